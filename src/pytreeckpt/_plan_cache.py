"""The plan cache: a save in the same layouts as an earlier one reuses its plan.

Pure: a small LRU from exact keys to plans; the caller decides the key. Nothing here
does I/O.
"""

from __future__ import annotations

import hashlib
import operator
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._errors import LayoutError
from ._piece_table import _I64, ArraySpec, unique_rows
from ._plan import ArrayLayout, ChunkingOptions, SavePlan
from ._plan_table import plan_save_tables
from ._sharding import Layout, Piece

__all__ = ["PlanCache", "cached_plan_save", "layouts_digest", "plan_save_fast", "spec_plan_key"]

V = TypeVar("V")


@dataclass(frozen=True, slots=True, eq=False)
class _GivenPieces(Layout):
    """Pieces already computed (gathered from the ranks), as a layout; equal by content."""

    pieces: tuple[tuple[Piece, ...], ...]

    @property
    def world_size(self) -> int:
        return len(self.pieces)

    def rank_pieces(self, shape: Sequence[int]) -> tuple[tuple[Piece, ...], ...]:
        return self.pieces

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _GivenPieces) and self.pieces == other.pieces

    def __hash__(self) -> int:
        return hash(self.pieces)


def plan_save_fast(layouts: Sequence[ArrayLayout], world: int, options: ChunkingOptions | None = None) -> SavePlan:
    """:func:`~pytreeckpt._plan.plan_save`, computed by the tables: the same plan, errors and all."""
    options = options or ChunkingOptions()
    for a in layouts:
        if len(a.pieces) > world:
            raise LayoutError(f"leaf {a.key!r}: its layout spans {len(a.pieces)} ranks but the world has {world}")
    specs = [ArraySpec(a.key, a.shape, a.itemsize, _GivenPieces(a.pieces)) for a in layouts]
    return SavePlan(world, tuple(t.to_plan() for t in plan_save_tables(specs, world, options)))


class PlanCache:
    """A small LRU of plans keyed by a hash of their inputs: a save in the same layout as the last reuses its plan.

    Pure: it only maps keys to values; the caller decides the key.

    >>> cache = PlanCache(2)
    >>> cache.get_or("k", lambda: 1), cache.get_or("k", lambda: 2), cache.hits
    (1, 1, 1)
    """

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[Hashable, Any] = OrderedDict()

    def get_or(self, key: Hashable, make: Callable[[], V]) -> V:
        if key in self._items:
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key]  # type: ignore[no-any-return]
        self.misses += 1
        value = make()
        self._items[key] = value
        while len(self._items) > self.size:
            self._items.popitem(last=False)
        return value

    def clear(self) -> None:
        self._items.clear()


def spec_plan_key(specs: Sequence[ArraySpec], *extra: Hashable) -> tuple[Any, ...]:
    """An exact cache key for plans of ``specs``, then ``extra`` (world, options, rank...).

    Per array (key, shape, itemsize, layout number, ranks), then the distinct layouts,
    compared by value. Cheap when arrays share layout objects (the layers of a model
    do): each layout object is numbered once by identity; only distinct ones are hashed.

    >>> from pytreeckpt import Mesh, Shard, ShardingSpec
    >>> spec = ShardingSpec(Mesh(2), [Shard(0)])
    >>> a = [ArraySpec("w", (4, 4), 4, spec), ArraySpec("v", (4, 4), 4, spec)]
    >>> b = [ArraySpec("w", (4, 4), 4, ShardingSpec(Mesh(2), [Shard(0)])), ArraySpec("v", (4, 4), 4, spec)]
    >>> spec_plan_key(a, 2) == spec_plan_key(b, 2)
    True
    """
    # Arrays of one (layout, shape, itemsize, ranks) *objects* share a number, found with
    # numpy over their ids (hashing every shape and range by value, or a Python loop per
    # array, costs more at thousands of arrays); the distinct combinations are few (the
    # model's layer shapes) and are compared by value next, in order of first use.
    n = len(specs)
    columns = [
        np.fromiter(map(id, map(_LAYOUT, specs)), dtype=_I64, count=n),
        np.fromiter(map(id, map(_SHAPE, specs)), dtype=_I64, count=n),
        np.fromiter(map(_ITEMSIZE, specs), dtype=_I64, count=n),
        np.fromiter(map(id, map(_RANKS, specs)), dtype=_I64, count=n),
    ]
    _, inverse, first = unique_rows(np.stack(columns, axis=1).reshape(n, 4))
    by_use = np.argsort(first, kind="stable")
    renumber = np.empty(len(first), dtype=_I64)
    renumber[by_use] = np.arange(len(first), dtype=_I64)
    nums = renumber[inverse]
    first_of = first[by_use].tolist()
    # Equal layouts met as distinct objects are normalised by value.
    canon: dict[Layout, int] = {}
    by_value: dict[tuple[Any, ...], int] = {}
    remap = []
    for i in first_of:
        s = specs[i]
        cols = (s.shape, s.itemsize, s.ranks)
        remap.append(by_value.setdefault((canon.setdefault(s.layout, len(canon)), cols), len(by_value)))
    numbered = np.asarray(remap, dtype=_I64)[nums]
    keys = "\0".join(map(_KEY, specs))
    return (keys, numbered.tobytes(), tuple(by_value), tuple(canon), *extra)


_LAYOUT = operator.attrgetter("layout")
_KEY = operator.attrgetter("key")
_SHAPE = operator.attrgetter("shape")
_ITEMSIZE = operator.attrgetter("itemsize")
_RANKS = operator.attrgetter("ranks")


_SAVE_PLANS = PlanCache(4)  # the plans of the last few saves


def cached_plan_save(
    layouts: Sequence[ArrayLayout], world: int, options: ChunkingOptions | None = None, cache: PlanCache | None = None
) -> SavePlan:
    """:func:`plan_save_fast`, reusing the plan of an earlier save whose layouts, world and options were equal.

    The key is the layouts themselves (a dict lookup: their hash, then equality), so a
    hit is exact, never a collision.
    """
    cache = _SAVE_PLANS if cache is None else cache
    key = (world, options or ChunkingOptions(), tuple(layouts))
    return cache.get_or(key, lambda: plan_save_fast(layouts, world, options))


def layouts_digest(parts: Sequence[Any]) -> str:
    """A digest of planning inputs (anything with a stable ``repr``): the plan cache's key."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\0")
    return h.hexdigest()
