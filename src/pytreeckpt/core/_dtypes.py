"""Element types: torch and numpy dtypes, their stored zarr v3 names, zero-copy views.

Every dtype is stored bit for bit. Most have a zarr v3 data type of their own; the few
that have none (torch's complex32 and packed sub-byte types) are stored as unsigned
integers of the same width, with the true dtype recorded in the metadata.

Names, widths and stored types are known without importing torch or ml_dtypes (ml_dtypes
0.7 takes about 2 s to import): ml_dtypes is imported when the numpy dtype of one of its
types is first asked for (:attr:`DType.numpy`), or a numpy-only type of its is named.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # (imported on first use: reading a checkpoint's metadata needs no torch)
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
        return _torch_tables()[0][self.name]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype of the stored array's elements."""
        return _numpy_of_storage(self.storage)

    @property
    def raw(self) -> np.dtype:
        """Elements of this width whose values are not interpreted (``V<itemsize>``): what a check of stored
        bytes and their checksums reads them as, with no ml_dtypes for bfloat16 or float8."""
        return np.dtype((np.void, self.itemsize))


def _ml_dtypes() -> ModuleType:
    """ml_dtypes, imported on first use (bfloat16, float8 and the numpy-only types are its)."""
    return importlib.import_module("ml_dtypes")


@functools.lru_cache(maxsize=64)
def _numpy_of_storage(storage: str) -> np.dtype:
    scalar_type: Any = storage if storage in _NUMPY_NATIVE else getattr(_ml_dtypes(), storage, storage)
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

# Names torch 2.6 (the oldest supported) may lack; whether it has them is asked of torch itself.
_NEWER_IN_TORCH = frozenset({"float8_e8m0fnu", "float4_e2m1fn_x2"})


def _torch_has(name: str) -> bool:
    if name not in _NEWER_IN_TORCH:
        return True
    import torch

    return hasattr(torch, name)


# Bytes per element of each stored type (as wide as its torch dtype): a document is parsed without importing torch.
_WIDTH: dict[str, int] = {
    **dict.fromkeys(("bool", "uint8", "int8"), 1),
    **dict.fromkeys(("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"), 1),
    **dict.fromkeys(("int16", "uint16", "float16", "bfloat16"), 2),
    **dict.fromkeys(("int32", "uint32", "float32"), 4),
    **dict.fromkeys(("int64", "uint64", "float64", "complex64"), 8),
    "complex128": 16,
}
_BY_NAME: dict[str, DType] = {n: DType(n, s, _WIDTH[s]) for n, s in _STORAGE.items()}
# numpy-only dtypes torch does not have: ml_dtypes' (one byte an element), stored under their own
# name (TensorStore's zarr v3 has no uint4, so ml_dtypes' uint4 is refused like any other dtype
# without a stored form). Known where the installed ml_dtypes has them (asked on first use).
_NUMPY_ONLY = frozenset({"float8_e4m3b11fnuz", "int4", "float4_e2m1fn"})
for _n in _NUMPY_ONLY:
    _BY_NAME.setdefault(_n, DType(_n, _n, 1))


@functools.cache
def _ml_dtypes_has(name: str) -> bool:
    return hasattr(_ml_dtypes(), name)


def _known(name: str) -> DType:
    """The :class:`DType` named ``name``; KeyError if unknown (or a dtype this torch or ml_dtypes has not)."""
    d = _BY_NAME[name]
    if not (_ml_dtypes_has(name) if name in _NUMPY_ONLY else _torch_has(name)):
        raise KeyError(name)
    return d


@functools.cache
def _torch_tables() -> tuple[dict[str, torch.dtype], dict[torch.dtype, DType], frozenset[str]]:
    """The torch dtype of each name, the :class:`DType` of each torch dtype, the names torch has (on first use)."""
    import torch

    by_name = {n: getattr(torch, n) for n in _STORAGE if hasattr(torch, n)}
    return by_name, {t: _BY_NAME[n] for n, t in by_name.items()}, frozenset(by_name)


def __getattr__(name: str) -> Any:
    if name == "TORCH_NAMES":
        # The names of the dtypes torch has (the others are numpy's, e.g. ml_dtypes' float4).
        return _torch_tables()[2]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_of_torch(dtype: torch.dtype) -> DType:
    """The :class:`DType` of a torch dtype; ValueError for ones that cannot be stored."""
    try:
        return _torch_tables()[1][dtype]
    except KeyError:
        raise ValueError(
            f"torch dtype {dtype} cannot be stored (quantized and sub-byte types are not supported)"
        ) from None


def dtype_of_numpy(dtype: np.dtype) -> DType:
    """The :class:`DType` of a numpy dtype (ml_dtypes' bfloat16 and float8 included)."""
    name = np.dtype(dtype).name
    if name in _BY_NAME and _BY_NAME[name].storage == name:
        try:
            return _known(name)
        except KeyError:
            pass
    raise ValueError(f"numpy dtype {dtype} cannot be stored (object, string and structured dtypes are not supported)")


def dtype_from_name(name: str) -> DType:
    """The :class:`DType` recorded under ``name`` in metadata; KeyError if unknown."""
    return _known(name)


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with CPU tensor ``t``, with the stored element type.

    >>> import torch
    >>> numpy_view(torch.ones(2, dtype=torch.bfloat16)).dtype
    dtype(bfloat16)
    """
    d = dtype_of_torch(t.dtype)
    if t.requires_grad:
        t = t.detach()
    if d.name in _NUMPY_NATIVE:
        return t.numpy()
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[d.itemsize]
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
