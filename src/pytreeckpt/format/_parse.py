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
    PARSE_BASE_BYTES,
    PARSE_BYTES_PER_BYTE,
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

    A document over ``max_bytes`` is refused before parsing begins; so is one whose parse could
    take more memory than ``PARSE_BYTES_PER_BYTE`` for each of its bytes and ``PARSE_BASE_BYTES``, or
    than ``available`` bytes (when given): its JSON values are bounded before they are decoded
    (:func:`parse_memory_bound`), its tree structure before it is rebuilt (:func:`tree_memory_bound`).
    """
    if len(raw) > max_bytes:
        raise MetadataError(
            f"the metadata document holds {len(raw)} bytes, more than the limit of {max_bytes} "
            f"(StorageOptions(max_metadata_bytes=...) raises it)"
        )
    memory = _Memory(raw, available)  # (MetadataError if its JSON values could take more than it may)
    check_encoding(raw)
    sealed = unseal_document(raw)  # (checked before it is parsed: a damaged document is said to be damaged)
    try:
        return _parse_typed(raw, namespace, sealed, memory)
    except Exception:  # (what the typed parse refuses, the parse of the JSON below reads or refuses in its words)
        if memory.refused:  # (but for a bound passed, which it would pass too)
            raise
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
    return _document_of(version, leaves, data.get("tree"), data.get("user_metadata", {}), checksums, namespace, memory)


class _Memory:
    """What a document's parse may take: ``PARSE_BYTES_PER_BYTE`` for each of its bytes and ``PARSE_BASE_BYTES``,
    at most ``available``. Made, it has refused a document whose JSON values could take more (``values``: their
    bound); :meth:`check_tree` refuses one whose tree structure, rebuilt, could take the rest. ``refused``: whether
    it refused the document."""

    def __init__(self, raw: bytes, available: int | None) -> None:
        self.raw = raw
        self.limit = PARSE_BYTES_PER_BYTE * len(raw) + PARSE_BASE_BYTES
        self.within = (
            f"a document of {len(raw)} bytes may take ({PARSE_BYTES_PER_BYTE} for each of its bytes and "
            f"{PARSE_BASE_BYTES >> 20} MiB): it holds more JSON objects, arrays or tree nodes for its size than a "
            f"save writes"
        )
        if available is not None and available < self.limit:
            self.limit, self.within = available, "available"
        self.refused = False
        # (Counting the document's JSON values costs 2 ms a MB: only when even the coarsest
        # bound, every byte an object, could pass the limit.)
        coarse = _COARSE_BYTES_PER_BYTE * len(raw) + _FIXED_BYTES
        self.counted = coarse > self.limit
        self.values = parse_memory_bound(raw) if self.counted else coarse
        self._check(self.values, "its JSON values, decoded")

    def check_tree(self, tree: Any) -> None:
        """MetadataError if its JSON values and the tree structure ``tree`` rebuilt could take more than it may."""
        need = tree_memory_bound(tree)
        if self.values + need > self.limit and not self.counted:
            self.counted, self.values = True, parse_memory_bound(self.raw)
        self._check(self.values + need, "its JSON values, and its tree structure rebuilt")

    def _check(self, need: int, what: str) -> None:
        if need > self.limit:
            self.refused = True
            raise MetadataError(
                f"reading the metadata document ({len(self.raw)} bytes) could take up to {need} bytes of memory "
                f"({what}), more than the {self.limit} bytes {self.within}"
            )


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
    memory: _Memory,
) -> CheckpointDoc:
    paths = [leaf.path for leaf in leaves if isinstance(leaf, ArrayMeta)]
    if len({p.lower() for p in paths}) != len(paths):
        raise MetadataError("two array leaves share one stored array path")
    memory.check_tree(tree_json)
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


def _parse_typed(raw: bytes, namespace: str, sealed: bool, memory: _Memory) -> CheckpointDoc:
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
    return _document_of(version, tuple(leaves), tree, _json(doc.user_metadata), checksums, namespace, memory)


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


_STRUCTURE = b'{[,:"'
_KEPT = bytes(c for c in range(128) if c not in _STRUCTURE)  # (deleted: what is neither structure nor beyond ASCII)
_BELOW_UCS2 = bytes(range(0xC4))  # (deleted: what leaves the bytes that lead a character past U+00FF)
_BELOW_UCS4 = bytes(range(0xF0))  # (... past U+FFFF)
_OPEN_BYTES = 112  # an object or array: a dict or list, of one member or item (each further one counted with it)
_ITEM_BYTES = 40  # an item or a member: its slot in its container, and a number (a string is counted by its quotes)
_QUOTE_BYTES = 32  # half a string (each has two quotes) of ASCII or Latin-1 characters, beyond its characters
_WIDE_BYTES = 16  # a byte of a character past U+007F (2 to 4 bytes): a string of them takes more, up to 4 a character
_TEXT_BYTES = 2  # each byte of the document: itself, and a character of a string decoded from it
_FIXED_BYTES = 1024
_COARSE_BYTES_PER_BYTE = _OPEN_BYTES + _TEXT_BYTES + 4  # (every byte an object: no document takes more)


def parse_memory_bound(raw: bytes) -> int:
    """An upper bound on the memory that decoding ``raw``'s JSON takes, the document's own bytes included
    (by ``json.loads``, or by msgspec as the typed parse does).

    Its objects and arrays (each ``{`` or ``[``), members and items (each ``,`` or ``:``),
    strings (each ``"``) and bytes beyond ASCII are counted, inside strings too (so this
    overestimates); none takes more Python objects than a fixed number of bytes beyond its
    characters (property_tests/test_parse_memory.py holds them to it). ``json.loads``
    decodes the text whole first, in 1, 2 or 4 bytes a character as its widest needs. A
    save's document of 4,548 array leaves takes about 4 times its size (bound: 14 times);
    one of empty objects, the worst, 29 times (bound: 49 times).

    >>> parse_memory_bound(b'{"a":[[],[]]}') == 4 * 112 + 2 * 40 + 2 * 32 + (2 + 1) * 13 + 1024
    True
    """
    found = raw.translate(None, _KEPT)
    opens = found.count(b"{") + found.count(b"[")
    items = found.count(b",") + found.count(b":")
    quotes = found.count(b'"')
    wide = len(found) - opens - items - quotes
    decoded = 1  # (bytes a character of the document decoded whole: 1 for ASCII and Latin-1)
    if wide and found.translate(None, _BELOW_UCS4):
        decoded = 4
    elif wide and found.translate(None, _BELOW_UCS2):
        decoded = 2
    return (
        _OPEN_BYTES * opens
        + _ITEM_BYTES * items
        + _QUOTE_BYTES * quotes
        + _WIDE_BYTES * wide
        + (_TEXT_BYTES + decoded) * len(raw)
        + _FIXED_BYTES
    )


_NODE_BYTES = 288  # a tree node: its Node, its lists of entries and children, the container a rebuild makes
_CHILD_BYTES = 240  # a child: its key entry, its slots, its Node if a leaf
_KEY_BYTES = 112  # a key of a node that has keys: its entry, its slot in the rebuilt container
_KIND_BYTES = {"odict": 64, "defaultdict": 128, "custom": 128, "per_rank": 192, "deque": 896}  # (a deque's block)
_CLASS_BYTES = 6144  # a namedtuple type made for one that is not imported (one for each name and fields)
_FIELD_BYTES = 512  # each of its fields


def tree_memory_bound(tree: Any) -> int:
    """An upper bound on the memory that rebuilding the tree structure ``tree`` (its JSON, decoded) takes
    beyond its JSON: its :class:`Node` objects, and the containers :func:`metadata` rebuilds from them.

    >>> tree_memory_bound({"k": "list", "c": [0, 1, {"k": "deque", "c": []}]})
    2192
    """
    need = 0
    classes: set[tuple[Any, tuple[Any, ...]]] = set()
    todo = [tree]
    while todo:
        node = todo.pop()
        if type(node) is not dict:
            continue
        kind = node.get("k")
        kids = node.get("c")
        need += _NODE_BYTES + (_KIND_BYTES.get(kind, 0) if type(kind) is str else 0)
        if type(kids) is list:
            need += _CHILD_BYTES * len(kids)
            todo.extend(c for c in kids if type(c) is dict)
        keys = node.get("keys")
        if type(keys) is list:
            need += _KEY_BYTES * len(keys)
        if kind == "namedtuple" and type(keys) is list and all(type(k) is str for k in keys):
            made = (node.get("type"), tuple(keys))
            if type(made[0]) in (str, type(None)) and made not in classes:
                classes.add(made)
                need += _CLASS_BYTES + _FIELD_BYTES * len(keys)
    return need


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
