"""crc32c, the checksum of every stored chunk, computed without holding the GIL on large buffers.

Chunks are checksummed as numpy views of the caller's (or the staging pool's) memory.
``crc32c`` (the package numcodecs uses for zarr's crc32c codec) releases the GIL for any
buffer of 32 KiB or more, and is about 3.5 times as fast on them here (16 MiB: 1 ms against
3.4 ms); google_crc32c releases it only for ``bytes`` objects, so every chunk's checksum
held it, and a training loop beside an asynchronous save waited at each torch call that
let the GIL go for a writer thread's checksum to end.
"""

from __future__ import annotations

from typing import Any

import crc32c as _crc32c

__all__ = ["crc32c"]


def crc32c(data: Any, value: int = 0) -> int:
    """The crc32c of a C-contiguous buffer (bytes, bytearray, memoryview, numpy array), continuing from ``value``.

    >>> hex(crc32c(b"123456789"))
    '0xe3069283'
    >>> crc32c(b"6789", crc32c(b"12345")) == crc32c(b"123456789")
    True
    """
    return int(_crc32c.crc32c(data, value))
