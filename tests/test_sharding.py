"""Sharding specs: torch's chunking rule, meshes, irregular layouts."""

from __future__ import annotations

import pytest
import torch

from pytreeckpt import (
    ExplicitRegions,
    FlatRanges,
    LayoutError,
    Mesh,
    Region,
    Replicate,
    Shard,
    ShardingSpec,
    StridedShard,
)
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._sharding import chunk_size_and_offset, flat_range_regions, layout_from_json


@pytest.mark.parametrize("size", range(13))
@pytest.mark.parametrize("parts", range(1, 7))
def test_chunking_follows_torch_chunk(size: int, parts: int) -> None:
    chunks = list(torch.arange(size).chunk(parts)) if size else []
    sizes = [len(c) for c in chunks] + [0] * (parts - len(chunks))
    offsets = [int(c[0]) for c in chunks if len(c)]
    for i in range(parts):
        got_size, got_off = chunk_size_and_offset(size, parts, i)
        assert got_size == sizes[i]
        if got_size:
            assert got_off == offsets[i]


def test_mesh_rank_order_is_row_major() -> None:
    mesh = Mesh((2, 3, 2), ("pp", "dp", "tp"))
    assert [mesh.coordinate(r) for r in (0, 1, 2, 11)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 2, 1)]
    with pytest.raises(LayoutError):
        Mesh((2, 0))
    with pytest.raises(LayoutError, match="distinct"):
        Mesh((2, 2), ("a", "a"))


def test_two_mesh_axes_on_one_dim_split_in_axis_order() -> None:
    spec = ShardingSpec(Mesh((2, 2)), [Shard(0), Shard(0)])
    regions = [spec.region(r, (10, 3)) for r in range(4)]
    # 10 -> 5 | 5, then each 5 -> 3 | 2
    assert [(r.offset[0], r.shape[0]) for r in regions] == [(0, 3), (3, 2), (5, 3), (8, 2)]


def test_uneven_sizes_leave_trailing_shards_empty() -> None:
    spec = ShardingSpec(Mesh(4), [Shard(0)])
    assert [spec.local_shape(r, (5, 2)) for r in range(4)] == [(2, 2), (2, 2), (1, 2), (0, 2)]
    assert spec.rank_pieces((5, 2))[3] == ()


def test_strided_shard_rank_holds_separate_rows() -> None:
    spec = ShardingSpec(Mesh(4), [StridedShard(0, 2)])
    pieces = spec.rank_pieces((8, 3))[0]
    assert [p.region for p in pieces] == [Region((0, 0), (1, 3)), Region((4, 0), (1, 3))]
    assert [p.local_box for p in pieces] == [(0, 0), (1, 0)]
    with pytest.raises(LayoutError, match="use rank_pieces"):
        spec.region(0, (8, 3))


def test_flat_ranges_decompose_into_row_major_boxes() -> None:
    assert flat_range_regions((2, 3, 4), 5, 19) == [
        Region((0, 1, 1), (1, 1, 3)),
        Region((0, 2, 0), (1, 1, 4)),
        Region((1, 0, 0), (1, 1, 4)),
        Region((1, 1, 0), (1, 1, 3)),
    ]
    assert flat_range_regions((), 0, 1) == [Region((), ())]
    with pytest.raises(LayoutError, match="rank 1: flat range ends at 13"):
        FlatRanges([(0, 6), (6, 13)]).rank_pieces((3, 4))


def test_explicit_regions_check_bounds_and_local_shapes() -> None:
    spec = ExplicitRegions([[((0, 0), (2, 2)), ((2, 0), (1, 2))], [((0, 0), (3, 2))]])
    assert spec.local_shape(0, (3, 2)) == (6,)
    assert spec.local_shape(1, (3, 2)) == (3, 2)
    with pytest.raises(LayoutError, match="rank 0: box"):
        ExplicitRegions([[((0, 0), (4, 2))]]).rank_pieces((3, 2))


@pytest.mark.parametrize(
    "spec",
    [
        ShardingSpec(Mesh((2, 2), ("dp", "tp")), [StridedShard(0, 2), Shard(0)]),
        ShardingSpec(Mesh(3), Replicate()),
        FlatRanges([(0, 3), (3, 9)]),
        ExplicitRegions([[((0,), (2,))], []]),
    ],
)
def test_specs_round_trip_through_json(spec: object) -> None:
    assert layout_from_json(spec.to_json()) == spec  # type: ignore[attr-defined]


def test_region_arithmetic() -> None:
    a = Region((0, 0), (4, 4))
    b = Region((2, 2), (4, 4))
    assert a.intersect(b) == Region((2, 2), (2, 2))
    assert a.intersect(Region((4, 0), (1, 1))) is None
    parts = a.subtract(b)
    assert sum(p.size for p in parts) == 12
    assert all(p.intersect(b) is None for p in parts)
    assert list(ChunkGrid((6,), (2,)).touching(Region((1,), (5,)))) == [(0,), (1,), (2,)]
