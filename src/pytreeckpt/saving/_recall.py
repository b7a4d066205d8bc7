"""A save of a tree like one saved before reuses that save's description and plan.

A training job saves one state again and again: the same dicts of tensors of the same
shapes, in the same layouts. Describing every leaf anew (flattening the tree, checking
each tensor, keying and planning it) costs microseconds a leaf, most of a save's own time
at 10^5 leaves, and most of a rank's plan when the plan itself is cached. So a save
remembers, for the last few trees it described, what it needs to recognise the next one:

- the tree's containers: each one's type, and a dict's keys in their order (or a
  sequence's length), compared a container at a time, in C;
- each leaf's description, column by column: its type; a tensor's shape, dtype, device
  and layout; an :class:`Abstract`'s shape, dtype, spec and placement (compared by
  identity first, so that layouts shared by a model's layers cost one comparison each).

A later save of a tree that matches, under the same world, rank, chunking and namespace,
takes the earlier save's keys, structure and plan, and describes only what is new: each
tensor's data, and each plain Python value (stored inline, so data too). Any other tree
is described in full, as always; so is every tree this cannot compare exactly: one with
dict keys other than str, containers other than dicts, OrderedDicts, lists, tuples and
namedtuples, leaves other than CPU tensors in a single process, Abstract leaves (for
plan_save) and Python values, or a spec or compression tree given.

Nothing here does I/O or talks to other ranks; a remembered tree holds no tensor.
"""

from __future__ import annotations

import collections
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from pytreeckpt.core._leaf import Abstract
from pytreeckpt.core._node import Node
from pytreeckpt.core._region import Region
from pytreeckpt.leaves import KINDS, PLAIN, ArrayIn
from pytreeckpt.leaves._value import ValueKind
from pytreeckpt.plan import ArraySpec, SavePlan

__all__ = ["Recalled", "Remembered", "forget", "hits", "recall", "remember"]

_SIZE = 4  # the trees remembered: a job saves one or a few states (a model, an EMA copy, ...)
# and at most this many leaves in all: a remembered tree holds about 1.7 KB a leaf (its
# structure, descriptions, metadata, entries and plan: 165 MB at 100,000 leaves)
_LEAVES = 200_000
_TYPES = {"dict": dict, "odict": collections.OrderedDict, "list": list, "tuple": tuple}
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DESCRIBE = operator.attrgetter("shape", "dtype", "is_cpu", "layout")  # (one getter: a fifth faster than four)
_SPEC = operator.attrgetter("spec")
_PLACEMENT = operator.attrgetter("placement")


@dataclass(frozen=True, slots=True)
class Remembered:
    """What a save of one tree found, enough to recognise the next save of such a tree and reuse it."""

    context: tuple[Any, ...]  # (world, rank, chunking options, plan only, namespace)
    shape: Any  # the containers: see _template
    types: list[type]
    tensors: list[int]  # the leaves that are plain tensors, in flatten order
    regions: list[Region]  # each plain tensor's one piece, the whole of it
    tensor_columns: list[tuple[Any, ...]]  # their shapes and dtypes, in CPU memory, strided (_DESCRIBE)
    abstracts: list[int]  # the Abstract leaves
    abstract_columns: tuple[list[Any], ...]  # their shapes and dtypes, and their specs and placements numbered
    values: list[int]  # the plain Python values
    keys: list[str]
    root: Node
    arrays: list[ArrayIn]  # the array leaves as described (a tensor's data getter and watch taken out)
    array_of: list[int]  # each leaf's index in ``arrays`` (-1 for a value)
    codecs: dict[str, Any]
    plan: SavePlan
    specs: list[ArraySpec]  # what the ranks agree on, and the agreement's own key of it
    dtypes: list[str]
    agreed: tuple[tuple[Any, ...], bytes] | None  # spec_plan_key(specs) and the digest the ranks compare
    derived: dict[Any, Any] = field(default_factory=dict)  # what the save derived from it, by where it stored it

    @property
    def only_tensors(self) -> bool:
        """Every leaf a plain tensor (so each one's index in ``arrays`` is its own)."""
        return len(self.tensors) == len(self.types)


