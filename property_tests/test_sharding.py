"""Invariants of sharding specs: coverage, replication, agreement with torch's chunking, flat ranges."""

from __future__ import annotations

import json
import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt import FlatRanges, Layout, Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec, StridedShard
from pytreeckpt.core._sharding import flat_range_regions, layout_from_json
from pytreeckpt.testing import meshes, placements, shapes, specs


@st.composite
def mesh_specs(draw: st.DrawFn, strided: bool = True) -> tuple[ShardingSpec, tuple[int, ...]]:
    shape = draw(shapes())
    mesh = draw(meshes())
    return ShardingSpec(mesh, draw(placements(mesh, len(shape), strided=strided))), shape


def _rank_of(mesh: Mesh, coord: list[int]) -> int:
    return int(np.ravel_multi_index(coord, mesh.shape))


@given(mesh_specs())
def test_mesh_specs_cover_the_tensor_once_per_replica(case: tuple[ShardingSpec, tuple[int, ...]]) -> None:
    spec, shape = case
    counts = np.zeros(shape, dtype=np.int64)
    for rank_pieces in spec.rank_pieces(shape):
        for p in rank_pieces:
            counts[p.region.slices()] += 1
    replicas = math.prod(n for n, p in zip(spec.mesh.shape, spec.placements, strict=True) if p == Replicate())
    assert (counts == replicas).all()


@given(mesh_specs())
def test_ranks_differing_only_along_replicate_axes_hold_the_same_regions(
    case: tuple[ShardingSpec, tuple[int, ...]],
) -> None:
    spec, shape = case
    pieces = spec.rank_pieces(shape)
    for rank in range(spec.world_size):
        coord = spec.mesh.coordinate(rank)
        for axis, p in enumerate(spec.placements):
            if p != Replicate():
                continue
            for c in range(spec.mesh.shape[axis]):
                other = _rank_of(spec.mesh, [*coord[:axis], c, *coord[axis + 1 :]])
                assert pieces[other] == pieces[rank]
                assert spec.local_shape(other, shape) == spec.local_shape(rank, shape)


def _reference_indices(spec: ShardingSpec, shape: tuple[int, ...], rank: int) -> list[torch.Tensor]:
    """Per dim, the global indices ``rank`` holds: torch.chunk applied in mesh-axis order, as DTensor does.

    ``torch.chunk`` may return fewer than ``n`` chunks; the missing trailing ones are empty.
    """
    idx = [torch.arange(s) for s in shape]
    coord = spec.mesh.coordinate(rank)
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            parts = torch.chunk(idx[p.dim], spec.mesh.shape[axis]) if shape[p.dim] else ()
            idx[p.dim] = parts[coord[axis]] if coord[axis] < len(parts) else idx[p.dim][:0]
    return idx


@given(mesh_specs(strided=False))
def test_mesh_spec_shards_agree_with_torch_chunk(case: tuple[ShardingSpec, tuple[int, ...]]) -> None:
    spec, shape = case
    g = torch.arange(math.prod(shape), dtype=torch.int64).reshape(shape)
    leaf = ShardedLeaf.from_global(g, spec)
    for rank in range(spec.world_size):
        idx = _reference_indices(spec, shape, rank)
        expected = g[np.ix_(*[i.numpy() for i in idx])] if shape else g
        assert spec.local_shape(rank, shape) == tuple(expected.shape)
        assert torch.equal(leaf.shards[rank], expected)
        region = spec.region(rank, shape)
        assert region.shape == tuple(len(i) for i in idx)
        for d, i in enumerate(idx):
            if len(i):
                assert region.offset[d] == int(i[0])
                assert torch.equal(i, torch.arange(region.offset[d], region.offset[d] + len(i)))


@st.composite
def flat_ranges(draw: st.DrawFn) -> tuple[FlatRanges, tuple[int, ...]]:
    shape = draw(shapes())
    n = math.prod(shape)
    ranges = []
    for _ in range(draw(st.integers(1, 5))):
        a = draw(st.integers(0, n))
        ranges.append((a, draw(st.integers(a, n))))
    return FlatRanges(ranges), shape


@given(flat_ranges())
def test_flat_range_pieces_are_contiguous_and_concatenate_to_the_range(
    case: tuple[FlatRanges, tuple[int, ...]],
) -> None:
    spec, shape = case
    flat = np.arange(math.prod(shape)).reshape(shape)
    for (a, b), pieces in zip(spec.ranges, spec.rank_pieces(shape), strict=True):
        position = 0
        values = []
        for p in pieces:
            assert not p.region.is_empty
            assert p.local_box is None
            assert p.local_offset == position  # pieces sit one after the other in the local tensor
            v = flat[p.region.slices()].reshape(-1)
            assert v.tolist() == list(range(int(v[0]), int(v[0]) + v.size))  # contiguous in row-major order
            values.append(v)
            position += v.size
        got = np.concatenate(values).tolist() if values else []
        assert got == list(range(a, b))
        assert len(pieces) <= max(1, 2 * len(shape) - 1)
        assert flat_range_regions(shape, a, b) == [p.region for p in pieces]


