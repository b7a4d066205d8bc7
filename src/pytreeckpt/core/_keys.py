"""Key paths: a leaf's typed path entries, their JSON, and the dotted and typed key strings.

A dict key, sequence index or field name is a typed entry (:data:`KeyEntry`), so that
keys of different types (``1``, ``"1"``, ``1.0``) stay apart; a leaf's dotted key path
(:func:`keystr`, e.g. ``optim.state.3.exp_avg``) names it in a checkpoint, and must name
it alone (:func:`check_unique_keys`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from ._errors import CheckpointError, MetadataError

__all__ = [
    "KeyEntry",
    "check_unique_keys",
    "entry_from_json",
    "entry_key",
    "entry_str",
    "entry_to_json",
    "key_entry",
    "keystr",
    "shown",
    "typed_keystr",
]

KeyEntry = tuple[Any, ...]
"""A typed path entry: ``("s", name)``, ``("i", 3)``, ``("b", True)``, ``("f", "1.5")``, ``("n",)``."""


def key_entry(key: Any) -> KeyEntry:
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
        return ("t", *(key_entry(k) for k in key))
    raise TypeError(f"dict keys must be str, int, float, bool, None or tuples of them, found {type(key).__name__}")


def entry_to_json(e: KeyEntry) -> Any:
    if e[0] == "s":
        return e[1]
    if e[0] == "t":
        return ["t", [entry_to_json(x) for x in e[1:]]]
    return list(e)


def entry_from_json(data: Any) -> KeyEntry:
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
            return ("t", *(entry_from_json(x) for x in data[1]))
    raise MetadataError(
        f"malformed key {shown(data)}: expected a string or a typed key (['i', int], ['b', bool], ['f', float "
        f"text], ['n'], ['t', [keys]])"
    )


def entry_key(e: KeyEntry) -> Any:
    """The Python dict key an entry stands for."""
    tag = e[0]
    if tag in ("s", "i", "b"):
        return e[1]
    if tag == "f":
        return float(e[1])
    if tag == "n":
        return None
    return tuple(entry_key(x) for x in e[1:])


def entry_str(e: KeyEntry) -> str:
    if e[0] == "t":
        return "(" + ",".join(entry_str(x) for x in e[1:]) + ")"
    if e[0] == "n":
        return "None"
    return str(e[1])


def keystr(path: Sequence[KeyEntry]) -> str:
    """The dotted key path of a leaf, e.g. ``optim.state.3.exp_avg``; ``""`` for the root."""
    return ".".join([e[1] if e[0] == "s" else entry_str(e) for e in path])


def typed_keystr(path: Sequence[KeyEntry]) -> str:
    """A leaf's path as Python subscripts, telling keys of every type apart.

    >>> typed_keystr([("s", "a.b"), ("i", 0), ("t", ("i", 1), ("s", "x"))])
    "['a.b'][0][(1, 'x')]"
    """
    return "".join(f"[{entry_key(e)!r}]" for e in path) or "(root)"


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


def shown(value: Any) -> str:
    """What a document holds where something else was expected, shortly (lone surrogates escaped)."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:80] + '...'}"
