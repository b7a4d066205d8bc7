"""A killed rank is an error that names it, within the call's timeout (as test_stuck_ranks.py, with SIGKILL)."""

from __future__ import annotations

import pytest
import stuck_workers
from multiproc import run_world
from stuck_workers import CASES, TIMEOUT, WORLD, check


@pytest.mark.parametrize(("op", "phase", "victim"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_a_rank_killed_at_a_phase_is_named_by_the_others_within_the_timeout(tmp_path, op, phase, victim):
    results = run_world(
        WORLD, stuck_workers.stop_at, str(tmp_path), op, phase, "SIGKILL", victim, TIMEOUT, silent=(victim,)
    )
    check(results, victim, op, phase, tmp_path)
