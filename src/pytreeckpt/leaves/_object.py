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
the helpers key it), so a checkpoint saved by one route loads by the other; an optimizer
with no model in its tree is stored as its ``state_dict()`` is, keyed by parameter number
(only without torch.distributed).
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
        if model is not None and uses_helpers(model.parameters()):
            return optimizer_state(model, obj)
        sd = obj.state_dict()
        return sd if model is None else _by_name(sd, _names(obj, model))

    def restore(self, obj: Any, loaded: Any, key: str, objects: Objects) -> None:
        model = objects.model_of(key, obj)
        if model is not None and uses_helpers(model.parameters()):
            set_optimizer_state(model, obj, loaded)
            return
        if model is not None:
            loaded = _by_number(loaded, _names(obj, model))
        obj.load_state_dict(loaded)


def _params(optimizer: Any) -> list[Any]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _names(optimizer: Any, model: nn.Module) -> list[str]:
    """The name in ``model`` of each of ``optimizer``'s parameters, by number (as its state dict numbers them)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for p in _params(optimizer)]


def _by_name(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer's state dict keyed by parameter name, as torch's distributed helpers key it."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {**sd, "state": {names[i]: v for i, v in sd["state"].items()}, "param_groups": groups}


def _by_number(sd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """:func:`_by_name` undone: keyed by parameter number, as ``Optimizer.load_state_dict`` takes it."""
    number = {n: i for i, n in enumerate(names)}
    try:
        groups = [{**g, "params": [number[n] for n in g["params"]]} for g in sd["param_groups"]]
        state = {number[n]: v for n, v in sd["state"].items()}
    except KeyError as e:
        raise CheckpointError(f"the checkpoint has optimizer state of parameter {e}, which the model lacks") from None
    return {**sd, "state": state, "param_groups": groups}


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

    def model_of(self, key: str, optimizer: Any) -> nn.Module | None:
        """The model of the tree whose parameters cover ``optimizer``'s (the first in the tree's order); None
        if none does and neither needs torch's distributed helpers."""
        wanted = {id(p) for p in _params(optimizer)}
        for f in self.found:
            if isinstance(f.kind, ModuleKind):
                have = self._params.get(id(f.obj))
                if have is None:
                    have = self._params[id(f.obj)] = {id(p) for p in f.obj.parameters()}
                if wanted <= have:
                    return cast(nn.Module, f.obj)
        if uses_helpers(_params(optimizer)):
            raise CheckpointError(
                f"leaf {where(key)}: the optimizer's state goes through torch's distributed state-dict helpers, "
                f"which need its model: put the model whose parameters it optimizes in the same tree"
            )
        return None

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
                raise CheckpointError(
                    f"leaf {where(f.key)}: the checkpoint's state was read but {type(f.obj).__name__}.load_state_dict "
                    f"refused it: {type(e).__name__}: {e}"
                ) from e
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
    ``metas``: its leaves).

    The checkpoint's state is what an object gets: the object's own leaves say only where it goes (its
    tensors' memory, its DTensors' layout). A stored leaf the object's state lacks is loaded as stored
    (:data:`AS_STORED`); so is one the object holds as another kind of leaf (a value for an array, an array of
    another shape or dtype), except in a model (a ``strict`` kind), where that is a mismatch, as is a leaf
    of the model's state the checkpoint lacks (a load's problems are listed before any read). An object whose
    key path holds no subtree in the checkpoint is a problem. At a per-rank part of the checkpoint
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
        sub = _subnode(stored, paths[f.index])
        if sub is not None and sub.kind == "per_rank":
            if len(sub.children) != world:  # (its own state: the per_rank policy keeps it or refuses)
                try:
                    s_leaves, _, own = flatten(state, KINDS.is_leaf, namespace=namespace)
                except CheckpointError as e:
                    raise CheckpointError(f"leaf {where(f.key)}: its state dict: {e}") from None
                f.node, f.indices = own, list(range(len(s_leaves)))
                expanded[f.index] = state
                continue
            sub = sub.children[rank]
        if sub is None or sub.kind == "leaf":
            there = "nothing" if sub is None else "a single leaf"
            objects.problems.append(
                f"leaf {where(f.key)}: the target holds a {type(f.obj).__name__} object, the checkpoint has {there} "
                f"there"
            )
            f.node, expanded[f.index] = Node("dict"), {}
            continue
        try:
            s_leaves, s_paths, _ = flatten(state, KINDS.is_leaf, namespace=namespace)
        except CheckpointError as e:
            raise CheckpointError(f"leaf {where(f.key)}: its state dict: {e}") from None
        mine = dict(zip(s_paths, s_leaves, strict=True))
        f.node, f.indices = sub, sub.leaf_indices()
        strict = f.kind.strict
        values = {}
        for i, p in zip(f.indices, sub.paths(), strict=True):
            leaf = mine.pop(p, AS_STORED)
            values[i] = leaf if strict or leaf is AS_STORED or _fits(leaf, metas[i]) else AS_STORED
        if strict:
            for p in mine:
                below = keystr(p)
                objects.problems.append(
                    f"leaf {where(f.key + '.' + below if f.key and below else f.key or below)} of the target is not "
                    f"in the checkpoint"
                )
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
