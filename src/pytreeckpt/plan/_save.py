"""Save planning: each stored array's chunk grid, and who writes which chunks from which pieces.

One planner, columnar, used at every scale: for every rank at once (one process holding
every rank's shards) or for one rank's own part (a rank among thousands).

Per array, what does not depend on the bytes already given to ranks is computed once
per (layout, shape, element size, chunking) and shared by every array of that layout
(a model's layers have a few): the chunk grid, the *cells* (boxes of chunks held whole
by the same set of positions), and the chunks no piece holds whole. Then per array:

- a cell held by one position is written by it, as one box;
- cells held by several (replicated data) are balanced over their holders, by bytes,
  within their *scope* (the set of holders), the loads carrying over from array to array;
- a chunk no piece holds whole is *merged*: written by the rank holding most of it
  (ties to the least loaded of its feeders, then the lowest rank) from the fragments
  its feeders send.

Every scope deciding a rank's writes contains the rank, so a rank's part depends only on
the arrays it holds: it plans those and nothing else. Pure: no I/O, no clock, no rank
taken from globals.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytreeckpt.core._errors import LayoutError
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region, region_of
from pytreeckpt.core._rows import rows_all, rows_prod

from ._balance import Box, Loads, Scopes, coalesce, scope_key, scope_loads, subtract_box, water_fill
from ._chunking import chunk_shape_of_table
from ._tables import _I64, PieceTable, Placed, _Memo, first_of_runs, piece_table, placed, rows_like, unique_rows
from ._types import (
    ArraySavePlan,
    ArraySpec,
    ChunkingOptions,
    Fragment,
    SavePlan,
    WriteOp,
    array_save_plan_of,
    check_placement,
    fragment_of,
    placement_of,
    write_of,
)

__all__ = ["check_complete", "plan_save", "plan_whole"]


# --------------------------------------------------------------------------- structure


@dataclass(eq=False)
class _Group:
    """Chunks held whole by the same two or more positions (replicated data), row-major."""

    holders: tuple[int, ...]  # positions, ascending
    chunks: list[int]  # flat chunk indices, ascending
    sizes: list[int]  # bytes of each chunk
    pieces: list[tuple[int, ...]]  # per chunk: each holder's lowest piece holding it
    memo: dict[bytes, tuple[list[int], np.ndarray]] = field(default_factory=dict)
    scopes: dict[Any, bytes] = field(default_factory=dict)

    def scope_key(self, ranks: np.ndarray, placement: Any) -> bytes:
        """The key of the scope of the holders' world ranks under ``placement`` (memoised)."""
        got = self.scopes.get(placement)
        if got is None:
            got = self.scopes[placement] = scope_key(ranks[list(self.holders)])
        return got

    def fill(self, loads: Loads) -> tuple[bytes | int, list[int]]:
        """Each chunk's holder index given the holders' loads, which it updates in place (memoised).

        The filling depends on the loads' differences only, so equal patterns of loads
        (layer after layer of a model) share one computation; that pattern is returned
        with the filling, as the key of the decision. A group of one chunk hands it to the
        least loaded holder, the lowest of ties (as :func:`water_fill` does), and that
        holder is the key: a norm weight held by 1,024 ranks costs no pattern of 1,024 loads.
        """
        if len(self.sizes) == 1:
            at = loads.give(self.sizes[0])
            return at, [at]
        values = loads.values
        rel = values - values.min()
        key = rel.tobytes()
        got = self.memo.get(key)
        if got is None:
            after = rel.tolist()
            assign = water_fill(self.sizes, after)
            got = self.memo[key] = (assign, np.asarray(after, dtype=np.int64) - rel)
        values += got[1]
        return key, got[0]


Part = tuple[int, int, tuple[int, ...], tuple[int, ...]]
"""(position, piece, lo, hi): the box ``[lo, hi)`` of a piece."""


