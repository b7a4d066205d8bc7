"""The stored form: the metadata document, its schema, and where arrays live (``docs/format.md`` in full).

A checkpoint is a directory::

    pytreeckpt.json          the metadata document; written last, atomically: the commit
    arrays/<name>/zarr.json  one zarr v3 array per tensor leaf, of its global shape
    arrays/<name>/c/...      its chunks
    packed/<rank>/<n>.zip    small arrays packed in zip archives by the rank that wrote them
                             (format version 3; what pytreeckpt writes on a local file system)
    ocdbt/<rank>/            small arrays packed in an OCDBT database per writing rank
                             (format version 2; on object stores)
    checksums/crc32c         every chunk's crc32c, when there are too many to keep in the
                             document (each array's part named by the document)

The metadata document (format version 1, 2 or 3: the lowest its checkpoint needs, see
``FORMAT_VERSION``), sealed by its own crc32c as its last member::

    {"format": "pytreeckpt", "version": 1 | 2 | 3,
     "tree": <structure>, "leaves": [<leaf>, ...], "user_metadata": {...},
     "document_crc32c": "<8 hex digits>"}

Array leaves are ``{"kind": "array", "key", "container", "dtype", "storage_dtype",
"shape", "chunk_shape", "path", "layout", "chunk_crc32c" | "chunk_crc32c_at"}`` (and
``database`` when packed, ``compression``, ``chunk_hashes``); plain Python leaves are
``{"kind": "value", "key", "value"}``. Nothing here does I/O.
"""

from __future__ import annotations

import base64
import binascii
import collections
import contextlib
import json
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import numpy as np

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._dtypes import DType, dtype_from_name
from pytreeckpt.core._errors import CheckpointError, MetadataError
from pytreeckpt.core._sharding import Layout, layout_from_json
from pytreeckpt.core._tree import Node
from pytreeckpt.core._values import decode_value

__all__ = [
    "ARCHIVE_DIR",
    "ARRAYS_DIR",
    "CHECKSUMS_DIR",
    "CHECKSUMS_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MAX_NDIM",
    "METADATA_FILE",
    "PACKED_DIR",
    "SEAL_BYTES",
    "STORED_DIRS",
    "ArrayMeta",
    "CheckpointDoc",
    "ChecksumFile",
    "Compression",
    "DocumentHead",
    "SumsTemplate",
    "ValueMeta",
    "array_leaf_heads",
    "array_leaf_texts",
    "array_names",
    "chunk_count",
    "crc32c_chars",
    "generation_name",
    "generation_of",
    "pack_checksums",
    "parse_document",
    "place_checksums",
    "plain_array_meta",
    "seal_document",
    "unseal_document",
    "zarr_metadata",
]

FORMAT_NAME = "pytreeckpt"
FORMAT_VERSION = 3
"""The newest version written: 3 when some array is packed in zip archives, 2 when some is
packed in an OCDBT database, else 1."""
METADATA_FILE = "pytreeckpt.json"
LOCK_FILE = ".pytreeckpt.lock"
STEP_DIR = re.compile(r"^step_(\d+)$")
"""A CheckpointManager's step directory (or key prefix): ``step_<n>``."""
ARRAYS_DIR = "arrays"
PACKED_DIR = "ocdbt"
ARCHIVE_DIR = "packed"
"""Packed arrays as zip archive entries (format version 3): ``packed/<rank>/<n>.zip``."""
CHECKSUMS_DIR = "checksums"
CHECKSUMS_FILE = "checksums/crc32c"
"""Every chunk's crc32c, when a document would hold more of them than ``StorageOptions.max_inline_checksum_bytes``
(each array's part is named by its leaf's ``chunk_crc32c_at``); ``checksums/crc32c~g<n>`` in a later generation."""
STORED_DIRS = (ARRAYS_DIR, PACKED_DIR, ARCHIVE_DIR, CHECKSUMS_DIR)
"""The top-level directories (key prefixes) holding a checkpoint's arrays, databases and checksums."""
CONTAINERS = ("torch", "numpy")
MAX_METADATA_BYTES = 256 << 20
"""The default cap on the metadata document's size (``StorageOptions.max_metadata_bytes``)."""
MAX_PACKED_BYTES = 64 << 20
"""A packed array is small: a document claiming a bigger one is refused before any allocation."""
MAX_NDIM = 32
"""The most dims a saved array may have: TensorStore's limit (``kMaxRank``) for the arrays it opens."""

# Patterns on names a document gives are applied with fullmatch (or end in \Z): "$" also
# matches before a final newline, and "packed/0\n" is no database.
_DATABASE = re.compile(r"(ocdbt|packed)/(0|[1-9][0-9]{0,8})(~g[1-9][0-9]{0,8})?")  # (fullmatch)
_CHECKSUMS = re.compile(r"checksums/crc32c(~g[1-9][0-9]{0,8})?")  # (fullmatch)
_GENERATION = re.compile(r"~g([1-9][0-9]{0,8})\Z")

