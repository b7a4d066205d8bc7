"""Pytrees: flatten and unflatten with stable key paths, and the structure as JSON.

A tree is walked one node at a time. Builtin containers (dict, OrderedDict,
defaultdict, list, tuple, deque, namedtuple) and dataclasses are handled here, keeping
dict insertion order; any other node is flattened one level by optree (structseqs and
types registered with ``optree.register_pytree_node`` in the given namespace).

Leaves are tensors, numpy arrays, pytreeckpt's sharded and abstract leaves, the plain
Python values int, float, bool, str and None, and enum members whose value is one of
those (stored with their type's name, like namedtuple types).

Every leaf's dotted key path must name it alone (``{"a.b": x, "a": {"b": y}}`` is
refused), and a tree nests at most :data:`MAX_DEPTH` levels.

The structure is recorded as JSON; nothing is ever pickled. Rebuilding a stored
structure without a target never imports a module and calls none of its code: a type
named in it is looked up only in the namespaces (``__dict__``) of modules already
imported and of their classes, never by ``getattr`` (which would run a module's lazy
``__getattr__``); a namedtuple or dataclass type found there is used only if it still
has the same fields, and its instances are made without calling its ``__new__`` or
``__init__``. A stored structure must describe exactly the leaves the document lists:
no key twice in one dict, no deque shorter than what it holds.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import keyword
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree

from ._errors import CheckpointError, MetadataError
from ._names import is_structseq, resolve_class, reusable_dataclass, reusable_tuple, static_attr, type_name
from ._values import decode_value, encode_value

__all__ = [
    "MAX_DEPTH",
    "KeyEntry",
    "Node",
    "broadcast_prefix",
    "check_unique_keys",
    "flatten",
    "keystr",
    "leaf_node",
    "typed_keystr",
]

MAX_DEPTH = 100
"""The deepest a tree may nest: containers below the root, down to the leaves."""

KeyEntry = tuple[Any, ...]
"""A typed path entry: ``("s", name)``, ``("i", 3)``, ``("b", True)``, ``("f", "1.5")``, ``("n",)``."""


def _entry(key: Any) -> KeyEntry:
    # Subclasses (IntEnum, str enums) are keyed, stored and rebuilt as their plain value.
    if isinstance(key, str):
        return ("s", str.__str__(key))
    if isinstance(key, bool):
        return ("b", bool(key))
    if isinstance(key, int):
        return ("i", int(key))
    if isinstance(key, float):
        return ("f", repr(float(key)))
    if key is None:
        return ("n",)
    if isinstance(key, tuple):
        return ("t", *(_entry(k) for k in key))
    raise TypeError(f"dict keys must be str, int, float, bool, None or tuples of them, found {type(key).__name__}")


def _entry_to_json(e: KeyEntry) -> Any:
    if e[0] == "s":
        return e[1]
    if e[0] == "t":
        return ["t", [_entry_to_json(x) for x in e[1:]]]
    return list(e)


def _entry_from_json(data: Any) -> KeyEntry:
    if isinstance(data, str):
        return ("s", data)
    if isinstance(data, list) and data:
        tag = data[0]
        if tag == "i" and len(data) == 2 and type(data[1]) is int:
            return ("i", data[1])
        if tag == "b" and len(data) == 2 and type(data[1]) is bool:
            return ("b", data[1])
        if tag == "f" and len(data) == 2 and isinstance(data[1], str):
            with contextlib.suppress(ValueError):
                float(data[1])
                return ("f", data[1])
        if tag == "n" and len(data) == 1:
            return ("n",)
        if tag == "t" and len(data) == 2 and isinstance(data[1], list):
            return ("t", *(_entry_from_json(x) for x in data[1]))
    raise MetadataError(
        f"malformed key {_found(data)}: expected a string or a typed key (['i', int], ['b', bool], ['f', float "
        f"text], ['n'], ['t', [keys]])"
    )


def _entry_key(e: KeyEntry) -> Any:
    """The Python dict key an entry stands for."""
    tag = e[0]
    if tag in ("s", "i", "b"):
        return e[1]
    if tag == "f":
        return float(e[1])
    if tag == "n":
        return None
    return tuple(_entry_key(x) for x in e[1:])


def _entry_str(e: KeyEntry) -> str:
    if e[0] == "t":
        return "(" + ",".join(_entry_str(x) for x in e[1:]) + ")"
    if e[0] == "n":
        return "None"
    return str(e[1])


def keystr(path: Sequence[KeyEntry]) -> str:
    """The dotted key path of a leaf, e.g. ``optim.state.3.exp_avg``; ``""`` for the root."""
    return ".".join([e[1] if e[0] == "s" else _entry_str(e) for e in path])


def typed_keystr(path: Sequence[KeyEntry]) -> str:
    """A leaf's path as Python subscripts, telling keys of every type apart.

    >>> typed_keystr([("s", "a.b"), ("i", 0), ("t", ("i", 1), ("s", "x"))])
    "['a.b'][0][(1, 'x')]"
    """
    return "".join(f"[{_entry_key(e)!r}]" for e in path) or "(root)"


def check_unique_keys(paths: Sequence[Sequence[KeyEntry]], keys: list[str] | None = None) -> list[str]:
    """The leaves' dotted key paths; refuse a tree in which two leaves have the same one.

    ``keys``: those key paths if known (:func:`flatten` makes them as it walks).

    Raises:
      CheckpointError: naming both leaves by their typed paths, and how to tell them apart.
    """
    if keys is None:
        keys = [keystr(path) for path in paths]
    if len(set(keys)) == len(keys):
        return keys
    seen: dict[str, Sequence[KeyEntry]] = {}
    for key, path in zip(keys, paths, strict=True):
        other = seen.setdefault(key, path)
        if other is not path:
            raise CheckpointError(
                f"two leaves have the key path {key!r}: {typed_keystr(other)} and {typed_keystr(path)}; a "
                f"checkpoint names every leaf by its dotted key path (load(include=...), load_slice, "
                f"metadata().arrays, export), so rename one of them (for example a key without '.', or keys "
                f"of one type in each dict)"
            )
    raise AssertionError("unreachable: a repeated key was found above")


@dataclass(slots=True)
class Node:
    """One container of a tree, or a leaf when ``kind == "leaf"``.

    ``entries`` are typed keys (dict keys, sequence indices, field names); ``leaf`` is
    the leaf's index in flatten order.
    """

    kind: str
    entries: Sequence[KeyEntry] = field(default_factory=list)
    children: Sequence[Node] = field(default_factory=list)
    type: Any = None
    type_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    leaf: int = -1

    # ------------------------------------------------------------------ rebuild
    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """Rebuild the tree with ``leaves`` in flatten order.

        Raises:
          MetadataError: a node the stored structure describes that its type cannot be made
            from (a registered unflatten function that fails on it), naming its key path.
        """
        try:
            return self._unflatten(leaves)
        except _NodeFailed as failed:
            where = _where(self._path_to(failed.node) or ())
            raise MetadataError(
                f"tree structure at {where}: a node of type {failed.node.type_name} cannot be rebuilt from what the "
                f"checkpoint stores ({type(failed.cause).__name__}: {failed.cause})"
            ) from failed.cause

    def _unflatten(self, leaves: Sequence[Any]) -> Any:
        if self.kind == "leaf":
            return leaves[self.leaf]
        kids = [c._unflatten(leaves) for c in self.children]
        k = self.kind
        if k in ("dict", "odict", "defaultdict"):
            items = [(_entry_key(e), v) for e, v in zip(self.entries, kids, strict=True)]
            if k == "dict":
                return dict(items)
            if k == "odict":
                return collections.OrderedDict(items)
            return collections.defaultdict(self.extra.get("factory"), items)
        if k == "list":
            return kids
        if k == "tuple":
            return tuple(kids)
        if k == "deque":
            return collections.deque(kids, maxlen=self.extra.get("maxlen"))
        try:
            if k == "namedtuple":  # (the type's own __new__ is not called: tuple's makes the instance, as copy does)
                return tuple.__new__(self.type, kids)
            if k == "dataclass":
                if self.type is dict:
                    return {_entry_key(e): v for e, v in zip(self.entries, kids, strict=True)}
                obj = object.__new__(self.type)
                for e, v in zip(self.entries, kids, strict=True):
                    object.__setattr__(obj, e[1], v)
                return obj
            if k == "custom":
                unflatten = self.extra.get("unflatten")
                if unflatten is None:
                    return {_entry_key(e): v for e, v in zip(self.entries, kids, strict=True)}
                return unflatten(self.extra.get("metadata"), kids)
        except Exception as e:  # (checked when parsed; a registered unflatten function is the user's code)
            raise _NodeFailed(self, e) from e
        raise AssertionError(k)

    def _path_to(self, node: Node) -> tuple[KeyEntry, ...] | None:
        if self is node:
            return ()
        for e, c in zip(self.entries, self.children, strict=True):
            below = c._path_to(node)
            if below is not None:
                return (e, *below)
        return None

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> Any:
        if self.kind == "leaf":
            return self.leaf
        out: dict[str, Any] = {"k": self.kind}
        if self.kind in ("dict", "odict", "defaultdict", "dataclass", "custom", "namedtuple"):
            out["keys"] = [_entry_to_json(e) for e in self.entries]
        if self.type_name is not None:
            out["type"] = self.type_name
        for name in ("maxlen", "factory_name", "metadata_json"):
            if name in self.extra:
                out[name] = self.extra[name]
        out["c"] = [c.to_json() for c in self.children]
        return out

    @classmethod
    def from_json(cls, data: Any, num_leaves: int, namespace: str = "", path: tuple[KeyEntry, ...] = ()) -> Node:
        """Rebuild a structure from JSON, resolving types only among imported modules, calling none of their code.

        ``path``: the node's key path in the whole structure, for the errors.

        Raises:
          MetadataError: a node that is not what a save writes, or that would not describe
            exactly its own leaves, naming its key path and what was expected versus found.
        """
        if type(data) is int:
            if not 0 <= data < num_leaves:
                raise MetadataError(
                    f"tree structure at {_where(path)}: names leaf {data}, but the document lists {num_leaves} leaves"
                )
            return leaf_node(data)
        if not isinstance(data, dict):
            raise MetadataError(
                f"tree structure at {_where(path)}: expected a node (an object) or a leaf index, found {_found(data)}"
            )
        kind = data.get("k")
        if type(kind) is not str or kind not in _KINDS:
            raise MetadataError(
                f"tree structure at {_where(path)}: unknown tree node kind {_found(kind)}, expected one of {_KINDS}"
            )
        kids = data.get("c")
        if type(kids) is not list:
            raise MetadataError(
                f"tree structure at {_where(path)}: 'c' must be a list of children, found {_found(kids)}"
            )
        if kind in ("list", "tuple", "deque"):
            entries: list[KeyEntry] = [("i", i) for i in range(len(kids))]
        else:
            entries = _entries(data.get("keys"), kind, path)
            if len(entries) != len(kids):
                raise MetadataError(
                    f"tree structure at {_where(path)}: a {kind} node of {len(entries)} keys has {len(kids)} children"
                )
        children = [  # (most children are leaves, most keys strings: taken here, without a call each)
            leaf_node(c)
            if type(c) is int and 0 <= c < num_leaves
            else cls.from_json(c, num_leaves, namespace, (*path, e))
            for e, c in zip(entries, kids, strict=True)
        ]
        type_name = data.get("type")
        if type_name is not None and type(type_name) is not str:
            raise MetadataError(
                f"tree structure at {_where(path)}: the {kind} node's type must be a 'module:qualname' string, found "
                f"{_found(type_name)}"
            )
        node = cls(kind, entries, children, type_name=type_name)
        if kind == "defaultdict":
            fname = data.get("factory_name")
            node.extra["factory_name"] = fname
            node.extra["factory"] = _SAFE_FACTORIES.get(fname) if isinstance(fname, str) else None
        elif kind == "deque":
            maxlen = data.get("maxlen")
            if maxlen is not None and (type(maxlen) is not int or not len(kids) <= maxlen <= sys.maxsize):
                raise MetadataError(
                    f"tree structure at {_where(path)}: a deque of {len(kids)} leaves or subtrees needs a maxlen of "
                    f"None or an integer from {len(kids)} to {sys.maxsize}, found {_found(maxlen)}"
                )
            node.extra["maxlen"] = maxlen
        elif kind == "namedtuple":
            fields = _field_names(entries, kind, path)
            found = resolve_class(type_name)
            if found is not None and reusable_tuple(found, fields):
                node.type = found
            else:
                name = (type_name or "Tuple").rsplit(".", 1)[-1].rsplit(":", 1)[-1]
                if not name.isidentifier() or keyword.iskeyword(name):
                    name = "Tuple"
                node.type = collections.namedtuple(name, fields, rename=True)  # type: ignore[misc]
        elif kind == "dataclass":
            typ = resolve_class(type_name)
            fields = _field_names(entries, kind, path)
            node.type = typ if typ is not None and reusable_dataclass(typ, fields) else dict
        elif kind == "custom":
            typ = resolve_class(type_name)
            node.extra["metadata_json"] = data.get("metadata_json")
            if typ is not None and "metadata_json" in data:
                if is_structseq(typ):
                    width = static_attr(typ, "n_sequence_fields")
                    if len(kids) != width:
                        raise MetadataError(
                            f"tree structure at {_where(path)}: a node of type {type_name} has {width} fields, found "
                            f"{len(kids)} children"
                        )
                    node.extra["unflatten"] = lambda _m, kids, typ=typ: typ(kids)
                else:
                    entry = optree.register_pytree_node.get(typ, namespace=namespace) if namespace else None
                    if entry is not None:
                        node.extra["unflatten"] = entry.unflatten_func
                        node.extra["metadata"] = decode_value(data["metadata_json"])
        if kind not in ("list", "tuple", "deque") and "unflatten" not in node.extra:  # (each key once, as in a dict)
            _check_unique(entries, kind, path)
        return node

    def paths(self) -> list[tuple[KeyEntry, ...]]:
        """Typed key paths of the leaves, in flatten order."""
        out: list[tuple[KeyEntry, ...]] = []
        self._paths((), out)
        return out

    def _paths(self, prefix: tuple[KeyEntry, ...], out: list[tuple[KeyEntry, ...]]) -> None:
        if self.kind == "leaf":
            out.append(prefix)
            return
        for e, c in zip(self.entries, self.children, strict=True):
            if c.kind == "leaf":  # (most children are leaves: taken here, without a call each)
                out.append((*prefix, e))
            else:
                c._paths((*prefix, e), out)


_SAFE_FACTORIES: dict[str, Callable[[], Any]] = {
    "list": list,
    "dict": dict,
    "int": int,
    "float": float,
    "str": str,
    "set": set,
    "tuple": tuple,
}


_KINDS = ("dict", "odict", "defaultdict", "list", "tuple", "deque", "namedtuple", "dataclass", "custom")


def _where(path: Sequence[KeyEntry]) -> str:
    return f"key path {keystr(path)!r}" if path else "the root"


def _found(value: Any) -> str:
    """What a document holds where something else was expected, shortly (lone surrogates escaped)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:80] + '...'}"


