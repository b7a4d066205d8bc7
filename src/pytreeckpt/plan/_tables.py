"""Layouts as tables: every piece of every position, computed from a spec for all positions at once.

A :class:`PieceTable` has one row per piece (layout position, piece index, offset,
extent): the boxes :meth:`Layout.rank_pieces` gives, computed with numpy from the spec
(``ShardingSpec`` vectorised over the mesh, ``FlatRanges`` visiting only the ranks that
hold something, ``ExplicitRegions`` as given). Tables are memoised per (layout, shape):
the layers of a model share a few. Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from pytreeckpt.core._region import Region
from pytreeckpt.core._rows import rows_all, rows_any
from pytreeckpt.core._sharding import (
    FlatRanges,
    Layout,
    Piece,
    Replicate,
    ShardingSpec,
    StridedShard,
    flat_range_regions,
)

from ._memos import PLACED, PLACED_BY_ID, TABLES, Memo

__all__ = ["PieceTable", "piece_table", "unique_rows"]

_I64 = np.int64


@dataclass(frozen=True, eq=False)
class PieceTable:
    """Every piece of a layout, one row each, sorted by (position, piece): ``lo``/``ext`` are (n, ndim)."""

    positions: int
    pos: np.ndarray
    piece: np.ndarray
    lo: np.ndarray
    ext: np.ndarray
    # Any two pieces are the same box or share no element (a mesh layout's: positions apart on an axis that
    # shards a dim hold disjoint runs of it; positions apart only on replicating axes hold the same pieces).
    disjoint: bool = False

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
        np.asarray(lo, dtype=_I64).reshape(len(pos), ndim),
        np.asarray(ext, dtype=_I64).reshape(len(pos), ndim),
    )


def _chunk_split(size: np.ndarray, parts: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``chunk_size_and_offset`` elementwise."""
    full = -(-size // parts)
    start = full * index
    empty = start >= size
    return np.where(empty, 0, np.minimum(full, size - start)), np.where(empty, size, start)


def _take(starts: np.ndarray, lens: np.ndarray, off: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``[off, off + size)`` of the concatenation of each row's runs, as runs (empty ones kept).

    ``starts`` and ``lens`` are (runs, rows): run ``j`` of every row is one contiguous array
    (a few runs, many rows: column-major, each step runs over contiguous memory).
    """
    if lens.shape[0] > 1:
        one = _take_within_runs(starts, lens, off, size)
        if one is not None:
            return one
    stop = off + size
    out_starts = np.empty(starts.shape, dtype=_I64)
    out_lens = np.empty(lens.shape, dtype=_I64)
    before = np.zeros(len(off), dtype=_I64)
    for j in range(lens.shape[0]):
        run = lens[j]
        lo = np.maximum(off, before)
        n = np.minimum(stop, before + run) - lo
        np.maximum(n, 0, out=n)
        out_lens[j] = n
        out_starts[j] = np.where(n > 0, starts[j] + lo - before, 0)
        before += run
    return out_starts, out_lens


def _take_within_runs(
    starts: np.ndarray, lens: np.ndarray, off: np.ndarray, size: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    """:func:`_take` as one run per row, when each row's window lies within one of its runs (None otherwise).

    A shard of a strided shard does (FSDP2 with tensor parallelism: ``StridedShard`` then
    ``Shard`` on one dim): each position's window falls in one of its row's runs, so its
    piece is one box. The runs :func:`_take` would keep besides are empty, which nothing
    after it tells apart from absent ones.
    """
    runs, n = lens.shape
    ends = np.empty((runs, n), dtype=_I64)  # (a row at a time: np.cumsum(axis=0) is 9x slower)
    ends[0] = lens[0]
    k = (ends[0] <= off).astype(_I64)  # the first run ending after the window starts
    for j in range(1, runs):
        np.add(ends[j - 1], lens[j], out=ends[j])
        k += ends[j] <= off
    nonempty = size > 0
    at = np.minimum(k, runs - 1) * n + np.arange(n)  # (flat indices of run k of each row)
    end = ends.ravel()[at]
    if bool((nonempty & (off + size > end)).any()):
        return None
    start = np.where(nonempty, starts.ravel()[at] + off - (end - lens.ravel()[at]), 0)
    return start.reshape(1, -1), np.where(nonempty, size, 0).reshape(1, -1)


def _mesh_table(spec: ShardingSpec, shape: tuple[int, ...]) -> PieceTable:
    """:meth:`ShardingSpec.rank_pieces` computed for all positions at once."""
    spec._check(shape)
    mesh = spec.mesh
    positions = mesh.size
    coords = np.stack(np.unravel_index(np.arange(positions), mesh.shape), axis=1).astype(_I64)
    # Per dim, the runs depend only on the coordinates along the mesh axes sharding that
    # dim: they are computed once per combination of those (rows, the first axis major),
    # and each position reads its row. Runs are kept (runs, rows), as _take takes them.
    runs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    for d, n in enumerate(shape):
        nested = _nested_runs(spec, d, n, coords)
        if nested is not None:
            runs.append(nested)
            continue
        starts = np.zeros((1, 1), dtype=_I64)
        lens = np.full((1, 1), n, dtype=_I64)
        row = np.zeros(positions, dtype=_I64)
        for axis, p in enumerate(spec.placements):
            if isinstance(p, Replicate) or p.dim != d:
                continue
            parts = mesh.shape[axis]
            c = np.tile(np.arange(parts, dtype=_I64), starts.shape[1])
            starts, lens = np.repeat(starts, parts, axis=1), np.repeat(lens, parts, axis=1)
            row = row * parts + coords[:, axis]
            local = lens.sum(axis=0)
            if isinstance(p, StridedShard):
                taken = []
                for j in range(p.split_factor):
                    part_size, part_off = _chunk_split(local, p.split_factor, np.full_like(local, j))
                    size, off = _chunk_split(part_size, parts, c)
                    taken.append(_take(starts, lens, part_off + off, size))
                starts = np.concatenate([t[0] for t in taken], axis=0)
                lens = np.concatenate([t[1] for t in taken], axis=0)
            else:
                size, off = _chunk_split(local, parts, c)
                starts, lens = _take(starts, lens, off, size)
        runs.append((starts, lens, row))
    # Runs per position and dim: merge adjacent ones, as ShardingSpec.intervals does.
    per_row = [_run_count(s, ln) for s, ln, _ in runs]
    if shape and all(bool((n == 1).all()) for n in per_row):  # (every position one box: the common case)
        firsts = [_first_run(s, ln) for s, ln, _ in runs]
        lo = np.stack([f[0][row] for f, (_, _, row) in zip(firsts, runs, strict=True)], axis=1)
        ext = np.stack([f[1][row] for f, (_, _, row) in zip(firsts, runs, strict=True)], axis=1)
        return PieceTable(
            positions, np.arange(positions, dtype=_I64), np.zeros(positions, _I64), lo, ext, disjoint=True
        )
    counts = (
        np.stack([n[row] for n, (_, _, row) in zip(per_row, runs, strict=True)], axis=1)
        if shape
        else np.ones((positions, 0), _I64)
    )
    holds = rows_all(counts > 0)
    simple = holds & rows_all(counts == 1)
    pos_l: list[np.ndarray] = []
    lo_l: list[np.ndarray] = []
    ext_l: list[np.ndarray] = []
    idx_l: list[np.ndarray] = []
    sel = np.flatnonzero(simple)
    if shape:
        firsts = [_first_run(s, ln) for s, ln, _ in runs]
        lo = np.stack([f[0][row[sel]] for f, (_, _, row) in zip(firsts, runs, strict=True)], axis=1)
        ext = np.stack([f[1][row[sel]] for f, (_, _, row) in zip(firsts, runs, strict=True)], axis=1)
    else:
        lo = ext = np.zeros((len(sel), 0), dtype=_I64)
    pos_l.append(sel)
    lo_l.append(lo)
    ext_l.append(ext)
    idx_l.append(np.zeros(len(sel), dtype=_I64))
    for q in np.flatnonzero(holds & ~simple).tolist():
        per_dim = [_merged_runs(s[:, row[q]], ln[:, row[q]]) for s, ln, row in runs]
        combos: list[tuple[int, ...]] = [()]
        for rs in per_dim:
            combos = [(*t, k) for t in combos for k in range(len(rs))]
        for i, combo in enumerate(combos):
            pos_l.append(np.array([q], dtype=_I64))
            idx_l.append(np.array([i], dtype=_I64))
            lo_l.append(np.array([[per_dim[d][k][0] for d, k in enumerate(combo)]], dtype=_I64).reshape(1, -1))
            ext_l.append(np.array([[per_dim[d][k][1] for d, k in enumerate(combo)]], dtype=_I64).reshape(1, -1))
    if len(pos_l) == 1:  # one run each: in order already
        return PieceTable(
            positions, sel, idx_l[0], lo.reshape(len(sel), len(shape)), ext.reshape(len(sel), len(shape)), disjoint=True
        )
    pos_a = np.concatenate(pos_l)
    idx_a = np.concatenate(idx_l)
    order = np.lexsort((idx_a, pos_a))
    return PieceTable(
        positions,
        pos_a[order],
        idx_a[order],
        np.concatenate(lo_l).reshape(len(pos_a), len(shape))[order],
        np.concatenate(ext_l).reshape(len(pos_a), len(shape))[order],
        disjoint=True,
    )


def _nested_runs(
    spec: ShardingSpec, d: int, n: int, coords: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Dim ``d``'s runs as :func:`_mesh_table`'s loop makes them, for FSDP2 with tensor parallelism, in closed form.

    When dim ``d`` is cut by ``StridedShard(d, b)`` on a mesh axis of ``a`` positions and then
    by ``Shard(d)`` on a later axis of ``b`` (nothing else cuts it), position ``(i, j)`` takes
    window ``j`` of the ``b`` runs ``i`` holds; where every window is exactly run ``j`` (the
    runs' lengths are how ``Shard`` cuts their sum: checked here), it holds ``i``'s cut of
    part ``j``, as ``torch.chunk`` nests. One run per row then, as ``_take_within_runs``
    leaves it; None when the pattern or the check does not hold (the loop computes it).
    """
    axes = [k for k, p in enumerate(spec.placements) if not isinstance(p, Replicate) and p.dim == d]
    if len(axes) != 2:
        return None
    first, second = (spec.placements[k] for k in axes)
    a, b = (spec.mesh.shape[k] for k in axes)
    if not (isinstance(first, StridedShard) and type(second) is not StridedShard and first.split_factor == b):
        return None
    j = np.arange(b, dtype=_I64)
    part_size, part_off = _chunk_split(np.full(b, n, dtype=_I64), b, j)  # (b,)
    i = np.arange(a, dtype=_I64)[:, None]
    size, off = _chunk_split(np.broadcast_to(part_size, (a, b)), a, np.broadcast_to(i, (a, b)))  # (a, b)
    held = size.sum(axis=1, keepdims=True)
    window, _ = _chunk_split(np.broadcast_to(held, (a, b)), b, np.broadcast_to(j, (a, b)))
    if not bool((window == size).all()):
        return None
    lens = size.reshape(1, -1)
    starts = np.where(lens > 0, (part_off + off).reshape(1, -1), 0)
    return starts, lens, coords[:, axes[0]] * b + coords[:, axes[1]]


def _run_count(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Non-empty runs per row after merging adjacent ones (as :func:`_merged_runs` merges them); (runs, rows) in."""
    count = np.zeros(starts.shape[1], dtype=_I64)
    end = np.full(starts.shape[1], -1, dtype=_I64)  # where the last non-empty run so far ends
    for j in range(starts.shape[0]):  # run by run: a few runs, many rows
        run_start, run = starts[j], lens[j]
        nonempty = run > 0
        count += nonempty & (end != run_start)  # a run starting where the last one ends continues it
        end = np.where(nonempty, run_start + run, end)
    return count


def _first_run(starts: np.ndarray, lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and total length of each row's runs (for rows holding one merged run); (runs, rows) in."""
    if len(lens) == 1:
        return starts[0], lens[0]
    start = starts[0]
    for j in range(len(lens) - 1, -1, -1):  # (the first non-empty run's start; np.argmax(axis=0) is 10x slower)
        start = np.where(lens[j] > 0, starts[j], start)
    return start, lens.sum(axis=0)


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
        np.asarray(lo, dtype=_I64).reshape(len(pos), nd),
        np.asarray(ext, dtype=_I64).reshape(len(pos), nd),
    )


V = TypeVar("V")


def piece_table(layout: Layout, shape: tuple[int, ...]) -> PieceTable:
    """Every piece of ``layout`` over an array of ``shape``, memoised per (layout, shape)."""

    def make() -> PieceTable:
        if any(s == 0 for s in shape):  # empty arrays: rank_pieces' own conventions, at no cost
            return _table_from_pieces(layout.rank_pieces(shape), len(shape))
        if isinstance(layout, ShardingSpec):
            return _mesh_table(layout, shape)
        if isinstance(layout, FlatRanges):
            return _flat_table(layout, shape)
        return _table_from_pieces(layout.rank_pieces(shape), len(shape))

    return TABLES.get_or((layout, shape), make)


def unique_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct rows of a 2-D integer array in lexicographic order, each row's index among them, and
    where each distinct row first occurs.

    What ``numpy.unique(a, axis=0, return_inverse=True, return_index=True)`` gives,
    without its slow sort of structured rows: from 256 rows, a stable sort of one number per
    row (:func:`_row_key`) when the rows fit one; else a stable lexsort of the columns.
    """
    n = len(a)
    if n == 0:
        return a, np.zeros(0, _I64), np.zeros(0, _I64)
    key = _row_key(a) if n >= 256 else None
    if key is not None:  # (one stable sort of a number per row, for many rows: half the time of lexsort's)
        order = np.argsort(key, kind="stable")
        k = key[order]
        new = np.ones(n, dtype=bool)
        np.not_equal(k[1:], k[:-1], out=new[1:])
        inverse = np.empty(n, dtype=_I64)
        inverse[order] = np.cumsum(new) - 1
        first = order[new]
        return a[first], inverse, first
    order = np.lexsort(a.T[::-1]) if a.shape[1] else np.arange(n, dtype=_I64)
    s = a[order]
    new = np.ones(n, dtype=bool)
    new[1:] = rows_any(s[1:] != s[:-1])
    inverse = np.empty(n, dtype=_I64)
    inverse[order] = np.cumsum(new) - 1
    return s[new], inverse, order[new]


def _row_key(a: np.ndarray) -> np.ndarray | None:
    """One int64 per row of ``a`` ordered as the rows are lexicographically (each column's offset from
    its least value, in mixed radix, the first column most significant); None when it would not fit."""
    if not a.shape[1]:
        return None
    cols = [a[:, j] for j in range(a.shape[1])]
    lows = [int(c.min()) for c in cols]
    spans = [int(c.max()) - lo + 1 for c, lo in zip(cols, lows, strict=True)]
    if math.prod(spans) >= 1 << 62:
        return None
    key = cols[0].astype(_I64) - lows[0]
    for c, lo, span in zip(cols[1:], lows[1:], spans[1:], strict=True):
        key *= span
        key += c
        key -= lo
    return key  # type: ignore[no-any-return]


def placed_table(layout: Layout, shape: tuple[int, ...], ranks: np.ndarray) -> tuple[PieceTable, np.ndarray, Any]:
    """The layout's table with positions renumbered in world-rank order, the world rank of each, and a memo key.

    Planning compares and orders ranks; with positions in rank order it can work in
    positions (memoised per layout) and map to world ranks at the end. A mesh whose
    ranks ascend (every mesh ``init_device_mesh`` makes, and its slices) keeps its table.
    """
    table = piece_table(layout, shape)
    if len(ranks) < 2 or bool((np.diff(ranks) > 0).all()):
        return table, ranks, (layout, shape)
    order = np.argsort(ranks, kind="stable")
    renumber = np.empty(len(order), dtype=_I64)
    renumber[order] = np.arange(len(order), dtype=_I64)
    pos = renumber[table.pos]
    rows = np.lexsort((table.piece, pos))
    moved = PieceTable(
        table.positions, pos[rows], table.piece[rows], table.lo[rows], table.ext[rows], disjoint=table.disjoint
    )
    return moved, ranks[order], (layout, shape, ranks.tobytes())


@dataclass(eq=False)
class Placed:
    """A layout's table for an array shape, in world-rank order, placed on world ranks.

    ``table_key`` names the table (shared by every placement of a layout whose ranks
    ascend), ``place`` the placement; ``derived`` holds what planning memoises on it.
    """

    table: PieceTable
    shape: tuple[int, ...]
    ranks: np.ndarray  # the world rank of each position of ``table``, ascending
    table_key: Any
    place: Any
    derived: dict[Any, Any]
    _positions: dict[int, int | None] = field(default_factory=dict)

    def per_table(self, kind: Hashable, shared: Memo, make: Callable[[], V]) -> V:
        """What planning derives from this layout's table alone (``kind``: what and with which parameters).

        Memoised on this placement, and in ``shared`` by table, so the placements of one
        table (the pipeline stages of a model) compute it once.
        """
        try:
            return self.derived[kind]  # type: ignore[no-any-return]
        except KeyError:
            got: V = shared.get_or((self.table_key, kind), make)
            self.derived[kind] = got
            return got

    def position(self, rank: int) -> int | None:
        """The position of world rank ``rank`` in ``table``, or None when the layout does not place it (memoised)."""
        try:
            return self._positions[rank]
        except KeyError:
            at = int(np.searchsorted(self.ranks, rank))
            got = self._positions[rank] = at if at < len(self.ranks) and int(self.ranks[at]) == rank else None
            return got


def placed(spec: Any) -> Placed:
    """The placed table of an :class:`~pytreeckpt.plan.ArraySpec` (memoised, looked up by the layout object first:
    hashing a spec by value costs more than the rest of the lookup)."""
    where = spec.ranks if spec.ranks is None or isinstance(spec.ranks, range) else tuple(spec.ranks)
    fast = (id(spec.layout), spec.shape, where)
    hit = PLACED_BY_ID.get(fast)
    if hit is not None and hit[0] is spec.layout:
        return hit[1]  # type: ignore[no-any-return]

    def make() -> Placed:
        table, ranks, key = placed_table(spec.layout, spec.shape, spec.rank_array())
        return Placed(table, spec.shape, ranks, key, (where, spec.layout.world_size), {})

    got: Placed = PLACED.get_or((spec.layout, spec.shape, where), make)
    PLACED_BY_ID.get_or(fast, lambda: (spec.layout, got))
    return got


def rows_like(table: PieceTable, row: int) -> np.ndarray:
    """The rows of ``table`` whose box equals row ``row``'s (itself among them), in table order.

    One column is compared over the whole table, the others over its matches only: a
    position's few boxes among 16,384 positions cost a column's scan each, not a scan of
    every column (a sixth of the work for boxes of 2 dims).
    """
    lo, ext = table.lo, table.ext
    nd = lo.shape[1]
    if nd == 0:
        return np.arange(len(table.pos), dtype=_I64)
    rows = np.flatnonzero(lo[:, 0] == lo[row, 0])
    for d in range(nd):
        if d:
            rows = rows[lo[rows, d] == lo[row, d]]
        rows = rows[ext[rows, d] == ext[row, d]]
    return rows


def first_of_runs(keys: np.ndarray) -> np.ndarray:
    """Indices where a sorted 1-D array starts a run of equal values."""
    if len(keys) == 0:
        return np.zeros(0, dtype=_I64)
    return np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
