"""The executor: the only code that touches storage.

It runs the writes of a :class:`~pytreeckpt._plan.SavePlan` and the reads of a
:class:`~pytreeckpt._plan.LoadPlan` as TensorStore futures with a bound on the bytes in
flight, and commits a checkpoint by writing its metadata document atomically.

Data comes and goes through callbacks that map ``(rank, piece)`` to numpy views of
rank-local memory, so the same executor serves one process holding every rank and
(with transfers done by the distributed adapter) one rank among many.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from ._chunkio import LITTLE_ENDIAN, IOPool, chunk_crc, open_regular, read_chunk, write_chunk
from ._errors import CheckpointError, MetadataError, NotCommittedError
from ._format import (
    ARRAYS_DIR,
    LOCK_FILE,
    METADATA_FILE,
    PACKED_DIR,
    STEP_DIR,
    ArrayMeta,
    chunk_count,
    generation_of,
    zarr_metadata,
)
from ._location import OBJECT_STORE_CHUNKING, OCDBT_CACHE, KvPrefix, Where, make_context, resolve
from ._region import Region, chunk_region
from .plan import ArrayLoadPlan, ArraySavePlan, ChunkingOptions, ReadOp, WriteOp

__all__ = [
    "ChunkSums",
    "ExecutorOptions",
    "PieceData",
    "Storage",
    "WriteItem",
    "assemble",
    "available_memory",
    "remove_tree",
    "write_items",
]

logger = logging.getLogger("pytreeckpt")

PieceData = Callable[[int, int], tuple[np.ndarray, Region]]
"""``(rank, piece) -> (view, region)``: a numpy view of the local memory holding that
piece, and the global region it covers."""

WriteItem = tuple[int, Region, np.ndarray, Callable[[], None] | None]
"""``(array index, region, data, done)``: one write; ``done`` runs when it has finished."""

MiB = 1 << 20
OCDBT_INLINE_BYTES = 64 * 1024

LOCK_WAIT = 1.0
"""Seconds a save waits for a checkpoint's lock held by another process before refusing."""

MAX_COMPRESSION_RATIO = 1 << 16
"""The most a compressed array's metadata may claim over its stored bytes (all-zero
chunks compress about 13,000 times with zstd)."""

MISSING_CHUNKS = 4096
"""How many more chunks than are present an array's grid may have before it is refused
whole (fewer are reported chunk by chunk as they are read): loops over a grid stay
bounded by the chunks actually stored."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecutorOptions:
    """Concurrency of the executor.

    Attributes:
      max_inflight_bytes: bytes of writes or reads issued and not yet finished.
      file_io_concurrency: TensorStore's limit on concurrent file operations.
      data_copy_concurrency: TensorStore's limit on threads encoding and decoding chunks.
      staging_bytes: the bound on the staging memory of an asynchronous save. None: as
        much as the state this rank writes, so the caller waits only for the copy; a
        smaller pool is reused ping-pong, the caller then also waiting for the writes
        that make room. Never less than one piece.
      staging_piece_bytes: the largest piece copied and written as one (whole chunks).
      keep_staging: keep the staging memory for the next asynchronous save (a copy
        into memory already mapped is several times faster); False frees it after each
        save. It is always freed after a failed save.
      progress: draw a progress bar on stderr for saves and loads.
      exit_timeout: seconds an asynchronous save still running when the program's
        main thread ends is waited for; past them it is cancelled and commits nothing
        (a warning on the ``pytreeckpt`` logger says so). None waits however long it
        takes.
    """

    max_inflight_bytes: int = 512 * MiB
    file_io_concurrency: int = 16
    data_copy_concurrency: int = 4
    staging_bytes: int | None = None
    staging_piece_bytes: int = 64 * MiB
    keep_staging: bool = True
    progress: bool = False
    exit_timeout: float | None = 600.0


class _Window:
    """Futures in flight, waited on oldest first once their bytes exceed a bound."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queue: collections.deque[tuple[Any, int, Callable[[], None] | None, str]] = collections.deque()
        self.bytes = 0

    def add(self, future: Any, nbytes: int, what: str, then: Callable[[], None] | None = None) -> None:
        self.queue.append((future, nbytes, then, what))
        self.bytes += nbytes
        while self.queue and self.bytes > self.limit:
            self.pop()

    def pop(self) -> None:
        future, nbytes, then, what = self.queue.popleft()
        self.bytes -= nbytes
        try:
            future.result()
        except Exception as e:
            self.drain_quietly()
            raise CheckpointError(f"{what}: {e}") from e
        if then is not None:
            then()

    def drain(self) -> None:
        while self.queue:
            self.pop()

    def drain_quietly(self) -> None:
        while self.queue:
            future = self.queue.popleft()[0]
            with contextlib.suppress(Exception):  # the first error is the one reported
                future.result()
        self.bytes = 0


