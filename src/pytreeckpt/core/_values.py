"""Plain Python leaves stored inline in the document: ints, floats (exact), bools, strings, None, enum members."""

from __future__ import annotations

import contextlib
import enum
import math
import types
from dataclasses import dataclass
from typing import Any

from ._errors import MetadataError
from ._names import MISSING, resolve_class, static_attr, type_name

__all__ = ["PYTHON_LEAF_TYPES", "StoredEnum", "decode_value", "encode_value", "resolve_value"]


@dataclass(frozen=True, slots=True)
class StoredEnum:
    """An enum member read from a checkpoint whose type is not imported here.

    ``type_name`` is ``module:qualname``; ``value`` the member's value. :func:`load`
    turns it into the member (the target's type, or the type once its module is
    imported); :func:`metadata` shows it as it is.
    """

    type_name: str
    value: Any

    def __repr__(self) -> str:
        return f"<{self.type_name} member of value {self.value!r}, type not imported>"


PYTHON_LEAF_TYPES = (bool, int, float, str, type(None), enum.Enum, StoredEnum)
"""The types of leaves stored inline in the metadata (of int, float and str, only enum subclasses)."""


def _plain_type_error(v: Any) -> TypeError:
    t = type(v)
    base = next((b.__name__ for b in (bool, int, float, str) if isinstance(v, b)), None)
    if base is not None:
        return TypeError(
            f"a value of type {t.__module__}.{t.__qualname__}, a subclass of {base}, would come back as a plain "
            f"{base}; convert it with {base}(...) before saving (enum members are stored with their type)"
        )
    return TypeError(f"cannot store {t.__module__}.{t.__qualname__} inline")


def encode_value(v: Any) -> Any:
    """JSON for a plain Python leaf value, exact for floats (NaN and infinities too).

    Enum members are stored with their type's name; subclasses of int, float and str
    that are not enums are refused (they would come back as plain values).

    Raises:
      TypeError: a value that would not come back equal.
    """
    if isinstance(v, enum.Enum):
        try:
            return {"enum": type_name(type(v)), "value": encode_value(v.value)}
        except TypeError:
            raise TypeError(
                f"enum member {v!r} has a value of type {type(v.value).__qualname__}, which cannot be stored inline"
            ) from None
    if isinstance(v, StoredEnum):
        return {"enum": v.type_name, "value": encode_value(v.value)}
    t = type(v)
    if t is float:
        if math.isfinite(v):
            return v
        return {"float": repr(v)}
    if v is None or t is bool or t is int or t is str:
        return v
    if t is list or t is tuple:
        return {"seq": [encode_value(x) for x in v], "tuple": t is tuple}
    raise _plain_type_error(v)


def decode_value(data: Any) -> Any:
    """The value :func:`encode_value` encoded; an enum member only if its type is imported, else a StoredEnum."""
    if data is None or isinstance(data, bool | int | float | str):
        return data
    if isinstance(data, dict) and set(data) == {"float"} and data["float"] in ("nan", "inf", "-inf"):
        return float(data["float"])
    if isinstance(data, dict) and set(data) == {"seq", "tuple"} and isinstance(data["seq"], list):
        seq = [decode_value(x) for x in data["seq"]]
        return tuple(seq) if data["tuple"] else seq
    if isinstance(data, dict) and set(data) == {"enum", "value"} and isinstance(data["enum"], str):
        stored = StoredEnum(data["enum"], decode_value(data["value"]))
        with contextlib.suppress(TypeError):
            return resolve_value(stored, None)
        return stored
    raise MetadataError(f"malformed inline value {str(data)[:200]}")


def resolve_value(value: Any, like: Any) -> Any:
    """A stored value as the load target asks for it: an enum member of the target leaf's type.

    ``like`` is the target's leaf (None without a target). An enum comes back as a
    member of ``like``'s enum type if it is one, else of its stored type if that type's
    module is imported (no module is ever imported here).

    Raises:
      TypeError: the enum's type is not imported and the target gives none, or the
        value is no member of the type.
    """
    if not isinstance(value, enum.Enum | StoredEnum):
        return value
    raw = value.value
    if isinstance(like, enum.Enum):
        typ: Any = type(like)
        name = type_name(typ)
    else:
        name = type_name(type(value)) if isinstance(value, enum.Enum) else value.type_name
        typ = type(value) if isinstance(value, enum.Enum) else resolve_class(name)
        if typ is None or not issubclass(typ, enum.Enum):
            raise TypeError(
                f"the checkpoint holds a member of enum {name}, which is not an enum imported here (its module is "
                f"not imported, or holds no such enum); import it before loading, or pass a target whose leaf is a "
                f"member of that enum (pytreeckpt never imports modules named in a checkpoint)"
            )
    if isinstance(value, typ):
        return value
    return _member(typ, raw, name)


_ENUM_HOOKS = (enum.Enum.__dict__["_missing_"], enum.Flag.__dict__["_missing_"])


def _member(typ: type[enum.Enum], raw: Any, name: str) -> enum.Enum:
    """The member of ``typ`` of value ``raw``, found among its members; a value that is none of them is made by the
    enum module's own code (a Flag's combination of members), never by a hook of the type's own."""
    members = static_attr(typ, "_value2member_map_")
    with contextlib.suppress(TypeError):  # (an unhashable value: looked for by the enum module below)
        found = members.get(raw, MISSING) if type(members) is dict else MISSING
        if found is not MISSING and type(found) is typ:
            return found  # type: ignore[no-any-return]
    plain = (
        type(typ) is enum.EnumType
        and static_attr(typ, "_missing_") in _ENUM_HOOKS
        and type(static_attr(typ, "_new_member_")) is types.BuiltinFunctionType
    )
    if plain:
        with contextlib.suppress(ValueError, TypeError, KeyError):
            return typ(raw)
    raise TypeError(
        f"the checkpoint holds the value {raw!r}, which is not a member of enum {name}"
        + ("" if plain else " (its own _missing_ or __new__ is not run for a value stored in a checkpoint)")
    )
