"""Integrity: what is stored is checked before and as it is read.

The files of an array are checked before anything opens them (kinds, places, sizes
against the metadata's claims); every chunk read is checked against the crc32c the
metadata records; chunk checksums and content hashes are gathered as a save writes."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.format import (
    ArrayMeta,
    chunk_count,
)
from pytreeckpt.storage._base import StorageBase
from pytreeckpt.storage._chunkfiles import chunk_crc, read_chunk
from pytreeckpt.storage._deadline import cancel, landed_within
from pytreeckpt.storage._packed import (
    MAX_ZARR_JSON_BYTES,
    PackedStores,
    check_zarr_json,
    describe_database,
    in_archives,
)
from pytreeckpt.storage._place import check_chunk_count

logger = logging.getLogger("pytreeckpt")


_INLINE_CHECK_BYTES = 1 << 20


class FileChecks(StorageBase):
    """Checks of the stored files of arrays, before TensorStore or a read opens them."""

    @property
    def packed(self) -> PackedStores:
        """The stores of this checkpoint's OCDBT databases and zip archives (see :mod:`pytreeckpt.storage._packed`)."""
        if self._packed is None:
            self._packed = PackedStores(self.location, self.contexts, self.waits)
        return self._packed  # type: ignore[no-any-return]

    def check_stored_sizes(self, metas: Sequence[ArrayMeta]) -> None:
        """Refuse metadata that claims more than is stored, before anything is allocated or looped over.

        Uncompressed chunks (raw bytes and a 4-byte checksum) hold at least the array's
        size; compressed ones at least ``1 / MAX_COMPRESSION_RATIO`` of it. A document
        claiming a huge shape is caught here instead of by a huge allocation. The chunks
        present bound the chunk grid (within ``MISSING_CHUNKS``, so a few missing chunks
        are named one by one when read), so no loop runs over a grid the files do not
        back. Packed arrays are small by definition (the metadata parser caps them); one of
        several chunks has its keys counted in its database. On a key-value store, whose
        listings carry no sizes, every chunk object must be present; a chunk shorter than
        claimed fails its read. Every file is checked as ``LocalDir.scan`` says.
        """
        for meta in metas:
            if meta.database is None:
                self.place.check_chunks_stored(meta)
            elif meta.chunk_shape != meta.shape:  # (one chunk, or none: nothing to count)
                self._check_packed_chunks(meta)

    def _check_packed_chunks(self, meta: ArrayMeta) -> None:
        """A packed array of several chunks: its chunk keys in the database bound its grid."""
        assert meta.database is not None
        if chunk_count(meta.shape, meta.chunk_shape) <= 1:
            return
        self.place.check_files(meta.database, meta.key)
        prefix = f"{meta.path}/c"
        try:  # through the database's reader, opened (an archive's directory parsed) once per checkpoint
            db = self.packed.reader(meta.database)
            if in_archives(meta.database):
                n = db.chunk_entries(meta.path)
            else:
                import tensorstore as ts  # (an OCDBT database: its reader is TensorStore's)

                listing = db.list(ts.KvStore.KeyRange(prefix + "/", prefix + "0"))
                n = len(self.waits.wait(listing, f"listing the chunks of {meta.path!r} in {meta.database!r}"))
        except CheckpointTimeoutError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"leaf {meta.key!r}: cannot list the chunks of {meta.path!r} in {meta.database!r}: {e}"
            ) from e
        check_chunk_count(meta, n, f"{describe_database(meta.database)} holds {n} of its chunks")

    def stored_bytes(self, meta: ArrayMeta) -> int | None:
        """Bytes of the chunk files of one stored array; None where the store cannot tell (packed, key-value)."""
        return None if meta.database is not None else self.place.stored_bytes(meta)

    def check_files(self, metas: Sequence[ArrayMeta]) -> None:
        """Before TensorStore or the executor opens anything of these arrays: every file of each
        (``zarr.json`` and chunks), or of its OCDBT database or zip archives, is checked by
        ``LocalDir.scan``; the chunk checksums the metadata records for it decode (MetadataError if
        not); and an array packed in zip archives has the ``zarr.json`` there that the document
        implies (:func:`check_zarr_json`), so TensorStore and zarr read what this library does."""
        for meta in metas:
            meta.crc32c()
        for meta in metas:
            self.place.check_files(meta.path if meta.database is None else meta.database, meta.key)
        for meta in metas:
            if meta.database is not None and in_archives(meta.database):
                reader = self.packed.reader(meta.database)
                try:
                    stored = reader.value(meta.path + "/zarr.json", limit=MAX_ZARR_JSON_BYTES)
                except CheckpointError as e:
                    raise CheckpointError(f"leaf {meta.key!r}: {e}") from e
                check_zarr_json(meta, stored)


