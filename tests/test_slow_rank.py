"""Slow is not stuck: a rank whose writes are slow but moving does not fail a save because the process
group's timeout is shorter than its write; the call's own ``timeout`` decides, and names that rank.

Two real gloo ranks whose process group was made with a 20 s timeout; rank 1's writes are
slowed to take about 40 s. The ranks wait for it at a meeting on the store, with the call's
deadline, not inside a gloo collective the group's timeout would end.
"""

from __future__ import annotations

import stuck_workers
import torch
from multiproc import run_world

import pytreeckpt

PG_TIMEOUT = 20.0
SLOW_WRITE = 40.0


def test_a_rank_writing_longer_than_the_group_timeout_still_commits(tmp_path):
    results = run_world(2, stuck_workers.slow_writer, str(tmp_path), 1, SLOW_WRITE, None, pg_timeout=PG_TIMEOUT)
    assert [r["phase"] for r in results] == [None, None], results
    assert all(r["seconds"] >= SLOW_WRITE * 0.9 for r in results), results  # (rank 0 waited for it, past 20 s)
    loaded = pytreeckpt.load(tmp_path / "ckpt")
    assert torch.equal(loaded["w"], torch.full((2 * 64, 256), 3.0))


def test_a_rank_writing_longer_than_the_call_timeout_is_named_and_nothing_is_committed(tmp_path):
    results = run_world(2, stuck_workers.slow_writer, str(tmp_path), 1, SLOW_WRITE, 10.0, pg_timeout=PG_TIMEOUT)
    waited, slow = results
    assert waited["phase"] == "writing the checkpoint", waited
    assert waited["ranks"] == [1], waited
    assert "rank 1" in waited["message"], waited
    assert 9.0 <= waited["seconds"] < 10.0 + 30.0, waited  # (the deadline held; the margin is a hang guard)
    # The slow rank itself raises when it comes, after the others gave the meeting up.
    assert slow["phase"] == "writing the checkpoint", slow
    assert "came after that" in slow["message"], slow
    assert not (tmp_path / "ckpt" / "pytreeckpt.json").exists()
    try:
        pytreeckpt.load(tmp_path / "ckpt")
    except pytreeckpt.NotCommittedError:
        pass
    else:
        raise AssertionError("the timed-out save committed")


def test_how_long_each_rank_waited_for_which_rank_is_in_the_monitor(tmp_path):
    """Each meeting is a span on rank 0's monitor: rank 0 waited for rank 1, the last to come, about as long
    as rank 1 was late; rank 1 waited for nobody there."""
    (waits, summary), _ = run_world(2, stuck_workers.watched_save, str(tmp_path), 1, 3.0)
    writing: dict[int, tuple[float, int]] = {}
    for phase, rank, seconds, last in waits:  # (each rank's first meeting after its writes)
        if phase == "wait: writing the checkpoint":
            writing.setdefault(rank, (seconds, last))
    assert set(writing) == {0, 1}, waits
    assert writing[0][1] == 1, writing
    assert writing[1][1] == 1, writing
    assert writing[0][0] >= 2.5, writing  # (rank 1 paused 3 s before its writes)
    assert writing[1][0] < writing[0][0], writing
    assert "wait: writing the checkpoint" in summary[0], summary


def test_the_store_workers_of_ended_writer_threads_end_with_them(tmp_path):
    """Each async save's writer thread meets the others through a store worker of its own: it must end with the
    writer, not pile up (a thread and a connection to the store a save)."""
    for before, after in run_world(2, stuck_workers.store_threads_after_saves, str(tmp_path), 6):
        assert after <= before + 1, (before, after)
