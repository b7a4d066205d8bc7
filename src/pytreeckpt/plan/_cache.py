"""The plan cache: a save or load in the same layouts as an earlier one reuses its plan.

A small LRU from exact keys to plans; :func:`spec_plan_key` makes the key of a state's
specs cheaply (arrays sharing layout objects, as a model's layers do, are numbered by
identity; only distinct layouts are compared by value). Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import numpy as np

from pytreeckpt.core._sharding import Layout

from ._tables import _I64, unique_rows
from ._types import ArraySpec

__all__ = ["PlanCache", "spec_digest", "spec_plan_key"]

V = TypeVar("V")


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
    # Arrays of one (layout, itemsize, ranks) *objects* and one shape share a number, found
    # with numpy over their ids and shape numbers (a Python loop per array costs more at
    # thousands of arrays); the distinct combinations are few (the model's layer shapes)
    # and are compared by value next, in order of first use. Shapes are numbered by value
    # (in C: a dict's setdefault mapped over them), as every leaf's shape is a tuple of its
    # own: numbered by identity, each array was its own combination, hashed in Python.
    n = len(specs)
    shapes: dict[tuple[int, ...], int] = {}
    columns = [
        np.fromiter(map(id, map(_LAYOUT, specs)), dtype=_I64, count=n),
        np.fromiter(map(shapes.setdefault, map(_SHAPE, specs), itertools.count()), dtype=_I64, count=n),
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


def spec_digest(key: tuple[Any, ...]) -> bytes:
    """A digest of a :func:`spec_plan_key`, the same in every process (Python's own hash is not)."""
    h = hashlib.blake2b(digest_size=16)
    keys, numbered, by_value, layouts = key[:4]
    h.update(keys.encode("utf-8", "surrogatepass"))
    h.update(b"\0")
    h.update(numbered)
    ranks_digests: dict[int, bytes] = {}  # (a rank tuple is shared by the arrays of a mesh: hashed once)
    for number, (shape, itemsize, ranks) in by_value:
        h.update(repr((number, shape, itemsize)).encode())
        if ranks is None:
            h.update(b"N")
            continue
        digest = ranks_digests.get(id(ranks))
        if digest is None:
            digest = ranks_digests[id(ranks)] = hashlib.blake2b(
                np.asarray(ranks, dtype=np.int64).tobytes(), digest_size=16
            ).digest()
        h.update(digest)
    for layout in layouts:
        h.update(repr(layout.to_json()).encode())
    for extra in key[4:]:
        h.update(b"\0" + repr(extra).encode())
    return h.digest()
