"""Rank workers of the stopped-rank tests (run by multiproc.run_world: ``fn(rank, world, *args)``).

One rank, the victim, sends itself a signal (SIGSTOP or SIGKILL) as it comes to a chosen
phase of a save, an asynchronous save, a load or a manager's restore: just before it would
meet the others there. The other ranks must raise CheckpointTimeoutError naming it, within
the call's timeout and a margin, and the previous checkpoint must stay as it was.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

import pytreeckpt
from pytreeckpt.distributed._comm import DistComm


def state(world: int, value: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tree whose tensor is sharded over the ranks (each writes its part), a replicated tensor and a value."""
    spec = pytreeckpt.ShardingSpec(pytreeckpt.Mesh(world), [pytreeckpt.Shard(0)])
    full = torch.full((world * 64, 256), value)
    tree = {"w": pytreeckpt.ShardedLeaf.from_global(full, spec), "b": torch.full((16,), value), "step": int(value)}
    return tree, {"w": spec, "b": None, "step": None}


def arm(victim: int, phase: str, sig: int) -> None:
    """Make rank ``victim`` send itself ``sig`` when it comes to the first meeting whose phase starts with ``phase``."""
    meet = DistComm.meet

    def stopping(self: DistComm, name: str) -> None:
        if self.rank == victim and name.startswith(phase):
            os.kill(os.getpid(), sig)
            time.sleep(60)  # (SIGKILL and SIGSTOP act at once; never reached)
        meet(self, name)

    DistComm.meet = stopping  # type: ignore[method-assign]


def stop_at(rank: int, world: int, root: str, op: str, phase: str, signame: str, victim: int, timeout: float) -> Any:
    """Save a first checkpoint, then run ``op`` with rank ``victim`` stopped at ``phase``; what this rank raised."""
    sig = getattr(signal, signame)
    first, spec = state(world, 1.0)
    second, _ = state(world, 2.0)
    path = Path(root) / "ckpt"
    if op == "restore":
        with pytreeckpt.CheckpointManager(Path(root) / "steps", async_=False) as manager:
            manager.save(1, first, spec)
    else:
        pytreeckpt.save(path, first, spec)
    arm(victim, phase, sig)
    start = time.monotonic()
    try:
        if op == "save":
            pytreeckpt.save(path, second, spec, overwrite=True, timeout=timeout)
        elif op == "async_save":
            pytreeckpt.async_save(path, second, spec, overwrite=True, timeout=timeout).wait()
        elif op == "load":
            pytreeckpt.load(path, second, timeout=timeout)
        elif op == "restore":
            pytreeckpt.CheckpointManager(Path(root) / "steps", async_=False, timeout=timeout).restore(target=second)
        else:
            raise ValueError(op)
    except pytreeckpt.CheckpointTimeoutError as e:
        return {"phase": e.phase, "ranks": list(e.ranks), "seconds": time.monotonic() - start, "message": str(e)}
    return {"phase": None, "seconds": time.monotonic() - start}
