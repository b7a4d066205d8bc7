"""Balancing work over the ranks able to take it, and merging chunk indices into boxes.

A *scope* is the set of ranks able to take a piece of work (the holders of a replicated
chunk, the ranks feeding a merged chunk, the ranks wanting a region); its loads are the
bytes given so far to each of its ranks. Work is handed to the least loaded rank of its
scope, so balance holds within every scope and a rank's part of a plan depends only on
the scopes that contain it. Pure and deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from ._memos import SCOPE_KEYS

__all__ = ["Loads", "Scopes", "scope_key", "scope_loads", "water_fill"]


class Loads:
    """The bytes given so far to each rank of a scope (int64 ``values``, updated in place by the planner;
    they only grow), and which rank is least loaded.

    >>> loads = Loads(3)
    >>> [loads.give(5) for _ in range(4)]
    [0, 1, 2, 0]
    """

    __slots__ = ("_at", "_floor", "values")

    def __init__(self, size: int) -> None:
        self.values = np.zeros(size, dtype=np.int64)
        self._at = 0  # the least loaded rank found last
        self._floor = 0  # and its load: no load is lower, and every load before it is higher

    def give(self, nbytes: int) -> int:
        """Give ``nbytes`` to the least loaded rank (:meth:`least`), and return it."""
        at = self.least()
        self.values[at] += nbytes
        return at

    def least(self) -> int:
        """The lowest of the least loaded ranks (``values.argmin()``): the one found last or the next while
        work goes round the scope (1,012 norm weights' chunks merged from 16,384 ranks), else a scan."""
        v, at, floor = self.values, self._at, self._floor
        n = len(v)
        if at < n and v[at] == floor:
            return at
        at += 1  # (the last found has more now: every load up to it is higher than the floor)
        if at < n and v[at] == floor:
            self._at = at
            return at
        at = self._at = int(v.argmin())
        self._floor = int(v[at])
        return at


Scopes = dict[bytes, Loads]
"""Per scope (keyed by :func:`scope_key` of its ranks, ascending), the bytes given so far to each of its ranks."""


def scope_key(ranks: Sequence[int] | np.ndarray) -> bytes:
    """The key of the scope of ``ranks`` (ascending): their int64 bytes, whose hash Python caches.

    Equal keys are one object (interned): the planner looks a scope up once per array, and
    a dict compares a key it holds with an equal one of another object byte by byte (128 KB
    for a scope of 16,384 ranks, a model's norm weights shared by the weights and the
    optimizer's copies), where one object is found by identity.
    """
    key = np.asarray(ranks, dtype=np.int64).tobytes()
    return SCOPE_KEYS.get(key)  # (bounded: a process planning ever new scopes)


def scope_loads(scopes: Scopes, key: bytes, size: int) -> Loads:
    """The loads of the scope ``key`` of ``size`` ranks (updated in place by the caller)."""
    got = scopes.get(key)
    if got is None:
        got = scopes[key] = Loads(size)
    return got


def water_fill(sizes: Sequence[int], load: list[int]) -> list[int]:
    """Hand chunks of ``sizes`` (in order) to the holders whose bytes so far are ``load``, evening loads out.

    Returns each chunk's holder (an index into ``load``) and adds the chunks to ``load``.
    Handing each chunk to the least loaded holder keeps the spread of the holders' loads
    within the larger of its spread before and the largest chunk. Contiguous runs (fewer,
    larger writes) are used when they keep that bound too.

    >>> load = [0, 0]
    >>> water_fill([4, 4, 4, 4], load), load
    ([0, 0, 1, 1], [8, 8])
    """
    n = len(load)
    if n > 1 and len(sizes) > 1:
        runs = _contiguous_runs(sizes, load)
        if runs is not None:
            after = list(load)
            for size, r in zip(sizes, runs, strict=True):
                after[r] += size
            if max(after) - min(after) <= max(max(load) - min(load), max(sizes)):
                load[:] = after
                return runs
    out = []
    heap = list(zip(load, range(n), strict=True))  # the least loaded holder, lowest first, is heap[0]
    heapq.heapify(heap)
    for size in sizes:
        best = heap[0][1]
        out.append(best)
        load[best] += size
        heapq.heapreplace(heap, (load[best], best))
    return out


def _contiguous_runs(sizes: Sequence[int], load: list[int]) -> list[int] | None:
    """Each chunk's holder when contiguous runs of the chunks fill the holders below the water level."""
    total = sum(sizes)
    current = sorted(load)
    # the level L such that sum(max(0, L - load)) == total
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
    # The quotas laid end to end; a chunk goes to the holder whose stretch holds the chunk's
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
