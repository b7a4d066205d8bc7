"""Packed arrays' keys, written and read straight through their OCDBT databases or zip archives.

A packed array (format version 2) is a zarr v3 array whose keys live in its writer's OCDBT
database. Opening it through TensorStore's zarr driver costs a spec parse, a metadata
read and a driver per array: for 10,000 small leaves that was most of a save or load. An
uncompressed packed array's keys are simple enough to write and read here instead, one
key-value store per database: ``<path>/zarr.json`` (the metadata document TensorStore would
write, byte for byte) and ``<path>/c/...`` (each chunk's little-endian bytes, edge chunks
padded with zeros, followed by their crc32c), written in transactions of bounded size.
The stored form is the same as TensorStore's, so either reads what the other wrote. Zip archives
are read and written without TensorStore (it is imported for OCDBT databases only).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._dtypes import dtype_from_name
from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError
from pytreeckpt.format import ARCHIVE_DIR, ArrayMeta, zarr_metadata
from pytreeckpt.storage._archive import ArchiveReader, ArchiveWriter, entry_bytes
from pytreeckpt.storage._chunkfiles import LITTLE_ENDIAN, _encoded_prefix
from pytreeckpt.storage._deadline import StoreWaits, cancel
from pytreeckpt.storage._io import OCDBT_INLINE_BYTES, _chunk_key
from pytreeckpt.storage._location import OCDBT_CACHE, ContextOnUse, Resolved

FLUSH_BYTES = 32 * 1024 * 1024
"""A database's transaction is committed (and a new one begun) once it holds this many bytes."""


def in_archives(database: str) -> bool:
    """Whether a database is a directory of zip archives (``packed/<rank>``), not an OCDBT database."""
    return database.startswith(ARCHIVE_DIR + "/")


def describe_database(database: str | None) -> str:
    """How errors name where a packed array lives."""
    if database is not None and in_archives(database):
        return f"the packed archives {database!r}"
    return f"the OCDBT database {database!r}"


def handles(meta: ArrayMeta) -> bool:
    """Whether this array's keys are written and read here: packed, uncompressed, not empty, little-endian host."""
    return meta.database is not None and meta.compression is None and LITTLE_ENDIAN and meta.nbytes > 0


def _fill_value(storage: str) -> Any:
    """The fill value TensorStore writes for an array of stored type ``storage`` (zero, as JSON of that type)."""
    if storage == "bool":
        return False
    if storage.startswith(("int", "uint")):
        return 0
    if storage.startswith("complex"):
        return [0.0, 0.0]
    return 0.0


@functools.lru_cache(maxsize=256)
def _template(storage: str, ndim: int) -> tuple[str, str, str]:
    """The zarr.json TensorStore writes for an uncompressed array of this type and rank, cut around its shapes:
    ``head + chunk_shape + middle + shape + tail``, the shapes' numbers joined by commas.

    Made here, without TensorStore (reading a checkpoint needs none): TensorStore's own document, its keys
    sorted, without spaces, the ``bytes`` codec's endianness left out for one-byte types (tests/test_storage.py
    compares the two for every type and several ranks).
    """
    dtype = dtype_from_name(storage)
    doc = zarr_metadata(dtype, [0] * ndim, [0] * ndim)
    if dtype.itemsize == 1:
        doc["codecs"][0] = {"name": "bytes"}
    doc.update(fill_value=_fill_value(storage), node_type="array", zarr_format=3)
    doc["chunk_grid"]["configuration"]["chunk_shape"] = ["@CHUNK@"]
    doc["shape"] = ["@SHAPE@"]
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    head, rest = text.split('"@CHUNK@"')
    middle, tail = rest.split('"@SHAPE@"')
    return head, middle, tail


def zarr_json(meta: ArrayMeta) -> bytes:
    """The ``zarr.json`` of an uncompressed array (packed or of its own), exactly as TensorStore writes it."""
    return _zarr_json(meta.dtype.storage, meta.shape, meta.chunk_shape)


@functools.lru_cache(maxsize=1024)
def _zarr_json(storage: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...]) -> bytes:
    head, middle, tail = _template(storage, len(shape))
    chunk = ",".join(map(str, chunk_shape))
    joined = ",".join(map(str, shape))
    return f"{head}{chunk}{middle}{joined}{tail}".encode()


MAX_ZARR_JSON_BYTES = 1 << 16
"""The most an array's stored ``zarr.json`` may hold (this library's are a few hundred bytes)."""

_ZARR_FIELDS = (
    "zarr_format",
    "node_type",
    "shape",
    "data_type",
    "chunk_grid",
    "chunk_key_encoding",
    "codecs",
    "fill_value",
)


