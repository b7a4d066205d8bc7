"""One process: torch.save, torch.distributed.checkpoint and pytreeckpt on the same state, with the limits.

Every save counts as done when its data is durable: pytreeckpt (TensorStore syncs each
file it writes, then the commit) and DCP (``sync_files=True``, its default) fsync by
themselves; torch.save and the raw write are followed by an fsync of what they wrote,
inside the timing. Loads are timed from a cold page cache (dropped before each run) and
warm (right after another read of the same files).
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import pytreeckpt
from pytreeckpt import Abstract, Mesh, Shard, ShardingSpec

from ._common import (
    drop_caches,
    fresh,
    fsync_tree,
    make_state,
    memcpy_into_preallocated,
    nbytes_of,
    raw_read,
    raw_write,
    save_load_targets,
    timed,
)


def _loads(name: str, fn: Any, repeat: int, cold: bool, out: dict[str, float]) -> None:
    if cold:
        out[f"{name} cold"] = timed(fn, repeat, lambda: drop_caches())
    fn()  # warm the cache
    out[f"{name} warm"] = timed(fn, repeat)


def run(size: int, leaves: int, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    """Seconds of every operation on a state of ``size`` bytes in ``leaves`` leaves."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = make_state(size, leaves)
    s: dict[str, float] = {}
    s["memcpy"] = timed(memcpy_into_preallocated(state), repeat)

    raw = workdir / "raw"
    s["raw write+fsync"] = timed(lambda: raw_write(state, raw), repeat, fresh(raw))
    _loads("raw read", lambda: raw_read(state, raw), repeat, cold, s)
    fresh(raw)()

    tpath = workdir / "torch.pt"

    def torch_save() -> None:
        torch.save(state, tpath)
        fsync_tree(tpath)

    s["torch.save"] = timed(torch_save, repeat, fresh(tpath))
    _loads("torch.load", lambda: torch.load(tpath, weights_only=True), repeat, cold, s)
    fresh(tpath)()

    import torch.distributed.checkpoint as dcp

    dpath = workdir / "dcp"
    s["dcp.save"] = timed(lambda: dcp.save(state, checkpoint_id=dpath), repeat, fresh(dpath))
    stalls: list[float] = []

    def dcp_async() -> None:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=dpath)
        stalls.append(time.perf_counter() - t0)
        fut.result()

    s["dcp.async_save total"] = timed(dcp_async, repeat, fresh(dpath))
    s["dcp.async_save stall"] = statistics.median(stalls)

    def dcp_load() -> None:
        target = {k: torch.empty_like(v) for k, v in state.items()}
        dcp.load(target, checkpoint_id=dpath)

    _loads("dcp.load", dcp_load, repeat, cold, s)
    fresh(dpath)()

    ppath = workdir / "ptc"
    s["pytreeckpt.save"] = timed(lambda: pytreeckpt.save(ppath, state), repeat, fresh(ppath))
    stalls = []

    def ptc_async() -> None:
        t0 = time.perf_counter()
        h = pytreeckpt.async_save(ppath, state)
        stalls.append(time.perf_counter() - t0)
        h.wait()

    fresh(ppath)()
    ptc_async()  # the first save maps the staging pool's pages; later ones reuse them
    fresh(ppath)()
    s["pytreeckpt.async_save total"] = timed(ptc_async, repeat, fresh(ppath))
    s["pytreeckpt.async_save stall"] = statistics.median(stalls[1:])
    stalls = []

    def ptc_lazy() -> None:
        t0 = time.perf_counter()
        h = pytreeckpt.async_save(ppath, state, snapshot="lazy")
        stalls.append(time.perf_counter() - t0)
        h.wait()

    s["pytreeckpt.async_save lazy total"] = timed(ptc_lazy, repeat, fresh(ppath))
    s["pytreeckpt.async_save lazy stall"] = statistics.median(stalls)
    _loads("pytreeckpt.load", lambda: pytreeckpt.load(ppath), repeat, cold, s)
    spec = ShardingSpec(Mesh(4), [Shard(1)])
    target = {k: Abstract(v.shape, v.dtype, spec) for k, v in state.items()}
    _loads("pytreeckpt.load resharded", lambda: pytreeckpt.load(ppath, target), repeat, cold, s)
    fresh(ppath)()
    pytreeckpt._staging.staging_pool().free()
    return {"bytes": nbytes_of(state), "leaves": leaves, "seconds": s}


def targets(r: dict[str, Any], cold: bool) -> list[tuple[str, float, str, float]]:
    """(target, measured ratio, comparison, bound) rows for this run."""
    s = r["seconds"]
    lazy = s["pytreeckpt.async_save lazy stall"] / s["pytreeckpt.async_save stall"]
    return [*save_load_targets(s, cold, "resharded load / load"), ("lazy stall / eager stall", lazy, "<", 0.05)]
