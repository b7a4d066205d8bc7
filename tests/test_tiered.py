"""TwoTierManager: frequent checkpoints in memory, fewer on durable storage, restore from the newer."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import HANG, killed_after_step

import pytreeckpt

EXAMPLE = Path(__file__).parent.parent / "examples" / "train_with_manager.py"


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fast tier in RAM (/dev/shm where the machine has it)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    path = root / f"pytreeckpt-test-{uuid.uuid4().hex[:8]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_steps_go_to_their_tier_with_retention_and_restore_takes_the_newest(tmp_path: Path, shm: Path) -> None:
    with pytreeckpt.TwoTierManager(shm, tmp_path / "d", fast_interval_steps=2, durable_interval_steps=5) as m:
        tiers = {step: m.save(step, {"w": torch.full((4,), float(step)), "step": step}) for step in range(1, 13)}
        m.wait()
        assert tiers[5] == tiers[10] == "durable"
        assert tiers[2] == tiers[12] == "fast"
        assert tiers[3] is None
        assert m.all_steps() == {"fast": [8, 12], "durable": [5, 10]}  # the fast tier keeps 2
        assert m.latest_step() == 12
        assert m.restore()["step"] == 12
        assert torch.equal(m.restore(10)["w"], torch.full((4,), 10.0))
    shutil.rmtree(shm)  # the machine restarted: the fast tier is gone
    with pytreeckpt.TwoTierManager(shm, tmp_path / "d", fast_interval_steps=2, durable_interval_steps=5) as m:
        assert m.restore()["step"] == 10
    with (
        pytreeckpt.TwoTierManager(shm, tmp_path / "none", fast_interval_steps=2, durable_interval_steps=5) as m,
        pytest.raises(pytreeckpt.NotCommittedError, match="fast tier"),
    ):
        m.restore()


def _losses(text: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"step (\d+) loss (\S+)", text)}


COMMON = [sys.executable, str(EXAMPLE), "--steps", "24", "--every", "10", "--fast-every", "3"]


@pytest.fixture(scope="module")
def uninterrupted_losses(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The losses of the example run without interruption (one run for every test below)."""
    tmp = tmp_path_factory.mktemp("reference")
    fast = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    fast = fast / f"pytreeckpt-test-{uuid.uuid4().hex[:8]}-ref"
    try:
        reference = subprocess.run(
            [*COMMON, "--dir", str(tmp / "ref"), "--fast-dir", str(fast)], capture_output=True, text=True, timeout=HANG
        )
    finally:
        shutil.rmtree(fast, ignore_errors=True)
    assert reference.returncode == 0, reference.stderr
    return _losses(reference.stdout)


@pytest.mark.parametrize("lose_fast_tier", [False, True])
def test_a_killed_run_resumes_from_the_fast_tier_or_from_the_durable_one(
    tmp_path: Path, shm: Path, lose_fast_tier: bool, uninterrupted_losses: dict[int, str]
) -> None:
    want = uninterrupted_losses
    base = [*COMMON, "--dir", str(tmp_path / "run"), "--fast-dir", str(shm)]
    killed_after_step(base, 17)
    if lose_fast_tier:
        shutil.rmtree(shm)
    resumed = subprocess.run(base, capture_output=True, text=True, timeout=HANG)
    assert resumed.returncode == 0, resumed.stderr
    restart = int(re.search(r"resumed from step (\d+)", resumed.stdout).group(1))  # type: ignore[union-attr]
    if lose_fast_tier:
        assert restart == 10  # the durable tier's newest
    else:
        assert restart in (12, 15)  # a fast-tier step newer than the durable 10
    got = _losses(resumed.stdout)
    assert sorted(got) == list(range(restart + 1, 25))
    differ = {s: (got[s], want[s]) for s in got if got[s] != want[s]}  # identical to the uninterrupted run
    assert not differ, f"resumed from step {restart}: (resumed, uninterrupted) losses differ at {differ}"
