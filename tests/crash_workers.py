"""Child processes for tests/test_reliability.py: saves that get killed, and racing writers."""

from __future__ import annotations

import os
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


def save_too_much(rank: int, world: int, path: str) -> tuple[str, list[str]]:
    """A distributed save of 8 MiB, written by both ranks, into a disk with less room: the error, and what is left."""
    g = torch.Generator().manual_seed(0)
    tree = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(4)}
    try:
        pytreeckpt.save(path, tree)
    except pytreeckpt.CheckpointError as e:
        error = f"CheckpointError: {e}"
    except Exception as e:  # anything else is a bug the test reports
        error = f"{type(e).__name__}: {e}"
    else:
        error = "saved"
    left = sorted(os.listdir(path)) if os.path.isdir(path) else []
    return error, left


def replace_distributed(rank: int, world: int, path: str) -> dict[str, Any]:
    """Two ranks save, then replace, a checkpoint of arrays both write and small ones packed per rank."""
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(world)))

    def tree(seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        big = torch.randn(1024, 512, generator=g)  # 2 MiB: stored on its own, written by both ranks
        small = {f"b{i}": torch.randn(16, generator=g) for i in range(8)}  # packed, spread over the ranks
        return {"big": distribute_tensor(big, mesh, [Shard(0)]), "small": small, "step": seed}

    pytreeckpt.save(path, tree(1))
    first = sorted(p for top in ("arrays", "ocdbt") for p in _names(path, top))
    pytreeckpt.save(path, tree(2), overwrite=True)
    second = sorted(p for top in ("arrays", "ocdbt") for p in _names(path, top))
    got = pytreeckpt.load(path)
    want = tree(2)
    whole = torch.equal(got["big"], want["big"].full_tensor()) and all(
        torch.equal(got["small"][k], v) for k, v in want["small"].items()
    )
    return {"first": first, "second": second, "step": got["step"], "whole": whole}


def _names(path: str, top: str) -> list[str]:
    folder = os.path.join(path, top)
    return [f"{top}/{n}" for n in os.listdir(folder)] if os.path.isdir(folder) else []
