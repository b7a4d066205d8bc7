"""The chunk grid: every piece of chunk arithmetic in one place (a chunk's key in a store is the storage layer's).

A stored array of ``shape`` is cut into chunks of ``chunk`` elements along each dim
(edge chunks are smaller). The grid answers which chunks a box touches or holds whole,
where a chunk lies, whether a box is whole chunks. Work is bounded by the number of
chunks involved, never by a product over dims: a 32-dim array of one chunk costs one
chunk.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeckpt.core._region import Bounds, Region
from pytreeckpt.core._rows import rows_prod

__all__ = ["ChunkGrid", "coalesce"]

_I64 = np.int64


@dataclass(frozen=True, slots=True)
class ChunkGrid:
    """A regular grid of chunks over an array.

    >>> g = ChunkGrid((10, 4), (4, 4))
    >>> g.grid, g.count
    ((3, 1), 3)
    >>> g.region((2, 0))
    Region(offset=(8, 0), shape=(2, 4))
    >>> list(g.touching(Region((3, 1), (2, 2))))
    [(0, 0), (1, 0)]
    """

    shape: tuple[int, ...]
    chunk: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.chunk) or any(c < 1 for c in self.chunk):
            raise ValueError(f"chunk shape {self.chunk} does not fit array shape {self.shape}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def grid(self) -> tuple[int, ...]:
        """Chunks along each dim (0 along a dim of size 0)."""
        return tuple(-(-s // c) for s, c in zip(self.shape, self.chunk, strict=True))

    @property
    def count(self) -> int:
        """The number of chunks: 1 for a 0-d array, 0 for a zero-size one."""
        return math.prod(self.grid)

    def region(self, index: Sequence[int]) -> Region:
        """The elements of chunk ``index``."""
        offset = tuple(i * c for i, c in zip(index, self.chunk, strict=True))
        extent = tuple(min(c, s - o) for o, c, s in zip(offset, self.chunk, self.shape, strict=True))
        return Region(offset, extent)

    def touching(self, region: Region) -> Iterator[tuple[int, ...]]:
        """Indices of the chunks ``region`` touches, in row-major order (none for an empty region)."""
        if region.is_empty:
            return iter(())
        lo = tuple(o // c for o, c in zip(region.offset, self.chunk, strict=True))
        hi = tuple((o + s - 1) // c + 1 for o, s, c in zip(region.offset, region.shape, self.chunk, strict=True))
        return self.indices(lo, hi)

    def indices(self, lo: Sequence[int], hi: Sequence[int]) -> Iterator[tuple[int, ...]]:
        """Every index of the box ``[lo, hi)`` of chunk indices, in row-major order."""
        if any(b <= a for a, b in zip(lo, hi, strict=True)):
            return
        index = list(lo)
        nd = len(index)
        while True:
            yield tuple(index)
            d = nd - 1
            while d >= 0:
                index[d] += 1
                if index[d] < hi[d]:
                    break
                index[d] = lo[d]
                d -= 1
            if d < 0:
                return

    def unflat(self, flat: int) -> tuple[int, ...]:
        out = []
        for g in reversed(self.grid):
            flat, i = divmod(flat, g)
            out.append(i)
        return tuple(reversed(out))

    def is_whole(self, region: Region) -> bool:
        """True when ``region`` is a union of whole chunks (edge chunks end at the array's edge)."""
        return all(
            o % c == 0 and ((o + s) % c == 0 or o + s == n)
            for o, s, c, n in zip(region.offset, region.shape, self.chunk, self.shape, strict=True)
        )

    # ------------------------------------------------------------------ columns
    def contained(self, lo: np.ndarray, ext: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For boxes ``lo``/``ext`` ((n, ndim) columns), the box ``[clo, chi)`` of chunks each holds whole.

        A chunk at the array's edge counts as whole when the box reaches the edge.
        Rows holding no whole chunk get ``chi == clo`` along some dim.
        """
        c = np.asarray(self.chunk, dtype=_I64)
        n = np.asarray(self.shape, dtype=_I64)
        end = lo + ext
        clo = -(-lo // c)
        chi = np.where(end < n, end // c, -(-n // c))
        return clo, np.maximum(clo, chi)

    def touched(self, lo: np.ndarray, ext: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For boxes ``lo``/``ext`` ((n, ndim) columns), the box ``[tlo, thi)`` of chunks each touches.

        An empty box touches none (``thi == tlo`` along its empty dims), so :meth:`cells` of
        the result are the chunks the boxes touch.

        >>> tlo, thi = ChunkGrid((10, 4), (4, 4)).touched(np.array([[3, 0], [5, 1]]), np.array([[2, 4], [0, 2]]))
        >>> tlo.tolist(), thi.tolist()
        ([[0, 0], [1, 0]], [[2, 1], [1, 1]])
        """
        c = np.asarray(self.chunk, dtype=_I64)
        tlo = lo // c
        return tlo, np.where(ext > 0, (lo + ext - 1) // c + 1, tlo)

    def cells(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every chunk of each chunk-index box ``[lo, hi)``: (box row, flat chunk index), row-major per box."""
        nd = self.ndim
        span = np.maximum(hi - lo, 0)
        counts = rows_prod(span) if nd else np.ones(len(lo), dtype=_I64)
        box = np.repeat(np.arange(len(lo), dtype=_I64), counts)
        local = np.arange(len(box), dtype=_I64) - np.repeat(np.cumsum(counts) - counts, counts)
        flat = np.zeros(len(box), dtype=_I64)
        stride = 1
        grid = self.grid
        rem = local
        for d in reversed(range(nd)):
            s = span[box, d]
            flat += (rem % s + lo[box, d]) * stride
            rem = rem // s
            stride *= grid[d]
        return box, flat

    def unflat_columns(self, flat: np.ndarray) -> np.ndarray:
        """Chunk indices (an (n, ndim) column) of flat positions."""
        out = np.zeros((len(flat), self.ndim), dtype=_I64)
        rem = np.asarray(flat, dtype=_I64)
        for d in reversed(range(self.ndim)):
            g = self.grid[d]
            out[:, d] = rem % g
            rem = rem // g
        return out


def coalesce(indices: Sequence[tuple[int, ...]]) -> list[Bounds]:
    """Merge a set of chunk indices into boxes ``(lo, hi)`` of the chunk index space, sorted.

    Boxes are merged along the last dim first, then the ones before it.

    >>> coalesce([(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)])
    [((0, 0), (2, 2)), ((2, 0), (3, 1))]
    """
    boxes: list[Bounds] = [(idx, tuple(i + 1 for i in idx)) for idx in sorted(indices)]
    ndim = len(indices[0]) if indices else 0
    for d in reversed(range(ndim)):

        def other(b: Bounds, d: int = d) -> tuple[Any, ...]:
            return (b[0][:d] + b[0][d + 1 :], b[1][:d] + b[1][d + 1 :])

        boxes.sort(key=lambda b, d=d: (other(b), b[0][d]))  # type: ignore[misc]
        merged: list[Bounds] = []
        for b in boxes:
            if merged and other(merged[-1]) == other(b) and merged[-1][1][d] == b[0][d]:
                lo, hi = merged[-1]
                merged[-1] = (lo, (*hi[:d], b[1][d], *hi[d + 1 :]))
            else:
                merged.append(b)
        boxes = merged
    boxes.sort()
    return boxes
