"""Packed arrays' chunks: keys of their writer's database (OCDBT, or entries of zip archives), written and
read by this package itself, every chunk checked; and the lean path of many small arrays (each one chunk in
a zip archive), written and read in the calling thread in one batch per database."""

from __future__ import annotations

import binascii
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.format import ARCHIVE_DIR, ArrayMeta
from pytreeckpt.storage._archive import ArchiveReader
from pytreeckpt.storage._chunkfiles import LITTLE_ENDIAN
from pytreeckpt.storage._deadline import cancel, landed_within
from pytreeckpt.storage._integrity import _INLINE_CHECK_BYTES, FileChecks
from pytreeckpt.storage._io import _all_of, _chunk_key, io_pool
from pytreeckpt.storage._packed import (
    MAX_ZARR_JSON_BYTES,
    check_zarr_json,
    decode_chunk,
    describe_database,
    encode_chunk,
    zarr_json,
)

_ARCHIVES = ARCHIVE_DIR + "/"
_ZERO_KEYS = ["/" + _chunk_key((0,) * n) for n in range(65)]  # the key of chunk (0, ..., 0), by rank

DONE: Future[Any] = Future()
DONE.set_result(None)


class PackedIO(FileChecks):
    """Writes and reads packed arrays' chunks (:func:`~pytreeckpt.storage._packed.handles`)."""

    def write_packed(
        self, meta: ArrayMeta, region: Region, data: np.ndarray, record: Callable[[tuple[int, ...], int], None] | None
    ) -> Future[Any]:
        """Write ``region``'s chunks as keys of the array's database (see :mod:`~pytreeckpt.storage._packed`).

        The bytes are copied into the database's transaction, so ``data`` may be reused at
        once; the future is that of a transaction this write filled and committed, if any.
        """
        assert meta.database is not None
        chunk = meta.chunk_shape
        if data.shape == chunk and not any(region.offset):  # the whole array in one chunk (most small arrays)
            index = (0,) * len(chunk)
            value, crc = encode_chunk(data, chunk)
            if record is not None:
                record(index, crc)
            future = self.packed.write(meta.database, f"{meta.path}/{_chunk_key(index)}", value, meta.path)
            return DONE if future is None else future
        futures = []
        grid = ChunkGrid(meta.shape, chunk)
        for index in grid.touching(region):
            box = grid.region(index).relative_to(region).slices()
            value, crc = encode_chunk(data[box], chunk)
            if record is not None:
                record(index, crc)
            future = self.packed.write(meta.database, f"{meta.path}/{_chunk_key(index)}", value, meta.path)
            if future is not None:
                futures.append(future)
        return _all_of(futures) if futures else DONE

    def read_packed_whole(self, meta: ArrayMeta, store: Any, dest: np.ndarray) -> PackedWhole:
        """Start reading every chunk of a packed array (:func:`handles`) into ``dest``, the whole array.

        Returns what waits for the reads (its ``result()``), checks each chunk as :meth:`_chunk`
        does (size, its own crc32c, the crc the metadata records) and fills ``dest``: the
        lean path of a load of many small arrays, one key-value read per chunk.
        """
        chunk = meta.chunk_shape
        one = chunk == meta.shape
        grid = ChunkGrid(meta.shape, chunk)
        indices = [(0,) * len(chunk)] if one else list(grid.touching(Region.full(meta.shape)))
        try:
            run = None
            if not one and isinstance(store, ArchiveReader):  # (an array's chunk entries follow one another)
                size = math.prod(chunk) * meta.dtype.itemsize + 4
                run = store.run([f"{meta.path}/{_chunk_key(index)}" for index in indices], size)
            if run is not None:
                reads = [(index, _Landed(value)) for index, value in zip(indices, run, strict=True)]
            else:
                reads = [(index, _read_key(store, meta, index)) for index in indices]
        except Exception as e:
            raise CheckpointError(f"leaf {meta.key!r}: reading {meta.path!r} in {meta.database!r}: {e}") from e
        return PackedWhole(meta, grid, reads, dest)

    def small_whole(self, meta: ArrayMeta) -> bool:
        """Whether :meth:`read_small` reads this array: one chunk, packed in zip archives, uncompressed."""
        database = meta.database
        return (
            database is not None
            and database.startswith(_ARCHIVES)
            and meta.chunk_shape == meta.shape
            and meta.compression is None
            and LITTLE_ENDIAN
            and meta.nbytes > 0
        )

    def write_small(
        self, metas: Sequence[ArrayMeta], datas: Sequence[np.ndarray], record: Callable[[int, int], None]
    ) -> int:
        """Write whole arrays of one chunk packed in zip archives (:meth:`small_whole`): ``datas[k]`` is array k's.

        The lean path of a save of many small leaves, in the calling thread: each array's
        ``zarr.json`` and chunk (as :func:`encode_chunk` makes it) are appended to its
        database's archives, in one batch per database; ``record(k, crc32c)`` is called
        with each chunk's checksum. The bytes are copied, so the data may change once this
        returns. Returns the bytes of elements written.
        """
        batches: dict[str, list[tuple[tuple[str, bytes], tuple[str, bytes]]]] = {}
        written = 0
        for k, (meta, data) in enumerate(zip(metas, datas, strict=True)):
            database = meta.database
            assert database is not None
            assert meta.chunk_shape == meta.shape == data.shape
            value, crc = encode_chunk(data, meta.chunk_shape)
            record(k, crc)
            batch = batches.get(database)
            if batch is None:
                batch = batches[database] = []
                self.place.note_array(meta)  # (its database, made durable in :meth:`sync`: once per database)
            chunk_key = meta.path + _ZERO_KEYS[len(meta.shape)]
            batch.append(((meta.path + "/zarr.json", zarr_json(meta)), (chunk_key, value)))
            written += data.nbytes
        for database, batch in batches.items():
            self.packed.write_groups(database, batch)  # (an array's two entries in one archive)
        return written

    def read_small(self, metas: Sequence[ArrayMeta]) -> list[bytes]:
        """Whole arrays of one chunk packed in zip archives (:meth:`small_whole`): each one's stored chunk.

        Each is ``meta.nbytes`` bytes of elements (little-endian, C order) and the 4 of their crc32c.

        The lean path of a load of many small leaves, in the calling thread: each array's
        archive entry is read from its open archive, and checked as every packed chunk is
        (the entry's header names it, its size, its own crc32c and the one the metadata
        records), and its ``zarr.json`` as :func:`check_zarr_json` says; a missing entry is a
        CheckpointError naming the leaf; so is an archive that changed while it was read. The
        archives' directories are checked as :meth:`scan` says before the first read of each.
        """
        readers: dict[str, ArchiveReader] = {}
        groups: dict[str, list[int]] = {}
        for k, meta in enumerate(metas):
            assert meta.database is not None
            group = groups.get(meta.database)
            if group is None:
                group = groups[meta.database] = []
            group.append(k)
        read: list[tuple[bytes, bytes] | None] = [None] * len(metas)
        for database, ks in groups.items():
            self.place.check_files(database, metas[ks[0]].key)
            reader = readers[database] = self.packed.reader(database)
            try:
                chosen = map(metas.__getitem__, ks)
                wanted = [(m.path + "/zarr.json", m.path + _ZERO_KEYS[len(m.shape)], m.nbytes + 4) for m in chosen]
                for k, got in zip(ks, reader.pairs(wanted, MAX_ZARR_JSON_BYTES), strict=True):
                    read[k] = got
            except CheckpointError as e:
                raise CheckpointError(f"leaf {metas[ks[0]].key!r} and others: {e}") from e
        out = []
        for meta, got in zip(metas, read, strict=True):
            db = meta.database
            assert db is not None
            ndim = len(meta.shape)
            size = meta.nbytes
            if got is None:  # (not in the common layout, or damaged: read alone, saying what is wrong)
                reader = readers[db]
                try:
                    stored = reader.value(meta.path + "/zarr.json", limit=MAX_ZARR_JSON_BYTES, check=False)
                    value = reader.value(meta.path + _ZERO_KEYS[ndim], size + 4, check=False)
                except CheckpointError as e:
                    raise CheckpointError(f"leaf {meta.key!r}: {e}") from e
            else:
                stored, value = got
            check_zarr_json(meta, stored)
            expected = None
            text = meta.crc32c_text
            if text is not None and meta.chunk_crc32c is None:
                try:
                    crcs = binascii.a2b_base64(text, strict_mode=True)
                except (binascii.Error, ValueError):
                    crcs = b""
                if len(crcs) == 4:
                    expected = int.from_bytes(crcs, "little")
                else:
                    meta.crc32c()  # (raises, naming the leaf)
            else:  # (recorded as bytes, in a checksums file, or not at all)
                expected = meta.recorded_crc32c((0,) * ndim)
            if (
                value is None
                or len(value) != size + 4
                or (crc := crc32c(value[:size])) != int.from_bytes(value[size:], "little")
                or (expected is not None and crc != expected)
            ):
                what = f"leaf {meta.key!r}: chunk {[0] * ndim}"
                if value is None:
                    raise CheckpointError(
                        f"{what} of {meta.path!r} is missing from {describe_database(db)} (leaf {meta.key!r})"
                    )
                decode_chunk(value, meta, what, expected)  # (raises, saying what is wrong)
                raise AssertionError("unreachable")
            out.append(value)
        for reader in readers.values():
            reader.check_unchanged()
        return out