_SAFE_PATH = re.compile(r"arrays/[A-Za-z0-9_][A-Za-z0-9_.~-]{0,199}")  # (fullmatch: no newline at the end either)


CHECKSUM_BLOCK = 1 << 20
"""A checksums file is read in blocks of this many bytes, each once, as the arrays read need them."""


class ChecksumFile:
    """The chunk checksums a document keeps in a file of their own (its ``checksums``): the file's
    path and size, and, once a storage attaches ``reader`` (``reader(path, start, stop)``: those
    bytes, or fewer where the file ends), its bytes as arrays need them, each block read once.

    A leaf names its part by offset and the crc32c of those bytes (``chunk_crc32c_at``), which
    :meth:`ArrayMeta.crc32c` checks: the file is trusted only through the document.
    """

    __slots__ = ("_blocks", "_lock", "path", "reader", "size")

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        self.reader: Callable[[str, int, int], bytes] | None = None
        self._blocks: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.size}

    def read(self, start: int, stop: int, key: str) -> bytes:
        """Bytes ``start`` to ``stop`` of the file (within its recorded size), for leaf ``key``."""
        if self.reader is None:
            raise CheckpointError(f"leaf {key!r}: its chunk checksums are in {self.path!r}, which nothing reads here")
        if stop <= start:
            return b""
        first, last = start // CHECKSUM_BLOCK, (stop - 1) // CHECKSUM_BLOCK
        with self._lock:  # (the I/O threads of a load ask for arrays at once; each block is read once)
            missing = [b for b in range(first, last + 1) if b not in self._blocks]
            if missing:
                lo, hi = missing[0] * CHECKSUM_BLOCK, min((missing[-1] + 1) * CHECKSUM_BLOCK, self.size)
                raw = self.reader(self.path, lo, hi)
                if len(raw) != hi - lo:
                    raise CheckpointError(
                        f"leaf {key!r}: {self.path!r} ends at byte {lo + len(raw)}, the metadata records "
                        f"{self.size} bytes"
                    )
                for b in range(missing[0], missing[-1] + 1):
                    self._blocks.setdefault(b, raw[b * CHECKSUM_BLOCK - lo : (b + 1) * CHECKSUM_BLOCK - lo])
            parts = [self._blocks[b] for b in range(first, last + 1)]
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        base = first * CHECKSUM_BLOCK
        return joined[start - base : stop - base]


def pack_checksums(crcs: Sequence[bytes | None]) -> tuple[bytes, list[tuple[int, int] | None]]:
    """The bytes of a checksums file holding ``crcs`` (each array's chunk checksums, or None), and each
    array's ``(offset, crc32c of its part)`` there.

    >>> pack_checksums([bytes(4), None, bytes(8)])[1]
    [(0, 1214729159), None, (4, 2351477386)]
    """
    refs: list[tuple[int, int] | None] = []
    offset = 0
    for c in crcs:
        if c is None:
            refs.append(None)
            continue
        refs.append((offset, crc32c(c)))
        offset += len(c)
    return b"".join(c for c in crcs if c is not None), refs


