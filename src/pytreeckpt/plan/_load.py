"""Load planning: each target region cut along the stored chunks, read once, delivered to every rank wanting it.

The same planner at every scale: for every rank at once, or for one rank's own part.
A target layout's distinct boxes are cut along the stored chunk grid; a region wanted by
one rank is read by it, a region wanted by several (replicated targets) by the least
loaded of them, by the bytes that same set of ranks has read so far, and sent on to the
others. Every decision about a rank's reads is made within a set of ranks containing it,
so a rank plans only the arrays it wants. Pure: no I/O, no clock, no globals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np

from pytreeckpt.core._errors import LayoutError
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region, region_of
from pytreeckpt.core._rows import rows_all, rows_any, rows_prod

from ._balance import Loads, Scopes, scope_key, scope_loads
from ._memos import LOAD_CUTS, OUTSIDE
from ._tables import _I64, PieceTable, Placed, first_of_runs, placed, rows_like, unique_rows
from ._types import (
    ArraySpec,
    Fragment,
    LoadPlan,
    ReadOp,
    array_load_plan_of,
    check_placement,
    fragment_of,
    placement_of,
    read_of,
)

__all__ = ["plan_load"]


@dataclass(eq=False)
class _Cuts:
    """A target layout cut along a stored chunk grid, in positions of a table in rank order.

    Regions are in the order the ranks meet them: by their first wanting (position,
    piece), then row-major within its box; a region equal to one met before is met once.
    """

    lo: np.ndarray  # (R, ndim) per region
    ext: np.ndarray
    nbytes: np.ndarray  # (R,) bytes per region
    wanted_ptr: np.ndarray  # (R + 1,) CSR into the wanting (position, piece) pairs, by position then piece
    want_pos: np.ndarray
    want_piece: np.ndarray
    single: np.ndarray  # (R,) the one position wanting the region, or -1
    outside: int = -1  # a table row reaching outside the array, if any
    _of_pos: dict[int, np.ndarray] = field(default_factory=dict)
    _scopes: dict[tuple[int, Any], tuple[tuple[int, ...], bytes]] = field(default_factory=dict)

    def wanting(self, r: int) -> np.ndarray:
        return self.want_pos[self.wanted_ptr[r] : self.wanted_ptr[r + 1]]

    def regions_of(self, pos: int) -> np.ndarray:
        """The regions position ``pos`` wants, in order (memoised)."""
        got = self._of_pos.get(pos)
        if got is None:
            rows = np.flatnonzero(self.want_pos == pos)
            owner = np.searchsorted(self.wanted_ptr, rows, side="right") - 1
            got = self._of_pos[pos] = np.unique(owner)
        return got

    def scope(self, r: int, ranks: np.ndarray, placement: Any) -> tuple[tuple[int, ...], bytes]:
        """The distinct positions wanting region ``r`` and the key of their world ranks' scope (memoised)."""
        key = (r, placement)
        got = self._scopes.get(key)
        if got is None:
            held = tuple(np.unique(self.wanting(r)).tolist())
            got = self._scopes[key] = (held, scope_key(ranks[list(held)]))
        return got


def _cuts(p: Placed, chunk: tuple[int, ...], itemsize: int) -> _Cuts:
    """A placed target layout cut along ``chunk`` (memoised on it, and shared by placements of one table)."""
    return p.per_table(("load", chunk, itemsize), LOAD_CUTS, lambda: _make_cuts(p.table, p.shape, chunk, itemsize))


def _first_outside(table: PieceTable, shape: tuple[int, ...]) -> int:
    """The first row of ``table`` reaching outside an array of ``shape``, or -1."""
    hi = table.lo + table.ext
    outside = np.flatnonzero(rows_any((table.lo < 0) | (hi > np.asarray(shape, dtype=_I64))))
    return int(outside[0]) if len(outside) else -1


