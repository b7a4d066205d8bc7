"""Element types: torch and numpy dtypes, their stored zarr v3 names, zero-copy views.

Every dtype is stored bit for bit. Most have a zarr v3 data type of their own; the few
that have none (torch's complex32 and packed sub-byte types) are stored as unsigned
integers of the same width, with the true dtype recorded in the metadata.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

__all__ = ["DType", "dtype_from_name", "dtype_of_numpy", "dtype_of_torch", "numpy_view"]


@dataclass(frozen=True, slots=True)
class DType:
    """An element type as pytreeckpt records it.

    Attributes:
      name: the metadata name (torch's name without the ``torch.`` prefix).
      storage: the zarr v3 ``data_type`` of the stored array.
      itemsize: bytes per element.
    """

    name: str
    storage: str
    itemsize: int

    @property
    def torch(self) -> torch.dtype:
        return _TORCH[self.name]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of the stored array's elements."""
        return _numpy_of_storage(self.storage)


@functools.lru_cache(maxsize=64)
def _numpy_of_storage(storage: str) -> np.dtype:
    scalar_type: Any = getattr(ml_dtypes, storage, storage)
    dtype: np.dtype = np.dtype(scalar_type)
    return dtype


# torch dtype name -> zarr v3 storage type (same element width, bit for bit).
_STORAGE: dict[str, str] = {
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "uint16": "uint16",
    "int32": "int32",
    "uint32": "uint32",
    "int64": "int64",
    "uint64": "uint64",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
    "complex64": "complex64",
    "complex128": "complex128",
    "complex32": "uint32",
    "float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2",
    "float8_e4m3fnuz": "float8_e4m3fnuz",
    "float8_e5m2fnuz": "float8_e5m2fnuz",
    "float8_e8m0fnu": "float8_e8m0fnu",
    "float4_e2m1fn_x2": "uint8",
    "bits8": "uint8",
    "bits16": "uint16",
}

_TORCH: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _STORAGE if hasattr(torch, n)}
_BY_TORCH: dict[torch.dtype, DType] = {t: DType(n, _STORAGE[n], t.itemsize) for n, t in _TORCH.items()}
_BY_NAME: dict[str, DType] = {d.name: d for d in _BY_TORCH.values()}
TORCH_NAMES = frozenset(_TORCH)
"""The names of the dtypes torch has (the others are numpy's, e.g. ml_dtypes' float4)."""
# numpy-only dtypes torch does not have: stored under their own name (TensorStore's zarr v3
# has no uint4, so ml_dtypes' uint4 is refused like any other dtype without a stored form).
for _n in ("float8_e4m3b11fnuz", "int4", "float4_e2m1fn"):
    if hasattr(ml_dtypes, _n):
        _BY_NAME.setdefault(_n, DType(_n, _n, np.dtype(getattr(ml_dtypes, _n)).itemsize))

_UINT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_of_torch(dtype: torch.dtype) -> DType:
    """The :class:`DType` of a torch dtype; ValueError for ones that cannot be stored."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise ValueError(
            f"torch dtype {dtype} cannot be stored (quantized and sub-byte types are not supported)"
        ) from None


def dtype_of_numpy(dtype: np.dtype) -> DType:
    """The :class:`DType` of a numpy dtype (ml_dtypes' bfloat16 and float8 included)."""
    name = np.dtype(dtype).name
    if name in _BY_NAME and _BY_NAME[name].storage == name:
        return _BY_NAME[name]
    raise ValueError(f"numpy dtype {dtype} cannot be stored (object, string and structured dtypes are not supported)")


def dtype_from_name(name: str) -> DType:
    """The :class:`DType` recorded under ``name`` in metadata; KeyError if unknown."""
    return _BY_NAME[name]


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with CPU tensor ``t``, with the stored element type.

    >>> numpy_view(torch.ones(2, dtype=torch.bfloat16)).dtype
    dtype(bfloat16)
    """
    d = dtype_of_torch(t.dtype)
    if t.requires_grad:
        t = t.detach()
    if d.name in _NUMPY_NATIVE:
        return t.numpy()
    width = _UINT_OF_WIDTH[d.itemsize]
    if t.dim() == 0:
        raw = t.reshape(1).view(width).numpy().reshape(())
    else:
        raw = t.view(width).numpy()
    return raw.view(d.numpy)


_NUMPY_NATIVE = {
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
    "float32",
    "float64",
    "complex64",
    "complex128",
}
