"""Objects with ``state_dict()`` and ``load_state_dict()``: saved as their state dicts' subtrees, restored in place.

Models (``nn.Module``), optimizers, LR schedulers, ``GradScaler``, stateful dataloaders and
a user's class are leaves of the kinds here (:class:`ModuleKind`, :class:`OptimizerKind`,
:class:`StatefulKind`, all an :class:`ObjectKind`). They never reach a save's description
or a load's matching as they are: before a save flattens its tree, :func:`expand_save`
puts each object's state dict in its place, and before a load matches its target,
:func:`expand_target` does so with the checkpoint's own subtree at that key (its leaves the
object's where it has them, else :data:`AS_STORED`: an optimizer that has not stepped
yet holds no state to load into). After every array is read, :meth:`Objects.restore`
gives each object its loaded subtree (``load_state_dict``) and puts the object itself in
the result. Finding that a tree holds no object is one pass over its leaves' types, in C.

A model whose parameters are DTensors (FSDP2, TP), or any model once torch.distributed is
initialised, and the optimizers paired with it (the model of the same tree whose
parameters cover the optimizer's) go through torch's distributed state-dict helpers
(``pytreeckpt.distributed._objects``); otherwise through their own ``state_dict()``. Either
way an optimizer paired with a model is stored keyed by the model's parameter names (as
the helpers key it), so a checkpoint saved by one route loads by the other. Optimizer state
is matched by parameter name, never by position: before any read, the target optimizer's
parameter names and groups are compared with the checkpoint's (:meth:`OptimizerKind.check`),
and its loaded state is renumbered to the target's own order of groups and parameters. An
optimizer none of whose tree's models holds all its parameters has no names, and is refused.
A model's state is matched by name as well: its subtree is its own state's, so a key on one
side only is a mismatch found before any read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from pytreeckpt.core._dtypes import TORCH_NAMES
from pytreeckpt.core._errors import CheckpointError, where
from pytreeckpt.core._keys import KeyEntry, keystr
from pytreeckpt.core._node import Node
from pytreeckpt.core._tree import flatten
from pytreeckpt.distributed._objects import (
    model_state,
    optimizer_state,
    set_model_state,
    set_optimizer_state,
    uses_helpers,
)
from pytreeckpt.format import ArrayMeta, ValueMeta

from ._kind import KINDS, Describing, LeafKind, Matching
from ._value import ValueKind

__all__ = [
    "AS_STORED",
    "AsStoredKind",
    "ModuleKind",
    "ObjectKind",
    "Objects",
    "OptimizerKind",
    "StatefulKind",
    "expand_save",
    "expand_target",
]


class ObjectKind(LeafKind):
    """An object saved as its state dict's subtree and restored in place: what every object kind does."""

    name = "object"
    strict = False  # whether a load target's own state must match the checkpoint's (else the checkpoint's is taken)

    def claims(self, t: type) -> bool:
        return (
            callable(getattr(t, "state_dict", None))
            and callable(getattr(t, "load_state_dict", None))
            and not issubclass(t, (torch.Tensor, dict, list, tuple))  # (containers stay containers)
            and not dataclasses.is_dataclass(t)
        )

    def state(self, obj: Any, key: str, objects: Objects) -> Any:
        """The subtree ``obj`` is saved as (and, for a load target, the leaves its state is read into)."""
        return obj.state_dict()

    def restore(self, obj: Any, loaded: Any, key: str, objects: Objects) -> None:
        """Give ``obj`` its loaded subtree."""
        obj.load_state_dict(loaded)

    def check(self, obj: Any, state: Any, sub: Node, metas: Sequence[ArrayMeta | ValueMeta], key: str) -> list[str]:
        """What keeps load target ``obj`` (its own state ``state``) from taking the stored subtree ``sub``, found
        before any read (``metas``: the checkpoint's leaves)."""
        return []

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        raise CheckpointError(f"leaf {where(key)}: a {type(leaf).__name__} object is saved only by save and async_save")

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        raise CheckpointError(f"leaf {where(key)}: a {type(leaf).__name__} object is a target only of load")


