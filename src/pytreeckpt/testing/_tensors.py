"""Hypothesis strategies of stored dtypes and of tensors rich in special values."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import torch
from hypothesis import strategies as st

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16",
)  # fmt: skip
_STORED_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
)
"""Every torch dtype pytreeckpt stores bit for bit (those this torch has)."""


# --------------------------------------------------------------------------- dtypes and values


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """Every torch dtype pytreeckpt stores bit for bit.

    bool, signed and unsigned integers of every width, float16, bfloat16, float32,
    float64, complex32, complex64, complex128, the float8 variants, float4 pairs and the
    bits types (those the installed torch has).

    Returns:
      A strategy of ``torch.dtype``.
    """
    return st.sampled_from(_STORED_DTYPES)


@functools.cache
def _special_bits(dtype: torch.dtype) -> np.ndarray:
    """Bit patterns of special values of ``dtype``, one per row of uint8."""
    n = dtype.itemsize
    rows = [
        bytes(n),  # zero
        b"\xff" * n,  # all ones: -1, a NaN
        bytes(n - 1) + b"\x80",  # the sign bit alone: -0.0, the smallest integer
        b"\xff" * (n - 1) + b"\x7f",  # all but the sign bit: the largest integer, a NaN
        b"\x01" + bytes(n - 1),  # the smallest subnormal, 1
    ]
    if dtype.is_floating_point or dtype.is_complex:
        values = [math.inf, -math.inf, math.nan, -math.nan, -0.0, 1.0]
        try:
            info = torch.finfo(dtype)
            values += [info.max, -info.max, info.tiny, info.eps]
        except (NotImplementedError, RuntimeError, TypeError):  # packed types such as float4_e2m1fn_x2
            pass
        for v in values:
            try:
                t = torch.tensor([v], dtype=torch.float64).to(dtype)
            except (NotImplementedError, RuntimeError, TypeError):
                continue
            rows.append(bytes(t.view(torch.uint8).numpy()))
    return np.frombuffer(b"".join(dict.fromkeys(rows)), dtype=np.uint8).reshape(-1, n).copy()


def _from_bits(raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    flat = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1))  # a writable copy
    if dtype == torch.bool:
        return (flat & 1).view(torch.bool).reshape(shape).clone()
    return flat.view(dtype).reshape(shape).clone()


def tensors(
    shape: Sequence[int], dtype: torch.dtype, *, elementwise_below: int = 64
) -> st.SearchStrategy[torch.Tensor]:
    """Random tensors of ``shape`` and ``dtype``, rich in special values.

    Elements are random bit patterns (so NaNs with payloads and subnormals appear)
    mixed with the special values of the dtype: infinities, NaNs of both signs, -0.0,
    the largest and smallest values, the smallest and largest integers. Small tensors
    are drawn element by element (so failures shrink to simple values); large ones
    from a drawn seed.

    Args:
      shape: the shape.
      dtype: the dtype (any of :func:`dtypes`).
      elementwise_below: tensors with fewer elements are drawn element by element.

    Returns:
      A strategy of CPU tensors.
    """
    shape = tuple(int(s) for s in shape)
    n, width = math.prod(shape), dtype.itemsize
    specials = _special_bits(dtype)
    element = st.one_of(
        st.binary(min_size=width, max_size=width),
        st.sampled_from([bytes(row) for row in specials]),
    )

    @st.composite
    def build(draw: st.DrawFn) -> torch.Tensor:
        if n < elementwise_below:
            raw = np.frombuffer(b"".join(draw(st.lists(element, min_size=n, max_size=n))), dtype=np.uint8)
            return _from_bits(raw.reshape(n, width), shape, dtype)
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        raw = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
        fraction = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
        mask = rng.random(n) < fraction
        raw[mask] = specials[rng.integers(0, len(specials), size=int(mask.sum()))]
        return _from_bits(raw, shape, dtype)

    return build()