class Storage:
    """A checkpoint location: a directory on a local file system, or a prefix of a key-value store.

    On a local file system the commit is an atomic rename and writers hold an ``flock``.
    On a key-value store (``memory://``, ``s3://``, ``gs://``) there is no rename: the
    commit is the metadata document, the last object written, put whole in one request.
    There is no lock there either: one writer per prefix is the caller's responsibility.
    """

    def __init__(self, path: Where, options: ExecutorOptions | None = None) -> None:
        self.location = resolve(path)
        self.url = self.location.url
        self.options = options or ExecutorOptions()
        self.context = make_context(self.location, self.options.file_io_concurrency, self.options.data_copy_concurrency)
        self.kv = None if self.location.is_local else KvPrefix(self.location, self.context)
        # Local files TensorStore wrote without fsync (``file_io_sync`` is off), and
        # directories whose every file is (OCDBT databases): made durable by :meth:`sync`.
        self._unsynced: set[Path] = set()
        self._unsynced_trees: set[str] = set()  # relative to the root
        self._made_dirs: set[Path] = set()
        # The commit protocol's state for one save: what the committed document referenced
        # when the save began (None: unreadable, so all is kept), and what the save made.
        self._kept: frozenset[str] | None = None
        self._prepared = False
        self._made_root = False
        self._scanned: dict[str, tuple[int, int]] = {}  # place -> (bytes, chunk files): see scan()
        self._root_real: str | None = None

    @property
    def root(self) -> Path:
        """The directory of a local checkpoint."""
        assert self.location.path is not None, "a key-value store location has no directory"
        return self.location.path

    @property
    def chunking(self) -> ChunkingOptions:
        """How arrays are chunked here when the caller says nothing."""
        if self.location.options.chunking is not None:
            return self.location.options.chunking
        return ChunkingOptions() if self.kv is None else OBJECT_STORE_CHUNKING

    # ------------------------------------------------------------------ commit protocol
    @property
    def metadata_path(self) -> Path:
        return self.root / METADATA_FILE

    def is_committed(self) -> bool:
        if self.kv is not None:
            return self.kv.read(METADATA_FILE) is not None
        return self.metadata_path.is_file()

    def lock(self) -> _Lock:
        """Take the directory's writer lock, or raise: one save at a time per checkpoint path.

        The lock is an ``flock`` on a file inside the directory, so the kernel releases it
        when its holder dies: a crashed save never blocks the next one. A lock held for a
        moment only (a CheckpointManager removing the directory) is waited for, up to
        ``LOCK_WAIT`` seconds; a lock file whose directory its holder removed is no lock,
        and the directory is made again. A key-value store has no such lock: there the lock
        is a no-op and one writer per prefix is the caller's responsibility.
        """
        if self.kv is not None:
            return _Lock(None)
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            self._make_root()
            held = self.try_lock()
            if held is not None:
                return held
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"another process is saving to {self.root} right now; two saves to one path cannot run at once"
                )
            time.sleep(0.01)

    def try_lock(self) -> _Lock | None:
        """The writer lock if it is free now; None if a writer holds it or the directory is gone.

        It never makes the directory: it is how a directory is locked to be removed.
        """
        if self.kv is not None:
            return _Lock(None)
        path = self.root / LOCK_FILE
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o666)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise CheckpointError(f"cannot write a checkpoint at {self.root}: {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        # The holder before us may have removed the lock file with its directory; this lock
        # then guards nothing (a new directory with a new lock file may exist by now).
        try:
            here, mine = os.stat(path), os.fstat(fd)
            same = (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)
        except OSError:
            same = False
        if not same:
            os.close(fd)
            return None
        return _Lock(fd)

    def _make_root(self) -> None:
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(self.root)  # 0o777 less the umask, as any directory the user makes
        except FileExistsError:
            if not self.root.is_dir():
                raise CheckpointError(f"{self.root} exists and is not a directory") from None
            return
        except OSError as e:
            raise CheckpointError(f"cannot write a checkpoint at {self.root}: {e}") from e
        self._made_root = True

    def check_writable(self, overwrite: bool) -> None:
        """Raise now, before any work, if a save here would be refused."""
        if self.kv is not None:
            self.kv.check_reachable()
            keys = self.kv.list()
            if METADATA_FILE in keys and not overwrite:
                raise CheckpointError(
                    f"{self.url} already holds a committed checkpoint; pass overwrite=True to replace it"
                )
            unknown = [k for k in keys if k != METADATA_FILE and k.split("/")[0] not in (ARRAYS_DIR, PACKED_DIR)]
            if unknown:
                raise CheckpointError(
                    f"{self.url} is not empty and is not a pytreeckpt checkpoint (it holds {unknown[:5]}); "
                    f"refusing to write into it"
                )
            return
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"{self.root} exists and is not a directory")
        if self.is_committed() and not overwrite:
            raise CheckpointError(
                f"{self.root} already holds a committed checkpoint; pass overwrite=True to replace it"
            )
        if self.root.is_dir():
            known = {ARRAYS_DIR, PACKED_DIR, METADATA_FILE, LOCK_FILE}
            unknown = [p.name for p in self.root.iterdir() if p.name not in known and not p.name.startswith(".tmp-")]
            if unknown:
                raise CheckpointError(
                    f"{self.root} is not empty and is not a pytreeckpt checkpoint (it holds {sorted(unknown)[:5]}); "
                    f"refusing to write into it"
                )

    def prepare(self, overwrite: bool) -> int:
        """Make the location ready for a new checkpoint; returns the generation its arrays are named with.

        A committed checkpoint is left whole and loadable: the new one is written beside
        it, under names its metadata does not use (:func:`generation_name`), and replaces
        it at the commit. What the committed metadata does not reference, the leftovers of
        a save that failed or was killed, is removed first. Locally the caller holds the lock.
        """
        self.check_writable(overwrite)
        self._kept = self._committed_names()
        self._prepared = True
        try:
            stored = self._stored_names()
            if self._kept is not None:
                self._delete(stored - self._kept)
                stored &= self._kept
            if self.kv is None:
                self._remove_temporaries()
                (self.root / ARRAYS_DIR).mkdir(exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot prepare {self.url} for a new checkpoint: {e}") from e
        return 1 + max(generation_of(name) for name in stored) if stored else 0

    def commit(self, document: bytes) -> None:
        """Write the metadata document atomically, then delete the arrays it does not reference.

        Locally: a temporary file (made with the mode the umask gives, as any file the user
        makes), fsync, rename over the old document, fsync of the directory. On a
        key-value store: one PUT of the whole document, after every array write has
        finished. A checkpoint this one replaces stays whole and loadable until that
        instant; then its arrays are deleted (a failure to delete them is logged, and the
        next save reclaims them).
        """
        if self.kv is not None:
            self.kv.write(METADATA_FILE, document)
        else:
            try:
                tmp = self.root / f".tmp-{os.getpid()}-{secrets.token_hex(8)}"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(document)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, self.metadata_path)
                except BaseException:
                    tmp.unlink(missing_ok=True)
                    raise
                _fsync(self.root)
            except OSError as e:
                raise CheckpointError(f"cannot commit the checkpoint at {self.root}: {e}") from e
        try:
            self._delete(self._unreferenced(_referenced(document)))
        except Exception as e:  # committed all the same: the next save reclaims them
            logger.warning("%s: committed, but the arrays it replaced could not all be deleted: %s", self.url, e)

    def abandon(self) -> None:
        """After a failed save: remove what it wrote, keeping all that a committed document references.

        The checkpoint the save was to replace stays whole (and so does the new one, if
        the failure came after its document was renamed into place). A directory the save
        made is removed. Errors here are logged: the save's own failure is what is reported.
        """
        if not (self._prepared or self._made_root):
            return
        try:
            now = self._committed_names()
            keep = None if self._kept is None or now is None else self._kept | now
            self._delete(self._unreferenced(keep))
            if self.kv is None:
                self._remove_temporaries()
                if not self.is_committed():  # the directory is left as the save found it, or removed if it made it
                    for top in (ARRAYS_DIR, PACKED_DIR):
                        with contextlib.suppress(FileNotFoundError):
                            (self.root / top).rmdir()
                    (self.root / LOCK_FILE).unlink(missing_ok=True)  # a writer waiting on it sees it gone
                    if self._made_root:
                        self.root.rmdir()
        except Exception as e:
            logger.warning("%s: the save failed and what it wrote could not all be removed: %s", self.url, e)

    def remove(self) -> None:
        """Delete the checkpoint: its commit first, so a crash midway leaves no half checkpoint.

        Parts already gone (another process removing it too) are no error.
        """
        if self.kv is not None:
            self.kv.delete(METADATA_FILE)
            self.kv.delete_prefix("")
            return
        self.metadata_path.unlink(missing_ok=True)
        remove_tree(self.root)

    def _committed_names(self) -> frozenset[str] | None:
        """The arrays and databases the committed document uses; empty if none is committed, None if unreadable."""
        if self.kv is not None:
            raw = self.kv.read(METADATA_FILE)
        else:
            try:
                raw = self.metadata_path.read_bytes()
            except (FileNotFoundError, NotADirectoryError):
                raw = None
        return frozenset() if raw is None else _referenced(raw)

    def _stored_names(self) -> set[str]:
        """The arrays and databases present: ``arrays/<name>`` and ``ocdbt/<name>``."""
        out: set[str] = set()
        if self.kv is not None:
            for key in self.kv.list():
                parts = key.split("/")
                if len(parts) > 1 and parts[0] in (ARRAYS_DIR, PACKED_DIR):
                    out.add(f"{parts[0]}/{parts[1]}")
            return out
        for top in (ARRAYS_DIR, PACKED_DIR):
            try:
                out.update(f"{top}/{name}" for name in os.listdir(self.root / top))
            except (FileNotFoundError, NotADirectoryError):
                continue
        return out

    def _unreferenced(self, keep: frozenset[str] | None) -> set[str]:
        """What is stored and not in ``keep``; nothing when ``keep`` is unknown."""
        return set() if keep is None else self._stored_names() - keep

    def _delete(self, names: Iterable[str]) -> None:
        for name in sorted(names):
            if self.kv is not None:
                self.kv.delete_prefix(name + "/")
            else:
                remove_tree(self.root / name)

    def _remove_temporaries(self) -> None:
        """Metadata documents a killed commit left half written (only under the lock)."""
        for p in self.root.iterdir():
            if p.name.startswith(".tmp-"):
                p.unlink(missing_ok=True)

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
        claimed fails its read. Every file is checked as :meth:`scan` says.
        """
        for meta in metas:
            if meta.database is not None:
                self._check_packed_chunks(meta)
                continue
            if self.kv is not None:
                self._check_chunks_listed(meta)
                continue
            stored, files = self.scan(meta.path, meta.key)
            ratio = 1 if meta.compression is None else MAX_COMPRESSION_RATIO
            if stored * ratio < meta.nbytes:
                raise MetadataError(
                    f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} "
                    f"({meta.nbytes} bytes) but {meta.path!r} holds only {stored} bytes of chunks"
                    + ("" if ratio == 1 else f", more than {ratio} times less than that")
                )
            self._check_chunk_count(meta, files, f"{meta.path!r} holds {files} chunk files")

    def _check_chunk_count(self, meta: ArrayMeta, present: int, where: str) -> None:
        expected = chunk_count(meta.shape, meta.chunk_shape)
        if expected > present + MISSING_CHUNKS:
            raise MetadataError(
                f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} in "
                f"{expected} chunks of {list(meta.chunk_shape)} but {where}"
            )

    def _check_packed_chunks(self, meta: ArrayMeta) -> None:
        """A packed array of several chunks: its chunk keys in the database bound its grid."""
        assert meta.database is not None
        if chunk_count(meta.shape, meta.chunk_shape) <= 1:
            return
        if self.kv is None:
            self.scan(meta.database, meta.key)
        prefix = f"{meta.path}/c"
        try:
            db = ts.KvStore.open(
                {"driver": "ocdbt", "base": self.location.kvstore(meta.database + "/"), "cache_pool": OCDBT_CACHE},
                context=self.context,
            ).result()
            keys = db.list(ts.KvStore.KeyRange(prefix + "/", prefix + "0")).result()
        except Exception as e:
            raise CheckpointError(
                f"leaf {meta.key!r}: cannot list the chunks of {meta.path!r} in {meta.database!r}: {e}"
            ) from e
        self._check_chunk_count(meta, len(keys), f"{meta.database!r} holds {len(keys)} of its chunks")

    def stored_bytes(self, meta: ArrayMeta) -> int | None:
        """Bytes of the chunk files of one stored array; None where the store cannot tell (packed, key-value)."""
        if meta.database is not None or self.kv is not None:
            return None
        return self.scan(meta.path, meta.key)[0]

    def check_files(self, metas: Sequence[ArrayMeta]) -> None:
        """Before TensorStore or the executor opens anything of these arrays: every file of each
        (``zarr.json`` and chunks), or of its OCDBT database, is checked by :meth:`scan`."""
        if self.kv is None:
            for meta in metas:
                self.scan(meta.path if meta.database is None else meta.database, meta.key)

    def scan(self, where: str, key: str) -> tuple[int, int]:
        """Check the files of one stored array (or OCDBT database) before anything reads them.

        Returns the bytes and the number of its chunk files (files but ``zarr.json``, whose
        bytes are not counted either).
        Refuses, with a CheckpointError naming the leaf and the path: a symbolic link that
        leads outside the checkpoint (links inside it are followed), anything but regular
        files and directories (a FIFO or a device would block or never end a read), a
        directory that cannot be read (permission denied, said as such) and link loops.
        Each place is walked once per Storage.
        """
        if where in self._scanned:
            return self._scanned[where]
        top = self._check_inside(self.root / where, key)
        total = files = 0
        seen: set[tuple[int, int]] = set()  # directories (device, inode): a link back up is walked once
        with contextlib.suppress(OSError):
            st = os.stat(top)
            seen.add((st.st_dev, st.st_ino))
        todo = [top]
        while todo:
            folder = todo.pop()
            try:
                with os.scandir(folder) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue  # a missing array: its size (0) says so
            except OSError as e:
                raise _os_failure(e, folder, f"leaf {key!r}", "list") from e
            for entry in entries:
                try:
                    if entry.is_symlink():
                        real = self._check_inside(Path(entry.path), key)
                        st = os.stat(real)
                        path = real
                    else:
                        st = entry.stat(follow_symlinks=False)
                        path = Path(entry.path)
                except FileNotFoundError:
                    continue  # gone since it was listed
                except OSError as e:
                    raise _os_failure(e, Path(entry.path), f"leaf {key!r}", "stat") from e
                if stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) not in seen:
                        seen.add((st.st_dev, st.st_ino))
                        todo.append(path)
                elif stat.S_ISREG(st.st_mode):
                    if entry.name != "zarr.json":
                        total += st.st_size
                        files += 1
                else:
                    raise CheckpointError(
                        f"leaf {key!r}: {entry.path} is not a regular file (a FIFO, device or socket); refused"
                    )
        self._scanned[where] = (total, files)
        return total, files

    def _check_chunks_listed(self, meta: ArrayMeta) -> None:
        assert self.kv is not None
        if meta.nbytes == 0:
            return
        prefix = meta.path + "/"
        listed = set(self.kv.list(prefix))
        expected = chunk_count(meta.shape, meta.chunk_shape)
        chunks = sum(1 for k in listed if k.startswith(prefix + "c"))
        if chunks < expected:
            raise MetadataError(
                f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} "
                f"in {expected} chunks but {self.url}/{meta.path} holds only {chunks} chunk objects"
            )

    def verify(self, metas: Sequence[ArrayMeta]) -> tuple[list[tuple[str, tuple[int, ...] | None, str]], int, int]:
        """Read every chunk of every array and check it as a load does; returns ``(problems, chunks read, bytes read)``.

        A problem is ``(key, chunk index or None for the whole array, message)``. Each
        chunk goes through the very checks of :meth:`read` (its own checksum, its size, the
        checksum the metadata records for it, the files' kinds and places), so a load
        fails exactly where this finds a problem. Memory stays bounded: chunks are read
        a window at a time into scratch buffers.
        """
        problems: list[tuple[int, str, tuple[int, ...] | None, str]] = []  # (array, key, chunk, message)
        chunks = nbytes = 0
        pending: collections.deque[tuple[int, str, tuple[int, ...], Future[Any], int]] = collections.deque()
        inflight = 0

        def settle() -> int:
            at, key, idx, future, size = pending.popleft()
            try:
                future.result()
            except Exception as e:
                problems.append((at, key, idx, str(e)))
            return size

        for at, meta in enumerate(metas):
            try:
                self.check_stored_sizes([meta])
                self.check_files([meta])
                (store,) = self.open_arrays([meta], create=False)
            except CheckpointError as e:
                problems.append((at, meta.key, None, str(e)))
                continue
            for idx in Region.full(meta.shape).chunk_indices(meta.chunk_shape):
                size = chunk_region(idx, meta.chunk_shape, meta.shape).size * meta.dtype.itemsize
                pending.append((at, meta.key, idx, self._chunk(meta, store, idx, []), size))
                inflight += size
                chunks += 1
                nbytes += size
                while pending and inflight > self.options.max_inflight_bytes:
                    inflight -= settle()
        while pending:
            settle()
        problems.sort(key=lambda p: p[0])  # in the order of the arrays (stable: chunks in grid order)
        return [p[1:] for p in problems], chunks, nbytes

    def read_metadata(self) -> bytes:
        """The metadata document, read only if it is at most ``max_metadata_bytes`` (checked before reading)."""
        limit = self.location.options.max_metadata_bytes
        if self.kv is not None:
            if self.kv.longer_than(METADATA_FILE, limit):
                raise MetadataError(
                    f"{self.url}/{METADATA_FILE} holds more than {limit} bytes, the limit on a metadata document "
                    f"(StorageOptions(max_metadata_bytes=...) raises it); refusing to read it"
                )
            raw = self.kv.read(METADATA_FILE)
            if raw is None:
                self.kv.check_reachable()  # a missing bucket reads as a missing object: say which it is
                raise self._not_committed()
            return raw
        try:
            fd, st = open_regular(self.metadata_path, self._real_root(), "the metadata document")
        except (FileNotFoundError, NotADirectoryError) as e:  # also a checkpoint replaced or removed meanwhile
            raise self._not_committed() from e
        try:
            if st.st_size > limit:
                raise MetadataError(
                    f"{self.metadata_path} holds {st.st_size} bytes, more than the limit of {limit} on a metadata "
                    f"document (StorageOptions(max_metadata_bytes=...) raises it); refusing to read it"
                )
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(limit + 1)
        except OSError as e:
            raise _os_failure(e, self.metadata_path, "the metadata document", "read") from e
        finally:
            os.close(fd)
        if len(raw) > limit:
            raise MetadataError(f"{self.metadata_path} grew past the limit of {limit} bytes while it was read")
        return raw

    def _real_root(self) -> str:
        """The real path of the checkpoint directory (links resolved), computed once."""
        if self._root_real is None:
            try:
                self._root_real = os.path.realpath(self.root, strict=True)
            except FileNotFoundError:
                self._root_real = os.path.realpath(self.root)
            except OSError as e:
                raise _os_failure(e, self.root, "the checkpoint directory", "resolve") from e
        return self._root_real

    def _not_committed(self) -> NotCommittedError:
        """Why there is no metadata document here, saying so when this is a CheckpointManager's directory."""
        if self.kv is None and not self.root.is_dir():
            return NotCommittedError(f"{self.root} does not exist or is not a directory")
        steps: dict[int, bool] = {}  # step -> committed
        if self.kv is not None:
            for key in self.kv.list("step_"):
                name, _, rest = key.partition("/")
                m = STEP_DIR.match(name)
                if m:
                    steps[int(m.group(1))] = steps.get(int(m.group(1)), False) or rest == METADATA_FILE
        else:
            with contextlib.suppress(OSError):
                for entry in os.scandir(self.root):
                    m = STEP_DIR.match(entry.name)
                    if m and entry.is_dir():
                        steps[int(m.group(1))] = os.path.isfile(os.path.join(entry.path, METADATA_FILE))
        committed = sorted(s for s, c in steps.items() if c)
        if committed:
            shown = committed if len(committed) <= 10 else [*committed[:3], "...", *committed[-3:]]
            listed = ", ".join(map(str, shown))
            return NotCommittedError(
                f"{self.url} is a CheckpointManager directory, not a checkpoint: it holds the committed steps "
                f"[{listed}]; load one with pytreeckpt.load('{self.url}/step_{committed[-1]}'), or the newest with "
                f"pytreeckpt.CheckpointManager('{self.url}').restore()"
            )
        if steps:
            return NotCommittedError(
                f"{self.url} is a CheckpointManager directory with no committed step yet (steps left uncommitted "
                f"by saves that failed or were interrupted: {sorted(steps)[:10]}), not a checkpoint"
            )
        return NotCommittedError(
            f"{self.url} is not a committed checkpoint (no {METADATA_FILE}); it may be a save that was interrupted"
            + ("" if self.kv is None else ", or nothing at all")
        )

    def _check_inside(self, path: Path, key: str) -> Path:
        """The real path of ``path`` (missing components kept), which must lie inside the checkpoint."""
        try:
            real = os.path.realpath(path, strict=True)
        except FileNotFoundError:
            real = os.path.realpath(path)
        except OSError as e:
            raise _os_failure(e, path, f"leaf {key!r}", "resolve") from e
        root = self._real_root()
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"leaf {key!r}: {path} leads outside the checkpoint {self.root} (symbolic link to {real}); refused"
            )
        return Path(real)

    # ------------------------------------------------------------------ arrays
    def _spec(self, meta: ArrayMeta, create: bool) -> dict[str, Any]:
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

    def open_arrays(self, metas: Sequence[ArrayMeta], create: bool) -> list[Any]:
        def failed(meta: ArrayMeta, e: Exception) -> CheckpointError:
            where = repr(meta.path)
            if meta.database is not None:
                where += f" in the OCDBT database {meta.database!r}"
            verb = "create" if create else "open"
            return CheckpointError(f"leaf {meta.key!r}: cannot {verb} stored array {where}: {e}")

        futures: list[Any] = []

        def settle() -> list[Any]:
            # Every open is waited for, so that none still makes files once this has raised.
            stores, first = [], None
            for meta, f in zip(metas, futures, strict=False):
                try:
                    stores.append(f.result())
                except Exception as e:
                    first = first or (meta, e)
            if first is not None:
                raise failed(*first) from first[1]
            return stores

        checked: set[str] = set()
        for meta in metas:
            if not create and self.kv is None:
                where = meta.path if meta.database is None else meta.database
                if where not in checked:  # a database holding many packed arrays is checked once
                    self._check_inside(self.root / where, meta.key)
                    checked.add(where)
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
        if create and self.kv is None:
            for meta in metas:
                if meta.database is None:
                    self._unsynced.add(self.root / meta.path / "zarr.json")
                else:
                    self._unsynced_trees.add(meta.database)
        return stores

    def _note_chunks(self, meta: ArrayMeta, region: Region) -> None:
        """Remember the chunk files a write of ``region`` (whole chunks) creates, to fsync them."""
        if self.kv is not None:
            return
        if meta.database is not None:
            self._unsynced_trees.add(meta.database)
            return
        array = self.root / meta.path
        self._unsynced.update(array / _chunk_key(index) for index in region.chunk_indices(meta.chunk_shape))

    def sync(self) -> None:
        """fsync every file written since the last call, and the directories holding them, in parallel.

        Directories from each file up to the checkpoint root are synced (the commit syncs
        the root itself), so new names are durable too.
        """
        files = set(self._unsynced)
        for tree in self._unsynced_trees:
            for dirpath, _, names in os.walk(self.root / tree):
                files.update(Path(dirpath) / n for n in names)
                files.add(Path(dirpath))
        self._unsynced.clear()
        self._unsynced_trees.clear()
        if not files:
            return
        dirs: set[Path] = set()
        for f in files:
            for parent in f.parents:
                if parent == self.root or self.root not in parent.parents:
                    break
                dirs.add(parent)
        targets = sorted(files - dirs) + sorted(dirs, key=lambda d: -len(d.parts))
        errors: list[OSError | None] = [None] * len(targets)
        workers = min(16, len(targets))
        parts = [range(k, len(targets), workers) for k in range(workers)]

        def run(part: range) -> None:
            for j in part:
                errors[j] = _fsync_quietly(targets[j])

        # Plain threads, not concurrent.futures: a save finishing while the interpreter
        # exits may still start threads, but an executor refuses new work then.
        threads = []
        for part in parts[1:]:
            t = threading.Thread(target=run, args=(part,), name="pytreeckpt-fsync", daemon=True)
            try:
                t.start()
            except RuntimeError:  # no new threads at all: this one does the part
                run(part)
                continue
            threads.append(t)
        run(parts[0])
        for t in threads:
            t.join()
        for path, error in zip(targets, errors, strict=True):
            if error is not None:
                raise CheckpointError(f"cannot make {path} durable (fsync): {error}")

    def write(
        self,
        metas: Sequence[ArrayMeta],
        items: Iterable[WriteItem],
        create: bool = True,
        progress: Callable[[int], None] | None = None,
        reuse: ChunkReuse | None = None,
        only: Iterable[int] | None = None,
        sums: ChunkSums | None = None,
    ) -> int:
        """Write ``(array index, region, data, done)`` items, a bounded number of bytes at a time.

        ``only`` gives the indices of the arrays the items write (None: any of ``metas``);
        only those are opened.

        ``items`` may be a generator that assembles each buffer when asked, so memory
        stays bounded by ``max_inflight_bytes``; ``done`` (or None) is called once the
        write of that buffer has finished, well or not, so its memory may be reused.
        With ``create=False`` the arrays must exist already (another rank created them).
        ``progress(nbytes)`` is called as writes finish. With ``reuse`` every chunk's
        content is hashed, and a chunk equal to the base checkpoint's is hard-linked from
        it instead of written. ``sums`` records every chunk's crc32c (and hash): chunk
        files written here give theirs as they are written, other chunks are checksummed
        from the data before TensorStore encodes it. Returns the bytes written.
        """
        wanted = range(len(metas)) if only is None else sorted(set(only))
        stores = dict(zip(wanted, self.open_arrays([metas[i] for i in wanted], create=create), strict=True))
        window = _Window(self.options.max_inflight_bytes)
        written = 0
        try:
            for i, region, buf, done in items:
                parts = [(region, buf)] if reuse is None else reuse.keep(i, region, buf, self, sums)
                if not parts:  # every chunk linked from the base
                    if done is not None:
                        done()
                    if progress is not None:
                        progress(buf.nbytes)
                    continue
                done_all = done if len(parts) == 1 else _after_all(len(parts), done)
                for part, data in parts:
                    nbytes = data.nbytes
                    written += nbytes
                    future: Any
                    if self._direct(metas[i], data):
                        future = self._write_direct(metas[i], part, data, None if sums is None else sums.recorder(i))
                    else:
                        if sums is not None:
                            sums.add_region(i, metas[i], part, data)
                        future = stores[i][part.slices()].write(data)
                        self._note_chunks(metas[i], part)
                    if done_all is not None or progress is not None:
                        future.add_done_callback(_finished(done_all, progress, nbytes))
                    window.add(future, nbytes, f"leaf {metas[i].key!r}: writing {part}")
        except BaseException:
            # The items failed (a copy, a transfer): let the writes already issued finish
            # before the failure is reported, so nothing writes into the directory after it.
            window.drain_quietly()
            raise
        window.drain()
        self.sync()
        return written

    def _direct(self, meta: ArrayMeta, data: np.ndarray) -> bool:
        """Whether the executor reads or writes this array's chunk files itself, with ``data`` as the memory.

        It does for non-empty, uncompressed arrays of their own (not packed) in a local
        directory on a little-endian host, where the memory has the stored element type;
        TensorStore does the rest. A write must cover whole chunks (every planned write does).
        """
        return self._reads_files(meta) and data.dtype == meta.dtype.numpy

    def _reads_files(self, meta: ArrayMeta) -> bool:
        """Whether this array's chunks are read as files by the executor (:func:`read_chunk`), not by TensorStore."""
        local_plain = self.kv is None and LITTLE_ENDIAN and meta.compression is None and meta.database is None
        return local_plain and meta.nbytes > 0 and len(meta.shape) > 0

    def _write_direct(
        self, meta: ArrayMeta, region: Region, data: np.ndarray, record: Callable[[tuple[int, ...], int], None] | None
    ) -> Future[Any]:
        """Write ``region`` (whole chunks) chunk file by chunk file; each file is fsynced as it is written.

        ``record(index, crc32c)`` is called with each chunk's checksum as it is written.
        """
        chunk = meta.chunk_shape
        bounds = zip(region.offset, region.stop, chunk, meta.shape, strict=True)
        if not all(o % c == 0 and (e % c == 0 or e == n) for o, e, c, n in bounds):
            raise CheckpointError(
                f"leaf {meta.key!r}: {region} is not whole chunks of {list(chunk)} (a planning error)"
            )
        array = self.root / meta.path
        futures = []
        for index in region.chunk_indices(chunk):
            path = array / _chunk_key(index)
            if path.parent not in self._made_dirs:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._made_dirs.add(path.parent)
                self._unsynced.add(path.parent)  # its new entries; the parents follow in :meth:`sync`
            box = chunk_region(index, chunk, meta.shape).relative_to(region).slices()
            futures.append(
                _IO.submit(self.options.file_io_concurrency, _write_recorded, path, data[box], chunk, index, record)
            )
        return _all_of(futures)

    def _read_chunks(
        self, meta: ArrayMeta, store: Any, wants: Sequence[tuple[Region, np.ndarray]]
    ) -> list[Callable[[], Future[Any]]]:
        """Read each ``(region, dest)`` of one array chunk by chunk, checking every chunk (see :meth:`_chunk`).

        A chunk several regions want is read once for all of them. Returns one function
        per region that starts the reads of its chunks (those not started yet) and returns
        a future of them all: the caller starts each region when its window has room, so
        the scratch memory of chunks only partly wanted stays bounded.
        """
        chunk = meta.chunk_shape
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
            for index in region.chunk_indices(chunk):
                whole = chunk_region(index, chunk, meta.shape)
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
        whole = chunk_region(index, meta.chunk_shape, meta.shape)
        if self._reads_files(meta):
            path = self.root / meta.path / _chunk_key(index)
            return _IO.submit(
                workers, _read_file_chunk, path, meta, whole.shape, targets, what, expected, self._real_root()
            )
        # One target wanting the whole chunk gets it straight in its memory; otherwise the
        # chunk lands in scratch memory and the targets' boxes are copied from there.
        straight = len(targets) == 1 and targets[0][1].shape == whole.shape and targets[0][1].dtype == meta.dtype.numpy
        out: Future[Any] = Future()
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
            _IO.submit(workers, _settle_stored_chunk, f, out, meta, targets, straight, what, expected)

        landing.add_done_callback(landed)
        return out

    def link_chunk(self, base: Path, base_path: str, path: str, index: tuple[int, ...]) -> bool:
        """Hard-link chunk ``index`` of the base checkpoint's array into this one; False where links fail.

        Only local directories have links; packed arrays live in a database, not in files.
        """
        if self.kv is not None:
            return False
        key = _chunk_key(index)
        src = base / base_path / key
        dst = self.root / path / key
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.link(src, dst)
        except OSError:
            return False
        self._unsynced.add(dst)  # its directory entry is new
        return True

    def read(
        self,
        metas: Sequence[ArrayMeta],
        plans: Sequence[ArrayLoadPlan],
        dest: Sequence[PieceData],
        rank: int | None,
        after: Callable[[int, ReadOp, np.ndarray], None] | None = None,
        array_done: Callable[[int], None] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Run the reads of ``rank`` (every rank when None) straight into destination memory.

        Each region lands in the reader's own target and is copied to the other targets
        in this process; ``after(array index, op, data)`` then runs, e.g. to send it on
        to targets on other ranks. ``array_done(i)`` runs once every read of array ``i``
        has landed (while later arrays are still being read), ``progress(nbytes)`` as
        reads land. Returns the bytes read.
        """
        self.check_files(metas)
        stores = self.open_arrays(metas, create=False)
        window = _Window(self.options.max_inflight_bytes)
        read = 0
        for i, (meta, plan, store, get) in enumerate(zip(metas, plans, stores, dest, strict=True)):
            mine = [op for op in plan.reads if rank is None or op.reader == rank]
            if not mine and array_done is not None:
                array_done(i)
            landing: list[list[np.ndarray]] = []  # per read: its reader's target first, then the others here
            for op in mine:
                outs = []
                for t in sorted(op.targets, key=lambda t: t.rank != op.reader):
                    if rank is None or t.rank == rank:
                        view, where = get(t.rank, t.piece)
                        outs.append(view[t.region.relative_to(where).slices()])
                landing.append(outs)
            starts = self._read_chunks(
                meta, store, [(op.region, outs[0]) for op, outs in zip(mine, landing, strict=True)]
            )
            for n, (op, outs) in enumerate(zip(mine, landing, strict=True)):
                first = outs[0]
                nbytes = op.region.size * plan.itemsize
                future = starts[n]()

                def fan_out(
                    first: np.ndarray = first,
                    rest: list[np.ndarray] = outs[1:],
                    i: int = i,
                    op: ReadOp = op,
                    last: bool = n == len(mine) - 1,
                    nbytes: int = nbytes,
                ) -> None:
                    for o in rest:
                        o[...] = first
                    if after is not None:
                        after(i, op, first)
                    if progress is not None:
                        progress(nbytes)
                    if last and array_done is not None:
                        array_done(i)

                read += nbytes
                window.add(future, nbytes, f"leaf {meta.key!r}: reading {op.region} of {meta.path!r}", fan_out)
        window.drain()
        return read


_IO = IOPool()
_INLINE_CHECK_BYTES = 1 << 20


def _read_file_chunk(
    path: Path,
    meta: ArrayMeta,
    valid: tuple[int, ...],
    targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    what: str,
    expected: int | None,
    inside: str,
) -> None:
    read_chunk(path, meta.chunk_shape, valid, targets, what, dtype=meta.dtype.numpy, expected=expected, inside=inside)


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
    """:func:`_check_stored_chunk`, settling ``out`` with its outcome."""
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

    def result(self) -> None:
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


def _write_recorded(
    path: Path,
    data: np.ndarray,
    chunk: tuple[int, ...],
    index: tuple[int, ...],
    record: Callable[[tuple[int, ...], int], None] | None,
) -> None:
    crc = write_chunk(path, data, chunk, True)
    if record is not None:
        record(index, crc)


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable plus free swap, at most its cgroup's limit.

    None where the system does not say (no ``/proc/meminfo``).
    """
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


def _os_failure(e: OSError, path: Path | str, what: str, action: str) -> CheckpointError:
    """A CheckpointError for a failed file-system call, naming ``what`` and the path; permission said as such."""
    if isinstance(e, PermissionError):
        return CheckpointError(f"{what}: permission denied: cannot {action} {path}")
    if e.errno == errno.ELOOP:
        return CheckpointError(f"{what}: cannot {action} {path}: too many levels of symbolic links (a loop?)")
    return CheckpointError(f"{what}: cannot {action} {path}: {e.strerror or e}")


def _referenced(document: bytes) -> frozenset[str] | None:
    """The arrays and databases a metadata document uses (``arrays/<name>``, ``ocdbt/<name>``); None if unreadable.

    Read leniently (a document of a newer format still protects what it names), and
    never trusted beyond naming what not to delete.
    """
    try:
        leaves = json.loads(document)["leaves"]
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None
    if not isinstance(leaves, list):
        return None
    names: set[str] = set()
    for leaf in leaves:
        if isinstance(leaf, dict):
            names.update(v for v in (leaf.get("path"), leaf.get("database")) if isinstance(v, str))
    return frozenset(names)


def remove_tree(path: Path) -> None:
    """Delete a file or a directory tree; parts vanishing meanwhile (another process removing them) are no error."""

    def vanished(_func: Any, _path: Any, exc: Any) -> None:
        error = exc if isinstance(exc, BaseException) else exc[1]
        if not isinstance(error, FileNotFoundError):
            raise error

    try:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        elif sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=vanished)
        else:
            shutil.rmtree(path, onerror=vanished)
    except FileNotFoundError:
        pass


