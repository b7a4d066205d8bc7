"""A save of a tree like one saved before (saving/_recall.py) is the save a fresh process would make.

A save remembers the trees it described, and a later save of a tree that matches one
reuses its keys, structure and plan. A wrong match is wrong data, so each property saves
a tree, changes it in one of the ways a training program can (its data only; a dict's
order; a key; a tensor resized, retyped or swapped for a Parameter, a view or a Python
value; a value changed; a container swapped for another kind; a leaf added or dropped;
an Abstract's spec, placement, shape or dtype; equal specs as new objects), saves or plans
it again, and checks that the result is, byte for byte or plan for plan, what a process
that never saw the first tree makes of the changed one. The trees whose only change is
their data must be recognised, so the check cannot pass by never reusing anything.
"""

from __future__ import annotations

import collections
import copy
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import pytreeckpt
from pytreeckpt import Abstract, ChunkingOptions
from pytreeckpt.saving import _recall
from pytreeckpt.testing import SimComm, specs

CHUNKING = ChunkingOptions(single_chunk_bytes=24, min_chunk_bytes=8, max_chunk_bytes=24)
DTYPES = [torch.float32, torch.int16, torch.bfloat16, torch.bool, torch.uint8]
WORLD = 8


class Pair(NamedTuple):
    a: Any
    b: Any


class Other(NamedTuple):
    a: Any
    b: Any


def _tensor(draw: st.DrawFn) -> torch.Tensor:
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    return torch.randint(0, 100, shape, generator=g).to(dtype)


_VALUES = st.one_of(st.integers(-5, 5), st.booleans(), st.none(), st.text(max_size=3), st.floats(allow_nan=False))
_KEYS = st.text("abc.", min_size=1, max_size=2)


@st.composite
def _leaf(draw: st.DrawFn) -> Any:
    return _tensor(draw) if draw(st.booleans()) else draw(_VALUES)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.dictionaries(_KEYS, children, max_size=4),
        st.dictionaries(_KEYS, children, max_size=3).map(collections.OrderedDict),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda t: Pair(*t)),
    )


TREES = st.recursive(_leaf(), _containers, max_leaves=12).map(lambda t: {"root": t})


