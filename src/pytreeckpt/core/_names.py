"""Classes named in a stored document (``module:qualname``), found without importing or running anything.

A name is looked up only in the namespace (``__dict__``) of a module the program has
already imported and then of its classes, never with ``getattr`` (which would run a
module's lazy ``__getattr__``, a metaclass's, or a property), and only a class is taken.
Whether a class found so may be reused for a stored namedtuple, dataclass or struct
sequence is decided from its namespaces too.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

__all__ = [
    "MISSING",
    "is_structseq",
    "resolve_class",
    "reusable_dataclass",
    "reusable_tuple",
    "static_attr",
    "type_name",
]


def type_name(t: type) -> str:
    """``module:qualname``, the name a stored document gives type ``t``."""
    return f"{t.__module__}:{t.__qualname__}"


# Names found in a document are looked up through these descriptors, never getattr: the namespace a
# module or class holds itself, so no lazy __getattr__ (a module's, a metaclass's) or property runs.
_MODULE_DICT: Any = vars(types.ModuleType)["__dict__"]
_CLASS_DICT: Any = type.__dict__["__dict__"]
_MRO: Any = type.__dict__["__mro__"]
_FLAGS: Any = type.__dict__["__flags__"]
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (or a C extension's heap type)
_ABSTRACT = 1 << 20  # Py_TPFLAGS_IS_ABSTRACT
_BASETYPE = 1 << 10  # Py_TPFLAGS_BASETYPE: the class can be subclassed
MISSING: Any = object()


def _is_class(obj: Any) -> bool:
    return issubclass(type(obj), type)  # (not isinstance: that can ask the object its __class__)


def static_attr(cls: type, name: str) -> Any:
    """``cls.name`` as found in the namespaces of ``cls``'s MRO, without running any descriptor; else MISSING."""
    for base in _MRO.__get__(cls):
        space = _CLASS_DICT.__get__(base)
        if name in space:
            return space[name]
    return MISSING


def resolve_class(name: str | None) -> Any:
    """The class named ``module:qualname`` if its module is already imported, else None.

    Only namespaces are read (the module's ``__dict__``, then each class's own): nothing is
    imported, no module's ``__getattr__`` runs, and what is found is a class or nothing.
    """
    if not isinstance(name, str) or name.count(":") != 1:
        return None
    module_name, qualname = name.split(":")
    module = sys.modules.get(module_name)
    if not issubclass(type(module), types.ModuleType):
        return None
    space = _MODULE_DICT.__get__(module)
    if type(space) is not dict:
        return None
    obj: Any = None
    for part in qualname.split("."):
        obj = space.get(part)
        if not _is_class(obj):
            return None
        space = _CLASS_DICT.__get__(obj)
    return obj


def _python_classes_down_to(cls: type, base: type) -> bool:
    """Whether every class of ``cls``'s MRO before ``base`` is a Python class whose ``__new__``, if it has one, is
    Python's: then ``base.__new__(cls)`` makes an instance (a C type's own ``__new__`` could be bypassed unsafely)."""
    for c in _MRO.__get__(cls):
        if c is base:
            return True
        if not _FLAGS.__get__(c) & _HEAPTYPE:
            return False
        new = _CLASS_DICT.__get__(c).get("__new__", MISSING)
        if new is not MISSING and type(new) is not staticmethod:
            return False
    return False


def reusable_tuple(typ: type, fields: list[str]) -> bool:
    """Whether ``typ`` is a namedtuple type of these fields, whose instances ``tuple.__new__`` can make."""
    found = static_attr(typ, "_fields")
    return (
        issubclass(typ, tuple)
        and type(found) is tuple
        and all(type(f) is str for f in found)
        and list(found) == fields
        and _python_classes_down_to(typ, tuple)
    )


def reusable_dataclass(typ: type, fields: list[str]) -> bool:
    """Whether ``typ`` is a dataclass of these fields, whose instances ``object.__new__`` can make and whose fields
    ``object.__setattr__`` sets without running a descriptor."""
    found = static_attr(typ, "__dataclass_fields__")
    if type(found) is not dict or not all(type(f) is dataclasses.Field for f in found.values()):
        return False
    names = [f.name for f in found.values() if getattr(f, "_field_type", None) is getattr(dataclasses, "_FIELD", 0)]
    if names != fields or _FLAGS.__get__(typ) & _ABSTRACT or not _python_classes_down_to(typ, object):
        return False
    for name in names:  # (a field that is a property or another data descriptor would run its __set__)
        attr = static_attr(typ, name)
        if (
            attr is not MISSING
            and type(attr) is not types.MemberDescriptorType
            and static_attr(type(attr), "__set__") is not MISSING
        ):
            return False
    return True


def is_structseq(typ: type) -> bool:
    """Whether ``typ`` is a C struct sequence (``os.stat_result``, ``time.struct_time``), which builtin code makes.

    (A class statement makes classes that can be subclassed: only a C type passes.)
    """
    return (
        type(typ) is type
        and issubclass(typ, tuple)
        and not _FLAGS.__get__(typ) & _BASETYPE
        and all(type(static_attr(typ, n)) is int for n in ("n_sequence_fields", "n_fields", "n_unnamed_fields"))
    )
