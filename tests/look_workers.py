"""Workers for tests/test_cli_look.py: checkpoints saved by 4 real ranks, for ``diff`` and ``inspect`` to look into."""

from __future__ import annotations

import torch

import pytreeckpt
from pytreeckpt import ChunkingOptions, FlatRanges, Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec

SMALL_CHUNKS = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=1024)
"""Chunks of at most 1 KiB: a few KiB leaf is many chunks."""


def tensors() -> dict[str, torch.Tensor]:
    """The global tensors of :func:`sharded_state`, the same in every process."""
    g = torch.Generator().manual_seed(0)
    return {
        "grid": torch.randn(64, 48, generator=g),
        "rep": torch.randn(32, 16, generator=g),
        "flat": torch.randn(100, generator=g).bfloat16(),
        "small": torch.arange(6.0),
    }


def layouts(world: int) -> dict[str, pytreeckpt.Layout]:
    """``grid``: rows and columns split on a 2 x 2 mesh; ``rep``: replicated along the mesh's first axis,
    rows split along its second; ``flat``: uneven flat ranges (rank r holds 10, 20, 30 and 40 elements)."""
    mesh = Mesh((2, world // 2))
    return {
        "grid": ShardingSpec(mesh, [Shard(0), Shard(1)]),
        "rep": ShardingSpec(mesh, [Replicate(), Shard(0)]),
        "flat": FlatRanges([(0, 10), (10, 30), (30, 60), (60, 100)]),
    }


def sharded_state(ranks: list[int] | None, world: int, scale: float) -> dict[str, object]:
    """The state as ``ranks`` (all when None) hold it, ``grid`` times ``scale``."""
    t = tensors()
    specs = layouts(world)
    return {
        "grid": ShardedLeaf.from_global(t["grid"] * scale, specs["grid"], ranks),
        "rep": ShardedLeaf.from_global(t["rep"], specs["rep"], ranks),
        "flat": ShardedLeaf.from_global(t["flat"], specs["flat"], ranks),
        "small": t["small"],
        "step": 7,
    }


def save_two(rank: int, world: int, a: str, b: str) -> None:
    """Two checkpoints saved by ``world`` ranks in 1 KiB chunks, differing only in ``grid`` (doubled in ``b``)."""
    pytreeckpt.save(a, sharded_state([rank], world, 1.0), chunking=SMALL_CHUNKS)
    pytreeckpt.save(b, sharded_state([rank], world, 2.0), chunking=SMALL_CHUNKS)