def place_checksums(
    crcs: Sequence[bytes | None], limit: int, path: str = CHECKSUMS_FILE
) -> tuple[list[tuple[int, int] | None], ChecksumFile | None, bytes | None]:
    """Where a document's chunk checksums go: in the document (no refs, no file) while their base64
    is at most ``limit`` bytes, else in a checksums file at ``path``: each array's ``(offset, crc32c)``
    there, the file the document names, and its bytes."""
    # (most are 4 bytes, one chunk; counted in C when none is missing)
    known = cast("Sequence[bytes]", crcs) if None not in crcs else [c for c in crcs if c is not None]
    sizes = collections.Counter(map(len, known))
    inline = sum(crc32c_chars(size // 4) * count for size, count in sizes.items())
    if inline <= limit:
        return [None] * len(crcs), None, None
    blob, refs = pack_checksums(crcs)
    return refs, ChecksumFile(path, len(blob)), blob


@dataclass(slots=True, unsafe_hash=True)
class ArrayMeta:
    """A tensor leaf as stored.

    Treat it as immutable (make a changed one with ``dataclasses.replace``): it is hashable
    by its compared fields, and one object may stand in several trees. It is not declared
    frozen because a frozen dataclass sets each of its 16 fields through
    ``object.__setattr__``: making one took 2.5 us, a fifth of parsing a 4,548-leaf document
    (plain attribute stores: 0.5 us).
    """

    key: str
    container: str
    dtype: DType
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    path: str
    layout: Layout | None
    compression: Compression | None = None
    chunk_hashes: tuple[str, ...] | None = None  # blake2b-128 of each chunk's raw bytes, C order of the grid
    database: str | None = None  # "ocdbt/<rank>" or "packed/<rank>": packed in that OCDBT database / those zip archives
    chunk_crc32c: bytes | None = None  # each chunk's crc32c, little-endian uint32 in C order of the grid
    # The same as a document stores it (base64), decoded by crc32c() when first needed: a
    # load decodes only what it reads (57 MB of them for a 405B model on 16,384 ranks).
    crc32c_text: str | None = field(default=None, compare=False, repr=False)
    # Or kept in the document's checksums file: this leaf's offset there and the crc32c of its part.
    crc32c_at: tuple[int, int] | None = field(default=None, compare=False, repr=False)
    crc32c_file: ChecksumFile | None = field(default=None, compare=False, repr=False)
    _decoded: list[bytes] = field(default_factory=list, compare=False, repr=False)
    # The bytes of its elements: made once (a load of 10,000 small leaves asked for it 5 times a leaf).
    nbytes: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.nbytes = _nbytes(self.shape, self.dtype)

    @property
    def records_crc32c(self) -> bool:
        """Whether the metadata records each chunk's crc32c (checkpoints from before it did not)."""
        return self.chunk_crc32c is not None or self.crc32c_text is not None or self.crc32c_at is not None

    def crc32c(self) -> bytes | None:
        """Each chunk's recorded crc32c (little-endian uint32 in C order of the grid), or None.

        From a parsed document the base64 is decoded here, once; MetadataError if it is not
        valid base64 (its length was checked by the parse).
        """
        if self.chunk_crc32c is not None:
            return self.chunk_crc32c
        if self._decoded:
            return self._decoded[0]
        if self.crc32c_at is not None and self.crc32c_file is not None:
            return self._crc32c_from_file(self.crc32c_file, *self.crc32c_at)
        if self.crc32c_text is None:
            return None
        try:
            raw = binascii.a2b_base64(self.crc32c_text, strict_mode=True)
        except (binascii.Error, ValueError):
            raise MetadataError(f"leaf {self.key!r}: chunk_crc32c is not valid base64") from None
        expected = 4 * chunk_count(self.shape, self.chunk_shape)
        if len(raw) != expected:
            raise MetadataError(
                f"leaf {self.key!r}: chunk_crc32c holds {len(raw)} bytes, expected {expected} (one uint32 per chunk)"
            )
        self._decoded.append(raw)  # (two threads at once decode twice, alike)
        return raw

    def _crc32c_from_file(self, file: ChecksumFile, offset: int, crc: int) -> bytes:
        n = 4 * chunk_count(self.shape, self.chunk_shape)
        raw = file.read(offset, offset + n, self.key)
        found = crc32c(raw)
        if found != crc:
            raise CheckpointError(
                f"leaf {self.key!r}: its chunk checksums, bytes {offset} to {offset + n} of {file.path!r}, have "
                f"crc32c {found:#010x}, the metadata records {crc:#010x}: the file is damaged or another checkpoint's"
            )
        self._decoded.append(raw)
        return raw

    def recorded_crc32c(self, index: Sequence[int]) -> int | None:
        """The crc32c the metadata records for chunk ``index`` (see ``chunk_crc``); None where it records none.

        >>> meta = ArrayMeta("w", "torch", dtype_from_name("float32"), (5,), (2,), "arrays/w", None,
        ...                  chunk_crc32c=bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0]))
        >>> meta.recorded_crc32c((2,))
        3
        """
        crcs = self.crc32c()
        if crcs is None:
            return None
        flat = 0
        for i, c, n in zip(index, self.chunk_shape, self.shape, strict=True):
            flat = flat * -(-n // c) + i
        return int.from_bytes(crcs[4 * flat : 4 * flat + 4], "little")

    def to_json(
        self, crc32c: bytes | None = None, hashes: Sequence[str] | None = None, crc32c_at: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        """This leaf's entry in the metadata document; with ``crc32c`` and ``hashes`` (each chunk's
        checksum and digest, as the fields hold them) in place of those it records, if given; with
        ``crc32c_at`` its checksums are in the document's checksums file, at that offset, of that crc32c."""
        out: dict[str, Any] = {
            "kind": "array",
            "key": self.key,
            "container": self.container,
            "dtype": self.dtype.name,
            "storage_dtype": self.dtype.storage,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "path": self.path,
            "layout": None if self.layout is None else self.layout.to_json(),
        }
        if self.compression is not None:
            out["compression"] = self.compression.to_json()
        if hashes or self.chunk_hashes is not None:
            out["chunk_hashes"] = list(hashes or self.chunk_hashes or ())
        if self.database is not None:
            out["database"] = self.database
        if crc32c_at is not None:
            out["chunk_crc32c_at"] = list(crc32c_at)
        elif crc32c is not None or self.chunk_crc32c is not None:
            out["chunk_crc32c"] = base64.b64encode(crc32c if crc32c is not None else self.chunk_crc32c).decode()  # type: ignore[arg-type]
        elif self.crc32c_text is not None:
            out["chunk_crc32c"] = self.crc32c_text
        elif self.crc32c_at is not None:  # (read from its checksums file, kept in this document)
            out["chunk_crc32c"] = base64.b64encode(self.crc32c() or b"").decode()
        return out


_BLOSC_NAMES = ("lz4", "lz4hc", "blosclz", "zstd", "snappy", "zlib")
_SHUFFLES = ("noshuffle", "shuffle", "bitshuffle")


@dataclass(frozen=True, slots=True)
class Compression:
    """A lossless zarr v3 codec for a leaf's chunks (applied before the checksum).

    ``Compression("zstd", level=3)``, or ``Compression("blosc", level=5, cname="lz4",
    shuffle="shuffle")``: blosc's byte shuffle groups the bytes of each element by
    significance, which suits the slowly varying exponents of float32 and bfloat16. The
    names ``"zstd"`` and ``"blosc"`` stand for these defaults wherever a compression is
    asked for.

    >>> Compression.parse("zstd")
    Compression(codec='zstd', level=3, cname='lz4', shuffle='shuffle')
    >>> Compression.parse("blosc").zarr_codec(2)["configuration"]["typesize"]
    2
    """

    codec: str
    level: int = 3
    cname: str = "lz4"
    shuffle: str = "shuffle"

    def __post_init__(self) -> None:
        if self.codec not in ("zstd", "blosc"):
            raise ValueError(f"compression codec must be 'zstd' or 'blosc', found {self.codec!r}")
        top = 22 if self.codec == "zstd" else 9
        if type(self.level) is not int or not (0 <= self.level <= top):
            raise ValueError(f"{self.codec} level must be an integer from 0 to {top}, found {self.level!r}")
        if self.cname not in _BLOSC_NAMES:
            raise ValueError(f"blosc cname must be one of {_BLOSC_NAMES}, found {self.cname!r}")
        if self.shuffle not in _SHUFFLES:
            raise ValueError(f"blosc shuffle must be one of {_SHUFFLES}, found {self.shuffle!r}")

    @classmethod
    def parse(cls, value: Any) -> Compression | None:
        """A Compression from a Compression, ``"zstd"``, ``"blosc"``, or None / ``"none"`` (no compression)."""
        if value is None or value == "none":
            return None
        if isinstance(value, Compression):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ValueError(f"a compression is a Compression, 'zstd', 'blosc', 'none' or None, found {value!r}")

    def zarr_codec(self, itemsize: int) -> dict[str, Any]:
        if self.codec == "zstd":
            return {"name": "zstd", "configuration": {"level": self.level, "checksum": False}}
        return {
            "name": "blosc",
            "configuration": {
                "cname": self.cname,
                "clevel": self.level,
                "shuffle": self.shuffle,
                "typesize": itemsize,
                "blocksize": 0,
            },
        }

    def to_json(self) -> dict[str, Any]:
        if self.codec == "zstd":
            return {"codec": "zstd", "level": self.level}
        return {"codec": "blosc", "level": self.level, "cname": self.cname, "shuffle": self.shuffle}

    @classmethod
    def from_json(cls, data: Any) -> Compression:
        if not isinstance(data, dict) or set(data) - {"codec", "level", "cname", "shuffle"}:
            raise ValueError(f"a compression is an object of codec, level, cname, shuffle; found {data!r}")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class ValueMeta:
    """A plain Python leaf, stored inline."""

    key: str
    value: Any

    def to_json(self, encoded: Any) -> dict[str, Any]:
        return {"kind": "value", "key": self.key, "value": encoded}


@dataclass(frozen=True, slots=True)
class CheckpointDoc:
    """The parsed metadata document."""

    version: int
    tree: Node
    leaves: tuple[ArrayMeta | ValueMeta, ...]
    user_metadata: dict[str, Any]
    checksums: ChecksumFile | None = None  # where leaves' chunk checksums are kept, if not in the document


def zarr_metadata(
    dtype: DType, shape: Sequence[int], chunk_shape: Sequence[int], compression: Compression | None = None
) -> dict[str, Any]:
    """The zarr v3 array metadata pytreeckpt writes: little-endian bytes, maybe compressed, a crc32c per chunk."""
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression is not None:
        codecs.append(compression.zarr_codec(dtype.itemsize))
    codecs.append({"name": "crc32c"})
    return {
        "shape": list(shape),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk_shape)}},
        "chunk_key_encoding": {"name": "default"},
        "data_type": dtype.storage,
        "codecs": codecs,
    }


_UNSAFE_CHAR = re.compile(r"[^A-Za-z0-9_.-]")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,179}")  # (fullmatch: a key that is its own name)