class StatefulKind(ObjectKind):
    """Any other object with ``state_dict()`` and ``load_state_dict()``: LR schedulers, GradScaler, dataloaders."""

    name = "stateful"


class ModuleKind(ObjectKind):
    """An ``nn.Module``: through the distributed state-dict helpers when its parameters are DTensors or
    torch.distributed is initialised."""

    name = "module"
    strict = True

    def claims(self, t: type) -> bool:
        return issubclass(t, nn.Module)

    def state(self, obj: Any, key: str, objects: Objects) -> Any:
        if uses_helpers(obj.parameters()):
            return model_state(obj)
        return obj.state_dict()

    def restore(self, obj: Any, loaded: Any, key: str, objects: Objects) -> None:
        if uses_helpers(obj.parameters()):
            set_model_state(obj, loaded)
        else:
            obj.load_state_dict(loaded)


class OptimizerKind(ObjectKind):
    """A ``torch.optim.Optimizer``, paired with the model of its tree that holds its parameters."""

    name = "optimizer"

    def claims(self, t: type) -> bool:
        return issubclass(t, torch.optim.Optimizer)

    def state(self, obj: Any, key: str, objects: Objects) -> Any:
        model = objects.model_of(key, obj)
        if uses_helpers(model.parameters()):
            return optimizer_state(model, obj)
        return _by_name(obj.state_dict(), _names(_params(obj), model))

    def restore(self, obj: Any, loaded: Any, key: str, objects: Objects) -> None:
        model = objects.model_of(key, obj)
        if uses_helpers(model.parameters()):
            set_optimizer_state(model, obj, loaded)  # (torch's helpers match groups and state by name)
            return
        obj.load_state_dict(_by_number(loaded, [_names(g["params"], model) for g in obj.param_groups]))

    def check(self, obj: Any, state: Any, sub: Node, metas: Sequence[ArrayMeta | ValueMeta], key: str) -> list[str]:
        """The checkpoint's parameter names and groups are the target optimizer's: the same names, each group
        holding the same set of parameters (in any order of groups and of parameters within them)."""
        at = where(key)
        stored = _stored_groups(sub, metas)
        if stored is None:
            return [
                f"leaf {at}: the checkpoint's optimizer state is not keyed by parameter name (saved without its "
                f"model, or by an older pytreeckpt), so it cannot be matched to this optimizer's parameters: load "
                f"it with target=None and give it to Optimizer.load_state_dict yourself"
            ]
        mine = [list(g["params"]) for g in state["param_groups"]]
        have, want = {n for g in stored for n in g}, {n for g in mine for n in g}
        problems = []
        if have != want:
            problems.append(
                f"leaf {at}: the optimizer's parameters differ by name: only in the checkpoint {sorted(have - want)}, "
                f"only in the target {sorted(want - have)}"
            )
        elif sorted(map(sorted, stored)) != sorted(map(sorted, mine)):
            problems.append(
                f"leaf {at}: the optimizer's parameter groups differ: the checkpoint's hold {stored}, the target's "
                f"{mine}"
            )
        extra = sorted(map(str, _state_keys(sub) - have))
        if extra:
            problems.append(f"leaf {at}: the checkpoint holds optimizer state of parameters in no group: {extra}")
        return problems