def _all_of(futures: list[Future[Any]]) -> Future[Any]:
    """A future done when every one of ``futures`` is, failing with the first failure among them."""
    if len(futures) == 1:
        return futures[0]
    out: Future[Any] = Future()
    left = [len(futures)]
    lock = threading.Lock()
    failure: list[BaseException] = []

    def one(f: Future[Any]) -> None:
        e = f.exception()
        with lock:
            if e is not None and not failure:
                failure.append(e)
            left[0] -= 1
            last = left[0] == 0
        if last:
            if failure:
                out.set_exception(failure[0])
            else:
                out.set_result(None)

    if not futures:
        out.set_result(None)
    for f in futures:
        f.add_done_callback(one)
    return out


def _after_all(n: int, done: Callable[[], None] | None) -> Callable[[], None] | None:
    """A callback that calls ``done`` on its ``n``-th call."""
    if done is None:
        return None
    left = [n]
    lock = threading.Lock()

    def one() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            done()

    return one


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
        self.grids = [tuple(-(-n // c) for n, c in zip(m.shape, m.chunk_shape, strict=True)) for m in metas]
        self.keys = [m.key for m in metas]
        self.crcs: dict[int, tuple[list[int], list[int]]] = {}  # array -> (flat indices, crc32c values)
        self.hashes: dict[int, dict[int, str]] = {}
        self._received: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []
        self._lock = threading.Lock()

    def flat(self, i: int, index: Sequence[int]) -> int:
        flat = 0
        for k, g in zip(index, self.grids[i], strict=True):
            flat = flat * g + k
        return flat

    def add_crc(self, i: int, index: Sequence[int], crc: int) -> None:
        flat = self.flat(i, index)
        with self._lock:
            flats, values = self.crcs.setdefault(i, ([], []))
            flats.append(flat)
            values.append(crc)

    def recorder(self, i: int) -> Callable[[tuple[int, ...], int], None]:
        """``record(index, crc32c)`` for the chunks of array ``i``."""

        def record(index: tuple[int, ...], crc: int) -> None:
            self.add_crc(i, index, crc)

        return record

    def add_region(self, i: int, meta: ArrayMeta, region: Region, data: np.ndarray) -> None:
        """Record the crc32c of every chunk of ``region`` (whole chunks; ``data`` its elements)."""
        chunk, shape, offset = meta.chunk_shape, meta.shape, region.offset
        if not all(
            o % c == 0 and (e % c == 0 or e == n) for o, e, c, n in zip(offset, region.stop, chunk, shape, strict=True)
        ):
            raise CheckpointError(
                f"leaf {meta.key!r}: {region} is not whole chunks of {list(chunk)} (a planning error)"
            )
        for index in region.chunk_indices(chunk):
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
                    np.asarray(f, dtype=np.uint32 if math.prod(self.grids[i]) <= 1 << 32 else np.int64),
                    np.asarray(v, dtype=np.uint32),
                )
                for i, (f, v) in self.crcs.items()
            }
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
        n = math.prod(self.grids[i])
        flats, values = self.crcs.get(i, ([], []))
        if n == 1 and flats == [0] and not any(i in r for r in self._received):  # most small arrays
            return values[0].to_bytes(4, "little")
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
                f"leaf {self.keys[i]!r}: no checksum was recorded for chunk {missing} (flat index) of "
                f"{n}: a chunk was not written (an internal error)"
            )
        return out.tobytes()

    def chunk_hashes(self, i: int) -> tuple[str, ...]:
        """Every chunk's content hash of array ``i`` in C order, or () where some chunk has none."""
        got = self.hashes.get(i, {})
        n = math.prod(self.grids[i])
        return tuple(got[k] for k in range(n)) if len(got) == n else ()


