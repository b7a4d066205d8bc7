"""Pytrees: flatten with stable key paths, and a prefix tree broadcast over a tree's leaves.

A tree is walked one node at a time. Builtin containers (dict, OrderedDict,
defaultdict, list, tuple, deque, namedtuple) and dataclasses are handled here, keeping
dict insertion order; any other node is flattened one level by optree (structseqs and
types registered with ``optree.register_pytree_node`` in the given namespace).

Leaves are tensors, numpy arrays, pytreeckpt's sharded and abstract leaves, the plain
Python values int, float, bool, str and None, and enum members whose value is one of
those (stored with their type's name, like namedtuple types).

Every leaf's dotted key path must name it alone (``{"a.b": x, "a": {"b": y}}`` is
refused), and a tree nests at most :data:`MAX_DEPTH` levels. The structure
flattening makes is a :class:`~pytreeckpt.core._node.Node` (``_node``: rebuilding and
JSON); key paths are in ``_keys``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import optree

from ._errors import CheckpointError
from ._keys import KeyEntry, entry_str, key_entry, keystr
from ._names import type_name
from ._node import SAFE_FACTORIES, Node, leaf_node
from ._per_rank import PerRank
from ._values import encode_value

__all__ = ["MAX_DEPTH", "broadcast_prefix", "flatten"]

MAX_DEPTH = 100
_DICTS = ("dict", "odict", "defaultdict")
_DICT_KINDS: dict[type, str] = {dict: "dict", collections.OrderedDict: "odict", collections.defaultdict: "defaultdict"}
"""The deepest a tree may nest: containers below the root, down to the leaves."""


def flatten(
    tree: Any, is_leaf: Callable[[Any], bool], *, namespace: str = "", keys: list[str] | None = None
) -> tuple[list[Any], list[tuple[KeyEntry, ...]], Node]:
    """Flatten ``tree`` into leaves, their typed key paths, and its structure.

    ``keys``, if given, gets each leaf's dotted key path (:func:`keystr` of its typed
    path), made as the tree is walked: a container's path is joined once, not once per leaf.

    Raises:
      CheckpointError: a leaf of a type pytreeckpt cannot store, naming its key path, or
        a tree nested deeper than :data:`MAX_DEPTH`.
    """
    leaves: list[Any] = []
    paths: list[tuple[KeyEntry, ...]] = []

    def walk(x: Any, path: tuple[KeyEntry, ...], prefix: str) -> Node:
        # prefix: the container's dotted key path and a dot ("" at the root), which its children's extend
        # (made only when the keys are asked for)
        if is_leaf(x):
            leaves.append(x)
            paths.append(path)
            if keys is not None:
                keys.append(prefix[:-1])
            return leaf_node(len(leaves) - 1)
        if len(path) >= MAX_DEPTH:
            raise CheckpointError(
                f"the tree nests deeper than {MAX_DEPTH} levels (below key path {keystr(path[:8])!r}...); "
                f"pytreeckpt stores trees of at most {MAX_DEPTH} levels (a container that holds itself nests "
                f"without end)"
            )
        node = _one_level(x, path, namespace)
        node.children = children = []
        key = ""
        for e, c in zip(node.entries, node.extra.pop("_kids"), strict=True):
            if keys is not None:
                key = prefix + (e[1] if e[0] == "s" else entry_str(e))
            if is_leaf(c):  # (most children are leaves: taken here, without a call of walk)
                leaves.append(c)
                paths.append((*path, e))
                if keys is not None:
                    keys.append(key)
                children.append(leaf_node(len(leaves) - 1))
            else:
                children.append(walk(c, (*path, e), key + "."))
        return node

    root = walk(tree, (), "")
    return leaves, paths, root


def _one_level(x: Any, path: tuple[KeyEntry, ...], namespace: str) -> Node:
    t = type(x)
    try:
        if t is dict or t is collections.OrderedDict or t is collections.defaultdict or t is PerRank:
            entries = [("s", k) if type(k) is str else key_entry(k) for k in x]  # (str keys, mostly: no call)
            kind = _DICT_KINDS.get(t, "dict")  # (a PerRank is saved as a dict)
            node = Node(kind, entries)
            if t is collections.defaultdict:
                f = x.default_factory
                fname = next((n for n, v in SAFE_FACTORIES.items() if v is f), None)
                node.extra.update(factory=f, factory_name=fname)
            node.extra["_kids"] = list(x.values())
            return node
    except TypeError as e:
        raise CheckpointError(f"at key path {keystr(path)!r}: {e}") from None
    if t is list or t is tuple:
        node = Node("list" if t is list else "tuple", [("i", i) for i in range(len(x))])
        node.extra["_kids"] = list(x)
        return node
    if t is collections.deque:
        node = Node("deque", [("i", i) for i in range(len(x))], extra={"maxlen": x.maxlen})
        node.extra["_kids"] = list(x)
        return node
    if isinstance(x, tuple) and hasattr(t, "_fields") and not optree.is_structseq(x):
        node = Node("namedtuple", [("s", f) for f in t._fields], type=t, type_name=type_name(t))
        node.extra["_kids"] = list(x)
        return node
    if dataclasses.is_dataclass(x) and not isinstance(x, type) and not _registered(t, namespace):
        fields = dataclasses.fields(x)
        node = Node("dataclass", [("s", f.name) for f in fields], type=t, type_name=type_name(t))
        node.extra["_kids"] = [getattr(x, f.name) for f in fields]
        return node
    try:
        out = optree.tree_flatten_one_level(x, none_is_leaf=True, namespace=namespace)
    except ValueError:
        raise CheckpointError(
            f"leaf at key path {keystr(path)!r} has type {t.__module__}.{t.__qualname__}, which pytreeckpt cannot "
            f"store; leaves are tensors, numpy arrays, ShardedLeaf, Abstract, int, float, bool, str, None or enum "
            f"members, and "
            f"containers "
            f"must be builtin, dataclasses or registered with optree"
        ) from None
    entries = []
    for entry in out.entries:
        try:
            entries.append(key_entry(entry))
        except TypeError:
            entries.append(("s", str(entry)))
    node = Node("custom", entries, type=t, type_name=type_name(t), extra={"unflatten": out.unflatten_func})
    node.extra["metadata"] = out.metadata
    # Metadata that is not plain data is not stored; without a target such a node comes back as a dict.
    with contextlib.suppress(TypeError):
        node.extra["metadata_json"] = encode_value(out.metadata) if not isinstance(out.metadata, type) else None
    node.extra["_kids"] = list(out.children)
    return node


def _registered(t: type, namespace: str) -> bool:
    return bool(namespace) and optree.register_pytree_node.get(t, namespace=namespace) is not None


# --------------------------------------------------------------------------- prefix


def broadcast_prefix(
    prefix: Any,
    tree: Node,
    is_prefix_leaf: Callable[[Any], bool],
    num_leaves: int,
    *,
    namespace: str = "",
    covers: Callable[[Any, Node, tuple[KeyEntry, ...]], None] | None = None,
) -> list[Any]:
    """For each leaf of ``tree``, the value of the ``prefix`` tree that covers it.

    ``prefix`` must have the structure of ``tree`` down to its own leaves (None or
    values for which ``is_prefix_leaf`` is true), each of which covers a whole subtree.
    A dict of ``prefix`` may leave out keys of the tree's dict (None covers them).
    ``covers(value, node, path)``, if given, is told of each prefix leaf that is not None
    and the subtree of ``tree`` it covers.

    Raises:
      CheckpointError: naming the key path where the prefix and the tree part ways.
    """
    out: list[Any] = [None] * num_leaves

    def fill(node: Node, value: Any) -> None:
        if node.kind == "leaf":
            out[node.leaf] = value
        for c in node.children:
            fill(c, value)

    def walk(p: Any, node: Node, path: tuple[KeyEntry, ...]) -> None:
        if p is None or is_prefix_leaf(p):
            fill(node, p)
            if covers is not None and p is not None:
                covers(p, node, path)
            return
        where = keystr(path) or "(root)"
        if node.kind == "leaf":
            raise CheckpointError(
                f"spec is not a prefix of the tree: at key path {where!r} the tree has a leaf but the spec has "
                f"a {type(p).__name__}"
            )
        pnode = _one_level(p, path, namespace)
        kids = pnode.extra.pop("_kids")
        if pnode.kind == "dict" and node.kind in _DICTS and pnode.entries != node.entries:
            # a dict of the spec may leave keys of the tree's dict out: None (the default) covers them
            given = dict(zip(pnode.entries, kids, strict=True))
            if given.keys() <= set(node.entries):
                kids = [given.get(e) for e in node.entries]
                pnode.entries = node.entries
        if pnode.entries != node.entries:
            raise CheckpointError(
                f"spec is not a prefix of the tree: at key path {where!r} the tree has keys "
                f"{[entry_str(e) for e in node.entries]} but the spec has {[entry_str(e) for e in pnode.entries]}"
            )
        for e, child_p, child in zip(node.entries, kids, node.children, strict=True):
            walk(child_p, child, (*path, e))

    walk(prefix, tree, ())
    return out
