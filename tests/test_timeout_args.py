"""The deadline of every wait: ``timeout=`` of the calls, ``set_default_timeout``, ``PYTREECKPT_TIMEOUT``."""

from __future__ import annotations

import math

import pytest
import torch

import pytreeckpt
from pytreeckpt.core import _timeout


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, "5", True, [5]])
def test_a_timeout_that_is_not_seconds_is_refused_before_anything_is_written(tmp_path, bad):
    with pytest.raises(ValueError, match="timeout"):
        pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)}, timeout=bad)
    assert not (tmp_path / "c").exists()
    pytreeckpt.save(tmp_path / "ok", {"w": torch.ones(2)})
    with pytest.raises(ValueError, match="timeout"):
        pytreeckpt.load(tmp_path / "ok", timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        pytreeckpt.async_save(tmp_path / "c", {"w": torch.ones(2)}, timeout=bad)
    with pytest.raises(ValueError, match="timeout"):
        pytreeckpt.CheckpointManager(tmp_path / "m", timeout=bad)


def test_the_default_comes_from_the_call_then_the_process_then_the_environment(monkeypatch):
    monkeypatch.delenv(_timeout.ENV, raising=False)
    assert _timeout.current_timeout() == _timeout.DEFAULT_TIMEOUT == 600.0
    monkeypatch.setenv(_timeout.ENV, "42.5")
    assert _timeout.current_timeout() == 42.5
    pytreeckpt.set_default_timeout(7)
    try:
        assert _timeout.current_timeout() == 7.0
        with _timeout.call_timeout(3):
            assert _timeout.current_timeout() == 3.0
        with _timeout.call_timeout(None):
            assert _timeout.current_timeout() == 7.0
    finally:
        pytreeckpt.set_default_timeout(None)
    assert _timeout.current_timeout() == 42.5
    with pytest.raises(ValueError, match="seconds"):
        pytreeckpt.set_default_timeout(-1)


def test_a_malformed_environment_variable_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(_timeout.ENV, "ten minutes")
    with pytest.raises(ValueError, match="PYTREECKPT_TIMEOUT"):
        pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})
    assert not (tmp_path / "c").exists()


def test_an_async_saves_writer_runs_with_the_calls_timeout(tmp_path, monkeypatch):
    """The writer thread runs in a copy of the caller's context: the call's deadline holds for its writes."""
    from pytreeckpt.saving import _job

    seen: list[float] = []
    persist = _job.SaveJob.persist

    def recording(self: _job.SaveJob) -> None:
        seen.append(_timeout.current_timeout())
        persist(self)

    monkeypatch.setattr(_job.SaveJob, "persist", recording)
    pytreeckpt.async_save(tmp_path / "c", {"w": torch.ones(2)}, timeout=12.5).wait()
    assert seen == [12.5]
