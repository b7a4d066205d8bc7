"""What the writer names, its reader accepts: over the whole generation space.

A save beside a committed checkpoint names its arrays, databases and checksums file with
a generation (``arrays/w~g7``) that the committed document does not use, and the reader
accepts at most 9 digits of it. Whatever generations the committed checkpoint's names
are at (the last one, 999,999,999, included; several at once in a hand-made document;
an unreadable document, where every stored name is kept), the generation the writer's
own ``prepare`` picks gives names ``parse_document`` accepts and that collide with no
name the committed checkpoint uses.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt.format import generation_name, generation_of, parse_document
from pytreeckpt.storage import Storage
from pytreeckpt.storage._commit import MAX_GENERATION, _referenced

GENERATIONS = st.one_of(
    st.integers(0, MAX_GENERATION),
    st.sampled_from([0, 1, 2, MAX_GENERATION - 1, MAX_GENERATION]),  # the edges, drawn often
)
NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)


def _document(arrays: list[str], databases: list[str], checksums: str | None) -> bytes:
    """A document of one float32 leaf per array (``arrays``) and per packed array (one per database)."""
    leaves: list[dict[str, Any]] = []
    for path in arrays:
        leaves.append({"path": path})
    for k, database in enumerate(databases):
        leaves.append({"path": f"arrays/packed{k}", "database": database})
    for k, leaf in enumerate(leaves):
        leaf |= {"kind": "array", "key": f"k{k}", "container": "torch", "dtype": "float32"}
        leaf |= {"storage_dtype": "float32", "shape": [2], "chunk_shape": [2], "layout": None}
    doc: dict[str, Any] = {"format": "pytreeckpt", "version": 3, "user_metadata": {}, "leaves": leaves}
    doc["tree"] = {"k": "dict", "keys": [leaf["key"] for leaf in leaves], "c": list(range(len(leaves)))}
    if checksums is not None:
        doc["checksums"] = {"path": checksums, "bytes": 0}
    return json.dumps(doc).encode()


@st.composite
def committed(draw: st.DrawFn) -> tuple[list[str], list[str], str | None]:
    """A committed checkpoint's names: arrays, databases, a checksums file, each at a drawn generation."""
    one = draw(GENERATIONS)
    each = st.just(one) if draw(st.booleans()) else GENERATIONS  # one generation, or (hand-made) several
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    arrays = [generation_name(f"arrays/{n}", draw(each)) for n in names]
    ranks = draw(st.lists(st.integers(0, 3), max_size=3, unique=True))
    top = draw(st.sampled_from(["packed", "ocdbt"]))
    databases = [generation_name(f"{top}/{r}", draw(each)) for r in ranks]
    checksums = generation_name("checksums/crc32c", draw(each)) if draw(st.booleans()) else None
    return arrays, databases, checksums


@given(
    committed(),
    st.lists(st.tuples(NAMES, GENERATIONS), max_size=3),  # leftovers of failed saves, at any generation
    st.booleans(),  # the committed document unreadable: then every stored name is kept
    st.lists(NAMES, max_size=3, unique=True),  # names of the new tree the committed one does not have
)
def test_the_generation_a_save_picks_names_what_the_reader_accepts_and_nothing_committed(
    names: tuple[list[str], list[str], str | None],
    leftovers: list[tuple[str, int]],
    unreadable: bool,
    more: list[str],
) -> None:
    arrays, databases, checksums = names
    document = _document(arrays, databases, checksums)
    parse_document(document)  # the committed checkpoint is one the reader accepts
    referenced = _referenced(document)
    assert referenced is not None
    stray = {generation_name(f"arrays/{n}~1", g) for n, g in leftovers} - referenced
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "c"
        for name in sorted(referenced | stray):
            (root / name).mkdir(parents=True)
        (root / "pytreeckpt.json").write_bytes(b"{not json" if unreadable else document)
        kept = referenced | stray if unreadable else referenced
        g = Storage(root).prepare(overwrite=True)
    # the names the save writes: every base the committed checkpoint uses, and new ones
    bases = [_base(a) for a in arrays] + [f"arrays/{n}" for n in more if f"arrays/{n}" not in map(_base, arrays)]
    written = [generation_name(b, g) for b in bases]
    dbs = [generation_name(_base(d), g) for d in databases]
    sums = generation_name("checksums/crc32c", g)
    parsed = parse_document(_document(written, dbs, sums))  # accepted by the reader's own checks
    assert [leaf.path for leaf in parsed.leaves][: len(written)] == written  # type: ignore[union-attr]
    assert [leaf.database for leaf in parsed.leaves][len(written) :] == dbs  # type: ignore[union-attr]
    assert parsed.checksums is not None
    assert parsed.checksums.path == sums
    assert all(generation_of(name) == g for name in [*written, *dbs, sums])
    assert not {*written, *dbs, sums} & kept, (g, sorted({*written, *dbs, sums} & kept))


def _base(name: str) -> str:
    """A stored name without its generation suffix."""
    g = generation_of(name)
    return name[: -len(f"~g{g}")] if g else name
