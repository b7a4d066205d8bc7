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

:func:`plan_save_rank` computes one rank's part without planning the world: writers are
balanced within scopes (see ``_plan``) and every scope that decides a rank's writes
contains the rank, so it plans only the arrays the rank holds. Its result equals the
global plan restricted to the rank (:func:`rank_part`); property tests hold it to that.

Layouts that are not regular (pieces whose chunk boxes overlap partially, a rank holding
a chunk twice, a rank order the mesh does not keep) are planned by the reference code
in ``_plan``, so every input gets the reference plan. Nothing here does I/O or reads a
clock.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._errors import LayoutError
from ._piece_table import _I64, _TABLES, ArraySpec, PieceTable, _Memo, _pos_of, piece_table, unique_rows
from ._plan import (
    ArraySavePlan,
    ChunkingOptions,
    Fragment,
    SavePlan,
    Scopes,
    WriteOp,
    _coalesce,
    _plan_array_save,
    _subtract_box,
    _water_fill,
    chunk_shape_from_cuts,
    merge_sources,
    scope_loads,
)
from ._region import Region
from ._sharding import Layout

__all__ = [
    "ArraySaveTable",
    "ArraySpec",
    "GridInfo",
    "PieceTable",
    "clear_caches",
    "grid_info",
    "piece_table",
    "plan_save_rank",
    "plan_save_tables",
    "rank_part",
]

_GRIDS = _Memo(256)


def clear_caches() -> None:
    """Forget the shared tables and grids (benchmarks time cold planning with this)."""
    _TABLES.clear()
    _GRIDS.clear()
    _PLACEMENTS.clear()


# --------------------------------------------------------------------------- grids


def _world_scope(
    cache: dict[Any, tuple[list[int], bytes]], positions: np.ndarray, ranks: np.ndarray, placement: Any
) -> tuple[list[int], bytes]:
    """The world ranks of layout ``positions`` under ``placement`` and their scope key, memoised in ``cache``."""
    got = cache.get(placement)
    if got is None:
        world = ranks[positions]
        got = cache[placement] = (world.tolist(), world.tobytes())
    return got


