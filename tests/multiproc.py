"""Run a function in several real processes joined by a gloo process group.

Workers are module-level functions (the processes import them by name); each
returns a picklable result or raises. ``run_world`` returns the results by rank, or
raises with every failed rank's traceback. The processes fork from a server that
imported torch and pytreeckpt once, instead of importing them anew for every rank.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple[Any, ...], out: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        try:
            result = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        out.put((rank, True, _portable(result)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))


def _portable(x: Any) -> Any:
    """Tensors as numpy arrays: torch's queue pickling shares memory that dies with the child."""
    import torch

    if isinstance(x, torch.Tensor):
        return ("__tensor__", x.detach().cpu().clone().numpy())
    if isinstance(x, dict):
        return {k: _portable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_portable(v) for v in x)
    return x


def _restore(x: Any) -> Any:
    import torch

    if isinstance(x, tuple) and len(x) == 2 and x[0] == "__tensor__":
        return torch.from_numpy(x[1])
    if isinstance(x, dict):
        return {k: _restore(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_restore(v) for v in x)
    return x


def run_world(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; the results by rank."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pytreeckpt"])
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, args, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for _ in range(world):
            try:
                rank, ok, value = out.get(timeout=timeout)
            except queue.Empty:
                break
            (results if ok else failures)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if failures or len(results) != world:
        missing = sorted(set(range(world)) - set(results) - set(failures))
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise AssertionError(f"ranks failed: {sorted(failures)}; no answer from {missing}\n{detail}")
    return [_restore(results[r]) for r in range(world)]