def _params(optimizer: Any) -> list[Any]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _names(params: Sequence[Any], model: nn.Module) -> list[str]:
    """The name in ``model`` of each of ``params``."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in params]


def _by_name(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer's state dict keyed by parameter name (``names``: by parameter number), as torch's distributed
    helpers key it."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {**sd, "state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": groups}


def _by_number(sd: dict[str, Any], groups: list[list[str]]) -> dict[str, Any]:
    """:func:`_by_name` undone for an optimizer whose groups hold the parameters named ``groups``: keyed by
    parameter number, its groups in the optimizer's own order of groups and of parameters within them, as
    ``Optimizer.load_state_dict`` pairs them (by position). The names were matched before the read
    (:meth:`OptimizerKind.check`)."""
    by_set = {frozenset(g["params"]): g for g in sd["param_groups"]}
    number: dict[str, int] = {}
    ordered = []
    for names in groups:
        base = len(number)
        ordered.append({**by_set[frozenset(names)], "params": list(range(base, base + len(names)))})
        number.update((n, base + k) for k, n in enumerate(names))
    return {**sd, "state": {number[n]: v for n, v in sd["state"].items()}, "param_groups": ordered}


def _child(node: Node, name: str) -> Node | None:
    """The child of dict node ``node`` at string key ``name``, or None."""
    if node.kind not in ("dict", "odict"):
        return None
    for entry, child in zip(node.entries, node.children, strict=True):
        if entry == ("s", name):
            return child
    return None


def _stored_groups(sub: Node, metas: Sequence[ArrayMeta | ValueMeta]) -> list[list[str]] | None:
    """The parameter names of each group of a stored optimizer state (None: it is not keyed by name)."""
    groups = _child(sub, "param_groups")
    if groups is None or groups.kind not in ("list", "tuple"):
        return None
    out = []
    for g in groups.children:
        params = _child(g, "params")
        if params is None or params.kind not in ("list", "tuple"):
            return None
        names = [metas[c.leaf] if c.kind == "leaf" else None for c in params.children]
        if not all(isinstance(m, ValueMeta) and type(m.value) is str for m in names):
            return None
        out.append([cast(ValueMeta, m).value for m in names])
    return out


def _state_keys(sub: Node) -> set[Any]:
    """The keys of a stored optimizer state's ``state`` dict: the parameters it holds state of."""
    state = _child(sub, "state")
    return set() if state is None else {e[1] if e[0] == "s" else e for e in state.entries}