def array_names(keys: Sequence[str]) -> list[str]:
    """Directory names for arrays: readable, safe on every file system, distinct ignoring case.

    >>> array_names(["model.w", "model/w", "", "Model.W"])
    ['model.w', 'model_w', 'root', 'Model.W~1']
    """
    seen: set[str] = set()
    out = []
    for key in keys:
        if _PLAIN_NAME.fullmatch(key):  # (most keys: a dotted path of plain words)
            base = key
        else:
            base = _UNSAFE_CHAR.sub("_", key)[:180] or "root"
            if base[0] in ".-":
                base = "_" + base
        name, n = base, 0
        while name.lower() in seen:
            n += 1
            name = f"{base}~{n}"
        seen.add(name.lower())
        out.append(name)
    return out


def generation_name(name: str, generation: int) -> str:
    """The name an array or database ``name`` gets in the save of ``generation``.

    The first save of a path writes generation 0, plain names; a save replacing a
    committed checkpoint writes the next generation beside it, under names the committed
    metadata does not use, and deletes the old arrays only once its own metadata is
    committed. Array names never contain ``~g`` otherwise (see :func:`array_names`).

    >>> generation_name("arrays/w", 0), generation_name("arrays/w", 3), generation_name("ocdbt/1", 2)
    ('arrays/w', 'arrays/w~g3', 'ocdbt/1~g2')
    >>> generation_of("arrays/w~1~g3"), generation_of("arrays/w~1")
    (3, 0)
    """
    return name if generation == 0 else f"{name}~g{generation}"


