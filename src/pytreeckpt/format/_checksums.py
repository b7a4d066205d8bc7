"""Where a document's chunk checksums go: in the document, or in a checksums file it names (:class:`ChecksumFile`)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.format._paths import CHECKSUMS_FILE

CHECKSUM_BLOCK = 1 << 20
"""A checksums file is read in blocks of this many bytes, each once, as the arrays read need them."""


class ChecksumFile:
    """The chunk checksums a document keeps in a file of their own (its ``checksums``): the file's
    path and size, and, once a storage attaches ``reader`` (``reader(path, start, stop)``: those
    bytes, or fewer where the file ends), its bytes as arrays need them, each block read once.

    A leaf names its part by offset and the crc32c of those bytes (``chunk_crc32c_at``), which
    :meth:`ArrayMeta.crc32c` checks: the file is trusted only through the document.
    """

    __slots__ = ("_blocks", "_lock", "path", "reader", "size")

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size
        self.reader: Callable[[str, int, int], bytes] | None = None
        self._blocks: dict[int, bytes] = {}
        self._lock = threading.Lock()

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "bytes": self.size}

    def read(self, start: int, stop: int, key: str) -> bytes:
        """Bytes ``start`` to ``stop`` of the file (within its recorded size), for leaf ``key``."""
        if self.reader is None:
            raise CheckpointError(f"leaf {key!r}: its chunk checksums are in {self.path!r}, which nothing reads here")
        if stop <= start:
            return b""
        first, last = start // CHECKSUM_BLOCK, (stop - 1) // CHECKSUM_BLOCK
        with self._lock:  # (the I/O threads of a load ask for arrays at once; each block is read once)
            missing = [b for b in range(first, last + 1) if b not in self._blocks]
            if missing:
                lo, hi = missing[0] * CHECKSUM_BLOCK, min((missing[-1] + 1) * CHECKSUM_BLOCK, self.size)
                raw = self.reader(self.path, lo, hi)
                if len(raw) != hi - lo:
                    raise CheckpointError(
                        f"leaf {key!r}: {self.path!r} ends at byte {lo + len(raw)}, the metadata records "
                        f"{self.size} bytes"
                    )
                for b in range(missing[0], missing[-1] + 1):
                    self._blocks.setdefault(b, raw[b * CHECKSUM_BLOCK - lo : (b + 1) * CHECKSUM_BLOCK - lo])
            parts = [self._blocks[b] for b in range(first, last + 1)]
        joined = parts[0] if len(parts) == 1 else b"".join(parts)
        base = first * CHECKSUM_BLOCK
        return joined[start - base : stop - base]


def pack_checksums(crcs: Sequence[bytes | None]) -> tuple[bytes, list[tuple[int, int] | None]]:
    """The bytes of a checksums file holding ``crcs`` (each array's chunk checksums, or None), and each
    array's ``(offset, crc32c of its part)`` there.

    >>> pack_checksums([bytes(4), None, bytes(8)])[1]
    [(0, 1214729159), None, (4, 2351477386)]
    """
    refs: list[tuple[int, int] | None] = []
    offset = 0
    for c in crcs:
        if c is None:
            refs.append(None)
            continue
        refs.append((offset, crc32c(c)))
        offset += len(c)
    return b"".join(c for c in crcs if c is not None), refs


def place_checksums(
    crcs: Sequence[bytes | None], limit: int, path: str = CHECKSUMS_FILE
) -> tuple[list[tuple[int, int] | None], ChecksumFile | None, bytes | None]:
    """Where a document's chunk checksums go: in the document (no refs, no file) while their base64
    is at most ``limit`` bytes, else in a checksums file at ``path``: each array's ``(offset, crc32c)``
    there, the file the document names, and its bytes."""
    # (most are 4 bytes, one chunk; counted in C when none is missing)
    known = cast("Sequence[bytes]", crcs) if None not in crcs else [c for c in crcs if c is not None]
    sizes = collections.Counter(map(len, known))
    inline = sum(crc32c_chars(size // 4) * count for size, count in sizes.items())
    if inline <= limit:
        return [None] * len(crcs), None, None
    blob, refs = pack_checksums(crcs)
    return refs, ChecksumFile(path, len(blob)), blob


def crc32c_chars(chunks: int) -> int:
    """The length of ``chunk_crc32c`` for a grid of ``chunks`` chunks: the base64 of 4 bytes per chunk, padded."""
    return 4 * -(-4 * chunks // 3)
