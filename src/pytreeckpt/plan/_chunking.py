"""Chunk shapes: how a stored array is cut into chunks, from its shape and every piece boundary.

Small arrays are one chunk. Larger ones get the coarsest grid aligned with every piece
boundary (so each rank writes whole chunks of its own), split to at most
``max_chunk_bytes``; if that grid is finer than ``min_chunk_bytes``, a regular grid that
ignores piece boundaries is used instead, and chunks straddling pieces are merged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ._memos import CHUNK_CUTS
from ._tables import PieceTable
from ._types import ChunkingOptions

__all__ = ["chunk_shape_from_cuts", "chunk_shape_of_table"]


def chunk_shape_of_table(
    table: PieceTable, shape: tuple[int, ...], itemsize: int, options: ChunkingOptions
) -> tuple[int, ...]:
    """The chunk shape of an array laid out as ``table``: per dim, the gcd of the piece boundaries inside it."""
    got = CHUNK_CUTS.get(id(table))
    if got is None or got[0] is not table:  # (an id reused after its table was dropped: made anew)
        cuts = []
        for d, n in enumerate(shape):
            edges = np.concatenate([table.lo[:, d], table.lo[:, d] + table.ext[:, d]])
            edges = edges[(edges > 0) & (edges < n)]
            cuts.append(int(np.gcd.reduce(edges)) if len(edges) else 0)
        if len(CHUNK_CUTS) >= CHUNK_CUTS.limit:
            CHUNK_CUTS.clear()
        got = CHUNK_CUTS[id(table)] = (table, cuts)  # (the element sizes of a table's arrays share its cuts)
    return chunk_shape_from_cuts(shape, itemsize, got[1], options)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            if i <= limit:
                best = max(best, i)
            if n // i <= limit:
                best = max(best, n // i)
        i += 1
    return best


def _cap(chunk: list[int], itemsize: int, max_bytes: int, divides: Sequence[bool]) -> tuple[int, ...]:
    """``chunk`` cut down, outermost dim first, to at most ``max_bytes``; a dim of ``divides`` to a divisor
    of its extent (a cut between pieces must stay a chunk boundary), any other to the most that fits."""
    for d in range(len(chunk)):
        inner = math.prod(chunk[d + 1 :]) * itemsize
        if chunk[d] * inner <= max_bytes:
            break
        target = max(1, max_bytes // max(inner, 1))
        chunk[d] = _largest_divisor_at_most(chunk[d], target) if divides[d] else min(chunk[d], target)
    return tuple(chunk)


def chunk_shape_from_cuts(
    shape: tuple[int, ...], itemsize: int, cuts: Sequence[int], options: ChunkingOptions
) -> tuple[int, ...]:
    """The chunk shape given, per dim, the gcd of the piece boundaries strictly inside the array (0: none).

    >>> chunk_shape_from_cuts((1024, 1024), 4, [256, 0], ChunkingOptions())
    (256, 1024)
    """
    if any(s == 0 for s in shape):
        return tuple(max(1, s) for s in shape)
    if math.prod(shape) * itemsize <= options.single_chunk_bytes:
        return shape
    aligned = [g if g else s for g, s in zip(cuts, shape, strict=True)]
    if math.prod(aligned) * itemsize >= options.min_chunk_bytes:
        # Only the cuts between pieces must stay chunk boundaries: a dim without one is cut
        # anywhere (the last chunk runs past the edge), so a prime extent is not cut into
        # chunks of one element. Where a cut's divisors force chunks below the minimum,
        # the regular grid serves better.
        chunk = _cap(aligned, itemsize, options.max_chunk_bytes, [bool(g) for g in cuts])
        if math.prod(chunk) * itemsize >= options.min_chunk_bytes:
            return chunk
    return _cap(list(shape), itemsize, options.max_chunk_bytes, [False] * len(shape))