@dataclass(slots=True)
class ChunkReuse:
    """Hashes the chunks of a save, and links those equal to the base checkpoint's instead of writing them.

    ``base_chunks[i]`` is the base's array path and chunk hashes for array ``i`` when the
    base stores that leaf the same way (shape, dtype, chunk grid, codecs), else None.
    Hashes (and the crc32c of linked chunks) go to the save's :class:`ChunkSums`.
    """

    chunk_shapes: list[tuple[int, ...]]
    shapes: list[tuple[int, ...]]
    paths: list[str]
    base: Path | None = None
    base_chunks: list[tuple[str, tuple[str, ...]] | None] = field(default_factory=list)
    linked_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def keep(
        self, i: int, region: Region, buf: np.ndarray, storage: Storage, sums: ChunkSums | None
    ) -> list[tuple[Region, np.ndarray]]:
        """Hash every chunk of this write; link the unchanged ones; return the boxes still to write."""
        chunk_shape, shape = self.chunk_shapes[i], self.shapes[i]
        grid = [-(-s // c) for s, c in zip(shape, chunk_shape, strict=True)]
        base = self.base_chunks[i] if self.base_chunks else None
        rest: list[tuple[Region, np.ndarray]] = []
        linked_any = False
        for index in region.chunk_indices(chunk_shape):
            box = chunk_region(index, chunk_shape, shape)
            data = buf[box.relative_to(region).slices()]
            digest = chunk_hash(data)
            flat = int(np.ravel_multi_index(index, grid)) if grid else 0
            if sums is not None:
                sums.add_hash(i, flat, digest)
            if (
                base is not None
                and self.base is not None
                and base[1][flat] == digest
                and storage.link_chunk(self.base, base[0], self.paths[i], index)
            ):
                with self._lock:
                    self.linked_bytes += data.nbytes
                if sums is not None:  # the same elements as the base's chunk file: the same checksum
                    sums.add_crc(i, index, chunk_crc(data, chunk_shape))
                linked_any = True
                continue
            rest.append((box, data))
        if not linked_any:
            return [(region, buf)]
        return rest


def _finished(
    done: Callable[[], None] | None, progress: Callable[[int], None] | None, nbytes: int
) -> Callable[[Any], None]:
    def callback(_future: Any) -> None:
        if done is not None:
            done()
        if progress is not None:
            progress(nbytes)

    return callback


class _Lock:
    """A held writer lock; ``release()`` (or process exit) frees it."""

    def __init__(self, fd: int | None) -> None:
        self.fd: int | None = fd

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def assemble(op: WriteOp, get: PieceData, dtype: np.dtype) -> np.ndarray:
    """The data of a write: a view of the writer's memory, or a buffer merged from fragments."""
    if op.is_direct:
        src, where = get(op.writer, op.sources[0].piece)
        view: np.ndarray = src[op.region.relative_to(where).slices()]
        return view
    buf = np.empty(op.region.shape, dtype=dtype)
    for frag in op.sources:
        src, where = get(frag.rank, frag.piece)
        buf[frag.region.relative_to(op.region).slices()] = src[frag.region.relative_to(where).slices()]
    return buf


def write_items(
    plans: Sequence[ArraySavePlan], data: Sequence[PieceData], dtypes: Sequence[np.dtype], rank: int | None
) -> Iterator[tuple[int, WriteOp, np.ndarray]]:
    """The writes of ``rank`` (every rank when None), each assembled when reached."""
    for i, (plan, get, dtype) in enumerate(zip(plans, data, dtypes, strict=True)):
        for op in plan.writes:
            if rank is None or op.writer == rank:
                yield i, op, assemble(op, get, dtype)


def _chunk_key(index: tuple[int, ...]) -> str:
    """The key of chunk ``index`` in a zarr v3 array (the default chunk key encoding: ``c/i/j``)."""
    return "/".join(["c", *map(str, index)])


def _fsync_quietly(path: Path) -> OSError | None:
    try:
        _fsync(path)
    except OSError as e:
        return e
    return None


def _fsync(path: Path) -> None:
    """fsync a file or a directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