def _cut_boxes(grid: ChunkGrid, blo: np.ndarray, bhi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Boxes ``[blo, bhi)`` cut along the chunk grid, row-major within each box: per region, its box,
    offset and extent."""
    if not grid.ndim:
        return np.arange(len(blo), dtype=_I64), np.zeros((len(blo), 0), _I64), np.zeros((len(blo), 0), _I64)
    c = np.asarray(grid.chunk, dtype=_I64)
    n = np.asarray(grid.shape, dtype=_I64)
    box, flat = grid.cells(*grid.touched(blo, bhi - blo))
    idx = grid.unflat_columns(flat)
    lo = np.maximum(idx * c, blo[box])
    ext = np.minimum(np.minimum((idx + 1) * c, n), bhi[box]) - lo
    return box, lo, ext


def _make_cuts(table: PieceTable, shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int) -> _Cuts:
    nd = len(shape)
    grid = ChunkGrid(shape, chunk)
    hi = table.lo + table.ext
    outside = _first_outside(table, shape)
    if outside >= 0:
        none = np.zeros(0, dtype=_I64)
        return _Cuts(
            np.zeros((0, nd), _I64), np.zeros((0, nd), _I64), none, np.zeros(1, _I64), none, none, none, outside
        )
    nonempty = np.asarray(rows_all(table.ext > 0)) if nd else np.ones(len(table.pos), dtype=bool)
    if grid.count == 0:
        nonempty[:] = False
    rows = np.flatnonzero(nonempty)
    # distinct boxes, in the order of their first holder
    ubox, inverse, first = unique_rows(np.concatenate([table.lo[rows], hi[rows]], axis=1))
    order = np.argsort(first, kind="stable")
    relabel = np.empty(len(order), dtype=_I64)
    relabel[order] = np.arange(len(order), dtype=_I64)
    box_of_row = relabel[inverse] if len(rows) else np.zeros(0, dtype=_I64)
    ub = ubox[order]
    blo, bhi = ub[:, :nd], ub[:, nd:]
    box, lo, ext = _cut_boxes(grid, blo, bhi)
    # a region several boxes give (overlapping targets) is met once, where first met
    if len(ub) > 1:
        uregion, region_of, first_r = unique_rows(np.concatenate([lo, ext], axis=1))
        keep = np.sort(first_r)
        renumber = np.empty(len(uregion), dtype=_I64)
        renumber[np.argsort(first_r, kind="stable")] = np.arange(len(uregion), dtype=_I64)
        region_of = renumber[region_of]
        lo, ext = lo[keep], ext[keep]
    else:
        region_of = np.arange(len(box), dtype=_I64)
    # the (position, piece) pairs wanting each region: every holder of every box giving it
    by_box = np.argsort(box_of_row, kind="stable")
    starts = np.searchsorted(box_of_row[by_box], np.arange(len(ub)), side="left")
    counts_b = np.searchsorted(box_of_row[by_box], np.arange(len(ub)), side="right") - starts
    per_pair = counts_b[box]
    pair = np.repeat(np.arange(len(box), dtype=_I64), per_pair)
    offs = np.arange(len(pair), dtype=_I64) - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
    trow = rows[by_box[starts[box[pair]] + offs]]
    reg = region_of[pair]
    wpos, wpiece = table.pos[trow], table.piece[trow]
    o = np.lexsort((wpiece, wpos, reg))
    reg, wpos, wpiece = reg[o], wpos[o], wpiece[o]
    ptr = np.searchsorted(reg, np.arange(len(lo) + 1), side="left")
    # regions wanted by one position only are read by it
    distinct = first_of_runs(reg * (int(table.positions) + 1) + wpos)
    nwanting = np.bincount(reg[distinct], minlength=len(lo))
    first_pos = wpos[ptr[:-1]] if len(wpos) else np.zeros(len(lo), dtype=_I64)
    single = np.where(nwanting == 1, first_pos, -1)
    nbytes = (rows_prod(ext) if nd else np.ones(len(lo), dtype=_I64)) * itemsize
    return _Cuts(lo, ext, nbytes, ptr, wpos, wpiece, single.astype(_I64))


def _own_cuts(table: PieceTable, shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int, pos: int) -> _Cuts:
    """:func:`_make_cuts` of the regions position ``pos`` wants only, for a table whose pieces are the same box
    or disjoint (``PieceTable.disjoint``): a region is then wanted by the holders of its box alone.

    Regions come in the order :func:`_make_cuts` gives them (boxes by their first holder,
    row-major within), with the same wanting pairs; a rank's reads and the scopes deciding
    them are those of the whole table's cuts, in O(the table) numpy work rather than a
    cut of every box.
    """
    nd = len(shape)
    grid = ChunkGrid(shape, chunk)
    a, b = np.searchsorted(table.pos, [pos, pos + 1])
    mine = np.arange(a, b, dtype=_I64)
    if nd:
        mine = mine[rows_all(table.ext[a:b] > 0)]
    if grid.count == 0:
        mine = mine[:0]
    holders, firsts = [], []
    for row in mine.tolist():  # (a position holds a few boxes, none empty: so none of their equals is)
        same = rows_like(table, row)
        holders.append(same)
        firsts.append(int(same[0]))
    order = sorted(range(len(holders)), key=firsts.__getitem__)
    boxes = mine[order]
    blo = table.lo[boxes]
    box, lo, ext = _cut_boxes(grid, blo, blo + table.ext[boxes])
    # each region's wanting pairs: the holders of its box, by (position, piece) as the table is sorted
    per_box = [holders[i] for i in order]
    counts = np.asarray([len(per_box[k]) for k in box.tolist()], dtype=_I64)
    rows = np.concatenate([per_box[k] for k in box.tolist()]) if len(box) else np.zeros(0, dtype=_I64)
    ptr = np.zeros(len(box) + 1, dtype=_I64)
    np.cumsum(counts, out=ptr[1:])
    wpos, wpiece = table.pos[rows], table.piece[rows]
    positions = [np.unique(table.pos[h]) for h in per_box]
    single_of_box = np.asarray([int(u[0]) if len(u) == 1 else -1 for u in positions], dtype=_I64)
    single = single_of_box[box] if len(box) else np.zeros(0, dtype=_I64)
    nbytes = (rows_prod(ext) if nd else np.ones(len(lo), dtype=_I64)) * itemsize
    return _Cuts(lo, ext, nbytes, ptr, wpos, wpiece, single)


@dataclass(eq=False)
class _RankReads:
    """A placed target layout's regions as one position wants them, and its reads per decision (memoised).

    ``choices`` lists the regions others want too, in order: each is read by the least
    loaded rank of its scope, the only thing the reads depend on besides the layout.
    """

    rows: list[int]
    choices: list[tuple[bytes, int, int]]  # per shared region: scope key, ranks in it, bytes
    reads: dict[tuple[int, ...], tuple[ReadOp, ...]] = field(default_factory=dict)


def _rank_reads(p: Placed, cuts: _Cuts, pos: int) -> _RankReads:
    rows = cuts.regions_of(pos).tolist()
    single, nbytes = cuts.single[rows].tolist(), cuts.nbytes[rows].tolist()
    choices = []
    for r, s, nb in zip(rows, single, nbytes, strict=True):
        if s < 0:
            held, skey = cuts.scope(r, p.ranks, p.place)
            choices.append((skey, len(held), nb))
    return _RankReads(rows, choices)


def _outside(p: Placed) -> int:
    """The first row of a placed table reaching outside its array, or -1 (memoised, shared by its placements)."""
    return p.per_table("outside", OUTSIDE, lambda: _first_outside(p.table, p.shape))


def _array_reads(spec: ArraySpec, chunk: tuple[int, ...], scopes: Scopes) -> tuple[ReadOp, ...]:
    """Every read of ``spec``'s array (a rank's own reads: :func:`_rank_view`)."""
    p = placed(spec)
    cuts = _cuts(p, chunk, spec.itemsize)
    _check_inside(spec, p, cuts.outside)
    rows: Sequence[int] = range(len(cuts.lo))
    return tuple(_reads(p, cuts, _targets(p, chunk, spec.itemsize), rows, _choose(p, cuts, rows, scopes)))


def _check_inside(spec: ArraySpec, p: Placed, bad: int) -> None:
    """Raise LayoutError naming the leaf if row ``bad`` (>= 0) of its placed table reaches outside the array."""
    if bad >= 0:
        table = p.table
        region = Region(tuple(table.lo[bad].tolist()), tuple(table.ext[bad].tolist()))
        raise LayoutError(
            f"leaf {spec.key!r}: rank {int(p.ranks[table.pos[bad]])} wants {region}, outside the stored shape "
            f"{spec.shape}"
        )


@dataclass(eq=False)
class _RankView:
    """What one rank's reads of a placed target layout cut along a stored chunk grid depend on."""

    p: Placed
    cuts: _Cuts
    mine: _RankReads
    targets: dict[int, tuple[Region, tuple[Fragment, ...]]]

    def reads(self, scopes: Scopes) -> tuple[ReadOp, ...]:
        """The rank's reads of one array, its shared regions handed out by ``scopes``' loads, which it updates."""
        mine = self.mine
        decided = []
        for skey, n, nb in mine.choices:
            loads = scopes.get(skey)
            if loads is None:
                loads = scopes[skey] = Loads(n)
            decided.append(loads.give(nb))
        key = tuple(decided)
        got = mine.reads.get(key)
        if got is None:
            got = mine.reads[key] = tuple(_reads(self.p, self.cuts, self.targets, mine.rows, key))
        return got


