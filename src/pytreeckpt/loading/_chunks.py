"""Stored arrays read a box at a time, into numpy memory of bounded size: what ``diff`` and ``inspect --stats``
walk over.

An array is visited along its stored chunk grid (:func:`chunk_boxes`); boxes are read in
batches (:func:`batches`) of at most :data:`BATCH_BYTES`, or one box when it is larger, so
the memory held at once is about the larger of the two, whatever the checkpoint's size.
The reads are the load's own (:func:`~pytreeckpt.execute._executor.read_arrays`: every
chunk checked against its recorded checksum), into numpy buffers of the stored dtype
(``ml_dtypes`` for bfloat16 and float8), so no torch is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import ExplicitRegions
from pytreeckpt.execute._executor import read_arrays
from pytreeckpt.format import ArrayMeta
from pytreeckpt.plan import ArraySpec, plan_load

from ._open import check_memory

if TYPE_CHECKING:
    from pytreeckpt.storage import Storage
    from pytreeckpt.storage._location import Where

__all__ = ["BATCH_BYTES", "BLOCK", "Arena", "batches", "blocks", "chunk_boxes", "read_boxes"]

BATCH_BYTES = 16 << 20
"""The bytes of boxes read in one batch (a box larger than this is read alone): the default largest chunk."""

BLOCK = 1 << 20
"""Elements converted to float64 at once when a box is worked on (8 MiB of temporaries a block)."""

_T = TypeVar("_T")


def chunk_boxes(meta: ArrayMeta, chunk_shape: tuple[int, ...] | None = None) -> Iterator[Region]:
    """The boxes of ``meta``'s chunk grid (or a grid of ``chunk_shape`` over its shape), in row-major order."""
    grid = ChunkGrid(meta.shape, meta.chunk_shape if chunk_shape is None else chunk_shape)
    for index in grid.indices((0,) * grid.ndim, grid.grid):
        yield grid.region(index)


def batches(items: Iterable[_T], nbytes: Callable[[_T], int], budget: int) -> Iterator[list[_T]]:
    """``items`` in consecutive groups of at most ``budget`` bytes each (an item larger than that alone)."""
    group: list[_T] = []
    held = 0
    for item in items:
        n = nbytes(item)
        if group and held + n > budget:
            yield group
            group, held = [], 0
        group.append(item)
        held += n
    if group:
        yield group


class Arena:
    """One buffer that the boxes of each batch are read into in turn, grown to the largest batch: memory faulted
    in once, not once a batch (a fresh buffer a batch made reading 2 x 100 MB take twice as long as a load)."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, np.uint8)

    def views(self, path: Where, wants: Sequence[tuple[ArrayMeta, Region]]) -> list[np.ndarray]:
        """An array of each box's shape and stored dtype, side by side (each at a multiple of 64 bytes)."""
        sizes = [region.size * meta.dtype.itemsize for meta, region in wants]
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + -(-n // 64) * 64)
        if starts[-1] > self._buffer.size:
            check_memory(path, [(meta.key, n) for (meta, _), n in zip(wants, sizes, strict=True)])
            self._buffer = np.empty(0, np.uint8)  # (the old one let go before the new one is made)
            self._buffer = np.empty(starts[-1], np.uint8)
        return [
            self._buffer[at : at + n].view(meta.dtype.numpy).reshape(region.shape)
            for (meta, region), at, n in zip(wants, starts[:-1], sizes, strict=True)
        ]


def read_boxes(
    storage: Storage, path: Where, wants: Sequence[tuple[ArrayMeta, Region]], arena: Arena | None = None
) -> list[np.ndarray]:
    """Each ``(array, box)`` of ``wants`` read into an array of the stored dtype, in one batch of reads: views of
    ``arena``'s buffer (valid until its next batch), or new arrays.

    The boxes of one array must not overlap (chunks of a grid do not).
    """
    out = (Arena() if arena is None else arena).views(path, wants)
    by_array: dict[int, tuple[ArrayMeta, list[int]]] = {}
    for i, (meta, _) in enumerate(wants):
        by_array.setdefault(id(meta), (meta, []))[1].append(i)
    metas = [meta for meta, _ in by_array.values()]
    specs = [
        ArraySpec(meta.key, meta.shape, meta.dtype.itemsize, ExplicitRegions([[wants[i][1] for i in at]]))
        for meta, at in by_array.values()
    ]
    plan = plan_load([meta.chunk_shape for meta in metas], specs, 1)

    def getter(at: list[int]) -> Callable[[int, int], tuple[np.ndarray, Region]]:
        return lambda rank, piece: (out[at[piece]], wants[at[piece]][1])

    read_arrays(storage, metas, plan.arrays, [getter(at) for _, at in by_array.values()], rank=None)
    return out


def blocks(*arrays: np.ndarray) -> Iterator[tuple[np.ndarray, ...]]:
    """The arrays (of one size) flattened and cut into blocks of :data:`BLOCK` elements, side by side."""
    flat = [a.reshape(-1) for a in arrays]
    n = flat[0].size if flat else 0
    for start in range(0, n, BLOCK):
        yield tuple(f[start : start + BLOCK] for f in flat)
