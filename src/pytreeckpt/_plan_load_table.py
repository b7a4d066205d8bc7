"""Load planning at scale: :func:`~pytreeckpt._plan.plan_load` computed with numpy, globally or for one rank.

The reference walks every target piece and every stored chunk it touches in Python.
Here a target layout's distinct boxes are cut along the stored chunk grid all at once;
only regions wanted by several ranks (replicated targets) need a decision, the reader:
the least loaded of the ranks that want it (by the reads of that same set of ranks), as
in the reference, in the reference's order. One rank's part is planned from the arrays
it wants only: every decision about its reads is made within a set of ranks containing
it. Layouts that are not regular (target boxes overlapping partially) are planned by
the reference. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ._errors import LayoutError
from ._piece_table import _I64, ArraySpec, _Memo, _pos_of, piece_table, unique_rows
from ._plan import ArrayLoadPlan, Fragment, LoadPlan, ReadOp, Scopes, _plan_array_load, scope_loads
from ._plan_table import _coverage
from ._region import Region

__all__ = ["ArrayLoadTable", "load_rank_part", "plan_load_rank", "plan_load_tables"]


@dataclass(frozen=True, eq=False)
class _LoadInfo:
    """A target layout cut along a stored chunk grid, in layout positions; reads in the reference's order."""

    regular: bool
    lo: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), _I64))  # (R, d) per read
    ext: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), _I64))
    box: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))  # (R,) the distinct box read into
    elems: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))
    members: list[tuple[tuple[int, int], ...]] = field(default_factory=list)  # per box: (position, piece)
    single_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))  # per read: its one wanter, or -1
    multi_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, _I64))  # reads wanted by several
    member_arr: list[np.ndarray] = field(default_factory=list)
    member_set: list[frozenset[int]] = field(default_factory=list)  # per box: its positions


_INFOS = _Memo(256)


def _load_info(spec: ArraySpec, chunk: tuple[int, ...]) -> _LoadInfo:
    return _INFOS.get_or((spec.layout, spec.shape, chunk), lambda: _make_info(spec, chunk))


def _make_info(spec: ArraySpec, chunk: tuple[int, ...]) -> _LoadInfo:
    shape = spec.shape
    nd = len(shape)
    table = piece_table(spec.layout, shape)
    if nd == 0 or any(s == 0 for s in shape) or len(table.pos) == 0:
        return _LoadInfo(False)
    n = np.asarray(shape, dtype=_I64)
    hi = table.lo + table.ext
    if (table.lo < 0).any() or (hi > n).any():
        return _LoadInfo(False)  # the reference names the leaf and the rank
    boxes = np.concatenate([table.lo, hi], axis=1)
    ubox, inverse, first = unique_rows(boxes)
    # Regular: distinct boxes disjoint (coverage on the grid of their own edges).
    edges = [np.unique(np.concatenate([ubox[:, d], ubox[:, nd + d]])) for d in range(nd)]
    clo = np.stack([np.searchsorted(edges[d], ubox[:, d]) for d in range(nd)], axis=1)
    chi = np.stack([np.searchsorted(edges[d], ubox[:, nd + d]) for d in range(nd)], axis=1)
    if (_coverage(clo, chi, tuple(len(e) - 1 for e in edges)) > 1).any():
        return _LoadInfo(False)
    pos_piece = table.pos * (len(ubox) + 1) + inverse
    if len(np.unique(pos_piece)) != len(pos_piece):
        return _LoadInfo(False)
    # Boxes in the order their first wanter meets them; the reads of each in row-major chunk order.
    order = np.argsort(first, kind="stable")
    ub = ubox[order]
    relabel = np.empty(len(order), dtype=_I64)
    relabel[order] = np.arange(len(order))
    box_of_row = relabel[inverse]
    c = np.asarray(chunk, dtype=_I64)
    c0 = ub[:, :nd] // c
    c1 = (ub[:, nd:] - 1) // c + 1
    counts = np.prod(c1 - c0, axis=1)
    box = np.repeat(np.arange(len(ub)), counts)
    local = np.arange(len(box)) - np.repeat(np.cumsum(counts) - counts, counts)
    idx = np.empty((len(box), nd), dtype=_I64)
    rem = local
    spans = (c1 - c0)[box]
    for d in reversed(range(nd)):
        idx[:, d] = rem % spans[:, d]
        rem = rem // spans[:, d]
    idx += c0[box]
    lo = np.maximum(idx * c, ub[box, :nd])
    ext = np.minimum(np.minimum((idx + 1) * c, n), ub[box, nd:]) - lo
    members: list[list[tuple[int, int]]] = [[] for _ in range(len(ub))]
    for r, b in enumerate(box_of_row.tolist()):
        members[b].append((int(table.pos[r]), int(table.piece[r])))
    nmem = np.asarray([len(m) for m in members], dtype=_I64)
    single_pos = np.where(nmem[box] == 1, np.asarray([m[0][0] for m in members], dtype=_I64)[box], -1)
    return _LoadInfo(
        True,
        lo,
        ext,
        box,
        np.prod(ext, axis=1),
        [tuple(m) for m in members],
        single_pos,
        np.flatnonzero(single_pos < 0),
        [np.asarray(sorted({p for p, _ in m}), dtype=_I64) for m in members],
        [frozenset(p for p, _ in m) for m in members],
    )


