"""Save planning's first stage: an array's *structure*, what planning it needs that does not depend on
the bytes already given to ranks, computed once per (placed layout, element size, chunking) and shared
by every array of that layout: the chunk grid, the cells (boxes of chunks held whole by the same set of
positions, :class:`~pytreeckpt.plan._cells.Group` where several), and the chunks no piece holds whole
(:class:`~pytreeckpt.plan._cells.Merge`). A rank planning its own part builds only what involves it
(:func:`rank_structure_of`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.core._rows import rows_all, rows_prod

from ._cells import Group, Merge
from ._chunking import chunk_shape_of_table
from ._memos import PART_INDEXES, STRUCTURES
from ._tables import _I64, PieceTable, Placed, first_of_runs, rows_like, unique_rows
from ._types import (
    ChunkingOptions,
)


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
class Structure:
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
    groups: list[Group]
    uncovered: np.ndarray  # flat indices of the chunks no piece holds whole, ascending
    _index: _PartIndex | None = None
    _merges: dict[int, Merge] = field(default_factory=dict)
    _by_pos: dict[int, tuple[np.ndarray, list[Group], list[int]]] = field(default_factory=dict)

    def involving(self, pos: int) -> tuple[np.ndarray, list[Group], list[int]]:
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

    def merge(self, flat: int) -> Merge:
        got = self._merges.get(flat)
        if got is None:
            got = self._merges[flat] = self._make_merge(flat)
        return got

    def _make_merge(self, flat: int) -> Merge:
        chunk = self.grid.region(self.grid.unflat(flat))
        t = self.table
        if self._index is None and len(self._merges) < 8:
            rows = _meeting(t, chunk)  # (a rank's part merges a chunk or two: a scan costs less than an index)
        else:
            if self._index is None:
                self._index = PART_INDEXES.get_or(id(t), lambda: _PartIndex(t))
                if self._index.table is not t:  # an id reused after its table was dropped
                    self._index = PART_INDEXES[id(t)] = _PartIndex(t)
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
        return Merge(
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


def structure_of(p: Placed, itemsize: int, opts: ChunkingOptions) -> Structure:
    """The save structure of a placed layout (memoised on it, and shared by placements of one table)."""
    return p.per_table(("save", itemsize, opts), STRUCTURES, lambda: _make_structure(p.table, p.shape, itemsize, opts))


def _grid_of(
    table: PieceTable, shape: tuple[int, ...], itemsize: int, opts: ChunkingOptions
) -> tuple[ChunkGrid, Structure | None]:
    """The chunk grid of an array laid out as ``table``, and its structure if it has no chunk (a zero-size array)."""
    grid = ChunkGrid(shape, chunk_shape_of_table(table, shape, itemsize, opts))
    if grid.count:
        return grid, None
    empty, none = np.zeros((0, len(shape)), dtype=_I64), np.zeros(0, dtype=_I64)
    return grid, Structure(grid, table, itemsize, none, none, empty, empty, True, [], none)


def _make_structure(table: PieceTable, shape: tuple[int, ...], itemsize: int, opts: ChunkingOptions) -> Structure:
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
    return Structure(
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
) -> list[Group]:
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
        groups.append(Group(holders, chunks, _chunk_bytes(grid, chunks, itemsize), pieces))
    return groups


def rank_structure_of(p: Placed, itemsize: int, opts: ChunkingOptions, pos: int) -> Structure:
    """The save structure of a placed layout as far as position ``pos`` takes part in it (memoised).

    A table whose pieces are equal or disjoint (every mesh layout's) is planned from ``pos``'s
    own boxes (:func:`_make_rank_structure`); any other from its whole structure.
    """
    if not p.table.disjoint or not p.shape:
        return structure_of(p, itemsize, opts)
    return p.per_table(
        ("save-rank", itemsize, opts, pos),
        STRUCTURES,
        lambda: _make_rank_structure(p.table, p.shape, itemsize, opts, pos),
    )


def _make_rank_structure(
    table: PieceTable, shape: tuple[int, ...], itemsize: int, opts: ChunkingOptions, pos: int
) -> Structure:
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
    s = Structure(
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
