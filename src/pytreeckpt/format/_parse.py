"""Parsing a metadata document: every field checked, with limits, before anything trusts it
(:func:`parse_document`), by a typed decode (msgspec) with a parse of the JSON behind it."""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from pytreeckpt.core._dtypes import dtype_from_name
from pytreeckpt.core._errors import MetadataError
from pytreeckpt.core._node import Node
from pytreeckpt.core._sharding import Layout, layout_from_json
from pytreeckpt.core._values import decode_value
from pytreeckpt.format._checksums import ChecksumFile, crc32c_chars
from pytreeckpt.format._model import ArrayMeta, CheckpointDoc, Compression, ValueMeta, chunk_count
from pytreeckpt.format._paths import (
    ARRAY_PATH_PATTERN,
    CHECKSUMS_PATTERN,
    CONTAINERS,
    DATABASE_PATTERN,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_METADATA_BYTES,
    MAX_PACKED_BYTES,
    check_relative_path,
)
from pytreeckpt.format._seal import DOCUMENT_CRC32C, SEAL_FORM, check_encoding, unseal_document

_TOP_KEYS = frozenset(("format", "version", "tree", "leaves", "user_metadata", "checksums", DOCUMENT_CRC32C))
_new = object.__new__


_MAX_INDEX = (1 << 62) - 2  # TensorStore's largest finite index: no stored extent is larger