def check_zarr_json(meta: ArrayMeta, stored: bytes | None) -> None:
    """Refuse an uncompressed array's stored ``zarr.json`` (None: missing), packed or of its own, that does not
    describe the array as the document does, as TensorStore or zarr would read it: its shape, data type, chunk
    grid, chunk key encoding, codecs and fill value. What TensorStore writes (:func:`zarr_json`) is compared byte
    for byte; another writing of the same (another TensorStore version's) field by field."""
    if stored is not None and stored == zarr_json(meta):
        return
    where = f"leaf {meta.key!r}: {meta.path}/zarr.json"
    if meta.database is not None:
        where += f" in {describe_database(meta.database)}"
    if stored is None:
        raise CheckpointError(
            f"{where} is missing: TensorStore or zarr could not open the array this document describes"
        )
    try:
        found = json.loads(stored)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{where} is not a JSON document ({e})") from e
    if not isinstance(found, dict):
        raise CheckpointError(f"{where} is not a JSON object")
    expected = json.loads(zarr_json(meta))
    for field in _ZARR_FIELDS:
        if found.get(field) != expected.get(field):
            raise CheckpointError(
                f"{where} does not describe the array the document does: its {field} is "
                f"{json.dumps(found.get(field))[:200]}, the document's array has {json.dumps(expected.get(field))}"
            )


def encode_chunk(data: np.ndarray, chunk: tuple[int, ...]) -> tuple[bytes, int]:
    """A chunk as stored: its valid box ``data`` padded to ``chunk`` with zeros, then its crc32c; and that crc."""
    if data.shape == chunk:  # (the whole chunk, the common case: its bytes in C order, whatever the strides)
        body = data.tobytes()
    else:
        raw = _encoded_prefix(data, chunk)
        pad = math.prod(chunk) * data.dtype.itemsize - raw.nbytes
        body = raw.tobytes() if not pad else raw.tobytes() + bytes(pad)
    crc = crc32c(body)
    return body + crc.to_bytes(4, "little"), crc


