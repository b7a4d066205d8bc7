"""Save planning at scale: layouts as numpy tables, plans as columns, a rank's own part, a plan cache.

:func:`~pytreeckpt._plan.plan_save` walks every chunk and every piece in Python; at
thousands of ranks that is minutes. This module computes the *same* plan with numpy:

- A layout becomes a :class:`PieceTable` (one row per piece: rank position, piece index,
  offset, extent), built from the spec without visiting ranks one by one, and shared by
  every array of the same layout and shape (every layer of a model has the same few).
- A :class:`GridInfo` holds what does not depend on the bytes already given to each
  rank: the chunk grid, which pieces wholly hold which boxes of chunks, the chunks that
  must be merged. Also shared.
- Per array, only what depends on those bytes is computed: one ``numpy.add.at`` for
  chunks with a single holder, the balancing of replicated chunks over their holders,
  and the writer of each merged chunk. The result is an :class:`ArraySaveTable`
  (columns), turned into the familiar :class:`~pytreeckpt._plan.ArraySavePlan` only
  where wanted: the whole plan for a small world, one rank's part at scale.

:func:`plan_save_rank` computes one rank's part without planning the world: the bytes
given to a rank matter only for the ranks that share a replicated chunk or tie for a
merged one, so it plans just the closure of those ranks. Its result equals the global
plan restricted to the rank (:func:`rank_part`); property tests hold it to that.

Layouts that are not regular (pieces whose chunk boxes overlap partially, a rank holding
a chunk twice, a rank order the mesh does not keep) are planned by the reference code
in ``_plan``, so every input gets the reference plan. Nothing here does I/O or reads a
clock.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ._errors import LayoutError
from ._plan import (
    ArrayLayout,
    ArraySavePlan,
    ChunkingOptions,
    Fragment,
    SavePlan,
    WriteOp,
    _coalesce,
    _plan_array_save,
    _water_fill,
    chunk_shape_from_cuts,
    merge_sources,
    merge_writer,
)
from ._region import Region
from ._sharding import FlatRanges, Layout, Piece, Replicate, ShardingSpec, StridedShard, flat_range_regions

__all__ = [
    "ArraySaveTable",
    "ArraySpec",
    "GridInfo",
    "PieceTable",
    "PlanCache",
    "grid_info",
    "layouts_digest",
    "piece_table",
    "plan_save_rank",
    "plan_save_tables",
    "rank_part",
]

_I64 = np.int64


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array of a state, as a spec: its layout sits on world ranks ``ranks`` (None: ``0..n-1``).

    A pipeline stage's tensors are a spec on the stage's sub-mesh placed on the stage's ranks.
    """

    key: str
    shape: tuple[int, ...]
    itemsize: int
    layout: Layout
    ranks: range | tuple[int, ...] | None = None

    def rank_array(self) -> np.ndarray:
        """World rank of each layout position."""
        n = self.layout.world_size
        if self.ranks is None:
            return np.arange(n, dtype=_I64)
        if len(self.ranks) != n:
            raise LayoutError(
                f"leaf {self.key!r}: its layout has {n} ranks but it is placed on {len(self.ranks)} ranks"
            )
        if isinstance(self.ranks, range):
            return np.arange(self.ranks.start, self.ranks.stop, self.ranks.step, dtype=_I64)
        return np.asarray(self.ranks, dtype=_I64)

    def array_layout(self, world: int) -> ArrayLayout:
        """The reference planning input: every world rank's pieces."""
        pieces: list[tuple[Piece, ...]] = [()] * world
        ranks = self.rank_array()
        for pos, ps in enumerate(self.layout.rank_pieces(self.shape)):
            pieces[int(ranks[pos])] = ps
        return ArrayLayout(self.key, self.shape, self.itemsize, tuple(pieces))


# --------------------------------------------------------------------------- piece tables


@dataclass(frozen=True, eq=False)
class PieceTable:
    """Every piece of a layout, one row each, sorted by (position, piece): ``lo``/``ext`` are (n, ndim)."""

    positions: int
    pos: np.ndarray
    piece: np.ndarray
    lo: np.ndarray
    ext: np.ndarray

    def pieces(self) -> tuple[tuple[Piece, ...], ...]:
        """The regions as :meth:`Layout.rank_pieces` gives them (local placement left out)."""
        out: list[list[Piece]] = [[] for _ in range(self.positions)]
        for p, lo, ext in zip(self.pos.tolist(), self.lo.tolist(), self.ext.tolist(), strict=True):
            out[p].append(Piece(Region(tuple(lo), tuple(ext))))
        return tuple(tuple(ps) for ps in out)


