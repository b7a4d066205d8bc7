"""A stopped or killed rank is an error that names it, within the call's timeout: never a silent hang.

Four real gloo ranks; one of them (the victim) sends itself SIGSTOP, or in another run
SIGKILL, as it comes to a phase of a save, an asynchronous save, a load or a manager's
restore (tests/stuck_workers.py). Every other rank must raise CheckpointTimeoutError naming
the victim and the phase, within the timeout and a margin (a bound against a hang, not a
measure of speed), and the checkpoint saved before must load as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import stuck_workers
import torch
from multiproc import run_world

import pytreeckpt

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


def _check(results: list, victim: int, op: str, phase: str, root: Path) -> None:
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


@pytest.mark.parametrize(("op", "phase", "victim"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_rank_stopped_at_a_phase_is_named_by_the_others_within_the_timeout(tmp_path, op, phase, victim):
    results = run_world(
        WORLD, stuck_workers.stop_at, str(tmp_path), op, phase, "SIGSTOP", victim, TIMEOUT, silent=(victim,)
    )
    _check(results, victim, op, phase, tmp_path)


@pytest.mark.parametrize(("op", "phase", "victim"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_rank_killed_at_a_phase_is_named_by_the_others_within_the_timeout(tmp_path, op, phase, victim):
    results = run_world(
        WORLD, stuck_workers.stop_at, str(tmp_path), op, phase, "SIGKILL", victim, TIMEOUT, silent=(victim,)
    )
    _check(results, victim, op, phase, tmp_path)