def generation_of(name: str) -> int:
    """The generation of a stored array or database name (0 for a plain name)."""
    m = _GENERATION.search(name)
    return int(m.group(1)) if m else 0


def check_relative_path(path: Any, key: str) -> str:
    """``path`` if it is a safe relative path below ``arrays/``; MetadataError otherwise."""
    if type(path) is not str:
        raise MetadataError(f"leaf {key!r}: array path must be a string, found {path!r}")
    if not _SAFE_PATH.fullmatch(path):
        raise MetadataError(
            f"leaf {key!r}: array path {path!r} is not of the form '{ARRAYS_DIR}/<name>' with a plain name; "
            f"a checkpoint may not point outside its directory"
        )
    return path


# --------------------------------------------------------------------------- the document's checksum

DOCUMENT_CRC32C = "document_crc32c"
_SEAL_OPEN = b',"document_crc32c":"'
SEAL_BYTES = len(_SEAL_OPEN) + 8 + 2
"""The bytes the document's checksum adds to it: ``,"document_crc32c":"<8 hex digits>"}`` in place of its ``}``."""
_SEAL = re.compile(rb',"document_crc32c":"([0-9a-f]{8})"\}\Z')
_SEAL_FORM = _SEAL_OPEN.decode() + '<8 lowercase hex digits>"}'
_TOP_KEYS = frozenset(("format", "version", "tree", "leaves", "user_metadata", "checksums", DOCUMENT_CRC32C))


def seal_document(document: bytes | bytearray) -> tuple[memoryview, bytes]:
    """The document as it is stored: its bytes up to its closing ``}``, and the member that ends it in
    their place, ``,"document_crc32c":"<crc32c of those bytes, 8 lowercase hex digits>"}`` (write one after
    the other: a document of 10^5 leaves is not copied to append 30 bytes).

    >>> body, tail = seal_document(b'{"a":1}')
    >>> bytes(body) + tail
    b'{"a":1,"document_crc32c":"149cdbb2"}'
    >>> unseal_document(bytes(body) + tail)
    True
    """
    view = memoryview(document)
    if not len(view) or view[-1] != ord("}"):
        raise ValueError("a metadata document is a JSON object: it ends with '}'")
    body = view[:-1]
    return body, b'%s%08x"}' % (_SEAL_OPEN, crc32c(body))


def unseal_document(raw: bytes | bytearray) -> bool:
    """Whether ``raw`` ends in its checksum (:func:`seal_document`), checked against the bytes before it:
    MetadataError if they differ. False for a document without one (written before it was recorded).

    Any change of one bit is refused: in the bytes the checksum covers, by the checksum; in the
    member itself, by the checksum (another hex digit), or by the parse (a document whose last
    member is not this exact form: it is not JSON, or has a key no document has, or a
    ``document_crc32c`` the parse refuses where this did not check it).
    """
    if len(raw) < SEAL_BYTES or raw[-2:] != b'"}':
        return False
    m = _SEAL.match(raw, len(raw) - SEAL_BYTES)
    if m is None:
        return False
    recorded = int(m.group(1), 16)
    found = crc32c(memoryview(raw)[: len(raw) - SEAL_BYTES])
    if found != recorded:
        raise MetadataError(
            f"the metadata document is damaged: its bytes have crc32c {found:08x}, its {DOCUMENT_CRC32C} "
            f"records {recorded:08x}"
        )
    return True


