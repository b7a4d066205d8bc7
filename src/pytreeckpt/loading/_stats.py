"""Each array's min, max, mean, L2 norm and counts of NaN and infinite values, read a chunk at a time
(``pytreeckpt inspect --stats``).

Arrays are read along their stored chunk grids, in batches of
:data:`~pytreeckpt.loading._chunks.BATCH_BYTES` (a larger chunk alone), and reduced in
float64 accumulators, block by block, so the memory held does not grow with the
checkpoint. Complex arrays are summarised by their elements' moduli; bool as 0 and 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pytreeckpt.core._region import Region
from pytreeckpt.format import ArrayMeta
from pytreeckpt.storage import ExecutorOptions
from pytreeckpt.storage._location import Where

from . import _chunks
from ._inspect import Arrays
from ._open import again_if_replaced, open_checkpoint

__all__ = ["LeafStats", "array_stats"]


@dataclass(frozen=True, slots=True)
class LeafStats:
    """One array's summary: over its finite elements ``min``, ``max``, ``mean`` and ``norm`` (L2; None when
    it has no finite element), and how many elements are NaN and how many infinite."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    min: float | None
    max: float | None
    mean: float | None
    norm: float | None
    nan: int
    inf: int

    @property
    def finite(self) -> bool:
        """No element is NaN or infinite."""
        return not self.nan and not self.inf

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "min": self.min,
            "max": self.max,
            "mean": self.mean,
            "norm": self.norm,
            "nan": self.nan,
            "inf": self.inf,
        }


class _Sums:
    """Float64 accumulators of one array; the norm kept as ``scale * sqrt(ssq)`` so that it does not overflow."""

    __slots__ = ("count", "high", "inf", "low", "nan", "scale", "ssq", "total")

    def __init__(self) -> None:
        self.count = self.nan = self.inf = 0
        self.low, self.high, self.total, self.scale, self.ssq = math.inf, -math.inf, 0.0, 0.0, 0.0

    def add(self, block: np.ndarray) -> None:
        x = np.abs(block.astype(np.complex128)) if block.dtype.kind == "c" else block.astype(np.float64)
        nan = np.isnan(x)
        inf = np.isinf(x)
        self.nan += int(np.count_nonzero(nan))
        self.inf += int(np.count_nonzero(inf))
        if self.nan or self.inf:
            x = x[~(nan | inf)]
        if not x.size:
            return
        self.count += x.size
        self.low = min(self.low, float(x.min()))
        self.high = max(self.high, float(x.max()))
        self.total += float(x.sum())
        top = float(np.abs(x).max())
        if top == 0.0:
            return
        if top > self.scale:
            self.ssq *= (self.scale / top) ** 2
            self.scale = top
        self.ssq += float(np.square(x / self.scale).sum())

    def result(self, meta: ArrayMeta) -> LeafStats:
        some = self.count > 0
        return LeafStats(
            meta.key,
            meta.dtype.name,
            tuple(meta.shape),
            self.low if some else None,
            self.high if some else None,
            self.total / self.count if some else None,
            self.scale * math.sqrt(self.ssq) if some else None,
            self.nan,
            self.inf,
        )


def array_stats(path: Where, executor: ExecutorOptions | None) -> list[LeafStats]:
    """Every array's :class:`LeafStats`, in the document's order; read again if the checkpoint is replaced."""
    return again_if_replaced(path, executor, "read", lambda seen: _once(path, executor, seen))


def _once(path: Where, executor: ExecutorOptions | None, seen: list[bytes]) -> list[LeafStats]:
    storage, doc = open_checkpoint(path, "", executor, seen)
    arrays = Arrays(path, doc)
    metas = [arrays[k] for k in arrays]
    storage.check_stored_sizes(metas)
    sums = {id(meta): _Sums() for meta in metas}
    every = ((meta, region) for meta in metas for region in _chunks.chunk_boxes(meta))

    def size(item: tuple[ArrayMeta, Region]) -> int:
        return item[1].size * item[0].dtype.itemsize

    arena = _chunks.Arena()
    for batch in _chunks.batches(every, size, _chunks.BATCH_BYTES):
        _add(batch, _chunks.read_boxes(storage, path, batch, arena), sums)
    return [sums[id(meta)].result(meta) for meta in metas]


def _add(batch: Sequence[tuple[ArrayMeta, Region]], data: Sequence[np.ndarray], sums: dict[int, _Sums]) -> None:
    for (meta, _), box in zip(batch, data, strict=True):
        for (block,) in _chunks.blocks(box):
            sums[id(meta)].add(block)