def _int_list(v: Any, what: str, key: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(type(x) is int and 0 <= x <= _MAX_INDEX for x in v) or len(v) > 64:
        raise MetadataError(
            f"leaf {key!r}: {what} must be a list of integers from 0 to 2**62 - 2, found {str(v)[:200]}"
        )
    return tuple(v)


def _layout(data: Any, key: str, seen: dict[str, Layout]) -> Layout:
    """A leaf's saved layout; leaves saved alike share one object (``seen``, per document)."""
    frozen = repr(data)  # (JSON values of different types or values have different reprs: True, 1, 1.0, "1")
    layout = seen.get(frozen)
    if layout is None:
        try:
            layout = layout_from_json(data)
        except Exception as e:  # a layout is informative only; a malformed one is still an error
            raise MetadataError(f"leaf {key!r}: malformed saved layout: {e}") from None
        seen[frozen] = layout
    return layout


def _parse_leaf(
    data: Any, index: int, layouts: dict[str, Layout] | None = None, checksums: ChecksumFile | None = None
) -> ArrayMeta | ValueMeta:
    """One leaf of a document from its JSON, every field checked."""
    if not isinstance(data, dict):
        raise MetadataError(f"leaf #{index}: expected an object, found {type(data).__name__}")
    key = data.get("key")
    if not isinstance(key, str):
        raise MetadataError(f"leaf #{index}: 'key' must be a string, found {key!r}")
    kind = data.get("kind")
    if kind == "value":
        if "value" not in data:
            raise MetadataError(f"leaf {key!r}: value leaf without 'value'")
        return ValueMeta(key, decode_value(data["value"]))
    if kind != "array":
        raise MetadataError(f"leaf {key!r}: unknown kind {kind!r}, expected 'array' or 'value'")
    try:
        dtype = dtype_from_name(data.get("dtype"))  # type: ignore[arg-type]
    except (KeyError, TypeError):
        raise MetadataError(f"leaf {key!r}: unknown dtype {data.get('dtype')!r}") from None
    if data.get("storage_dtype") != dtype.storage:
        raise MetadataError(
            f"leaf {key!r}: dtype {dtype.name} is stored as {dtype.storage}, "
            f"metadata says {data.get('storage_dtype')!r}"
        )
    container = data.get("container")
    if container not in CONTAINERS:
        raise MetadataError(f"leaf {key!r}: container must be one of {CONTAINERS}, found {container!r}")
    shape = _int_list(data.get("shape"), "shape", key)
    chunk_shape = _int_list(data.get("chunk_shape"), "chunk_shape", key)
    if len(chunk_shape) != len(shape) or any(c < 1 for c in chunk_shape):
        raise MetadataError(f"leaf {key!r}: chunk_shape {chunk_shape} does not fit shape {shape}")
    path = check_relative_path(data.get("path"), key)
    database = data.get("database")
    if database is not None:
        if not isinstance(database, str) or not DATABASE_PATTERN.fullmatch(database):
            raise MetadataError(
                f"leaf {key!r}: database must be 'ocdbt/<rank>' or 'packed/<rank>', maybe with '~g<generation>', "
                f"found {str(database)[:200]!r}"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > MAX_PACKED_BYTES:
            raise MetadataError(
                f"leaf {key!r}: a packed array holds at most {MAX_PACKED_BYTES} bytes, the metadata claims {nbytes}"
            )
    layout_json = data.get("layout")
    layout = None if layout_json is None else _layout(layout_json, key, {} if layouts is None else layouts)
    try:
        compression = None if data.get("compression") is None else Compression.from_json(data["compression"])
    except (ValueError, TypeError) as e:
        raise MetadataError(f"leaf {key!r}: malformed compression: {e}") from None
    hashes = data.get("chunk_hashes")
    if hashes is not None:
        n = chunk_count(shape, chunk_shape)
        if (
            not isinstance(hashes, list)
            or len(hashes) != n
            or not all(isinstance(h, str) and _HASH.fullmatch(h) for h in hashes)
        ):
            raise MetadataError(f"leaf {key!r}: chunk_hashes must be {n} hex digests of 32 digits")
        hashes = tuple(hashes)
    crcs = _parse_crcs(data.get("chunk_crc32c"), shape, chunk_shape, key)
    at = _parse_crcs_at(data.get("chunk_crc32c_at"), crcs, shape, chunk_shape, key, checksums)
    return ArrayMeta(
        key,
        container,
        dtype,
        shape,
        chunk_shape,
        path,
        layout,
        compression,
        hashes,
        database,
        None,
        crcs,
        at,
        None if at is None else checksums,
    )


def _parse_crcs_at(
    at: Any,
    inline: str | None,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    key: str,
    checksums: ChecksumFile | None,
) -> tuple[int, int] | None:
    """``chunk_crc32c_at``: absent, or ``[offset, crc32c]``, this leaf's part of the document's checksums
    file (4 bytes a chunk from ``offset``, whose crc32c is ``crc32c``)."""
    if at is None:
        return None
    if inline is not None:
        raise MetadataError(f"leaf {key!r}: both chunk_crc32c and chunk_crc32c_at are given; a leaf has one")
    if checksums is None:
        raise MetadataError(f"leaf {key!r}: chunk_crc32c_at without a checksums file in the document")
    n = 4 * chunk_count(shape, chunk_shape)
    if (
        not isinstance(at, list)
        or len(at) != 2
        or not all(type(x) is int for x in at)
        or not 0 <= at[1] <= 0xFFFFFFFF
        or at[0] < 0
    ):
        raise MetadataError(
            f"leaf {key!r}: chunk_crc32c_at must be [offset, crc32c], two integers, found {str(at)[:200]}"
        )
    if at[0] + n > checksums.size:
        raise MetadataError(
            f"leaf {key!r}: chunk_crc32c_at names bytes {at[0]} to {at[0] + n} of {checksums.path!r} "
            f"(4 bytes for each of its {n // 4} chunks), which holds {checksums.size}"
        )
    return at[0], at[1]


def _parse_checksums(data: Any) -> ChecksumFile | None:
    """The document's ``checksums``: absent, or ``{"path": "checksums/crc32c[~g<n>]", "bytes": <size>}``."""
    if data is None:
        return None
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("path"), str)
        or not CHECKSUMS_PATTERN.fullmatch(data["path"])
        or type(data.get("bytes")) is not int
        or not 0 <= data["bytes"] <= _MAX_INDEX
    ):
        raise MetadataError(
            "metadata 'checksums' must be {\"path\": \"checksums/crc32c\" (maybe with '~g<generation>'), "
            f'"bytes": <size>}}, found {str(data)[:200]}'
        )
    return ChecksumFile(data["path"], data["bytes"])


