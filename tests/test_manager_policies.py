"""CheckpointManager policies: keep the best by a metric, save and keep by time, delete off the training thread."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import manager_workers as mw
import pytest
import torch
from helpers import HANG
from hypothesis import given, settings
from hypothesis import strategies as st
from multiproc import run_world

from pytreeckpt import CheckpointManager
from pytreeckpt.manager import _manager
from pytreeckpt.manager._policy import Retention, StepFacts


def state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


LOSSES = {1: 0.9, 2: 0.3, 3: 0.8, 4: 0.1, 5: 0.7, 6: 0.2, 7: 0.95, 8: 0.6}


@pytest.mark.parametrize(("mode", "best", "then"), [("min", [2, 4, 6], [4, 6, 9]), ("max", [1, 3, 7], [1, 7, 9])])
def test_keep_best_keeps_the_best_by_the_metric_and_the_newest(
    tmp_path: Path, mode: str, best: list[int], then: list[int]
) -> None:
    options = {"max_to_keep": 1, "keep_best": 3, "best_fn": lambda md: md["loss"], "best_mode": mode}
    with CheckpointManager(tmp_path, **options) as m:  # type: ignore[arg-type]
        for step, loss in LOSSES.items():
            m.save(step, state(step), user_metadata={"loss": loss})
        m.wait()
        assert m.all_steps() == sorted({*best, 8})
    # a new manager (a restarted job) reads the metrics of the steps from their metadata
    with CheckpointManager(tmp_path, **options) as m:  # type: ignore[arg-type]
        m.save(9, state(9), user_metadata={"loss": 0.05 if mode == "min" else 0.99})
        m.wait()
        assert m.all_steps() == then


def test_keep_best_alone_keeps_the_best_and_the_newest_and_steps_without_a_metric_are_not_ranked(
    tmp_path: Path,
) -> None:
    with CheckpointManager(tmp_path, keep_best=2, best_fn=lambda md: md["loss"], async_=False) as m:
        for step, loss in LOSSES.items():
            m.save(step, state(step), user_metadata={"loss": loss} if step != 3 else {})
        m.save(9, state(9))  # no metric: kept as the newest only
        m.save(10, state(10), user_metadata={"loss": 0.5})
        m.wait()
        assert m.all_steps() == [4, 6, 10]


def test_save_interval_seconds_adds_saves_by_time(tmp_path: Path) -> None:
    now = [1000.0]
    with CheckpointManager(
        tmp_path, save_interval_steps=5, save_interval_seconds=60, clock=lambda: now[0], async_=False
    ) as m:
        saved = []
        for step in range(1, 13):
            now[0] += 25.0 if step < 8 else 1.0  # slow steps, then fast ones
            if m.save(step, state(step)):
                saved.append(step)
    # 60 s after the start at step 3 (75 s); step 5 on the step interval, and 10; not 60 s after step 5 till then
    assert saved == [3, 5, 10]


def test_rank_0s_clock_decides_the_timed_saves_of_every_rank(tmp_path: Path) -> None:
    results = run_world(2, mw.timed_saves, str(tmp_path))
    assert results[0] == results[1], results
    assert results[0]["saved"] == [3, 6, 9, 12]


def test_keep_period_keeps_one_step_per_period(tmp_path: Path) -> None:
    now = [0.0]
    with CheckpointManager(tmp_path, max_to_keep=2, keep_period_seconds=100, clock=lambda: now[0]) as m:
        for step in range(1, 21):
            now[0] = step * 30.0  # 30 s a step: steps 1, 5, 9, 13, 17 start a period of 100 s each
            m.save(step, state(step))
        m.wait()
        assert m.all_steps() == [1, 5, 9, 13, 17, 19, 20]
    # A restart: the times of earlier steps come from their metadata files, written within a second or so
    # (this test's clock ran faster than the files'): one period holds them all, the oldest is kept.
    with CheckpointManager(tmp_path, max_to_keep=2, keep_period_seconds=100) as m:
        m.save(21, state(21))
        m.wait()
        assert m.all_steps() == [1, 20, 21]


def test_rules_combine(tmp_path: Path) -> None:
    now = [0.0]
    with CheckpointManager(
        tmp_path,
        max_to_keep=2,
        keep_every_n_steps=10,
        keep_best=1,
        best_fn=lambda md: md["loss"],
        keep_period_seconds=1000,
        clock=lambda: now[0],
    ) as m:
        for step in range(1, 26):
            now[0] = step * 100.0
            m.save(step, state(step), user_metadata={"loss": abs(step - 7)})
        m.wait()
        assert m.all_steps() == [1, 7, 10, 11, 20, 21, 24, 25]


def test_old_steps_are_deleted_on_the_deleter_thread_and_wait_waits_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    opened: list[bool] = []  # for each deletion: whether the saves had ended when it was let go
    saved = threading.Event()
    remove_tree = _manager.remove_tree

    def held_remove(path: Path) -> None:  # each deletion waits until the saves are over (a hang guard aside)
        threads.append(threading.current_thread().name)
        opened.append(saved.wait(HANG / 4))
        remove_tree(path)

    monkeypatch.setattr(_manager, "remove_tree", held_remove)
    with CheckpointManager(tmp_path, max_to_keep=1, async_=False) as m:
        for step in range(1, 5):
            m.save(step, state(step))
        assert m.all_steps() == [4]  # steps being deleted are not listed
        saved.set()  # the saves ended while no deletion could: they did not wait for one
        m.wait()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]
    assert opened == [True, True, True], opened  # (a save that waited for a deletion left it waiting in vain)
    assert all(t.startswith("pytreeckpt-deleter") for t in threads), threads


def test_a_failed_deletion_is_logged_and_retried_by_the_next_retention(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    failures = [1]
    discard = _manager._discard

    def failing_once(path: Path, committed: bool) -> bool:
        if failures:
            failures.pop()
            raise OSError(f"{path}: the file system said no")
        return discard(path, committed)

    monkeypatch.setattr(_manager, "_discard", failing_once)
    with caplog.at_level(logging.WARNING, logger="pytreeckpt"), CheckpointManager(tmp_path, max_to_keep=1) as m:
        m.save(1, state(1))
        m.save(2, state(2))
        m.wait()
        assert "deleting step 1 failed, the next retention retries" in caplog.text
        assert "the file system said no" in caplog.text
        assert m.all_steps() == [1, 2]  # still there
        m.save(3, state(3))
        m.wait()
        assert m.all_steps() == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3"]


def _loss(md: Mapping[str, Any]) -> float:
    if md["loss"] == "raise":
        raise KeyError("no loss logged")
    return None if md["loss"] is None else float(md["loss"])  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("losses", "kept"),
    [
        (["nan", 0.1, 0.5, 0.7, 0.9], [2, 5]),  # the NaN step took the best's place
        (["-inf", 0.1, 0.5, 0.7, 0.9], [2, 5]),
        ([0.4, "nan", "nan", 0.2, "inf", None, "raise", 0.9], [4, 8]),
    ],
)
def test_keep_best_never_loses_the_best_finite_step_to_a_nan_none_infinity_or_raising_metric(
    tmp_path: Path, losses: list[Any], kept: list[int]
) -> None:
    options = {"max_to_keep": 1, "keep_best": 1, "best_fn": _loss, "async_": False}
    with CheckpointManager(tmp_path, **options) as m:  # type: ignore[arg-type]
        for step, loss in enumerate(losses, 1):
            m.save(step, state(step), user_metadata={"loss": loss})
        m.wait()
        assert m.all_steps() == kept
    with CheckpointManager(tmp_path, **options) as m:  # type: ignore[arg-type]  (metrics read back from disk)
        m.save(len(losses) + 1, state(0), user_metadata={"loss": "nan"})
        m.wait()
        assert m.all_steps() == [kept[0], len(losses) + 1]


_METRICS = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([math.nan, math.inf, -math.inf, None, "raise"]),
)


@settings(max_examples=300, deadline=None)
@given(
    metrics=st.lists(st.tuples(_METRICS, st.booleans()), min_size=1, max_size=12),
    keep_best=st.integers(1, 4),
    mode=st.sampled_from(["min", "max"]),
    max_to_keep=st.one_of(st.none(), st.integers(1, 3)),
)
def test_the_best_finite_steps_are_always_kept_whatever_the_other_metrics(
    metrics: list[tuple[Any, bool]], keep_best: int, mode: str, max_to_keep: int | None
) -> None:
    stored = {step: {"loss": m} for step, (m, _) in enumerate(metrics, 1)}
    facts = StepFacts(_loss, "run", lambda step: stored[step], lambda step: None)
    for step, (_, saved_here) in enumerate(metrics, 1):
        if saved_here:  # noted at its save, else read back from its metadata
            facts.note(step, 0.0, stored[step])
    steps = sorted(stored)
    retention = Retention(max_to_keep=max_to_keep, keep_best=keep_best, best_mode=mode)
    keep = retention.keep(steps, {s: facts.metric(s) for s in steps})
    finite = [(m, s) for s, (m, _) in enumerate(metrics, 1) if isinstance(m, float) and math.isfinite(m)]
    finite.sort(key=lambda e: (e[0] if mode == "min" else -e[0], -e[1]))  # the best first; a tie: the newer
    assert {s for _, s in finite[:keep_best]} <= keep
    newest = set(steps[-(max_to_keep or 1) :])
    assert keep <= newest | {s for _, s in finite}  # a step without a finite metric only as one of the newest