@dataclass(frozen=True, slots=True)
class Recalled:
    """A tree recognised: the earlier save's description, and this tree's own leaves."""

    was: Remembered
    leaves: list[Any]


_remembered: list[Remembered] = []
_lock = threading.Lock()
_hits = [0]  # the saves that reused a remembered description (tests check that it happens)


def _template(node: Node) -> Any:
    """The containers of a tree as :func:`_leaves_of` matches them: None for a leaf, else
    (type, dict keys or None, the children's templates or None if all are leaves); None
    for the whole tree if it holds a container this cannot compare exactly."""
    if node.kind == "leaf":
        return None
    typ = node.type if node.kind == "namedtuple" else _TYPES.get(node.kind)
    keys = None
    if node.kind in ("dict", "odict"):
        if any(e[0] != "s" for e in node.entries):
            raise _NotPlain
        keys = [e[1] for e in node.entries]
    elif typ is None:
        raise _NotPlain
    kids = [None if c.kind == "leaf" else _template(c) for c in node.children]
    return (typ, keys, len(kids), None if all(k is None for k in kids) else kids)


class _NotPlain(Exception):
    pass


def _leaves_of(x: Any, template: Any, leaves: list[Any]) -> bool:
    """Whether ``x``'s containers are ``template``'s (their types, keys in order, lengths),
    appending its leaves in flatten order to ``leaves``."""
    typ, keys, n, kids = template
    if type(x) is not typ:
        return False
    if keys is not None:
        if list(x) != keys:  # (str keys in insertion order; equal strings are the same key path)
            return False
        children = x.values()
    else:
        if len(x) != n:
            return False
        children = x
    if kids is None:
        leaves.extend(children)
        return True
    for c, k in zip(children, kids, strict=True):
        if k is None:
            leaves.append(c)
        elif not _leaves_of(c, k, leaves):
            return False
    return True


def _pick(leaves: list[Any], idx: list[int]) -> list[Any]:
    return leaves if len(idx) == len(leaves) else [leaves[i] for i in idx]


def _numbered(objs: list[Any]) -> tuple[list[int], list[int], list[Any]]:
    """Each object's number among the distinct values (hashable, compared by value) in order of
    first use, the index of each number's first object, and the values. Objects are looked up by
    identity first: a model's layers share their layouts, so only the few distinct objects are
    hashed and compared."""
    ids = list(map(id, objs))
    canon: dict[Any, int] = {}
    first: list[int] = []
    number = {}
    for i, o in enumerate(objs):
        if ids[i] not in number:
            got = number[ids[i]] = canon.setdefault(o, len(canon))
            if got == len(first):
                first.append(i)
    return list(map(number.__getitem__, ids)), first, list(canon)


def _same_numbered(objs: list[Any], numbered: tuple[list[int], list[int], list[Any]]) -> bool:
    """Whether each object equals the value ``numbered`` (of :func:`_numbered`) gives it: compared
    by value for the first of each number, then, as a list in C, by identity where shared."""
    numbers, first, values = numbered
    reps = [objs[i] for i in first]
    return reps == values and objs == list(map(reps.__getitem__, numbers))


def _abstract_columns(abstracts: list[Any]) -> tuple[Any, ...]:
    return (
        list(map(_SHAPE, abstracts)),
        list(map(_DTYPE, abstracts)),
        _numbered(list(map(_SPEC, abstracts))),
        _numbered(list(map(_PLACEMENT, abstracts))),
    )


def _same_abstracts(abstracts: list[Any], columns: tuple[Any, ...]) -> bool:
    shapes, dtypes, spec_numbers, placement_numbers = columns
    return (
        list(map(_SHAPE, abstracts)) == shapes
        and list(map(_DTYPE, abstracts)) == dtypes
        and _same_numbered(list(map(_SPEC, abstracts)), spec_numbers)
        and _same_numbered(list(map(_PLACEMENT, abstracts)), placement_numbers)
    )


