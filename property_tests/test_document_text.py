"""A save's metadata document is assembled from texts (its tree and user metadata serialised when
it plans, each array leaf's entry from the fragments its kind shares): byte for byte what
``json.dumps`` makes of the document as dicts."""

from __future__ import annotations

import json
import operator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pytreeckpt.core._dtypes import dtype_from_name
from pytreeckpt.core._tree import Node
from pytreeckpt.format._document import (
    ArrayMeta,
    ChecksumFile,
    Compression,
    DocumentHead,
    array_leaf_parts,
    build_document,
)
from pytreeckpt.testing import shapes, specs

_TEXT = st.text(max_size=10)  # (any code point, lone surrogates too: json.dumps escapes them)


def _dumps(x: Any) -> str:
    return json.dumps(x, allow_nan=False, separators=(",", ":"), check_circular=False)


@st.composite
def leaves(draw: st.DrawFn) -> tuple[ArrayMeta, bytes | None, tuple[str, ...] | None, tuple[int, int] | None]:
    shape = draw(shapes(max_side=5))
    layout = draw(st.none() | specs(shape))
    chunk = tuple(draw(st.integers(1, 6)) for _ in shape)
    compression = draw(st.none() | st.sampled_from([Compression("zstd"), Compression("blosc", level=5)]))
    meta = ArrayMeta(
        draw(_TEXT),
        draw(st.sampled_from(["torch", "numpy"])),
        dtype_from_name(draw(st.sampled_from(["float32", "bfloat16", "int8", "complex64", "bool"]))),
        shape,
        chunk,
        draw(_TEXT),
        layout,
        compression,
        draw(st.none() | st.tuples(st.just("0" * 32))),
        draw(st.none() | st.sampled_from(["packed/0", "ocdbt/3", "packed/ü"])),
        draw(st.none() | st.binary(min_size=4, max_size=8)),
    )
    crc = draw(st.none() | st.binary(max_size=12))
    hashes = draw(st.none() | st.just(()) | st.tuples(st.just("ab" * 16)))
    at = draw(st.none() | st.tuples(st.integers(0, 2**40), st.integers(0, 2**32 - 1)))
    return meta, crc, hashes, at


@settings(max_examples=100)  # (a deterministic encoder: 100 examples of every kind of field suffice)
@given(st.lists(leaves(), max_size=8))
def test_array_leaf_parts_are_their_entries_serialised(cases: list[Any]) -> None:
    metas, crcs, hashes, refs = (list(x) for x in zip(*cases, strict=True)) if cases else ([], [], [], [])
    want = [_dumps(m.to_json(c, h, at)) for m, c, h, at in cases]
    assert list(map(operator.add, *array_leaf_parts(metas, crcs, hashes, refs))) == want


@settings(max_examples=100)
@given(
    st.lists(leaves(), max_size=5),
    st.dictionaries(_TEXT, st.integers() | _TEXT | st.floats(allow_nan=False, allow_infinity=False), max_size=3),
    st.booleans(),
    st.lists(st.integers(0, 4), max_size=3),
)
def test_a_document_of_texts_is_the_document_of_dicts(
    cases: list[Any], user: dict[str, Any], in_file: bool, values_at: list[int]
) -> None:
    metas = [m for m, *_ in cases]
    entries: list[dict[str, Any]] = [m.to_json(c, h, at) for m, c, h, at in cases]
    for i in values_at:  # value leaves among the arrays
        entries.insert(min(i, len(entries)), {"kind": "value", "key": "v", "value": {"int": i}})
    n = len(entries)
    tree = Node("dict", [("s", str(i)) for i in range(n)], [Node("leaf", leaf=i) for i in range(n)])
    checksums = ChecksumFile("checksums/crc32c.2", 40) if in_file else None
    databases = {d for m in metas if isinstance(d := m.database, str)}
    doc: dict[str, Any] = {
        "format": "pytreeckpt",
        "version": 3 if any(d.startswith("packed/") for d in databases) else 2 if databases else 1,
        "tree": tree.to_json(),
        "leaves": entries,
        "user_metadata": user,
    }
    if checksums is not None:
        doc["checksums"] = checksums.to_json()
    want = _dumps(doc).encode()
    assert build_document(tree, entries, user, checksums) == want
    texts = map(operator.add, *array_leaf_parts(metas, *([x[k] for x in cases] for k in (1, 2, 3))))
    mixed = [e if e["kind"] == "value" else next(texts) for e in entries]
    assert DocumentHead.of(tree, user).document(mixed, (m.database for m in metas), checksums) == want
    if not values_at:  # arrays only: a save joins their parts into the document at once
        heads, tails = array_leaf_parts(metas, *([x[k] for x in cases] for k in (1, 2, 3)))
        got = DocumentHead.of(tree, user).document_of_parts(heads, tails, (m.database for m in metas), checksums)
        assert got == want
