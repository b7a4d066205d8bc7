"""Rank workers of the PeerTierManager tests and benchmark (run by multiproc.run_world: ``fn(rank, world, *args)``)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

import pytreeckpt
from pytreeckpt import PER_RANK


def peer_state(rank: int, world: int, step: int) -> dict[str, Any]:
    """A DTensor sharded over the ranks, a model (the same on every rank), a per-rank tensor and the step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(
        torch.arange(world * 8 * 4, dtype=torch.float32).reshape(world * 8, 4) + step, mesh, [Shard(0)]
    )
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    return {"w": w, "model": model, "rng": torch.full((2,), float(100 * rank + step)), "step": step}


def _manager(rank: int, local_root: str, durable: str, **options: Any) -> pytreeckpt.PeerTierManager:
    return pytreeckpt.PeerTierManager(
        Path(local_root) / f"node{rank // 2}", durable, ranks_per_node=2, durable_interval_steps=3, **options
    )


def peer_save(rank: int, world: int, local_root: str, durable: str, last: int) -> dict[str, Any]:
    with _manager(rank, local_root, durable) as m:
        tiers = {step: m.save(step, peer_state(rank, world, step), {"rng": PER_RANK}) for step in range(1, last + 1)}
        m.wait()
        return {"tiers": tiers, "steps": m.all_steps()}


def peer_restore(rank: int, world: int, local_root: str, durable: str) -> dict[str, Any]:
    """Restore the newest step into a fresh state; count the files opened under ``durable``."""
    opened: list[str] = []
    root = str(Path(durable).resolve())

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "open" and isinstance(args[0], (str, Path)) and str(args[0]).startswith(root):
            opened.append(str(args[0]))

    sys.addaudithook(hook)  # (this process only: a rank of run_world)
    with _manager(rank, local_root, durable) as m, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target = peer_state(rank, world, 0)
        out = m.restore(target=target)
        step = out["step"]
        expected = peer_state(rank, world, step)
        return {
            "step": step,
            "tier": m.last_restored_tier,
            "sources": m.last_restored_sources,
            "w": bool(torch.equal(out["w"].full_tensor(), expected["w"].full_tensor())),
            "w_is_shard": out["w"].placements == target["w"].placements and out["w"].to_local().shape == (8, 4),
            "model": out["model"] is target["model"] and float(target["model"].weight.mean()) == float(step),
            "rng": out["rng"].tolist(),
            "durable_opened": len(opened),
            "local": sorted(p.name for p in (Path(local_root) / f"node{rank // 2}").iterdir()),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, pytreeckpt.CheckpointDamageWarning)],
        }