@dataclass(frozen=True, eq=False)
class ArrayLoadTable:
    """One array's reads as columns, in the reference's order: region, reader, the box read into."""

    key: str
    shape: tuple[int, ...]
    itemsize: int
    rows: np.ndarray
    reader: np.ndarray
    info: _LoadInfo
    ranks: np.ndarray

    def __len__(self) -> int:
        return len(self.rows)

    def to_plan(self, select: Sequence[int] | None = None) -> ArrayLoadPlan:
        sel = range(len(self.rows)) if select is None else select
        lo, ext = self.info.lo, self.info.ext
        rows, reader, ranks = self.rows.tolist(), self.reader.tolist(), self.ranks.tolist()
        reads = []
        for i in sel:
            r = rows[i]
            region = Region(tuple(lo[r].tolist()), tuple(ext[r].tolist()))
            targets = tuple(Fragment(ranks[p], pi, region) for p, pi in self.info.members[int(self.info.box[r])])
            reads.append(ReadOp(region, reader[i], targets))
        return ArrayLoadPlan(self.key, self.shape, self.itemsize, tuple(reads))

    def rows_of(self, rank: int) -> list[int]:
        """Reads that involve ``rank``: it reads them or wants them."""
        pos = _pos_of(self.ranks, rank)
        out = set(np.flatnonzero(self.reader == rank).tolist())
        if pos is not None:
            wanted = [b for b, m in enumerate(self.info.members) if any(p == pos for p, _ in m)]
            if wanted:
                out.update(np.flatnonzero(np.isin(self.info.box[self.rows], wanted)).tolist())
        return sorted(out)


