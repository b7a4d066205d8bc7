"""Chunk files read and written by the executor itself: its fast path for uncompressed local arrays.

An uncompressed pytreeckpt array is a zarr v3 array whose codecs are ``bytes``
(little endian) and ``crc32c``: each chunk file holds the chunk's elements in C order,
edge chunks padded to the full chunk shape, followed by the crc32c of those bytes (4
bytes, little endian). The files written here are the files TensorStore writes, and
TensorStore reads them (and this module reads TensorStore's).

Done here, a read lands in the destination memory with one ``pread`` and a checksum,
and a write leaves the caller's memory with one ``pwritev``, without the decode and
copy stages TensorStore runs for every chunk. Cold loads of large arrays ran at about
0.55x the speed of a plain read of the same bytes through TensorStore, and 0.9x here.

The I/O runs on plain daemon threads, not ``concurrent.futures``'s executor, which
refuses new work once the interpreter starts to exit while an asynchronous save may
still be writing. When the program ends (``atexit``, after Python has joined every
non-daemon thread, an asynchronous save's writer included) the threads are stopped and
joined, so none is inside a system call on a Python buffer while the interpreter
finalises.
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import fcntl
import functools
import math
import mmap
import os
import queue
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._errors import CheckpointError, PermissionDeniedError
from pytreeckpt.core._libc import linux_libc

__all__ = [
    "LITTLE_ENDIAN",
    "NEW_FILE",
    "IOPool",
    "chunk_crc",
    "cold_files",
    "lower_priority",
    "make_dirs",
    "no_link",
    "open_regular",
    "read_chunk",
    "read_small",
    "write_chunk",
]

LITTLE_ENDIAN = sys.byteorder == "little"
_MAX_IO = 1 << 30  # bytes per system call (Linux moves at most about 2 GiB in one)
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
"""How a save opens a file it writes: a symbolic link in its place is an error (ELOOP), never followed."""


_Task = list[Any]  # [future, fn, args]: emptied by the thread that runs it (see _run)

QUIESCE_SECONDS = 60.0
"""How long the exit hook waits for the chunk reads and writes already running (each one
``pread`` or ``pwrite`` and fsync of one chunk file) before the interpreter finalises."""


def lower_priority(nice: int) -> None:
    """Run the calling thread ``nice`` steps below the process's main thread (Linux: per thread).

    A thread can only lower its own priority (raising it needs privileges), so this is
    for threads of their own; one already that low (it inherited it) stays as it is.
    Where the platform cannot, nothing changes.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        want = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)  # (the pid names the main thread)
        if os.getpriority(os.PRIO_PROCESS, tid) < want:
            os.setpriority(os.PRIO_PROCESS, tid, want)
    except OSError:
        pass


class IOPool:
    """Daemon threads running blocking file I/O, each call returning a :class:`Future`.

    With ``nice`` > 0 its threads run at a lower scheduling priority (:func:`lower_priority`).
    The first thread started registers :meth:`quiesce` with :mod:`atexit`.
    """

    def __init__(self, nice: int = 0) -> None:
        self.nice = nice
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()  # None: a thread stops
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._hooked = False

    def submit(self, workers: int, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """Run ``fn(*args)`` on one of at least ``workers`` threads (inline where no thread can start)."""
        future: Future[Any] = Future()
        with self._lock:
            while len(self._threads) < workers:
                t = threading.Thread(target=self._work, name="pytreeckpt-io", daemon=True)
                try:
                    t.start()
                except RuntimeError:  # the interpreter is exiting: no new threads
                    break
                self._threads.append(t)
                if not self._hooked:
                    self._hooked = True
                    atexit.register(self.quiesce, QUIESCE_SECONDS)
            alive = bool(self._threads)
        if not alive:
            _run([future, fn, args])
            return future
        self._tasks.put([future, fn, args])
        return future

    def _work(self) -> None:
        lower_priority(self.nice)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            _run(task)
            del task  # an idle thread must not keep the last buffer (staging memory) alive

    def quiesce(self, timeout: float | None = None) -> bool:
        """Stop the threads: work not started yet fails (a CheckpointError), work running is finished.

        Returns whether every thread ended within ``timeout`` seconds. A later
        :meth:`submit` starts threads anew.
        """
        with self._lock:
            threads, self._threads = self._threads, []
            while True:
                try:
                    task = self._tasks.get_nowait()
                except queue.Empty:
                    break
                if task is not None:
                    task[0].set_exception(CheckpointError("chunk I/O not run: the program is exiting"))
            for _ in threads:
                self._tasks.put(None)
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)


