"""Flatten, unflatten and the JSON structure of random nested trees."""

from __future__ import annotations

import collections
import json
import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt.core._keys import keystr
from pytreeckpt.core._node import Node
from pytreeckpt.core._tree import flatten
from pytreeckpt.core._values import decode_value, encode_value

Point = collections.namedtuple("Point", "x y")
Triple = collections.namedtuple("Triple", ["first", "second", "third"])

keys = st.one_of(
    st.text(max_size=5),
    st.integers(-5, 2**40),
    st.booleans(),
    st.floats(allow_nan=False),
    st.none(),
    st.tuples(st.integers(0, 3), st.text(max_size=2)),
)
leaves = st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=5), st.none())
trees = st.recursive(
    leaves,
    lambda kids: st.one_of(
        st.dictionaries(keys, kids, max_size=4),
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.builds(Point, kids, kids),
        st.builds(Triple, kids, kids, kids),
        st.dictionaries(st.text(max_size=3), kids, max_size=3).map(collections.OrderedDict),
    ),
    max_leaves=16,
)


def _is_leaf(x: Any) -> bool:
    return x is None or isinstance(x, bool | int | float | str)


def _same(a: Any, b: Any) -> bool:
    """Equal trees: the same container types, keys in the same order, equal leaves (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return repr(a) == repr(b)
    return bool(a == b)


@given(trees)
def test_flatten_then_unflatten_is_identity(tree: Any) -> None:
    flat, paths, node = flatten(tree, _is_leaf)
    assert len(flat) == len(paths)
    assert _same(node.unflatten(flat), tree)
    assert node.paths() == paths
    assert len({tuple(p) for p in paths}) == len(paths)  # typed paths tell leaves apart


@given(trees)
def test_structure_round_trips_through_json(tree: Any) -> None:
    flat, paths, node = flatten(tree, _is_leaf)
    doc = json.dumps(node.to_json(), allow_nan=False)
    again = Node.from_json(json.loads(doc), len(flat))
    assert _same(again.unflatten(flat), tree)
    assert again.paths() == paths
    assert [keystr(p) for p in again.paths()] == [keystr(p) for p in paths]
    assert json.dumps(again.to_json(), allow_nan=False) == doc


@given(trees)
def test_plain_leaves_round_trip_through_json_exactly(tree: Any) -> None:
    flat, _, _ = flatten(tree, _is_leaf)
    for value in flat:
        again = decode_value(json.loads(json.dumps(encode_value(value), allow_nan=False)))
        assert _same(again, value)
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(again)


@given(trees)
def test_keys_made_while_flattening_are_the_paths_keys(tree: Any) -> None:
    named: list[str] = []
    flat, paths, _ = flatten(tree, _is_leaf, keys=named)
    assert named == [keystr(p) for p in paths]
    assert len(named) == len(flat)
