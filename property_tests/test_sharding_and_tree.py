"""Invariants of sharding specs and of the tree structure."""

from __future__ import annotations

import collections
import json
import math

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt import FlatRanges, Replicate, ShardingSpec
from pytreeckpt._sharding import flat_range_regions
from pytreeckpt._tree import Node, flatten
from pytreeckpt.testing import meshes, placements, shapes, specs


@st.composite
def mesh_specs(draw: st.DrawFn) -> tuple[ShardingSpec, tuple[int, ...]]:
    shape = draw(shapes())
    mesh = draw(meshes())
    return ShardingSpec(mesh, draw(placements(mesh, len(shape)))), shape


@given(mesh_specs())
def test_mesh_specs_cover_the_tensor_and_replicate_along_replicate_axes(case: tuple) -> None:
    spec, shape = case
    pieces = spec.rank_pieces(shape)
    counts = np.zeros(shape, dtype=np.int64)
    for rank_pieces in pieces:
        for p in rank_pieces:
            counts[p.region.slices()] += 1
    groups = math.prod(s for s, p in zip(spec.mesh.shape, spec.placements, strict=True) if p == Replicate())
    assert (counts == groups).all()  # every element held once per replica
    for r in range(spec.world_size):
        coord = spec.mesh.coordinate(r)
        for axis, p in enumerate(spec.placements):
            if p == Replicate():
                other = list(coord)
                other[axis] = (coord[axis] + 1) % spec.mesh.shape[axis]
                rank2 = int(np.ravel_multi_index(other, spec.mesh.shape))
                assert pieces[rank2] == pieces[r]
        local = spec.local_shape(r, shape)
        assert sum(p.region.size for p in pieces[r]) == math.prod(local)


@given(shapes(min_dims=0), st.data())
def test_flat_range_boxes_are_contiguous_and_concatenate_to_the_range(shape: tuple, data: st.DataObject) -> None:
    n = math.prod(shape)
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    flat = np.arange(n).reshape(shape)
    boxes = flat_range_regions(shape, a, b)
    got = np.concatenate([flat[box.slices()].reshape(-1) for box in boxes]) if boxes else np.zeros(0, int)
    assert got.tolist() == list(range(a, b))
    for box in boxes:
        values = flat[box.slices()].reshape(-1)
        assert values.tolist() == list(range(int(values[0]), int(values[0]) + len(values)))  # contiguous


@given(shapes(), st.data())
def test_from_global_then_to_global_is_identity(shape: tuple, data: st.DataObject) -> None:
    from pytreeckpt import ShardedLeaf

    spec = data.draw(specs(shape))
    t = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    leaf = ShardedLeaf.from_global(t, spec)
    assert torch.equal(leaf.to_global(), t)
    if isinstance(spec, FlatRanges):
        for r, (lo, hi) in enumerate(spec.ranges):
            assert leaf.shards[r].tolist() == list(range(lo, hi))


Point = collections.namedtuple("Point", "x y")
keys = st.one_of(st.text(max_size=5), st.integers(-5, 5))
leaves = st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.text(max_size=5), st.none())
trees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.dictionaries(keys, kids, max_size=4),
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.builds(Point, kids, kids),
        st.dictionaries(st.text(max_size=3), kids, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=12,
)


@given(trees)
def test_structure_round_trips_through_json(tree: object) -> None:
    is_leaf = lambda x: not isinstance(x, dict | list | tuple)  # noqa: E731
    flat, paths, node = flatten(tree, is_leaf)
    again = Node.from_json(json.loads(json.dumps(node.to_json())), len(flat))
    rebuilt = again.unflatten(flat)
    assert rebuilt == tree
    assert type(rebuilt) is type(tree)
    assert again.paths() == paths
    if isinstance(tree, dict):
        assert list(rebuilt) == list(tree)  # insertion order kept