def _table_from_pieces(pieces: Sequence[Sequence[Piece]], ndim: int) -> PieceTable:
    pos, idx, lo, ext = [], [], [], []
    for p, ps in enumerate(pieces):
        for i, piece in enumerate(ps):
            pos.append(p)
            idx.append(i)
            lo.append(piece.region.offset)
            ext.append(piece.region.shape)
    return PieceTable(
        len(pieces),
        np.asarray(pos, dtype=_I64),
        np.asarray(idx, dtype=_I64),
        np.asarray(lo, dtype=_I64).reshape(-1, ndim),
        np.asarray(ext, dtype=_I64).reshape(-1, ndim),
    )


def _chunk_split(size: np.ndarray, parts: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``chunk_size_and_offset`` elementwise."""
    full = -(-size // parts)
    start = full * index
    empty = start >= size
    return np.where(empty, 0, np.minimum(full, size - start)), np.where(empty, size, start)


def _take(starts: np.ndarray, lens: np.ndarray, off: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[off, off + size)`` of the concatenation of each row's runs, as runs (empty ones kept)."""
    before = np.cumsum(lens, axis=1) - lens
    lo = np.maximum(off[:, None], before)
    hi = np.minimum((off + size)[:, None], before + lens)
    n = np.maximum(hi - lo, 0)
    return np.where(n > 0, starts + lo - before, 0), n


def _mesh_table(spec: ShardingSpec, shape: tuple[int, ...]) -> PieceTable:
    """:meth:`ShardingSpec.rank_pieces` computed for all positions at once."""
    spec._check(shape)
    mesh = spec.mesh
    positions = mesh.size
    coords = np.stack(np.unravel_index(np.arange(positions), mesh.shape), axis=1).astype(_I64)
    runs: list[tuple[np.ndarray, np.ndarray]] = []
    for d, n in enumerate(shape):
        starts = np.zeros((positions, 1), dtype=_I64)
        lens = np.full((positions, 1), n, dtype=_I64)
        for axis, p in enumerate(spec.placements):
            if isinstance(p, Replicate) or p.dim != d:
                continue
            parts, c = mesh.shape[axis], coords[:, axis]
            local = lens.sum(axis=1)
            if isinstance(p, StridedShard):
                taken = []
                for j in range(p.split_factor):
                    part_size, part_off = _chunk_split(local, p.split_factor, np.full_like(local, j))
                    size, off = _chunk_split(part_size, parts, c)
                    taken.append(_take(starts, lens, part_off + off, size))
                starts = np.concatenate([t[0] for t in taken], axis=1)
                lens = np.concatenate([t[1] for t in taken], axis=1)
            else:
                size, off = _chunk_split(local, parts, c)
                starts, lens = _take(starts, lens, off, size)
        runs.append((starts, lens))
    # Runs per position and dim: merge adjacent ones, as ShardingSpec.intervals does.
    counts = np.stack([_run_count(s, ln) for s, ln in runs], axis=1) if shape else np.ones((positions, 0), _I64)
    holds = (counts > 0).all(axis=1)
    simple = holds & (counts == 1).all(axis=1)
    pos_l: list[np.ndarray] = []
    lo_l: list[np.ndarray] = []
    ext_l: list[np.ndarray] = []
    idx_l: list[np.ndarray] = []
    sel = np.flatnonzero(simple)
    if shape:
        lo = np.stack([_first_run(s, ln)[0][sel] for s, ln in runs], axis=1)
        ext = np.stack([_first_run(s, ln)[1][sel] for s, ln in runs], axis=1)
    else:
        lo = ext = np.zeros((len(sel), 0), dtype=_I64)
    pos_l.append(sel)
    lo_l.append(lo)
    ext_l.append(ext)
    idx_l.append(np.zeros(len(sel), dtype=_I64))
    for q in np.flatnonzero(holds & ~simple).tolist():
        per_dim = [_merged_runs(s[q], ln[q]) for s, ln in runs]
        combos: list[tuple[int, ...]] = [()]
        for rs in per_dim:
            combos = [(*t, k) for t in combos for k in range(len(rs))]
        for i, combo in enumerate(combos):
            pos_l.append(np.array([q], dtype=_I64))
            idx_l.append(np.array([i], dtype=_I64))
            lo_l.append(np.array([[per_dim[d][k][0] for d, k in enumerate(combo)]], dtype=_I64).reshape(1, -1))
            ext_l.append(np.array([[per_dim[d][k][1] for d, k in enumerate(combo)]], dtype=_I64).reshape(1, -1))
    pos_a = np.concatenate(pos_l)
    idx_a = np.concatenate(idx_l)
    order = np.lexsort((idx_a, pos_a))
    return PieceTable(
        positions,
        pos_a[order],
        idx_a[order],
        np.concatenate(lo_l).reshape(-1, len(shape))[order],
        np.concatenate(ext_l).reshape(-1, len(shape))[order],
    )


def _run_count(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Non-empty runs per row after merging adjacent ones."""
    nonempty = lens > 0
    count = nonempty.sum(axis=1)
    if starts.shape[1] == 1:
        return np.asarray(count, dtype=_I64)
    # a non-empty run continuing the previous non-empty run is not counted
    out = count.copy()
    for p in np.flatnonzero(count > 1).tolist():
        out[p] = len(_merged_runs(starts[p], lens[p]))
    return np.asarray(out, dtype=_I64)


def _first_run(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and total length of each row's runs (for rows holding one merged run)."""
    first = np.argmax(lens > 0, axis=1)
    rows = np.arange(starts.shape[0])
    return starts[rows, first], lens.sum(axis=1)


def _merged_runs(starts: np.ndarray, lens: np.ndarray) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, n in zip(starts.tolist(), lens.tolist(), strict=True):
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == s:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((s, n))
    return out


def _flat_table(spec: FlatRanges, shape: tuple[int, ...]) -> PieceTable:
    """:meth:`FlatRanges.rank_pieces`, visiting only the ranks that hold something."""
    spec._check(shape)
    pos, idx, lo, ext = [], [], [], []
    for p, (a, b) in enumerate(spec.ranges):
        if a >= b:
            continue
        i = 0
        for reg in flat_range_regions(shape, a, b):
            if reg.is_empty:
                continue
            pos.append(p)
            idx.append(i)
            lo.append(reg.offset)
            ext.append(reg.shape)
            i += 1
    nd = len(shape)
    return PieceTable(
        spec.world_size,
        np.asarray(pos, dtype=_I64),
        np.asarray(idx, dtype=_I64),
        np.asarray(lo, dtype=_I64).reshape(-1, nd),
        np.asarray(ext, dtype=_I64).reshape(-1, nd),
    )


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Memo(dict[Any, Any]):
    """A bounded memo: cleared when full (tables are cheap to rebuild; this keeps memory bounded)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get_or(self, key: Hashable, make: Callable[[], V]) -> V:
        try:
            return self[key]  # type: ignore[no-any-return]
        except KeyError:
            if len(self) >= self.limit:
                self.clear()
            value = make()
            self[key] = value
            return value


_TABLES = _Memo(256)
_GRIDS = _Memo(256)


def clear_caches() -> None:
    """Forget the shared tables and grids (benchmarks time cold planning with this)."""
    _TABLES.clear()
    _GRIDS.clear()


def piece_table(layout: Layout, shape: tuple[int, ...]) -> PieceTable:
    """Every piece of ``layout`` over an array of ``shape``, memoised per (layout, shape)."""

    def make() -> PieceTable:
        if isinstance(layout, ShardingSpec):
            return _mesh_table(layout, shape)
        if isinstance(layout, FlatRanges):
            return _flat_table(layout, shape)
        return _table_from_pieces(layout.rank_pieces(shape), len(shape))

    return _TABLES.get_or((layout, shape), make)


# --------------------------------------------------------------------------- grids


@dataclass(frozen=True, eq=False)
class _Group:
    """Chunks held by the same two or more positions, in row-major order."""

    members: tuple[int, ...]
    chunks: list[tuple[int, ...]]
    sizes: dict[tuple[int, ...], int]
    piece_of: dict[tuple[int, tuple[int, ...]], int]  # (member, chunk) -> its piece


@dataclass(frozen=True, eq=False)
class _Merge:
    chunk: Region
    parts: list[tuple[int, int, Region]]  # (position, piece, part), in position order
    overlap: dict[int, int]  # position -> elements of the chunk it holds
    tied: tuple[int, ...]  # positions holding the most: the writer is one of them
    sources: dict[int, tuple[Fragment, ...]] = field(default_factory=dict)  # writer position -> its sources


@dataclass(frozen=True, eq=False)
class GridInfo:
    """What planning an array needs that does not depend on the bytes given to ranks so far.

    ``regular`` is False when the fast planner does not apply (then ``_plan`` plans it).
    In position space: ``single_*`` are boxes of chunks held by one piece only (a direct
    write each), ``groups`` chunks held by several, ``merges`` chunks no piece holds whole.
    ``coupled`` gives, per position, the positions whose written bytes decide where its own
    replicated or merged chunks go.
    """

    chunk_shape: tuple[int, ...]
    regular: bool
    positions: int = 0
    single_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    single_piece: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    single_lo: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), _I64))
    single_ext: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), _I64))
    single_elems: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    groups: list[_Group] = field(default_factory=list)
    merges: list[_Merge] = field(default_factory=list)
    coupled: dict[int, frozenset[int]] = field(default_factory=dict)
    pos_rows: dict[int, list[int]] = field(default_factory=dict)  # position -> its single rows


def _contained(table: PieceTable, chunk: tuple[int, ...], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the box ``[clo, chi)`` of chunk indices lying wholly inside its piece."""
    c = np.asarray(chunk, dtype=_I64)
    n = np.asarray(shape, dtype=_I64)
    end = table.lo + table.ext
    clo = -(-table.lo // c)
    chi = np.where(end < n, end // c, -(-n // c))
    return clo, np.maximum(clo, chi)


def _coverage(lo: np.ndarray, hi: np.ndarray, grid: tuple[int, ...]) -> np.ndarray:
    """How many of the boxes ``[lo, hi)`` cover each cell of ``grid`` (a difference array, summed)."""
    nd = len(grid)
    diff = np.zeros(tuple(g + 1 for g in grid), dtype=_I64)
    for corner in range(1 << nd):
        idx = tuple(np.where((corner >> d) & 1, hi[:, d], lo[:, d]) for d in range(nd))
        sign = -1 if bin(corner).count("1") % 2 else 1
        np.add.at(diff, idx, sign)
    for d in range(nd):
        diff = np.cumsum(diff, axis=d)
    return diff[tuple(slice(0, g) for g in grid)]


def grid_info(layout: Layout, shape: tuple[int, ...], itemsize: int, options: ChunkingOptions) -> GridInfo:
    """The chunk grid of an array and its rank-independent plan structure, memoised."""
    return _GRIDS.get_or((layout, shape, itemsize, options), lambda: _grid_info(layout, shape, itemsize, options))


def _grid_info(layout: Layout, shape: tuple[int, ...], itemsize: int, options: ChunkingOptions) -> GridInfo:
    table = piece_table(layout, shape)
    return grid_info_of_table(table, shape, itemsize, options)


def grid_info_of_table(table: PieceTable, shape: tuple[int, ...], itemsize: int, options: ChunkingOptions) -> GridInfo:
    nd = len(shape)
    cuts = []
    for d in range(nd):
        edges = np.concatenate([table.lo[:, d], table.lo[:, d] + table.ext[:, d]])
        edges = edges[(edges > 0) & (edges < shape[d])]
        cuts.append(int(np.gcd.reduce(edges)) if len(edges) else 0)
    chunk = chunk_shape_from_cuts(shape, itemsize, cuts, options)
    if nd == 0 or any(s == 0 for s in shape):
        return GridInfo(chunk, regular=False)
    grid = tuple(-(-s // c) for s, c in zip(shape, chunk, strict=True))
    clo, chi = _contained(table, chunk, shape)
    has = (chi > clo).all(axis=1)
    rows = np.flatnonzero(has)
    boxes = np.concatenate([clo[rows], chi[rows]], axis=1)
    if len(rows):
        ubox, inverse = np.unique(boxes, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
    else:
        ubox, inverse = np.zeros((0, 2 * nd), _I64), np.zeros(0, _I64)
    # Regular: distinct boxes are disjoint, and no position holds a box twice.
    cover = _coverage(ubox[:, :nd], ubox[:, nd:], grid)
    if (cover > 1).any():
        return GridInfo(chunk, regular=False)
    pos_box = table.pos[rows] * (len(ubox) + 1) + inverse
    if len(np.unique(pos_box)) != len(pos_box):
        return GridInfo(chunk, regular=False)
    members = np.bincount(inverse, minlength=len(ubox))
    one = members[inverse] == 1
    srows = rows[one]
    s_lo, s_hi = clo[srows], chi[srows]
    c = np.asarray(chunk, dtype=_I64)
    n = np.asarray(shape, dtype=_I64)
    lo_el = s_lo * c
    ext_el = np.minimum(s_hi * c, n) - lo_el
    single_pos = table.pos[srows]
    pos_rows: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(single_pos.tolist()):
        pos_rows[p].append(i)
    # Replicated boxes: grouped by their holder positions.
    by_members: dict[tuple[int, ...], list[int]] = defaultdict(list)
    rep_rows = rows[~one]
    rep_box = inverse[~one]
    holders_of_box: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for r, b in zip(rep_rows.tolist(), rep_box.tolist(), strict=True):
        holders_of_box[b].append((int(table.pos[r]), int(table.piece[r])))
    for b, hs in holders_of_box.items():
        by_members[tuple(sorted({p for p, _ in hs}))].append(b)
    groups = []
    coupled: dict[int, set[int]] = defaultdict(set)
    for mem, bs in by_members.items():
        chunks: list[tuple[int, ...]] = []
        piece_of: dict[tuple[int, tuple[int, ...]], int] = {}
        for b in bs:
            blo, bhi = ubox[b, :nd].tolist(), ubox[b, nd:].tolist()
            cs = _box_indices(blo, bhi)
            chunks.extend(cs)
            for p, pi in holders_of_box[b]:
                for ci in cs:
                    piece_of[(p, ci)] = pi
        chunks.sort()
        sizes = {ci: _chunk_size(ci, chunk, shape) * itemsize for ci in chunks}
        groups.append(_Group(mem, chunks, sizes, piece_of))
        for p in mem:
            coupled[p].update(mem)
    groups.sort(key=lambda g: (len(g.members), g.members))
    # Merged chunks: those no piece holds whole, in row-major order.
    merges = []
    end = table.lo + table.ext
    for cidx in np.argwhere(cover == 0).tolist():
        creg = Region(
            tuple(i * k for i, k in zip(cidx, chunk, strict=True)),
            tuple(min(k, s - i * k) for i, k, s in zip(cidx, chunk, shape, strict=True)),
        )
        clo_el = np.asarray(creg.offset, dtype=_I64)
        chi_el = clo_el + np.asarray(creg.shape, dtype=_I64)
        ilo = np.maximum(table.lo, clo_el)
        ihi = np.minimum(end, chi_el)
        hit = np.flatnonzero((ihi > ilo).all(axis=1))
        parts = []
        overlap: dict[int, int] = defaultdict(int)
        for r in hit.tolist():
            part = Region(tuple(ilo[r].tolist()), tuple((ihi[r] - ilo[r]).tolist()))
            p = int(table.pos[r])
            overlap[p] += part.size
            parts.append((p, int(table.piece[r]), part))
        best = max(overlap.values(), default=0)
        tied = tuple(sorted(p for p, v in overlap.items() if v == best))
        merges.append(_Merge(creg, parts, dict(overlap), tied))
        if len(tied) > 1:
            for p in tied:
                coupled[p].update(tied)
    return GridInfo(
        chunk,
        regular=True,
        positions=table.positions,
        single_pos=single_pos,
        single_piece=table.piece[srows],
        single_lo=lo_el,
        single_ext=ext_el,
        single_elems=np.prod(ext_el, axis=1),
        groups=groups,
        merges=merges,
        coupled={p: frozenset(s) for p, s in coupled.items()},
        pos_rows=dict(pos_rows),
    )


def _box_indices(lo: list[int], hi: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for a, b in zip(lo, hi, strict=True):
        out = [(*t, i) for t in out for i in range(a, b)]
    return out


def _chunk_size(index: tuple[int, ...], chunk: tuple[int, ...], shape: tuple[int, ...]) -> int:
    return math.prod(min(k, s - i * k) for i, k, s in zip(index, chunk, shape, strict=True))


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True, eq=False)
class ArraySaveTable:
    """One array's writes as columns, sorted by offset; ``piece`` is -1 for merged writes.

    Direct writes (one source: the writer's own piece ``piece`` covering the region) are
    columns only; merged writes keep their sources in ``merged`` (row -> WriteOp).
    """

    key: str
    shape: tuple[int, ...]
    itemsize: int
    chunk_shape: tuple[int, ...]
    offset: np.ndarray
    extent: np.ndarray
    writer: np.ndarray
    piece: np.ndarray
    merged: dict[int, WriteOp]

    def __len__(self) -> int:
        return len(self.writer)

    def to_plan(self, rows: Sequence[int] | None = None) -> ArraySavePlan:
        """The :class:`ArraySavePlan` of these writes (or of ``rows`` of them)."""
        sel = range(len(self.writer)) if rows is None else rows
        off, ext = self.offset.tolist(), self.extent.tolist()
        writer, piece = self.writer.tolist(), self.piece.tolist()
        writes = []
        for i in sel:
            op = self.merged.get(i)
            if op is None:
                region = Region(tuple(off[i]), tuple(ext[i]))
                op = WriteOp(region, writer[i], (Fragment(writer[i], piece[i], region),))
            writes.append(op)
        return ArraySavePlan(self.key, self.shape, self.itemsize, self.chunk_shape, tuple(writes))

    def rows_of(self, rank: int) -> list[int]:
        """Rows whose write involves ``rank``, as writer or as a source."""
        rows = set(np.flatnonzero(self.writer == rank).tolist())
        for i, op in self.merged.items():
            if any(s.rank == rank for s in op.sources):
                rows.add(i)
        return sorted(rows)


def _table_of_plan(ap: ArraySavePlan) -> ArraySaveTable:
    nd = len(ap.shape)
    merged = {i: w for i, w in enumerate(ap.writes) if not w.is_direct}
    return ArraySaveTable(
        ap.key,
        ap.shape,
        ap.itemsize,
        ap.chunk_shape,
        np.asarray([w.region.offset for w in ap.writes], dtype=_I64).reshape(-1, nd),
        np.asarray([w.region.shape for w in ap.writes], dtype=_I64).reshape(-1, nd),
        np.asarray([w.writer for w in ap.writes], dtype=_I64),
        np.asarray([-1 if i in merged else w.sources[0].piece for i, w in enumerate(ap.writes)], dtype=_I64),
        merged,
    )


class _Load:
    """Bytes given to each rank so far: a dense vector, or a dict for a closure of ranks."""

    def __init__(self, world: int, dense: bool) -> None:
        self.vec = np.zeros(world if dense else 0, dtype=_I64)
        self.sparse: dict[int, int] = defaultdict(int)
        self.dense = dense

    def __getitem__(self, r: int) -> int:
        return int(self.vec[r]) if self.dense else self.sparse[r]

    def add(self, r: int, v: int) -> None:
        if self.dense:
            self.vec[r] += v
        else:
            self.sparse[r] += v


def _plan_array(
    spec: ArraySpec,
    world: int,
    options: ChunkingOptions,
    load: _Load,
    only: frozenset[int] | None,
    emit: int | None = None,
) -> ArraySaveTable:
    """One array's writes.

    With ``only`` (a closed set of ranks), only the bytes of those ranks are tracked, and
    with ``emit`` only the writes involving that rank are made.
    """
    info = grid_info(spec.layout, spec.shape, spec.itemsize, options)
    ranks = spec.rank_array()
    monotonic = len(ranks) < 2 or bool((np.diff(ranks) > 0).all())
    if not info.regular or not monotonic or (len(ranks) and (ranks[0] < 0 or ranks[-1] >= world)):
        return _plan_reference(spec, world, options, load, only)
    nd = len(spec.shape)
    itemsize = spec.itemsize
    # Chunks with one holder: a direct write each.
    if only is None:
        srow = np.arange(len(info.single_pos))
    else:
        pos_of = _positions_of(ranks, only)
        srow = np.asarray(
            sorted(i for p in pos_of for i in info.pos_rows.get(p, ())),
            dtype=_I64,
        )
    writers = ranks[info.single_pos[srow]] if len(srow) else np.zeros(0, _I64)
    nbytes = info.single_elems[srow] * itemsize
    if load.dense:
        np.add.at(load.vec, writers, nbytes)
    else:
        for w, b in zip(writers.tolist(), nbytes.tolist(), strict=True):
            load.sparse[w] += b
    if emit is not None:
        keep = writers == emit
        srow, writers = srow[keep], writers[keep]
    off_l = [info.single_lo[srow]]
    ext_l = [info.single_ext[srow]]
    wr_l = [writers]
    pc_l = [info.single_piece[srow]]
    merged_ops: list[WriteOp] = []
    # Replicated chunks: balanced over their holders.
    for g in info.groups:
        holders = [int(ranks[p]) for p in g.members]
        if only is not None and not only.intersection(holders):
            continue
        local = [load[h] for h in holders]
        assign = _water_fill(g.chunks, range(len(holders)), g.sizes, local)
        for h, v0, v1 in zip(holders, [load[h] for h in holders], local, strict=True):
            load.add(h, v1 - v0)
        if emit is not None and emit not in holders:
            continue
        by_source: dict[tuple[int, int], list[tuple[int, ...]]] = defaultdict(list)
        for ci, k in assign.items():
            by_source[(k, g.piece_of[(g.members[k], ci)])].append(ci)
        for (k, pi), idxs in sorted(by_source.items()):
            if emit is not None and holders[k] != emit:
                continue
            for lo, hi in _coalesce(idxs):
                a = np.asarray(lo, dtype=_I64) * np.asarray(info.chunk_shape, dtype=_I64)
                b = np.minimum(np.asarray(hi, dtype=_I64) * info.chunk_shape, spec.shape)
                off_l.append(a.reshape(1, nd))
                ext_l.append((b - a).reshape(1, nd))
                wr_l.append(np.asarray([holders[k]], dtype=_I64))
                pc_l.append(np.asarray([pi], dtype=_I64))
    # Merged chunks: the rank holding most of each, ties to the least loaded.
    for m in info.merges:
        if only is not None and not any(int(ranks[p]) in only for p in m.overlap):
            continue
        if len(m.tied) == 1:
            writer_pos = m.tied[0]
        else:
            writer_pos = merge_writer(spec.key, m.chunk, {p: m.overlap[p] for p in m.tied}, _MappedLoad(load, ranks))
        writer = int(ranks[writer_pos])
        load.add(writer, m.chunk.size * itemsize)
        if emit is not None and writer != emit and _pos_of(ranks, emit) not in m.overlap:
            continue
        sources = m.sources.get(writer_pos)
        if sources is None:
            sources = m.sources[writer_pos] = merge_sources(spec.key, m.chunk, writer_pos, m.parts, m.overlap).sources
        frags = tuple(Fragment(int(ranks[f.rank]), f.piece, f.region) for f in sources)
        merged_ops.append(WriteOp(m.chunk, writer, frags))
    for op in merged_ops:
        off_l.append(np.asarray([op.region.offset], dtype=_I64).reshape(1, nd))
        ext_l.append(np.asarray([op.region.shape], dtype=_I64).reshape(1, nd))
        wr_l.append(np.asarray([op.writer], dtype=_I64))
        pc_l.append(np.asarray([-1], dtype=_I64))
    offset = np.concatenate(off_l).reshape(-1, nd)
    extent = np.concatenate(ext_l).reshape(-1, nd)
    writer_a = np.concatenate(wr_l)
    piece_a = np.concatenate(pc_l)
    order = np.lexsort(offset.T[::-1]) if nd else np.arange(len(writer_a))
    n_direct = len(writer_a) - len(merged_ops)
    rank_of_row = np.empty(len(order), dtype=_I64)
    rank_of_row[order] = np.arange(len(order))
    merged = {int(rank_of_row[n_direct + j]): op for j, op in enumerate(merged_ops)}
    return ArraySaveTable(
        spec.key,
        spec.shape,
        itemsize,
        info.chunk_shape,
        offset[order],
        extent[order],
        writer_a[order],
        piece_a[order],
        merged,
    )


class _MappedLoad:
    """Bytes given so far, indexed by layout position."""

    def __init__(self, load: _Load, ranks: np.ndarray) -> None:
        self.load, self.ranks = load, ranks

    def __getitem__(self, p: int) -> tuple[int, int]:
        r = int(self.ranks[p])
        return (self.load[r], r)


def _positions_of(ranks: np.ndarray, only: frozenset[int]) -> list[int]:
    want = np.asarray(sorted(only), dtype=_I64)
    pos = np.searchsorted(ranks, want)
    ok = (pos < len(ranks)) & (ranks[np.minimum(pos, len(ranks) - 1)] == want)
    return [int(v) for v in pos[ok]]


def _plan_reference(
    spec: ArraySpec, world: int, options: ChunkingOptions, load: _Load, only: frozenset[int] | None
) -> ArraySaveTable:
    layout = spec.array_layout(world)
    if only is not None:
        raise _NotClosed
    lst = load.vec.tolist()
    ap = _plan_array_save(layout, options, lst)
    load.vec[:] = lst
    return _table_of_plan(ap)


class _NotClosed(Exception):
    """The closure of a rank reaches an array the fast planner cannot restrict."""


def _check_world(specs: Sequence[ArraySpec], world: int) -> None:
    for s in specs:
        if s.layout.world_size > world or (s.ranks is not None and len(s.ranks) and max(s.ranks) >= world):
            raise LayoutError(f"leaf {s.key!r}: its layout spans ranks beyond the world of {world}")


def plan_save_tables(
    specs: Sequence[ArraySpec], world: int, options: ChunkingOptions | None = None
) -> list[ArraySaveTable]:
    """The global save plan, as columns: equal to ``plan_save`` on the same layouts.

    >>> from pytreeckpt import Mesh, Shard, ShardingSpec
    >>> spec = ArraySpec("w", (1024, 1024), 4, ShardingSpec(Mesh(4), [Shard(0)]))
    >>> t = plan_save_tables([spec], 4)[0]
    >>> t.writer.tolist(), t.chunk_shape
    ([0, 1, 2, 3], (256, 1024))
    """
    options = options or ChunkingOptions()
    _check_world(specs, world)
    load = _Load(world, dense=True)
    return [_plan_array(s, world, options, load, None) for s in specs]


def rank_part(tables: Sequence[ArraySaveTable], world: int, rank: int) -> SavePlan:
    """The part of a global plan that involves ``rank``: every array, with only the writes it writes or feeds."""
    return SavePlan(world, tuple(t.to_plan(t.rows_of(rank)) for t in tables))


def _closure(specs: Sequence[ArraySpec], world: int, rank: int, options: ChunkingOptions) -> frozenset[int] | None:
    """The ranks whose written bytes decide ``rank``'s writes: closed under sharing a replicated or tied chunk.

    None when some array is not regular (then the rank's part comes from the global plan).
    """
    distinct: dict[tuple[int, Any], tuple[GridInfo, np.ndarray | None]] = {}
    for s in specs:
        info = grid_info(s.layout, s.shape, s.itemsize, options)
        if not info.regular:
            return None
        if info.coupled or info.merges:
            key = (id(info), s.ranks)
            if key not in distinct:
                distinct[key] = (info, None if s.ranks is None else s.rank_array())
    members = {rank}
    stack = [rank]
    # Merges ``rank`` only feeds still depend on the bytes of the ranks tied to write them.
    for info, ranks in distinct.values():
        pos = _pos_of(ranks, rank)
        if pos is None:
            continue
        for m in info.merges:
            if len(m.tied) > 1 and pos in m.overlap:
                for p in m.tied:
                    q = _rank_at(ranks, p)
                    if q not in members:
                        members.add(q)
                        stack.append(q)
    coupled = [(info, ranks) for info, ranks in distinct.values() if info.coupled]
    while stack:
        r = stack.pop()
        for info, ranks in coupled:
            pos = _pos_of(ranks, r)
            if pos is None:
                continue
            for p in info.coupled.get(pos, ()):
                q = _rank_at(ranks, p)
                if q not in members:
                    members.add(q)
                    stack.append(q)
    return frozenset(members)


def _pos_of(ranks: np.ndarray | None, r: int) -> int | None:
    if ranks is None:
        return r
    i = int(np.searchsorted(ranks, r))
    return i if i < len(ranks) and ranks[i] == r else None


def _rank_at(ranks: np.ndarray | None, p: int) -> int:
    return p if ranks is None else int(ranks[p])


def plan_save_rank(
    specs: Sequence[ArraySpec], world: int, rank: int, options: ChunkingOptions | None = None
) -> SavePlan:
    """``rank``'s part of the global save plan, computed without planning the whole world.

    Equal to ``rank_part(plan_save_tables(specs, world), world, rank)``.
    """
    options = options or ChunkingOptions()
    _check_world(specs, world)
    only = _closure(specs, world, rank, options)
    if only is None:
        return rank_part(plan_save_tables(specs, world, options), world, rank)
    load = _Load(world, dense=False)
    involved: dict[Any, bool] = {}
    out = []
    for s in specs:
        key = s.ranks
        hit = involved.get(key)
        if hit is None:
            hit = involved[key] = bool(_positions_of(s.rank_array(), only))
        if not hit:
            info = grid_info(s.layout, s.shape, s.itemsize, options)
            out.append(ArraySavePlan(s.key, s.shape, s.itemsize, info.chunk_shape, ()))
            continue
        table = _plan_array(s, world, options, load, only, rank)
        out.append(table.to_plan(table.rows_of(rank)))
    return SavePlan(world, tuple(out))


# --------------------------------------------------------------------------- cache


def layouts_digest(parts: Sequence[Any]) -> str:
    """A digest of planning inputs (anything with a stable ``repr``): the plan cache's key."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()


class PlanCache:
    """A small LRU of plans keyed by a hash of their inputs: a save in the same layout as the last reuses its plan.

    Pure: it only maps keys to values; the caller decides the key.

    >>> cache = PlanCache(2)
    >>> cache.get_or("k", lambda: 1), cache.get_or("k", lambda: 2), cache.hits
    (1, 1, 1)
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[Hashable, Any] = OrderedDict()

    def get_or(self, key: Hashable, make: Callable[[], V]) -> V:
        if key in self._items:
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key]  # type: ignore[no-any-return]
        self.misses += 1
        value = make()
        self._items[key] = value
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        self._items.clear()
