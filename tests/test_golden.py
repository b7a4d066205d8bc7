"""Checkpoints written by earlier versions of the format still load, bit for bit."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
from helpers import bits

import pytreeckpt

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))

from make_golden import golden_state  # noqa: E402


def test_format_v1_golden_checkpoint_loads() -> None:
    want = golden_state()
    got = pytreeckpt.load(GOLDEN / "v1")
    for k in ("w", "flat", "rep"):
        assert torch.equal(bits(got["model"][k]), bits(want["model"][k].to_global())), k
    for k, v in want["dtypes"].items():
        assert torch.equal(bits(got["dtypes"][k]), bits(v)), k
    assert torch.equal(bits(got["optim"]["state"][0]["exp_avg"]), bits(want["optim"]["state"][0]["exp_avg"]))
    assert list(got["optim"]["state"]) == [0]
    assert tuple(got["point"]) == (1, "two")
    assert got["step"] == 3
    assert math.isnan(got["nan"])
    assert got["none"] is None
    assert pytreeckpt.metadata(GOLDEN / "v1").version == 1
