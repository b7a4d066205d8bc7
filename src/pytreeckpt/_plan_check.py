"""Exact, vectorised checks of plan invariants, fast enough for plans of 16,384 ranks.

Save: every write is a union of whole chunks, every chunk is written exactly once, by a
rank of the world; a direct write's source is the writer's own piece and contains the
write; a merged write's fragments lie in their pieces and tile the write exactly once.
Load: every element of every target piece is read exactly once and delivered to every
rank that wants it; every read lies in one stored chunk and is read by a rank that wants
it. Counting is done on chunk grids and box tables with numpy, never by sampling.
Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ._piece_table import _I64, ArraySpec, piece_table, unique_rows
from ._plan import ArrayLoadPlan, WriteOp
from ._plan_load_table import ArrayLoadTable
from ._plan_table import ArraySaveTable, _coverage, _LazyMerge

__all__ = ["check_load", "check_save"]


def _piece_rows(spec: ArraySpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Piece boxes keyed by ``rank * stride + piece``, sorted by key."""
    table = piece_table(spec.layout, spec.shape)
    ranks = spec.rank_array()
    stride = int(table.piece.max()) + 1 if len(table.piece) else 1
    key = ranks[table.pos] * stride + table.piece
    order = np.argsort(key)
    return key[order], table.lo[order], (table.lo + table.ext)[order], stride


