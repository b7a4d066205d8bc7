"""The files an import reads and an export writes, opened as the storage layer opens a checkpoint's own.

A file read is opened by :func:`pytreeckpt.storage.open_regular`: without blocking (a
FIFO, device, socket or directory is refused, never waited on) and without following a
symbolic link that leads out of its directory. It is read with ``pread`` into memory of
the size asked for, never mapped: a file cut short while it is read is a CheckpointError
naming it, never a SIGBUS. A file written is made exclusively (``O_CREAT | O_EXCL |
O_NOFOLLOW``): whatever an earlier run left at its name, a symbolic link above all, is
removed as itself first, never written through; a directory there is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.storage import open_regular

__all__ = ["create_new", "make_dir", "open_source", "read_exactly", "read_into", "remove_file"]

_MAX_IO = 1 << 30  # bytes per system call (Linux moves at most about 2 GiB in one)
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def open_source(path: Path, inside: str | None, what: str) -> tuple[int, os.stat_result]:
    """``path`` opened for reading, with its ``fstat``: a regular file, or a link to one inside the directory
    ``inside`` (a real path; None: no link is followed). CheckpointError naming ``what`` and the path otherwise,
    a missing file included."""
    try:
        return open_regular(path, inside, what)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{what}: {path} is missing") from None


def read_into(fd: int, buf: memoryview, offset: int, path: Path, what: str) -> None:
    """Fill ``buf`` (bytes) from the file open as ``fd``, from ``offset``; CheckpointError naming ``what`` and the
    file where it ends first (it shrank, or was cut short while read)."""
    got, n = 0, len(buf)
    while got < n:
        try:
            k = os.preadv(fd, [buf[got : got + min(n - got, _MAX_IO)]], offset + got)
        except OSError as e:
            raise CheckpointError(f"{what}: cannot read {path}: {e.strerror or e}") from e
        if k <= 0:
            size = os.fstat(fd).st_size
            raise CheckpointError(
                f"{what}: {path} holds {size} bytes now, not the {offset + n} read from it (it shrank while it "
                f"was read)"
            )
        got += k


def read_exactly(fd: int, nbytes: int, offset: int, path: Path, what: str) -> bytearray:
    """``nbytes`` bytes of the file open as ``fd`` from ``offset`` (see :func:`read_into`)."""
    buf = bytearray(nbytes)
    read_into(fd, memoryview(buf), offset, path, what)
    return buf


def remove_file(path: Path, what: str) -> None:
    """Remove ``path`` as itself (a symbolic link is removed, never followed); missing is no error, a directory
    is refused (CheckpointError naming ``what`` and the path)."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise CheckpointError(f"{what}: {path} is a directory, not a file this writes; refusing to remove it")
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise CheckpointError(f"{what}: cannot remove {path}: {e.strerror or e}") from e


def create_new(path: Path, what: str) -> int:
    """A descriptor of ``path``, made new and empty for writing: what was there (a file or link a killed run left,
    or one planted) is removed as itself first, and the file is created exclusively, so nothing is written through
    a link. CheckpointError naming ``what`` and the path where that fails (a directory there, another writer)."""
    for attempt in range(2):
        try:
            return os.open(path, _NEW, 0o666)  # (less the umask)
        except FileExistsError:
            if attempt:
                raise CheckpointError(f"{what}: {path} was made again while this wrote it (another writer?)") from None
            remove_file(path, what)
        except OSError as e:
            raise CheckpointError(f"{what}: cannot create {path}: {e.strerror or e}") from e
    raise AssertionError("unreachable")


def make_dir(path: Path, what: str) -> None:
    """Make the directory ``path`` (and its parents) if missing; CheckpointError naming ``what`` if something else
    is there (a link to a directory is one: the caller named it)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise CheckpointError(f"{what}: {path} exists and is not a directory") from None
    except OSError as e:
        raise CheckpointError(f"{what}: cannot make the directory {path}: {e.strerror or e}") from e
