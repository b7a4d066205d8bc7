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
import fcntl
import hashlib
import json
import logging
import math
import os
import secrets
import shutil
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

from ._chunkio import LITTLE_ENDIAN, IOPool, read_chunk, write_chunk
from ._errors import CheckpointError, MetadataError, NotCommittedError
from ._format import (
    ARRAYS_DIR,
    LOCK_FILE,
    METADATA_FILE,
    PACKED_DIR,
    STEP_DIR,
    ArrayMeta,
    generation_of,
    zarr_metadata,
)
from ._location import OBJECT_STORE_CHUNKING, OCDBT_CACHE, KvPrefix, Where, make_context, resolve
from ._region import Region, chunk_region
from .plan import ArrayLoadPlan, ArraySavePlan, ChunkingOptions, ReadOp, WriteOp

__all__ = ["ExecutorOptions", "PieceData", "Storage", "WriteItem", "assemble", "remove_tree", "write_items"]

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
        """Refuse metadata that claims more bytes than are stored, before anything is allocated.

        Uncompressed chunks (raw bytes and a 4-byte checksum) hold at least the array's
        size; compressed ones at least ``1 / MAX_COMPRESSION_RATIO`` of it. A document
        claiming a huge shape is caught here instead of by a huge allocation. Packed
        arrays are small by definition (the metadata parser caps them). On a key-value
        store, whose listings carry no sizes, every chunk object must be present; a chunk
        shorter than claimed fails its read.
        """
        for meta in metas:
            if meta.database is not None:
                continue
            if self.kv is not None:
                self._check_chunks_listed(meta)
                continue
            stored = self.stored_bytes(meta) or 0
            ratio = 1 if meta.compression is None else MAX_COMPRESSION_RATIO
            if stored * ratio < meta.nbytes:
                raise MetadataError(
                    f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} "
                    f"({meta.nbytes} bytes) but {meta.path!r} holds only {stored} bytes of chunks"
                    + ("" if ratio == 1 else f", more than {ratio} times less than that")
                )

    def stored_bytes(self, meta: ArrayMeta) -> int | None:
        """Bytes of the chunk files of one stored array; None where the store cannot tell (packed, key-value)."""
        if meta.database is not None or self.kv is not None:
            return None
        folder = self._check_inside(self.root / meta.path, meta.key)
        stored = 0
        for dirpath, _dirs, files in os.walk(folder):
            for name in files:
                if name != "zarr.json":
                    stored += os.stat(os.path.join(dirpath, name)).st_size
        return stored

    def _check_chunks_listed(self, meta: ArrayMeta) -> None:
        assert self.kv is not None
        if meta.nbytes == 0:
            return
        prefix = meta.path + "/"
        listed = set(self.kv.list(prefix))
        grid = [-(-n // c) for n, c in zip(meta.shape, meta.chunk_shape, strict=True)]
        expected = math.prod(grid)
        chunks = sum(1 for k in listed if k.startswith(prefix + "c"))
        if chunks < expected:
            raise MetadataError(
                f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} "
                f"in {expected} chunks but {self.url}/{meta.path} holds only {chunks} chunk objects"
            )

    def verify(self, metas: Sequence[ArrayMeta]) -> tuple[list[tuple[str, tuple[int, ...] | None, str]], int, int]:
        """Read every chunk of every array; returns ``(problems, chunks read, bytes read)``.

        A problem is ``(key, chunk index or None for the whole array, message)``.
        Memory stays bounded: chunks are read a window at a time into scratch buffers.
        """
        problems: list[tuple[str, tuple[int, ...] | None, str]] = []
        chunks = nbytes = 0
        for meta in metas:
            try:
                self.check_stored_sizes([meta])
                (store,) = self.open_arrays([meta], create=False)
            except CheckpointError as e:
                problems.append((meta.key, None, str(e)))
                continue
            pending: collections.deque[tuple[tuple[int, ...], Any, int]] = collections.deque()
            inflight = 0

            def settle(
                pending: collections.deque[tuple[tuple[int, ...], Any, int]] = pending, meta: ArrayMeta = meta
            ) -> int:
                idx, future, size = pending.popleft()
                try:
                    future.result()
                except Exception as e:
                    problems.append((meta.key, idx, f"chunk {list(idx)} of {meta.path!r}: {e}"))
                return size

            for idx in Region.full(meta.shape).chunk_indices(meta.chunk_shape):
                region = chunk_region(idx, meta.chunk_shape, meta.shape)
                size = region.size * meta.dtype.itemsize
                pending.append((idx, store[region.slices()].read(), size))
                inflight += size
                chunks += 1
                nbytes += size
                while pending and inflight > self.options.max_inflight_bytes:
                    inflight -= settle()
            while pending:
                settle()
        return problems, chunks, nbytes

    def read_metadata(self) -> bytes:
        if self.kv is not None:
            raw = self.kv.read(METADATA_FILE)
            if raw is None:
                self.kv.check_reachable()  # a missing bucket reads as a missing object: say which it is
                raise self._not_committed()
            return raw
        self._check_inside(self.metadata_path, "metadata")
        try:  # opened, not checked first: a checkpoint replaced or removed meanwhile is no OS error
            with open(self.metadata_path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as e:
            raise self._not_committed() from e

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
        real = path.resolve()
        if not real.is_relative_to(self.root.resolve()):
            raise CheckpointError(f"leaf {key!r}: {path} leads outside the checkpoint {self.root} (symbolic link?)")
        return real

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
            return CheckpointError(
                f"leaf {meta.key!r}: cannot {'create' if create else 'open'} stored array {meta.path!r}: {e}"
            )

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
        it instead of written. Returns the bytes written.
        """
        wanted = range(len(metas)) if only is None else sorted(set(only))
        stores = dict(zip(wanted, self.open_arrays([metas[i] for i in wanted], create=create), strict=True))
        window = _Window(self.options.max_inflight_bytes)
        written = 0
        try:
            for i, region, buf, done in items:
                parts = [(region, buf)] if reuse is None else reuse.keep(i, region, buf, self)
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
                        future = self._write_direct(metas[i], part, data)
                    else:
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
        local_plain = self.kv is None and LITTLE_ENDIAN and meta.compression is None and meta.database is None
        return local_plain and meta.nbytes > 0 and len(meta.shape) > 0 and data.dtype == meta.dtype.numpy

    def _write_direct(self, meta: ArrayMeta, region: Region, data: np.ndarray) -> Future[Any]:
        """Write ``region`` (whole chunks) chunk file by chunk file; each file is fsynced as it is written."""
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
            futures.append(_IO.submit(self.options.file_io_concurrency, write_chunk, path, data[box], chunk, True))
        return _all_of(futures)

    def _read_direct(self, meta: ArrayMeta, wants: Sequence[tuple[Region, np.ndarray]]) -> list[Future[Any]]:
        """Read each ``(region, dest)`` of one array chunk file by chunk file, checking checksums.

        A chunk several regions want is read once for all of them. Every chunk is queued
        at once; a chunk only partly wanted goes through a scratch buffer, so the memory
        held is at most one chunk per I/O thread. Returns one future per region.
        """
        chunk = meta.chunk_shape
        targets: dict[tuple[int, ...], list[tuple[tuple[slice, ...], np.ndarray]]] = {}
        valid: dict[tuple[int, ...], tuple[int, ...]] = {}
        needs: list[list[tuple[int, ...]]] = []
        for region, dest in wants:
            needs.append([])
            for index in region.chunk_indices(chunk):
                whole = chunk_region(index, chunk, meta.shape)
                part = whole.intersect(region)
                assert part is not None
                valid[index] = whole.shape
                box = part.relative_to(whole).slices()
                targets.setdefault(index, []).append((box, dest[part.relative_to(region).slices()]))
                needs[-1].append(index)
        array = self.root / meta.path
        futures = {
            index: _IO.submit(
                self.options.file_io_concurrency,
                read_chunk,
                array / _chunk_key(index),
                chunk,
                valid[index],
                wanted,
                f"chunk {list(index)}",
            )
            for index, wanted in targets.items()
        }
        return [_all_of([futures[index] for index in indices]) for indices in needs]

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
            direct: list[Future[Any]] | None = None
            if mine and all(self._direct(meta, outs[0]) for outs in landing):
                direct = self._read_direct(meta, [(op.region, outs[0]) for op, outs in zip(mine, landing, strict=True)])
            for n, (op, outs) in enumerate(zip(mine, landing, strict=True)):
                first = outs[0]
                nbytes = op.region.size * plan.itemsize
                future: Any
                if direct is not None:
                    future = direct[n]
                else:
                    future = ts.array(first).write(store[op.region.slices()])

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


@dataclass(slots=True)
class ChunkReuse:
    """Hashes the chunks of a save, and links those equal to the base checkpoint's instead of writing them.

    ``base_chunks[i]`` is the base's array path and chunk hashes for array ``i`` when the
    base stores that leaf the same way (shape, dtype, chunk grid, codecs), else None.
    """

    chunk_shapes: list[tuple[int, ...]]
    shapes: list[tuple[int, ...]]
    paths: list[str]
    base: Path | None = None
    base_chunks: list[tuple[str, tuple[str, ...]] | None] = field(default_factory=list)
    hashes: dict[int, dict[int, str]] = field(default_factory=dict)
    linked_bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def keep(self, i: int, region: Region, buf: np.ndarray, storage: Storage) -> list[tuple[Region, np.ndarray]]:
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
            with self._lock:
                self.hashes.setdefault(i, {})[flat] = digest
            if (
                base is not None
                and self.base is not None
                and base[1][flat] == digest
                and storage.link_chunk(self.base, base[0], self.paths[i], index)
            ):
                with self._lock:
                    self.linked_bytes += data.nbytes
                linked_any = True
                continue
            rest.append((box, data))
        if not linked_any:
            return [(region, buf)]
        return rest

    def chunk_hashes(self, i: int) -> tuple[str, ...]:
        got = self.hashes.get(i, {})
        n = math.prod(-(-s // c) for s, c in zip(self.shapes[i], self.chunk_shapes[i], strict=True))
        return tuple(got[k] for k in range(n)) if len(got) == n else ()


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
