"""What every part of :class:`~pytreeckpt.storage.Storage` shares: the location, its root, the
I/O thread pool and the window bounding the bytes in flight."""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError, PermissionDeniedError
from pytreeckpt.plan import ChunkingOptions
from pytreeckpt.storage._chunkfiles import IOPool, lower_priority
from pytreeckpt.storage._location import OBJECT_STORE_CHUNKING, KvPrefix, Where, make_context, resolve
from pytreeckpt.storage._options import ExecutorOptions

logger = logging.getLogger("pytreeckpt")


OCDBT_INLINE_BYTES = 64 * 1024


_IO = IOPool()
_BACKGROUND_IO: dict[int, IOPool] = {}  # by niceness: the threads of saves written behind the caller
_BACKGROUND = threading.local()  # .nice: this thread writes a save in the background


def io_pool() -> IOPool:
    """The I/O threads for the calling thread: at its background niceness when it has one."""
    nice = background_nice()
    if nice <= 0:
        return _IO
    pool = _BACKGROUND_IO.get(nice)
    if pool is None:
        pool = _BACKGROUND_IO.setdefault(nice, IOPool(nice))
    return pool


def background_nice() -> int:
    """The niceness the calling thread's I/O runs at (0: as the caller)."""
    return int(getattr(_BACKGROUND, "nice", 0))


def in_background(nice: int) -> None:
    """Mark the calling thread, a thread of its own that writes a save while the program goes on,
    as background work: it and the I/O threads it uses run ``nice`` steps below normal priority,
    so the program's own threads (a training loop's compute) come first on busy cores."""
    _BACKGROUND.nice = max(0, nice)
    lower_priority(nice)


class Window:
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


class StorageBase:
    """A checkpoint location's state; the parts of :class:`Storage` each add one responsibility."""

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
        self._packed: Any = None  # the OCDBT databases' key-value stores, once used (ArrayIO.packed)
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

    def _check_inside(self, path: Path, key: str, what: str | None = None) -> Path:
        """The real path of ``path`` (missing components kept), which must lie inside the checkpoint; errors
        name leaf ``key``, or ``what`` where given."""
        what = f"leaf {key!r}" if what is None else what
        try:
            real = os.path.realpath(path, strict=True)
        except FileNotFoundError:
            real = os.path.realpath(path)
        except OSError as e:
            raise _os_failure(e, path, what, "resolve") from e
        root = self._real_root()
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            raise CheckpointError(
                f"{what}: {path} leads outside the checkpoint {self.root} (symbolic link to {real}); refused"
            )
        return Path(real)


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


def _os_failure(e: OSError, path: Path | str, what: str, action: str) -> CheckpointError:
    """A CheckpointError for a failed file-system call, naming ``what`` and the path; permission said as such."""
    if isinstance(e, PermissionError):
        return PermissionDeniedError(f"{what}: permission denied: cannot {action} {path}")
    if e.errno == errno.ELOOP:
        return CheckpointError(f"{what}: cannot {action} {path}: too many levels of symbolic links (a loop?)")
    return CheckpointError(f"{what}: cannot {action} {path}: {e.strerror or e}")


def _chunk_key(index: tuple[int, ...]) -> str:
    """The key of chunk ``index`` in a zarr v3 array (the default chunk key encoding: ``c/i/j``)."""
    return "/".join(["c", *map(str, index)])
