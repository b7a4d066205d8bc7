"""Every memo planning keeps beyond one call, in one place: what each holds, its bound, and why.

Planning is pure functions (no planner object lives from one call to the next), so what it
derives from a layout alone is kept here, for the life of the process. Each memo maps
immutable inputs (a layout, a shape, a piece table) to what follows from them alone: a hit
returns what a miss would compute, so they change how long planning takes, never what it
returns. Each is bounded (cleared when full: a process planning ever new layouts stays
bounded). :func:`clear` forgets them all (``plan.clear_caches``: benchmarks time cold
planning with it). A plan of the same state again is cached per state by
:class:`~pytreeckpt.plan.PlanCache`, which its owner (a save or load) holds.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

__all__ = [
    "CHUNK_CUTS",
    "LOAD_CUTS",
    "OUTSIDE",
    "PART_INDEXES",
    "PLACED",
    "PLACED_BY_ID",
    "SCOPE_KEYS",
    "STRUCTURES",
    "TABLES",
    "WHOLE_WRITES",
    "Interned",
    "Memo",
    "clear",
]

V = TypeVar("V")


class Memo(dict[Any, Any]):
    """A bounded memo: cleared when full (what it holds is cheap to make again; this keeps memory bounded)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def get_or(self, key: Hashable, make: Callable[[], V]) -> V:
        try:
            return self[key]  # type: ignore[no-any-return]
        except KeyError:
            if len(self) >= self.limit:
                self.clear()
            value = make()
            self[key] = value
            return value


class Interned:
    """Equal byte strings as one object, up to ``limit`` bytes of them (then forgotten, and kept anew)."""

    __slots__ = ("_held", "_keys", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._keys: dict[bytes, bytes] = {}
        self._held = 0

    def get(self, key: bytes) -> bytes:
        got = self._keys.get(key)
        if got is not None:
            return got
        if self._held + len(key) > self.limit:
            self.clear()
        self._keys[key] = key
        self._held += len(key)
        return key

    def clear(self) -> None:
        self._keys.clear()
        self._held = 0


TABLES = Memo(4096)
"""(layout, shape) -> its :class:`~pytreeckpt.plan._tables.PieceTable` (``_tables.piece_table``)."""
PLACED = Memo(4096)
"""(layout, shape, ranks) -> its :class:`~pytreeckpt.plan._tables.Placed` (``_tables.placed``), which also memoises
what is derived from it (``Placed.derived``, ``Placed.per_table``)."""
PLACED_BY_ID = Memo(4096)
"""(id of a layout, shape, ranks) -> (that layout, its ``Placed``): found without hashing a layout by value; the
layout is kept alive, so its id is not reused meanwhile."""
CHUNK_CUTS = Memo(4096)
"""id of a piece table -> (that table, the gcd of its piece boundaries per dim) (``_chunking.chunk_shape_of_table``)."""
STRUCTURES = Memo(4096)
"""(table key, what) -> a save structure (``_structure.structure_of``, ``rank_structure_of``), shared by the
placements of one table (the pipeline stages of a model)."""
PART_INDEXES = Memo(4096)
"""id of a piece table -> its index of boxes by position along one dim (``_structure._PartIndex``; it keeps the
table alive)."""
LOAD_CUTS = Memo(4096)
"""(table key, what) -> how a load cuts a table's boxes along a chunk grid (``_load._cuts``)."""
OUTSIDE = Memo(4096)
"""(table key, "outside") -> the first row of a table reaching outside its array, or -1 (``_load._outside``)."""
WHOLE_WRITES = Memo(4096)
"""shape -> the one write of an array rank 0 holds whole (``_save.plan_whole``): a shared tuple per shape."""
SCOPE_KEYS = Interned(64 << 20)
"""The keys of scopes (``_balance.scope_key``), one object per value: a dict finds a key it holds by identity,
where an equal key of another object is compared byte by byte (128 KB for a scope of 16,384 ranks)."""

_ALL = (
    TABLES,
    PLACED,
    PLACED_BY_ID,
    CHUNK_CUTS,
    STRUCTURES,
    PART_INDEXES,
    LOAD_CUTS,
    OUTSIDE,
    WHOLE_WRITES,
    SCOPE_KEYS,
)


def clear() -> None:
    """Forget every memo above."""
    for memo in _ALL:
        memo.clear()
