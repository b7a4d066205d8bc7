"""Stored arrays: opening them (TensorStore specs), and reading and writing their chunks.

Local uncompressed arrays are read and written chunk file by chunk file here (see
:mod:`pytreeckpt.storage._chunkfiles`), packed arrays' chunks as keys of their database (see
:mod:`pytreeckpt.storage._packed_io`); the rest through TensorStore. Every chunk read goes
through :meth:`ArrayIO._chunk`, which checks it."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError, PermissionDeniedError
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.format import (
    ARCHIVE_DIR,
    PACKED_DIR,
    ArrayMeta,
    zarr_metadata,
)
from pytreeckpt.storage._chunkfiles import DIRECT_MIN_BYTES, LITTLE_ENDIAN, cold_files, read_small, write_chunk
from pytreeckpt.storage._deadline import cancel
from pytreeckpt.storage._integrity import (
    _INLINE_CHECK_BYTES,
    _Landing,
    _read_file_chunk,
    _settle_stored_chunk,
)
from pytreeckpt.storage._io import OCDBT_INLINE_BYTES, _all_of, _chunk_key, io_pool
from pytreeckpt.storage._location import OCDBT_CACHE
from pytreeckpt.storage._packed import (
    MAX_ZARR_JSON_BYTES,
    check_zarr_json,
    describe_database,
    handles,
    in_archives,
)
from pytreeckpt.storage._packed_io import PackedIO, PackedRead

logger = logging.getLogger("pytreeckpt")


class _Ready:
    """What :meth:`ArrayIO.open_arrays` gives for an array it had nothing to open for: ``value``, at once."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self, timeout: float | None = None) -> Any:
        return self.value


_COLD_SAMPLE = 64  # chunk files ArrayIO.cold looks at, the largest arrays' first


