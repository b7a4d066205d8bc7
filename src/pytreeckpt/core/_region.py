"""Boxes of an N-dimensional index space: the one region type of pytreeckpt.

A :class:`Region` is an ``(offset, shape)`` box. Saving, loading and resharding all
reduce to intersecting regions, so the same type describes a rank's shard, a stored
chunk and a read. Two other spellings of a box exist where planning's inner loops need
them, each defined once: :data:`Bounds` (``(lo, hi)`` tuples, :meth:`Region.bounds`), and
columns of many boxes (``lo`` and ``ext`` numpy arrays: ``plan``'s piece tables and
:class:`~pytreeckpt.core._grid.ChunkGrid`'s column methods). ``Region.slices()`` is how
numpy is indexed with one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pytreeckpt.core._slots import slots_constructor

__all__ = ["Bounds", "Region", "region_of", "subtract_bounds"]

Bounds = tuple[tuple[int, ...], tuple[int, ...]]
"""A box as ``(lo, hi)``: the elements ``lo <= i < hi`` (``Region(lo, hi - lo)``)."""


@dataclass(frozen=True, slots=True)
class Region:
    """The box ``[offset, offset + shape)`` of an N-dimensional index space.

    >>> a = Region((0, 2), (4, 4))
    >>> a.intersect(Region((2, 0), (4, 4)))
    Region(offset=(2, 2), shape=(2, 2))
    >>> a.size
    16
    """

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offset) != len(self.shape):
            raise ValueError(f"offset {self.offset} and shape {self.shape} differ in rank")
        if self.shape and min(self.shape) < 0:
            raise ValueError(f"negative extent in shape {self.shape}")

    @classmethod
    def full(cls, shape: Sequence[int]) -> Region:
        """The region covering a whole array of ``shape``."""
        if cls is Region and type(shape) is tuple:
            return _full(shape)
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offset, self.shape, strict=True))

    @property
    def is_empty(self) -> bool:
        return self.size == 0

    def intersect(self, other: Region) -> Region | None:
        """The common box, or None when they share no element."""
        lo = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        hi = tuple(min(a, b) for a, b in zip(self.stop, other.stop, strict=True))
        if any(h <= lo_ for lo_, h in zip(lo, hi, strict=True)):
            return None
        return Region(lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True)))

    def contains(self, other: Region) -> bool:
        """True when every element of ``other`` lies in this region."""
        return all(
            so <= oo and oo + os_ <= so + ss
            for so, ss, oo, os_ in zip(self.offset, self.shape, other.offset, other.shape, strict=True)
        )

    def relative_to(self, outer: Region) -> Region:
        """This region in the coordinates of ``outer`` (which must contain it)."""
        return Region(tuple(a - b for a, b in zip(self.offset, outer.offset, strict=True)), self.shape)

    def slices(self) -> tuple[Any, ...]:
        """Index expression selecting this region from an array, as a view.

        A 0-d region gives ``(...,)``: indexing a 0-d array with ``()`` would copy.
        """
        if not self.shape:
            return (Ellipsis,)
        return tuple(slice(o, o + s) for o, s in zip(self.offset, self.shape, strict=True))

    def subtract(self, other: Region) -> list[Region]:
        """This region minus ``other``, as disjoint boxes (at most ``2 * ndim``)."""
        inter = self.intersect(other)
        if inter is None:
            return [self]
        return [Region.from_bounds(b) for b in subtract_bounds(self.offset, self.stop, inter.offset, inter.stop)]

    @property
    def bounds(self) -> Bounds:
        """``(offset, stop)``."""
        return self.offset, self.stop

    @classmethod
    def from_bounds(cls, bounds: Bounds) -> Region:
        lo, hi = bounds
        return cls(lo, tuple(h - o for o, h in zip(lo, hi, strict=True)))

    def to_json(self) -> list[list[int]]:
        return [list(self.offset), list(self.shape)]

    @classmethod
    def from_json(cls, data: Any) -> Region:
        if (
            not isinstance(data, list)
            or len(data) != 2
            or not all(isinstance(p, list) and all(type(v) is int for v in p) for p in data)
        ):
            raise ValueError(f"a region is [offset, shape] of integers, found {data!r}")
        return cls(tuple(data[0]), tuple(data[1]))


def subtract_bounds(
    lo: tuple[int, ...], hi: tuple[int, ...], glo: tuple[int, ...], ghi: tuple[int, ...]
) -> list[Bounds]:
    """``[lo, hi)`` minus its sub-box ``[glo, ghi)``, as disjoint boxes (at most two per dim)."""
    out = []
    cur_lo, cur_hi = list(lo), list(hi)
    for d in range(len(lo)):
        if glo[d] > cur_lo[d]:
            h = list(cur_hi)
            h[d] = glo[d]
            out.append((tuple(cur_lo), tuple(h)))
        if ghi[d] < cur_hi[d]:
            a = list(cur_lo)
            a[d] = ghi[d]
            out.append((tuple(a), tuple(cur_hi)))
        cur_lo[d], cur_hi[d] = glo[d], ghi[d]
    return out


def split_aligned(region: Region, chunk_shape: Sequence[int], itemsize: int, max_bytes: int) -> list[Region]:
    """Cut ``region`` (a union of whole chunks) into boxes of whole chunks of at most ``max_bytes``.

    Cuts fall on chunk boundaries, outer dimensions first; a single chunk larger than
    ``max_bytes`` stays whole.

    >>> [r.shape for r in split_aligned(Region((0, 0), (8, 4)), (2, 2), 1, 8)]
    [(2, 4), (2, 4), (2, 4), (2, 4)]
    >>> [r.offset for r in split_aligned(Region((0, 0), (2, 4)), (2, 2), 1, 4)]
    [(0, 0), (0, 2)]
    """
    if region.size * itemsize <= max_bytes or region.ndim == 0:
        return [region]
    out: list[Region] = []
    _split(region, tuple(chunk_shape), itemsize, max_bytes, 0, out)
    return out


def _split(region: Region, chunk: tuple[int, ...], itemsize: int, max_bytes: int, d: int, out: list[Region]) -> None:
    if region.size * itemsize <= max_bytes or d == region.ndim:
        out.append(region)
        return
    inner = math.prod(region.shape[:d] + region.shape[d + 1 :]) * itemsize  # bytes per index along d
    step = max(chunk[d], 1)
    take = max(1, max_bytes // max(inner * step, 1)) * step
    lo, end = region.offset[d], region.offset[d] + region.shape[d]
    while lo < end:
        # the first cut lands on the chunk grid even if the region starts off it
        hi = min(end, (lo // step) * step + take)
        offset = list(region.offset)
        shape = list(region.shape)
        offset[d], shape[d] = lo, hi - lo
        part = Region(tuple(offset), tuple(shape))
        if part.size * itemsize > max_bytes and take == step:
            _split(part, chunk, itemsize, max_bytes, d + 1, out)
        else:
            out.append(part)
        lo = hi


@functools.lru_cache(maxsize=4096)
def _full(shape: tuple[int, ...]) -> Region:
    """:meth:`Region.full`, once per shape (regions are immutable): many leaves share a shape."""
    return Region((0,) * len(shape), tuple(int(s) for s in shape))


# ``Region(offset, shape)`` for a box its caller computed (tuples of ints, as many in each, no
# negative extent), without the checks: a plan makes thousands, and the checks cost half of making
# one (tests/test_plan.py checks it against Region's own __init__).
region_of: Callable[[tuple[int, ...], tuple[int, ...]], Region] = slots_constructor(Region)
