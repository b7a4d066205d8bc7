"""Save planning's units of work beyond a cell written whole by its one holder: a group of chunks held
whole by the same several positions (:class:`Group`, balanced over them), and a chunk no piece holds
whole (:class:`Merge`), written by one of the positions holding parts of it from the fragments the
others send."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pytreeckpt.core._errors import LayoutError
from pytreeckpt.core._region import Bounds, Region, region_of, subtract_bounds

from ._balance import Loads, scope_key, water_fill
from ._tables import _I64, first_of_runs
from ._types import (
    Fragment,
    fragment_of,
)


@dataclass(eq=False)
class Group:
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
class Merge:
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
            return fragments(ranks, self.sources(key, writer))
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
                    got = memo[(self, pos)] = fragments(ranks, [part for _, part in self._mine(pos)[0]])
                return got
        sources = self.sources_from(key, writer, pos)
        fkey = tuple(sources)
        got = memo.get(fkey)
        if got is None:
            got = memo[fkey] = fragments(ranks, sources)
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
    uncovered: list[Bounds] = [(chunk.offset, chunk.stop)]
    for pos, piece, plo, phi in order:
        rest: list[Bounds] = []
        for ulo, uhi in uncovered:
            glo = tuple(map(max, ulo, plo))
            ghi = tuple(map(min, uhi, phi))
            if any(h <= a for a, h in zip(glo, ghi, strict=True)):
                rest.append((ulo, uhi))
                continue
            got.append((pos, piece, glo, ghi))
            rest.extend(subtract_bounds(ulo, uhi, glo, ghi))
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


def fragments(ranks: np.ndarray, parts: Sequence[Part]) -> tuple[Fragment, ...]:
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
