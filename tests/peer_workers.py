"""Rank workers of the PeerTierManager tests and benchmark (run by multiproc.run_world: ``fn(rank, world, *args)``)."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import pytreeckpt
from pytreeckpt import PER_RANK
from pytreeckpt.core._checksum import crc32c
from pytreeckpt.distributed._peers import receive_files


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


def send_hostile(group: Any, dst: int, files: list[tuple[str, bytes]]) -> Callable[[], None]:
    """Send ``files`` (name, bytes) to ``dst`` as ``send_files`` does (its wire format), the names whatever they are:
    a hostile peer. Returns the function that waits until they are sent."""
    header = json.dumps({"error": None, "files": [[name, len(data), crc32c(data)] for name, data in files]}).encode()
    works = [
        dist.isend(torch.tensor([len(header)], dtype=torch.int64), dst, group=group),
        dist.isend(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, group=group),
    ]
    works += [dist.isend(torch.frombuffer(bytearray(d), dtype=torch.uint8), dst, group=group) for _, d in files if d]

    def finish() -> None:
        for w in works:
            w.wait()

    return finish


def hostile_peer(rank: int, world: int, local_root: str, durable: str, names: list[str]) -> str | None:
    """Nodes of one rank each; node 0's leader sends the files ``names`` instead of its step. The error on this
    rank (None: none)."""
    if rank == 0:
        import pytreeckpt.manager._peers as peers

        peers.send_files = lambda group, dst, root, what: send_hostile(group, dst, [(n, b"ESCAPED") for n in names])
    with pytreeckpt.PeerTierManager(
        Path(local_root) / f"node{rank}", durable, ranks_per_node=1, durable_interval_steps=100
    ) as m:
        try:
            m.save(1, {"x": torch.full((2,), float(rank))})
            m.wait()
        except pytreeckpt.CheckpointError as e:
            return str(e)
    return None


def hostile_files(rank: int, world: int, into: str, files: list[tuple[str, bytes]]) -> str | None:
    """Rank 0 sends ``files`` to rank 1, which receives them into ``into``; rank 1's error (None: none)."""
    if rank == 0:
        send_hostile(None, 1, files)()
        return None
    try:
        receive_files(None, 0, Path(into), "step 1 of node 0")
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return None


def two_nodes(rank: int, world: int, local_root: str, durable: str, steps: list[int]) -> dict[str, Any]:
    """Nodes of one rank each: save ``steps`` (none: restore the newest), with the peer tier only."""
    with (
        pytreeckpt.PeerTierManager(
            Path(local_root) / f"node{rank}", durable, ranks_per_node=1, durable_interval_steps=100
        ) as m,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for step in steps:
            m.save(step, {"x": torch.full((2,), float(10 * step + rank))})
        if steps:
            m.wait()
            return {"steps": m.all_steps()}
        out = m.restore(target={"x": torch.zeros(2)})
        return {
            "step": m.last_restored_step,
            "tier": m.last_restored_tier,
            "x": out["x"].tolist(),
            "warnings": [str(w.message) for w in caught if issubclass(w.category, pytreeckpt.CheckpointDamageWarning)],
        }