@given(shapes(), st.data())
def test_any_complete_layout_cuts_and_reassembles_a_tensor(shape: tuple[int, ...], data: st.DataObject) -> None:
    spec = data.draw(specs(shape))
    t = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    leaf = ShardedLeaf.from_global(t, spec)
    assert torch.equal(leaf.to_global(), t)
    for rank, pieces in enumerate(spec.rank_pieces(shape)):
        local = leaf.shards[rank]
        assert tuple(local.shape) == spec.local_shape(rank, shape)
        assert sum(p.region.size for p in pieces) == local.numel()  # pieces fill the local tensor


@given(shapes(), st.data())
def test_layouts_round_trip_through_json(shape: tuple[int, ...], data: st.DataObject) -> None:
    spec: Layout = data.draw(specs(shape, complete=False))
    again = layout_from_json(json.loads(json.dumps(spec.to_json())))
    assert again == spec
    assert again.rank_pieces(shape) == spec.rank_pieces(shape)


@given(mesh_specs(), mesh_specs(), st.sampled_from(["same", "other", "renamed", "other placements"]))
def test_spec_equality_is_the_equality_of_its_mesh_and_placements(
    a: tuple[ShardingSpec, tuple[int, ...]], b: tuple[ShardingSpec, tuple[int, ...]], how: str
) -> None:
    """(ShardingSpec compares a key of plain values made once, not its fields one by one: the same verdict.)"""
    x = a[0]
    mesh = Mesh(x.mesh.shape, [f"{n}'" for n in x.mesh.axis_names] if how == "renamed" else x.mesh.axis_names)
    y = {
        "same": ShardingSpec(mesh, list(x.placements)),
        "renamed": ShardingSpec(mesh, list(x.placements)),
        "other placements": ShardingSpec(mesh, list(b[0].placements)),
        "other": b[0],
    }[how]
    fields_equal = x.mesh.shape == y.mesh.shape and x.mesh.axis_names == y.mesh.axis_names
    fields_equal = fields_equal and len(x.placements) == len(y.placements)
    fields_equal = fields_equal and all(
        type(p) is type(q) and p == q for p, q in zip(x.placements, y.placements, strict=False)
    )
    assert (x == y) is fields_equal
    assert (x != y) is not fields_equal
    if fields_equal:
        assert hash(x) == hash(y)
        assert x is not y


@st.composite
def fsdp_tp_specs(draw: st.DrawFn, matched: bool = False) -> tuple[ShardingSpec, tuple[int, ...]]:
    """FSDP2 with tensor parallelism: ``StridedShard`` then ``Shard`` (maybe more) on one dim, sides of any
    remainder, so that a position's window of its strided runs lies in one run or spans several.

    ``matched``: the split factor is the size of the ``Shard`` axis, as FSDP2 makes it."""
    dims = draw(st.integers(1, 2))
    dim = draw(st.integers(0, dims - 1))
    shape = tuple(draw(st.integers(0, 40)) for _ in range(dims))
    sizes = draw(st.lists(st.integers(1, 5), min_size=2, max_size=3))
    split = sizes[1] if matched else draw(st.integers(1, 4))
    rest: list[Shard | Replicate] = [
        draw(st.sampled_from([Shard(dim), Replicate(), Shard(dims - 1 - dim)])) for _ in sizes[2:]
    ]
    return ShardingSpec(Mesh(tuple(sizes)), [StridedShard(dim, split), Shard(dim), *rest]), shape


@given(fsdp_tp_specs() | fsdp_tp_specs(matched=True))
def test_the_piece_table_of_a_strided_then_plain_shard_holds_every_positions_pieces(
    case: tuple[ShardingSpec, tuple[int, ...]],
) -> None:
    """(The table takes a window within one run without keeping the row's empty runs: the same pieces.)"""
    from pytreeckpt.plan._tables import _mesh_table

    spec, shape = case
    table = _mesh_table(spec, shape)
    want = tuple(tuple(p.region for p in ps if not p.region.is_empty) for ps in spec.rank_pieces(shape))
    assert tuple(tuple(p.region for p in ps) for ps in table.pieces()) == want


@given(mesh_specs())
def test_the_piece_table_holds_every_positions_pieces(case: tuple[ShardingSpec, tuple[int, ...]]) -> None:
    """The planner's columnar table of a mesh layout (made for all positions at once) is, position by
    position, what ``rank_pieces`` gives one at a time (less a zero-size array's empty pieces)."""
    from pytreeckpt.plan._tables import _mesh_table

    spec, shape = case
    table = _mesh_table(spec, shape)
    want = tuple(tuple(p.region for p in ps if not p.region.is_empty) for ps in spec.rank_pieces(shape))
    assert tuple(tuple(p.region for p in ps) for ps in table.pieces()) == want


@given(fsdp_tp_specs(matched=True) | fsdp_tp_specs() | mesh_specs())
def test_the_closed_form_of_a_strided_then_plain_shard_makes_the_table_the_loop_makes(
    case: tuple[ShardingSpec, tuple[int, ...]],
) -> None:
    """Where ``_nested_runs`` computes a dim's runs in closed form, the table is, column for column, the one
    the general loop over the placements makes."""
    from unittest import mock

    from pytreeckpt.plan import _tables

    spec, shape = case
    fast = _tables._mesh_table(spec, shape)
    with mock.patch.object(_tables, "_nested_runs", return_value=None):
        loop = _tables._mesh_table(spec, shape)
    assert fast.positions == loop.positions
    assert fast.disjoint == loop.disjoint
    for name in ("pos", "piece", "lo", "ext"):
        assert np.array_equal(getattr(fast, name), getattr(loop, name)), name