def _plan_array(
    spec: ArraySpec, chunk: tuple[int, ...], world: int, scopes: Scopes, only: int | None
) -> ArrayLoadTable | ArrayLoadPlan:
    """One array's reads; with ``only``, just the reads that rank makes or wants."""
    info = _load_info(spec, chunk)
    ranks = spec.rank_array()
    monotonic = len(ranks) < 2 or bool((np.diff(ranks) > 0).all())
    if not info.regular or not monotonic:
        pieces = spec.array_layout(world).pieces
        return _plan_array_load(spec.key, spec.shape, spec.itemsize, chunk, pieces, scopes)
    nbytes = info.elems * spec.itemsize
    single = info.single_pos
    if only is None:
        multi = info.multi_rows.tolist()
        keep_single = np.flatnonzero(single >= 0)
    else:
        pos = _pos_of(ranks, only)
        keep_single = np.flatnonzero(single == (-1 if pos is None else pos))
        box = info.box
        multi = [r for r in info.multi_rows.tolist() if pos in info.member_set[int(box[r])]]
    readers = np.full(len(info.box), -1, dtype=_I64)
    readers[keep_single] = ranks[single[keep_single]]
    # Reads wanted by several ranks: the least loaded of them, by the reads of that same set of ranks.
    keys: dict[int, tuple[list[int], bytes]] = {}
    for r in multi:
        b = int(info.box[r])
        got_key = keys.get(b)
        if got_key is None:
            wanters = ranks[info.member_arr[b]]
            got_key = keys[b] = (wanters.tolist(), wanters.tobytes())
        wanting, key = got_key
        local = scope_loads(scopes, key, len(wanting))
        at = local.index(min(local))
        readers[r] = wanting[at]
        local[at] += int(nbytes[r])
        scopes[key] = local
    sel = np.sort(np.concatenate([keep_single, np.asarray(multi, dtype=_I64)])) if only is not None else None
    if sel is None:
        sel = np.arange(len(info.box))
    return ArrayLoadTable(spec.key, spec.shape, spec.itemsize, sel, readers[sel], info, ranks)


def plan_load_tables(
    stored_chunks: Sequence[tuple[int, ...]], targets: Sequence[ArraySpec], world: int
) -> list[ArrayLoadTable | ArrayLoadPlan]:
    """The global load plan: per target array (its stored chunk shape given), its reads.

    Equal to ``plan_load`` on the same layouts; arrays the fast path does not cover come
    back as the reference's :class:`ArrayLoadPlan`.
    """
    _check(targets, world)
    scopes: Scopes = {}
    return [_plan_array(s, c, world, scopes, None) for s, c in zip(targets, stored_chunks, strict=True)]


def load_rank_part(tables: Sequence[ArrayLoadTable | ArrayLoadPlan], world: int, rank: int) -> LoadPlan:
    """The reads of a global load plan that involve ``rank`` (it reads them or wants them)."""
    out = []
    for t in tables:
        if isinstance(t, ArrayLoadTable):
            out.append(t.to_plan(t.rows_of(rank)))
        else:
            reads = tuple(r for r in t.reads if r.reader == rank or any(f.rank == rank for f in r.targets))
            out.append(ArrayLoadPlan(t.key, t.shape, t.itemsize, reads))
    return LoadPlan(world, tuple(out))


def plan_load_rank(
    stored_chunks: Sequence[tuple[int, ...]], targets: Sequence[ArraySpec], world: int, rank: int
) -> LoadPlan:
    """``rank``'s part of the load plan, planned from the arrays ``rank`` wants only.

    Equal to ``load_rank_part(plan_load_tables(...), world, rank)``.
    """
    _check(targets, world)
    scopes: Scopes = {}
    involved: dict[object, bool] = {}
    out: list[ArrayLoadPlan] = []
    for s, c in zip(targets, stored_chunks, strict=True):
        where = s.ranks if s.ranks is not None else s.layout.world_size
        hit = involved.get(where)
        if hit is None:
            hit = involved[where] = bool((s.rank_array() == rank).any())
        if not hit:
            out.append(ArrayLoadPlan(s.key, s.shape, s.itemsize, ()))
            continue
        t = _plan_array(s, c, world, scopes, rank)
        if isinstance(t, ArrayLoadTable):
            out.append(t.to_plan(t.rows_of(rank)))
        else:
            reads = tuple(r for r in t.reads if r.reader == rank or any(f.rank == rank for f in r.targets))
            out.append(ArrayLoadPlan(t.key, t.shape, t.itemsize, reads))
    return LoadPlan(world, tuple(out))


def _check(targets: Sequence[ArraySpec], world: int) -> None:
    for s in targets:
        if s.layout.world_size > world:
            raise LayoutError(f"leaf {s.key!r}: its target spans {s.layout.world_size} ranks but the world has {world}")
