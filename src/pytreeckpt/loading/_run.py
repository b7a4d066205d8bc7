"""A load's last stages: this rank's reads planned along the stored chunks, then read into the destinations.

The ranks agree on the target's layouts (:mod:`pytreeckpt.distributed`), the plan cuts
this rank's target along the stored chunks (:mod:`pytreeckpt.plan`), the executor reads
each chunk once into its destination (:mod:`pytreeckpt.execute`), and each result leaf is
made (its host-to-device copy started as soon as its array is read).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pytreeckpt.core._dtypes import DType
from pytreeckpt.distributed._agree import Carried, agree_on_specs, agree_with_spans, state_digest
from pytreeckpt.distributed._comm import Comm, data_comm
from pytreeckpt.execute._executor import read_arrays
from pytreeckpt.execute._memory import Prefault
from pytreeckpt.execute._monitor import Monitor, Progress, Span
from pytreeckpt.leaves import Matching, Objects, small_result, span
from pytreeckpt.plan import ArraySpec, LoadPlan, PlanCache, plan_load, spec_plan_key

from ._match import LoadRequest, match

__all__ = ["LOAD_PLANS", "load_once"]

LOAD_PLANS = PlanCache(4)  # the plans of the last few loads: a load into the layout of one of them reuses its plan


def load_once(request: LoadRequest, monitor: Monitor, seen: list[bytes] | None = None) -> Any:
    """One attempt at ``request``: the result tree (with ``plan_only``, this rank's LoadPlan)."""
    comm = request.comm
    me = 0 if comm is None else comm.rank
    t0 = time.time()
    # In a distributed load, what a rank does before a collective is carried into it: a
    # rank that raised alone would leave the others waiting for the collective's timeout.
    carried = Carried(comm)
    matched = match(request, carried, seen)
    dests = [] if matched is None else matched.matching.dests
    specs: list[ArraySpec] = []
    with carried.catch():
        specs = [d.spec() for _, d in dests]
    world = comm.world if comm is not None else max((span(d.layout, d.ranks) for _, d in dests), default=1)
    rank = None if comm is None else comm.rank
    chunks = [d.meta.chunk_shape for _, d in dests]
    plan = LoadPlan(world, ())
    base: tuple[Any, ...] | None = None
    if carried.error is None:
        # Planned before the ranks agree on the layouts (a plan of layouts they disagree on is dropped): a
        # failure here is carried into that agreement, the one collective between the document and the reads.
        with carried.catch():
            base = spec_plan_key(specs)
            plan = LOAD_PLANS.get_or(
                (*base, world, rank, tuple(chunks)), lambda: plan_load(chunks, specs, world, rank=rank)
            )
            if comm is None:
                plan = _held(plan, [d.pieces for _, d in dests])
    if comm is not None:
        names = [d.meta.dtype.name if d.cast is None else f"{d.meta.dtype.name}->{d.cast.name}" for _, d in dests]
        # (a target's objects are restored after an agreement of their own: every rank must hold them)
        objects = [] if matched is None or matched.objects is None else matched.objects.described()
        known = None if base is None else (base, state_digest(base, names, objects))
        agree_on_specs(comm, specs, names, "load", carried.error, objects, known)
    if request.plan_only:
        return plan
    assert matched is not None  # (else the agreement raised)
    storage, found = matched.storage, matched.matching
    results, small, buffers = found.results, found.small, found.buffers
    metas = [d.meta for _, d in dests]
    getters = [d.get for _, d in dests]
    to = [d.cast for _, d in dests]  # (the dtype each destination casts to, or None)
    casts: list[DType | None] | None = to if any(c is not None for c in to) else None
    thread = threading.current_thread().name
    monitor.add(Span("load", "plan", me, t0, time.time(), 0, thread))
    h2d_bytes, h2d_seconds = [0], [0.0]

    def finish(k: int) -> None:
        """Make array ``k``'s result leaf: for a device target, start its host-to-device copy."""
        i, d = dests[k]
        start = time.perf_counter()
        results[i] = d.finish()
        if d.device_bytes:
            h2d_bytes[0] += d.device_bytes
            h2d_seconds[0] += time.perf_counter() - start

    mine = sum(op.region.size * ap.itemsize for ap in plan.arrays for op in ap.reads if comm is None or op.reader == me)
    small_bytes = sum(m.nbytes for _, m, _ in small)
    mine += small_bytes
    progress = Progress.maybe(storage.options.progress and me == 0, "load", mine)
    error: BaseException | None = None  # (a distributed load's: every rank raises it together)
    try:
        if small:
            with monitor.phase("load", "read", me) as box:
                for (i, meta, leaf), value in zip(small, storage.read_small([m for _, m, _ in small]), strict=True):
                    results[i] = small_result(meta, value, leaf)
                box[0] = small_bytes
            progress.advance(small_bytes)
        if comm is None:
            # each array's host-to-device copy starts as soon as it is read, overlapping later reads
            with monitor.phase("load", "read", me) as box, Prefault(buffers.fresh):
                box[0] = read_arrays(
                    storage,
                    metas,
                    plan.arrays,
                    getters,
                    None,
                    array_done=finish,
                    progress=progress.advance,
                    casts=casts,
                )
        else:
            if matched.local is not None:  # this rank's own per-rank leaves, read by it alone
                try:
                    with monitor.phase("load", "read", me) as box:
                        box[0] = _read_local(storage, matched.local, progress.advance)
                except Exception as e:
                    error = e
            dtypes = [(d.meta.dtype if d.cast is None else d.cast).numpy for _, d in dests]  # (what is sent on)
            after, forward = data_comm(comm, "reading").read_forwarding(plan.arrays, getters, dtypes)
            try:
                with monitor.phase("load", "read", me) as box, Prefault(buffers.fresh):
                    box[0] = read_arrays(
                        storage,
                        metas,
                        plan.arrays,
                        getters,
                        comm.rank,
                        after=after,
                        progress=progress.advance,
                        casts=casts,
                    )
            except Exception as e:
                error = e
            finally:
                with monitor.phase("load", "transfer", me):
                    forward()  # every posted transfer completes, even after a failed read
            if error is None:
                try:  # (a failure here too must reach the agreement, or the others would wait for this rank)
                    for k in range(len(dests)):
                        finish(k)
                except Exception as e:
                    error = e
    finally:
        progress.close()
    if h2d_bytes[0]:
        end = time.time()
        monitor.add(Span("load", "h2d", me, end - h2d_seconds[0], end, h2d_bytes[0], thread))
    if comm is not None:  # (with every rank's spans, to rank 0's monitor)
        agree_with_spans(comm, error, "loading the checkpoint", monitor)
    if matched.objects is not None:
        return _restored(matched.objects, results, comm)
    return matched.structure.unflatten(results)


def _read_local(storage: Any, local: Matching, progress: Any) -> int:
    """Read the leaves ``local`` holds (this rank's alone) as a single process reads: planned for one rank."""
    results, dests = local.results, local.dests  # (no small array read without a plan: its small_whole is None)
    nbytes = 0
    if dests:
        specs = [d.spec() for _, d in dests]
        plan = plan_load([d.meta.chunk_shape for _, d in dests], specs, 1)

        def done(k: int) -> None:
            i, d = dests[k]
            results[i] = d.finish()

        metas, getters = [d.meta for _, d in dests], [d.get for _, d in dests]
        to = [d.cast for _, d in dests]
        casts = to if any(c is not None for c in to) else None
        nbytes += read_arrays(
            storage, metas, plan.arrays, getters, None, array_done=done, progress=progress, casts=casts
        )
    return nbytes


def _restored(objects: Objects, results: list[Any], comm: Comm | None) -> Any:
    """The result tree, each object of the target given its loaded state (in a distributed load, once every rank
    read its part; a rank whose object refused its state makes every rank raise)."""
    if comm is None:
        return objects.restore(results)
    error, tree = None, None
    try:
        tree = objects.restore(results)
    except Exception as e:
        error = e
    comm.agree(error, "restoring the target's objects")
    return tree


def _held(plan: LoadPlan, held: Sequence[Mapping[int, Any]]) -> LoadPlan:
    """``plan`` without the reads into ranks whose memory this process does not hold (a ShardedLeaf of some ranks)."""
    arrays = []
    for ap, ranks in zip(plan.arrays, held, strict=True):
        reads = ap.reads
        if any(t.rank not in ranks for op in reads for t in op.targets):
            kept = ((op, tuple(t for t in op.targets if t.rank in ranks)) for op in reads)
            reads = tuple(dataclasses.replace(op, targets=ts) for op, ts in kept if ts)
            ap = dataclasses.replace(ap, reads=reads)
        arrays.append(ap)
    return dataclasses.replace(plan, arrays=tuple(arrays))