def _entries(keys: Any, kind: str, path: tuple[KeyEntry, ...]) -> list[KeyEntry]:
    if type(keys) is not list:
        raise MetadataError(
            f"tree structure at {_where(path)}: a {kind} node needs a list of keys, found {_found(keys)}"
        )
    try:
        return [("s", k) if type(k) is str else _entry_from_json(k) for k in keys]
    except MetadataError as e:
        raise MetadataError(f"tree structure at {_where(path)}: a {kind} node's {e}") from None


def _field_names(entries: Sequence[KeyEntry], kind: str, path: tuple[KeyEntry, ...]) -> list[str]:
    names = [e[1] for e in entries if e[0] == "s"]
    if len(names) != len(entries):
        bad = next(e for e in entries if e[0] != "s")
        raise MetadataError(
            f"tree structure at {_where(path)}: a {kind} node's keys are field names (strings), found "
            f"{_found(_entry_key(bad))}"
        )
    return names


def _check_unique(entries: Sequence[KeyEntry], kind: str, path: tuple[KeyEntry, ...]) -> None:
    """Refuse a node whose keys name one Python key twice (``1``, ``True`` and ``1.0`` are one dict key)."""
    keys = [e[1] if e[0] == "s" else _entry_key(e) for e in entries]
    if len(set(keys)) == len(keys):
        return
    seen: set[Any] = set()
    twice = next(k for k in keys if k in seen or seen.add(k))  # type: ignore[func-returns-value]
    raise MetadataError(
        f"tree structure at {_where(path)}: the {kind} node has the key {twice!r} twice (as {len(keys)} keys, "
        f"{len(set(keys))} different), so it would hold fewer leaves than the document lists"
    )