def _check_encoding(raw: bytes | bytearray) -> None:
    """MetadataError unless ``raw`` is UTF-8 without a byte order mark, as the format says (json.loads
    would read UTF-16 and UTF-32 too, and skip a BOM)."""
    if raw[:3] == b"\xef\xbb\xbf":
        raise MetadataError("the metadata document starts with a UTF-8 byte order mark; the format is UTF-8 without")
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff") or raw[:4] == b"\x00\x00\xfe\xff":
        raise MetadataError("the metadata document starts with a UTF-16 or UTF-32 byte order mark; the format is UTF-8")
    nul = raw.find(b"\x00")  # (no JSON text in UTF-8 holds a NUL byte; UTF-16 and UTF-32 of ASCII do)
    if nul >= 0:
        raise MetadataError(
            f"the metadata document holds a NUL byte (at byte {nul}): it is not UTF-8 JSON (UTF-16 or UTF-32?); "
            f"the format is UTF-8"
        )
    if not raw.isascii():
        try:
            bytes(raw).decode("utf-8")
        except UnicodeDecodeError as e:
            raise MetadataError(f"the metadata document is not UTF-8 (at byte {e.start}: {e.reason})") from None


# --------------------------------------------------------------------------- parsing


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
        if not isinstance(database, str) or not _DATABASE.fullmatch(database):
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


