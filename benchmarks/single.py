"""One process: torch.save, torch.distributed.checkpoint and pytreeckpt on the same state, with the limits.

Every save counts as done when its data is durable: pytreeckpt (it fsyncs each chunk
file as it writes it, the rest before the commit) and DCP (``sync_files=True``, its
default) fsync by themselves; torch.save and the raw write are followed by an fsync of
what they wrote, inside the timing. Loads are timed from a cold page cache (dropped before each run) and
warm (right after another read of the same files). The tools and the physical limits
take turns in every round, as in the distributed benchmark.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

import pytreeckpt
from pytreeckpt import Abstract, Mesh, Shard, ShardingSpec

from ._common import (
    alternating,
    alternating_loads,
    drop_caches,
    fresh,
    fsync_tree,
    make_state,
    memcpy_into_preallocated,
    nbytes_of,
    raw_read,
    raw_write,
    save_load_targets,
)


def _saves(state: dict[str, torch.Tensor], paths: tuple[Path, ...], repeat: int) -> dict[str, float]:
    """Seconds of the saves, asynchronous saves and the limits they are held against, taking turns."""
    raw, tpath, dpath, ppath = paths
    s: dict[str, float] = {}

    def torch_save() -> None:
        torch.save(state, tpath)
        fsync_tree(tpath)

    memcpy = memcpy_into_preallocated(state)
    s.update(
        alternating(
            {
                "memcpy": (memcpy, None),
                "raw write+fsync": (lambda: raw_write(state, raw), fresh(raw)),
                "torch.save": (torch_save, fresh(tpath)),
                "dcp.save": (lambda: dcp.save(state, checkpoint_id=dpath), fresh(dpath)),
                "pytreeckpt.save": (lambda: pytreeckpt.save(ppath, state), fresh(ppath)),
            },
            repeat,
        )
    )
    stalls: dict[str, list[float]] = {"dcp": [], "ptc": [], "lazy": []}

    def dcp_async() -> None:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=dpath)
        stalls["dcp"].append(time.perf_counter() - t0)
        fut.result()

    def ptc_async(snapshot: str = "eager", into: list[float] = stalls["ptc"]) -> None:
        t0 = time.perf_counter()
        h = pytreeckpt.async_save(ppath, state, snapshot=snapshot)
        into.append(time.perf_counter() - t0)
        h.wait()

    del memcpy  # its destination is as large as the state: not kept beside the staging memory of both tools
    fresh(ppath)()
    ptc_async(into=[])  # the first save maps the staging pool's pages; later ones reuse them
    s.update(
        alternating(
            {
                "dcp.async_save total": (dcp_async, fresh(dpath)),
                "pytreeckpt.async_save total": (ptc_async, fresh(ppath)),
                "pytreeckpt.async_save lazy total": (lambda: ptc_async("lazy", stalls["lazy"]), fresh(ppath)),
            },
            repeat,
        )
    )
    s["dcp.async_save stall"] = statistics.median(stalls["dcp"])
    s["pytreeckpt.async_save stall"] = statistics.median(stalls["ptc"])
    s["pytreeckpt.async_save lazy stall"] = statistics.median(stalls["lazy"])
    return s


def run(size: int, leaves: int, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    """Seconds of every operation on a state of ``size`` bytes in ``leaves`` leaves.

    The tools take turns in every round (saves with the bare memcpy and the raw write,
    then asynchronous saves, then loads with the raw read), each writing to its own
    place, so every checkpoint exists side by side when the loads begin.
    """
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = make_state(size, leaves)
    paths = workdir / "raw", workdir / "torch.pt", workdir / "dcp", workdir / "ptc"
    s = _saves(state, paths, repeat)
    # The loads need room beside four checkpoints in the page cache: the state and the
    # staging pool go (a version keeping them peaked at 17.7 GB of 24 at 4 GiB).
    nbytes = nbytes_of(state)
    shapes = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
    del state  # with it goes the staged copy DCP keeps as long as the state lives
    gc.collect()
    pytreeckpt.execute._staging.staging_pool().free()
    raw, tpath, dpath, ppath = paths

    def dcp_load() -> None:
        target = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in shapes.items()}
        dcp.load(target, checkpoint_id=dpath)

    spec = ShardingSpec(Mesh(4), [Shard(1)])
    resharded = {k: Abstract(v.shape, v.dtype, spec) for k, v in shapes.items()}
    s.update(
        alternating_loads(
            {
                "raw read": lambda: raw_read(shapes, raw),
                "torch.load": lambda: torch.load(tpath, weights_only=True),
                "dcp.load": dcp_load,
                "pytreeckpt.load": lambda: pytreeckpt.load(ppath),
                "pytreeckpt.load resharded": lambda: pytreeckpt.load(ppath, resharded),
            },
            repeat,
            cold,
            drop_caches,
        )
    )
    for path in paths:
        fresh(path)()
    return {"bytes": nbytes, "leaves": leaves, "seconds": s}


def targets(r: dict[str, Any], cold: bool) -> list[tuple[str, float, str, float]]:
    """(target, measured ratio, comparison, bound) rows for this run."""
    s = r["seconds"]
    lazy = s["pytreeckpt.async_save lazy stall"] / s["pytreeckpt.async_save stall"]
    return [*save_load_targets(s, cold, "resharded load / load"), ("lazy stall / eager stall", lazy, "<", 0.05)]