def _read_file_chunk(
    path: Path,
    meta: ArrayMeta,
    valid: tuple[int, ...],
    targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    what: str,
    expected: int | None,
    inside: str,
    direct: bool = False,
) -> None:
    read_chunk(
        path,
        meta.chunk_shape,
        valid,
        targets,
        what,
        dtype=meta.dtype.numpy if targets else meta.dtype.raw,  # (none: a check of the bytes alone, as verify's)
        expected=expected,
        inside=inside,
        direct=direct,
    )


def _check_stored_chunk(
    landed: Any,
    meta: ArrayMeta,
    targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    straight: bool,
    what: str,
    expected: int | None,
) -> None:
    """A whole chunk TensorStore read (``landed``): check its crc32c against ``expected``, fill ``targets``."""
    try:
        data = targets[0][1] if straight else landed.result()
        if straight:
            landed.result()
    except Exception as e:
        raise CheckpointError(f"{what}: {e}") from e
    if expected is not None:
        crc = chunk_crc(data, meta.chunk_shape, meta.dtype.numpy)
        if crc != expected:
            raise CheckpointError(
                f"{what} is not the chunk the metadata records: it has crc32c {crc:#010x}, the metadata "
                f"records {expected:#010x} (a chunk moved, swapped or replaced)"
            )
    if not straight:
        for box, dest in targets:
            dest[...] = data[box]


def _settle_stored_chunk(landed: Any, out: Future[Any], *args: Any) -> None:
    """:func:`_check_stored_chunk`, settling ``out`` with its outcome (unless it was cancelled)."""
    if out.cancelled():
        return
    try:
        _check_stored_chunk(landed, *args)
    except BaseException as e:
        out.set_exception(e)
    else:
        out.set_result(None)