def check_save(specs: Sequence[ArraySpec], tables: Sequence[ArraySaveTable], world: int) -> list[str]:
    """Problems with a global save plan (empty when every invariant holds)."""
    problems: list[str] = []
    for spec, t in zip(specs, tables, strict=True):
        key = spec.key
        nd = len(t.shape)
        if t.shape != spec.shape or nd == 0 or any(s == 0 for s in t.shape):
            if t.shape != spec.shape:
                problems.append(f"leaf {key!r}: shape {t.shape} differs from the layout's {spec.shape}")
            continue
        c = np.asarray(t.chunk_shape, dtype=_I64)
        n = np.asarray(t.shape, dtype=_I64)
        end = t.offset + t.extent
        if ((t.offset % c) != 0).any() or (((end % c) != 0) & (end != n)).any() or (t.extent <= 0).any():
            problems.append(f"leaf {key!r}: a write is not a union of whole chunks")
            continue
        grid = tuple(int(v) for v in -(-n // c))
        cover = _coverage(t.offset // c, -(-end // c), grid)
        if (cover != 1).any():
            problems.append(
                f"leaf {key!r}: {int((cover == 0).sum())} chunks unwritten, {int((cover > 1).sum())} written twice"
            )
        if ((t.writer < 0) | (t.writer >= world)).any():
            problems.append(f"leaf {key!r}: a writer outside the world of {world}")
        keys, plo, phi, stride = _piece_rows(spec)
        direct = np.flatnonzero(t.piece >= 0)
        want = t.writer[direct] * stride + t.piece[direct]
        at = np.minimum(np.searchsorted(keys, want), max(len(keys) - 1, 0))
        found = (keys[at] == want) if len(keys) else np.zeros(len(want), dtype=bool)
        inside = (plo[at] <= t.offset[direct]).all(axis=1) & (end[direct] <= phi[at]).all(axis=1)
        if not (found & inside).all():
            problems.append(f"leaf {key!r}: a direct write is not inside its writer's own piece")
        for row, op in t.merged.items():
            w = op.op() if isinstance(op, _LazyMerge) else op
            problems.extend(_check_merge(key, w, t, row, keys, plo, phi, stride))
    return problems


def _check_merge(
    key: str, op: WriteOp, t: ArraySaveTable, row: int, keys: np.ndarray, plo: np.ndarray, phi: np.ndarray, stride: int
) -> list[str]:
    nd = len(t.shape)
    if tuple(t.offset[row].tolist()) != op.region.offset or t.writer[row] != op.writer:
        return [f"leaf {key!r}: merged write {row} disagrees with its columns"]
    flo = np.asarray([f.region.offset for f in op.sources], dtype=_I64).reshape(len(op.sources), nd)
    fhi = flo + np.asarray([f.region.shape for f in op.sources], dtype=_I64).reshape(len(op.sources), nd)
    want = np.asarray([f.rank * stride + f.piece for f in op.sources], dtype=_I64)
    at = np.minimum(np.searchsorted(keys, want), len(keys) - 1)
    ok = (keys[at] == want) & (plo[at] <= flo).all(axis=1) & (fhi <= phi[at]).all(axis=1)
    rlo = np.asarray(op.region.offset, dtype=_I64)
    rhi = rlo + np.asarray(op.region.shape, dtype=_I64)
    ok &= (rlo <= flo).all(axis=1) & (fhi <= rhi).all(axis=1)
    if not ok.all():
        return [f"leaf {key!r}: a fragment of merged write {op.region} lies outside its piece or the write"]
    edges = [np.unique(np.concatenate([flo[:, d], fhi[:, d], rlo[d : d + 1], rhi[d : d + 1]])) for d in range(nd)]
    glo = np.stack([np.searchsorted(edges[d], flo[:, d]) for d in range(nd)], axis=1)
    ghi = np.stack([np.searchsorted(edges[d], fhi[:, d]) for d in range(nd)], axis=1)
    cover = _coverage(glo, ghi, tuple(len(e) - 1 for e in edges))
    if (cover != 1).any():
        return [f"leaf {key!r}: the fragments of merged write {op.region} do not tile it exactly once"]
    return []


def check_load(
    targets: Sequence[ArraySpec],
    stored_chunks: Sequence[tuple[int, ...]],
    tables: Sequence[ArrayLoadTable | ArrayLoadPlan],
    world: int,
) -> list[str]:
    """Problems with a global load plan (empty when every invariant holds)."""
    problems: list[str] = []
    for spec, chunk, t in zip(targets, stored_chunks, tables, strict=True):
        key = spec.key
        if not isinstance(t, ArrayLoadTable):
            continue  # planned by the reference, checked by the reference's own tests
        info = t.info
        if len(t.rows) != len(info.box) or not (np.diff(t.rows) > 0).all():
            problems.append(f"leaf {key!r}: the plan skips or repeats reads")
            continue
        nd = len(t.shape)
        c = np.asarray(chunk, dtype=_I64)
        lo, hi = info.lo[t.rows], info.lo[t.rows] + info.ext[t.rows]
        if ((lo // c) != ((hi - 1) // c)).any() or (info.ext[t.rows] <= 0).any():
            problems.append(f"leaf {key!r}: a read spans more than one stored chunk")
        # Each distinct target box is tiled by its reads: distinct chunks, volumes adding up.
        box = info.box[t.rows]
        table = piece_table(spec.layout, spec.shape)
        boxes = unique_rows(np.concatenate([table.lo, table.lo + table.ext], axis=1))[0]
        vol = np.prod(boxes[:, nd:] - boxes[:, :nd], axis=1)
        got = np.bincount(box, weights=info.elems[t.rows].astype(np.float64), minlength=len(boxes))
        if len(got) != len(vol) or not np.array_equal(np.sort(got.astype(_I64)), np.sort(vol)):
            problems.append(f"leaf {key!r}: the reads do not add up to the target pieces")
        pair = np.concatenate([box[:, None], lo // c], axis=1)
        if len(unique_rows(pair)[0]) != len(pair):
            problems.append(f"leaf {key!r}: a region is read twice")
        # Every target piece gets every read of its box; the reader is one of the ranks wanting it.
        members = sum(len(m) for m in info.members)
        if members != len(table.pos):
            problems.append(f"leaf {key!r}: some target pieces receive nothing")
        reader_pos = np.searchsorted(t.ranks, t.reader)
        ok = (reader_pos < len(t.ranks)) & (t.ranks[np.minimum(reader_pos, len(t.ranks) - 1)] == t.reader)
        single = info.single_pos[t.rows]
        ok &= (single < 0) | (single == reader_pos)
        if not ok.all() or ((t.reader < 0) | (t.reader >= world)).any():
            problems.append(f"leaf {key!r}: a read by a rank that does not want it")
        multi = np.flatnonzero(single < 0)
        if len(multi):
            stride = len(t.ranks) + 1
            pairs = np.sort(
                np.concatenate([b * stride + m for b, m in enumerate(info.member_arr)]).astype(_I64, copy=False)
            )
            want = box[multi] * stride + reader_pos[multi]
            at = np.minimum(np.searchsorted(pairs, want), len(pairs) - 1)
            if not (pairs[at] == want).all():
                problems.append(f"leaf {key!r}: a replicated read by a rank that does not want it")
    return problems