def _nodes(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every node of ``tree`` (containers and leaves) with its path of keys and indices."""
    out = [(path, tree)]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _nodes(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out += _nodes(v, (*path, i))
    return out


def _rebuilt(tree: Any, path: tuple[Any, ...], change: Any) -> Any:
    """``tree`` with the node at ``path`` replaced by ``change(node)``; containers on the way are new objects."""
    if not path:
        return change(tree)
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        out = type(tree)((k, _rebuilt(v, rest, change) if k == head else v) for k, v in tree.items())
        return out
    items = [_rebuilt(v, rest, change) if i == head else v for i, v in enumerate(tree)]
    return type(tree)(*items) if isinstance(tree, Pair) else type(tree)(items)


def _fresh_data(tree: Any) -> Any:
    """The same tree with every tensor a new one of the same shape and dtype, other values."""
    if isinstance(tree, torch.Tensor):
        return (tree.to(torch.int32) + 7).to(tree.dtype) if tree.dtype != torch.bool else ~tree
    if isinstance(tree, dict):
        return type(tree)((k, _fresh_data(v)) for k, v in tree.items())
    if isinstance(tree, Pair):
        return Pair(*(_fresh_data(v) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_fresh_data(v) for v in tree)
    return tree


def _changed(draw: st.DrawFn, tree: Any) -> tuple[Any, bool]:
    """The tree changed in one way, and whether only its data changed (so it must be recognised)."""
    nodes = _nodes(tree)
    kind = draw(
        st.sampled_from(
            ["data", "order", "rename", "resize", "retype", "param", "view", "to_value", "value", "container", "drop"]
        )
    )
    tensors = [(p, n) for p, n in nodes if isinstance(n, torch.Tensor)]
    values = [(p, n) for p, n in nodes if p and not isinstance(n, (torch.Tensor, dict, list, tuple))]
    dicts = [(p, n) for p, n in nodes if isinstance(n, dict) and len(n) >= 1]
    seqs = [(p, n) for p, n in nodes if isinstance(n, (list, tuple)) and not isinstance(n, Pair)]
    if kind == "order" and any(len(n) >= 2 for _, n in dicts):
        p, n = draw(st.sampled_from([(p, n) for p, n in dicts if len(n) >= 2]))
        return _rebuilt(tree, p, lambda d: type(d)(reversed(list(d.items())))), False
    if kind == "rename" and len(dicts) > 1:
        p, n = draw(st.sampled_from(dicts[1:]))
        old = draw(st.sampled_from(sorted(n)))
        new = old + "z"
        return _rebuilt(tree, p, lambda d: type(d)((new if k == old else k, v) for k, v in d.items())), False
    if tensors and kind in ("resize", "retype", "param", "view", "to_value"):
        p, t = draw(st.sampled_from(tensors))
        if kind == "resize":
            new_t = torch.zeros((*t.shape, 2), dtype=t.dtype)
        elif kind == "retype":
            new_t = t.to(torch.float64)
        elif kind == "param":
            new_t = torch.nn.Parameter(t.clone(), requires_grad=False)
        elif kind == "view":  # a view of equal shape and other strides: the same description, other data
            new_t = torch.flip(t, [0]) if t.dim() else t.clone()
            if t.dim() >= 2 and t.shape[0] == t.shape[1]:
                new_t = t.clone().transpose(0, 1)
            return _rebuilt(_fresh_data(tree), p, lambda _: new_t), True
        else:
            new_t = 3
        return _rebuilt(tree, p, lambda _: new_t), False
    if kind == "value" and values:
        p, v = draw(st.sampled_from(values))
        new_v = draw(_VALUES.filter(lambda x: type(x) is not type(v) or x != v))
        return _rebuilt(tree, p, lambda _: new_v), type(new_v) is type(v)
    if kind == "container" and (dicts or seqs):
        p, n = draw(st.sampled_from(dicts + seqs))
        if isinstance(n, dict):
            swap = dict if isinstance(n, collections.OrderedDict) else collections.OrderedDict
            return _rebuilt(tree, p, lambda d: swap(d.items())), False
        if len(n) == 2 and draw(st.booleans()):
            return _rebuilt(tree, p, lambda s: Other(*s)), False
        return _rebuilt(tree, p, lambda s: list(s) if isinstance(s, tuple) else tuple(s)), False
    if kind == "drop" and (dicts or seqs):
        p, n = draw(st.sampled_from(dicts + seqs))
        if isinstance(n, dict):
            return _rebuilt(tree, p, lambda d: type(d)(list(d.items())[1:])), False
        return _rebuilt(tree, p, lambda s: type(s)([*s, 5])), False
    return _fresh_data(tree), True


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@settings(max_examples=100)  # (three saves an example: 100 take about 20 s)
@given(TREES, st.data())
def test_a_changed_tree_saves_as_a_fresh_process_would_save_it(tree: Any, data: st.DataObject) -> None:
    changed, same = _changed(data.draw, tree)
    with tempfile.TemporaryDirectory() as d:
        _recall.forget()
        try:
            pytreeckpt.save(Path(d) / "first", tree, chunking=CHUNKING)
        except pytreeckpt.CheckpointError:
            assume(False)  # (two leaves of one dotted key path: refused, as test_tree.py shows)
        hits = _recall.hits()
        again = _outcome(Path(d) / "again", changed)
        if same:
            assert _recall.hits() == hits + 1, "a tree whose only change is its data was not recognised"
        _recall.forget()
        assert again == _outcome(Path(d) / "fresh", changed)


def _outcome(path: Path, tree: Any) -> Any:
    """The files a save writes, or the error it raises."""
    try:
        pytreeckpt.save(path, tree, chunking=CHUNKING)
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return _files(path)


# --------------------------------------------------------------------------- plans of Abstract trees


@st.composite
def _abstract(draw: st.DrawFn) -> Abstract:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=2)))
    spec = draw(specs(shape, max_ranks=WORLD))
    placement = None
    if draw(st.booleans()):
        placement = tuple(draw(st.permutations(range(WORLD)))[: spec.world_size])
    return Abstract(shape, draw(st.sampled_from([torch.float32, torch.bfloat16])), spec, placement)


ABSTRACT_TREES = st.dictionaries(_KEYS, st.one_of(_abstract(), st.lists(_abstract(), max_size=2)), min_size=1)


def _leaf_paths(tree: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [p for p, n in _nodes(tree) if isinstance(n, Abstract)]


@given(ABSTRACT_TREES, st.integers(0, WORLD - 1), st.data())
def test_a_changed_abstract_tree_plans_as_a_fresh_process_would_plan_it(
    tree: dict[str, Any], rank: int, data: st.DataObject
) -> None:
    paths = _leaf_paths(tree)
    kind = data.draw(st.sampled_from(["copies", "spec", "placement", "shape", "dtype", "order"]))
    same = False
    if kind == "copies" or not paths:  # every Abstract and spec a new object, equal by value
        changed, same = copy.deepcopy(tree), True
    elif kind == "order":
        changed = dict(reversed(list(tree.items())))
    else:
        p = data.draw(st.sampled_from(paths))
        leaf: Abstract = _nodes(tree)[[q for q, _ in _nodes(tree)].index(p)][1]
        if kind == "spec":
            new = Abstract(leaf.shape, leaf.dtype, data.draw(specs(leaf.shape, max_ranks=WORLD)))
        elif kind == "placement":
            order = data.draw(st.permutations(range(WORLD)))
            new = Abstract(leaf.shape, leaf.dtype, leaf.spec, tuple(order[: leaf.spec.world_size]))
        elif kind == "shape":
            shape = (*leaf.shape, 1)
            new = Abstract(shape, leaf.dtype, data.draw(specs(shape, max_ranks=WORLD)))
        else:
            new = Abstract(leaf.shape, torch.float16, leaf.spec, leaf.placement)
        changed = _rebuilt(tree, p, lambda _: new)
    _recall.forget()
    pytreeckpt.plan_save(tree, process_group=SimComm(rank, WORLD))
    hits = _recall.hits()
    again = pytreeckpt.plan_save(changed, process_group=SimComm(rank, WORLD))
    if same:
        assert _recall.hits() == hits + 1, "a copy of the tree was not recognised"
    _recall.forget()
    assert again == pytreeckpt.plan_save(changed, process_group=SimComm(rank, WORLD))