class _Landing:
    """A small chunk's TensorStore read, checked (:func:`_check_stored_chunk`) by the thread asking ``result()``."""

    def __init__(self, landed: Any, *args: Any) -> None:
        self._landed = landed
        self._args: tuple[Any, ...] = args
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._checked = False

    def result(self, timeout: float | None = None) -> None:
        landed = self._landed
        if landed is not None:
            landed_within(landed, timeout)
        with self._lock:
            if not self._checked:
                self._checked = True
                try:
                    _check_stored_chunk(self._landed, *self._args)
                except BaseException as e:
                    self._error = e
                self._landed, self._args = None, ()  # the buffers are not kept alive
        if self._error is not None:
            raise self._error

    def cancel(self) -> None:
        landed = self._landed
        if landed is not None:
            cancel(landed)


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable plus free swap, at most its cgroup's limit, and at
    most what its address-space limit (``RLIMIT_AS``) leaves beyond what it maps already (``VmSize``).

    None where the system does not say (no ``/proc/meminfo``).
    """
    free = _system_memory()
    room = _address_space_left()
    if room is None:
        return free
    return room if free is None else min(free, room)


def _address_space_left() -> int | None:
    """What ``RLIMIT_AS`` leaves this process to map (None: no limit, or the system does not say)."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    except (ImportError, OSError, ValueError):
        return None
    if limit == resource.RLIM_INFINITY or limit < 0:
        return None
    try:
        with open("/proc/self/status", "rb") as f:
            mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith(b"VmSize:"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return max(0, limit - mapped)


def _system_memory() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            info = {line.split(b":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
    except (OSError, ValueError, IndexError):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            return None
    if b"MemAvailable" not in info:
        return None
    free = info[b"MemAvailable"] + info.get(b"SwapFree", 0)
    try:  # a container's whole memory limit (cgroup v2; its usage counts reclaimable page cache, so not that)
        with open("/sys/fs/cgroup/memory.max", "rb") as f:
            limit = f.read().strip()
        if limit != b"max":
            free = min(free, int(limit))
    except (OSError, ValueError):
        pass
    return free


def chunk_hash(data: np.ndarray) -> str:
    """blake2b-128 of an array's raw bytes in C order."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return hashlib.blake2b(raw.data, digest_size=16).hexdigest()


class ChunkSums:
    """What a save records of every chunk it writes: its crc32c, and its content hash for incremental saves.

    Kept by array index and flat chunk index (C order of the grid). In a distributed save
    each rank records the chunks it writes and sends :meth:`payload` to rank 0, which
    :meth:`merge` s them; both kinds travel in that one message.
    """

    def __init__(self, metas: Sequence[ArrayMeta]) -> None:
        self.metas = metas
        self._grids: dict[int, tuple[int, ...]] = {}  # array -> its chunk grid, made when first asked for
        self.crcs: dict[int, tuple[list[int], list[int]]] = {}  # array -> (flat indices, crc32c values)
        self.single: dict[int, int] = {}  # array -> the crc32c of its only chunk (add_single)
        self.hashes: dict[int, dict[int, str]] = {}
        self._received: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
        self._lock = threading.Lock()

    def grid(self, i: int) -> tuple[int, ...]:
        """Array ``i``'s chunk grid (chunks per dimension)."""
        got = self._grids.get(i)
        if got is None:
            m = self.metas[i]
            got = self._grids[i] = tuple(-(-n // c) for n, c in zip(m.shape, m.chunk_shape, strict=True))
        return got

    def flat(self, i: int, index: Sequence[int]) -> int:
        flat = 0
        for k, g in zip(index, self.grid(i), strict=True):
            flat = flat * g + k
        return flat

    def add_crc(self, i: int, index: Sequence[int], crc: int) -> None:
        flat = self.flat(i, index)
        with self._lock:
            flats, values = self.crcs.setdefault(i, ([], []))
            flats.append(flat)
            values.append(crc)

    def add_single(self, i: int, crc: int) -> None:
        """Record the crc32c of array ``i``'s only chunk (most small arrays: kept apart, one entry each)."""
        self.single[i] = crc  # (one store: atomic under the GIL, and never of an array add_crc records)

    def crc32c_all(self) -> list[bytes]:
        """:meth:`crc32c` of every array, in order; those of one chunk encoded together (a call per
        array was a fifth of a 100,000-leaf save's commit)."""
        values = self.single_crc32c()
        if values is None:
            return [self.crc32c(i) for i in range(len(self.metas))]
        return [values[k : k + 4] for k in range(0, len(values), 4)]

    def single_crc32c(self) -> bytes | None:
        """Every array's :meth:`crc32c` joined in order, when each array is one chunk recorded by
        :meth:`add_single` (4 bytes an array); else None."""
        n = len(self.metas)
        single = self.single
        if self._received or len(single) != n:
            return None
        values = np.empty(n, dtype="<u4")  # (n distinct indices below n: each array's once)
        values[np.fromiter(single, dtype=np.intp, count=n)] = np.fromiter(single.values(), dtype="<u4", count=n)
        return values.tobytes()

    def recorder(self, i: int) -> Callable[[tuple[int, ...], int], None]:
        """``record(index, crc32c)`` for the chunks of array ``i``."""

        def record(index: tuple[int, ...], crc: int) -> None:
            self.add_crc(i, index, crc)

        return record

    def add_region(self, i: int, meta: ArrayMeta, region: Region, data: np.ndarray) -> None:
        """Record the crc32c of every chunk of ``region`` (whole chunks; ``data`` its elements)."""
        chunk, shape, offset = meta.chunk_shape, meta.shape, region.offset
        grid = ChunkGrid(shape, chunk)
        if not grid.is_whole(region):
            raise CheckpointError(
                f"leaf {meta.key!r}: {region} is not whole chunks of {list(chunk)} (a planning error)"
            )
        for index in grid.touching(region):
            box = tuple(
                slice(k * c - o, min(k * c + c, n) - o) for k, c, o, n in zip(index, chunk, offset, shape, strict=True)
            )
            self.add_crc(i, index, chunk_crc(data[box], chunk, meta.dtype.numpy))

    def add_hash(self, i: int, flat: int, digest: str) -> None:
        with self._lock:
            self.hashes.setdefault(i, {})[flat] = digest

    def payload(self) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[int, dict[int, str]]]:
        """This rank's records, compact (numpy arrays of indices and checksums), for rank 0."""
        with self._lock:
            crcs = {
                i: (
                    np.asarray(f, dtype=np.uint32 if math.prod(self.grid(i)) <= 1 << 32 else np.int64),
                    np.asarray(v, dtype=np.uint32),
                )
                for i, (f, v) in self.crcs.items()
            }
            for i, crc in self.single.items():
                crcs[i] = (np.zeros(1, dtype=np.uint32), np.asarray([crc], dtype=np.uint32))
            return crcs, {i: dict(h) for i, h in self.hashes.items()}

    def merge(self, payload: tuple[dict[int, tuple[np.ndarray, np.ndarray]], dict[int, dict[int, str]]]) -> None:
        """Add another rank's :meth:`payload`."""
        crcs, hashes = payload
        with self._lock:
            self._received.append(crcs)
            for i, got in hashes.items():
                self.hashes.setdefault(i, {}).update(got)

    def crc32c(self, i: int) -> bytes:
        """Every chunk's crc32c of array ``i``: little-endian uint32 in C order of the grid (the metadata's field)."""
        if i in self.single and not self._received:  # most small arrays: one chunk, by add_single
            return self.single[i].to_bytes(4, "little")
        flats, values = self.crcs.get(i, ([], []))
        m = self.metas[i]
        if flats == [0] and i not in self.single and not self._received and m.chunk_shape == m.shape:
            return values[0].to_bytes(4, "little")  # (one chunk written by the staged path)
        if i in self.single:
            flats, values = [*flats, 0], [*values, self.single[i]]
        n = math.prod(self.grid(i))
        out = np.zeros(n, dtype="<u4")
        seen = np.zeros(n, dtype=bool)
        parts = [(np.asarray(flats, dtype=np.int64), np.asarray(values, dtype=np.uint32))]
        parts += [r[i] for r in self._received if i in r]
        for where, got in parts:
            out[where] = got
            seen[where] = True
        if not seen.all():
            missing = int(np.flatnonzero(~seen)[0])
            raise CheckpointError(
                f"leaf {self.metas[i].key!r}: no checksum was recorded for chunk {missing} (flat index) of "
                f"{n}: a chunk was not written (an internal error)"
            )
        return out.tobytes()

    def chunk_hashes(self, i: int) -> tuple[str, ...]:
        """Every chunk's content hash of array ``i`` in C order, or () where some chunk has none."""
        got = self.hashes.get(i, {})
        n = math.prod(self.grid(i))
        return tuple(got[k] for k in range(n)) if len(got) == n else ()