class _NodeFailed(Exception):
    """A node whose type could not be made (raised inside :meth:`Node._unflatten`, which knows no path)."""

    def __init__(self, node: Node, cause: Exception) -> None:
        super().__init__(node, cause)
        self.node = node
        self.cause = cause


# --------------------------------------------------------------------------- flatten


_NO_EXTRA: Any = types.MappingProxyType({})  # (read-only: a leaf's extra is never written)


def leaf_node(index: int) -> Node:
    """The node of leaf ``index`` (in flatten order).

    Its entries and children are the one empty tuple, its extra one read-only empty mapping:
    a tree of 100,000 leaves does not make 200,000 empty lists and 100,000 empty dicts,
    which the cyclic collector would then walk (and it is made in half the time).
    """
    # (its slots stored here, not through the dataclass's __init__: a third fewer instructions, and
    # tests/test_tree.py checks it equals Node("leaf", leaf=index))
    node = _new_node(Node)
    node.kind = "leaf"
    node.entries = ()
    node.children = ()
    node.type = None
    node.type_name = None
    node.extra = _NO_EXTRA
    node.leaf = index
    return node


_new_node = object.__new__


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
                key = prefix + (e[1] if e[0] == "s" else _entry_str(e))
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
        if t is dict or t is collections.OrderedDict or t is collections.defaultdict:
            entries = [("s", k) if type(k) is str else _entry(k) for k in x]  # (str keys, mostly: no call)
            kind = {dict: "dict", collections.OrderedDict: "odict", collections.defaultdict: "defaultdict"}[t]
            node = Node(kind, entries)
            if t is collections.defaultdict:
                f = x.default_factory
                fname = next((n for n, v in _SAFE_FACTORIES.items() if v is f), None)
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
            entries.append(_entry(entry))
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
    prefix: Any, tree: Node, is_prefix_leaf: Callable[[Any], bool], num_leaves: int, *, namespace: str = ""
) -> list[Any]:
    """For each leaf of ``tree``, the value of the ``prefix`` tree that covers it.

    ``prefix`` must have the structure of ``tree`` down to its own leaves (None or
    values for which ``is_prefix_leaf`` is true), each of which covers a whole subtree.

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
            return
        where = keystr(path) or "(root)"
        if node.kind == "leaf":
            raise CheckpointError(
                f"spec is not a prefix of the tree: at key path {where!r} the tree has a leaf but the spec has "
                f"a {type(p).__name__}"
            )
        pnode = _one_level(p, path, namespace)
        kids = pnode.extra.pop("_kids")
        if pnode.entries != node.entries:
            raise CheckpointError(
                f"spec is not a prefix of the tree: at key path {where!r} the tree has keys "
                f"{[_entry_str(e) for e in node.entries]} but the spec has {[_entry_str(e) for e in pnode.entries]}"
            )
        for e, child_p, child in zip(node.entries, kids, node.children, strict=True):
            walk(child_p, child, (*path, e))

    walk(prefix, tree, ())
    return out
