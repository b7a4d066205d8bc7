"""The reference planner: slow and obvious, a test oracle for pytreeckpt's planner.

It walks every piece of every rank and every chunk in Python, straight from the
definitions: each chunk written once, by a rank holding it whole when one does (the least
loaded of those holding it, per scope), else merged by the rank holding most of it; each
target region cut along the stored chunks and read once, by the least loaded rank
wanting it. ``property_tests/test_planner.py`` holds :func:`pytreeckpt.plan.plan_save`
and :func:`pytreeckpt.plan.plan_load` equal to it. Not used by the library.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeckpt import LayoutError, Region
from pytreeckpt.core._sharding import Piece
from pytreeckpt.plan import (
    ArrayLoadPlan,
    ArraySavePlan,
    ArraySpec,
    ChunkingOptions,
    Fragment,
    LoadPlan,
    ReadOp,
    SavePlan,
    WriteOp,
)


@dataclass(frozen=True, slots=True)
class ArrayLayout:
    """The planning input for one array: its shape, element size and every rank's pieces."""

    key: str
    shape: tuple[int, ...]
    itemsize: int
    pieces: tuple[tuple[Piece, ...], ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def chunk_region(index: Sequence[int], chunk_shape: Sequence[int], shape: Sequence[int]) -> Region:
    offset = tuple(i * c for i, c in zip(index, chunk_shape, strict=True))
    extent = tuple(min(c, s - o) for o, c, s in zip(offset, chunk_shape, shape, strict=True))
    return Region(offset, extent)


def chunk_indices(region: Region, chunk_shape: Sequence[int]) -> list[tuple[int, ...]]:
    ranges = [
        range(o // c, (o + s - 1) // c + 1) if s > 0 else range(0)
        for o, s, c in zip(region.offset, region.shape, chunk_shape, strict=True)
    ]
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*t, i) for t in out for i in r]
    return out


def array_layout(spec: ArraySpec, world: int) -> ArrayLayout:
    """Every world rank's pieces of ``spec`` (the oracle's input)."""
    pieces: list[tuple[Piece, ...]] = [()] * world
    ranks = spec.rank_array()
    for pos, ps in enumerate(spec.layout.rank_pieces(spec.shape)):
        pieces[int(ranks[pos])] = ps
    return ArrayLayout(spec.key, spec.shape, spec.itemsize, tuple(pieces))


def rank_part(plan: SavePlan, rank: int) -> SavePlan:
    """The writes of a whole plan that involve ``rank``; merged writes it only feeds keep its own fragments."""
    arrays = []
    for ap in plan.arrays:
        writes = []
        for op in ap.writes:
            if op.writer == rank:
                writes.append(op)
            elif any(s.rank == rank for s in op.sources):
                writes.append(WriteOp(op.region, op.writer, tuple(s for s in op.sources if s.rank == rank)))
        arrays.append(ArraySavePlan(ap.key, ap.shape, ap.itemsize, ap.chunk_shape, tuple(writes)))
    return SavePlan(plan.world_size, tuple(arrays))


def load_rank_part(plan: LoadPlan, rank: int) -> LoadPlan:
    """The reads of a whole plan that ``rank`` wants (it reads them or receives them)."""
    return LoadPlan(
        plan.world_size,
        tuple(
            ArrayLoadPlan(
                a.key, a.shape, a.itemsize, tuple(r for r in a.reads if any(t.rank == rank for t in r.targets))
            )
            for a in plan.arrays
        ),
    )


# --------------------------------------------------------------------------- chunk grid