@dataclass(eq=False)
class _Merge:
    """A chunk no piece holds whole: the parts of it each position holds, and the order they are taken in.

    When position ``w`` writes the chunk, its fragments are taken in this order: ``w``'s
    own parts (by piece), then every other part by how much of the chunk its position
    holds (most first), then by position and piece; a part equal to one already taken
    adds nothing (replicas), and each part gives what is still missing of the chunk.
    Parts stay in columns; lists are made only for the positions asked about.
    """

    chunk: Region
    feeders: tuple[int, ...]  # positions holding a part, ascending
    overlap: np.ndarray  # elements of the chunk each feeder holds (summed over its pieces)
    pos: np.ndarray  # per part, in table order (position, then piece)
    piece: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    box: np.ndarray  # per part, its distinct box
    base: np.ndarray  # each distinct box once, from its first part in the shared order: part indices
    is_grid: bool  # the distinct boxes are the cells of a grid over the chunk
    nbytes: int  # bytes of the chunk
    _sources: dict[int, list[Part]] = field(default_factory=dict)
    _scopes: dict[Any, bytes] = field(default_factory=dict)
    _tied: np.ndarray | None = None
    _sent: dict[int, tuple[list[tuple[int, Part]], frozenset[int]]] = field(default_factory=dict)
    _holding: dict[int, frozenset[int]] = field(default_factory=dict)
    _ptr: list[int] | None = None

    def scope_key(self, ranks: np.ndarray, placement: Any) -> bytes:
        got = self._scopes.get(placement)
        if got is None:
            got = self._scopes[placement] = scope_key(ranks[self.pos[first_of_runs(self.pos)]])
        return got

    def writer_at(self, loads: Loads) -> int:
        """The index (in ``feeders``) of the writer: most of the chunk, then least loaded, then lowest."""
        if self._tied is None:
            self._tied = np.flatnonzero(self.overlap == self.overlap.max())
        tied = self._tied
        if len(tied) == 1:
            return int(tied[0])
        if len(tied) == len(loads.values):
            return loads.least()
        return int(tied[loads.values[tied].argmin()])

    def _parts(self, idx: np.ndarray) -> list[Part]:
        nd = self.lo.shape[1]
        return [
            (p, pi, tuple(row[:nd]), tuple(row[nd:]))
            for p, pi, row in zip(
                self.pos[idx].tolist(),
                self.piece[idx].tolist(),
                np.concatenate([self.lo[idx], self.hi[idx]], axis=1).tolist(),
                strict=True,
            )
        ]

    def _of(self, pos: int) -> np.ndarray:
        """Part indices of position ``pos`` (parts are in table order: by position, then piece)."""
        a, b = np.searchsorted(self.pos, [pos, pos + 1])
        return np.arange(a, b)

    def _own(self, pos: int) -> np.ndarray:
        """Part indices of position ``pos``, one per distinct box (its lowest piece), by piece."""
        idx = self._of(pos)
        _, first = np.unique(self.box[idx], return_index=True)
        return idx[np.sort(first)]

    def _order(self, writer: int) -> np.ndarray:
        """The part indices ``writer`` takes fragments from: its own, then each other distinct box once."""
        own = self._own(writer)
        rest = self.base[~np.isin(self.box[self.base], self.box[own])]
        return np.concatenate([own, rest])

    def written(self, key: str, writer: int, ranks: np.ndarray) -> tuple[Fragment, ...]:
        """The fragments, of world ranks ``ranks``, assembling the chunk when position ``writer`` writes it."""
        if not self.is_grid:
            return _fragments(ranks, self.sources(key, writer))
        idx = self._order(writer)  # (grid cells are taken whole: fragments straight from the columns)
        lo = map(tuple, self.lo[idx].tolist())
        ext = map(tuple, (self.hi[idx] - self.lo[idx]).tolist())
        return tuple(map(fragment_of, ranks[self.pos[idx]].tolist(), self.piece[idx].tolist(), map(region_of, lo, ext)))

    def sources(self, key: str, writer: int) -> list[Part]:
        """The fragments assembling the chunk when position ``writer`` writes it (memoised)."""
        got = self._sources.get(writer)
        if got is not None:
            return got
        order = self._parts(self._order(writer))
        got = order if self.is_grid else _cover(key, self.chunk, order)  # grid cells are taken whole
        self._sources[writer] = got
        return got

    def sources_from(self, key: str, writer: int, pos: int) -> list[Part]:
        """The fragments position ``pos`` (not the writer) sends to ``writer``."""
        if not self.is_grid:
            return [p for p in self.sources(key, writer) if p[0] == pos]
        mine, boxes = self._mine(pos)
        if not mine:
            return []
        held = self._held_by(writer)
        if held.isdisjoint(boxes):
            return [part for _, part in mine]
        return [part for box, part in mine if box not in held]

    def sent(
        self, key: str, writer: int, pos: int, ranks: np.ndarray, memo: dict[Any, tuple[Fragment, ...]]
    ) -> tuple[Fragment, ...]:
        """:meth:`sources_from` as fragments of world ranks ``ranks``, memoised in ``memo`` (the placement's) on
        what ``pos`` sends: mostly the same whoever writes (a writer holds nothing ``pos`` holds but replicas)."""
        if self.is_grid:
            holding = self._holding.get(pos)
            if holding is None:  # the positions holding a box of pos's (pos's replicas, and pos)
                boxes = self._mine(pos)[1]
                holding = self._holding[pos] = frozenset(self.pos[np.isin(self.box, list(boxes))].tolist())
            if writer not in holding:  # (the writer holds none of pos's boxes: pos sends them all)
                got = memo.get((self, pos))
                if got is None:
                    got = memo[(self, pos)] = _fragments(ranks, [part for _, part in self._mine(pos)[0]])
                return got
        sources = self.sources_from(key, writer, pos)
        fkey = tuple(sources)
        got = memo.get(fkey)
        if got is None:
            got = memo[fkey] = _fragments(ranks, sources)
        return got

    def _mine(self, pos: int) -> tuple[list[tuple[int, Part]], frozenset[int]]:
        """Position ``pos``'s parts among the distinct boxes, in the shared order, with their boxes (memoised)."""
        got = self._sent.get(pos)
        if got is None:
            idx = self.base[self.pos[self.base] == pos]
            mine = list(zip(self.box[idx].tolist(), self._parts(idx), strict=True))
            got = self._sent[pos] = (mine, frozenset(b for b, _ in mine))
        return got

    def _held_by(self, writer: int) -> set[int]:
        """The boxes position ``writer`` holds itself."""
        if self._ptr is None:
            self._ptr = np.searchsorted(self.pos, np.asarray((*self.feeders, self.feeders[-1] + 1))).tolist()
        k = bisect_left(self.feeders, writer)
        a, b = self._ptr[k], self._ptr[k + 1]
        return {int(self.box[a])} if b == a + 1 else set(self.box[a:b].tolist())


def _cover(key: str, chunk: Region, order: list[Part]) -> list[Part]:
    """Take from each part, in order, what is still missing of ``chunk``."""
    got: list[Part] = []
    uncovered: list[Box] = [(chunk.offset, chunk.stop)]
    for pos, piece, plo, phi in order:
        rest: list[Box] = []
        for ulo, uhi in uncovered:
            glo = tuple(map(max, ulo, plo))
            ghi = tuple(map(min, uhi, phi))
            if any(h <= a for a, h in zip(glo, ghi, strict=True)):
                rest.append((ulo, uhi))
                continue
            got.append((pos, piece, glo, ghi))
            rest.extend(subtract_box(ulo, uhi, glo, ghi))
        uncovered = rest
        if not uncovered:
            break
    if uncovered:
        lo, hi = uncovered[0]
        first = Region(lo, tuple(h - a for a, h in zip(lo, hi, strict=True)))
        raise LayoutError(
            f"leaf {key!r}: elements {first} (and {len(uncovered) - 1} more boxes) are held by no rank, "
            f"so they cannot be saved"
        )
    return got


