"""The bounds on what reading a metadata document takes hold: for any JSON text, decoding it (by json.loads,
as the parse of the JSON does, or by msgspec, as the typed parse does) takes at most
``parse_memory_bound`` of it; for any tree structure, rebuilding it (its Node objects, the containers
``metadata`` makes, the leaf indices checked) at most ``tree_memory_bound`` beyond its JSON. Each is
measured by tracemalloc on many copies of a random value, so what each copy takes is what is bounded."""

from __future__ import annotations

import collections
import json
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt.core._node import Node
from pytreeckpt.core._tree import flatten
from pytreeckpt.format._parse import _leaf_ids, parse_memory_bound, tree_memory_bound

_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=6)
_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-300, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    _TEXT,
)
_JSON = st.recursive(
    _SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(_TEXT, kids, max_size=4)), max_leaves=8
)
_COPIES = 2000
_TREE_COPIES = 200


def _peak(make: Callable[[], Any]) -> int:
    """The most memory ``make()`` took while it ran (what it returns is kept until it is measured)."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        kept = make()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del kept
    return peak


@given(_JSON, st.booleans())
def test_decoding_a_documents_json_takes_at_most_its_bound(value: Any, ascii_only: bool) -> None:
    one = json.dumps(value, separators=(",", ":"), ensure_ascii=ascii_only)
    raw = ("[" + ",".join([one] * _COPIES) + "]").encode()
    bound = parse_memory_bound(raw)
    assert _peak(lambda: json.loads(raw)) <= bound
    assert _peak(lambda: msgspec.json.decode(raw)) <= bound


Point = collections.namedtuple("Point", "x y")
_KEYS = st.one_of(st.text(max_size=4), st.integers(-5, 2**40), st.booleans())
_TREES = st.recursive(
    st.integers(0, 9),
    lambda kids: st.one_of(
        st.dictionaries(_KEYS, kids, max_size=4),
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.lists(kids, max_size=4).map(collections.deque),
        st.builds(Point, kids, kids),
        st.dictionaries(st.text(max_size=3), kids, max_size=3).map(collections.OrderedDict),
        st.dictionaries(st.text(max_size=3), kids, max_size=3).map(lambda d: collections.defaultdict(list, d)),
    ),
    max_leaves=12,
)


def _not_imported(tree: Any, n: int) -> Any:
    """The structure's JSON with each namedtuple's type one not imported (``nowhere:T<n>``): one is made."""
    if isinstance(tree, dict):
        out = {k: _not_imported(v, n) for k, v in tree.items()}
        if out.get("k") == "namedtuple":
            out["type"] = f"nowhere:T{n}"
        return out
    if isinstance(tree, list):
        return [_not_imported(v, n) for v in tree]
    return tree


@given(_TREES, st.booleans())
def test_rebuilding_a_tree_structure_takes_at_most_its_bound(value: Any, imported: bool) -> None:
    leaves, _, node = flatten(value, lambda x: type(x) is int)
    one = node.to_json()
    copies = [one if imported else _not_imported(one, i % 7) for i in range(_TREE_COPIES)]
    tree = {"k": "list", "c": copies}
    count = max(1, len(leaves))

    def rebuild() -> Any:
        structure = Node.from_json(tree, count)
        return structure, _leaf_ids(structure), structure.unflatten([0] * count)

    assert _peak(rebuild) <= tree_memory_bound(tree)