def _read_key(store: Any, meta: ArrayMeta, index: tuple[int, ...]) -> Any:
    """Start the read of a packed chunk's key; from zip archives, only an entry of the chunk's size is read."""
    key = f"{meta.path}/{_chunk_key(index)}"
    if isinstance(store, ArchiveReader):
        return store.read(key, math.prod(meta.chunk_shape) * meta.dtype.itemsize + 4)
    return store.read(key)


class PackedWhole:
    """The reads of every chunk of a packed array into ``dest`` (see :meth:`PackedIO.read_packed_whole`):
    ``result()`` waits for them, checks each chunk and fills ``dest``."""

    __slots__ = ("_dest", "_grid", "_meta", "_reads")

    def __init__(self, meta: ArrayMeta, grid: ChunkGrid, reads: list[tuple[tuple[int, ...], Any]], dest: Any) -> None:
        self._meta, self._grid, self._reads, self._dest = meta, grid, reads, dest

    def result(self, timeout: float | None = None) -> None:
        meta, dest = self._meta, self._dest
        one = meta.chunk_shape == meta.shape
        end = None if timeout is None else time.monotonic() + timeout
        for index, landing in self._reads:
            if end is not None and not isinstance(landing, _Landed):
                landed_within(landing, max(0.0, end - time.monotonic()))
            what = f"leaf {meta.key!r}: chunk {list(index)}"
            data = _landed(landing, meta, what, meta.recorded_crc32c(index))
            if one:
                dest[...] = data
            else:
                whole = self._grid.region(index)
                dest[whole.slices()] = data[tuple(slice(0, n) for n in whole.shape)]

    def cancel(self) -> None:
        for _, landing in self._reads:
            if not isinstance(landing, _Landed):
                cancel(landing)


