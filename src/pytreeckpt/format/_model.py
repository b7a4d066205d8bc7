"""The document's model: a tensor leaf as stored (:class:`ArrayMeta`), its compression, a plain Python
leaf (:class:`ValueMeta`), the parsed document (:class:`CheckpointDoc`), and each array's zarr v3 metadata."""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._dtypes import DType
from pytreeckpt.core._errors import CheckpointError, MetadataError
from pytreeckpt.core._node import Node
from pytreeckpt.core._sharding import Layout
from pytreeckpt.format._checksums import ChecksumFile


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

        >>> from pytreeckpt.core._dtypes import dtype_from_name
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


def chunk_count(shape: Sequence[int], chunk_shape: Sequence[int]) -> int:
    """The number of chunks of a regular grid (a 0-d array has one; a zero-size one none)."""
    return math.prod(-(-s // c) for s, c in zip(shape, chunk_shape, strict=True))