class _AsStored:
    """A target leaf of an object's subtree that the object does not hold yet: loaded as stored."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "AS_STORED"


AS_STORED = _AsStored()


class AsStoredKind(LeafKind):
    """:data:`AS_STORED`: the stored leaf as a load without a target makes it (an optimizer's state before its
    first step)."""

    name = "as_stored"

    def claims(self, t: type) -> bool:
        return t is _AsStored

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        raise CheckpointError(f"leaf {where(key)}: AS_STORED is a load target, never saved")

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        KINDS.stored(stored).destination(i, key, stored, None, m)


@dataclass(slots=True)
class Found:
    """An object of a tree: its leaf index and key path there, its kind; for a load target, the stored
    subtree its state is read as (``node``: that subtree's structure, ``indices``: its stored leaves)."""

    index: int
    key: str
    obj: Any
    kind: ObjectKind
    node: Node | None = None
    indices: list[int] = dataclasses.field(default_factory=list)


class Objects:
    """The objects of a tree (a save's, or a load target's), with what pairs an optimizer with its model."""

    def __init__(self, found: list[Found], root: Node, n: int) -> None:
        self.found = found
        self.root = root  # the tree's structure with its objects as leaves
        self.n = n  # its leaves
        self.tree: Any = None  # the tree with each object's state dict in its place
        self.problems: list[str] = []  # a load target's objects that do not match the checkpoint
        self._params: dict[int, set[int]] = {}

    def model_of(self, key: str, optimizer: Any) -> nn.Module:
        """The model of the tree whose parameters cover ``optimizer``'s (the first in the tree's order): it names
        them.

        Raises:
          CheckpointError: no model of the tree holds all of the optimizer's parameters.
        """
        params = _params(optimizer)
        wanted = {id(p) for p in params}
        for f in self.found:
            if isinstance(f.kind, ModuleKind):
                have = self._params.get(id(f.obj))
                if have is None:
                    have = self._params[id(f.obj)] = {id(p) for p in f.obj.parameters()}
                if wanted <= have:
                    return cast(nn.Module, f.obj)
        named: set[int] = set().union(*self._params.values())
        unnamed = [f"#{i} of shape {tuple(p.shape)}" for i, p in enumerate(params) if id(p) not in named]
        helpers = " (its state goes through torch's distributed state-dict helpers, which need its model)"
        raise CheckpointError(
            f"leaf {where(key)}: optimizer state is stored and matched by parameter name, and no model of the tree "
            f"holds all of this optimizer's parameters ({len(unnamed)} of {len(params)} are in none of its models: "
            f"{', '.join(unnamed[:8])}{', ...' if len(unnamed) > 8 else ''}){helpers if uses_helpers(params) else ''}"
            f": put the model whose parameters it optimizes in the same tree (one nn.Module holding them all, e.g. "
            f"an nn.ModuleDict)"
        )

    def described(self) -> list[str]:
        """The objects, as ranks compare them before a distributed load (each restores its own after it)."""
        return [f"{f.key or '(root)'} (a {type(f.obj).__name__} object)" for f in self.found]

    def state_of(self, f: Found) -> Any:
        try:
            return f.kind.state(f.obj, f.key, self)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"leaf {where(f.key)}: {type(f.obj).__name__}.state_dict() failed: {e}") from e

    def restore(self, results: Sequence[Any]) -> Any:
        """The load's result tree: each object given its loaded subtree, and in its place."""
        by_index = {f.index: f for f in self.found}
        restored: list[str] = []
        out: list[Any] = []
        pos = 0
        for j in range(self.n):
            f = by_index.get(j)
            if f is None:
                out.append(results[pos])
                pos += 1
                continue
            count = len(f.indices)
            assert f.node is not None
            loaded = f.node.unflatten(
                cast(Sequence[Any], dict(zip(f.indices, results[pos : pos + count], strict=True)))
            )
            pos += count
            try:
                f.kind.restore(f.obj, loaded, f.key, self)
            except Exception as e:
                done = ", ".join(where(k) for k in restored) if restored else "none"
                raise CheckpointError(
                    f"leaf {where(f.key)}: the checkpoint's state was read but {type(f.obj).__name__}.load_state_dict "
                    f"refused it: {type(e).__name__}: {e} (the target's objects restored before it: {done}; those "
                    f"after it were not restored)"
                ) from e
            restored.append(f.key)
            out.append(f.obj)
        return self.root.unflatten(out)


def _find(leaves: Sequence[Any], key_of: Callable[[int], str]) -> list[Found]:
    """The objects among ``leaves``, just flattened (so every leaf's type was asked of :data:`KINDS`): in a
    process that never met an object, known at once; else one pass over the leaves' types, in C."""
    met = KINDS.met(ObjectKind)
    if not met or met.isdisjoint(map(type, leaves)):
        return []
    return [Found(i, key_of(i), x, cast(ObjectKind, KINDS.kind(x))) for i, x in enumerate(leaves) if type(x) in met]


def expand_save(leaves: list[Any], keys: list[str], root: Node) -> Any | None:
    """The tree of a save's ``leaves`` (flattened with objects as leaves) with each object's state dict in its
    place; None if it holds no object.

    Raises:
      CheckpointError: naming the object's key path, if its state cannot be had.
    """
    found = _find(leaves, keys.__getitem__)
    if not found:
        return None
    objects = Objects(found, root, len(leaves))
    expanded = list(leaves)
    for f in found:
        expanded[f.index] = objects.state_of(f)
    return root.unflatten(expanded)