def _run(task: _Task) -> None:
    """Run ``task`` (``[future, fn, args]``) and settle its future.

    The task is emptied first and its arguments dropped before the future is settled: the
    future's callbacks run here, and the caller they wake must not find its buffers (staging
    memory) still held by this thread.
    """
    future, fn, args = task
    task.clear()
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as e:
        del args
        future.set_exception(_without_frames(e))
    else:
        del args
        future.set_result(result)


def _without_frames(error: BaseException) -> BaseException:
    """``error`` with the tracebacks of it and its causes dropped: their frames would keep the
    buffers (staging memory, the caller's arrays) alive for as long as the error is kept."""
    todo: list[BaseException | None] = [error]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]
    return error


def _padded_tail(valid: Sequence[int], chunk: Sequence[int]) -> bool:
    """Whether a box of ``valid`` elements at the origin of a ``chunk`` is one C-order prefix of it."""
    return all(v == c for v, c in zip(valid[1:], chunk[1:], strict=True))


def _bytes_of(a: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous array, as a flat uint8 view."""
    return a.reshape(-1).view(np.uint8)


def _encoded_prefix(data: np.ndarray, chunk: tuple[int, ...]) -> np.ndarray:
    """The bytes of a chunk whose valid box is ``data``, in C order, up to where only zero padding is left.

    Where the valid box is a C-order prefix of the chunk (only its last rows missing) those
    are ``data``'s own bytes; otherwise the box is placed in a zero chunk first.
    """
    if data.shape != chunk and not _padded_tail(data.shape, chunk):
        full = np.zeros(chunk, dtype=data.dtype)
        full[tuple(slice(0, n) for n in data.shape)] = data
        data = full
    return _bytes_of(np.ascontiguousarray(data))


def write_chunk(path: Path, data: np.ndarray, chunk_shape: Sequence[int], fsync: bool, direct: bool = False) -> int:
    """Write one chunk file: ``data`` (the chunk's valid box, any strides), padding, checksum.

    With ``fsync`` the file is made durable before this returns. With ``direct`` a file of
    :data:`DIRECT_MIN_BYTES` or more is written around the page cache where the file
    system allows it (:func:`_write_direct`); the file is the same. Returns the checksum
    written: the chunk's :func:`chunk_crc`, which the metadata records.
    """
    chunk = tuple(chunk_shape)
    raw = _encoded_prefix(data, chunk)
    pad = math.prod(chunk) * data.dtype.itemsize - raw.nbytes
    if direct and _O_DIRECT and raw.nbytes + pad >= DIRECT_MIN_BYTES:
        written = _write_direct(path, raw, pad, fsync)
        if written is not None:
            return written
    crc = crc32c(raw)
    parts = [raw]
    if pad:
        zeros = np.zeros(pad, dtype=np.uint8)
        crc = crc32c(zeros, crc)
        parts.append(zeros)
    parts.append(np.frombuffer(crc.to_bytes(4, "little"), dtype=np.uint8))
    fd = os.open(path, NEW_FILE, 0o666)  # less the umask
    try:
        _write_all(fd, parts)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return int(crc)


_ZEROS = np.zeros(1 << 20, dtype=np.uint8)


def chunk_crc(data: np.ndarray, chunk_shape: Sequence[int], dtype: np.dtype | None = None) -> int:
    """The crc32c of one chunk as zarr's ``bytes`` codec encodes it: what the metadata records per chunk.

    ``data`` is the chunk's valid box (any strides); the encoded chunk is the whole chunk
    shape, edge chunks padded with zero bits (the fill value), little endian, C order,
    elements of ``dtype`` (the stored type; ``data``'s own when None). For an uncompressed
    chunk file this is the checksum the file ends with.

    >>> hex(chunk_crc(np.arange(3, dtype=np.uint8), (4,)))
    '0xca63e957'
    """
    chunk = tuple(chunk_shape)
    if dtype is not None and data.dtype != dtype:
        data = data.astype(dtype)  # e.g. big-endian input: stored as little endian
    data = _little_endian(data)
    raw = _encoded_prefix(data, chunk)
    crc = crc32c(raw)
    pad = math.prod(chunk) * data.dtype.itemsize - raw.nbytes
    while pad > 0:
        step = min(pad, _ZEROS.nbytes)
        crc = crc32c(_ZEROS[:step], crc)
        pad -= step
    return int(crc)


def _little_endian(a: np.ndarray) -> np.ndarray:
    """``a``, or a copy of its elements as raw little-endian bytes (of a void type) where they are big endian."""
    order = a.dtype.byteorder
    if order in ("|", "<") or (order == "=" and LITTLE_ENDIAN) or a.dtype.itemsize == 1:
        return a
    width = a.dtype.itemsize // (2 if a.dtype.kind == "c" else 1)
    swapped = np.ascontiguousarray(a).reshape(-1).view(f"u{width}").byteswap()
    return swapped.view(f"V{a.dtype.itemsize}").reshape(a.shape)


def no_link(path: Path, what: str) -> CheckpointError | None:
    """A CheckpointError if ``path`` is a symbolic link (what a save must not write or delete through); else None."""
    try:
        target = os.readlink(path)
    except OSError:  # (not a link, or not there)
        return None
    return CheckpointError(
        f"{what}: {path} is a symbolic link to {os.path.join(os.path.dirname(path), target)}; a save never writes, "
        f"deletes or locks through a link inside a checkpoint: refused (remove the link, or save elsewhere)"
    )


def make_dirs(root: Path, path: Path, what: str) -> None:
    """Make the directory ``path`` below ``root`` (which exists: the checkpoint directory, a link there
    if the user named one), and its missing parents, one by one.

    An existing part is checked, never followed: a symbolic link or another file there is a
    CheckpointError naming ``what`` and the path, so a save never writes outside the checkpoint.
    """
    here = root
    for part in path.relative_to(root).parts:
        here = here / part
        try:
            os.mkdir(here)  # 0o777 less the umask
        except FileExistsError:
            linked = no_link(here, what)
            if linked is not None:
                raise linked from None
            if not os.path.isdir(here):
                raise CheckpointError(f"{what}: {here} exists and is not a directory; refused") from None


def open_regular(path: Path | str, inside: str | None, what: str) -> tuple[int, os.stat_result]:
    """Open a file of a checkpoint for reading; returns the descriptor and its ``fstat``.

    Only a regular file is read: a FIFO, device or socket is refused (the open does not
    block on a FIFO: ``O_NONBLOCK``). A symbolic link is followed only where it leads to a
    place inside the directory ``inside`` (a real path; None: links are not followed):
    the check costs a system call only for links (``O_NOFOLLOW`` fails on them).
    FileNotFoundError and NotADirectoryError are raised as they are; every other failure is a CheckpointError naming
    ``what`` and the path, with the OS error chained.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except OSError as e:
        if e.errno != errno.ELOOP or inside is None:
            raise _os_error(e, path, what) from e
        real = _real_inside(path, inside, what)
        try:
            fd = os.open(real, flags | os.O_NOFOLLOW)
        except OSError as e2:
            raise _os_error(e2, path, what) from e2
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(
                f"{what}: {path} is not a regular file (a FIFO, device, socket or directory); refused"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_small(path: Path, inside: str, what: str, limit: int) -> bytes | None:
    """The bytes of a small file of a checkpoint (a ``zarr.json``), opened as :func:`open_regular` does; None where
    it is missing. CheckpointError where it holds more than ``limit`` bytes."""
    try:
        fd, st = open_regular(path, inside, what)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        if st.st_size > limit:
            raise CheckpointError(f"{what}: {path} holds {st.st_size} bytes, more than the {limit} expected")
        return os.pread(fd, limit + 1, 0)
    except OSError as e:
        raise _os_error(e, path, what) from e
    finally:
        os.close(fd)


def _real_inside(path: Path | str, inside: str, what: str) -> str:
    """The real path of ``path``, which must lie inside ``inside`` (a real path); CheckpointError otherwise."""
    try:
        real = os.path.realpath(path, strict=True)
    except OSError as e:
        raise _os_error(e, path, what) from e
    if real != inside and not real.startswith(inside.rstrip(os.sep) + os.sep):
        raise CheckpointError(
            f"{what}: {path} leads outside the checkpoint {inside} (symbolic link to {real}); refused"
        )
    return real


def _os_error(e: OSError, path: Path | str, what: str) -> BaseException:
    """A CheckpointError for a failed open or stat (a missing file or directory stays itself, for callers to word)."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return e
    if isinstance(e, PermissionError):
        return PermissionDeniedError(f"{what}: permission denied reading {path}")
    if e.errno == errno.ELOOP:
        return CheckpointError(f"{what}: cannot open {path}: too many levels of symbolic links (a loop?)")
    return CheckpointError(f"{what}: cannot open {path}: {e.strerror or e}")


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")]


_CACHESTAT = 451  # (Linux 6.5 and later; one number on every architecture, as every system call since 5.1)


@functools.cache
def _syscall() -> Any:
    """libc's ``syscall`` where the kernel has ``cachestat`` (Linux 6.5 and later), else None."""
    fn = linux_libc("syscall", ctypes.c_long)
    return fn if fn is not None and _pages_cached(fn, 0) is not None else None


def _pages_cached(fn: Any, fd: int, nbytes: int = 0) -> int | None:
    """How many pages of the file's first ``nbytes`` (0: all of it) the page cache holds (``cachestat``); None
    where the kernel cannot say."""
    span, got = _CacheRange(0, nbytes), _CacheStat()
    if fn(_CACHESTAT, ctypes.c_long(fd), ctypes.byref(span), ctypes.byref(got), ctypes.c_long(0)) != 0:
        return None if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM) else 0  # (fd 0 may be anything: EBADF)
    return int(got.cache)


def cold_files(paths: Sequence[Path]) -> bool:
    """Whether the page cache holds less than half of these files' pages (``cachestat``): a load reads them around
    it (:func:`_read_direct`) into new memory. False where the kernel cannot say, or where none can be opened."""
    fn = _syscall()
    if fn is None:
        return False
    cached = pages = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            size = os.fstat(fd).st_size
            got = _pages_cached(fn, fd)
        finally:
            os.close(fd)
        if got is None:
            return False
        cached, pages = cached + got, pages + -(-size // _DIRECT_ALIGN)
    return pages > 0 and cached * 2 < pages


def _read_direct(fd: int, head: np.ndarray) -> tuple[int, int]:
    """Read the whole blocks of ``head`` (flat uint8, from the file's first byte) around the page cache, where it
    holds :data:`DIRECT_MIN_BYTES` or more, the file system takes ``O_DIRECT`` and the page cache holds none of
    those blocks; returns the bytes read and their crc32c (0, 0: none read, the caller reads through the page
    cache).

    A cold read of a large checkpoint into new memory through the page cache fills twice its size of fresh
    pages (the cache's and the memory's; on a virtual machine each costs a fault in the host too): a 4 GiB load
    took 7.4 s that way and 2.7 s around the cache, fio's own time. Blocks the cache holds, even some, are
    read from there (faster than the device).

    The file is read :data:`_DIRECT_READ` bytes at a time, straight into ``head``, each piece checksummed as it
    lands: on the development machine (a virtual one) 16 threads read 1 GiB in 0.62-0.70 s that way against
    0.78-0.81 s in one read per file, and the kernel faults the new pages in, in bulk (a 4 GiB load into new
    tensors: 3.38-3.60 s, against 3.1-3.9 s in one read per file).

    ``head`` must start on a page (the new memory a load returns): a caller's tensor, 64 bytes into a page,
    which ``O_DIRECT`` cannot fill, is read through the page cache (0, 0). Its pages are already faulted in, so
    the cache's fresh pages are the only ones, and the kernel's readahead drives the device in large requests.
    Reading it around the cache instead, through each thread's page-aligned buffer and a copy, lost in most
    sittings, most at 4 ranks: 1 GiB in place at 4 ranks took 0.86-0.99 s so against 0.68-0.74 s through the
    cache (medians of 6 and 10 alternated rounds, 0.89 s with 2 MiB pieces), in one process 0.87 s against
    0.70 s (16 rounds), 4 GiB 3.98 s against 3.25 s.
    """
    if head.nbytes < DIRECT_MIN_BYTES or not _O_DIRECT or head.ctypes.data % _DIRECT_ALIGN:
        return 0, 0
    fn = _syscall()
    whole = head.nbytes - head.nbytes % _DIRECT_ALIGN
    if fn is None or _pages_cached(fn, fd, whole) != 0:  # (the last block, a save writes through the cache)
        return 0, 0
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT)
    except OSError:  # (a file system that takes no direct reads)
        return 0, 0
    try:
        done = crc = 0
        while done < whole:
            into = head[done : done + min(_DIRECT_READ, whole - done)]
            try:
                n = os.preadv(fd, [into.data], done)
            except OSError as e:
                if e.errno == errno.EINVAL and done == 0:  # (it opened, but takes no direct reads)
                    return 0, 0
                raise
            n -= n % _DIRECT_ALIGN  # (shorter than it was: the caller's read says so)
            if n == 0:
                break
            crc = crc32c(into[:n], crc)
            done += n
            if n < into.nbytes:
                break
        return done, crc
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


DIRECT_MIN_BYTES = 1 << 20
"""The smallest chunk file ``write_chunk(direct=True)`` writes around the page cache."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # (Linux and a few others; elsewhere every write is buffered)
_DIRECT_ALIGN = 4096  # what O_DIRECT asks of offsets, lengths and memory on every common device
_BOUNCE_BYTES = 2 << 20
_DIRECT_READ = 256 << 10  # bytes per direct read (see _read_direct)
_BOUNCE = threading.local()  # .buf: this I/O thread's page-aligned buffer for direct writes


def _write_direct(path: Path, raw: np.ndarray, pad: int, fsync: bool) -> int | None:
    """Write ``raw`` (flat uint8), ``pad`` zero bytes and their crc32c as a new file at ``path`` with
    ``O_DIRECT``; returns the crc32c, or None, with nothing written, where the file system refuses it.

    The bytes go from memory to the device without a copy in the page cache that the kernel
    then writes back: an asynchronous save's writer takes much less CPU from the training
    loop beside it (figures: ``ExecutorOptions.direct_io``). ``O_DIRECT`` wants aligned
    memory: where ``raw`` starts on a page (an asynchronous save's staging memory, a load's
    own) its whole blocks are written straight from it, in one call; the rest (all of it
    where ``raw`` does not start on a page, as a tensor's memory rarely does) passes through
    this thread's page-aligned buffer, 2 MiB at a time, its checksum computed there while the
    bytes are in the cache. The file's last part, shorter than a block, is written through
    the page cache, and ``fsync`` makes all of it durable.
    """
    try:
        fd = os.open(path, NEW_FILE | _O_DIRECT, 0o666)
    except OSError as e:
        if e.errno == errno.EINVAL:  # (tmpfs, some network and FUSE file systems)
            return None
        raise
    try:
        crc = offset = 0
        if raw.ctypes.data % _DIRECT_ALIGN == 0:
            whole = raw.nbytes - raw.nbytes % _DIRECT_ALIGN
            while offset < whole:
                block = raw[offset : offset + min(_MAX_IO, whole - offset)]
                crc = crc32c(block, crc)
                if not _pwrite_direct(fd, block, offset):
                    return None
                offset += block.nbytes
            raw = raw[whole:]
        buf = _bounce()
        filled = 0
        tail = np.zeros(4, dtype=np.uint8)  # (the crc32c, once the bytes before it are all counted)
        for part, zero in ((raw, False), (pad, True), (tail, False)):
            n = part if isinstance(part, int) else part.nbytes
            if part is tail:
                tail[:] = np.frombuffer(crc.to_bytes(4, "little"), dtype=np.uint8)
            done = 0
            while done < n:
                k = min(len(buf) - filled, n - done)
                into = buf[filled : filled + k]
                if zero:
                    into[:] = 0
                else:
                    into[:] = part[done : done + k]  # type: ignore[index]
                if part is not tail:
                    crc = crc32c(into, crc)
                filled, done = filled + k, done + k
                if filled == len(buf):
                    if not _pwrite_direct(fd, buf, offset):
                        return None
                    offset, filled = offset + filled, 0
        whole = filled - filled % _DIRECT_ALIGN
        if whole:
            if not _pwrite_direct(fd, buf[:whole], offset):
                return None
            offset += whole
        if filled > whole:
            _write_buffered(fd, buf[whole:filled], offset)
        if fsync:
            os.fsync(fd)
        return int(crc)
    finally:
        os.close(fd)


def _pwrite_direct(fd: int, block: np.ndarray, offset: int) -> bool:
    """Write an aligned block at an aligned offset; False if the file system refused the first one."""
    try:
        n = os.pwrite(fd, block.data, offset)
    except OSError as e:
        if e.errno == errno.EINVAL and offset == 0:  # (it opened, but takes no direct writes)
            return False
        raise
    if n < block.nbytes:  # (short: the rest through the page cache, at whatever alignment it is left)
        _write_buffered(fd, block[n:], offset + n)
    return True


def _write_buffered(fd: int, data: np.ndarray, offset: int) -> None:
    """Write ``data`` at ``offset`` through the page cache: ``O_DIRECT`` cleared from ``fd`` for good."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
    _write_all(fd, [data], offset)


def _bounce() -> np.ndarray:
    buf = getattr(_BOUNCE, "buf", None)
    if buf is None:
        buf = _BOUNCE.buf = np.frombuffer(mmap.mmap(-1, _BOUNCE_BYTES), dtype=np.uint8)  # (page-aligned)
    return buf  # type: ignore[no-any-return]


def _write_all(fd: int, parts: list[np.ndarray], offset: int = 0) -> None:
    for part in parts:
        done = 0
        while done < part.nbytes:
            n = os.pwrite(fd, part[done : done + _MAX_IO].data, offset)
            done += n
            offset += n


def read_chunk(
    path: Path,
    chunk_shape: Sequence[int],
    valid: Sequence[int],
    targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    what: str,
    *,
    dtype: np.dtype | None = None,
    expected: int | None = None,
    inside: str | None = None,
    direct: bool = False,
) -> None:
    """Read one chunk file once, check it, and put its elements ``box`` into ``dest``
    for every ``(box, dest)`` of ``targets`` (none: only check it).

    ``valid`` is the part of the chunk inside the array (less than ``chunk_shape`` at an
    edge); ``dtype`` the stored element type (the first target's when None). The file
    must be a regular file of exactly the chunk's size, end with the crc32c of the rest,
    and that crc32c must be ``expected``, the one the metadata records for this chunk
    (when it records one): a chunk moved, swapped or taken from another checkpoint is
    caught. A symbolic link is followed only inside the directory ``inside``. Where one
    target wants all of the chunk, laid out as one prefix of the file, into contiguous
    memory, the file is read into that memory (with ``direct``, around the page cache
    where the cache holds none of the file: :func:`_read_direct`); otherwise through a
    scratch buffer. ``what`` names the chunk in errors.
    """
    chunk = tuple(chunk_shape)
    if dtype is None:
        dtype = targets[0][1].dtype
    stored = math.prod(chunk) * dtype.itemsize
    try:
        fd, st = open_regular(path, inside, what)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{what} is missing: no file {path}") from None
    try:
        if st.st_size != stored + 4:
            raise CheckpointError(f"{what} is damaged: {path} holds {st.st_size} bytes, expected {stored + 4}")
        try:
            crc = _read_into(fd, chunk, valid, dtype, stored, targets, path, what, direct)
        except OSError as e:
            raise CheckpointError(f"{what}: cannot read {path}: {e.strerror or e}") from e
        if expected is not None and crc != expected:
            raise CheckpointError(
                f"{what} is not the chunk the metadata records: {path} holds a chunk with crc32c {crc:#010x}, "
                f"the metadata records {expected:#010x} (a chunk moved, swapped or replaced)"
            )
    finally:
        os.close(fd)


def _read_into(
    fd: int,
    chunk: tuple[int, ...],
    valid: Sequence[int],
    dtype: np.dtype,
    stored: int,
    targets: Sequence[tuple[tuple[slice, ...], np.ndarray]],
    path: Path,
    what: str,
    direct: bool = False,
) -> int:
    """Read and check the file's bytes, and fill the targets; returns the chunk's crc32c."""
    if len(targets) == 1:
        box, dest = targets[0]
        whole = tuple(b.start for b in box) == (0,) * len(chunk) and tuple(b.stop for b in box) == tuple(valid)
        if whole and dest.dtype == dtype and dest.flags.c_contiguous and _padded_tail(valid, chunk):
            head = _bytes_of(dest)
            tail = np.empty(stored + 4 - head.nbytes, dtype=np.uint8)
            done, crc = _read_direct(fd, head) if direct else (0, 0)
            _read_all(fd, [head[done:], tail], done)
            return _check(crc32c(tail[:-4], crc32c(head[done:], crc)), tail, path, what)
    scratch = np.empty(stored + 4, dtype=np.uint8)
    _read_all(fd, [scratch])
    crc = _check(crc32c(scratch[:stored]), scratch[stored:], path, what)
    elements = scratch[:stored].view(dtype).reshape(chunk)
    for box, dest in targets:
        dest[...] = elements[box]
    return int(crc)


def _check(crc: int, tail: np.ndarray, path: Path, what: str) -> int:
    """Compare a computed crc32c with the one stored in the last 4 bytes of ``tail``; returns it."""
    expected = int.from_bytes(tail[-4:].tobytes(), "little")
    if crc != expected:
        raise CheckpointError(
            f"{what} is damaged: {path} fails its checksum (crc32c stored {expected:#010x}, computed {crc:#010x})"
        )
    return int(crc)


def _read_all(fd: int, parts: list[np.ndarray], offset: int = 0) -> None:
    for part in parts:
        done = 0
        while done < part.nbytes:
            n = os.preadv(fd, [part[done : done + _MAX_IO].data], offset)
            if n == 0:
                raise OSError(f"unexpected end of file at byte {offset}")
            done += n
            offset += n
