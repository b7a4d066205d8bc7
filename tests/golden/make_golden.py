"""Writes tests/golden/v1: a small checkpoint of format version 1, committed to the repository.

Run only when the format version changes (into a new directory): test_golden.py checks
that every committed version still loads with today's code.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

import torch

import pytreeckpt
from pytreeckpt import FlatRanges, Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec, StridedShard

Point = collections.namedtuple("Point", "x y")


def golden_state() -> dict[str, Any]:
    """Deterministic values (no random numbers), so the test can rebuild them."""
    g = torch.arange(60, dtype=torch.float32).reshape(6, 10) / 7
    return {
        "model": {
            "w": ShardedLeaf.from_global(g, ShardingSpec(Mesh((2, 2), ("dp", "tp")), [StridedShard(0, 2), Shard(0)])),
            "flat": ShardedLeaf.from_global(g.to(torch.bfloat16), FlatRanges([(0, 17), (17, 17), (17, 60)])),
            "rep": ShardedLeaf.from_global(torch.arange(5, dtype=torch.int64), ShardingSpec(Mesh(3), [Replicate()])),
        },
        "optim": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 2), -0.0)}}, "lr": 1e-3},
        "dtypes": {
            "f8": torch.arange(8, dtype=torch.float32).to(torch.float8_e4m3fn),
            "c64": torch.arange(4, dtype=torch.float32).to(torch.complex64) * 1j,
            "b": torch.tensor([True, False, True]),
            "u16": torch.arange(3, dtype=torch.int32).to(torch.uint16),
        },
        "point": Point(1, "two"),
        "step": 3,
        "nan": float("nan"),
        "none": None,
    }


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "v1"
    pytreeckpt.save(out, golden_state(), chunking=pytreeckpt.ChunkingOptions(single_chunk_bytes=64, max_chunk_bytes=64))
    print(f"wrote {out}")
