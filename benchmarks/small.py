"""Many small leaves: 10,000 tensors of 4 KiB, as optimizer step counters, biases and norms make."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

import pytreeckpt

from ._common import count_files, drop_caches, fresh, fsync_tree, timed


def run(count: int, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i // 10}.p{i % 10}": torch.randn(1024, generator=g) for i in range(count)}
    s: dict[str, float] = {}
    files: dict[str, int] = {}
    setup = (lambda: drop_caches()) if cold else None
    mode = "cold" if cold else "warm"

    tpath = workdir / "small.pt"

    def torch_save() -> None:
        torch.save(state, tpath)
        fsync_tree(tpath)

    s["torch.save"] = timed(torch_save, repeat, fresh(tpath))
    s[f"torch.load {mode}"] = timed(lambda: torch.load(tpath, weights_only=True), repeat, setup)
    files["torch.save"] = count_files(tpath)
    fresh(tpath)()

    import torch.distributed.checkpoint as dcp

    dpath = workdir / "small-dcp"
    s["dcp.save"] = timed(lambda: dcp.save(state, checkpoint_id=dpath), repeat, fresh(dpath))

    def dcp_load() -> None:
        dcp.load({k: torch.empty_like(v) for k, v in state.items()}, checkpoint_id=dpath)

    s[f"dcp.load {mode}"] = timed(dcp_load, repeat, setup)
    files["dcp.save"] = count_files(dpath)
    fresh(dpath)()

    ppath = workdir / "small-ptc"
    s["pytreeckpt.save"] = timed(lambda: pytreeckpt.save(ppath, state), repeat, fresh(ppath))
    s[f"pytreeckpt.load {mode}"] = timed(lambda: pytreeckpt.load(ppath), repeat, setup)
    files["pytreeckpt.save"] = count_files(ppath)
    fresh(ppath)()
    return {"leaves": count, "bytes": count * 4096, "seconds": s, "files": files}


def targets(r: dict[str, Any], cold: bool) -> list[tuple[str, float, str, float]]:
    s = r["seconds"]
    mode = "cold" if cold else "warm"
    return [
        ("small leaves: DCP save time / pytreeckpt save time", s["dcp.save"] / s["pytreeckpt.save"], ">", 1.0),
        (
            "small leaves: DCP load time / pytreeckpt load time",
            s[f"dcp.load {mode}"] / s[f"pytreeckpt.load {mode}"],
            ">",
            1.0,
        ),
    ]
