"""Packed arrays in zip archives: one directory of archives per writing rank (``StorageOptions(pack_format="zip")``).

The keys a packed array has in an OCDBT database (``arrays/<name>/zarr.json`` and its
chunk keys, the same bytes) are instead the entries of plain zip archives (stored, not
compressed) in ``packed/<rank>/<n>.zip``: TensorStore opens such an array through its
``zip`` key-value store and zarr-python through its ``ZipStore``, given the archive that
holds the array's ``zarr.json``: every entry of an array is in that one archive. A writer
appends entries to its archive as they come (one buffered file write per few MiB, not a
transaction per key); a reader keeps the archives open and reads an entry found through
their central directories with one ``pread``: no TensorStore future per key, which is most
of what reading 10,000 small arrays from OCDBT costs. An archive holds at most
``MAX_ENTRIES`` entries and ``MAX_BYTES`` bytes, so none needs ZIP64; the next one is begun
before an array whose entries would not fit.
"""

from __future__ import annotations

import os
import stat
import struct
import threading
import weakref
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.storage._chunkfiles import NEW_FILE, make_dirs

MAX_ENTRIES = 65_000
MAX_BYTES = (1 << 32) - (64 << 20)
_ZIP_ENTRIES, _ZIP_BYTES = 0xFFFF, 0xFFFFFFFF  # what a zip without ZIP64 can say
_BUFFER_BYTES = 4 << 20
_DIRECTORY_BLOCK = 1 << 20  # a central directory is read this many bytes at a time

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_END = struct.Struct("<IHHHHIIH")
_CENTRAL_FIELDS = struct.Struct("<I20xIHHH8xI")  # of a central entry: signature, size, name, extra and comment
# lengths, local header offset
assert _CENTRAL_FIELDS.size == _CENTRAL.size
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_VERSION = 20  # 2.0: stored entries, no ZIP64
_PAIR_HEAD = _LOCAL_SIG.to_bytes(4, "little")  # a local header's first bytes
_NO_EXTRA = bytes(2)  # a local header's last field: no extra field


def _headed(raw: bytes | memoryview, p: int, name: bytes) -> bool:
    """Whether a local header at byte ``p`` of ``raw`` names ``name`` and has no extra field (its name's length
    is the directory's): read together with its neighbours, an entry's value starts right after it."""
    return raw[p : p + 4] == _PAIR_HEAD and raw[p + 28 : p + 30 + len(name)] == _NO_EXTRA + name


_WINDOW_BYTES, _GAP_BYTES = 4 << 20, 64 << 10  # ArchiveReader.pairs: the most it reads at once, and skips
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01, the earliest a zip can say: the bytes do not depend on when


def archive_name(n: int) -> str:
    return f"{n}.zip"


def entry_bytes(key: str, size: int) -> int:
    """The bytes an entry of ``size`` bytes named ``key`` takes in an archive (its local header, name and value)."""
    return _LOCAL.size + len(key.encode()) + size


class _Archive:
    """An archive being written: its file, its entries so far, and what arrays begun in it still hold back."""

    __slots__ = ("buffer", "entries", "fd", "held_bytes", "held_entries", "n", "offset", "pending")

    def __init__(self, n: int, fd: int) -> None:
        self.n, self.fd = n, fd
        self.entries: list[tuple[bytes, int, int, int]] = []  # name, crc-32, size, offset of its local header
        self.offset = 0
        self.buffer = bytearray()
        self.held_entries = self.held_bytes = 0  # reserved by arrays begun here, not yet written
        self.pending = 0  # arrays begun here whose entries are not all written