def _tile_grid(ubox: np.ndarray, chunk: Region) -> bool:
    """True when the distinct boxes ``ubox`` (lo | hi rows) are every cell of a grid over ``chunk``."""
    nd = chunk.ndim
    cells = 1
    for d in range(nd):
        iv = unique_rows(ubox[:, [d, nd + d]])[0]
        if iv[0, 0] != chunk.offset[d] or iv[-1, 1] != chunk.stop[d] or (iv[1:, 0] != iv[:-1, 1]).any():
            return False
        cells *= len(iv)
    return cells == len(ubox)


@dataclass(eq=False)
class _Structure:
    """What planning an array needs that does not depend on the bytes given to ranks so far.

    In positions of a table whose position order is world-rank order.
    """

    grid: ChunkGrid
    table: PieceTable
    itemsize: int
    # cells held whole by one position: a direct write each (chunk-index boxes)
    single_pos: np.ndarray
    single_piece: np.ndarray
    single_lo: np.ndarray
    single_hi: np.ndarray
    # per single cell: True where the cell is a whole box the position writes alone, False
    # where it is one chunk among others its (position, piece) writes (overlapping layouts)
    single_box: bool
    groups: list[_Group]
    uncovered: np.ndarray  # flat indices of the chunks no piece holds whole, ascending
    _index: _PartIndex | None = None
    _merges: dict[int, _Merge] = field(default_factory=dict)
    _by_pos: dict[int, tuple[np.ndarray, list[_Group], list[int]]] = field(default_factory=dict)

    def involving(self, pos: int) -> tuple[np.ndarray, list[_Group], list[int]]:
        """The single cells, groups and merged chunks position ``pos`` takes part in (memoised)."""
        got = self._by_pos.get(pos)
        if got is None:
            got = self._by_pos[pos] = (
                np.flatnonzero(self.single_pos == pos),
                [g for g in self.groups if pos in g.holders],
                self.merged_touched_by(pos),
            )
        return got

    def merged_touched_by(self, pos: int) -> list[int]:
        """Flat indices of the merged chunks position ``pos`` holds a part of, ascending."""
        if not len(self.uncovered):
            return []
        t = self.table
        rows = np.flatnonzero(t.pos == pos)
        if not len(rows):
            return []
        _, flat = self.grid.cells(*self.grid.touched(t.lo[rows], t.ext[rows]))
        u = self.uncovered  # (ascending: a search finds the few chunks of a position among many)
        at = np.minimum(np.searchsorted(u, flat), len(u) - 1)
        return np.unique(flat[u[at] == flat]).tolist()  # type: ignore[no-any-return]

    def merge(self, flat: int) -> _Merge:
        got = self._merges.get(flat)
        if got is None:
            got = self._merges[flat] = self._make_merge(flat)
        return got

    def _make_merge(self, flat: int) -> _Merge:
        chunk = self.grid.region(self.grid.unflat(flat))
        t = self.table
        if self._index is None and len(self._merges) < 8:
            rows = _meeting(t, chunk)  # (a rank's part merges a chunk or two: a scan costs less than an index)
        else:
            if self._index is None:
                self._index = _PART_INDEXES.get_or(id(t), lambda: _PartIndex(t))
                if self._index.table is not t:  # an id reused after its table was dropped
                    self._index = _PART_INDEXES[id(t)] = _PartIndex(t)
            rows = self._index.intersecting(chunk)
        nd = self.grid.ndim
        lo = np.maximum(t.lo[rows], np.asarray(chunk.offset, dtype=_I64))
        hi = np.minimum(t.lo[rows] + t.ext[rows], np.asarray(chunk.stop, dtype=_I64))
        pos, piece = t.pos[rows], t.piece[rows]
        sizes = rows_prod(hi - lo) if nd else np.ones(len(rows), dtype=_I64)
        # (rows are in table order, by position then piece: each feeder's parts are a run)
        starts = first_of_runs(pos)
        feeders = pos[starts]
        inverse = np.cumsum(np.r_[False, pos[1:] != pos[:-1]]) if len(pos) else np.zeros(0, dtype=_I64)
        overlap = np.add.reduceat(sizes, starts) if len(pos) else np.zeros(0, dtype=_I64)
        ubox, box, _ = unique_rows(np.concatenate([lo, hi], axis=1))
        # the shared order: most of the chunk first, then position, then piece; each
        # distinct box from its first part in that order, the boxes in that order
        if len(overlap) and overlap.min() == overlap.max():
            shared = np.arange(len(pos))  # (every feeder holds as much: table order)
        else:
            shared = np.lexsort((piece, pos, -overlap[inverse]))
        _, first = np.unique(box[shared], return_index=True)
        base = shared[np.sort(first)]
        return _Merge(
            chunk,
            tuple(feeders.tolist()),
            overlap,
            pos,
            piece,
            lo,
            hi,
            box,
            base,
            _tile_grid(ubox, chunk),
            chunk.size * self.itemsize,
        )


