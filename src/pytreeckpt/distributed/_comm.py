"""The ``Comm`` protocol and its torch.distributed implementation, :class:`DistComm`.

``Comm`` is what a save or load needs of its ranks (gather to rank 0, broadcast,
agreement on success or failure); :class:`DistComm` implements it on the checkpoint's
own gloo groups (``_groups``), and also moves merge fragments to their chunk's writer
and forwards replicated reads to the other ranks that want them, point to point.
:func:`distributed_comm` gives a save or load its ``Comm``, or None in a single process.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch
import torch.distributed as dist

from pytreeckpt.core._errors import (
    CheckpointError,
    CheckpointTimeoutError,
    LayoutError,
    MetadataError,
    NotCommittedError,
    TargetMismatchError,
)
from pytreeckpt.core._region import Region
from pytreeckpt.core._timeout import current_timeout
from pytreeckpt.distributed import _meet
from pytreeckpt.distributed._groups import checkpoint_group, group_ranks
from pytreeckpt.distributed._meet import meetings_of, ranks_text
from pytreeckpt.execute._executor import PieceData, WriteItem
from pytreeckpt.execute._monitor import Monitor, Span
from pytreeckpt.plan import ArrayLoadPlan, ArraySavePlan, ReadOp

__all__ = [
    "Comm",
    "DistComm",
    "WriteTransfers",
    "comm_monitor",
    "data_comm",
    "describe_failure",
    "distributed_comm",
    "failure",
    "wait_work",
]

_T = TypeVar("_T")

# The deadline of a meeting of a call one of whose waits timed out already: it is given up at once (every rank
# there raises), instead of each failure costing the ranks that came another whole timeout.
_GIVE_UP_AT_ONCE = 0.001


def wait_work(work: Any, timeout: float, what: str, peer: int) -> None:
    """Wait for a gloo point-to-point ``work`` with rank ``peer``, at most ``timeout`` seconds.

    Raises:
      CheckpointTimeoutError: it did not complete in time.
      CheckpointError: the transfer failed (the peer's connection closed: it died).
    """
    try:
        work.wait(timedelta(seconds=timeout))
    except RuntimeError as e:
        if "Timed out" in str(e) or "timed out" in str(e):
            raise CheckpointTimeoutError(
                f"{what}: timed out after {timeout:g} s (rank {peer} is stopped, dead or slower than the timeout): "
                f"{e}; the checkpoint group's transfers cannot be trusted any more: end the job and restart it "
                f"from the last committed checkpoint",
                phase=what,
                ranks=(peer,),
                timeout=timeout,
            ) from e
        raise CheckpointError(f"{what}: failed: {e}") from e


@runtime_checkable
class Comm(Protocol):
    """What a save or load needs of its ranks: the object collectives of planning and agreement.

    :class:`DistComm` is the torch.distributed one. Another (``pytreeckpt.testing.SimComm``,
    one rank of a simulated world) may be passed as ``process_group`` to
    ``pytreeckpt.plan_save`` and ``pytreeckpt.plan_load``, which need nothing else.
    """

    rank: int
    world: int

    def gather(self, obj: Any, what: str = "") -> list[Any]: ...

    def broadcast(self, obj: Any, src: int = 0, what: str = "", meet: bool = True) -> Any: ...

    def agree(self, error: BaseException | None, what: str) -> None: ...


def data_comm(comm: Comm, what: str) -> DistComm:
    """``comm`` as the torch.distributed communicator that moves data and maps meshes to ranks.

    Another :class:`Comm` (a simulated world) plans only the leaves every rank describes
    by a spec (``ShardedLeaf``, ``Abstract``), and moves no data.

    Raises:
      CheckpointError: ``comm`` is not a :class:`DistComm`.
    """
    if not isinstance(comm, DistComm):
        raise CheckpointError(
            f"{what} needs a torch.distributed process group; {type(comm).__name__} only plans leaves described "
            f"by a spec (ShardedLeaf, Abstract) and moves no data"
        )
    return comm


def distributed_comm(group: Any = None, timeout: float | None = None, op: str = "save") -> Comm | None:
    """The DistComm of a save or load, or None when it runs as a single process.

    ``op`` names the call in the spans of its waits (``"save"``, ``"load"``); ``"manager"``, a manager's
    own collectives, run on groups of their own (``checkpoint_group``'s ``purpose``).

    A save or load is distributed when torch.distributed is initialised (at any world
    size) or ``group`` is given; its ranks are those of ``group``, else of the default
    group. With one rank there is nobody to talk to: no gloo group is made, no
    collective is issued, and the call runs as a single process does, DTensors on a mesh
    of this one rank included.

    Raises:
      CheckpointError: this process is not a member of ``group``.
    """
    if isinstance(group, Comm):
        return group
    if group is None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
    elif len(group_ranks(group)) == 1:
        return None
    comm = DistComm(checkpoint_group(group, "manager" if op == "manager" else ""), timeout)
    comm.op = op
    return comm


def comm_monitor(comm: Comm | None) -> Monitor:
    """The monitor of a call: its DistComm's, which has recorded the call's waits on other ranks from the
    first, or a new one."""
    if isinstance(comm, DistComm) and comm.monitor is not None:
        return comm.monitor
    return Monitor()


def _as_bytes(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class DistComm:
    """One rank's view of the checkpoint process group."""

    def __init__(self, groups: tuple[Any, Any], timeout: float | None = None) -> None:
        self.group, self.p2p = groups
        self._timeout = timeout  # None: the call's (core._timeout.current_timeout), at each wait
        self.phase = "the first collective"  # the last meeting's (names an unnamed collective after it)
        self.monitor: Monitor | None = Monitor()  # where each meeting's wait is recorded (None: nowhere)
        self.op = "save"  # the Span.op of those records
        # a wait of this comm that timed out: its next meetings are given up at once, not waited for again
        self.failed: CheckpointTimeoutError | None = None
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        # global ranks of a mesh -> its ranks in the group (None: the same; a range: consecutive)
        self.mesh_ranks: dict[tuple[int, ...], range | tuple[int, ...] | None] = {}
        # (id of a DeviceMesh,) or (its id, placements) -> (the mesh, what it gives): see dtensor_layout
        self.dtensor_layouts: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.in_group = {int(g): r for r, g in enumerate(dist.get_process_group_ranks(self.group))}  # global -> rank
        self.members = frozenset(self.in_group)  # global ranks

    def global_rank(self, rank: int) -> int:
        return int(dist.get_global_rank(self.group, rank))

    @property
    def timeout(self) -> float:
        """Seconds each wait of this comm may last (its own, else the running call's)."""
        return current_timeout() if self._timeout is None else self._timeout

    def meet(self, phase: str) -> None:
        """Wait for every rank of the group to come to ``phase``, within :attr:`timeout` (``_meet``).

        Raises:
          CheckpointTimeoutError: a rank did not come (every rank that came raises it alike).
        """
        if not _meet.ENABLED:
            return
        timeout = self.timeout if self.failed is None else _GIVE_UP_AT_ONCE
        try:
            waited = meetings_of(self.group).meet(phase, timeout)
        except CheckpointTimeoutError as e:
            self.failed = self.failed or e
            raise
        self.phase = phase
        if self.monitor is not None:
            thread = threading.current_thread().name
            span = Span(self.op, f"wait: {phase}", self.rank, waited.start, waited.end, 0, thread, waited.last)
            self.monitor.add(span)

    def _collective(self, what: str, fn: Callable[[], _T], meet: bool = True) -> _T:
        """``fn()``, a collective of the group, once every rank has come to ``what`` (unnamed: "after" the last).

        ``meet=False``: the ranks come straight from a collective with nothing between (the second half
        of a pair): they are all there; it runs at once, bounded by the gloo group's timeout
        (``_groups``: the default timeout when the group was made).
        """
        phase = what or f"after {self.phase}"
        if meet:
            self.meet(phase)
        try:
            return fn()
        except RuntimeError as e:  # gloo's: a rank died or left during it (they all came to it)
            raise CheckpointError(f"{phase}: a collective of the checkpoint group failed: {e}") from e

    def gather(self, obj: Any, what: str = "") -> list[Any]:
        """Every rank's ``obj`` on rank 0 (other ranks get an empty list)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._collective(what, lambda: dist.gather_object(obj, out, dst=self.global_rank(0), group=self.group))
        return out if out is not None else []

    def broadcast(self, obj: Any, src: int = 0, what: str = "", meet: bool = True) -> Any:
        box = [obj]
        self._collective(
            what, lambda: dist.broadcast_object_list(box, src=self.global_rank(src), group=self.group), meet
        )
        return box[0]

    def max_of(self, values: Sequence[int], what: str, meet: bool = True) -> list[int]:
        """Each position's maximum over the ranks (one all-reduce)."""
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        self._collective(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group), meet)
        return [int(v) for v in t.tolist()]

    def wait_for(self, work: Any, peer: int, what: str) -> None:
        """Wait for a point-to-point transfer with rank ``peer`` (of the group), within :attr:`timeout`.

        Raises:
          CheckpointTimeoutError: it did not complete in time (the group's transfers are then broken:
            gloo closes a pair that timed out).
        """
        try:
            wait_work(work, self.timeout, what, peer)
        except CheckpointTimeoutError as e:
            self.failed = self.failed or e
            raise

    def all_same(self, value: bytes | None, what: str = "") -> bool:
        """Whether every rank holds rank 0's ``value`` (None, a rank that has none, differs from every value).

        Two tensor collectives, whatever the world: rank 0's 32-byte digest of its value broadcast, then
        an all-reduce of "differs", so every rank returns the same answer. At 4 gloo ranks on one machine
        they took 1.35 ms against 7.15 ms for the object gather and broadcast of a 16-byte digest
        (:func:`~pytreeckpt.distributed._agree.agree_on_specs`'s, medians of 50).
        """
        mine = torch.zeros(33, dtype=torch.uint8)  # (a flag "has a value", then its digest)
        if value is not None:
            mine[0] = 1
            mine[1:] = torch.frombuffer(bytearray(hashlib.blake2b(value, digest_size=32).digest()), dtype=torch.uint8)
        ref = mine.clone()
        self._collective(what, lambda: dist.broadcast(ref, src=self.global_rank(0), group=self.group))
        return not self._anywhere(value is None or not torch.equal(ref, mine), what or self.phase, meet=False)

    def _anywhere(self, flag: bool, what: str, meet: bool = True) -> bool:
        """Whether ``flag`` is true on any rank (one all-reduce; every rank gets the same answer)."""
        return bool(self.max_of([flag], what, meet)[0])

    def agree(self, error: BaseException | None, what: str) -> None:
        """Every rank raises the same error if any rank failed; the message names the failed ranks.

        The error is of the failed ranks' CheckpointError subclass when they share one;
        on a rank that failed it is chained to that rank's own error.
        """
        # One all-reduce when every rank succeeded (1.0 ms at 4 ranks on one machine, against 7.6 ms for the
        # gather and broadcast below, torch's object collectives); every rank sees the same flag, so where a
        # rank failed all go on to those together.
        if not self._anywhere(error is not None, what):
            return
        gathered = self.gather(describe_failure(error), f"{what} (what failed)")  # on rank 0; its verdict to all
        failed = self.broadcast([(r, e) for r, e in enumerate(gathered) if e is not None] if self.rank == 0 else None)
        if failed:
            raise failure(what, failed, self.world) from error

    # ------------------------------------------------------------------ save
    def post_write_transfers(
        self,
        plans: Sequence[ArraySavePlan],
        data: Sequence[PieceData],
        dtypes: Sequence[np.dtype],
        direct: bool = True,
    ) -> WriteTransfers:
        """Post every send and receive of merge fragments at once, before any write.

        With ``direct=False`` the transfers yield only the merged writes (the direct
        ones come from the staging pipeline).

        Fragments of a merged chunk held by other ranks travel point to point to the
        chunk's writer, overlapping the direct writes. Every posted receive is always
        matched: a rank that cannot read a fragment of its own still sends that many
        bytes (and reports its error), so no rank waits forever and no stale receive
        is left on the group.
        """
        me = self.rank
        t = WriteTransfers(self)
        tags = _PairTags()
        for i, plan in enumerate(plans):
            for op in plan.writes:
                if op.is_direct:
                    continue
                buf = np.empty(op.region.shape, dtype=dtypes[i]) if op.writer == me else None
                pending: list[tuple[Any, torch.Tensor, Region, int]] = []
                for frag in op.sources:
                    tag = tags.next(frag.rank, op.writer)
                    if frag.rank == me:
                        try:
                            src, where = data[i](me, frag.piece)
                            part = src[frag.region.relative_to(where).slices()]
                        except Exception as e:
                            t.error = t.error or e
                            part = np.zeros(frag.region.shape, dtype=dtypes[i])
                        if buf is not None:
                            buf[frag.region.relative_to(op.region).slices()] = part
                        else:
                            payload = _as_bytes(part)
                            work = dist.isend(payload, dst=self.global_rank(op.writer), group=self.p2p, tag=tag)
                            t.sends.append((work, payload, op.writer))
                    elif buf is not None:
                        tmp = torch.empty(frag.region.size * dtypes[i].itemsize, dtype=torch.uint8)
                        work = dist.irecv(tmp, src=self.global_rank(frag.rank), group=self.p2p, tag=tag)
                        pending.append((work, tmp, frag.region.relative_to(op.region), frag.rank))
                if buf is not None:
                    t.merged.append((i, op.region, buf, pending))
        for i, plan in enumerate(plans):
            for op in plan.writes:
                if direct and op.is_direct and op.writer == me:
                    t.direct.append((i, op, data[i]))
        return t

    # ------------------------------------------------------------------ load
    def read_forwarding(
        self, plans: Sequence[ArrayLoadPlan], dest: Sequence[PieceData], dtypes: Sequence[np.dtype]
    ) -> tuple[Callable[[int, ReadOp, np.ndarray], None], Callable[[], None]]:
        """Receives for regions other ranks read for this one, and sends for those it reads for others.

        Returns ``(after, finish)``: ``after`` is called by the executor when a region this
        rank read is in memory, and sends it on; ``finish`` sends whatever was not sent
        (after a failed read: the receivers must not wait forever; every rank learns of
        the failure and discards the data), waits for every transfer, and copies received
        regions into place.
        """
        me = self.rank
        tags: dict[tuple[int, int, int], int] = {}
        recvs: list[tuple[Any, torch.Tensor, list[np.ndarray], int]] = []
        pairs = _PairTags()
        for i, plan in enumerate(plans):
            for j, op in enumerate(plan.reads):
                for rank in sorted({t.rank for t in op.targets} - {op.reader}):
                    tag = tags[(i, j, rank)] = pairs.next(op.reader, rank)
                    if rank == me:
                        outs = []
                        for t in op.targets:
                            if t.rank == me:
                                view, where = dest[i](me, t.piece)
                                outs.append(view[t.region.relative_to(where).slices()])
                        tmp = torch.empty(op.region.size * dtypes[i].itemsize, dtype=torch.uint8)
                        work = dist.irecv(tmp, src=self.global_rank(op.reader), group=self.p2p, tag=tag)
                        recvs.append((work, tmp, outs, op.reader))
        index = {(i, id(op)): j for i, plan in enumerate(plans) for j, op in enumerate(plan.reads)}
        sends: list[tuple[Any, torch.Tensor, int]] = []
        sent: set[tuple[int, int]] = set()
        what = "reading the checkpoint (a region read for another rank)"

        def send(i: int, j: int, op: ReadOp, data: np.ndarray) -> None:
            sent.add((i, j))
            payload: torch.Tensor | None = None
            for rank in sorted({t.rank for t in op.targets} - {me}):
                payload = _as_bytes(data) if payload is None else payload
                work = dist.isend(payload, dst=self.global_rank(rank), group=self.p2p, tag=tags[(i, j, rank)])
                sends.append((work, payload, rank))

        def after(i: int, op: ReadOp, data: np.ndarray) -> None:
            send(i, index[(i, id(op))], op, data)

        def finish() -> None:
            for i, plan in enumerate(plans):
                for j, op in enumerate(plan.reads):
                    if op.reader == me and (i, j) not in sent and any(t.rank != me for t in op.targets):
                        send(i, j, op, np.zeros(op.region.shape, dtype=dtypes[i]))
            for work, tmp, outs, peer in recvs:
                self.wait_for(work, peer, what)
                for o in outs:
                    o[...] = tmp.numpy().view(o.dtype).reshape(o.shape)
            for work, _payload, peer in sends:
                self.wait_for(work, peer, what)

        return after, finish


# Point-to-point tags start high: gloo's collectives number their own messages from 0
# on a group, and a send with a small tag can be taken for one of them.
_TAG_BASE = 1 << 20


class _PairTags:
    """Tags of point-to-point messages, numbered per (sender, receiver) pair in plan order.

    Each rank plans only its own part, so the two ends of a message number it alike only
    by counting the messages between them: both see those in the same order (arrays in
    order, each array's operations in the order of the whole plan).
    """

    def __init__(self) -> None:
        self._count: dict[tuple[int, int], int] = {}

    def next(self, sender: int, receiver: int) -> int:
        n = self._count.get((sender, receiver), 0) + 1
        self._count[(sender, receiver)] = n
        return _TAG_BASE + n


_MERGE = "writing the checkpoint (a merged chunk's fragment)"


class WriteTransfers:
    """The merge-fragment transfers of one rank's save, posted up front; each waited for as long as ``comm`` says."""

    def __init__(self, comm: DistComm) -> None:
        self.comm = comm
        self.sends: list[tuple[Any, torch.Tensor, int]] = []
        self.merged: list[tuple[int, Region, np.ndarray, list[tuple[Any, torch.Tensor, Region, int]]]] = []
        self.direct: list[tuple[int, Any, PieceData]] = []
        self.error: BaseException | None = None
        self.received = 0

    def items(self) -> Iterator[WriteItem]:
        """This rank's writes: direct ones at once, merged ones as their fragments arrive."""
        if self.error is not None:
            raise self.error
        for i, op, get in self.direct:
            src, where = get(op.writer, op.sources[0].piece)
            yield i, op.region, src[op.region.relative_to(where).slices()], None
        for i, region, buf, pending in self.merged:
            while pending:
                work, tmp, rel, peer = pending.pop(0)  # a gloo work is waited on once only
                self.comm.wait_for(work, peer, _MERGE)
                buf[rel.slices()] = tmp.numpy().view(buf.dtype).reshape(rel.shape)
                self.received += tmp.numel()
            yield i, region, buf, None

    def received_bytes(self) -> int:
        """Bytes of merge fragments received from other ranks so far, and still pending."""
        return self.received + sum(p[1].numel() for _, _, _, pending in self.merged for p in pending)

    def wait_all(self) -> None:
        """Complete every posted transfer not yet completed, whatever happened to the writes."""
        for _, _, _, pending in self.merged:
            while pending:
                work, _, _, peer = pending.pop(0)
                self.comm.wait_for(work, peer, _MERGE)
        while self.sends:
            work, _, peer = self.sends.pop(0)
            self.comm.wait_for(work, peer, _MERGE)


_ERRORS: dict[str, type[CheckpointError]] = {
    c.__name__: c
    for c in (
        CheckpointError,
        NotCommittedError,
        MetadataError,
        TargetMismatchError,
        LayoutError,
        CheckpointTimeoutError,
    )
}


def describe_failure(error: BaseException | None) -> tuple[str, str] | None:
    """What a rank tells the others of its error: the type's name and the message."""
    return None if error is None else (type(error).__name__, str(error))


def failure(what: str, failed: Sequence[tuple[int, tuple[str, str]]], world: int) -> CheckpointError:
    """The one error every rank raises when ``failed`` ranks (rank, (type name, message)) failed at ``what``.

    >>> str(failure("writing", [(1, ("OSError", "disk full")), (3, ("OSError", "disk full"))], 4))
    'writing failed on 2 of 4 ranks: ranks 1, 3: OSError: disk full'
    """
    by_error: dict[tuple[str, str], list[int]] = {}
    for rank, (kind, message) in failed:
        by_error.setdefault((kind, message), []).append(rank)
    detail = "; ".join(f"{ranks_text(ranks)}: {kind}: {message}" for (kind, message), ranks in by_error.items())
    kinds = {kind for kind, _ in by_error}
    cls = _ERRORS.get(kinds.pop(), CheckpointError) if len(kinds) == 1 else CheckpointError
    return cls(f"{what} failed on {len(failed)} of {world} ranks: {detail}")
