"""Saves and loads pause Python's cyclic garbage collector while they run in the caller's thread, and only then."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

import pytreeckpt
from pytreeckpt.loading import _run as _load
from pytreeckpt.saving import _job as _save


@pytest.fixture(autouse=True)
def _collector_enabled() -> Any:
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_a_save_and_a_load_run_without_the_collector_and_restore_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[bool] = []
    write, read = _save.write_arrays, _load.read_arrays
    monkeypatch.setattr(_save, "write_arrays", lambda *a, **k: (seen.append(gc.isenabled()), write(*a, **k))[1])
    monkeypatch.setattr(_load, "read_arrays", lambda *a, **k: (seen.append(gc.isenabled()), read(*a, **k))[1])
    tree = {"w": torch.randn(8, 4), "b": torch.ones(3)}
    pytreeckpt.save(tmp_path / "c", tree)
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], tree["w"])
    assert seen == [False, False]
    assert gc.isenabled()
    pytreeckpt.async_save(tmp_path / "d", tree).wait()
    assert gc.isenabled()


def test_a_failing_save_or_load_restores_the_collector(tmp_path: Path) -> None:
    with pytest.raises(pytreeckpt.CheckpointError):
        pytreeckpt.load(tmp_path / "missing")
    assert gc.isenabled()
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})
    with pytest.raises(pytreeckpt.CheckpointError):
        pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})  # already committed
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled(tmp_path: Path) -> None:
    gc.disable()
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})
    pytreeckpt.load(tmp_path / "c")
    assert not gc.isenabled()