def _rank_view(spec: ArraySpec, chunk: tuple[int, ...], rank: int) -> _RankView | None:
    """The rank's view of ``spec``'s placed layout cut along ``chunk`` (None: it wants nothing of it), memoised.

    A rank wanting nothing of it plans nothing, not even its placed table: the ranks placing
    it find any fault of its layout (every rank learns it at the planning's agreement).
    """
    if not spec.placed_on(rank):
        return None
    p = placed(spec)
    table = p.table
    own = table.disjoint  # (a rank's own cuts suffice)
    _check_inside(spec, p, _outside(p) if own else _cuts(p, chunk, spec.itemsize).outside)
    pos = p.position(rank)
    if pos is None:
        return None
    key = ("load-view", chunk, spec.itemsize, pos)
    got = p.derived.get(key)
    if got is None:
        if own:
            cuts = _own_cuts(table, p.shape, chunk, spec.itemsize, pos)
        else:
            cuts = _cuts(p, chunk, spec.itemsize)
        mine = _rank_reads(p, cuts, pos)
        got = p.derived[key] = _RankView(p, cuts, mine, _targets(p, chunk, spec.itemsize, pos if own else None))
    return got  # type: ignore[no-any-return]


def _targets(
    p: Placed, chunk: tuple[int, ...], itemsize: int, pos: int | None = None
) -> dict[int, tuple[Region, tuple[Fragment, ...]]]:
    """Per region of the placed layout cut along ``chunk``, its region and target fragments, once built
    (``pos``: of the regions of that position's own cuts, which number them apart)."""
    key = ("targets", chunk, itemsize, pos)
    got = p.derived.get(key)
    if got is None:
        got = p.derived[key] = {}
    return got  # type: ignore[no-any-return]


