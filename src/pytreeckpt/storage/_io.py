"""What every part of the storage package shares: the I/O thread pools (a save written in the background
runs at a lower priority), the window bounding the bytes in flight, and small helpers (a chunk's key, an
OS error said as a CheckpointError)."""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError, PermissionDeniedError
from pytreeckpt.storage._chunkfiles import IOPool, lower_priority
from pytreeckpt.storage._deadline import StoreWaits, cancel

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
    """Futures in flight, waited on oldest first once their bytes exceed a bound.

    With ``waits`` (an object store's) each wait is bounded by the call's timeout; past it
    every future still in the window is cancelled and the CheckpointTimeoutError raised.
    """

    def __init__(self, limit: int, waits: StoreWaits | None = None) -> None:
        self.limit = limit
        self.waits = waits or _UNBOUNDED
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
            self.waits.wait(future, what)
        except CheckpointTimeoutError:
            self.cancel()
            raise
        except Exception as e:
            self.drain_quietly()
            raise CheckpointError(f"{what}: {e}") from e
        if then is not None:
            then()

    def drain(self) -> None:
        while self.queue:
            self.pop()

    def drain_quietly(self) -> None:
        """Wait for every future left (within the call's timeout each, on an object store), ignoring failures;
        once the store did not answer, cancel them instead."""
        while self.queue:
            if self.waits.stuck:
                self.cancel()
                return
            entry = self.queue.popleft()
            with contextlib.suppress(Exception):  # the first error is the one reported
                self.waits.wait(entry[0], entry[3])
        self.bytes = 0

    def cancel(self) -> None:
        """Cancel every future left (what TensorStore has not sent yet is not sent)."""
        while self.queue:
            cancel(self.queue.popleft()[0])
        self.bytes = 0


_UNBOUNDED = StoreWaits(None)


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