def _largest_divisor_at_most(n: int, limit: int) -> int:
    best = 1
    i = 1
    while i * i <= n:
        if n % i == 0:
            if i <= limit:
                best = max(best, i)
            if n // i <= limit:
                best = max(best, n // i)
        i += 1
    return best


def _cap(chunk: list[int], itemsize: int, max_bytes: int, divides: Sequence[bool]) -> tuple[int, ...]:
    """``chunk`` cut down, outermost dim first, to at most ``max_bytes``; a dim of ``divides`` to a divisor
    of its extent (a cut between pieces must stay a chunk boundary), any other to the most that fits."""
    for d in range(len(chunk)):
        inner = math.prod(chunk[d + 1 :]) * itemsize
        if chunk[d] * inner <= max_bytes:
            break
        target = max(1, max_bytes // max(inner, 1))
        chunk[d] = _largest_divisor_at_most(chunk[d], target) if divides[d] else min(chunk[d], target)
    return tuple(chunk)


def choose_chunk_shape(
    shape: Sequence[int], itemsize: int, pieces: Sequence[Sequence[Piece]], options: ChunkingOptions
) -> tuple[int, ...]:
    """The chunk shape of a stored array.

    Small arrays are one chunk. Larger ones get the coarsest grid aligned with every
    piece boundary, split to at most ``max_chunk_bytes``; if that grid is finer than
    ``min_chunk_bytes``, a regular grid that ignores piece boundaries is used instead.
    """
    shape = tuple(int(s) for s in shape)
    if any(s == 0 for s in shape) or math.prod(shape) * itemsize <= options.single_chunk_bytes:
        return chunk_shape_from_cuts(shape, itemsize, [0] * len(shape), options)
    cuts = []
    for d in range(len(shape)):
        g = 0
        for rank_pieces in pieces:
            for p in rank_pieces:
                for cut in (p.region.offset[d], p.region.offset[d] + p.region.shape[d]):
                    if 0 < cut < shape[d]:
                        g = math.gcd(g, cut)
        cuts.append(g)
    return chunk_shape_from_cuts(shape, itemsize, cuts, options)


def chunk_shape_from_cuts(
    shape: tuple[int, ...], itemsize: int, cuts: Sequence[int], options: ChunkingOptions
) -> tuple[int, ...]:
    """:func:`choose_chunk_shape` given, per dim, the gcd of the piece boundaries inside the array (0: none)."""
    if any(s == 0 for s in shape):
        return tuple(max(1, s) for s in shape)
    if math.prod(shape) * itemsize <= options.single_chunk_bytes:
        return shape
    aligned = [g if g else s for g, s in zip(cuts, shape, strict=True)]
    if math.prod(aligned) * itemsize >= options.min_chunk_bytes:
        # Only the cuts between pieces must stay chunk boundaries: a dim without one is cut
        # anywhere (the last chunk runs past the edge), so a prime extent is not cut into
        # chunks of one element. Where a cut's divisors force chunks below the minimum,
        # the regular grid serves better.
        chunk = _cap(aligned, itemsize, options.max_chunk_bytes, [bool(g) for g in cuts])
        if math.prod(chunk) * itemsize >= options.min_chunk_bytes:
            return chunk
    return _cap(list(shape), itemsize, options.max_chunk_bytes, [False] * len(shape))


# --------------------------------------------------------------------------- save


def _contained_chunk_range(piece: Region, chunk_shape: Sequence[int], shape: Sequence[int]) -> list[range]:
    """Per dim, the chunk indices whose chunk lies wholly inside ``piece``."""
    out = []
    for o, s, c, n in zip(piece.offset, piece.shape, chunk_shape, shape, strict=True):
        first = -(-o // c)
        end = o + s
        last = (end // c) if end < n else -(-n // c)
        out.append(range(first, max(first, last)))
    return out


def _grid_product(ranges: Sequence[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*t, i) for t in out for i in r]
    return out


def _coalesce(indices: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Merge a set of chunk indices into boxes ``(lo, hi)`` of the chunk index space."""
    boxes = [(idx, tuple(i + 1 for i in idx)) for idx in sorted(indices)]
    ndim = len(indices[0]) if indices else 0
    for d in reversed(range(ndim)):

        def other(b: tuple[tuple[int, ...], tuple[int, ...]], d: int = d) -> tuple[Any, ...]:
            return (b[0][:d] + b[0][d + 1 :], b[1][:d] + b[1][d + 1 :])

        def sort_key(b: tuple[tuple[int, ...], tuple[int, ...]], d: int = d) -> tuple[Any, ...]:
            return (other(b), b[0][d])

        boxes.sort(key=sort_key)
        merged: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for b in boxes:
            if merged and other(merged[-1]) == other(b) and merged[-1][1][d] == b[0][d]:
                lo, hi = merged[-1]
                merged[-1] = (lo, (*hi[:d], b[1][d], *hi[d + 1 :]))
            else:
                merged.append(b)
        boxes = merged
    boxes.sort()
    return boxes


def _box_region(lo: Sequence[int], hi: Sequence[int], chunk_shape: Sequence[int], shape: Sequence[int]) -> Region:
    offset = tuple(a * c for a, c in zip(lo, chunk_shape, strict=True))
    stop = tuple(min(b * c, n) for b, c, n in zip(hi, chunk_shape, shape, strict=True))
    return Region(offset, tuple(e - o for o, e in zip(offset, stop, strict=True)))


def _water_fill(
    chunks: list[tuple[int, ...]], sizes: dict[tuple[int, ...], int], load: list[int]
) -> dict[tuple[int, ...], int]:
    """Hand ``chunks`` (in order) to the holders whose bytes so far are ``load``, evening loads out.

    Returns each chunk's holder (an index into ``load``) and adds the chunks to ``load``.
    Handing each chunk to the least loaded holder keeps the spread of the holders' loads
    within the larger of its spread before and the largest chunk. Contiguous runs (fewer,
    larger writes) are used when they keep that bound too.
    """
    n = len(load)
    csz = [sizes[c] for c in chunks]
    if n > 1 and len(chunks) > 1:
        runs = _contiguous_runs(csz, load)
        after = list(load)
        for size, r in zip(csz, runs or (), strict=False):
            after[r] += size
        if runs is not None and max(after) - min(after) <= max(max(load) - min(load), max(csz)):
            load[:] = after
            return dict(zip(chunks, runs, strict=True))
    out = {}
    heap = list(zip(load, range(n), strict=True))  # the least loaded holder, lowest first, is heap[0]
    heapq.heapify(heap)
    for c, size in zip(chunks, csz, strict=True):
        best = heap[0][1]
        out[c] = best
        load[best] += size
        heapq.heapreplace(heap, (load[best], best))
    return out


def _contiguous_runs(sizes: list[int], load: list[int]) -> list[int] | None:
    """Each chunk's holder when contiguous runs of the chunks fill the holders below the water level."""
    total = sum(sizes)
    current = sorted(load)
    # find the level L such that sum(max(0, L - load)) == total
    level: float = current[0]
    acc = 0
    for i, v in enumerate(current):
        width = i + 1
        nxt = current[i + 1] if i + 1 < len(current) else None
        need = total - acc
        if nxt is None or (nxt - v) * width >= need:
            level = v + need / width
            break
        acc += (nxt - v) * width
    order = [r for r, x in enumerate(load) if level - x > 0]
    if not order:  # nothing to hand out
        return None
    quota = [level - load[r] for r in order]
    # Lay the quotas end to end; a chunk goes to the holder whose stretch holds the chunk's
    # midpoint. Each holder gets a contiguous run, and no holder's rounding carries over.
    out, i, bound, pos = [], 0, quota[0], 0.0
    for size in sizes:
        mid = pos + size / 2
        while i < len(order) - 1 and mid > bound:
            i += 1
            bound += quota[i]
        out.append(order[i])
        pos += size
    return out


Scopes = dict[bytes, list[int]]
"""Per scope (keyed by :func:`scope_key` of its ranks, ascending), the bytes given so far to each of its ranks."""


def scope_key(ranks: Sequence[int]) -> bytes:
    """The key of the scope of ``ranks`` (ascending): their int64 bytes, whose hash Python caches."""
    return np.asarray(ranks, dtype=np.int64).tobytes()


def scope_loads(scopes: Scopes, key: bytes, size: int) -> list[int]:
    """The loads of the scope ``key`` of ``size`` ranks, as a new list."""
    got = scopes.get(key)
    return [0] * size if got is None else list(got)


def _plan_array_save(layout: ArrayLayout, options: ChunkingOptions, scopes: Scopes) -> ArraySavePlan:
    shape, itemsize = layout.shape, layout.itemsize
    chunk_shape = choose_chunk_shape(shape, itemsize, layout.pieces, options)
    full = Region.full(shape)
    all_chunks = list(chunk_indices(full, chunk_shape))
    if not all_chunks:
        return ArraySavePlan(layout.key, shape, itemsize, chunk_shape, ())
    # Which (rank, piece) wholly hold each chunk.
    holders: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
    for rank, rank_pieces in enumerate(layout.pieces):
        for pi, piece in enumerate(rank_pieces):
            for idx in _grid_product(_contained_chunk_range(piece.region, chunk_shape, shape)):
                holders[idx].append((rank, pi))
    sizes = {idx: chunk_region(idx, chunk_shape, shape).size * itemsize for idx in all_chunks}
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = defaultdict(list)
    merged: list[tuple[int, ...]] = []
    for idx in all_chunks:
        hs = holders.get(idx)
        if hs:
            groups[tuple(sorted({r for r, _ in hs}))].append(idx)
        else:
            merged.append(idx)
    writer_of: dict[tuple[int, ...], int] = {}
    for ranks in sorted(groups, key=lambda k: (len(k), k)):
        key = scope_key(ranks)
        local = scope_loads(scopes, key, len(ranks))
        assign = _water_fill(groups[ranks], sizes, local)
        scopes[key] = local
        writer_of.update({c: ranks[k] for c, k in assign.items()})
    # Direct writes: coalesce each writer's chunks per source piece.
    by_source: dict[tuple[int, int], list[tuple[int, ...]]] = defaultdict(list)
    for idx, writer in writer_of.items():
        piece_index = next(p for r, p in holders[idx] if r == writer)
        by_source[(writer, piece_index)].append(idx)
    writes: list[WriteOp] = []
    for (writer, piece_index), idxs in sorted(by_source.items()):
        for lo, hi in _coalesce(idxs):
            region = _box_region(lo, hi, chunk_shape, shape)
            writes.append(WriteOp(region, writer, (Fragment(writer, piece_index, region),)))
    # Merged chunks: the writer is the rank holding most of the chunk.
    for idx in merged:
        writes.append(_merge_write(layout, chunk_region(idx, chunk_shape, shape), scopes))
    writes.sort(key=lambda w: w.region.offset)
    return ArraySavePlan(layout.key, shape, itemsize, chunk_shape, tuple(writes))


def _merge_write(layout: ArrayLayout, chunk: Region, scopes: Scopes) -> WriteOp:
    overlap: dict[int, int] = defaultdict(int)
    parts: list[tuple[int, int, Region]] = []
    for rank, rank_pieces in enumerate(layout.pieces):
        for pi, piece in enumerate(rank_pieces):
            inter = piece.region.intersect(chunk)
            if inter is not None:
                overlap[rank] += inter.size
                parts.append((rank, pi, inter))
    if not overlap:
        raise LayoutError(f"leaf {layout.key!r}: elements {chunk} are held by no rank, so they cannot be saved")
    feeders = tuple(sorted(overlap))
    key = scope_key(feeders)
    local = scope_loads(scopes, key, len(feeders))
    at = {r: i for i, r in enumerate(feeders)}
    writer = min(overlap, key=lambda r: (-overlap[r], local[at[r]], r))
    op = merge_sources(layout.key, chunk, writer, parts, overlap)
    local[at[writer]] += chunk.size * layout.itemsize
    scopes[key] = local
    return op


def merge_sources(
    key: str, chunk: Region, writer: int, parts: list[tuple[int, int, Region]], overlap: dict[int, int]
) -> WriteOp:
    """The write of a merged chunk by ``writer`` from ``parts`` (rank, piece, part of the chunk), in rank order."""
    # The writer's own pieces first, then the others by how much they hold. Boxes are
    # kept as (lo, hi) tuples; a part equal to one already used adds nothing (replicas).
    parts = sorted(parts, key=lambda p: (p[0] != writer, -overlap[p[0]], p[0], p[1]))
    uncovered: list[tuple[tuple[int, ...], tuple[int, ...]]] = [(chunk.offset, chunk.stop)]
    sources: list[Fragment] = []
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for rank, pi, inter in parts:
        plo, phi = inter.offset, inter.stop
        if (plo, phi) in seen:
            continue
        seen.add((plo, phi))
        rest: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for ulo, uhi in uncovered:
            glo = tuple(map(max, ulo, plo))
            ghi = tuple(map(min, uhi, phi))
            if any(h <= lo for lo, h in zip(glo, ghi, strict=True)):
                rest.append((ulo, uhi))
                continue
            sources.append(Fragment(rank, pi, Region(glo, tuple(h - lo for lo, h in zip(glo, ghi, strict=True)))))
            rest.extend(_subtract_box(ulo, uhi, glo, ghi))
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
    return WriteOp(chunk, writer, tuple(sources))


def _subtract_box(
    lo: tuple[int, ...], hi: tuple[int, ...], glo: tuple[int, ...], ghi: tuple[int, ...]
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``[lo, hi)`` minus its sub-box ``[glo, ghi)``, cut as :meth:`Region.subtract` cuts it."""
    out = []
    cur_lo, cur_hi = list(lo), list(hi)
    for d in range(len(lo)):
        if glo[d] > cur_lo[d]:
            h = list(cur_hi)
            h[d] = glo[d]
            out.append((tuple(cur_lo), tuple(h)))
        if ghi[d] < cur_hi[d]:
            a = list(cur_lo)
            a[d] = ghi[d]
            out.append((tuple(a), tuple(cur_hi)))
        cur_lo[d], cur_hi[d] = glo[d], ghi[d]
    return out


def plan_save(layouts: Sequence[ArrayLayout], world_size: int, options: ChunkingOptions | None = None) -> SavePlan:
    """Compute the save plan of every array.

    Arrays are planned in order; within each scope (the ranks sharing a replicated chunk
    or feeding a merged one) the bytes already given carry over from one array to the
    next, so replicated data balances across the whole state.

    Raises:
      LayoutError: some element of an array is held by no rank.
    """
    options = options or ChunkingOptions()
    scopes: Scopes = {}
    arrays = []
    for layout in layouts:
        if len(layout.pieces) > world_size:
            raise LayoutError(
                f"leaf {layout.key!r}: its layout spans {len(layout.pieces)} ranks but the world has {world_size}"
            )
        arrays.append(_plan_array_save(layout, options, scopes))
    return SavePlan(world_size, tuple(arrays))


# --------------------------------------------------------------------------- load


def _plan_array_load(
    key: str,
    shape: tuple[int, ...],
    itemsize: int,
    chunk_shape: tuple[int, ...],
    pieces: Sequence[Sequence[Piece]],
    scopes: Scopes,
) -> ArrayLoadPlan:
    full = Region.full(shape)
    wanted: dict[Region, list[Fragment]] = {}
    for rank, rank_pieces in enumerate(pieces):
        for pi, piece in enumerate(rank_pieces):
            if not full.contains(piece.region):
                raise LayoutError(f"leaf {key!r}: rank {rank} wants {piece.region}, outside the stored shape {shape}")
            for idx in chunk_indices(piece.region, chunk_shape):
                inter = chunk_region(idx, chunk_shape, shape).intersect(piece.region)
                if inter is not None:
                    wanted.setdefault(inter, []).append(Fragment(rank, pi, inter))
    reads = []
    for region, targets in wanted.items():
        wanters = tuple(sorted({t.rank for t in targets}))
        if len(wanters) == 1:
            reader = wanters[0]
        else:
            scope = scope_key(wanters)
            local = scope_loads(scopes, scope, len(wanters))
            at = local.index(min(local))
            reader = wanters[at]
            local[at] += region.size * itemsize
            scopes[scope] = local
        reads.append(ReadOp(region, reader, tuple(targets)))
    return ArrayLoadPlan(key, shape, itemsize, tuple(reads))


def plan_load(
    stored: Sequence[tuple[str, tuple[int, ...], int, tuple[int, ...]]],
    targets: Sequence[Sequence[Sequence[Piece]]],
    world_size: int,
) -> LoadPlan:
    """Compute the reads that fill every target piece from the stored arrays.

    Args:
      stored: per array, ``(key, shape, itemsize, chunk_shape)`` as stored.
      targets: per array, every rank's target pieces (global coordinates).
      world_size: ranks of the loading world.
    """
    scopes: Scopes = {}
    arrays = []
    for (key, shape, itemsize, chunk_shape), pieces in zip(stored, targets, strict=True):
        if len(pieces) > world_size:
            raise LayoutError(f"leaf {key!r}: its target spans {len(pieces)} ranks but the world has {world_size}")
        arrays.append(_plan_array_load(key, shape, itemsize, chunk_shape, pieces, scopes))
    return LoadPlan(world_size, tuple(arrays))