def _choose(p: Placed, cuts: _Cuts, rows: Sequence[int], scopes: Scopes) -> tuple[int, ...]:
    """The reader (an index into its scope) of each of ``rows`` wanted by several positions, in order."""
    decided = []
    for r in rows:
        if cuts.single[r] < 0:
            held, key = cuts.scope(r, p.ranks, p.place)
            loads = scope_loads(scopes, key, len(held))
            decided.append(loads.give(cuts.nbytes[r]))
    return tuple(decided)


def _reads(
    p: Placed,
    cuts: _Cuts,
    memo: dict[int, tuple[Region, tuple[Fragment, ...]]],
    rows: Sequence[int],
    decided: Sequence[int],
) -> list[ReadOp]:
    """The reads of ``rows`` given the readers :func:`_choose` picked; ``memo`` keeps each region's targets."""
    ranks = p.ranks
    reads = []
    choice = iter(decided)
    single = cuts.single
    for r in rows:
        got = memo.get(r)
        if got is None:
            region = region_of(tuple(cuts.lo[r].tolist()), tuple(cuts.ext[r].tolist()))
            a, b = cuts.wanted_ptr[r], cuts.wanted_ptr[r + 1]
            wanting = ranks[cuts.want_pos[a:b]].tolist()
            targets = tuple(map(fragment_of, wanting, cuts.want_piece[a:b].tolist(), repeat(region, len(wanting))))
            got = memo[r] = (region, targets)
        region, targets = got
        s = int(single[r])
        if s >= 0:
            reader = int(ranks[s])
        else:
            held, _ = cuts.scope(r, ranks, p.place)
            reader = int(ranks[held[next(choice)]])
        reads.append(read_of(region, reader, targets))
    return reads


def plan_load(
    chunk_shapes: Sequence[tuple[int, ...]],
    specs: Sequence[ArraySpec],
    world: int,
    *,
    rank: int | None = None,
) -> LoadPlan:
    """The reads filling every target piece of ``specs`` from stored arrays chunked as ``chunk_shapes``.

    With ``rank``, each array keeps the reads ``rank`` wants (it reads them, or receives
    them from the rank that does); arrays it wants nothing of are not planned.

    Raises:
      LayoutError: a target spans ranks beyond the world, or wants elements outside the
        stored shape.

    >>> from pytreeckpt import Mesh, Replicate, ShardingSpec
    >>> t = ArraySpec("w", (8, 4), 4, ShardingSpec(Mesh(2), [Replicate()]))
    >>> reads = plan_load([(4, 4)], [t], 2).arrays[0].reads
    >>> [(op.region.offset, op.reader, [f.rank for f in op.targets]) for op in reads]
    [((0, 0), 0, [0, 1]), ((4, 0), 1, [0, 1])]
    """
    scopes: Scopes = {}
    out = []
    checked: set[tuple[int, Any]] = set()
    if rank is None:
        for spec, chunk in zip(specs, chunk_shapes, strict=True):
            check_placement(spec, world, checked, "target")
            reads = _array_reads(spec, tuple(chunk), scopes)
            out.append(array_load_plan_of(spec.key, spec.shape, spec.itemsize, reads))
        return LoadPlan(world, tuple(out))
    # A rank's part: arrays of one (layout, shape, element size, placement, chunk) object, as a
    # model's layers are, are looked up once per plan (the objects live as long as the call).
    views: dict[tuple[Any, ...], tuple[_RankView | None]] = {}
    for spec, chunk in zip(specs, chunk_shapes, strict=True):
        where = (*placement_of(spec), spec.shape, spec.itemsize, tuple(chunk))
        got = views.get(where)
        if got is None:
            check_placement(spec, world, checked, "target")
            got = views[where] = (_rank_view(spec, tuple(chunk), rank),)
        view = got[0]
        reads = () if view is None else view.reads(scopes)
        out.append(array_load_plan_of(spec.key, spec.shape, spec.itemsize, reads))
    return LoadPlan(world, tuple(out))
