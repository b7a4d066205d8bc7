"""A tree's structure (:class:`Node`): rebuilding a tree from it, and it as JSON.

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
import functools
import keyword
import sys
import types
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._errors import MetadataError
from ._keys import KeyEntry, entry_from_json, entry_key, entry_to_json, keystr, shown
from ._names import is_structseq, resolve_class, reusable_dataclass, reusable_tuple, static_attr
from ._per_rank import PerRank, rank_entry
from ._values import decode_value

__all__ = ["SAFE_FACTORIES", "Node", "leaf_node"]


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
            items = [(entry_key(e), v) for e, v in zip(self.entries, kids, strict=True)]
            if k == "dict":
                return dict(items)
            if k == "odict":
                return collections.OrderedDict(items)
            return collections.defaultdict(self.extra.get("factory"), items)
        if k == "list":
            return kids
        if k == "per_rank":
            return PerRank(enumerate(kids))
        if k == "tuple":
            return tuple(kids)
        if k == "deque":
            return collections.deque(kids, maxlen=self.extra.get("maxlen"))
        try:
            if k == "namedtuple":  # (the type's own __new__ is not called: tuple's makes the instance, as copy does)
                return tuple.__new__(self.type, kids)
            if k == "dataclass":
                if self.type is dict:
                    return {entry_key(e): v for e, v in zip(self.entries, kids, strict=True)}
                obj = object.__new__(self.type)
                for e, v in zip(self.entries, kids, strict=True):
                    object.__setattr__(obj, e[1], v)
                return obj
            if k == "custom":
                unflatten = self.extra.get("unflatten")
                if unflatten is None:
                    return {entry_key(e): v for e, v in zip(self.entries, kids, strict=True)}
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

    def outline(self, kinds: Sequence[str], cut: Container[tuple[KeyEntry, ...]] = ()) -> Any:
        """What ranks saving one tree compare of it (JSON): every container's kind, type, typed keys and
        options (a deque's maxlen, a defaultdict's factory), each leaf as its kind's name (``kinds``, by leaf
        index), and the subtrees at the key paths ``cut`` (each rank's own, marked per rank) as ``"cut"``."""
        return self._outline(kinds, cut, ())

    def _outline(self, kinds: Sequence[str], cut: Container[tuple[KeyEntry, ...]], path: tuple[KeyEntry, ...]) -> Any:
        if self.kind == "leaf":
            return kinds[self.leaf]
        if path in cut:
            return "cut"
        out = self.to_json_head()
        out["c"] = [
            kinds[c.leaf] if c.kind == "leaf" else c._outline(kinds, cut, (*path, e))
            for e, c in zip(self.entries, self.children, strict=True)
        ]
        return out

    # ------------------------------------------------------------------ JSON
    def to_json_head(self) -> dict[str, Any]:
        """A container's JSON without its children."""
        out: dict[str, Any] = {"k": self.kind}
        if self.kind in ("dict", "odict", "defaultdict", "dataclass", "custom", "namedtuple"):
            out["keys"] = [entry_to_json(e) for e in self.entries]
        if self.type_name is not None:
            out["type"] = self.type_name
        for name in ("maxlen", "factory_name", "metadata_json"):
            if name in self.extra:
                out[name] = self.extra[name]
        return out

    def to_json(self) -> Any:
        if self.kind == "leaf":
            return self.leaf
        out = self.to_json_head()
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
                f"tree structure at {_where(path)}: expected a node (an object) or a leaf index, found {shown(data)}"
            )
        kind = data.get("k")
        if type(kind) is not str or kind not in _KINDS:
            raise MetadataError(
                f"tree structure at {_where(path)}: unknown tree node kind {shown(kind)}, expected one of {_KINDS}"
            )
        kids = data.get("c")
        if type(kids) is not list:
            raise MetadataError(
                f"tree structure at {_where(path)}: 'c' must be a list of children, found {shown(kids)}"
            )
        if kind in ("list", "tuple", "deque"):
            entries: list[KeyEntry] = [("i", i) for i in range(len(kids))]
        elif kind == "per_rank":
            if not kids:
                raise MetadataError(f"tree structure at {_where(path)}: a per_rank node holds no rank's subtree")
            entries = [rank_entry(r) for r in range(len(kids))]
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
                f"{shown(type_name)}"
            )
        node = cls(kind, entries, children, type_name=type_name)
        if kind == "defaultdict":
            fname = data.get("factory_name")
            node.extra["factory_name"] = fname
            node.extra["factory"] = SAFE_FACTORIES.get(fname) if isinstance(fname, str) else None
        elif kind == "deque":
            maxlen = data.get("maxlen")
            if maxlen is not None and (type(maxlen) is not int or not len(kids) <= maxlen <= sys.maxsize):
                raise MetadataError(
                    f"tree structure at {_where(path)}: a deque of {len(kids)} leaves or subtrees needs a maxlen of "
                    f"None or an integer from {len(kids)} to {sys.maxsize}, found {shown(maxlen)}"
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
                node.type = _tuple_type(name, tuple(fields))
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
                    # (optree's registry where optree is imported: else nothing can be registered in it)
                    registry = sys.modules.get("optree") if namespace else None
                    entry = None if registry is None else registry.register_pytree_node.get(typ, namespace=namespace)
                    if entry is not None:
                        node.extra["unflatten"] = entry.unflatten_func
                        node.extra["metadata"] = decode_value(data["metadata_json"])
        if (
            kind not in ("list", "tuple", "deque", "per_rank") and "unflatten" not in node.extra
        ):  # (each key once, as in a dict)
            _check_unique(entries, kind, path)
        return node

    def leaf_indices(self) -> list[int]:
        """The indices of the leaves below this node (itself, if a leaf), in walk order."""
        if self.kind == "leaf":
            return [self.leaf]
        out: list[int] = []
        for c in self.children:
            out += c.leaf_indices()
        return out

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


SAFE_FACTORIES: dict[str, Callable[[], Any]] = {
    "list": list,
    "dict": dict,
    "int": int,
    "float": float,
    "str": str,
    "set": set,
    "tuple": tuple,
}


_SEQUENCES = ("list", "tuple", "deque", "per_rank")  # (keys implied by the children's order)
_KINDS = ("dict", "odict", "defaultdict", "list", "tuple", "deque", "namedtuple", "dataclass", "custom", "per_rank")


@functools.lru_cache(maxsize=256)
def _tuple_type(name: str, fields: tuple[str, ...]) -> type:
    """A namedtuple type for a stored one that is not imported: one for each name and fields (a class takes
    some KB: a tree of many such nodes makes one, not one a node)."""
    return collections.namedtuple(name, fields, rename=True)  # type: ignore[misc]


def _where(path: Sequence[KeyEntry]) -> str:
    return f"key path {keystr(path)!r}" if path else "the root"


def _entries(keys: Any, kind: str, path: tuple[KeyEntry, ...]) -> list[KeyEntry]:
    if type(keys) is not list:
        raise MetadataError(
            f"tree structure at {_where(path)}: a {kind} node needs a list of keys, found {shown(keys)}"
        )
    try:
        return [("s", k) if type(k) is str else entry_from_json(k) for k in keys]
    except MetadataError as e:
        raise MetadataError(f"tree structure at {_where(path)}: a {kind} node's {e}") from None


def _field_names(entries: Sequence[KeyEntry], kind: str, path: tuple[KeyEntry, ...]) -> list[str]:
    names = [e[1] for e in entries if e[0] == "s"]
    if len(names) != len(entries):
        bad = next(e for e in entries if e[0] != "s")
        raise MetadataError(
            f"tree structure at {_where(path)}: a {kind} node's keys are field names (strings), found "
            f"{shown(entry_key(bad))}"
        )
    return names


def _check_unique(entries: Sequence[KeyEntry], kind: str, path: tuple[KeyEntry, ...]) -> None:
    """Refuse a node whose keys name one Python key twice (``1``, ``True`` and ``1.0`` are one dict key)."""
    keys = [e[1] if e[0] == "s" else entry_key(e) for e in entries]
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
