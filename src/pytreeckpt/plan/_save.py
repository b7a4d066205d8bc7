"""Save planning: each stored array's chunk grid, and who writes which chunks from which pieces.

Stages, in call order: an array's structure, per placed layout (``_structure``: its grid,
cells, groups of ``_cells.Group`` and merged chunks of ``_cells.Merge``); then, here, the
balancing decisions per array and the writes that follow from them (``plan_save``).

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
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pytreeckpt.core._errors import LayoutError
from pytreeckpt.core._grid import ChunkGrid, coalesce
from pytreeckpt.core._region import Bounds, Region, region_of

from ._balance import Loads, Scopes, scope_loads
from ._cells import Group, Merge
from ._chunking import chunk_shape_of_table
from ._memos import WHOLE_WRITES
from ._structure import Structure, rank_structure_of, structure_of
from ._tables import Placed, piece_table, placed
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


def _array_writes(
    spec: ArraySpec, opts: ChunkingOptions, scopes: Scopes
) -> tuple[tuple[int, ...], tuple[WriteOp, ...]]:
    """One array's chunk shape and every write.

    The writes follow from the placed layout and the balancing decisions alone: arrays of
    one placed layout deciding alike (10,000 small tensors of one shape, a model's layers)
    share them, as a rank's part does (:class:`_RankPart`).
    """
    p = placed(spec)
    s = structure_of(p, spec.itemsize, opts)
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
    s: Structure
    pos: int
    singles: list[int]
    groups: list[tuple[Group, bytes]]  # each with the key of its scope
    merges: list[tuple[int, Merge, bytes]]  # (flat chunk, merge, scope key)
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
        s = rank_structure_of(p, spec.itemsize, opts, pos)
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
    key: str, s: Structure, p: Placed, scopes: Scopes, groups: Sequence[Group], merges: Sequence[int]
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
    s: Structure,
    p: Placed,
    pos: int | None,
    singles: Sequence[int],
    groups: Sequence[Group],
    assigns: Sequence[list[int]],
    merges: Sequence[int],
    writers: Sequence[int],
) -> tuple[WriteOp, ...]:
    """The writes involving position ``pos`` (every write when None) given the decisions of :func:`_decide`."""
    grid, ranks = s.grid, p.ranks
    # (writer position, piece) -> its whole boxes, and its chunks to coalesce
    boxes: dict[tuple[int, int], list[Bounds]] = defaultdict(list)
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


def _merged_write(key: str, m: Merge, p: Placed, pos: int | None, at: int) -> WriteOp | None:
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


def _direct(grid: ChunkGrid, box: Bounds, writer: int, piece: int) -> WriteOp:
    lo, hi = box
    offset = tuple(i * c for i, c in zip(lo, grid.chunk, strict=True))
    stop = tuple(min(i * c, n) for i, c, n in zip(hi, grid.chunk, grid.shape, strict=True))
    region = region_of(offset, tuple(e - o for o, e in zip(offset, stop, strict=True)))
    return write_of(region, writer, (fragment_of(writer, piece, region),))


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
    writes = WHOLE_WRITES.get(shape)
    if writes is None:
        if len(WHOLE_WRITES) >= WHOLE_WRITES.limit:  # (a bound: a process saving arrays of ever new shapes)
            WHOLE_WRITES.clear()
        region = Region.full(shape)
        writes = WHOLE_WRITES.setdefault(shape, (WriteOp(region, 0, (Fragment(0, 0, region),)),))
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
    s = structure_of(placed(spec), spec.itemsize, opts)
    for flat in s.uncovered.tolist():
        m = s.merge(flat)
        if not m.feeders:
            raise LayoutError(f"leaf {spec.key!r}: elements {m.chunk} are held by no rank, so they cannot be saved")
        m.sources(spec.key, m.feeders[0])