def _meeting(table: PieceTable, box: Region) -> np.ndarray:
    """Rows of ``table`` whose non-empty boxes meet ``box``, in table order (what :class:`_PartIndex` finds).

    A dim at a time, each over the rows the dims before it left: a chunk meets a few of 16,384
    positions' boxes along the dim they are sharded on, so the later dims cost little.
    """
    lo, ext = table.lo, table.ext
    if not box.ndim:
        return np.arange(len(table.pos))
    rows = None
    for d, (a, b) in enumerate(zip(box.offset, box.stop, strict=True)):
        start, e = (lo[:, d], ext[:, d]) if rows is None else (lo[rows, d], ext[rows, d])
        hit = (start < b) & (start + e > a) & (e > 0)
        rows = np.flatnonzero(hit) if rows is None else rows[hit]
    assert rows is not None
    return rows


class _PartIndex:
    """Finds the rows of a table whose boxes meet a box, without scanning every row."""

    def __init__(self, table: PieceTable) -> None:
        self.table = table
        nd = table.lo.shape[1]
        nonempty = np.flatnonzero(rows_all(table.ext > 0)) if nd else np.arange(len(table.pos))
        self.rows = nonempty
        if nd == 0 or not len(nonempty):
            self.dim = -1
            return
        # sweep along the dim where the boxes start at the most distinct places
        lo = table.lo[nonempty]
        self.dim = _sweep_dim(lo)
        order = np.argsort(lo[:, self.dim], kind="stable")
        self.rows = nonempty[order]
        self.start = table.lo[self.rows, self.dim]
        self.reach = np.maximum.accumulate(self.start + table.ext[self.rows, self.dim])

    def intersecting(self, box: Region) -> np.ndarray:
        """Rows meeting ``box``, in table order."""
        t = self.table
        if self.dim < 0:
            return np.sort(self.rows)
        a, b = box.offset[self.dim], box.stop[self.dim]
        first = int(np.searchsorted(self.reach, a, side="right"))
        last = int(np.searchsorted(self.start, b, side="left"))
        cand = self.rows[first:last]
        lo, hi = t.lo[cand], t.lo[cand] + t.ext[cand]
        meets = rows_all(lo < np.asarray(box.stop, dtype=_I64)) & rows_all(hi > np.asarray(box.offset, dtype=_I64))
        return np.sort(cand[meets])


_STRUCTURES = _Memo(4096)
_PART_INDEXES = _Memo(4096)  # id of a table -> its index (which keeps the table alive), shared by its structures


def _structure(p: Placed, itemsize: int, opts: ChunkingOptions) -> _Structure:
    """The save structure of a placed layout (memoised on it, and shared by placements of one table)."""
    return p.per_table(("save", itemsize, opts), _STRUCTURES, lambda: _make_structure(p.table, p.shape, itemsize, opts))


def _grid_of(
    table: PieceTable, shape: tuple[int, ...], itemsize: int, opts: ChunkingOptions
) -> tuple[ChunkGrid, _Structure | None]:
    """The chunk grid of an array laid out as ``table``, and its structure if it has no chunk (a zero-size array)."""
    grid = ChunkGrid(shape, chunk_shape_of_table(table, shape, itemsize, opts))
    if grid.count:
        return grid, None
    empty, none = np.zeros((0, len(shape)), dtype=_I64), np.zeros(0, dtype=_I64)
    return grid, _Structure(grid, table, itemsize, none, none, empty, empty, True, [], none)


def _make_structure(table: PieceTable, shape: tuple[int, ...], itemsize: int, opts: ChunkingOptions) -> _Structure:
    grid, nothing = _grid_of(table, shape, itemsize, opts)
    if nothing is not None:
        return nothing
    nd = len(shape)
    clo, chi = grid.contained(table.lo, table.ext)
    rows = np.flatnonzero(rows_all(chi > clo)) if nd else np.arange(len(table.pos), dtype=_I64)
    ubox, inverse, _ = unique_rows(np.concatenate([clo[rows], chi[rows]], axis=1))
    ulo, uhi = ubox[:, :nd], ubox[:, nd:]
    # (a table whose pieces are equal or disjoint holds distinct chunks in distinct boxes: a chunk held whole
    # by two pieces lies in both, so they overlap, so they are the same box)
    if table.disjoint or _disjoint(ulo, uhi):
        # Each distinct box is a cell; its holders are the rows with that box.
        cell_of_row = inverse
        cell_lo, cell_hi = ulo, uhi
        per_chunk = False
    else:
        # Overlapping boxes: a cell is one chunk, held by every box containing it.
        box_of, flat = grid.cells(ulo, uhi)
        cells, cell_of_pair = np.unique(flat, return_inverse=True)
        # pair each (box, chunk) with the rows holding that box
        by_box = np.argsort(inverse, kind="stable")
        starts = np.searchsorted(inverse[by_box], np.arange(len(ubox)), side="left")
        ends = np.searchsorted(inverse[by_box], np.arange(len(ubox)), side="right")
        counts = (ends - starts)[box_of]
        pair = np.repeat(np.arange(len(box_of)), counts)
        offs = np.arange(len(pair)) - np.repeat(np.cumsum(counts) - counts, counts)
        row_idx = by_box[starts[box_of[pair]] + offs]
        rows = rows[row_idx]
        cell_of_row = cell_of_pair.reshape(-1)[pair]
        cell_lo = grid.unflat_columns(cells)
        cell_hi = cell_lo + 1
        per_chunk = True
    pos, piece = table.pos[rows], table.piece[rows]
    # holders of each cell: distinct positions ascending, each with its lowest piece
    order = np.lexsort((piece, pos, cell_of_row))
    c_sorted, p_sorted, pi_sorted = cell_of_row[order], pos[order], piece[order]
    keep = first_of_runs(c_sorted * (int(table.positions) + 1) + p_sorted)
    c_sorted, p_sorted, pi_sorted = c_sorted[keep], p_sorted[keep], pi_sorted[keep]
    starts = first_of_runs(c_sorted)
    nholders = np.diff(np.r_[starts, len(c_sorted)])
    cell_ids = c_sorted[starts]
    one = nholders == 1
    single_cells = cell_ids[one]
    single_pos = p_sorted[starts[one]]
    single_piece = pi_sorted[starts[one]]
    # replicated cells, grouped by their holders
    by_holders: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for cell, s, n in zip(cell_ids[~one].tolist(), starts[~one].tolist(), nholders[~one].tolist(), strict=True):
        by_holders[tuple(p_sorted[s : s + n].tolist())].append((cell, tuple(pi_sorted[s : s + n].tolist())))
    groups = _groups(grid, cell_lo, cell_hi, by_holders, itemsize)
    # chunks no piece holds whole
    covered = int(rows_prod(cell_hi - cell_lo).sum()) if nd else len(cell_ids)
    if covered >= grid.count:
        uncovered = np.zeros(0, dtype=_I64)
    else:
        _, flat = grid.cells(cell_lo, cell_hi)
        mask = np.ones(grid.count, dtype=bool)
        mask[flat] = False
        uncovered = np.flatnonzero(mask)
    return _Structure(
        grid,
        table,
        itemsize,
        single_pos,
        single_piece,
        cell_lo[single_cells],
        cell_hi[single_cells],
        not per_chunk,
        groups,
        uncovered,
    )


