"""Rank workers of the CheckpointManager tests (run by multiproc.run_world: ``fn(rank, world, *args)``)."""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from helpers import HANG

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


class HeldWrites:
    """Holds the writes of asynchronous saves (``write_arrays`` on a save's writer thread) until :attr:`gate` is
    set: by the test, or by anyone waiting for a save (``SaveHandle.wait``, which also notes whether the save it
    waits for was still running). With ``after_commit``, the writer thread is held instead once the save has
    committed, before its handle says it is done."""

    def __init__(self, setattr: Callable[[Any, str, Any], None] = setattr, after_commit: bool = False) -> None:
        from pytreeckpt.saving import _handle, _job

        self.gate = threading.Event()
        self.waited_running: list[bool] = []
        write, wait, leave = _job.write_arrays, _handle.SaveHandle.wait, _handle.SaveHandle._leave

        def hold() -> None:
            if threading.current_thread().name == "pytreeckpt-save":
                assert self.gate.wait(HANG / 4), "the held save was never let go (a hang guard)"

        def held_write(*args: Any, **kwargs: Any) -> Any:
            hold()
            return write(*args, **kwargs)

        def held_leave(handle: Any, keep: bool) -> None:
            hold()
            leave(handle, keep)

        def opening_wait(handle: Any, timeout: float | None = None) -> None:
            self.waited_running.append(not handle.done())
            self.gate.set()
            wait(handle, timeout)

        if after_commit:
            setattr(_handle.SaveHandle, "_leave", held_leave)
        else:
            setattr(_job, "write_arrays", held_write)
        setattr(_handle.SaveHandle, "wait", opening_wait)


def skips_while_a_rank_writes(rank: int, world: int, directory: str, after_commit: bool) -> dict[str, Any]:
    """Rank 1's asynchronous save of step 2 is held (in its writes, or once committed, when rank 0's has finished);
    the save due at step 4 is skipped by both ranks; once rank 1's is let go, step 6 is saved by both."""
    held = HeldWrites(after_commit=after_commit) if rank == 1 else None
    waiting = _waiting_at("writing the checkpoint") if rank == 0 and not after_commit else None
    saved: dict[int, bool] = {}
    with (
        pytreeckpt.CheckpointManager(directory, save_interval_steps=2, on_busy="skip", timeout=30) as m,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        saved[2] = m.save(2, rank_state(2, world))
        if waiting is not None:  # rank 0's writer waits for rank 1's at the save's next collective
            assert waiting.wait(HANG / 4)
        if rank == 0 and after_commit:
            assert m._handle is not None
            m._handle.wait()  # rank 0's save is over, rank 1's is not
        saved[4] = m.save(4, rank_state(4, world))
        step_4 = os.path.exists(os.path.join(directory, "step_4"))
        if held is not None:
            held.gate.set()
        m.wait()
        saved[6] = m.save(6, rank_state(6, world))
        m.wait()
        return {
            "saved": saved,
            "step_4": step_4,
            "steps": m.all_steps(),
            "restored": m.restore(target=rank_state(0, world))["step"],
            "warnings": [str(w.message) for w in caught if issubclass(w.category, pytreeckpt.CheckpointSkippedWarning)],
        }


def _waiting_at(phase: str) -> threading.Event:
    """An event set once a thread of this rank has come to the checkpoint group's meeting ``phase`` (its place
    among the group's meetings taken: see distributed._meet) and waits there for the other ranks."""
    from pytreeckpt.distributed import _meet

    came = threading.Event()
    call = _meet.store_call

    def noting(store: Any, fn: Callable[[Any], Any], seconds: float, what: str) -> Any:
        if what == phase:
            came.set()
        return call(store, fn, seconds, what)

    _meet.store_call = noting  # type: ignore[assignment]
    return came
