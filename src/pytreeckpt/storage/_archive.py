"""Packed arrays in zip archives: one directory of archives per writing rank (``StorageOptions(pack_format="zip")``).

The keys a packed array has in an OCDBT database (``arrays/<name>/zarr.json`` and its
chunk keys, the same bytes) are instead the entries of plain zip archives (stored, not
compressed) in ``packed/<rank>/<n>.zip``: TensorStore opens such an array through its
``zip`` key-value store and zarr-python through its ``ZipStore``. A writer appends entries
to its archive as they come (one buffered file write per few MiB, not a transaction per
key); a reader maps the archives and finds an entry through their central directories:
no TensorStore future per key, which is most of what reading 10,000 small arrays from
OCDBT costs. An archive holds at most ``MAX_ENTRIES`` entries and ``MAX_BYTES`` bytes, so
none needs ZIP64; the next one is begun when it is full.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.storage._chunkfiles import make_dirs

MAX_ENTRIES = 65_000
MAX_BYTES = (1 << 32) - (64 << 20)
_BUFFER_BYTES = 4 << 20

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_CENTRAL_FIELDS = struct.Struct("<I20xIHHH8xI")  # of a central entry: signature, size, name, extra and comment
# lengths, local header offset
assert _CENTRAL_FIELDS.size == _CENTRAL.size
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_VERSION = 20  # 2.0: stored entries, no ZIP64
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the earliest a zip can say: the bytes do not depend on when


def archive_name(n: int) -> str:
    return f"{n}.zip"


class ArchiveWriter:
    """Appends entries to the archives of one directory, ``root / database``; thread-safe. :meth:`finish`
    writes their directories.

    The directory and its parents below ``root`` are made without following a link, and an
    archive is never opened through one: a link there is a CheckpointError.
    """

    def __init__(self, root: Path, database: str) -> None:
        self.root, self.database = root, database
        self.folder = root / database
        self._lock = threading.Lock()
        self._n = -1
        self._fd: int | None = None
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, crc-32, size, offset of its local header
        self._offset = 0
        self._buffer = bytearray()

    def _begin(self) -> None:
        self._n += 1
        make_dirs(self.root, self.folder, f"the packed archives {self.database!r}")
        path = self.folder / archive_name(self._n)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        self._entries, self._offset = [], 0

    def write(self, key: str, value: bytes) -> None:
        self.write_many(((key, value),))

    def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
        """Append ``(key, value)`` entries, in order."""
        with self._lock:
            buffer, entries, pack = self._buffer, self._entries, _LOCAL.pack
            for key, value in items:
                name = key.encode()
                size = len(value)
                record = _LOCAL.size + len(name) + size
                if self._fd is None or len(entries) >= MAX_ENTRIES or self._offset + record > MAX_BYTES:
                    if self._fd is not None:
                        self._close()
                    self._begin()
                    entries = self._entries
                crc = zlib.crc32(value)
                buffer += pack(_LOCAL_SIG, _VERSION, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), 0)
                buffer += name
                buffer += value
                entries.append((name, crc, size, self._offset))
                self._offset += record
                if len(buffer) >= _BUFFER_BYTES:
                    self._flush()

    def _flush(self) -> None:
        assert self._fd is not None
        done = 0
        with memoryview(self._buffer) as whole:  # (every view released, even when a write fails)
            while done < len(whole):
                with whole[done:] as rest:
                    done += os.write(self._fd, rest)
        self._buffer.clear()

    def _close(self) -> None:
        """The open archive's central directory and end record; then it is closed."""
        start, mark = self._offset, len(self._buffer)  # (every entry is before the directory in the file)
        for name, crc, size, offset in self._entries:
            self._buffer += _CENTRAL.pack(
                _CENTRAL_SIG, _VERSION, _VERSION, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), 0, 0, 0, 0, 0, offset
            )
            self._buffer += name
        size = len(self._buffer) - mark
        n = len(self._entries)
        self._buffer += _END.pack(_END_SIG, 0, 0, n, n, size, start, 0)
        self._flush()
        assert self._fd is not None
        os.close(self._fd)
        self._fd = None

    def finish(self) -> None:
        """Complete the open archive (its files are made durable by the caller's sync)."""
        with self._lock:
            if self._fd is not None:
                self._close()

    def abort(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            self._buffer = bytearray()


class _Read:
    """A finished key read, shaped as TensorStore's (``state``, ``value``), and as its future."""

    __slots__ = ("state", "value")

    def __init__(self, value: bytes | None) -> None:
        self.state = "missing" if value is None else "value"
        self.value = b"" if value is None else value

    def result(self) -> _Read:
        return self

    def add_done_callback(self, fn: Any) -> None:
        fn(self)


class ArchiveReader:
    """The entries of one directory's archives, read from their mapped files (opened at the first read:
    a save's writers open the arrays they write before their archives exist)."""

    def __init__(self, folder: Path, database: str) -> None:
        self.folder, self.database = folder, database
        self._index: dict[str, tuple[mmap.mmap, int, int]] = {}  # name -> (archive, local header offset, size)
        self._lock = threading.Lock()
        self._loaded = False

    def _load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            try:
                names = sorted(os.listdir(self.folder))
            except OSError as e:
                raise CheckpointError(f"cannot list the packed archives of {self.database!r}: {e}") from e
            for name in names:
                if name.endswith(".zip"):
                    self._open(self.folder / name)
            self._loaded = True

    def _damaged(self, path: Path, what: str) -> CheckpointError:
        return CheckpointError(f"the packed archive {self.database}/{path.name} is damaged: {what}")

    def _open(self, path: Path) -> None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _END.size:
                raise self._damaged(path, f"it holds {size} bytes, less than a zip's end record")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        sig, _, _, _, n, cd_size, cd_start, comment = _END.unpack_from(mm, size - _END.size)
        if sig != _END_SIG or comment != 0 or cd_start + cd_size != size - _END.size:
            raise self._damaged(path, "no end record where this library writes it (a truncated or foreign file)")
        cd = mm[cd_start : cd_start + cd_size]  # (parsed from a copy: slices of bytes are cheaper than of a map)
        p = 0
        index = self._index
        head, unpack = _CENTRAL.size, _CENTRAL_FIELDS.unpack_from
        for _ in range(n):
            if p + head > cd_size:
                raise self._damaged(path, "its central directory is shorter than it says")
            sig, entry_size, name_len, extra_len, comment_len, offset = unpack(cd, p)
            if sig != _CENTRAL_SIG:
                raise self._damaged(path, f"no central directory entry at byte {cd_start + p}")
            name = cd[p + head : p + head + name_len].decode("utf-8", "replace")
            if offset + _LOCAL.size + name_len + entry_size > cd_start:
                raise self._damaged(path, f"entry {name!r} runs past the entries")
            index[name] = (mm, offset, entry_size)
            p += head + name_len + extra_len + comment_len

    def read(self, key: str) -> _Read:
        """Key ``key``'s value, as TensorStore's key-value stores give it (a future of a read result)."""
        return _Read(self.value(key))

    def value(self, key: str) -> bytes | None:
        """Entry ``key``'s bytes, or None if no archive holds it; CheckpointError if its header is damaged."""
        if not self._loaded:
            self._load()
        got = self._index.get(key)
        if got is None:
            return None
        mm, offset, size = got
        name = key.encode()
        header = _LOCAL.unpack_from(mm, offset)
        start = offset + _LOCAL.size
        if header[0] != _LOCAL_SIG or mm[start : start + len(name)] != name:
            raise CheckpointError(
                f"the packed archive entry {key!r} in {self.database!r} is damaged: its header does not name it"
            )
        start += len(name) + header[10]  # (after the name, the local header's extra field)
        return mm[start : start + size]

    def keys(self, prefix: str) -> list[str]:
        if not self._loaded:
            self._load()
        return [k for k in self._index if k.startswith(prefix)]


__all__ = ["MAX_BYTES", "MAX_ENTRIES", "ArchiveReader", "ArchiveWriter", "archive_name"]
