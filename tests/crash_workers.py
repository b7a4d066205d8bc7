"""Child processes for tests/test_reliability.py: saves that get killed, and racing writers."""

from __future__ import annotations

from typing import Any

import torch

import pytreeckpt


def state(seed: int) -> dict[str, Any]:
    """About 20 MiB in 8 large and 150 small leaves, mixed dtypes, and Python values."""
    g = torch.Generator().manual_seed(seed)
    big = {
        f"w{i}": torch.randn(512, 1024, generator=g).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(8)
    }
    small = {f"b{i}": torch.randn(64, generator=g) for i in range(150)}
    return {"big": big, "small": small, "step": seed, "name": f"state {seed}"}


def save_when_told(path: str, seed: int, use_async: bool, ready: Any, go: Any, done: Any) -> None:
    tree = state(seed)
    ready.set()
    go.wait()
    if use_async:
        pytreeckpt.async_save(path, tree, overwrite=True).wait()
    else:
        pytreeckpt.save(path, tree, overwrite=True)
    done.set()


def race(path: str, seed: int, ready: Any, go: Any, out: Any) -> None:
    tree = state(seed)
    ready.set()
    go.wait()
    try:
        pytreeckpt.save(path, tree, overwrite=True)
        out.put((seed, "ok"))
    except pytreeckpt.CheckpointError as e:
        out.put((seed, f"CheckpointError: {e}"))
    except Exception as e:  # anything else is a bug the test reports
        out.put((seed, f"{type(e).__name__}: {e}"))