def _parse_crcs(text: Any, shape: tuple[int, ...], chunk_shape: tuple[int, ...], key: str) -> str | None:
    """``chunk_crc32c``: absent, or the base64 of one little-endian uint32 per chunk, in C order of the grid.

    Its type and length are checked here; its characters when it is decoded (:meth:`ArrayMeta.crc32c`).
    """
    if text is None:
        return None
    n = chunk_count(shape, chunk_shape)
    expected = crc32c_chars(n)
    if not isinstance(text, str) or len(text) != expected:
        found = f"{len(text)} characters" if isinstance(text, str) else type(text).__name__
        raise MetadataError(
            f"leaf {key!r}: chunk_crc32c must be the base64 of {n} little-endian uint32 values (one per chunk, "
            f"{expected} characters), found {found}"
        )
    return text


def parse_document(
    raw: bytes, namespace: str = "", max_bytes: int = MAX_METADATA_BYTES, available: int | None = None
) -> CheckpointDoc:
    """Validate and parse a metadata document; MetadataError names what is wrong.

    A document over ``max_bytes`` is refused, and so is one whose parse could take more
    than ``available`` bytes of memory (when given), before parsing begins.
    """
    if len(raw) > max_bytes:
        raise MetadataError(
            f"the metadata document holds {len(raw)} bytes, more than the limit of {max_bytes} "
            f"(StorageOptions(max_metadata_bytes=...) raises it)"
        )
    # (Counting the document's separators costs 0.1 s at 57 MB: only when even the coarsest
    # bound, every byte a value, could exceed what is available.)
    need = parse_memory_bound(raw) if available is not None and 84 * len(raw) + 80 > available else 0
    if available is not None and need > available:
        raise MetadataError(
            f"parsing the metadata document ({len(raw)} bytes) could take up to {need} bytes of memory, "
            f"more than the {available} bytes available"
        )
    check_encoding(raw)
    sealed = unseal_document(raw)  # (checked before it is parsed: a damaged document is said to be damaged)
    try:
        return _parse_typed(raw, namespace, sealed)
    except Exception:  # (what the typed parse refuses, the parse of the JSON below reads or refuses in its words)
        pass
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise MetadataError(f"metadata is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise MetadataError(f"metadata must be a JSON object, found {type(data).__name__}")
    version = _check_header(data.get("format"), data.get("version"))
    _check_members(data, sealed)
    leaves_json = data.get("leaves")
    if not isinstance(leaves_json, list):
        raise MetadataError("metadata 'leaves' must be a list")
    layouts: dict[str, Layout] = {}
    checksums = _parse_checksums(data.get("checksums"))
    leaves = tuple(_parse_leaf(leaf, i, layouts, checksums) for i, leaf in enumerate(leaves_json))
    return _document_of(version, leaves, data.get("tree"), data.get("user_metadata", {}), checksums, namespace)


def _check_members(data: dict[str, Any], sealed: bool) -> None:
    """MetadataError for a top-level member no document has, or a ``document_crc32c`` not checked as the
    document's last member (:func:`unseal_document`): a bit flipped in that member is no document without one."""
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise MetadataError(
            f"the metadata document has members {unknown[:5]!r}, which no document has (expected "
            f"{sorted(_TOP_KEYS)}): it is damaged, or of a newer format"
        )
    if DOCUMENT_CRC32C in data and not sealed:
        raise MetadataError(
            f"the metadata document's {DOCUMENT_CRC32C} is not its last member in the form "
            f"{SEAL_FORM}: the document is damaged"
        )


def _check_header(name: Any, version: Any) -> int:
    """The document's format version, if it names pytreeckpt's format and a version this reads."""
    if name != FORMAT_NAME:
        raise MetadataError(f"not a pytreeckpt metadata document (format is {name!r})")
    if type(version) is not int or version > FORMAT_VERSION or version < 1:
        raise MetadataError(
            f"metadata format version {version!r} is not supported by this pytreeckpt (reads versions 1 to "
            f"{FORMAT_VERSION}); upgrade pytreeckpt to read it"
        )
    return version


def _document_of(
    version: int,
    leaves: tuple[ArrayMeta | ValueMeta, ...],
    tree_json: Any,
    user: Any,
    checksums: ChecksumFile | None,
    namespace: str,
) -> CheckpointDoc:
    paths = [leaf.path for leaf in leaves if isinstance(leaf, ArrayMeta)]
    if len({p.lower() for p in paths}) != len(paths):
        raise MetadataError("two array leaves share one stored array path")
    try:
        tree = Node.from_json(tree_json, len(leaves), namespace)
    except RecursionError:
        raise MetadataError("tree structure is nested too deeply") from None
    ids = _leaf_ids(tree)
    if ids != list(range(len(leaves))) and sorted(ids) != list(range(len(leaves))):  # (saves name them in order)
        raise _not_every_leaf_once(ids, leaves)
    if not isinstance(user, dict):
        raise MetadataError("'user_metadata' must be a JSON object")
    return CheckpointDoc(version, tree, leaves, user, checksums)


# --------------------------------------------------------------------------- the typed parse
#
# A document decoded by msgspec against the types its fields must have (a C decoder: for a 405B
# model's 4,548 leaves 8 ms against json.loads's 20, and without a Python dict per leaf), its array
# leaves of one kind checked once. Whatever it refuses or fails on goes to the parse of the JSON
# above, which reads it or says what is wrong; whatever it reads, that parse reads the same
# (property_tests/test_parse_memo.py).

_NULL = msgspec.Raw(b"null")
_ABSENT = msgspec.Raw(b"")


class _ArrayJSON(msgspec.Struct, tag_field="kind", tag="array"):
    key: str
    container: str
    dtype: str
    storage_dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    path: str
    layout: msgspec.Raw = _NULL
    database: str | None = None
    chunk_crc32c: str | None = None
    chunk_crc32c_at: tuple[int, int] | None = None
    compression: msgspec.Raw = _NULL
    chunk_hashes: msgspec.Raw = _NULL

    def as_json(self) -> dict[str, Any]:
        """The leaf as ``json.loads`` gives it (absent fields as null, which the parse reads alike)."""
        return {
            "kind": "array",
            "key": self.key,
            "container": self.container,
            "dtype": self.dtype,
            "storage_dtype": self.storage_dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "path": self.path,
            "layout": _json(self.layout),
            "database": self.database,
            "chunk_crc32c": self.chunk_crc32c,
            "chunk_crc32c_at": None if self.chunk_crc32c_at is None else list(self.chunk_crc32c_at),
            "compression": _json(self.compression),
            "chunk_hashes": _json(self.chunk_hashes),
        }


class _ValueJSON(msgspec.Struct, tag_field="kind", tag="value"):
    key: str
    value: msgspec.Raw


class _DocumentJSON(msgspec.Struct, forbid_unknown_fields=True):
    leaves: list[_ArrayJSON | _ValueJSON]
    format: msgspec.Raw = _NULL
    version: msgspec.Raw = _NULL
    tree: msgspec.Raw = _NULL
    user_metadata: msgspec.Raw = msgspec.Raw(b"{}")
    checksums: msgspec.Raw = _NULL
    document_crc32c: msgspec.Raw = _ABSENT


_DECODER = msgspec.json.Decoder(_DocumentJSON)

_Kind = tuple[ArrayMeta, int, int]
"""An array leaf parsed in full, the number of its chunks and the length of their ``chunk_crc32c``."""


def _json(raw: msgspec.Raw) -> Any:
    return json.loads(bytes(raw), parse_constant=_reject_constant)


def _parse_typed(raw: bytes, namespace: str, sealed: bool) -> CheckpointDoc:
    doc = _DECODER.decode(raw)
    if doc.document_crc32c != _ABSENT and not sealed:
        raise ValueError("document_crc32c not checked")  # (the parse of the JSON says what is wrong)
    version = _check_header(_json(doc.format), _json(doc.version))
    checksums = _parse_checksums(_json(doc.checksums))
    kinds: dict[tuple[Any, ...], _Kind] = {}
    layouts: dict[str, Layout] = {}
    leaves: list[ArrayMeta | ValueMeta] = []
    for i, leaf in enumerate(doc.leaves):
        if type(leaf) is _ValueJSON:
            leaves.append(ValueMeta(leaf.key, decode_value(_json(leaf.value))))
            continue
        assert type(leaf) is _ArrayJSON
        kind = (
            leaf.dtype,
            leaf.storage_dtype,
            leaf.container,
            leaf.database,
            leaf.shape,
            leaf.chunk_shape,
            bytes(leaf.layout),
        )
        plain = leaf.compression == _NULL and leaf.chunk_hashes == _NULL
        got = kinds.get(kind) if plain else None
        alike = None if got is None else _parse_alike(leaf, got, checksums)
        if alike is not None:
            leaves.append(alike)
            continue
        meta = _parse_leaf(leaf.as_json(), i, layouts, checksums)
        if plain and got is None and isinstance(meta, ArrayMeta):
            chunks = chunk_count(meta.shape, meta.chunk_shape)
            kinds[kind] = (meta, chunks, crc32c_chars(chunks))
        leaves.append(meta)
    # (the tree's JSON decoded by msgspec, a third of json.loads's work: what it refuses, a number
    # out of range or a lone surrogate, goes to the parse of the JSON, as any refusal here)
    tree = msgspec.json.decode(doc.tree)
    return _document_of(version, tuple(leaves), tree, _json(doc.user_metadata), checksums, namespace)


def _parse_alike(leaf: _ArrayJSON, kind: _Kind, checksums: ChecksumFile | None) -> ArrayMeta | None:
    """An array leaf of a kind parsed before (``kind``: its dtype, container, shapes, database and layout
    are those of that leaf), checked for what is its own; None to parse it in full."""
    like, chunks, crc_chars = kind
    crcs, at = leaf.chunk_crc32c, leaf.chunk_crc32c_at
    if not ARRAY_PATH_PATTERN.fullmatch(leaf.path) or (crcs is not None and len(crcs) != crc_chars):
        return None
    if at is not None and (
        crcs is not None
        or checksums is None
        or not (at[0] >= 0 and at[0] + 4 * chunks <= checksums.size and 0 <= at[1] <= 0xFFFFFFFF)
    ):
        return None
    return _meta_like(like, leaf.key, leaf.path, crcs, at, None if at is None else checksums)


def _meta_like(
    like: ArrayMeta, key: str, path: str, text: str | None, at: tuple[int, int] | None, file: ChecksumFile | None
) -> ArrayMeta:
    """An uncompressed, unhashed array leaf of ``like``'s kind (its container, dtype, shapes, layout and
    database) with its own key, path and checksums, made by storing its fields (as :func:`plain_array_meta`)."""
    m: ArrayMeta = _new(ArrayMeta)
    m.key = key
    m.container = like.container
    m.dtype = like.dtype
    m.shape = like.shape
    m.chunk_shape = like.chunk_shape
    m.path = path
    m.layout = like.layout
    m.compression = None
    m.chunk_hashes = None
    m.database = like.database
    m.chunk_crc32c = None
    m.crc32c_text = text
    m.crc32c_at = at
    m.crc32c_file = file
    m._decoded = []
    m.nbytes = like.nbytes
    return m


def parse_memory_bound(raw: bytes) -> int:
    """An upper bound on the memory ``json.loads`` takes for ``raw``.

    Every JSON value but the first follows a ``,``, ``:``, ``[`` or ``{`` (counted inside
    strings too, so this overestimates), and no value takes more than about 80 bytes of
    Python objects beyond its characters; the text itself is decoded once (up to 4 bytes
    per character). Parsing a document of 10,000 leaves takes about 6 times its size
    (bound: 13 times); one of empty objects, the worst, 25 times (bound: 57 times).

    >>> parse_memory_bound(b"[[], [], []]") > 4 * 80
    True
    """
    values = 1 + sum(raw.count(c) for c in (b",", b":", b"[", b"{"))
    return 80 * values + 4 * len(raw)


def _not_every_leaf_once(ids: list[int], leaves: Sequence[ArrayMeta | ValueMeta]) -> MetadataError:
    """The error for a tree structure that names some leaf of the document twice, or some leaf not at all."""
    counts = collections.Counter(ids)
    twice = [f"leaf {i} ({leaves[i].key!r}) {n} times" for i, n in counts.items() if n > 1][:1]
    missing = [f"leaf {i} ({leaves[i].key!r}) not at all" for i in range(len(leaves)) if i not in counts][:1]
    return MetadataError(
        f"tree structure must name every leaf the document lists exactly once: it names {' and '.join(twice + missing)}"
    )


def _leaf_ids(node: Node) -> list[int]:
    if node.kind == "leaf":
        return [node.leaf]
    out: list[int] = []
    for c in node.children:
        if c.kind == "leaf":
            out.append(c.leaf)
        else:
            out.extend(_leaf_ids(c))
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


_HASH = re.compile(r"[0-9a-f]{32}")
