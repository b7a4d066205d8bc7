"""The metadata parser's typed decode and its memo of array leaves alike: a document parses to the same
leaves, or fails with the same error, as its JSON does leaf by leaf in full (the typed decode refuses what
has not the types the parse wants; the memo only skips checks of what equals a leaf parsed before)."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any
from unittest import mock

from hypothesis import event, given, settings
from hypothesis import strategies as st

from pytreeckpt.core._errors import MetadataError
from pytreeckpt.format import ArrayMeta, parse_document
from pytreeckpt.format import _parse as document_module

_LEAF = {
    "kind": "array",
    "container": "torch",
    "dtype": "float32",
    "storage_dtype": "float32",
    "shape": [3, 2],
    "chunk_shape": [3, 2],
    "layout": None,
    "database": "packed/0",
    "chunk_crc32c": "XbVgKw==",
}
_LAYOUT = {"kind": "mesh", "mesh": {"shape": [2], "axis_names": ["dp"]}, "placements": [{"kind": "shard", "dim": 0}]}

# What one field of a leaf may be changed to: values of the right and of the wrong kind.
_CHANGES: dict[str, list[Any]] = {
    "key": [0, None, "", "x.y", ["k"], "k\u00e9"],
    "path": ["arrays/ok", "arrays/../x", "arrays/w\n", "arrays/", "other/w", 7, None, "arrays/a/b", "arrays/.x"],
    "chunk_crc32c": [None, "", "AAAAAA==", "AAAA", 5, "!!!!!!==", ["XbVgKw=="]],
    "chunk_crc32c_at": [
        None,
        [0, 7],
        [36, 7],
        [40, 7],
        [-4, 7],
        [0, 2**32],
        [0, True],
        [0.0, 7],
        [0],
        "0,7",
        5,
        [2**70, 7],
        [0, 7, 1],
    ],
    "layout": [
        _LAYOUT,
        {"kind": "mesh"},
        3,
        {"kind": "nope"},
        {**_LAYOUT, "mesh": {"shape": [2.0], "axis_names": ["dp"]}},
        {**_LAYOUT, "mesh": {"shape": [True], "axis_names": ["dp"]}},
    ],
    "dtype": ["int8", "bfloat16", "float64", "nope", 4],
    "storage_dtype": ["int8", "uint16", None],
    "container": ["numpy", "jax", None],
    "shape": [[3, True], [3.0, 2], [3], [3, 2, 1], [-3, 2], "3,2", [3, 2], [2**70, 2], [], [3, None]],
    "chunk_shape": [[1, 2], [3, 0], [True, 2], [3, 2.0], [3]],
    "database": [None, "packed/1", "ocdbt/0", "packed/01", "packed/0~g2", 0, "../x"],
    "compression": [{"id": "zstd", "level": 3}, {"id": "nope"}, 5],
    "chunk_hashes": [["0" * 32], "x", [1]],
    "kind": ["value", "other", None, 1],
    "value": [1, ["f", "nan"], [1, 2], None],
    "extra": ["anything"],
}


def _make(n: int, changes: list[tuple[int, str, Any]], drop: list[tuple[int, str]], in_file: bool = False) -> bytes:
    """``n`` leaves alike but for their keys and paths, then changed; ``in_file``: their checksums in the
    document's checksums file (40 bytes: 4 for each leaf's one chunk) rather than in the document."""
    leaves = []
    for i in range(n):
        leaf = copy.deepcopy(_LEAF)
        leaf.update(key=f"w{i}", path=f"arrays/w{i}")
        if in_file:
            del leaf["chunk_crc32c"]
            leaf["chunk_crc32c_at"] = [4 * i, 7]
        leaves.append(leaf)
    for i, field, value in changes:
        leaves[i % n][field] = value
    for i, field in drop:
        leaves[i % n].pop(field, None)
    tree = {"k": "dict", "keys": [f"w{i}" for i in range(n)], "c": list(range(n))}
    doc = {"format": "pytreeckpt", "version": 3, "tree": tree, "leaves": leaves, "user_metadata": {}}
    if in_file:
        doc["checksums"] = {"path": "checksums/crc32c", "bytes": 40}
    return json.dumps(doc).encode()


def _parsed(raw: bytes) -> tuple[str, Any]:
    try:
        doc = parse_document(raw)
    except MetadataError as e:
        return "error", str(e)
    # (the fields ArrayMeta's equality leaves out, its checksums' among them, are compared here: every
    # field, which also finds one the memo's constructor left unset)
    sums = [
        tuple(getattr(leaf, f.name) for f in dataclasses.fields(leaf) if f.name != "crc32c_file")
        if isinstance(leaf, ArrayMeta)
        else None
        for leaf in doc.leaves
    ]
    files = {id(leaf.crc32c_file) for leaf in doc.leaves if getattr(leaf, "crc32c_file", None) is not None}
    assert files <= {id(doc.checksums)}
    return "ok", (doc.leaves, doc.tree.to_json(), sums)


_CHANGE = st.sampled_from(sorted(_CHANGES)).flatmap(
    lambda f: st.tuples(st.integers(0, 7), st.just(f), st.sampled_from(_CHANGES[f]))
)


@settings(max_examples=300)
@given(
    st.integers(2, 8),
    st.lists(_CHANGE, max_size=4),
    st.lists(st.tuples(st.integers(0, 7), st.sampled_from([*sorted(_LEAF), "chunk_crc32c_at"])), max_size=2),
    st.booleans(),
)
def test_the_memo_parses_as_the_full_parse(
    n: int, changes: list[tuple[int, str, Any]], drop: list[Any], in_file: bool
) -> None:
    raw = _make(n, changes, drop, in_file)
    with_memo = _parsed(raw)
    with _in_full():
        in_full = _parsed(raw)
    event(with_memo[0])
    assert with_memo == in_full


@settings(max_examples=300)
@given(st.integers(2, 6), _CHANGE, st.booleans())
def test_one_leaf_unlike_the_one_before(n: int, change: tuple[int, str, Any], in_file: bool) -> None:
    """One field of a leaf after the first (whose parse the memo holds) changed: the case the memo must tell."""
    i, field, value = change
    raw = _make(n, [(1 + i % (n - 1), field, value)], [], in_file)
    with_memo = _parsed(raw)
    with _in_full():
        in_full = _parsed(raw)
    event(f"{field}: {with_memo[0]}")
    assert with_memo == in_full


def _in_full() -> Any:
    """The parse of the document's JSON, leaf by leaf in full, without the typed decode."""
    return mock.patch.object(document_module, "_parse_typed", side_effect=ValueError("not typed"))


def test_the_memo_is_used() -> None:
    """(So the properties above compare two paths: a document is decoded by type, and leaves alike are
    parsed through the memo.)"""
    calls = []
    real = document_module._parse_alike

    def spy(*a: Any) -> Any:
        got = real(*a)
        calls.append(got is not None)
        return got

    untyped = mock.patch.object(document_module, "_parse_leaf", wraps=document_module._parse_leaf)
    for in_file in (False, True):
        calls.clear()
        with mock.patch.object(document_module, "_parse_alike", spy), untyped as full:
            parse_document(_make(4, [], [], in_file))
        assert calls == [True, True, True]
        assert full.call_count == 1  # (the first leaf of its kind)


def test_every_change_in_the_catalogue() -> None:
    """Each value of each field above, on a leaf after the first, with the checksums in the document and in a
    file: all of them, so that none is left to sampling (a rare value is the one a memo gets wrong)."""
    for in_file in (False, True):
        for field, values in _CHANGES.items():
            for value in values:
                raw = _make(3, [(1, field, value)], [], in_file)
                with_memo = _parsed(raw)
                with _in_full():
                    in_full = _parsed(raw)
                assert with_memo == in_full, (in_file, field, value)