def crc32c_chars(chunks: int) -> int:
    """The length of ``chunk_crc32c`` for a grid of ``chunks`` chunks: the base64 of 4 bytes per chunk, padded."""
    return 4 * -(-4 * chunks // 3)


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
        or not _CHECKSUMS.fullmatch(data["path"])
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
    _check_encoding(raw)
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
            f"{_SEAL_FORM}: the document is damaged"
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
    if not _SAFE_PATH.fullmatch(leaf.path) or (crcs is not None and len(crcs) != crc_chars):
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


def plain_array_meta(
    key: str,
    container: str,
    dtype: DType,
    shape: tuple[int, ...],
    chunk_shape: tuple[int, ...],
    path: str,
    layout: Layout | None,
    compression: Compression | None,
    database: str | None,
) -> ArrayMeta:
    """``ArrayMeta(key, container, dtype, shape, chunk_shape, path, layout, compression, database=database)``
    (no chunk hashes or checksums yet), made by storing its fields: without ``__init__``'s keyword
    defaults and ``__post_init__`` call, for the many thousand leaves of a parse or a save.
    tests/test_format.py checks every field against ``__init__``'s."""
    m: ArrayMeta = _new(ArrayMeta)
    m.key = key
    m.container = container
    m.dtype = dtype
    m.shape = shape
    m.chunk_shape = chunk_shape
    m.path = path
    m.layout = layout
    m.compression = compression
    m.chunk_hashes = None
    m.database = database
    m.chunk_crc32c = None
    m.crc32c_text = None
    m.crc32c_at = None
    m.crc32c_file = None
    m._decoded = []
    m.nbytes = _nbytes(shape, dtype)
    return m


def _nbytes(shape: tuple[int, ...], dtype: DType) -> int:
    return math.prod(shape) * dtype.itemsize


_new = object.__new__


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


def chunk_count(shape: Sequence[int], chunk_shape: Sequence[int]) -> int:
    """The number of chunks of a regular grid (a 0-d array has one; a zero-size one none)."""
    return math.prod(-(-s // c) for s, c in zip(shape, chunk_shape, strict=True))


def _dumps(x: Any) -> str:
    # (no cycles to look for: user metadata was checked by a round trip, the rest is made here)
    return json.dumps(x, allow_nan=False, separators=(",", ":"), check_circular=False)


def _not_json(e: Exception) -> MetadataError:
    return MetadataError(f"metadata is not JSON-serialisable (check user_metadata): {e}")


@dataclass(frozen=True, slots=True)
class DocumentHead:
    """A metadata document's tree and user metadata, serialised once: a save does it when it plans
    (what cannot be serialised is refused before any write) and joins them with the leaves'
    entries when it commits."""

    tree: str
    user: str

    @classmethod
    def of(cls, tree: Node, user_metadata: dict[str, Any] | None) -> DocumentHead:
        try:
            return cls(_dumps(tree.to_json()), _dumps(user_metadata or {}))
        except (TypeError, ValueError) as e:
            raise _not_json(e) from None

    @classmethod
    def of_tree_text(cls, tree: str, user_metadata: dict[str, Any] | None) -> DocumentHead:
        """The head of a tree serialised before (``DocumentHead.of(...).tree``)."""
        try:
            return cls(tree, _dumps(user_metadata or {}))
        except (TypeError, ValueError) as e:
            raise _not_json(e) from None

    def document(
        self,
        leaves: Sequence[str | dict[str, Any]],
        databases: Iterable[str | None],
        checksums: ChecksumFile | None = None,
    ) -> bytes:
        """The document of these leaves' entries (JSON texts, as :func:`array_leaf_texts` makes them joined, or
        dicts), stored in ``databases`` (its version says which kinds of database it needs), and
        ``checksums``: the file its leaves' ``chunk_crc32c_at`` name. Byte for byte ``json.dumps``'s
        text of the whole document (compact separators)."""
        try:
            texts = cast("list[str]", leaves)
            if not set(map(type, leaves)) <= {str}:  # (values' entries among them, as dicts)
                texts = [x if type(x) is str else _dumps(x) for x in leaves]
        except (TypeError, ValueError) as e:
            raise _not_json(e) from None
        before, after = self.frame(databases, checksums)
        return "".join([before, ",".join(texts), after]).encode()

    def frame(self, databases: Iterable[str | None], checksums: ChecksumFile | None = None) -> tuple[str, str]:
        """The document's text before its leaves' entries and after them."""
        stored = {d for d in set(databases) if d is not None}  # (the set first: a few among 10^5 leaves)
        version = 3 if any(d.startswith(ARCHIVE_DIR + "/") for d in stored) else 2 if stored else 1
        before = f'{{"format":{_dumps(FORMAT_NAME)},"version":{version},"tree":{self.tree},"leaves":['
        after = ['],"user_metadata":', self.user]
        if checksums is not None:
            after += [',"checksums":', _dumps(checksums.to_json())]
        after.append("}")
        return before, "".join(after)


def build_document(
    tree: Node,
    leaves: Sequence[dict[str, Any]],
    user_metadata: dict[str, Any] | None,
    checksums: ChecksumFile | None = None,
) -> bytes:
    """Serialise a metadata document (``checksums``: the file its leaves' ``chunk_crc32c_at`` name).

    The route a save takes (:meth:`DocumentHead.document`) in one call, for documents made
    by hand (tests, benchmarks); a save itself keeps its head and array texts from save to
    save (``saving/_job.py``).
    """
    databases = (leaf.get("database") for leaf in leaves)
    return DocumentHead.of(tree, user_metadata).document(leaves, databases, checksums)


_encode_str = json.encoder.encode_basestring_ascii  # (what json.dumps uses for a str: the C encoder)


def array_leaf_heads(metas: Sequence[ArrayMeta]) -> list[str | None]:
    """Each array leaf's entry in the metadata document up to its checksums, as JSON text (see
    :func:`array_leaf_texts`); None for a leaf with compression or chunk hashes, whose entry
    ``to_json`` makes. A save of a tree like one before keeps them (api/_recall.py).

    What leaves of one kind share (container, dtypes and shapes; layout and database) is
    serialised once; each leaf adds its key and path.
    """
    enc = _encode_str
    kinds: dict[tuple[Any, ...], str] = {}
    places: dict[tuple[int, str | None], str] = {}
    out: list[str | None] = []
    for m in metas:
        if m.compression is not None or m.chunk_hashes is not None:
            out.append(None)
            continue
        kind = (m.container, m.dtype.name, m.dtype.storage, m.shape, m.chunk_shape)
        mid = kinds.get(kind)
        if mid is None:
            mid = kinds[kind] = (
                f',"container":{enc(m.container)},"dtype":{enc(m.dtype.name)},"storage_dtype":{enc(m.dtype.storage)}'
                f',"shape":{_dumps(list(m.shape))},"chunk_shape":{_dumps(list(m.chunk_shape))},"path":'
            )
        place = (id(m.layout), m.database)  # (the metas hold their layouts: an id is not reused meanwhile)
        tail = places.get(place)
        if tail is None:
            layout = "null" if m.layout is None else _dumps(m.layout.to_json())
            database = "" if m.database is None else f',"database":{enc(m.database)}'
            tail = places[place] = f',"layout":{layout}{database}'
        out.append('{"kind":"array","key":' + enc(m.key) + mid + enc(m.path) + tail)
    return out


def array_leaf_texts(
    metas: Sequence[ArrayMeta],
    crcs: Sequence[bytes | None],
    hashes: Sequence[Sequence[str] | None],
    refs: Sequence[tuple[int, int] | None],
    heads: Sequence[str | None] | None = None,
) -> list[str]:
    """Each array leaf's entry in the metadata document as JSON text: ``meta.to_json(crc, hashes, ref)``
    serialised as the document serialises it (tests check it byte for byte).

    ``heads``: :func:`array_leaf_heads` of ``metas``, if made before. A save of 100,000
    small leaves spent a quarter of its commit on a dict per leaf and its serialisation;
    each leaf's entry is now its head and its checksums, those of leaves of one chunk
    encoded together. Leaves with compression or chunk hashes, or without checksums, go
    through ``to_json``. (A save whose leaves all have 4-byte checksums in the document
    fills a :class:`SumsTemplate` instead.)
    """
    if heads is None:
        heads = array_leaf_heads(metas)
    single = _single_chunk_sums(crcs)
    out: list[str] = []
    for m, head, crc, hashed, at, sums in zip(metas, heads, crcs, hashes, refs, single, strict=True):
        if head is None or hashed or (at is None and crc is None):
            out.append(_dumps(m.to_json(crc, hashed, at)))
        elif at is not None:
            out.append(f'{head},"chunk_crc32c_at":[{int(at[0])},{int(at[1])}]}}')
        elif sums is not None:
            out.append(head + sums)
        else:
            out.append(f'{head},"chunk_crc32c":"{base64.b64encode(crc).decode()}"}}')  # type: ignore[arg-type]
    return out


_SUMS_OPEN = ',"chunk_crc32c":"'
_B64 = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", dtype=np.uint8)


def _single_chunk_sums(crcs: Sequence[bytes | None]) -> list[str | None]:
    """``',"chunk_crc32c":"<base64>"}'`` for each array of one chunk (a 4-byte checksum), None for the
    others: the base64 of all of them made at once (numpy), not a call per leaf."""
    sizes = [0 if c is None else len(c) for c in crcs]
    every = sizes.count(4) == len(crcs)
    where = range(len(crcs)) if every else [i for i, n in enumerate(sizes) if n == 4]
    out: list[str | None] = [None] * len(crcs)
    if not where:
        return out
    joined_crcs = b"".join(crcs) if every else b"".join([crcs[i] for i in where])  # type: ignore[misc, arg-type]
    width = len(_SUMS_FILLER)  # (the opening, 8 base64 characters, the last two "==", and '"}')
    text = np.empty((len(where), width), dtype=np.uint8)
    text[:] = np.frombuffer(_SUMS_FILLER.encode(), dtype=np.uint8)
    text[:, len(_SUMS_OPEN) : len(_SUMS_OPEN) + 6] = _base64_of_sums(joined_crcs)
    joined = text.tobytes().decode("ascii")
    texts = [joined[at : at + width] for at in range(0, len(joined), width)]
    if every:
        return texts  # type: ignore[return-value]
    for i, t in zip(where, texts, strict=True):
        out[i] = t
    return out


_SUMS_FILLER = _SUMS_OPEN + "AAAAAA==" + '"}'  # (a 4-byte checksum's base64 ends "==")


def _base64_of_sums(joined: bytes) -> np.ndarray:
    """The base64 of each 4-byte checksum in ``joined`` up to its closing "==": a row of 6 ASCII bytes each."""
    b = np.frombuffer(joined, dtype=np.uint8).reshape(-1, 4)
    out = np.empty((len(b), 6), dtype=np.uint8)
    out[:, 0] = _B64[b[:, 0] >> 2]
    out[:, 1] = _B64[((b[:, 0] & 3) << 4) | (b[:, 1] >> 4)]
    out[:, 2] = _B64[((b[:, 1] & 15) << 2) | (b[:, 2] >> 6)]
    out[:, 3] = _B64[b[:, 2] & 63]
    out[:, 4] = _B64[b[:, 3] >> 2]
    out[:, 5] = _B64[(b[:, 3] & 3) << 4]
    return out


class SumsTemplate:
    """The text of a document of array leaves whose checksums (4 bytes each) are in it, made with every
    checksum a placeholder: :meth:`filled` writes a save's checksums into it (6 bytes a leaf).

    The rest of such a document is the same from one save of a tree to the next (api/_recall.py
    keeps the template): a save of 100,000 small leaves spent 70 ms of its commit splitting and
    joining each leaf's text again, and 17 ms more on each copy of the 24 MB document (a fresh
    allocation's page faults): the template is filled where it is.
    """

    __slots__ = ("_at", "_lock", "_text", "frame")

    def __init__(self, heads: Sequence[str], before: str, after: str) -> None:
        """``heads``: :func:`array_leaf_heads` (none None); ``before``, ``after``: the document's
        frame (:meth:`DocumentHead.frame`), ASCII as json.dumps makes them (a placeholder's place
        is counted in characters)."""
        n = len(heads)
        body = [","] * (3 * n + 1)  # the frame's start; then per leaf its head, its checksums and a comma
        body[0] = before
        body[1::3] = heads
        body[2::3] = [_SUMS_FILLER] * n
        body[-1] = after  # (in place of the last leaf's comma)
        text = "".join(body) if n else before + after
        if not text.isascii():
            raise ValueError(f"a metadata document's text is not ASCII: {text[:200]!r}...")
        lengths = np.fromiter(map(len, heads), dtype=np.intp, count=n)
        ends = np.cumsum(lengths + (len(_SUMS_FILLER) + 1))  # (each leaf's text and its comma)
        at = len(before) + ends - (len(_SUMS_FILLER) + 1) + len(_SUMS_OPEN)  # where each leaf's base64 begins
        self.frame = (before, after)
        self._text = bytearray(text.encode())
        self._at = (at[:, None] + np.arange(6)).reshape(-1)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def filled(self, crcs: bytes) -> Iterator[bytearray]:
        """The document with these checksums (each leaf's 4 bytes, joined in order): the template's own
        text, to use only within the block (saves filling one template wait for each other)."""
        if len(crcs) * 6 != len(self._at) * 4:
            raise ValueError(f"{len(crcs) // 4} checksums for a document of {len(self._at) // 6} leaves")
        with self._lock:
            np.frombuffer(self._text, dtype=np.uint8)[self._at] = _base64_of_sums(crcs).reshape(-1)
            yield self._text
