"""A save's metadata document is assembled from texts (its tree and user metadata serialised when
it plans, each array leaf's entry from the fragments its kind shares): byte for byte what
``json.dumps`` makes of the document as dicts."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pytreeckpt.core._dtypes import dtype_from_name
from pytreeckpt.core._node import Node
from pytreeckpt.format import (
    ArrayMeta,
    ChecksumFile,
    Compression,
    DocumentHead,
    SumsTemplate,
    array_leaf_heads,
    array_leaf_texts,
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
def test_array_leaf_texts_are_their_entries_serialised(cases: list[Any]) -> None:
    metas, crcs, hashes, refs = (list(x) for x in zip(*cases, strict=True)) if cases else ([], [], [], [])
    want = [_dumps(m.to_json(c, h, at)) for m, c, h, at in cases]
    assert array_leaf_texts(metas, crcs, hashes, refs) == want


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
    texts = iter(array_leaf_texts(metas, *([x[k] for x in cases] for k in (1, 2, 3))))
    mixed = [e if e["kind"] == "value" else next(texts) for e in entries]
    assert DocumentHead.of(tree, user).document(mixed, (m.database for m in metas), checksums) == want


@settings(max_examples=100)
@given(
    st.lists(leaves(), max_size=6),
    st.lists(st.binary(min_size=4, max_size=4), min_size=2, max_size=2),
    st.dictionaries(_TEXT, st.integers() | _TEXT, max_size=3),
)
def test_a_filled_template_is_the_document_of_dicts(
    cases: list[Any], rounds: list[bytes], user: dict[str, Any]
) -> None:
    """A document of arrays whose checksums are 4 bytes each, filled into its template (twice, as two saves
    of one tree do): the document ``json.dumps`` makes of it as dicts."""
    metas = [dataclasses.replace(m, compression=None, chunk_hashes=None) for m, *_ in cases]
    n = len(metas)
    tree = Node("dict", [("s", str(i)) for i in range(n)], [Node("leaf", leaf=i) for i in range(n)])
    head = DocumentHead.of(tree, user)
    heads = array_leaf_heads(metas)
    template = SumsTemplate([h for h in heads if h is not None], *head.frame(m.database for m in metas))
    for salt in rounds:
        crcs = [bytes(a ^ b for a, b in zip(salt, i.to_bytes(4, "little"), strict=True)) for i in range(n)]
        want = build_document(tree, [m.to_json(c, None, None) for m, c in zip(metas, crcs, strict=True)], user)
        with template.filled(b"".join(crcs)) as got:
            assert got == want