def decode_chunk(
    value: bytes, meta: ArrayMeta, what: str, expected: int | None, dtype: np.dtype | None = None
) -> np.ndarray:
    """A stored chunk's elements (the whole chunk shape), its size and checksums checked: of ``dtype`` (the
    stored type's when None; ``meta.dtype.raw`` where only the bytes are checked)."""
    size = math.prod(meta.chunk_shape) * meta.dtype.itemsize
    if len(value) != size + 4:
        raise CheckpointError(
            f"{what} of {meta.path!r} in {describe_database(meta.database)} holds {len(value)} bytes, "
            f"expected {size + 4} (a damaged or replaced chunk)"
        )
    stored = int.from_bytes(value[size:], "little")
    crc = crc32c(np.frombuffer(value, dtype=np.uint8, count=size))
    if crc != stored:
        raise CheckpointError(
            f"{what} of {meta.path!r} in {describe_database(meta.database)} is damaged: its bytes have "
            f"crc32c {crc:#010x}, it records {stored:#010x}"
        )
    if expected is not None and crc != expected:
        raise CheckpointError(
            f"{what} is not the chunk the metadata records: it has crc32c {crc:#010x}, the metadata "
            f"records {expected:#010x} (a chunk moved, swapped or replaced)"
        )
    if dtype is None:
        dtype = meta.dtype.numpy
    return np.frombuffer(value, dtype=dtype, count=size // meta.dtype.itemsize).reshape(meta.chunk_shape)


class PackedStores:
    """One key-value store per OCDBT database of this checkpoint; writes go through bounded transactions."""

    def __init__(self, location: Resolved, contexts: ContextOnUse, waits: StoreWaits | None = None) -> None:
        self.location, self.contexts = location, contexts
        self.waits = waits or StoreWaits(None)
        self._readers: dict[str, Any] = {}
        self._writers: dict[str, tuple[Any, Any]] = {}  # database -> (store, its open transaction)
        self._archives: dict[str, ArchiveWriter] = {}  # database -> its writer (zip archives)
        self._buffered: dict[str, int] = {}
        self._lock = threading.Lock()

    def _spec(self, database: str, create: bool) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "driver": "ocdbt",
            "base": self.location.kvstore(database + "/"),
            "cache_pool": OCDBT_CACHE,
        }
        if create:  # the same spec (and so the same driver) as TensorStore's zarr arrays in this database
            spec["config"] = {"max_inline_value_bytes": OCDBT_INLINE_BYTES}
        return spec

    def reader(self, database: str) -> Any:
        """What reads the database's keys: ``read(key)`` gives a future of a result with ``state`` and ``value``."""
        with self._lock:
            if database not in self._readers:
                if in_archives(database):
                    assert self.location.path is not None  # (archives are written to local directories only)
                    self._readers[database] = ArchiveReader(self.location.path / database, database)
                else:
                    import tensorstore as ts  # (OCDBT databases only: archives are read here)

                    opened = ts.KvStore.open(self._spec(database, False), context=self.contexts.get())
                    self._readers[database] = self.waits.wait(opened, f"opening the database {database!r}")
            return self._readers[database]

    def _archive(self, database: str) -> ArchiveWriter:
        assert in_archives(database)
        with self._lock:
            writer = self._archives.get(database)
            if writer is None:
                assert self.location.path is not None
                writer = self._archives[database] = ArchiveWriter(self.location.path, database)
        return writer

    def begin(self, meta: ArrayMeta) -> None:
        """Write a packed array's ``zarr.json`` as it is created; in zip archives, first place the array in
        the archive that will hold all its entries (its chunks, written later, go there too)."""
        assert meta.database is not None
        key, value = meta.path + "/zarr.json", zarr_json(meta)
        if not in_archives(meta.database):
            self.write(meta.database, key, value)
            return
        grid = [-(-n // c) for n, c in zip(meta.shape, meta.chunk_shape, strict=True)]
        chunks = math.prod(grid)
        longest = f"{meta.path}/{_chunk_key(tuple(g - 1 for g in grid))}"  # (the most digits)
        chunk_bytes = math.prod(meta.chunk_shape) * meta.dtype.itemsize + 4
        writer = self._archive(meta.database)
        with _archive_errors(meta.database):
            nbytes = entry_bytes(key, len(value)) + chunks * entry_bytes(longest, chunk_bytes)
            writer.reserve(meta.path, 1 + chunks, nbytes)
            writer.write(key, value, meta.path)

    def write_many(self, database: str, items: Iterable[tuple[str, bytes]], leaf: str | None = None) -> None:
        """Append ``(key, value)`` entries to the database's zip archives: of array ``leaf`` (see :meth:`begin`),
        or all the entries of one array."""
        writer = self._archive(database)
        with _archive_errors(database):
            writer.write_many(items, leaf)

    def write_groups(self, database: str, groups: Iterable[Sequence[tuple[str, bytes]]]) -> None:
        """Append groups of ``(key, value)`` entries to the database's zip archives, each all of one array's."""
        writer = self._archive(database)
        with _archive_errors(database):
            writer.write_groups(groups)

    def write(self, database: str, key: str, value: bytes, leaf: str | None = None) -> Future[Any] | None:
        """Write one key in the database's open transaction; returns the commit's future when this one filled it.

        In zip archives the key is appended to the archive of array ``leaf`` (nothing to wait for: None).
        """
        if in_archives(database):
            self.write_many(database, ((key, value),), leaf)
            return None
        import tensorstore as ts

        with self._lock:
            if database not in self._writers:
                opened = ts.KvStore.open(self._spec(database, True), context=self.contexts.get())
                store = self.waits.wait(opened, f"opening the database {database!r}")
                self._writers[database] = (store, ts.Transaction())
                self._buffered[database] = 0
            store, txn = self._writers[database]
            store.with_transaction(txn).write(key, value)
            self._buffered[database] += len(value)
            if self._buffered[database] < FLUSH_BYTES:
                return None
            self._writers[database] = (store, ts.Transaction())
            self._buffered[database] = 0
        return _commit(txn, database)

    def commit(self) -> None:
        """Commit every open transaction and wait for them."""
        with self._lock:
            open_ = [(database, txn) for database, (_, txn) in self._writers.items()]
            self._writers.clear()
            self._buffered.clear()
            archives = list(self._archives.items())
            self._archives.clear()
        for database, writer in archives:
            with _archive_errors(database):
                writer.finish()
        futures = [(database, _commit(txn, database)) for database, txn in open_]
        for database, future in futures:
            try:
                self.waits.wait(future, f"writing the packed arrays of the database {database!r}")
            except CheckpointTimeoutError:
                for _, other in futures:
                    cancel(other)
                raise

    def abort(self) -> None:
        """Drop what open transactions hold (after a failure)."""
        with self._lock:
            for _, txn in self._writers.values():
                txn.abort()
            self._writers.clear()
            self._buffered.clear()
            for writer in self._archives.values():
                writer.abort()
            self._archives.clear()


@contextlib.contextmanager
def _archive_errors(database: str) -> Iterator[None]:
    """A failed file operation on a database's zip archives (a full disk) as a CheckpointError naming them."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(f"cannot write the packed archives {database!r}: {e}") from e


def _commit(txn: Any, database: str) -> Future[Any]:
    out: Future[Any] = Future()
    try:
        committed = txn.commit_async()
    except Exception as e:
        out.set_exception(CheckpointError(f"cannot write the OCDBT database {database!r}: {e}"))
        return out

    def done(f: Any) -> None:
        if out.cancelled():
            return
        try:
            f.result()
        except BaseException as e:  # (a cancelled commit too)
            out.set_exception(CheckpointError(f"cannot write the OCDBT database {database!r}: {e}"))
        else:
            out.set_result(None)

    committed.add_done_callback(done)
    out.add_done_callback(lambda f: cancel(committed) if f.cancelled() else None)  # (a wait that timed out)
    return out


__all__ = [
    "FLUSH_BYTES",
    "MAX_ZARR_JSON_BYTES",
    "PackedStores",
    "check_zarr_json",
    "decode_chunk",
    "describe_database",
    "encode_chunk",
    "handles",
    "in_archives",
    "zarr_json",
]