def _groups(
    grid: ChunkGrid,
    cell_lo: np.ndarray,
    cell_hi: np.ndarray,
    by_holders: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]],
    itemsize: int,
) -> list[_Group]:
    """The groups of replicated cells: per holders (fewest first, then ascending), the chunks of their cells
    ``(cell, each holder's piece)`` in flat order."""
    groups = []
    for holders in sorted(by_holders, key=lambda h: (len(h), h)):
        chunks: list[int] = []
        pieces: list[tuple[int, ...]] = []
        for cell, pis in by_holders[holders]:
            _, flat = grid.cells(cell_lo[cell : cell + 1], cell_hi[cell : cell + 1])
            chunks.extend(flat.tolist())
            pieces.extend([pis] * len(flat))
        order_c = sorted(range(len(chunks)), key=chunks.__getitem__)
        chunks = [chunks[i] for i in order_c]
        pieces = [pieces[i] for i in order_c]
        groups.append(_Group(holders, chunks, _chunk_bytes(grid, chunks, itemsize), pieces))
    return groups


def _rank_structure(p: Placed, itemsize: int, opts: ChunkingOptions, pos: int) -> _Structure:
    """The save structure of a placed layout as far as position ``pos`` takes part in it (memoised).

    A table whose pieces are equal or disjoint (every mesh layout's) is planned from ``pos``'s
    own boxes (:func:`_make_rank_structure`); any other from its whole structure.
    """
    if not p.table.disjoint or not p.shape:
        return _structure(p, itemsize, opts)
    return p.per_table(
        ("save-rank", itemsize, opts, pos),
        _STRUCTURES,
        lambda: _make_rank_structure(p.table, p.shape, itemsize, opts, pos),
    )


def _make_rank_structure(
    table: PieceTable, shape: tuple[int, ...], itemsize: int, opts: ChunkingOptions, pos: int
) -> _Structure:
    """:func:`_make_structure`'s cells, groups and merged chunks involving position ``pos`` (what
    ``involving(pos)`` gives), for a table whose pieces are equal or disjoint, of one or more dims.

    In such a table a chunk held whole by a piece lies in no other piece but its equals: the
    cells ``pos`` holds are its own boxes, each held by the rows of an equal piece; and a
    chunk ``pos`` touches but holds whole in none of its boxes is held whole by no piece (a
    piece holding it would meet ``pos``'s, so equal it): a merged chunk. So ``pos``'s part
    comes from its few rows and a scan of the table per box, not from every row's cells.
    """
    grid, nothing = _grid_of(table, shape, itemsize, opts)
    if nothing is not None:
        return nothing
    nd = len(shape)
    a, b = (int(i) for i in np.searchsorted(table.pos, [pos, pos + 1]))
    lo, ext = table.lo[a:b], table.ext[a:b]
    clo, chi = grid.contained(lo, ext)
    has = np.flatnonzero(rows_all(chi > clo))
    # pos's distinct boxes of whole chunks, in the order of the whole structure's cells
    ubox, _, first = unique_rows(np.concatenate([clo[has], chi[has]], axis=1))
    cell_lo, cell_hi = ubox[:, :nd], ubox[:, nd:]
    singles: list[int] = []
    single_piece: list[int] = []
    by_holders: dict[tuple[int, ...], list[tuple[int, tuple[int, ...]]]] = defaultdict(list)
    for cell, r in enumerate((a + has[first]).tolist()):
        same = rows_like(table, r)
        keep = same[first_of_runs(table.pos[same])]  # (rows by position, then piece: each one's lowest piece)
        holders = tuple(table.pos[keep].tolist())
        pieces = tuple(table.piece[keep].tolist())
        if len(holders) == 1:
            singles.append(cell)
            single_piece.append(pieces[0])
        else:
            by_holders[holders].append((cell, pieces))
    groups = _groups(grid, cell_lo, cell_hi, by_holders, itemsize)
    # the chunks pos touches but holds whole in none of its boxes
    _, touched = grid.cells(*grid.touched(lo, ext))
    _, inside = grid.cells(clo[has], chi[has])
    merged = np.setdiff1d(touched, inside)
    s = _Structure(
        grid,
        table,
        itemsize,
        np.full(len(singles), pos, dtype=_I64),
        np.asarray(single_piece, dtype=_I64),
        cell_lo[singles],
        cell_hi[singles],
        True,
        groups,
        merged,
    )
    s._by_pos[pos] = (np.arange(len(singles), dtype=_I64), groups, merged.tolist())
    return s


