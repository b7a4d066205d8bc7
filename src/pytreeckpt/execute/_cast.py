"""A load's casts (``load(..., cast=True)``): which dtypes convert into which, and the conversion of one read.

A cast read lands in a buffer of the stored dtype the size of its region (at most one
chunk: every planned read lies within one), which is then converted into the destination
region with torch's own conversion (``copy_``, what ``Tensor.to`` does: round to nearest
even, NaN and infinities kept, subnormals as torch makes them). So no copy of a whole
array in its stored dtype is ever made: the buffers in flight are bounded by the
executor's window, as the reads are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pytreeckpt.core._dtypes import DType

if TYPE_CHECKING:  # (imported by a cast: the executor's reads need no torch, nor does ``pytreeckpt verify``)
    import torch

__all__ = ["CASTABLE", "cast_problem", "convert", "torch_view"]

CASTABLE = frozenset(
    {
        "bool",
        "uint8",
        "int8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "complex64",
        "complex128",
    }
)
"""The dtypes a load casts between: torch's arithmetic ones. Not the raw and packed ones
(``bits8``, ``bits16``, ``float4_e2m1fn_x2``), ``complex32`` (torch's support is
experimental), nor the numpy-only ones (``int4``, ``float4_e2m1fn``, ...)."""

_COMPLEX = frozenset({"complex64", "complex128"})
_INT_OF_WIDTH = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def cast_problem(stored: DType, target: DType) -> str | None:
    """Why a stored array of dtype ``stored`` cannot load into a target of dtype ``target`` (None: it can)."""
    for d in (stored, target):
        if d.name not in CASTABLE:
            return f"{d.name} has no cast (casts are between bool, integer, floating and complex dtypes)"
    if stored.name in _COMPLEX and target.name not in _COMPLEX:
        return "a complex array cast to a real dtype would lose its imaginary part"
    return None


def torch_view(a: np.ndarray, d: DType) -> torch.Tensor:
    """A CPU tensor of dtype ``d`` sharing memory with numpy array ``a`` (whose elements are ``d``'s)."""
    import torch

    if a.dtype.kind in "biufc" and a.dtype.isbuiltin:  # numpy's own dtypes: torch takes them as they are
        return torch.from_numpy(a)
    raw = a.view(_INT_OF_WIDTH[d.itemsize])  # (ml_dtypes' bfloat16 and float8: torch sees their bits)
    return torch.from_numpy(raw).view(d.torch)


def convert(src: np.ndarray, src_dtype: DType, dst: np.ndarray, dst_dtype: DType) -> None:
    """Convert ``src`` (elements of ``src_dtype``) into ``dst`` (of ``dst_dtype``, the same shape) as
    ``Tensor.to`` does."""
    import torch

    with torch.no_grad():
        torch_view(dst, dst_dtype).copy_(torch_view(src, src_dtype))
