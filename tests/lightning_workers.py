"""Worker run on gloo ranks by tests/test_lightning.py: Lightning's way of saving from global rank 0 alone."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def rank_zero_saves_every_rank_loads(rank: int, world: int, path: str) -> dict[str, Any]:
    """As a DDP strategy does: rank 0 alone saves (the others wait at a barrier), then every rank loads."""
    from pytreeckpt.integrations.lightning import PytreeCheckpointIO

    io = PytreeCheckpointIO()
    w = torch.arange(12.0).reshape(3, 4)
    if rank == 0:
        io.save_checkpoint({"state_dict": {"w": w}, "global_step": 5}, path)
    dist.barrier()
    got = io.load_checkpoint(path)
    return {"equal": torch.equal(got["state_dict"]["w"], w), "step": got["global_step"]}