class ArrayIO(PackedIO):
    """Opens stored arrays and moves their chunks, every chunk read checked; makes what was written durable."""

    def note_chunks(self, meta: ArrayMeta, region: Region) -> None:
        """Remember the chunks a write of ``region`` (whole chunks) creates, to make them durable in :meth:`sync`."""
        self.place.note_chunks(meta, region)

    def sync(self) -> None:
        """Make every write since the last call durable: packed arrays' keys still in an OCDBT transaction are
        committed, then (locally) every file written and the directories holding them are fsynced, in parallel."""
        if self._packed is not None:
            self._packed.commit()
        self.place.sync()

    def link_chunk(self, base: Path, base_path: str, path: str, index: tuple[int, ...]) -> bool:
        """Hard-link chunk ``index`` of the base checkpoint's array into this one; False where links fail
        (only local directories have links; packed arrays live in a database, not in files)."""
        return self.place.link_chunk(base, base_path, path, index)

    def packed_prefix(self) -> str:
        """Where a save here packs small arrays: ``packed`` (zip archives: ``StorageOptions.pack_format="zip"``,
        a local directory, a little-endian host) or ``ocdbt`` (OCDBT databases)."""
        zipped = self.location.options.pack_format == "zip" and self.place.has_files and LITTLE_ENDIAN
        return ARCHIVE_DIR if zipped else PACKED_DIR

    # ------------------------------------------------------------------ arrays
    def _spec(self, meta: ArrayMeta, create: bool) -> dict[str, Any]:
        if meta.database is not None and in_archives(meta.database):
            raise CheckpointError(
                f"leaf {meta.key!r}: {meta.path!r} in {describe_database(meta.database)} is read and written by "
                f"this library's archive code, not opened through TensorStore (a compressed array is never packed "
                f"there)"
            )
        if meta.database is None:
            kvstore = self.location.kvstore(meta.path + "/")
        else:  # packed: the array's keys inside its writer's OCDBT database
            kvstore = {
                "driver": "ocdbt",
                "base": self.location.kvstore(meta.database + "/"),
                "path": meta.path + "/",
                "cache_pool": OCDBT_CACHE,  # its b-tree nodes are read once, not once per array
            }
            if create:  # small values live inside the b-tree nodes: one read serves many arrays
                kvstore["config"] = {"max_inline_value_bytes": OCDBT_INLINE_BYTES}
        spec: dict[str, Any] = {
            "driver": "zarr3",
            "kvstore": kvstore,
            "metadata": zarr_metadata(meta.dtype, meta.shape, meta.chunk_shape, meta.compression),
            # Every chunk is stored, even one equal to the fill value (so -0.0 and NaN
            # payloads survive and a missing chunk is an error), and a missing chunk
            # fails a read instead of reading as zeros.
            "store_data_equal_to_fill_value": True,
            "fill_missing_data_reads": False,
        }
        return spec

    def open_arrays(self, metas: Sequence[ArrayMeta], create: bool, check_only: bool = False) -> list[Any]:
        """Open (or create) the stored arrays, each checked first: what reads each (TensorStore's array, a packed
        array's database reader, None where this package reads its chunk files). ``check_only``: for
        :meth:`verify`, which reads the chunk files of every local uncompressed array itself (:meth:`_reads_files`).
        """

        def failed(meta: ArrayMeta, e: Exception) -> CheckpointError:
            where = repr(meta.path)
            if meta.database is not None:
                where += f" in {describe_database(meta.database)}"
            verb = "create" if create else "open"
            return CheckpointError(f"leaf {meta.key!r}: cannot {verb} stored array {where}: {e}")

        futures: list[Any] = []

        def settle() -> list[Any]:
            # Every open is waited for, so that none still makes files once this has raised.
            stores, first = [], None
            for meta, f in zip(metas, futures, strict=False):
                try:
                    stores.append(self.waits.wait(f, f"opening the stored array {meta.path!r} of leaf {meta.key!r}"))
                except CheckpointTimeoutError:
                    for other in futures:
                        cancel(other)
                    raise
                except Exception as e:
                    first = first or (meta, e)
            if first is not None:
                raise failed(*first) from first[1]
            return stores

        checked: set[str] = set()
        for meta in metas:
            if not create:
                where = meta.path if meta.database is None else meta.database
                if where not in checked:  # a database holding many packed arrays is checked once
                    self.place.check_inside(where, meta.key)
                    checked.add(where)
            if handles(meta):  # nothing to open: its keys are written and read through its database
                assert meta.database is not None
                try:
                    if create:
                        self.packed.begin(meta)
                        futures.append(_Ready(None))
                    else:
                        futures.append(_Ready(self.packed.reader(meta.database)))
                except Exception as e:
                    with contextlib.suppress(CheckpointError):
                        settle()
                    raise failed(meta, e) from e
                continue
            if not create and self._reads_files(meta, check_only):
                # Its chunk files are read (read_chunk) and written (write_chunk) by the executor, not by TensorStore:
                # nothing to open. Its zarr.json, which TensorStore and zarr read, must describe the array as the
                # document does (checked in line: on the I/O pool, 2,000 cold arrays took 1.83 s against 1.62 s).
                zarr = self.root / meta.path / "zarr.json"
                what = f"leaf {meta.key!r}"
                try:
                    assert self.files is not None
                    check_zarr_json(meta, read_small(zarr, self.files.real_root(), what, MAX_ZARR_JSON_BYTES))
                except CheckpointError:
                    with contextlib.suppress(CheckpointError):
                        settle()
                    raise
                futures.append(_Ready(None))
                continue
            import tensorstore as ts  # (here: what reads chunk files and zip archives needs none)

            spec = self._spec(meta, create)
            try:  # a spec TensorStore rejects (e.g. sizes past its limits) fails here, not in the future
                if create:
                    futures.append(ts.open(spec, context=self.context, create=True))
                else:
                    futures.append(ts.open(spec, context=self.context, open=True))
            except Exception as e:
                with contextlib.suppress(CheckpointError):
                    settle()
                raise failed(meta, e) from e
        stores = settle()
        if create:
            for meta in metas:
                self.place.note_array(meta)
        return stores

    def handles_packed(self, meta: ArrayMeta) -> bool:
        """Whether this array's chunks are keys of its database, written and read by this package itself
        (packed, uncompressed, not empty, on a little-endian host)."""
        return handles(meta)

    def handles_files(self, meta: ArrayMeta, data: np.ndarray) -> bool:
        """Whether the executor reads or writes this array's chunk files itself, with ``data`` as the memory.

        It does for non-empty, uncompressed arrays of their own (not packed) in a local
        directory on a little-endian host, where the memory has the stored element type;
        TensorStore does the rest. A write must cover whole chunks (every planned write does).
        """
        return (self._reads_files(meta) or handles(meta)) and data.dtype == meta.dtype.numpy

    def cold(self, metas: Sequence[ArrayMeta]) -> bool:
        """Whether a load of these arrays will read most of their bytes around the page cache, into new memory
        (``ExecutorOptions.direct_io``; chunk files of a MiB or more that the cache holds less than half of, judged
        on up to :data:`_COLD_SAMPLE` of them): new memory is then best faulted in 4 KiB pages, by the reads
        themselves (the kernel maps a direct read's pages in bulk; huge pages cost more: a cold 4 GiB load took
        3.6 s into huge pages, 2.7 s into small ones, as into memory already mapped)."""
        if not self.options.direct_io:
            return False
        big = [m for m in metas if self._reads_files(m) and m.nbytes >= DIRECT_MIN_BYTES]
        if sum(m.nbytes for m in big) * 2 < sum(m.nbytes for m in metas):
            return False
        paths: list[Path] = []
        for meta in sorted(big, key=lambda m: -m.nbytes):
            grid = ChunkGrid(meta.shape, meta.chunk_shape)
            for index in itertools.islice(grid.touching(Region.full(meta.shape)), _COLD_SAMPLE - len(paths)):
                paths.append(self.root / meta.path / _chunk_key(index))
            if len(paths) >= _COLD_SAMPLE:
                break
        return cold_files(paths)

    def _reads_files(self, meta: ArrayMeta, check_only: bool = False) -> bool:
        """Whether this array's chunks are read as files by the executor (:func:`read_chunk`), not by TensorStore.

        A load's are, of arrays with elements and dimensions; a check's (``check_only``: :meth:`verify`, the bytes
        and checksums of each chunk, not its values) of 0-d and empty arrays too, so that verifying a local
        checkpoint of uncompressed arrays imports no TensorStore.
        """
        local_plain = self.place.has_files and LITTLE_ENDIAN and meta.compression is None and meta.database is None
        return local_plain and (check_only or (meta.nbytes > 0 and len(meta.shape) > 0))

    def write_chunk_files(
        self, meta: ArrayMeta, region: Region, data: np.ndarray, record: Callable[[tuple[int, ...], int], None] | None
    ) -> Future[Any]:
        """Write ``region`` (whole chunks) chunk file by chunk file; each file is fsynced as it is written.

        ``record(index, crc32c)`` is called with each chunk's checksum as it is written.
        """
        if handles(meta):
            return self.write_packed(meta, region, data, record)
        chunk = meta.chunk_shape
        grid = ChunkGrid(meta.shape, chunk)
        if not grid.is_whole(region):
            raise CheckpointError(
                f"leaf {meta.key!r}: {region} is not whole chunks of {list(chunk)} (a planning error)"
            )
        files = self.files
        assert files is not None, "chunk files are written in local directories only"
        array = self.root / meta.path
        futures = []
        for index in grid.touching(region):
            path = array / _chunk_key(index)
            files.chunk_dir(path.parent)
            box = grid.region(index).relative_to(region).slices()
            futures.append(
                io_pool().submit(
                    self.options.file_io_concurrency,
                    _write_recorded,
                    path,
                    data[box],
                    chunk,
                    index,
                    record,
                    self.options.direct_io,
                )
            )
        return _all_of(futures)

    def read_chunks(
        self, meta: ArrayMeta, store: Any, wants: Sequence[tuple[Region, np.ndarray]]
    ) -> list[Callable[[], Future[Any]]]:
        """Read each ``(region, dest)`` of one array chunk by chunk, checking every chunk (see :meth:`_chunk`).

        A chunk several regions want is read once for all of them. Returns one function
        per region that starts the reads of its chunks (those not started yet) and returns
        a future of them all: the caller starts each region when its window has room, so
        the scratch memory of chunks only partly wanted stays bounded.
        """
        chunk = meta.chunk_shape
        grid = ChunkGrid(meta.shape, chunk)
        targets: dict[tuple[int, ...], list[tuple[tuple[slice, ...], np.ndarray]]] = {}
        needs: list[list[tuple[int, ...]]] = []
        alone: dict[tuple[int, ...], bool] = {}  # every region wanting the chunk wants nothing else
        for region, dest in wants:
            needs.append([])
            first = tuple(o // c for o, c in zip(region.offset, chunk, strict=True))
            last = tuple((o + n - 1) // c for o, n, c in zip(region.offset, region.shape, chunk, strict=True))
            if first == last:  # within one chunk (every planned read is): no Region arithmetic
                box = tuple(
                    slice(o - k * c, o - k * c + n)
                    for o, n, k, c in zip(region.offset, region.shape, first, chunk, strict=True)
                )
                targets.setdefault(first, []).append((box, dest))
                needs[-1].append(first)
                alone[first] = alone.get(first, True)
                continue
            for index in grid.touching(region):
                whole = grid.region(index)
                part = whole.intersect(region)
                assert part is not None
                box = part.relative_to(whole).slices()
                targets.setdefault(index, []).append((box, dest[part.relative_to(region).slices()]))
                needs[-1].append(index)
                alone[index] = False
        futures: dict[tuple[int, ...], Any] = {}

        def starter(indices: list[tuple[int, ...]]) -> Callable[[], Future[Any]]:
            def start() -> Future[Any]:
                for index in indices:
                    if index not in futures:
                        futures[index] = self._chunk(meta, store, index, targets[index], lazy=alone[index])
                if len(indices) == 1:
                    return futures[indices[0]]  # type: ignore[no-any-return]
                return _all_of([futures[index] for index in indices])

            return start

        return [starter(indices) for indices in needs]

    def _chunk(
        self,
        meta: ArrayMeta,
        store: Any,
        index: tuple[int, ...],
        targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
        lazy: bool = True,
    ) -> Any:
        """Read chunk ``index`` once, check it, and fill ``targets`` (none: only check it); returns a future.

        Every read of a chunk, by :meth:`read` and by :meth:`verify` alike, comes here. The
        chunk must be the one the metadata records (its crc32c, see ``chunk_crc``), where
        it records one: local uncompressed chunk files are read by :func:`read_chunk`,
        which also checks the file's kind, place, size and own checksum; others are read
        whole by TensorStore (which checks their codecs' checksum), and their crc32c is
        computed once they have landed: for a small chunk, with ``lazy``, by the thread that
        waits for its result (a :class:`_Landing`, which only has ``result()``: handing each
        of 10,000 small packed arrays to another thread cost more than the check), else on
        an I/O thread.
        """
        what = f"chunk {list(index)}"
        expected = meta.recorded_crc32c(index)
        workers = self.options.file_io_concurrency
        whole = ChunkGrid(meta.shape, meta.chunk_shape).region(index)
        if handles(meta):
            return PackedRead(store, meta, index, targets, what, expected, lazy, workers)
        if self._reads_files(meta, check_only=not targets):  # (no targets: verify's check of the chunk)
            files = self.files
            assert files is not None
            path = self.root / meta.path / _chunk_key(index)
            return io_pool().submit(
                workers,
                _read_file_chunk,
                path,
                meta,
                whole.shape,
                targets,
                what,
                expected,
                files.real_root(),
                self.options.direct_io,
            )
        # One target wanting the whole chunk gets it straight in its memory; otherwise the
        # chunk lands in scratch memory and the targets' boxes are copied from there.
        straight = len(targets) == 1 and targets[0][1].shape == whole.shape and targets[0][1].dtype == meta.dtype.numpy
        out: Future[Any] = Future()
        import tensorstore as ts

        try:
            if straight:
                landing = ts.array(targets[0][1]).write(store[whole.slices()])
            else:
                landing = store[whole.slices()].read()
        except Exception as e:
            out.set_exception(CheckpointError(f"{what}: {e}"))
            return out

        if lazy and whole.size * meta.dtype.itemsize <= _INLINE_CHECK_BYTES:
            return _Landing(landing, meta, targets, straight, what, expected)

        def landed(f: Any) -> None:  # on a TensorStore thread: the checks go to an I/O thread
            io_pool().submit(workers, _settle_stored_chunk, f, out, meta, targets, straight, what, expected)

        landing.add_done_callback(landed)
        out.add_done_callback(lambda f: cancel(landing) if f.cancelled() else None)  # (a wait that timed out)
        return out

    def verify(self, metas: Sequence[ArrayMeta]) -> tuple[list[Problem], list[Problem], int, int]:
        """Read every chunk of every array and check it as a load does.

        Returns ``(problems, unreadable, chunks read, bytes read)``. A problem is ``(key,
        chunk index or None for the whole array, message)``: damage in ``problems``, a file
        or directory this process may not read (permission denied, not damage) in
        ``unreadable``. Each
        chunk goes through the very checks of :meth:`read` (its own checksum, its size, the
        checksum the metadata records for it, the files' kinds and places), so a load
        fails exactly where this finds a problem. Memory stays bounded: chunks are read
        a window at a time into scratch buffers.
        """
        problems: list[tuple[int, str, tuple[int, ...] | None, str]] = []  # (array, key, chunk, message)
        unreadable: list[tuple[int, str, tuple[int, ...] | None, str]] = []
        chunks = nbytes = 0

        def found(at: int, key: str, idx: tuple[int, ...] | None, e: BaseException) -> None:
            (unreadable if _denied(e) else problems).append((at, key, idx, str(e)))

        pending: collections.deque[tuple[int, str, tuple[int, ...], Future[Any], int]] = collections.deque()
        inflight = 0

        def settle() -> int:
            at, key, idx, future, size = pending.popleft()
            try:
                future.result()
            except Exception as e:
                found(at, key, idx, e)
            return size

        for at, meta in enumerate(metas):
            try:
                self.check_stored_sizes([meta])
                self.check_files([meta])
                (store,) = self.open_arrays([meta], create=False, check_only=True)
            except CheckpointError as e:
                found(at, meta.key, None, e)
                continue
            grid = ChunkGrid(meta.shape, meta.chunk_shape)
            for idx in grid.touching(Region.full(meta.shape)):
                size = grid.region(idx).size * meta.dtype.itemsize
                pending.append((at, meta.key, idx, self._chunk(meta, store, idx, []), size))
                inflight += size
                chunks += 1
                nbytes += size
                while pending and inflight > self.options.max_inflight_bytes:
                    inflight -= settle()
        while pending:
            settle()
        problems.sort(key=lambda p: p[0])  # in the order of the arrays (stable: chunks in grid order)
        unreadable.sort(key=lambda p: p[0])
        return [p[1:] for p in problems], [p[1:] for p in unreadable], chunks, nbytes


Problem = tuple[str, tuple[int, ...] | None, str]  # (key, chunk index or None for the whole array, message)


def _denied(e: BaseException | None) -> bool:
    """Whether error ``e``, or one it was raised from, is a permission refusal rather than damage."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, (PermissionDeniedError, PermissionError)):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def _write_recorded(
    path: Path,
    data: np.ndarray,
    chunk: tuple[int, ...],
    index: tuple[int, ...],
    record: Callable[[tuple[int, ...], int], None] | None,
    direct: bool,
) -> None:
    crc = write_chunk(path, data, chunk, True, direct)
    if record is not None:
        record(index, crc)
