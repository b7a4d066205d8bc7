"""Several gloo ranks: a sharded model-like state saved and loaded by each tool, then resharded at fewer ranks.

Each rank holds its shard of every matrix (DTensor ``Shard(0)``) and a copy of small
replicated tensors. Every timing is taken between barriers, so it is the slowest rank's.
Every tool, and each physical limit, takes its turn in every round of the saves and of
the loads (the memcpy in the rounds of asynchronous saves), in a new order each round,
so none is favoured by what ran before it, by what the virtual disk has cached, or by a
drift of the machine's speed.
The resharded load reads the checkpoints written at ``ranks`` ranks at ``ranks // 2``
ranks with ``Shard(1)`` placements.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pytreeckpt

from ._common import (
    alternating,
    alternating_loads,
    drop_caches,
    free_port,
    fsync_tree,
    gloo_rank,
    raw_read,
    raw_write,
    remove,
    save_load_targets,
)


def _shapes(total: int, leaves: int) -> list[tuple[str, tuple[int, int], torch.dtype]]:
    out = []
    for i in range(leaves):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        cols = 4096
        rows = total // leaves // (cols * (4 if dtype == torch.float32 else 2))
        out.append((f"layers.{i}.weight", (rows, cols), dtype))
    return out


def _state(rank: int, world: int, total: int, leaves: int, mesh: Any, placements: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(rank)
    state: dict[str, Any] = {}
    for key, (rows, cols), dtype in _shapes(total, leaves):
        if placements is None:  # this rank's Shard(0) rows, made locally
            per = rows // world
            local = torch.randn(per, cols, generator=g).to(dtype)
            state[key] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=(rows, cols), stride=(cols, 1)
            )
        else:  # a load target: Shard(placements), fresh memory
            spec = pytreeckpt.ShardingSpec(pytreeckpt.Mesh(world), [pytreeckpt.Shard(placements)])
            shape = spec.local_shape(rank, (rows, cols))
            state[key] = DTensor.from_local(
                torch.empty(shape, dtype=dtype),
                mesh,
                [Shard(placements)],
                run_check=False,
                shape=(rows, cols),
                stride=(cols, 1),
            )
    g = torch.Generator().manual_seed(1234)  # the same on every rank: replicated
    for i in range(32):
        norm = torch.randn(16 * 1024, generator=g)
        state[f"norms.{i}"] = norm if placements is None else torch.empty_like(norm)
    return state


def _timed(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _drop(rank: int) -> Callable[[], None]:
    def setup() -> None:
        dist.barrier()
        if rank == 0:
            drop_caches()
        dist.barrier()

    return setup


def _rm(rank: int, path: Path, own: bool = False) -> Callable[[], None]:
    """A setup removing ``path`` (by rank 0; by every rank when each has its ``own``), then ``sync``:
    no save starts with the writeback of an earlier one still in flight."""

    def setup() -> None:
        dist.barrier()
        if own or rank == 0:
            remove(path)
        dist.barrier()
        if rank == 0:
            os.sync()
        dist.barrier()

    return setup


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    with gloo_rank(rank, world, port) as mesh:
        work = Path(args["workdir"])
        repeat, cold = args["repeat"], args["cold"]
        s: dict[str, float] = {}
        import torch.distributed.checkpoint as dcp

        dpath, ppath = work / "dcp", work / "ptc"
        if args["phase"] == "save":
            state = _state(rank, world, args["bytes"], args["leaves"], mesh, None)
            local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items()}
            dst = {k: torch.empty_like(v).zero_() for k, v in local.items()}

            def memcpy() -> None:
                for k, v in local.items():
                    dst[k].copy_(v)

            raw = work / f"raw{rank}"
            tpath = work / f"torch{rank}.pt"

            def torch_save() -> None:
                torch.save(local, tpath)
                fsync_tree(tpath)

            # One untimed save per tool first: the first call pays one-time costs (pytreeckpt makes its
            # checkpoint process groups, DCP its planner caches), which the timed runs should not count.
            _rm(rank, dpath)()
            dcp.save(state, checkpoint_id=dpath)
            _rm(rank, ppath)()
            pytreeckpt.save(ppath, state)
            s.update(
                alternating(
                    {
                        "raw write+fsync": (lambda: raw_write(local, raw), _rm(rank, raw, own=True)),
                        "torch.save": (torch_save, _rm(rank, tpath, own=True)),
                        "dcp.save": (lambda: dcp.save(state, checkpoint_id=dpath), _rm(rank, dpath)),
                        "pytreeckpt.save": (lambda: pytreeckpt.save(ppath, state), _rm(rank, ppath)),
                    },
                    repeat,
                    _timed,
                )
            )
            dcp_stalls: list[float] = []
            ptc_stalls: list[float] = []
            # DCP's background save runs collectives: on a group of its own, as DCP's recipe does, or
            # they interleave with the benchmark's barriers on the default group and hang it (seen).
            dcp_group = dist.new_group(backend="gloo")

            def dcp_async() -> None:
                t0 = time.perf_counter()
                fut = dcp.async_save(state, checkpoint_id=dpath, process_group=dcp_group)
                dcp_stalls.append(_slowest(time.perf_counter() - t0))
                fut.result()

            def ptc_async() -> None:
                t0 = time.perf_counter()
                h = pytreeckpt.async_save(ppath, state)
                ptc_stalls.append(_slowest(time.perf_counter() - t0))
                h.wait()

            _rm(rank, ppath)()
            ptc_async()  # maps the staging pool's pages once
            ptc_stalls.clear()
            s.update(
                alternating(
                    {
                        "memcpy": (memcpy, None),
                        "dcp.async_save total": (dcp_async, _rm(rank, dpath)),
                        "pytreeckpt.async_save total": (ptc_async, _rm(rank, ppath)),
                    },
                    repeat,
                    _timed,
                )
            )
            s["dcp.async_save stall"] = statistics.median(dcp_stalls)
            s["pytreeckpt.async_save stall"] = statistics.median(ptc_stalls)

            def dcp_load() -> None:
                target = _state(rank, world, args["bytes"], args["leaves"], mesh, 0)
                dcp.load(target, checkpoint_id=dpath)

            def ptc_load() -> None:
                target = _state(rank, world, args["bytes"], args["leaves"], mesh, 0)
                pytreeckpt.load(ppath, target)

            loads = {
                "raw read": lambda: raw_read(local, raw),
                "torch.load": lambda: torch.load(tpath, weights_only=True),
                "dcp.load": dcp_load,
                "pytreeckpt.load": ptc_load,
            }
            s.update(alternating_loads(loads, repeat, cold, _drop(rank), _timed))
            shutil.rmtree(raw, ignore_errors=True)
            tpath.unlink()
        else:  # resharded: fewer ranks, Shard(1)

            def dcp_reshard() -> None:
                target = _state(rank, world, args["bytes"], args["leaves"], mesh, 1)
                dcp.load(target, checkpoint_id=dpath)

            def ptc_reshard() -> None:
                target = _state(rank, world, args["bytes"], args["leaves"], mesh, 1)
                pytreeckpt.load(ppath, target)

            s.update(
                alternating_loads(
                    {"dcp.load resharded": dcp_reshard, "pytreeckpt.load resharded": ptc_reshard},
                    repeat,
                    cold,
                    _drop(rank),
                    _timed,
                )
            )
        if rank == 0:
            (work / f"result-{args['phase']}.json").write_text(json.dumps(s))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run(ranks: int, size: int, leaves: int, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    args = {"workdir": str(workdir), "repeat": repeat, "cold": cold, "bytes": size, "leaves": leaves}
    mp.spawn(_worker, args=(ranks, free_port(), {**args, "phase": "save"}), nprocs=ranks, join=True)
    seconds = json.loads((workdir / "result-save.json").read_text())
    fewer = max(1, ranks // 2)
    mp.spawn(_worker, args=(fewer, free_port(), {**args, "phase": "reshard"}), nprocs=fewer, join=True)
    seconds.update(json.loads((workdir / "result-reshard.json").read_text()))
    shutil.rmtree(workdir / "dcp", ignore_errors=True)
    shutil.rmtree(workdir / "ptc", ignore_errors=True)
    state = sum(rows * cols * dt.itemsize for _, (rows, cols), dt in _shapes(size, leaves)) + 32 * 16 * 1024 * 4
    return {"ranks": ranks, "reshard_ranks": fewer, "bytes": state, "seconds": seconds}


def targets(r: dict[str, Any], cold: bool) -> list[tuple[str, float, str, float]]:
    """(target, measured ratio, comparison, bound) rows for this run."""
    return save_load_targets(r["seconds"], cold, "resharded load / same-layout load")
