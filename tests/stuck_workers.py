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

WORLD = 4
TIMEOUT = 4.0
MARGIN = 30.0  # (a machine busy with other work is slow to schedule ranks; a hang would take 600 s)

CASES = [
    # (operation, the phase the victim stops at, the victim)
    ("save", "agreeing on the save", 2),
    ("save", "creating the packed arrays", 3),
    ("save", "writing the checkpoint", 1),
    ("save", "committing the checkpoint", 2),
    ("save", "writing the checkpoint", 0),
    ("async_save", "preparing the save", 1),
    ("async_save", "writing the checkpoint", 3),
    ("async_save", "committing the checkpoint", 1),
    ("load", "reading the checkpoint metadata", 1),
    ("load", "loading the checkpoint", 2),
    ("restore", "rank 0's view of the steps", 3),
    ("restore", "loading the checkpoint", 1),
    ("restore", "the restore vote", 2),
]


def check(results: list, victim: int, op: str, phase: str, root: Path) -> None:
    for rank, got in enumerate(results):
        if rank == victim:
            assert got is None
            continue
        assert got["phase"] is not None, f"rank {rank} did not raise ({op} with rank {victim} stopped at {phase})"
        assert got["phase"].startswith(phase), got
        assert f"rank {victim}" in got["message"], got["message"]
        if victim == 0:  # its process serves the rendezvous store (no torchrun): that store does not answer
            assert "store" in got["message"], got["message"]
            assert got["seconds"] < TIMEOUT + MARGIN, got
            continue
        assert victim in got["ranks"], got
        assert TIMEOUT * 0.9 <= got["seconds"] < TIMEOUT + MARGIN, got
    # The checkpoint saved before the stop loads as it was, nothing half-committed over it; a rank stopped
    # after rank 0's commit (at the last meeting) leaves the new one committed, whole.
    expected = 2 if phase == "committing the checkpoint" else 1
    if op == "restore":
        with pytreeckpt.CheckpointManager(root / "steps") as m:
            assert m.all_steps() == [1]
            loaded = m.restore()
    else:
        loaded = pytreeckpt.load(root / "ckpt")
    assert loaded["step"] == expected
    assert torch.equal(loaded["w"], torch.full((WORLD * 64, 256), float(expected)))
    assert torch.equal(loaded["b"], torch.full((16,), float(expected)))


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


def slow_writer(rank: int, world: int, root: str, slow: int, seconds: float, timeout: float | None) -> Any:
    """Save with rank ``slow``'s writes slowed to take ``seconds`` in all (moving: a pause before each of its
    chunks); what this rank raised, or None and whether the checkpoint then loads."""
    from pytreeckpt.saving import _job

    tree, spec = state(world, 3.0)
    if rank == slow:
        write = _job.write_arrays

        def slowly(storage: Any, metas: Any, items: Any, **kw: Any) -> int:
            items = list(items)

            def paced() -> Any:
                for item in items:
                    time.sleep(seconds / max(len(items), 1))
                    yield item

            return write(storage, metas, paced(), **kw)

        _job.write_arrays = slowly  # type: ignore[assignment]
    start = time.monotonic()
    try:
        pytreeckpt.save(Path(root) / "ckpt", tree, spec, timeout=timeout)
        got: dict[str, Any] = {"phase": None, "seconds": time.monotonic() - start}
    except pytreeckpt.CheckpointTimeoutError as e:
        got = {"phase": e.phase, "ranks": list(e.ranks), "seconds": time.monotonic() - start, "message": str(e)}
    # Every rank stays until all are done: rank 0's process serves the store the slow rank comes to at last.
    (Path(root) / f"done-{rank}").touch()
    guard = time.monotonic() + 300
    while not all((Path(root) / f"done-{r}").exists() for r in range(world)) and time.monotonic() < guard:
        time.sleep(0.05)
    return got


def watched_save(rank: int, world: int, root: str, slow: int, seconds: float) -> Any:
    """Save with rank ``slow`` pausing ``seconds`` before its writes, into a Monitor; on rank 0, every rank's
    waits on the others ("wait: <phase>" spans: who waited how long, and for whom)."""
    from pytreeckpt.saving import _job

    tree, spec = state(world, 4.0)
    if rank == slow:
        write = _job.write_arrays

        def late(*args: Any, **kw: Any) -> int:
            time.sleep(seconds)
            return write(*args, **kw)

        _job.write_arrays = late  # type: ignore[assignment]
    monitor = pytreeckpt.Monitor()
    pytreeckpt.save(Path(root) / "ckpt", tree, spec, monitor=monitor)
    waits = [s for s in monitor.spans if s.phase.startswith("wait: ")]
    return [(s.phase, s.rank, s.seconds, s.last) for s in waits], monitor.summary() if rank == 0 else None


def store_threads_after_saves(rank: int, world: int, root: str, saves: int) -> Any:
    """``saves`` asynchronous saves (each on a writer thread of its own, each with meetings): how many threads
    serve store calls before and after them (a writer's worker ends with its writer)."""
    import gc
    import threading

    def serving() -> int:
        gc.collect()
        time.sleep(0.2)  # (a worker let go ends at its next look at its queue: at once)
        return sum(t.name == "pytreeckpt-store" and t.is_alive() for t in threading.enumerate())

    tree, spec = state(world, 5.0)
    pytreeckpt.save(Path(root) / "first", tree, spec)
    before = serving()
    for i in range(saves):
        pytreeckpt.async_save(Path(root) / f"a{i}", tree, spec).wait()
    return before, serving()
