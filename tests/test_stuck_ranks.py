"""A stopped rank is an error that names it, within the call's timeout: never a silent hang.

Four real gloo ranks; one of them (the victim) sends itself SIGSTOP (test_killed_ranks.py:
SIGKILL) as it comes to a phase of a save, an asynchronous save, a load or a manager's
restore (tests/stuck_workers.py). Every other rank must raise CheckpointTimeoutError naming
the victim and the phase, within the timeout and a margin (a bound against a hang, not a
measure of speed), and the checkpoint saved before must load as it was.
"""

from __future__ import annotations

import pytest
import stuck_workers
from multiproc import run_world
from stuck_workers import CASES, TIMEOUT, WORLD, check


@pytest.mark.parametrize(("op", "phase", "victim"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_rank_stopped_at_a_phase_is_named_by_the_others_within_the_timeout(tmp_path, op, phase, victim):
    results = run_world(
        WORLD, stuck_workers.stop_at, str(tmp_path), op, phase, "SIGSTOP", victim, TIMEOUT, silent=(victim,)
    )
    check(results, victim, op, phase, tmp_path)
