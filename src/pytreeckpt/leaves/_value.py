"""Plain Python leaves (bool, int, float, str, None, and enum members of those), stored inline in the document."""

from __future__ import annotations

from typing import Any

import numpy as np

from pytreeckpt.core._errors import CheckpointError, where
from pytreeckpt.core._values import PYTHON_LEAF_TYPES, encode_value, resolve_value
from pytreeckpt.format import ArrayMeta, ValueMeta

from ._kind import Describing, LeafKind, Matching

__all__ = ["ValueKind", "value_entry"]


def value_entry(key: str, leaf: Any) -> dict[str, Any]:
    """A plain Python leaf's entry in the metadata document."""
    try:
        encoded = encode_value(leaf)
    except TypeError as e:
        raise CheckpointError(f"leaf {where(key)}: {e}") from None
    return ValueMeta(key, leaf).to_json(encoded)


class ValueKind(LeafKind):
    """A plain Python value (numpy scalars, though float subclasses, are arrays: asked after them)."""

    name = "value"

    def claims(self, t: type) -> bool:
        return issubclass(t, PYTHON_LEAF_TYPES) and not issubclass(t, np.generic)

    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        d.entries.append(value_entry(key, leaf))
        d.values.append(key)

    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        if isinstance(stored, ValueMeta):
            try:
                m.results[i] = resolve_value(stored.value, leaf)
            except TypeError as e:
                m.problems.append(f"leaf {where(key)}: {e}")
            return
        m.problems.append(
            f"leaf {where(key)}: the checkpoint has an array of shape {stored.shape} and dtype "
            f"{stored.dtype.name}, the target has a {type(leaf).__name__}"
        )