def _no_data(rank: int, pi: int) -> Any:
    raise AssertionError("a remembered description holds no data")


def remember(
    context: tuple[Any, ...],
    leaves: Sequence[Any],
    keys: list[str],
    root: Node,
    arrays: list[ArrayIn],
    codecs: dict[str, Any],
    plan: SavePlan,
    specs: list[ArraySpec],
    dtypes: list[str],
    agreed: tuple[tuple[Any, ...], bytes] | None,
) -> Remembered | None:
    """Remember the description of a tree (flattened by pytreeckpt to ``leaves``), if it can be recognised exactly."""
    world, _, _, plan_only, _ = context
    try:
        shape = _template(root)
    except _NotPlain:
        return None
    # Which leaves are tensors, Abstract leaves and Python values, by type (a few types, many leaves).
    types = list(map(type, leaves))
    kind_of: dict[type, int] = {}
    for t, leaf in dict(zip(types, leaves, strict=True)).items():  # (a leaf of each type, in C)
        if isinstance(KINDS.of(leaf), ValueKind):
            kind_of[t] = 0
        elif t in PLAIN and world is None:
            kind_of[t] = 1
        elif t is Abstract and plan_only:
            kind_of[t] = 2
        else:
            return None
    kinds = np.fromiter(map(kind_of.__getitem__, types), dtype=np.int8, count=len(types))
    is_array = kinds != 0
    tensors, abstracts, values = (np.flatnonzero(kinds == k).tolist() for k in (1, 2, 0))
    array_of = np.where(is_array, np.cumsum(is_array) - 1, -1).tolist()
    if len(tensors) + len(abstracts) != len(arrays):
        return None
    described = _pick(arrays, tensors) if not abstracts else [arrays[array_of[i]] for i in tensors]
    # (what recall reads of each tensor, from what _plain_in read: a tuple equals a torch.Size)
    tensor_columns = [(a.shape, a.dtype.torch, True, torch.strided) for a in described]
    regions = [a.pieces[0][0].region for a in described]
    for a in described:  # (what reads their data: the save took it already, and nothing remembered holds it)
        a.get = _no_data
        a.watch = ()
    memo = Remembered(
        context,
        shape,
        types,
        tensors,
        regions,
        tensor_columns,
        abstracts,
        _abstract_columns(_pick(list(leaves), abstracts)),
        values,
        keys,
        root,
        arrays,
        array_of,
        codecs,
        plan,
        specs,
        dtypes,
        agreed,
    )
    with _lock:
        kept = [m for m in _remembered if m.context != context or m.shape != shape][-(_SIZE - 1) :]
        while kept and sum(len(m.types) for m in kept) + len(types) > _LEAVES:
            kept.pop(0)  # (the least recently remembered first; the newest tree is always kept)
        _remembered[:] = [*kept, memo]
    return memo


def recall(tree: Any, context: tuple[Any, ...]) -> Recalled | None:
    """The description of an earlier save this tree matches, or None."""
    with _lock:
        candidates = [m for m in reversed(_remembered) if m.context == context]
    for m in candidates:
        leaves: list[Any] = []
        try:
            if m.shape is None:
                leaves.append(tree)
            elif not _leaves_of(tree, m.shape, leaves):
                continue
            if list(map(type, leaves)) != m.types:
                continue
            if m.tensors and list(map(_DESCRIBE, _pick(leaves, m.tensors))) != m.tensor_columns:
                continue
            if m.abstracts and not _same_abstracts(_pick(leaves, m.abstracts), m.abstract_columns):
                continue
        except Exception:  # (keys that cannot be compared, a tensor whose shape cannot be asked: described in full)
            continue
        with _lock:
            _hits[0] += 1
        return Recalled(m, leaves)
    return None


def hits() -> int:
    """How many saves (and plans) so far reused a remembered description."""
    return _hits[0]


def forget() -> None:
    """Forget every remembered tree (tests, and a benchmark's cold runs)."""
    with _lock:
        _remembered.clear()