class _Landed:
    """A key's value already read, as TensorStore's read results give it (``state``, ``value``), and its future."""

    __slots__ = ("value",)
    state = "value"

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> _Landed:
        return self


def _landed(
    landing: Any, meta: ArrayMeta, what: str, expected: int | None, dtype: np.dtype | None = None
) -> np.ndarray:
    """A packed chunk's key-value read, waited for and checked (see :func:`decode_chunk`): the whole chunk."""
    try:
        got = landing.result()
    except Exception as e:
        raise CheckpointError(f"{what} of {meta.path!r} in {describe_database(meta.database)}: {e}") from e
    if got.state != "value":
        raise CheckpointError(
            f"{what} of {meta.path!r} is missing from {describe_database(meta.database)} (leaf {meta.key!r})"
        )
    return decode_chunk(got.value, meta, what, expected, dtype)


class PackedRead:
    """A packed chunk read from its database's key-value store, checked and copied to its targets.

    Small and alone (``lazy``): by the thread asking ``result()``; otherwise on an I/O
    thread as soon as it lands, settling a future.
    """

    def __init__(
        self,
        store: Any,
        meta: ArrayMeta,
        index: tuple[int, ...],
        targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
        what: str,
        expected: int | None,
        lazy: bool,
        workers: int,
    ) -> None:
        self._args: tuple[Any, ...] = (meta, targets, what, expected)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._checked = False
        self._out: Future[Any] | None = None
        try:
            self._landing = _read_key(store, meta, index)
        except Exception as e:
            self._landing = None
            self._error = CheckpointError(f"{what}: {e}")
            self._checked = True
        if (lazy and meta.nbytes <= _INLINE_CHECK_BYTES) or self._landing is None:
            return
        out: Future[Any] = Future()
        self._out = out

        def landed(_f: Any) -> None:
            io_pool().submit(workers, self._settle, out)

        self._landing.add_done_callback(landed)

    def _settle(self, out: Future[Any]) -> None:
        if out.cancelled():
            return
        try:
            self._check()
        except BaseException as e:
            out.set_exception(e)
        else:
            out.set_result(None)

    def _check(self) -> None:
        meta, targets, what, expected = self._args
        data = _landed(self._landing, meta, what, expected, None if targets else meta.dtype.raw)  # (none: verify's)
        for box, dest in targets:
            dest[...] = data[box]

    def result(self, timeout: float | None = None) -> None:
        if self._out is not None:
            self._out.result(timeout)
            return
        landing = self._landing
        if landing is not None:
            landed_within(landing, timeout)
        with self._lock:
            if not self._checked:
                self._checked = True
                try:
                    self._check()
                except BaseException as e:
                    self._error = e
                self._landing, self._args = None, ()  # the buffers are not kept alive
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        landing = self._landing
        if landing is not None:
            cancel(landing)
        if self._out is not None:
            self._out.cancel()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if self._out is not None:
            self._out.add_done_callback(fn)
            return
        fn(self)