def _chunk_bytes(grid: ChunkGrid, flat: list[int], itemsize: int) -> list[int]:
    """Bytes of each chunk ``flat`` (edge chunks are smaller)."""
    if not grid.ndim:
        return [itemsize] * len(flat)
    idx = grid.unflat_columns(np.asarray(flat, dtype=_I64))
    c = np.asarray(grid.chunk, dtype=_I64)
    ext = np.minimum(c, np.asarray(grid.shape, dtype=_I64) - idx * c)
    return (rows_prod(ext) * itemsize).tolist()  # type: ignore[no-any-return]


def _sweep_dim(lo: np.ndarray) -> int:
    """The dim along which boxes starting at ``lo`` start at the most distinct places (judged on a sample).

    Sweeps along it find the boxes meeting a box quickly; any dim gives the same answers.
    """
    sample = np.sort(lo[:: max(1, len(lo) // 1024)], axis=0)
    return int(np.argmax((sample[1:] != sample[:-1]).sum(axis=0)))


def _disjoint(lo: np.ndarray, hi: np.ndarray) -> bool:
    """True when no two of the boxes ``[lo, hi)`` share a cell (bounded work for tiled boxes)."""
    n = len(lo)
    if n < 2:
        return True
    nd = lo.shape[1]
    if nd == 0:
        return False
    d = _sweep_dim(lo)
    order = np.argsort(lo[:, d], kind="stable")
    lo, hi = lo[order], hi[order]
    # candidates of box i: the boxes after it (in start order) starting before it ends
    ends = np.searchsorted(lo[:, d], hi[:, d], side="left")
    counts = np.maximum(ends - np.arange(n) - 1, 0)
    total = int(counts.sum())
    if total == 0:
        return True
    step = 1 << 20
    first = np.repeat(np.arange(n), counts)
    offs = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    for s in range(0, total, step):
        i = first[s : s + step]
        j = i + 1 + offs[s : s + step]
        if rows_all((lo[i] < hi[j]) & (lo[j] < hi[i])).any():
            return False
    return True


# --------------------------------------------------------------------------- planning


def _array_writes(
    spec: ArraySpec, opts: ChunkingOptions, scopes: Scopes
) -> tuple[tuple[int, ...], tuple[WriteOp, ...]]:
    """One array's chunk shape and every write.

    The writes follow from the placed layout and the balancing decisions alone: arrays of
    one placed layout deciding alike (10,000 small tensors of one shape, a model's layers)
    share them, as a rank's part does (:class:`_RankPart`).
    """
    p = placed(spec)
    s = _structure(p, spec.itemsize, opts)
    groups, merges = s.groups, s.uncovered.tolist()
    assigns, writers, decided = _decide(spec.key, s, p, scopes, groups, merges)
    memo = ("all", spec.itemsize, opts, decided)
    writes = p.derived.get(memo)
    if writes is None:
        singles: Sequence[int] = range(len(s.single_pos))
        writes = p.derived[memo] = _writes(spec.key, s, p, None, singles, groups, assigns, merges, writers)
    return s.grid.chunk, writes


@dataclass(eq=False)
class _RankPart:
    """What one position takes part in of a placed layout's plan, and its writes per decision (memoised).

    The writes follow from the balancing decisions alone, so arrays of one placed layout
    deciding alike (a model's layers, mostly) share them. The direct writes are kept
    apart from the merged ones, whose writers vary more.
    """

    p: Placed
    s: _Structure
    pos: int
    singles: list[int]
    groups: list[tuple[_Group, bytes]]  # each with the key of its scope
    merges: list[tuple[int, _Merge, bytes]]  # (flat chunk, merge, scope key)
    direct: dict[tuple[bytes | int, ...], tuple[WriteOp, ...]] = field(default_factory=dict)
    merged: dict[tuple[int, int], WriteOp | None] = field(default_factory=dict)

    def writes(self, key: str, scopes: Scopes) -> tuple[WriteOp, ...]:
        """This position's writes of the array ``key``, handing out work by ``scopes``' loads, which it updates."""
        rels = []
        assigns = []
        for g, skey in self.groups:
            loads = scopes.get(skey)
            if loads is None:
                loads = scopes[skey] = Loads(len(g.holders))
            rel, assign = g.fill(loads)
            rels.append(rel)
            assigns.append(assign)
        decided = tuple(rels)
        direct = self.direct.get(decided)
        if direct is None:
            groups = [g for g, _ in self.groups]
            direct = self.direct[decided] = _writes(
                key, self.s, self.p, self.pos, self.singles, groups, assigns, (), ()
            )
        if not self.merges:
            return direct
        merged = []
        for flat, m, skey in self.merges:
            loads = scopes.get(skey)
            if loads is None:
                loads = scopes[skey] = Loads(len(m.feeders))
            at = m.writer_at(loads)
            loads.values[at] += m.nbytes
            op = self.merged.get((flat, at), _UNSEEN)  # (mostly unseen: the writer rotates as the loads grow)
            if op is _UNSEEN:
                op = self.merged[(flat, at)] = _merged_write(key, m, self.p, self.pos, at)
            if op is not None:
                merged.append(op)
        if not direct and len(merged) < 2:
            return tuple(merged)
        return tuple(sorted((*direct, *merged), key=_OFFSET))


_UNSEEN: Any = object()


def _rank_part(spec: ArraySpec, opts: ChunkingOptions, rank: int) -> tuple[tuple[int, ...], _RankPart | None]:
    """The chunk shape of ``spec``'s array and what ``rank`` takes part in (None: nothing), memoised per placement.

    An array placed on other ranks only is not placed: its chunk shape comes from its layout's table.
    """
    if not spec.placed_on(rank):
        return chunk_shape_of_table(piece_table(spec.layout, spec.shape), spec.shape, spec.itemsize, opts), None
    p = placed(spec)
    pos = p.position(rank)
    assert pos is not None  # (placed on rank, so it has a position)
    key = ("rank", spec.itemsize, opts, pos)
    got = p.derived.get(key)
    if got is None:
        s = _rank_structure(p, spec.itemsize, opts, pos)
        singles, groups, merges = s.involving(pos)
        ms = []
        for flat in merges:
            m = s.merge(flat)
            ms.append((flat, m, m.scope_key(p.ranks, p.place)))
        gs = [(g, g.scope_key(p.ranks, p.place)) for g in groups]
        got = p.derived[key] = _RankPart(p, s, pos, singles.tolist(), gs, ms)
    return got.s.grid.chunk, got


_OFFSET = operator.attrgetter("region.offset")


def _decide(
    key: str, s: _Structure, p: Placed, scopes: Scopes, groups: Sequence[_Group], merges: Sequence[int]
) -> tuple[list[list[int]], list[int], tuple[Any, ...]]:
    """Hand out ``groups`` and the writers of ``merges`` by their scopes' loads, which it updates.

    Returns each group's holder per chunk, each merge's writer (an index into its
    feeders), and the decisions as a key (what the writes depend on besides the layout).
    """
    ranks, place = p.ranks, p.place
    assigns = []
    writers = []
    decided: list[Any] = []
    for g in groups:
        rel, assign = g.fill(scope_loads(scopes, g.scope_key(ranks, place), len(g.holders)))
        assigns.append(assign)
        decided.append(rel)
    for flat in merges:
        m = s.merge(flat)
        if not m.feeders:
            raise LayoutError(f"leaf {key!r}: elements {m.chunk} are held by no rank, so they cannot be saved")
        loads = scope_loads(scopes, m.scope_key(ranks, place), len(m.feeders))
        at = m.writer_at(loads)
        loads.values[at] += m.nbytes
        writers.append(at)
        decided.append(at)
    return assigns, writers, tuple(decided)


def _writes(
    key: str,
    s: _Structure,
    p: Placed,
    pos: int | None,
    singles: Sequence[int],
    groups: Sequence[_Group],
    assigns: Sequence[list[int]],
    merges: Sequence[int],
    writers: Sequence[int],
) -> tuple[WriteOp, ...]:
    """The writes involving position ``pos`` (every write when None) given the decisions of :func:`_decide`."""
    grid, ranks = s.grid, p.ranks
    # (writer position, piece) -> its whole boxes, and its chunks to coalesce
    boxes: dict[tuple[int, int], list[Box]] = defaultdict(list)
    loose: dict[tuple[int, int], list[tuple[int, ...]]] = defaultdict(list)
    if len(singles):
        sp, spi = s.single_pos[singles].tolist(), s.single_piece[singles].tolist()
        slo, shi = s.single_lo[singles].tolist(), s.single_hi[singles].tolist()
        for q, pi, lo, hi in zip(sp, spi, slo, shi, strict=True):
            if s.single_box:
                boxes[(q, pi)].append((tuple(lo), tuple(hi)))
            else:
                loose[(q, pi)].append(tuple(lo))
    for g, assign in zip(groups, assigns, strict=True):
        mine = None if pos is None else g.holders.index(pos)
        for c, k, pis in zip(g.chunks, assign, g.pieces, strict=True):
            if mine is None or k == mine:
                loose[(g.holders[k], pis[k])].append(grid.unflat(c))
    writes: list[WriteOp] = []
    for (q, pi), bs in boxes.items():
        if (q, pi) not in loose and len(bs) == 1:
            writes.append(_direct(grid, bs[0], int(ranks[q]), pi))
        else:
            loose[(q, pi)].extend(i for lo, hi in bs for i in grid.indices(lo, hi))
    for (q, pi), idxs in loose.items():
        for box in coalesce(idxs):
            writes.append(_direct(grid, box, int(ranks[q]), pi))
    for flat, at in zip(merges, writers, strict=True):
        op = _merged_write(key, s.merge(flat), p, pos, at)
        if op is not None:
            writes.append(op)
    writes.sort(key=_OFFSET)
    return tuple(writes)


def _merged_write(key: str, m: _Merge, p: Placed, pos: int | None, at: int) -> WriteOp | None:
    """The merged write of ``m``'s chunk by its feeder ``at``, as position ``pos`` takes part in it (None: whole).

    None when ``pos`` neither writes it nor sends it anything.
    """
    ranks = p.ranks
    writer_pos = m.feeders[at]
    if pos is None or pos == writer_pos:
        return write_of(m.chunk, int(ranks[writer_pos]), m.written(key, writer_pos, ranks))
    # what a feeder sends is mostly the same whoever writes: its fragments are shared
    frag_memo = p.derived.get("fragments")
    if frag_memo is None:
        frag_memo = p.derived["fragments"] = {}
    frags = m.sent(key, writer_pos, pos, ranks, frag_memo)
    return write_of(m.chunk, int(ranks[writer_pos]), frags) if frags else None


def _fragments(ranks: np.ndarray, parts: Sequence[Part]) -> tuple[Fragment, ...]:
    """The parts ``(position, piece, lo, hi)`` as fragments of world ranks."""
    if len(parts) < 16:
        return tuple(
            fragment_of(int(ranks[q]), pi, region_of(lo, tuple(h - a for a, h in zip(lo, hi, strict=True))))
            for q, pi, lo, hi in parts
        )
    q, pi, lo, hi = zip(*parts, strict=True)
    world = ranks[list(q)].tolist()
    ext = map(tuple, (np.asarray(hi, dtype=_I64) - np.asarray(lo, dtype=_I64)).tolist())
    return tuple(map(fragment_of, world, pi, map(region_of, lo, ext)))


def _direct(grid: ChunkGrid, box: Box, writer: int, piece: int) -> WriteOp:
    lo, hi = box
    offset = tuple(i * c for i, c in zip(lo, grid.chunk, strict=True))
    stop = tuple(min(i * c, n) for i, c, n in zip(hi, grid.chunk, grid.shape, strict=True))
    region = region_of(offset, tuple(e - o for o, e in zip(offset, stop, strict=True)))
    return write_of(region, writer, (fragment_of(writer, piece, region),))


_WHOLE_WRITES: dict[tuple[int, ...], tuple[WriteOp, ...]] = {}


def plan_whole(key: str, shape: tuple[int, ...], itemsize: int) -> ArraySavePlan:
    """The plan of an array rank 0 alone holds whole (one piece) and stores as one chunk.

    What :func:`plan_save` plans for such an array (``ShardingSpec(Mesh(1), [Replicate()])``
    of at most ``ChunkingOptions.single_chunk_bytes``, no zero extent), without its
    tables: rank 0 writes the whole array from its piece. The writes of one shape are
    one shared tuple.

    >>> from pytreeckpt import Mesh, Replicate, ShardingSpec
    >>> one = ShardingSpec(Mesh(1), [Replicate()])
    >>> plan_whole("w", (4, 4), 4) == plan_save([ArraySpec("w", (4, 4), 4, one)], 1).arrays[0]
    True
    """
    writes = _WHOLE_WRITES.get(shape)
    if writes is None:
        if len(_WHOLE_WRITES) >= 4096:  # (a bound: a process saving arrays of ever new shapes)
            _WHOLE_WRITES.clear()
        region = Region.full(shape)
        writes = _WHOLE_WRITES.setdefault(shape, (WriteOp(region, 0, (Fragment(0, 0, region),)),))
    return ArraySavePlan(key, shape, itemsize, shape, writes)


def plan_save(
    specs: Sequence[ArraySpec], world: int, *, rank: int | None = None, options: ChunkingOptions | None = None
) -> SavePlan:
    """The save plan of ``specs`` on a world of ``world`` ranks: every write, or those involving ``rank``.

    With ``rank``, each array keeps the writes ``rank`` makes, and the merged writes it
    feeds with only its own fragments (what it sends, and to whom); arrays it holds no
    piece of are not planned beyond their chunk grid. Arrays are planned in order; within
    each scope the bytes already given carry over from one array to the next.

    Raises:
      LayoutError: a layout spans ranks beyond the world, or (planning every write, or
        the merged chunks ``rank`` writes) some element is held by no rank.

    >>> from pytreeckpt import Mesh, Replicate, Shard, ShardingSpec
    >>> w = ArraySpec("w", (1024, 1024), 4, ShardingSpec(Mesh((2, 2)), [Replicate(), Shard(0)]))
    >>> options = ChunkingOptions(max_chunk_bytes=1 << 20)  # 1 MiB chunks: two per shard, each held by two ranks
    >>> plan = plan_save([w], 4, options=options)
    >>> [(op.writer, op.region.offset) for op in plan.arrays[0].writes]
    [(0, (0, 0)), (2, (256, 0)), (1, (512, 0)), (3, (768, 0))]
    >>> [op.writer for op in plan_save([w], 4, rank=2, options=options).arrays[0].writes]
    [2]
    """
    opts = options or ChunkingOptions()
    scopes: Scopes = {}
    out = []
    checked: set[tuple[int, Any]] = set()
    if rank is None:
        for spec in specs:
            check_placement(spec, world, checked, "layout")
            chunk, writes = _array_writes(spec, opts, scopes)
            out.append(array_save_plan_of(spec.key, spec.shape, spec.itemsize, chunk, writes))
        return SavePlan(world, tuple(out))
    # A rank's part: arrays of one (layout, shape, element size, placement) object, as a
    # model's layers are, are looked up once per plan (the objects live as long as the call).
    parts: dict[tuple[Any, ...], tuple[tuple[int, ...], _RankPart | None]] = {}
    for spec in specs:
        where = (*placement_of(spec), spec.shape, spec.itemsize)
        got = parts.get(where)
        if got is None:
            check_placement(spec, world, checked, "layout")
            got = parts[where] = _rank_part(spec, opts, rank)
        chunk, part = got
        writes = () if part is None else part.writes(spec.key, scopes)
        out.append(array_save_plan_of(spec.key, spec.shape, spec.itemsize, chunk, writes))
    return SavePlan(world, tuple(out))


def check_complete(spec: ArraySpec, options: ChunkingOptions | None = None) -> None:
    """Raise LayoutError naming the leaf if some element of ``spec`` is held by no rank.

    Mesh specs hold every element by construction; irregular layouts are checked on the
    chunks no piece holds whole (what merged writes would assemble).
    """
    opts = options or ChunkingOptions()
    s = _structure(placed(spec), spec.itemsize, opts)
    for flat in s.uncovered.tolist():
        m = s.merge(flat)
        if not m.feeders:
            raise LayoutError(f"leaf {spec.key!r}: elements {m.chunk} are held by no rank, so they cannot be saved")
        m.sources(spec.key, m.feeders[0])