def expand_target(
    leaves: list[Any],
    paths: list[tuple[KeyEntry, ...]],
    root: Node,
    stored: Node,
    metas: Sequence[ArrayMeta | ValueMeta],
    namespace: str,
    rank: int = 0,
    world: int = 1,
) -> Objects | None:
    """A load target's objects (None if it holds none), with ``tree``: the target with each object's state in
    its place, shaped as the checkpoint's subtree at its key path (``stored``: the checkpoint's structure,
    ``metas``: its leaves), or, for a model (a ``strict`` kind), as its own state.

    The checkpoint's state is what an object gets: the object's own leaves say only where it goes (its
    tensors' memory, its DTensors' layout). A stored leaf the object's state lacks is loaded as stored
    (:data:`AS_STORED`); so is one the object holds as another kind of leaf (a value for an array, an array of
    another shape or dtype). A model's state is matched leaf by leaf, by key path, as any target's is: a key on
    one side only, or a leaf of another shape or dtype, is a mismatch (a load's problems are listed before any
    read). An object whose key path holds no subtree in the checkpoint is a problem, and so is anything its
    kind's :meth:`ObjectKind.check` finds (an optimizer's parameter names). At a per-rank part of the checkpoint
    (``PER_RANK``) an object is shaped as the subtree its rank (``rank`` of ``world``) saved; a part saved at
    another world size leaves it its own state, for the load's ``per_rank`` policy to judge.
    """
    found = _find(leaves, lambda i: keystr(paths[i]))
    if not found:
        return None
    objects = Objects(found, root, len(leaves))
    expanded = list(leaves)
    for f in found:
        state = objects.state_of(f)
        try:
            s_leaves, s_paths, own = flatten(state, KINDS.is_leaf, namespace=namespace)
        except CheckpointError as e:
            raise CheckpointError(f"leaf {where(f.key)}: its state dict: {e}") from None
        sub = _subnode(stored, paths[f.index])
        if sub is not None and sub.kind == "per_rank":
            sub = sub.children[rank] if len(sub.children) == world else own  # (else the per_rank policy judges)
        if sub is None or (sub.kind == "leaf" and sub is not own):
            there = "nothing" if sub is None else "a single leaf"
            objects.problems.append(
                f"leaf {where(f.key)}: the target holds a {type(f.obj).__name__} object, the checkpoint has {there} "
                f"there"
            )
            f.node, expanded[f.index] = Node("dict"), {}
            continue
        if sub is not own:
            objects.problems += f.kind.check(f.obj, state, sub, metas, f.key)
        if sub is own or f.kind.strict:  # (its own state's tree: its leaves and the stored ones matched by path)
            f.node, f.indices = own, list(range(len(s_leaves)))
            expanded[f.index] = state
            continue
        mine = dict(zip(s_paths, s_leaves, strict=True))
        f.node, f.indices = sub, sub.leaf_indices()
        values = {}
        for i, p in zip(f.indices, sub.paths(), strict=True):
            leaf = mine.pop(p, AS_STORED)
            values[i] = leaf if leaf is AS_STORED or _fits(leaf, metas[i]) else AS_STORED
        expanded[f.index] = sub.unflatten(cast(Sequence[Any], values))
    objects.tree = root.unflatten(expanded)
    return objects


def _fits(leaf: Any, meta: ArrayMeta | ValueMeta) -> bool:
    """Whether target ``leaf`` can take stored leaf ``meta`` as it is (a value a value; an array an array of its
    shape and dtype)."""
    if isinstance(meta, ValueMeta):
        return isinstance(KINDS.of(leaf), ValueKind)
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or tuple(shape) != meta.shape:
        return False
    if isinstance(dtype, torch.dtype):
        return meta.dtype.name in TORCH_NAMES and dtype == meta.dtype.torch
    return True


def _subnode(node: Node, path: tuple[KeyEntry, ...]) -> Node | None:
    """The node at ``path`` below ``node``, or None."""
    for e in path:
        for entry, child in zip(node.entries, node.children, strict=True):
            if entry == e:
                node = child
                break
        else:
            return None
    return node
