"""Lazy snapshots: async_save returns at once, the copy runs behind forward and backward."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from helpers import HANG
from torch import nn

import pytreeckpt
from pytreeckpt.execute import _pipeline


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(32, 64, generator=g)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Copies into staging memory wait until the test opens the gate: training certainly runs first."""
    opened = threading.Event()
    original = _pipeline.copy_into

    def gated(dst, src):  # type: ignore[no-untyped-def]
        assert opened.wait(HANG)
        original(dst, src)

    monkeypatch.setattr(_pipeline, "copy_into", gated)
    return opened


def test_lazy_save_holds_the_state_of_the_call_while_training_goes_on(tmp_path: Path, gate: threading.Event) -> None:
    model, opt = _model()
    for i in range(3):
        _step(model, opt, i)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    expected = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {k: {n: t.clone() for n, t in v.items()} for k, v in opt.state_dict()["state"].items()},
    }
    h = pytreeckpt.async_save(tmp_path / "c", state, snapshot="lazy")
    h.guard(opt)
    assert not h.done()  # returned before a single byte was copied
    x = torch.randn(32, 64)
    opt.zero_grad()
    model(x).pow(2).mean().backward()  # forward and backward run while the snapshot is pending
    gate.set()
    opt.step()  # the guard waits for the copy before the first change
    for i in range(3, 6):
        _step(model, opt, i)
    h.wait()
    out = pytreeckpt.load(tmp_path / "c")
    assert out["step"] == 3
    for k, v in expected["model"].items():
        assert torch.equal(out["model"][k], v), k
    for k, v in expected["optim"].items():
        for n, t in v.items():
            assert torch.equal(out["optim"]["state"][k][n], t), (k, n)
    assert not torch.equal(model.state_dict()["0.weight"], expected["model"]["0.weight"])  # training did change it


def test_a_change_that_overtakes_the_copy_fails_the_save(tmp_path: Path, gate: threading.Event) -> None:
    w = torch.zeros(8, 1024)
    state = {f"w{i}": torch.zeros(8, 1024) for i in range(4)}
    state["w"] = w
    h = pytreeckpt.async_save(tmp_path / "c", state, snapshot="lazy")
    w.add_(1.0)  # no wait_snapshot: the copy has not reached it
    gate.set()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'w' was changed in place"):
        h.wait_snapshot()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"changed in place"):
        h.wait()
    with pytest.raises(pytreeckpt.NotCommittedError):
        pytreeckpt.load(tmp_path / "c")
    pytreeckpt.save(tmp_path / "c", state)  # the failure was reported: the next save goes ahead


def test_wait_snapshot_then_change_is_safe(tmp_path: Path) -> None:
    w = torch.arange(1000.0)
    h = pytreeckpt.async_save(tmp_path / "c", {"w": w}, snapshot="lazy")
    h.wait_snapshot()
    w.mul_(0)
    h.wait()
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], torch.arange(1000.0))


def test_an_eager_snapshot_is_copied_when_the_call_returns(tmp_path: Path) -> None:
    h = pytreeckpt.async_save(tmp_path / "c", {"w": torch.ones(3)})
    h.wait_snapshot(timeout=0)
    h.wait()
    with pytest.raises(ValueError, match="eager"):
        pytreeckpt.async_save(tmp_path / "d", {"w": torch.ones(3)}, snapshot="later")
