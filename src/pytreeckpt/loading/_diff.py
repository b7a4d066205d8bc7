"""Two checkpoints compared leaf by leaf, a chunk at a time: ``pytreeckpt.diff`` and ``pytreeckpt diff``.

Leaves are matched by key path. Arrays of the same shape and dtype are read along the
stored chunk grid of one of them (the finer, when the two are chunked differently), the
same box from both (the two at once), in batches of :data:`~pytreeckpt.loading._chunks.BATCH_BYTES` a side
(a larger chunk alone): the memory held is about twice the larger of that and the largest
chunk, whatever the checkpoints' sizes. Elements are compared bit for bit; those that
differ give the largest absolute and relative difference, in float64. Plain Python leaves
are compared as the document stores them (type and value). No torch is imported.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytreeckpt.core._region import Region
from pytreeckpt.core._values import encode_value
from pytreeckpt.format import ArrayMeta, CheckpointDoc, ValueMeta
from pytreeckpt.storage import ExecutorOptions, Storage
from pytreeckpt.storage._location import Where, describe

from . import _chunks
from ._inspect import ambiguity_error, ambiguous_keys
from ._open import again_if_replaced, open_checkpoint

__all__ = ["DiffReport", "LeafDiff", "diff_checkpoints"]

STATUSES = ("equal", "values", "shape", "dtype", "kind", "only_a", "only_b")


@dataclass(frozen=True, slots=True)
class LeafDiff:
    """How one leaf compares.

    Attributes:
      key: the key path.
      status: ``"equal"`` (bit for bit, or equal plain values); ``"values"`` (same shape
        and dtype, some elements differ; or plain values differ); ``"shape"`` or
        ``"dtype"`` (the arrays' shapes, or only their dtypes, differ: no data is read);
        ``"kind"`` (an array in one, a plain value in the other); ``"only_a"``, ``"only_b"``.
      a, b: what each checkpoint holds there: ``"float32 (8, 5)"``, a value's repr, or None.
      differing: elements that differ, bit for bit (``-0.0`` and ``0.0`` differ, a NaN equals
        the same NaN).
      elements: elements compared.
      max_abs: the largest ``|a - b|`` over differing elements both finite (None when there
        are none); for complex values the modulus, for integers computed in float64.
      max_rel: the largest ``|a - b| / max(|a|, |b|)`` over the same elements.
      nonfinite: differing elements where either side is NaN or infinite (not in ``max_abs``).
    """

    key: str
    status: str
    a: str | None
    b: str | None
    differing: int = 0
    elements: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    nonfinite: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "status": self.status,
            "a": self.a,
            "b": self.b,
            "differing": self.differing,
            "elements": self.elements,
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "nonfinite": self.nonfinite,
        }


@dataclass(frozen=True, slots=True)
class DiffReport:
    """What :func:`~pytreeckpt.diff` found.

    Attributes:
      a, b: the two checkpoints.
      leaves: one :class:`LeafDiff` per key path: those of ``a`` in its order, then those only in ``b``.
      chunks: boxes compared (each read from both).
      nbytes: bytes read, both sides.
      peak_bytes: the most bytes of array data held at once (both sides of a batch).
    """

    a: str
    b: str
    leaves: tuple[LeafDiff, ...]
    chunks: int = 0
    nbytes: int = 0
    peak_bytes: int = 0

    @property
    def equal(self) -> bool:
        """Every leaf is in both and equal."""
        return all(leaf.status == "equal" for leaf in self.leaves)

    @property
    def differences(self) -> tuple[LeafDiff, ...]:
        """The leaves that are not equal."""
        return tuple(leaf for leaf in self.leaves if leaf.status != "equal")

    def __getitem__(self, key: str) -> LeafDiff:
        for leaf in self.leaves:
            if leaf.key == key:
                return leaf
        raise KeyError(key)

    def to_json(self) -> dict[str, Any]:
        counts = {s: sum(leaf.status == s for leaf in self.leaves) for s in STATUSES}
        return {
            "a": self.a,
            "b": self.b,
            "equal": self.equal,
            "counts": counts,
            "leaves": [leaf.to_json() for leaf in self.leaves],
            "chunks": self.chunks,
            "bytes": self.nbytes,
            "peak_bytes": self.peak_bytes,
        }


def diff_checkpoints(a: Where, b: Where, executor: ExecutorOptions | None) -> DiffReport:
    """:func:`~pytreeckpt.diff`: read again from the new document when either checkpoint is replaced meanwhile."""
    return again_if_replaced(
        a,
        executor,
        "compared",
        lambda seen_a: again_if_replaced(b, executor, "compared", lambda seen_b: _once(a, b, executor, seen_a, seen_b)),
    )


def _leaves(path: Where, doc: CheckpointDoc) -> dict[str, ArrayMeta | ValueMeta]:
    many = ambiguous_keys(doc)
    if many:
        key = next(iter(many))
        raise ambiguity_error(key, many[key], describe(path))
    return {leaf.key: leaf for leaf in doc.leaves if isinstance(leaf, (ArrayMeta, ValueMeta))}


def _text(leaf: ArrayMeta | ValueMeta | None) -> str | None:
    if leaf is None:
        return None
    if isinstance(leaf, ArrayMeta):
        return f"{leaf.dtype.name} {tuple(leaf.shape)}"
    return repr(leaf.value)


def _stored(leaf: ValueMeta) -> str:
    """A plain value as the document stores it, type and all (1, 1.0 and True differ; a NaN equals a NaN)."""
    return json.dumps(encode_value(leaf.value), sort_keys=True)


@dataclass(slots=True)
class _Pair:
    """Two arrays of one shape and dtype, compared box by box; what was found so far."""

    key: str
    a: ArrayMeta
    b: ArrayMeta
    differing: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    nonfinite: int = 0
    grid: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        finer = min((self.a, self.b), key=lambda m: math.prod(m.chunk_shape))
        self.grid = finer.chunk_shape

    def boxes(self) -> Iterator[tuple[_Pair, Region]]:
        for region in _chunks.chunk_boxes(self.a, self.grid):
            yield self, region

    def result(self) -> LeafDiff:
        n = math.prod(self.a.shape)
        status = "values" if self.differing else "equal"
        text = _text(self.a)
        return LeafDiff(self.key, status, text, text, self.differing, n, self.max_abs, self.max_rel, self.nonfinite)


def _once(a: Where, b: Where, executor: ExecutorOptions | None, seen_a: list[bytes], seen_b: list[bytes]) -> DiffReport:
    sa, doc_a = open_checkpoint(a, "", executor, seen_a)
    sb, doc_b = open_checkpoint(b, "", executor, seen_b)
    la, lb = _leaves(a, doc_a), _leaves(b, doc_b)
    out: dict[str, LeafDiff | _Pair] = {}
    for key in [*la, *(k for k in lb if k not in la)]:
        x, y = la.get(key), lb.get(key)
        out[key] = _compare_meta(key, x, y)
    pairs = [p for p in out.values() if isinstance(p, _Pair)]
    sa.check_stored_sizes([p.a for p in pairs])
    sb.check_stored_sizes([p.b for p in pairs])
    chunks, nbytes, peak = _compare_data(sa, sb, a, b, pairs)
    leaves = tuple(v.result() if isinstance(v, _Pair) else v for v in out.values())
    return DiffReport(describe(a), describe(b), leaves, chunks, nbytes, peak)


def _compare_meta(key: str, x: ArrayMeta | ValueMeta | None, y: ArrayMeta | ValueMeta | None) -> LeafDiff | _Pair:
    """The leaf's difference when the metadata tells it; a :class:`_Pair` to compare when the data must."""
    if x is None or y is None:
        return LeafDiff(key, "only_b" if x is None else "only_a", _text(x), _text(y))
    if isinstance(x, ArrayMeta) and isinstance(y, ArrayMeta):
        if tuple(x.shape) != tuple(y.shape):
            return LeafDiff(key, "shape", _text(x), _text(y))
        if x.dtype.name != y.dtype.name:
            return LeafDiff(key, "dtype", _text(x), _text(y))
        return _Pair(key, x, y)
    if isinstance(x, ValueMeta) and isinstance(y, ValueMeta):
        same = _stored(x) == _stored(y)
        return LeafDiff(key, "equal" if same else "values", _text(x), _text(y))
    return LeafDiff(key, "kind", _text(x), _text(y))


def _compare_data(sa: Storage, sb: Storage, a: Where, b: Where, pairs: Sequence[_Pair]) -> tuple[int, int, int]:
    """Every box of every pair read from both sides, batch by batch, and compared; (boxes, bytes, peak bytes)."""

    def size(item: tuple[_Pair, Region]) -> int:
        return item[1].size * item[0].a.dtype.itemsize

    chunks = nbytes = peak = 0
    every = (item for p in pairs for item in p.boxes())
    arena_a, arena_b = _chunks.Arena(), _chunks.Arena()
    with ThreadPoolExecutor(1, thread_name_prefix="pytreeckpt-diff") as other:  # (b read while a is)
        for batch in _chunks.batches(every, size, _chunks.BATCH_BYTES):
            ys_read = other.submit(_chunks.read_boxes, sb, b, [(p.b, r) for p, r in batch], arena_b)
            try:
                xs = _chunks.read_boxes(sa, a, [(p.a, r) for p, r in batch], arena_a)
            finally:
                ys = ys_read.result()
            held = 2 * sum(size(item) for item in batch)
            chunks, nbytes, peak = chunks + len(batch), nbytes + held, max(peak, held)
            for (p, _), x, y in zip(batch, xs, ys, strict=True):
                _compare_box(p, x, y)
            del xs, ys
    return chunks, nbytes, peak


def _bits(x: np.ndarray) -> np.ndarray:
    """``x`` as unsigned integers of its width (bytes, a row per element, for other widths)."""
    width = x.dtype.itemsize
    if width in (1, 2, 4, 8):
        return x.view(f"u{width}")
    return x.view(np.uint8).reshape(-1, width)


def _compare_box(p: _Pair, x: np.ndarray, y: np.ndarray) -> None:
    for bx, by in _chunks.blocks(x, y):
        ne = _bits(bx) != _bits(by)
        if ne.ndim == 2:
            ne = ne.any(axis=1)
        k = int(np.count_nonzero(ne))
        if not k:
            continue
        p.differing += k
        wide = np.complex128 if bx.dtype.kind == "c" else np.float64
        u, v = bx[ne].astype(wide), by[ne].astype(wide)
        finite = np.isfinite(u) & np.isfinite(v)
        p.nonfinite += int(k - np.count_nonzero(finite))
        if not finite.any():
            continue
        u, v = u[finite], v[finite]
        d = np.abs(u - v)
        mag = np.maximum(np.abs(u), np.abs(v))
        rel = np.divide(d, mag, out=np.zeros_like(d), where=mag > 0)
        p.max_abs = max(p.max_abs or 0.0, float(d.max()))
        p.max_rel = max(p.max_rel or 0.0, float(rel.max()))