class ArchiveWriter:
    """Appends entries to the archives of one directory, ``root / database``; thread-safe. :meth:`finish`
    writes their directories.

    Every entry of one array goes to one archive. An array whose entries come in separate
    calls (its ``zarr.json`` when it is created, its chunks as they are written) is begun
    with :meth:`reserve`, which places it, and its later entries go where it was placed; the
    entries of one :meth:`write_many` call without a reservation (or each group of
    :meth:`write_groups`) are one array's. An archive is completed once it is full and no
    array placed in it waits for entries.

    The directory and its parents below ``root`` are made without following a link, and an
    archive is never opened through one: a link there is a CheckpointError.
    """

    def __init__(self, root: Path, database: str) -> None:
        self.root, self.database = root, database
        self.folder = root / database
        self._lock = threading.Lock()
        self._n = -1
        self._current: _Archive | None = None
        self._open: list[_Archive] = []
        self._leaves: dict[str, list[Any]] = {}  # array path -> [its archive, entries and bytes it reserved, unwritten]

    def _begin(self) -> _Archive:
        self._n += 1
        make_dirs(self.root, self.folder, f"the packed archives {self.database!r}")
        path = self.folder / archive_name(self._n)
        fd = os.open(path, NEW_FILE, 0o666)  # (a link in its place is an error, never followed)
        archive = _Archive(self._n, fd)
        self._open.append(archive)
        return archive

    def _room(self, entries: int, nbytes: int) -> _Archive:
        """The archive for an array of ``entries`` entries of ``nbytes`` bytes: the open one if they fit, else a
        new one."""
        a = self._current
        if (
            a is None
            or len(a.entries) + a.held_entries + entries > MAX_ENTRIES
            or a.offset + a.held_bytes + nbytes > MAX_BYTES
        ):
            if a is not None and a.pending == 0 and a.entries:
                self._close(a)
            if a is None or a.entries or a.pending:  # (an empty archive takes an array however large)
                a = self._current = self._begin()
        return a

    def reserve(self, leaf: str, entries: int, nbytes: int) -> None:
        """Begin array ``leaf`` (its path), which will have ``entries`` entries taking at most ``nbytes`` bytes
        (see :func:`entry_bytes`): its entries, in whatever calls they come, all go to the archive chosen now."""
        with self._lock:
            a = self._room(entries, nbytes)
            a.held_entries += entries
            a.held_bytes += nbytes
            a.pending += 1
            self._leaves[leaf] = [a, entries, nbytes]

    def write(self, key: str, value: bytes, leaf: str | None = None) -> None:
        self.write_many(((key, value),), leaf)

    def write_many(self, items: Iterable[tuple[str, bytes]], leaf: str | None = None) -> None:
        """Append ``(key, value)`` entries, in order: entries of array ``leaf`` (begun with :meth:`reserve`), or,
        with no reservation, all of one array."""
        with self._lock:
            held = self._leaves.get(leaf) if leaf is not None else None
            if held is None:
                self._write_group(list(items))
                return
            a = held[0]
            for key, value in items:
                name = key.encode()
                record = _LOCAL.size + len(name) + len(value)
                if held[1] > 0:  # (what it reserved is now written)
                    held[1] -= 1
                    a.held_entries -= 1
                    taken = min(record, held[2])
                    held[2] -= taken
                    a.held_bytes -= taken
                self._append(a, name, value)
            if held[1] == 0:  # every entry the array reserved is written: its archive may be completed
                del self._leaves[leaf]  # type: ignore[arg-type]
                a.held_bytes -= held[2]
                a.pending -= 1
                if a.pending == 0 and a is not self._current:
                    self._close(a)

    def write_groups(self, groups: Iterable[Sequence[tuple[str, bytes]]]) -> None:
        """Append each group of ``(key, value)`` entries (all the entries of one array) to one archive."""
        with self._lock:
            for group in groups:
                self._write_group(group)

    def _write_group(self, group: Sequence[tuple[str, bytes]]) -> None:
        named = [(key.encode(), value) for key, value in group]
        a = self._room(len(named), sum(_LOCAL.size + len(name) + len(value) for name, value in named))
        for name, value in named:
            self._append(a, name, value)

    def _append(self, a: _Archive, name: bytes, value: bytes) -> None:
        size = len(value)
        record = _LOCAL.size + len(name) + size
        if len(a.entries) >= _ZIP_ENTRIES or a.offset + record > _ZIP_BYTES - (1 << 20):
            raise CheckpointError(
                f"the packed archive {self.folder / archive_name(a.n)} would hold more than a zip without ZIP64 can "
                f"(entry {name.decode()!r}): an array of more entries or bytes than an archive holds"
            )
        crc = zlib.crc32(value)
        a.buffer += _LOCAL.pack(_LOCAL_SIG, _VERSION, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), 0)
        a.buffer += name
        a.buffer += value
        a.entries.append((name, crc, size, a.offset))
        a.offset += record
        if len(a.buffer) >= _BUFFER_BYTES:
            self._flush(a)

    def _flush(self, a: _Archive) -> None:
        done = 0
        with memoryview(a.buffer) as whole:  # (every view released, even when a write fails)
            while done < len(whole):
                with whole[done:] as rest:
                    done += os.write(a.fd, rest)
        a.buffer.clear()

    def _close(self, a: _Archive) -> None:
        """An archive's central directory and end record; then it is closed."""
        start, mark = a.offset, len(a.buffer)  # (every entry is before the directory in the file)
        for name, crc, size, offset in a.entries:
            a.buffer += _CENTRAL.pack(
                _CENTRAL_SIG, _VERSION, _VERSION, 0, 0, 0, _DOS_DATE, crc, size, size, len(name), 0, 0, 0, 0, 0, offset
            )
            a.buffer += name
        size = len(a.buffer) - mark
        n = len(a.entries)
        a.buffer += _END.pack(_END_SIG, 0, 0, n, n, size, start, 0)
        self._open.remove(a)
        try:
            self._flush(a)
        finally:
            os.close(a.fd)
        if a is self._current:
            self._current = None

    def finish(self) -> None:
        """Complete the open archives (their files are made durable by the caller's sync)."""
        with self._lock:
            self._leaves.clear()
            for a in list(self._open):
                self._close(a)

    def abort(self) -> None:
        with self._lock:
            for a in self._open:
                os.close(a.fd)
                a.buffer = bytearray()
            self._open.clear()
            self._leaves.clear()
            self._current = None


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


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
    fds.clear()


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ArchiveReader:
    """The entries of one directory's archives, read from their open files (opened at the first read: a save's
    writers open the arrays they write before their archives exist).

    Entries are read with ``os.pread``, never through a memory map: an archive cut short or
    rewritten while it is read gives a short read or a changed file, said as a
    CheckpointError naming the archive (a map would have the process killed by SIGBUS).
    Nothing is allocated from a claim the file does not hold: the central directory must
    lie within the file and is read a block at a time, checked as it goes; an entry must
    lie before the directory, and a caller bounds the size it reads (``value(key, size)``).
    """

    def __init__(self, folder: Path, database: str) -> None:
        self.folder, self.database = folder, database
        self._index: dict[str, tuple[int, int, int]] = {}  # name -> (archive, local header offset, size)
        self._files: list[tuple[int, str, tuple[int, int, int, int]]] = []  # (fd, name, identity at open)
        self._fds: list[int] = []
        self._finalizer = weakref.finalize(self, _close_all, self._fds)
        self._lock = threading.Lock()
        self._loaded = False
        self._chunks: dict[str, int] | None = None  # "<array path>/c/" -> its chunk entries, counted once

    def close(self) -> None:
        self._finalizer()

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
                    self._open(name)
            self._loaded = True

    def _damaged(self, name: str, what: str) -> CheckpointError:
        return CheckpointError(f"the packed archive {self.database}/{name} is damaged: {what}")

    def _changed(self, at: int) -> CheckpointError:
        _, name, _ = self._files[at]
        return CheckpointError(
            f"the packed archive {self.database}/{name} changed while it was read (cut short, rewritten or "
            f"replaced in place): load it again once whatever writes it is done"
        )

    def _pread(self, at: int, size: int, offset: int) -> bytes:
        fd = self._files[at][0]
        try:
            got = os.pread(fd, size, offset)
        except OSError as e:
            raise CheckpointError(f"cannot read the packed archive {self.database}/{self._files[at][1]}: {e}") from e
        if len(got) != size:
            raise self._changed(at)
        return got

    def _open(self, name: str) -> None:
        path = self.folder / name
        try:  # (O_NONBLOCK: a FIFO put there is refused below, not waited on)
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise CheckpointError(f"cannot open the packed archive {self.database}/{name}: {e}") from e
        self._fds.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise self._damaged(name, "it is not a regular file")
        at = len(self._files)
        self._files.append((fd, name, _identity(st)))
        size = st.st_size
        if size < _END.size:
            raise self._damaged(name, f"it holds {size} bytes, less than a zip's end record")
        sig, _, _, _, n, cd_size, cd_start, comment = _END.unpack(self._pread(at, _END.size, size - _END.size))
        if sig != _END_SIG or comment != 0 or cd_start + cd_size != size - _END.size:
            raise self._damaged(name, "no end record where this library writes it (a truncated or foreign file)")
        index = self._index
        head, unpack = _CENTRAL.size, _CENTRAL_FIELDS.unpack_from
        block, p, read, left = b"", 0, 0, n  # the directory's bytes from ``read - len(block)``; ``p``: in ``block``
        while left:
            # A block at a time, each checked as it is parsed: a directory claimed over holes fails at its first
            # entry, not after its claimed size is allocated.
            more = min(_DIRECTORY_BLOCK, cd_size - read)
            block = block[p:] + self._pread(at, more, cd_start + read)
            read += more
            p = 0
            stop = len(block) - (head + 3 * 0xFFFF) if read < cd_size else len(block) - head  # (an entry's most)
            if p > stop:
                raise self._damaged(name, "its central directory is shorter than it says")
            while left and p <= stop:
                sig, entry_size, name_len, extra_len, comment_len, offset = unpack(block, p)
                if sig != _CENTRAL_SIG:
                    raise self._damaged(name, f"no central directory entry at byte {cd_start + read - len(block) + p}")
                if p + head + name_len > len(block):
                    raise self._damaged(name, "its central directory is shorter than it says")
                key = block[p + head : p + head + name_len].decode("utf-8", "replace")
                if offset + _LOCAL.size + name_len + entry_size > cd_start:
                    raise self._damaged(name, f"entry {key!r} runs past the entries")
                index[key] = (at, offset, entry_size)
                p += head + name_len + extra_len + comment_len
                left -= 1
            if left and read >= cd_size and p > stop:
                raise self._damaged(name, "its central directory is shorter than it says")
        if read - len(block) + p != cd_size:  # (a claim of more is not read, nor allocated)
            raise self._damaged(
                name, f"its central directory of {n} entries takes {read - len(block) + p} bytes, it says {cd_size}"
            )

    def read(self, key: str, size: int | None = None) -> _Read:
        """Key ``key``'s value, as TensorStore's key-value stores give it (a future of a read result)."""
        return _Read(self.value(key, size))

    def size(self, key: str) -> int | None:
        """Entry ``key``'s size as its archive's directory says, or None if no archive holds it."""
        if not self._loaded:
            self._load()
        got = self._index.get(key)
        return None if got is None else got[2]

    def value(self, key: str, size: int | None = None, *, limit: int | None = None, check: bool = True) -> bytes | None:
        """Entry ``key``'s bytes, or None if no archive holds it; CheckpointError if its header is damaged,
        if it does not hold ``size`` bytes or holds more than ``limit`` (when given: nothing of another size
        is read), or if its archive changed since it was opened (with ``check``; else the caller asks
        :meth:`check_unchanged`)."""
        if not self._loaded:
            self._load()
        got = self._index.get(key)
        if got is None:
            return None
        at, offset, stored = got
        if (size is not None and stored != size) or (limit is not None and stored > limit):
            expected = size if size is not None else f"at most {limit}"
            raise CheckpointError(
                f"the packed archive entry {key!r} in {self.database!r} holds {stored} bytes, expected {expected} "
                f"(a damaged or replaced entry)"
            )
        name = key.encode()
        start = _LOCAL.size + len(name)
        raw = self._pread(at, start + stored, offset)
        header = _LOCAL.unpack_from(raw)
        if header[0] != _LOCAL_SIG or raw[_LOCAL.size : start] != name:
            raise CheckpointError(
                f"the packed archive entry {key!r} in {self.database!r} is damaged: its header does not name it"
            )
        value = raw[start:] if not header[10] else self._pread(at, stored, offset + start + header[10])
        if check:
            self.check_unchanged(at)
        return value

    def run(self, keys: Sequence[str], size: int) -> list[memoryview] | None:
        """Entries ``keys``, each of ``size`` bytes, read with one ``pread`` where they lie one after another in one
        archive, as a writer appends an array's chunks, their headers naming them and having no extra field; None
        otherwise (the caller reads them with :meth:`value`, which says what is wrong). The archive must not have
        changed since it was opened."""
        if not self._loaded:
            self._load()
        index = self._index
        first = index.get(keys[0]) if keys else None
        if first is None or len(keys) > _WINDOW_BYTES // max(size, 1):
            return None
        at, low, high = first[0], first[1], first[1]
        names = []
        for key in keys:
            got = index.get(key)
            name = key.encode()
            if got is None or got[0] != at or got[1] != high or got[2] != size:
                return None
            names.append(name)
            high += 30 + len(name) + size  # (30: a local header's size)
        raw = memoryview(self._pread(at, high - low, low))
        out = []
        p = 0
        for name in names:
            start = p + 30 + len(name)
            if not _headed(raw, p, name):
                return None
            out.append(raw[start : start + size])
            p = start + size
        self.check_unchanged(at)
        return out

    def pairs(self, wanted: Sequence[tuple[str, str, int]], limit: int) -> list[tuple[bytes, bytes] | None]:
        """For each ``(first, second, size)``: ``(value(first, limit=limit), value(second, size))`` where the
        second entry follows the first in their archive (as a small array's ``zarr.json`` and chunk do), their
        headers name them and have no extra field; else None (the caller reads them with :meth:`value`, which
        says what is wrong). Entries near each other are read together, at most ``_WINDOW_BYTES`` at a time:
        a few reads for thousands of small arrays. Changes are not checked (see :meth:`check_unchanged`)."""
        if not self._loaded:
            self._load()
        index = self._index
        out: list[tuple[bytes, bytes] | None] = [None] * len(wanted)
        window: list[tuple[int, int, int, int, bytes, bytes]] = []  # (k, start, stored, size, names) to read together
        at = low = high = -1
        for k, (first, second, size) in enumerate(wanted):
            one, two = index.get(first), index.get(second)
            if one is None or two is None or one[0] != two[0] or two[2] != size or one[2] > limit:
                continue
            name1, name2 = first.encode(), second.encode()
            start, stored = one[1], one[2]
            end1 = start + 30 + len(name1) + stored  # (30: a local header's size)
            if two[1] != end1:
                continue
            end = end1 + 30 + len(name2) + size
            if one[0] != at or start < high or start - high > _GAP_BYTES or end - low > _WINDOW_BYTES:
                if window:
                    self._read_window(at, low, high, window, out)
                window = []
                at, low = one[0], start
            high = end
            window.append((k, start, stored, size, name1, name2))
        if window:
            self._read_window(at, low, high, window, out)
        return out

    def _read_window(
        self,
        at: int,
        low: int,
        high: int,
        window: list[tuple[int, int, int, int, bytes, bytes]],
        out: list[tuple[bytes, bytes] | None],
    ) -> None:
        """Read bytes ``low`` to ``high`` of archive ``at`` and the pairs of entries in them (see :meth:`pairs`)."""
        raw = self._pread(at, high - low, low)
        for k, start, stored, size, name1, name2 in window:
            p = start - low
            start1 = p + 30 + len(name1)
            end1 = start1 + stored
            start2 = end1 + 30 + len(name2)
            if _headed(raw, p, name1) and _headed(raw, end1, name2):
                out[k] = (raw[start1:end1], raw[start2 : start2 + size])

    def check_unchanged(self, at: int | None = None) -> None:
        """CheckpointError if an archive (archive ``at``; None: every one) changed since it was opened."""
        for k, (fd, _, identity) in enumerate(self._files):
            if (at is None or k == at) and _identity(os.fstat(fd)) != identity:
                raise self._changed(k)

    def chunk_entries(self, array: str) -> int:
        """How many chunk entries (``<array>/c/...``) the archives hold for the array at path ``array``.

        Counted for every array in one pass over the index, the first time it is asked, so asking
        it of each of a checkpoint's arrays is linear in the entries, not their product.
        """
        if not self._loaded:
            self._load()
        counts = self._chunks
        if counts is None:
            with self._lock:
                counts = {}
                for key in self._index:  # ("arrays/<name>/c/...": a name holds no "/")
                    at = key.find("/", key.find("/") + 1)
                    if at > 0 and key.startswith("/c/", at):
                        head = key[:at]
                        counts[head] = counts.get(head, 0) + 1
                self._chunks = counts
        return counts.get(array, 0)


__all__ = ["MAX_BYTES", "MAX_ENTRIES", "ArchiveReader", "ArchiveWriter", "archive_name", "entry_bytes"]