@dataclass(frozen=True, eq=False)
class _Group:
    """Chunks held by the same two or more positions, in row-major order."""

    members: tuple[int, ...]
    member_arr: np.ndarray
    chunks: list[tuple[int, ...]]
    sizes: dict[tuple[int, ...], int]
    pieces: dict[tuple[int, ...], dict[int, int]]  # chunk -> member -> the member's piece holding it
    memo: dict[bytes, tuple[dict[tuple[int, ...], int], list[int]]] = field(default_factory=dict)
    member_set: frozenset[int] = field(init=False)
    # placement -> the members' world ranks and their scope key
    scopes: dict[Any, tuple[list[int], bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "member_set", frozenset(self.members))

    def scope(self, ranks: np.ndarray, placement: Any) -> tuple[list[int], bytes]:
        return _world_scope(self.scopes, self.member_arr, ranks, placement)


@dataclass(frozen=True, eq=False)
class _Merge:
    chunk: Region
    part_pos: np.ndarray  # the pieces meeting the chunk, in position order, and their parts of it
    part_piece: np.ndarray
    part_lo: np.ndarray
    part_hi: np.ndarray
    overlap: dict[int, int]  # position -> elements of the chunk it holds
    tied_at: tuple[int, ...]  # where in ``overlap_arr`` the positions holding the most are: one writes
    overlap_arr: np.ndarray  # the positions feeding the chunk, ascending
    ubox: np.ndarray  # the distinct part boxes, lo | hi rows
    # each distinct box's best holder (position, piece): most of the chunk, then the lowest position, then piece
    first_pos: list[int]
    first_piece: list[int]
    part_box: np.ndarray  # per part, its distinct box
    base: list[int]  # boxes in the order of their first holders
    is_grid: bool  # the distinct boxes are the cells of a grid over the chunk
    first_holders: frozenset[int] = field(init=False)
    first_boxes: dict[int, list[int]] = field(init=False)  # position -> the boxes it is first in line for
    base_index: dict[int, int] = field(init=False)  # box -> its place in ``base``
    sources: dict[int, _Sources] = field(default_factory=dict)  # writer position -> its sources
    _boxes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # placement -> the feeders' world ranks and their scope key
    scopes: dict[Any, tuple[list[int], bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "first_holders", frozenset(self.first_pos))
        first_boxes: dict[int, list[int]] = {}
        for b, p in enumerate(self.first_pos):
            first_boxes.setdefault(p, []).append(b)
        object.__setattr__(self, "first_boxes", first_boxes)
        object.__setattr__(self, "base_index", {b: i for i, b in enumerate(self.base)})

    def parts(self) -> list[tuple[int, int, Region]]:
        return [
            (p, pi, Region(tuple(lo), tuple(h - a for a, h in zip(lo, hi, strict=True))))
            for p, pi, lo, hi in zip(
                self.part_pos.tolist(),
                self.part_piece.tolist(),
                self.part_lo.tolist(),
                self.part_hi.tolist(),
                strict=True,
            )
        ]

    def box(self, b: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Distinct box ``b`` as (lo, hi) tuples, made when first asked for."""
        got = self._boxes.get(b)
        if got is None:
            row = self.ubox[b].tolist()
            nd = len(row) // 2
            got = self._boxes[b] = (tuple(row[:nd]), tuple(row[nd:]))
        return got

    def scope(self, ranks: np.ndarray, placement: Any) -> tuple[list[int], bytes]:
        return _world_scope(self.scopes, self.overlap_arr, ranks, placement)

    def first(self, b: int) -> tuple[int, int]:
        return self.first_pos[b], self.first_piece[b]

    def own_boxes(self, pos: int) -> list[tuple[int, int]]:
        """(its lowest piece holding it, box) for each box position ``pos`` holds, ascending."""
        sel = self.part_pos == pos
        best: dict[int, int] = {}
        for b, pi in zip(self.part_box[sel].tolist(), self.part_piece[sel].tolist(), strict=True):
            best[b] = min(pi, best.get(b, pi))
        return sorted((pi, b) for b, pi in best.items())

    def sources_for(self, key: str, writer: int) -> _Sources:
        """The sources when ``writer`` (a position) writes: as ``merge_sources`` gives them, memoised.

        ``merge_sources`` skips a part equal to one already used, so only the first holder
        of each distinct box in its order (the writer's own boxes first) matters.
        """
        got = self.sources.get(writer)
        if got is None:
            own = self.own_boxes(writer)
            mine = {b for _, b in own}
            if self.is_grid:
                # Boxes on a grid: every box left uncovered is a union of grid cells, so each
                # distinct box is one fragment, whole: the writer's own, then the others in order.
                got = self.sources[writer] = _GridSources(self, writer, own, mine)
                return got
            firsts = [(writer, pi, *self.box(b)) for pi, b in own]
            firsts += [(*self.first(b), *self.box(b)) for b in self.base if b not in mine]
            uncovered = [(self.chunk.offset, self.chunk.stop)]
            frags: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = []
            for p, pi, plo, phi in firsts:
                rest = []
                for ulo, uhi in uncovered:
                    if ulo[0] >= phi[0] or uhi[0] <= plo[0]:
                        rest.append((ulo, uhi))
                        continue
                    glo = tuple(map(max, ulo, plo))
                    ghi = tuple(map(min, uhi, phi))
                    if any(h <= a for a, h in zip(glo, ghi, strict=True)):
                        rest.append((ulo, uhi))
                        continue
                    frags.append((p, pi, glo, ghi))
                    rest.extend(_subtract_box(ulo, uhi, glo, ghi))
                uncovered = rest
                if not uncovered:
                    break
            if uncovered:  # the reference raises the error naming the leaf
                merge_sources(key, self.chunk, writer, self.parts(), self.overlap)
            got = self.sources[writer] = _Sources(frags)
        return got


class _Sources:
    """The sources of a merged write, as (position, piece, lo, hi); fragments made when asked for."""

    __slots__ = ("_items", "position_set")

    def __init__(self, items: list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]) -> None:
        self._items = items
        self.position_set = frozenset(i[0] for i in items)

    def has(self, pos: int) -> bool:
        return pos in self.position_set

    def entries(self) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
        return self._items

    def fragments(self, ranks: np.ndarray, only: int | None = None) -> tuple[Fragment, ...]:
        """The sources as fragments of world ranks; with ``only``, just that rank's."""
        items = self.entries()
        if only is not None:
            pos = _pos_of(ranks, only)
            items = [i for i in items if i[0] == pos]
        return tuple(
            Fragment(int(ranks[p]), pi, Region(lo, tuple(h - a for a, h in zip(lo, hi, strict=True))))
            for p, pi, lo, hi in items
        )


@dataclass(frozen=True, eq=False)
class GridInfo:
    """What planning an array needs that does not depend on the bytes given to ranks so far.

    ``regular`` is False when the fast planner does not apply (then ``_plan`` plans it).
    In position space: ``single_*`` are boxes of chunks held by one piece only (a direct
    write each), ``groups`` chunks held by several, ``merges`` chunks no piece holds whole.
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
    _involving: dict[int, tuple[np.ndarray, list[_Group], list[_Merge]]] = field(default_factory=dict)
    _single_writes: dict[tuple[int, int], tuple[WriteOp, ...]] = field(default_factory=dict)

    def single_writes(self, pos: int | None, rank: int) -> tuple[WriteOp, ...]:
        """The direct writes of the chunks only position ``pos`` holds, made by ``rank``; memoised."""
        key = (-1 if pos is None else pos, rank)
        got = self._single_writes.get(key)
        if got is None:
            rows = self.involving(pos)[0]
            out = []
            for lo, ext, pi in zip(
                self.single_lo[rows].tolist(),
                self.single_ext[rows].tolist(),
                self.single_piece[rows].tolist(),
                strict=True,
            ):
                region = Region(tuple(lo), tuple(ext))
                out.append(WriteOp(region, rank, (Fragment(rank, pi, region),)))
            got = self._single_writes[key] = tuple(out)
        return got

    def involving(self, pos: int | None) -> tuple[np.ndarray, list[_Group], list[_Merge]]:
        """The direct writes (rows), groups and merges position ``pos`` holds a part of, memoised."""
        got = self._involving.get(-1 if pos is None else pos)
        if got is None:
            if pos is None:
                got = (np.zeros(0, _I64), [], [])
            else:
                got = (
                    np.flatnonzero(self.single_pos == pos),
                    [g for g in self.groups if pos in g.member_set],
                    [m for m in self.merges if pos in m.overlap],
                )
            self._involving[-1 if pos is None else pos] = got
        return got


def _contained(table: PieceTable, chunk: tuple[int, ...], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the box ``[clo, chi)`` of chunk indices lying wholly inside its piece."""
    c = np.asarray(chunk, dtype=_I64)
    n = np.asarray(shape, dtype=_I64)
    end = table.lo + table.ext
    clo = -(-table.lo // c)
    chi = np.where(end < n, end // c, -(-n // c))
    return clo, np.maximum(clo, chi)


def _coverage(lo: np.ndarray, hi: np.ndarray, grid: tuple[int, ...]) -> np.ndarray:
    """How many of the boxes ``[lo, hi)`` cover each cell of ``grid`` (a difference array, summed).

    The work is bounded by the number of cells, not by products over dims: dims of one
    cell are set aside (a box holds that cell or is empty), so the ``2 ** k`` corners of
    the ``k`` dims left number at most the cells, and the difference array has the
    grid's own shape (corners past its end change no cell).
    """
    lo, hi = np.asarray(lo, dtype=_I64), np.asarray(hi, dtype=_I64)
    if any(g == 0 for g in grid):
        return np.zeros(grid, dtype=_I64)
    wide = [d for d, g in enumerate(grid) if g > 1]
    narrow = [d for d, g in enumerate(grid) if g == 1]
    if narrow:  # keep the boxes holding the one cell of each such dim
        keep = ((lo[:, narrow] <= 0) & (hi[:, narrow] >= 1)).all(axis=1)
        lo, hi = lo[keep][:, wide], hi[keep][:, wide]
    sub = tuple(grid[d] for d in wide)
    if not sub:
        return np.full(grid, len(lo), dtype=_I64)
    diff = np.zeros(sub, dtype=_I64)
    for corner in range(1 << len(sub)):
        idx = [np.where((corner >> k) & 1, hi[:, k], lo[:, k]) for k in range(len(sub))]
        inside = np.ones(len(lo), dtype=bool)
        for k, n in enumerate(sub):
            inside &= idx[k] < n
        sign = -1 if bin(corner).count("1") % 2 else 1
        np.add.at(diff, tuple(i[inside] for i in idx), sign)
    for k in range(len(sub)):
        diff = np.cumsum(diff, axis=k)
    return diff.reshape(grid)


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
        ubox, inverse, _ = unique_rows(boxes)
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
    # Replicated boxes: grouped by their holder positions.
    by_members: dict[tuple[int, ...], list[int]] = defaultdict(list)
    rep_rows = rows[~one]
    rep_box = inverse[~one]
    # Each replicated box's holders, by position (a position holds a box once: regular).
    pieces_of_box: dict[int, dict[int, int]] = {}
    if len(rep_rows):
        rpos, rpiece = table.pos[rep_rows], table.piece[rep_rows]
        order = np.lexsort((rpos, rep_box))
        rb, rpos, rpiece = rep_box[order], rpos[order], rpiece[order]
        bounds = np.flatnonzero(np.diff(rb)) + 1
        for b, ps, pis in zip(
            rb[np.r_[0, bounds]].tolist(), np.split(rpos, bounds), np.split(rpiece, bounds), strict=True
        ):
            pos_list = ps.tolist()
            by_members[tuple(pos_list)].append(b)
            pieces_of_box[b] = dict(zip(pos_list, pis.tolist(), strict=True))
    groups = []
    for mem, bs in by_members.items():
        chunks: list[tuple[int, ...]] = []
        box_of: dict[tuple[int, ...], dict[int, int]] = {}
        for b in bs:
            cs = _box_indices(ubox[b, :nd].tolist(), ubox[b, nd:].tolist())
            chunks.extend(cs)
            box_of.update(dict.fromkeys(cs, pieces_of_box[b]))
        chunks.sort()
        sizes = {ci: _chunk_size(ci, chunk, shape) * itemsize for ci in chunks}
        groups.append(_Group(mem, np.asarray(mem, dtype=_I64), chunks, sizes, box_of))
    groups.sort(key=lambda g: (len(g.members), g.members))
    # Merged chunks: those no piece holds whole, in row-major order.
    merges = []
    end = table.lo + table.ext
    for cidx in np.argwhere(cover == 0).tolist():
        creg = Region(
            tuple(i * k for i, k in zip(cidx, chunk, strict=True)),
            tuple(min(k, s - i * k) for i, k, s in zip(cidx, chunk, shape, strict=True)),
        )
        merges.append(_make_merge(table, end, creg))
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
    )


class _GridSources(_Sources):
    """The sources of a merged write on a grid of boxes, listed only when asked for."""

    __slots__ = ("merge", "mine", "own", "writer")

    def __init__(self, merge: _Merge, writer: int, own: list[tuple[int, int]], mine: set[int]) -> None:
        self.merge, self.writer, self.own, self.mine = merge, writer, own, mine

    def has(self, pos: int) -> bool:
        if pos == self.writer:
            return bool(self.own)
        m = self.merge
        firsts = m.first_boxes.get(pos, ())
        return any(b not in self.mine for b in firsts)

    def fragments(self, ranks: np.ndarray, only: int | None = None) -> tuple[Fragment, ...]:
        if only is None or _pos_of(ranks, only) == self.writer:
            return super().fragments(ranks, only)
        pos = _pos_of(ranks, only)
        m = self.merge
        boxes = [] if pos is None else [b for b in m.first_boxes.get(pos, ()) if b not in self.mine]
        boxes.sort(key=m.base_index.__getitem__)
        return tuple(
            Fragment(only, m.first_piece[b], Region(lo, tuple(h - a for a, h in zip(lo, hi, strict=True))))
            for b in boxes
            for lo, hi in (m.box(b),)
        )

    def entries(self) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
        m = self.merge
        out = [(self.writer, pi, *m.box(b)) for pi, b in self.own]
        out += [(*m.first(b), *m.box(b)) for b in m.base if b not in self.mine]
        return out


def _make_merge(table: PieceTable, end: np.ndarray, creg: Region) -> _Merge:
    clo = np.asarray(creg.offset, dtype=_I64)
    chi = clo + np.asarray(creg.shape, dtype=_I64)
    ilo = np.maximum(table.lo, clo)
    ihi = np.minimum(end, chi)
    hit = np.flatnonzero((ihi > ilo).all(axis=1))
    hpos, hpiece, hlo, hhi = table.pos[hit], table.piece[hit], ilo[hit], ihi[hit]
    if not len(hit):
        nothing = np.zeros(0, _I64)
        return _Merge(creg, hpos, hpiece, hlo, hhi, {}, (), nothing, nothing, [], [], nothing, [], False)
    upos, inv = np.unique(hpos, return_inverse=True)
    ov = np.zeros(len(upos), dtype=_I64)
    np.add.at(ov, inv.reshape(-1), np.prod(hhi - hlo, axis=1))
    overlap = dict(zip(upos.tolist(), ov.tolist(), strict=True))
    tied_at = np.flatnonzero(ov == ov.max())
    ubox, binv, _ = unique_rows(np.concatenate([hlo, hhi], axis=1))
    row_ov = ov[inv.reshape(-1)]
    order = np.lexsort((hpiece, hpos, -row_ov, binv))
    # Each box's best holder: the first of its run in ``order`` (boxes come in index order).
    sb = binv[order]
    first = order[np.flatnonzero(np.r_[True, sb[1:] != sb[:-1]])]
    fpos, fpiece = hpos[first], hpiece[first]
    # Boxes in the order their first holders come when the writer holds none of them.
    base = np.lexsort((fpiece, fpos, -ov[np.searchsorted(upos, fpos)])).tolist()
    return _Merge(
        creg,
        hpos,
        hpiece,
        hlo,
        hhi,
        overlap,
        tuple(tied_at.tolist()),
        upos,
        ubox,
        fpos.tolist(),
        fpiece.tolist(),
        binv,
        base,
        _is_grid(ubox, clo, chi),
    )


def _is_grid(ubox: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> bool:
    """True when the boxes ``ubox`` (lo | hi rows, distinct) are every cell of a grid over ``[lo, hi)``."""
    nd = len(lo)
    cells = 1
    for d in range(nd):
        iv = unique_rows(ubox[:, [d, nd + d]])[0]
        if iv[0, 0] != lo[d] or iv[-1, 1] != hi[d] or (iv[1:, 0] != iv[:-1, 1]).any():
            return False
        cells *= len(iv)
    return cells == len(ubox)


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
    merged: dict[int, WriteOp | _LazyMerge]

    def __len__(self) -> int:
        return len(self.writer)

    def to_plan(self, rows: Sequence[int] | None = None, rank: int | None = None) -> ArraySavePlan:
        """The :class:`ArraySavePlan` of these writes (or of ``rows`` of them).

        With ``rank``, a merged write that ``rank`` feeds but does not write keeps only
        ``rank``'s own fragments: what that rank sends, and to whom.
        """
        sel = list(range(len(self.writer))) if rows is None else list(rows)
        off, ext = self.offset[sel].tolist(), self.extent[sel].tolist()
        writer, piece = self.writer[sel].tolist(), self.piece[sel].tolist()
        writes = []
        for j, i in enumerate(sel):
            op = self.merged.get(i)
            if op is None:
                region = Region(tuple(off[j]), tuple(ext[j]))
                op = WriteOp(region, writer[j], (Fragment(writer[j], piece[j], region),))
            else:
                if isinstance(op, _LazyMerge):
                    op = op.op(None if rank == op.writer else rank)
                elif rank is not None and rank != op.writer:
                    op = WriteOp(op.region, op.writer, tuple(f for f in op.sources if f.rank == rank))
            writes.append(op)
        return ArraySavePlan(self.key, self.shape, self.itemsize, self.chunk_shape, tuple(writes))

    def rows_of(self, rank: int) -> list[int]:
        """Rows whose write involves ``rank``, as writer or as a source."""
        rows = set(np.flatnonzero(self.writer == rank).tolist())
        for i, op in self.merged.items():
            if isinstance(op, _LazyMerge):
                if op.has_source(rank):
                    rows.add(i)
            elif any(s.rank == rank for s in op.sources):
                rows.add(i)
        return sorted(rows)


@dataclass(frozen=True, slots=True)
class _LazyMerge:
    """A merged write whose sources are kept in layout positions until asked for."""

    chunk: Region
    writer: int
    sources: _Sources
    ranks: np.ndarray

    def has_source(self, rank: int) -> bool:
        pos = _pos_of(self.ranks, rank)
        return pos is not None and self.sources.has(pos)

    def op(self, only: int | None = None) -> WriteOp:
        """The write; with ``only``, keeping just the fragments of that rank."""
        return WriteOp(self.chunk, self.writer, self.sources.fragments(self.ranks, only))


def _table_of_plan(ap: ArraySavePlan) -> ArraySaveTable:
    nd = len(ap.shape)
    merged: dict[int, WriteOp | _LazyMerge] = {i: w for i, w in enumerate(ap.writes) if not w.is_direct}
    return ArraySaveTable(
        ap.key,
        ap.shape,
        ap.itemsize,
        ap.chunk_shape,
        np.asarray([w.region.offset for w in ap.writes], dtype=_I64).reshape(len(ap.writes), nd),
        np.asarray([w.region.shape for w in ap.writes], dtype=_I64).reshape(len(ap.writes), nd),
        np.asarray([w.writer for w in ap.writes], dtype=_I64),
        np.asarray([-1 if i in merged else w.sources[0].piece for i, w in enumerate(ap.writes)], dtype=_I64),
        merged,
    )


_Decision = tuple[list[int], list[int], int, int, "_LazyMerge | None"]  # offset, extent, writer, piece, merge


def _decide(
    spec: ArraySpec,
    info: GridInfo,
    ranks: np.ndarray,
    scopes: Scopes,
    groups: list[_Group],
    merges: list[_Merge],
    emit: int | None = None,
    emit_pos: int | None = None,
) -> list[_Decision]:
    """The writes of ``groups`` (replicated chunks) and ``merges``, adding their bytes to ``scopes``.

    With ``emit``, only the writes involving that rank are returned.
    """
    out: list[_Decision] = []
    # Replicated chunks: balanced over their holders.
    placement = (spec.ranks, len(ranks))
    for g in groups:
        holders, key = g.scope(ranks, placement)
        before = scopes.get(key)
        memo_key = b"" if before is None else np.asarray(before, dtype=_I64).tobytes()
        hit = g.memo.get(memo_key)
        if hit is None:
            local = [0] * len(holders) if before is None else list(before)
            assign = _water_fill(g.chunks, g.sizes, local)
            hit = g.memo[memo_key] = (assign, local)
        assign = hit[0]
        scopes[key] = hit[1]
        by_source: dict[tuple[int, int], list[tuple[int, ...]]] = defaultdict(list)
        for ci, k in assign.items():
            if emit is None or holders[k] == emit:
                by_source[(k, g.pieces[ci][g.members[k]])].append(ci)
        for (k, pi), idxs in sorted(by_source.items()):
            boxes = [(idxs[0], tuple(i + 1 for i in idxs[0]))] if len(idxs) == 1 else _coalesce(idxs)
            for lo, hi in boxes:
                a = [i * c for i, c in zip(lo, info.chunk_shape, strict=True)]
                b = [min(i * c, n) for i, c, n in zip(hi, info.chunk_shape, spec.shape, strict=True)]
                out.append((a, [y - x for x, y in zip(a, b, strict=True)], holders[k], pi, None))
    # Merged chunks: the rank holding most of each, ties to the least loaded of its feeders, then the lowest.
    for m in merges:
        if not m.overlap:
            raise LayoutError(f"leaf {spec.key!r}: elements {m.chunk} are held by no rank, so they cannot be saved")
        feeders, key = m.scope(ranks, placement)
        local = scope_loads(scopes, key, len(feeders))
        if len(m.tied_at) == 1:
            at = m.tied_at[0]
        elif len(m.tied_at) == len(feeders):  # every feeder holds as much: the least loaded of all
            at = local.index(min(local))
        else:
            at = min(m.tied_at, key=local.__getitem__)
        local[at] += m.chunk.size * spec.itemsize
        scopes[key] = local
        writer_pos = int(m.overlap_arr[at])
        writer = feeders[at]
        if emit is not None and writer != emit:
            # ``emit`` feeds the chunk only if it is the first holder of a distinct box the writer lacks
            if emit_pos not in m.first_holders:
                continue
            sources = m.sources_for(spec.key, writer_pos)
            if not sources.has(emit_pos):  # type: ignore[arg-type]
                continue
        else:
            sources = m.sources_for(spec.key, writer_pos)
        lazy = _LazyMerge(m.chunk, writer, sources, ranks)
        out.append((list(m.chunk.offset), list(m.chunk.shape), writer, -1, lazy))
    return out


def _plan_array(
    spec: ArraySpec, world: int, options: ChunkingOptions, scopes: Scopes, info: GridInfo | None = None
) -> ArraySaveTable:
    """One array's writes, adding the bytes each scope gives its ranks to ``scopes``."""
    if info is None:
        info = grid_info(spec.layout, spec.shape, spec.itemsize, options)
    ranks, monotonic = _placement(spec)
    if not info.regular or not monotonic or (len(ranks) and (ranks[0] < 0 or ranks[-1] >= world)):
        return _plan_reference(spec, world, options, scopes)
    nd = len(spec.shape)
    extra = _decide(spec, info, ranks, scopes, info.groups, info.merges)
    # Chunks with one holder: a direct write each.
    offset, extent = info.single_lo, info.single_ext
    writer_a, piece_a = ranks[info.single_pos], info.single_piece
    if extra:
        offset = np.concatenate([offset, np.asarray([e[0] for e in extra], dtype=_I64).reshape(len(extra), nd)])
        extent = np.concatenate([extent, np.asarray([e[1] for e in extra], dtype=_I64).reshape(len(extra), nd)])
        writer_a = np.concatenate([writer_a, np.asarray([e[2] for e in extra], dtype=_I64)])
        piece_a = np.concatenate([piece_a, np.asarray([e[3] for e in extra], dtype=_I64)])
    order = np.lexsort(offset.T[::-1]) if nd else np.arange(len(writer_a))
    row_of = np.empty(len(order), dtype=_I64)
    row_of[order] = np.arange(len(order))
    base = len(info.single_pos)
    merged: dict[int, WriteOp | _LazyMerge] = {
        int(row_of[base + j]): e[4] for j, e in enumerate(extra) if e[4] is not None
    }
    return ArraySaveTable(
        spec.key,
        spec.shape,
        spec.itemsize,
        info.chunk_shape,
        offset[order],
        extent[order],
        writer_a[order],
        piece_a[order],
        merged,
    )


def _plan_array_rank(
    spec: ArraySpec, world: int, options: ChunkingOptions, scopes: Scopes, rank: int, info: GridInfo
) -> ArraySavePlan:
    """``rank``'s part of one array's writes; only the scopes containing ``rank`` are followed."""
    ranks, monotonic = _placement(spec)
    if not info.regular or not monotonic or (len(ranks) and (ranks[0] < 0 or ranks[-1] >= world)):
        table = _plan_reference(spec, world, options, scopes)
        return table.to_plan(table.rows_of(rank), rank)
    pos = _pos_of(ranks, rank)
    _, groups, merges = info.involving(pos)
    writes = list(info.single_writes(pos, rank))
    for lo, ext, writer, piece, lazy in _decide(spec, info, ranks, scopes, groups, merges, rank, pos):
        if lazy is None:
            region = Region(tuple(lo), tuple(ext))
            writes.append(WriteOp(region, writer, (Fragment(writer, piece, region),)))
        else:
            writes.append(lazy.op(None if rank == lazy.writer else rank))
    writes.sort(key=lambda w: w.region.offset)
    return ArraySavePlan(spec.key, spec.shape, spec.itemsize, info.chunk_shape, tuple(writes))


_PLACEMENTS = _Memo(1024)


def _placement(spec: ArraySpec) -> tuple[np.ndarray, bool]:
    """The world rank of each layout position, and whether they ascend; memoised per placement."""

    def make() -> tuple[np.ndarray, bool]:
        ranks = spec.rank_array()
        return ranks, len(ranks) < 2 or bool((np.diff(ranks) > 0).all())

    return _PLACEMENTS.get_or((spec.ranks, spec.layout.world_size), make)  # type: ignore[no-any-return]


def _plan_reference(spec: ArraySpec, world: int, options: ChunkingOptions, scopes: Scopes) -> ArraySaveTable:
    return _table_of_plan(_plan_array_save(spec.array_layout(world), options, scopes))


def _check_placement(s: ArraySpec, world: int) -> None:
    size = s.layout.world_size
    top = size - 1
    if isinstance(s.ranks, range) and len(s.ranks):
        top = max(s.ranks[0], s.ranks[-1])
    elif s.ranks is not None and len(s.ranks):
        top = max(s.ranks)
    if size > world or top >= world:
        raise LayoutError(f"leaf {s.key!r}: its layout spans ranks beyond the world of {world}")


def _check_world(specs: Sequence[ArraySpec], world: int) -> None:
    seen: set[tuple[int, Any]] = set()
    for s in specs:
        where = (id(s.layout), s.ranks)
        if where not in seen:
            _check_placement(s, world)
            seen.add(where)


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
    scopes: Scopes = {}
    return [_plan_array(s, world, options, scopes) for s in specs]


def rank_part(tables: Sequence[ArraySaveTable], world: int, rank: int) -> SavePlan:
    """The part of a global plan that involves ``rank``: every array, with only the writes it writes or feeds.

    A merged write the rank feeds but does not write keeps only the rank's own fragments.
    """
    return SavePlan(world, tuple(t.to_plan(t.rows_of(rank), rank) for t in tables))


def plan_save_rank(
    specs: Sequence[ArraySpec], world: int, rank: int, options: ChunkingOptions | None = None
) -> SavePlan:
    """``rank``'s part of the global save plan, computed from the arrays ``rank`` holds.

    Equal to ``rank_part(plan_save_tables(specs, world), world, rank)``. Writers are
    balanced within scopes (the ranks able to take a chunk), every scope deciding this
    rank's writes contains it, so the arrays it holds no piece of are never planned:
    they contribute their chunk grid only.
    """
    options = options or ChunkingOptions()
    grids: dict[tuple[int, tuple[int, ...], int], GridInfo] = {}
    placed: dict[tuple[int, Any], bool] = {}  # (layout, ranks) -> whether ``rank`` holds a piece
    scopes: Scopes = {}
    out = []
    for s in specs:
        where = (id(s.layout), s.ranks)
        hit = placed.get(where)
        if hit is None:
            _check_placement(s, world)
            hit = placed[where] = bool((s.rank_array() == rank).any())
        k = (id(s.layout), s.shape, s.itemsize)
        info = grids.get(k)
        if info is None:
            info = grids[k] = grid_info(s.layout, s.shape, s.itemsize, options)
        if not hit:
            out.append(ArraySavePlan(s.key, s.shape, s.itemsize, info.chunk_shape, ()))
            continue
        out.append(_plan_array_rank(s, world, options, scopes, rank, info))
    return SavePlan(world, tuple(out))
