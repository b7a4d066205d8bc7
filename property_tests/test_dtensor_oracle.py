"""pytreeckpt's regions for DTensor layouts agree with torch's own computation.

Two oracles, both torch's code: the private ``_compute_local_shape_and_global_offset``
for Shard/Replicate placements, and, for strided sharding (``_StridedShard``, as FSDP2
with TP makes), the values torch's placements put on each rank when they split a tensor
mesh axis by mesh axis. pytreeckpt itself only follows torch's chunking rule.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate as TReplicate
from torch.distributed.tensor.placement_types import Shard as TShard
from torch.distributed.tensor.placement_types import _StridedShard

from pytreeckpt import Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec, StridedShard


@st.composite
def dtensor_layouts(draw: st.DrawFn, strided: bool) -> tuple[tuple[int, ...], tuple[int, ...], list]:
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim)))
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["shard", "replicate", "strided"] if strided else ["shard", "replicate"]))
        dim = draw(st.integers(0, ndim - 1))
        if kind == "shard":
            placements.append(("shard", dim))
        elif kind == "replicate":
            placements.append(("replicate",))
        else:
            placements.append(("strided", dim, draw(st.integers(1, 4))))
    return mesh_shape, shape, placements


def _ours(p: tuple) -> object:
    return {"shard": lambda: Shard(p[1]), "replicate": Replicate, "strided": lambda: StridedShard(p[1], p[2])}[p[0]]()


def _torch(p: tuple) -> object:
    if p[0] == "shard":
        return TShard(p[1])
    if p[0] == "replicate":
        return TReplicate()
    return _StridedShard(p[1], split_factor=p[2])


def _coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    return [Mesh(mesh_shape).coordinate(r) for r in range(math.prod(mesh_shape))]


@given(dtensor_layouts(strided=False))
def test_regions_equal_torchs_local_shape_and_offset(layout: tuple) -> None:
    mesh_shape, shape, placements = layout
    spec = ShardingSpec(Mesh(mesh_shape), [_ours(p) for p in placements])
    for rank, coord in enumerate(_coordinates(mesh_shape)):
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coord), [_torch(p) for p in placements]
        )
        assert spec.local_shape(rank, shape) == tuple(local_shape)
        region = spec.region(rank, shape)
        assert region.shape == tuple(local_shape)
        if region.size:  # torch reports the end of the dim as the offset of an empty shard
            assert region.offset == tuple(offset), (rank, coord)


@given(dtensor_layouts(strided=True))
def test_local_shards_equal_the_values_torch_places_on_each_rank(layout: tuple) -> None:
    mesh_shape, shape, placements = layout
    g = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    leaf = ShardedLeaf.from_global(g, ShardingSpec(Mesh(mesh_shape), [_ours(p) for p in placements]))
    for rank, coord in enumerate(_coordinates(mesh_shape)):
        local = g
        for axis, p in enumerate(placements):
            if p[0] == "replicate":
                continue
            # torch's own split of what the previous mesh axes left, without padding
            shards, _ = _torch(p)._split_tensor(local, mesh_shape[axis], with_padding=False, contiguous=True)
            local = shards[coord[axis]]
        assert torch.equal(leaf.shards[rank], local), (rank, coord, placements)
