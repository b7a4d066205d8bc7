"""CheckpointManager(on_busy=...): a save due while the previous asynchronous save is still writing waits, or is
skipped; a forced save and a preemption's always wait; the ranks of a distributed job skip together."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import manager_workers as mw
import pytest
import torch
from multiproc import run_world

from pytreeckpt import CheckpointManager, CheckpointSkippedWarning, TwoTierManager


def state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> mw.HeldWrites:
    """Asynchronous saves' writes held until the test lets them go, or until someone waits for the save."""
    return mw.HeldWrites(monkeypatch.setattr)


SKIPPED_4 = r"step 4 is not saved: the asynchronous save of step 2, started \d+\.\d s ago, is still writing \("


def test_with_on_busy_skip_a_due_save_is_skipped_while_the_previous_async_save_writes(
    tmp_path: Path, held: mw.HeldWrites
) -> None:
    with CheckpointManager(tmp_path, save_interval_steps=2, on_busy="skip") as m:
        assert m.save(2, state(2))
        assert not m.save(3, state(3))  # (not due)
        with pytest.warns(CheckpointSkippedWarning, match=SKIPPED_4):
            assert not m.save(4, state(4))
        assert held.waited_running == []  # nobody waited for step 2
        assert not (tmp_path / "step_4").exists()
        held.gate.set()
        m.wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointSkippedWarning)
            assert m.save(6, state(6))  # step 2 is over: the next due save is made
        m.wait()
        assert m.all_steps() == [2, 6]
        assert m.restore()["step"] == 6


def test_with_on_busy_wait_a_due_save_waits_for_the_previous_async_save(tmp_path: Path, held: mw.HeldWrites) -> None:
    with CheckpointManager(tmp_path, save_interval_steps=2, on_busy="wait") as m:
        assert m.save(2, state(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointSkippedWarning)
            assert m.save(4, state(4))
        assert held.waited_running == [True]  # it waited for step 2 while it was writing
        m.wait()
        assert m.all_steps() == [2, 4]


def test_with_on_busy_skip_a_forced_save_waits_for_the_previous_async_save(tmp_path: Path, held: mw.HeldWrites) -> None:
    with CheckpointManager(tmp_path, save_interval_steps=2, on_busy="skip") as m:
        assert m.save(2, state(2))
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointSkippedWarning)
            assert m.save(3, state(3), force=True)
        assert held.waited_running == [True]
        m.wait()
        assert m.all_steps() == [2, 3]


def test_with_on_busy_skip_the_save_after_a_preemption_signal_waits_for_the_previous_async_save(
    tmp_path: Path, held: mw.HeldWrites
) -> None:
    with CheckpointManager(tmp_path, save_interval_steps=2, on_busy="skip", save_on_signals=(signal.SIGUSR1,)) as m:
        assert m.save(2, state(2))
        os.kill(os.getpid(), signal.SIGUSR1)  # the preemption notice, while step 2 is still writing
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointSkippedWarning)
            assert m.save(3, state(3))
        assert held.waited_running == [True]
        assert m.reached_preemption(3)
        assert m.all_steps() == [2, 3]  # committed when save returned


def test_a_two_tier_manager_with_on_busy_skip_skips_a_durable_step_while_the_previous_one_writes(
    tmp_path: Path, held: mw.HeldWrites
) -> None:
    with TwoTierManager(
        tmp_path / "fast", tmp_path / "durable", fast_interval_steps=100, durable_interval_steps=2, on_busy="skip"
    ) as m:
        assert m.save(2, state(2)) == "durable"
        with pytest.warns(CheckpointSkippedWarning, match=SKIPPED_4):
            assert m.save(4, state(4)) is None
        held.gate.set()
        m.wait()
        assert m.save(6, state(6)) == "durable"
        m.wait()
        assert m.all_steps() == {"fast": [], "durable": [2, 6]}


@pytest.mark.parametrize("on_busy", ["never", "", None, "SKIP"])
def test_on_busy_other_than_wait_or_skip_is_refused_before_anything_is_made(tmp_path: Path, on_busy: object) -> None:
    with pytest.raises(ValueError, match=r"on_busy is 'wait' or 'skip', found"):
        CheckpointManager(tmp_path / "m", on_busy=on_busy)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"on_busy is 'wait' or 'skip', found"):
        TwoTierManager(
            tmp_path / "fast", tmp_path / "durable", fast_interval_steps=1, durable_interval_steps=2, on_busy=on_busy
        )  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "after_commit",
    [pytest.param(False, id="rank_1_still_writing"), pytest.param(True, id="rank_0_done_rank_1_not")],
)
def test_the_ranks_skip_a_step_together_while_one_ranks_async_save_is_not_over(
    tmp_path: Path, after_commit: bool
) -> None:
    results = run_world(2, mw.skips_while_a_rank_writes, str(tmp_path), after_commit)
    for rank, r in enumerate(results):
        assert r["saved"] == {2: True, 4: False, 6: True}, (rank, r)
        assert not r["step_4"]
        assert r["steps"] == [2, 6]
        assert r["restored"] == 6
        assert len(r["warnings"]) == 1, r["warnings"]
        assert "step 4 is not saved: the asynchronous save of step 2" in r["warnings"][0]
    assert ("on another rank" in results[0]["warnings"][0]) == after_commit
    assert "on another rank" not in results[1]["warnings"][0]
