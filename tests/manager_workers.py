"""Rank workers of the CheckpointManager tests (run by multiproc.run_world: ``fn(rank, world, *args)``)."""

from __future__ import annotations

import os
import signal
import time
import warnings
from typing import Any

import torch

import pytreeckpt


def rank_state(step: int, world: int) -> Any:
    """A state whose tensor is sharded over the ranks (a DTensor) and a plain value."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.full((1024 * world, 512), float(step)), mesh, [Shard(0)]), "step": step}


def save_steps(rank: int, world: int, directory: str, last: int) -> None:
    with pytreeckpt.CheckpointManager(directory, async_=False) as m:
        for step in range(1, last + 1):
            m.save(step, rank_state(step, world))


def restore_newest(rank: int, world: int, directory: str) -> dict[str, Any]:
    with pytreeckpt.CheckpointManager(directory) as m, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = m.restore(target=rank_state(0, world))
        return {
            "step": restored["step"],
            "w": float(restored["w"].full_tensor().mean()),
            "last_restored_step": m.last_restored_step,
            "warnings": [str(w.message) for w in caught if issubclass(w.category, pytreeckpt.CheckpointDamageWarning)],
        }


def preempted_loop(rank: int, world: int, directory: str, signalled_rank: int, signal_at: int) -> dict[str, Any]:
    """A training loop that calls save at every step; rank ``signalled_rank`` gets SIGTERM at step ``signal_at``."""
    seen: list[int] = []

    def noted(signum: int, frame: object) -> None:  # a handler installed before the manager's: it is chained to
        seen.append(signum)

    previous = signal.signal(signal.SIGTERM, noted)
    try:
        with pytreeckpt.CheckpointManager(directory, save_interval_steps=1000, save_on_signals=(signal.SIGTERM,)) as m:
            stopped = None
            for step in range(1, 200):
                w = torch.full((64,), float(step))
                if rank == signalled_rank and step == signal_at:
                    os.kill(os.getpid(), signal.SIGTERM)
                saved = m.save(step, {"w": w, "step": step})
                if m.reached_preemption(step):
                    stopped = step
                    break
                assert not saved, f"step {step} saved off the interval without a signal"
                time.sleep(0.01 if rank == signalled_rank else 0.0)  # the ranks out of step in time, not in steps
            steps = m.all_steps()
        restored = signal.getsignal(signal.SIGTERM) is noted
        return {"stopped": stopped, "steps": steps, "chained": seen, "handler_restored": restored}
    finally:
        signal.signal(signal.SIGTERM, previous)


def timed_saves(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank 0's clock moves 4 s a step; rank 1's is far ahead: rank 0's clock decides for both."""
    now = [0.0]

    def clock() -> float:
        return now[0] if rank == 0 else 1e12 + now[0] * 1000

    saved = []
    with pytreeckpt.CheckpointManager(
        directory, save_interval_steps=1000, save_interval_seconds=10, clock=clock, async_=False
    ) as m:
        for step in range(1, 13):
            now[0] += 4.0
            if m.save(step, {"w": torch.full((4,), float(step)), "step": step}):
                saved.append(step)
        return {"saved": saved, "steps": m.all_steps()}


def preempted_from_outside(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank 0 sends SIGTERM to rank 1's process at step 10, while rank 1 runs on: both must stop at one step."""
    import torch.distributed as dist

    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    with pytreeckpt.CheckpointManager(directory, save_interval_steps=1000, save_on_signals=(signal.SIGTERM,)) as m:
        stopped = None
        for step in range(1, 200):
            w = torch.full((64,), float(step))
            if rank == 0 and step == 10:
                os.kill(pids[1], signal.SIGTERM)
            time.sleep(0.002 * rank)
            m.save(step, {"w": w, "step": step})
            if m.reached_preemption(step):
                stopped = step
                break
        flag = m._triggers.flag
        return {"stopped": stopped, "steps": m.all_steps(), "signal": flag.signum if flag else None}
