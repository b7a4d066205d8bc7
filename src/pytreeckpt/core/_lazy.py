"""A package's names imported on first use (PEP 562), so that importing one module of it stays cheap.

The command line's ``ls``, ``inspect`` and ``verify`` import no torch (and ``ls`` neither numpy nor
TensorStore) although the packages they reach re-export modules that do.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package``, where ``exports`` maps each name it
    re-exports to the module defining it (``".._model"`` style, relative to ``package``, or absolute).
    A name is imported on first use and kept in the package, as an eager import would have."""
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(module), *exports})

    return __getattr__, __dir__
