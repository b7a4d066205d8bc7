"""Import torch.distributed.checkpoint (DCP) directories, without unpickling arbitrary objects.

DCP pickles its metadata and writes each tensor chunk as a ``torch.save`` archive. Both
are read here by unpicklers that resolve an allowlist of names only — DCP's own
metadata classes, torch dtypes and sizes, and the two functions torch uses to rebuild a
tensor, replaced by our own — so a crafted DCP directory cannot run code: anything
outside the list is refused with a CheckpointError.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from pytreeckpt.api import save
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._leaf import ShardedLeaf
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import ExplicitRegions

__all__ = ["import_dcp"]

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def _torch_dtype(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and _torch_dtype(name) is not None:
            return _torch_dtype(name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which is not plain checkpoint metadata")


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


# The storage classes torch.save names for the dtypes it pickles with _rebuild_tensor_v2
# (torch.storage._dtype_to_storage_type_map, fixed since torch 2.1), resolved by name:
# asking the classes themselves for their dtype goes through TypedStorage, deprecated.
# Newer dtypes (float8, uint16/32/64, complex32, ...) are stored as an UntypedStorage of
# bytes, their dtype given to _rebuild_tensor_v3.
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}


def _rebuild_tensor(
    storage: torch.Tensor, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_rest: Any
) -> torch.Tensor:
    return torch.as_strided(storage, tuple(size), tuple(stride), int(offset)).contiguous()


class _BlobUnpickler(pickle.Unpickler):
    """A torch.save archive: tensors rebuilt from raw storages; otherwise plain data only."""

    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, what: str) -> None:
        super().__init__(io.BytesIO(data))
        self.archive, self.prefix, self.what = archive, prefix, what

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):
            return self._rebuild_tensor_v3
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if (module, name) == ("torch.storage", "UntypedStorage"):
            return _StorageType(torch.uint8)
        if module == "torch" and _torch_dtype(name) is not None:
            return _torch_dtype(name)
        raise CheckpointError(f"{self.what} holds {module}.{name}, which is not plain data; refusing to load it")

    def _rebuild_tensor_v3(
        self,
        storage: torch.Tensor,
        offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        _requires_grad: bool,
        _hooks: Any,
        dtype: torch.dtype,
        *_rest: Any,
    ) -> torch.Tensor:
        """A tensor of a dtype newer than torch's typed storages, over an untyped storage of bytes."""
        if not isinstance(dtype, torch.dtype) or storage.dtype != torch.uint8 or storage.numel() % dtype.itemsize:
            raise CheckpointError(f"{self.what}: a {dtype} tensor over a storage of {storage.numel()} bytes")
        return _rebuild_tensor(storage.view(dtype), offset, size, stride)

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageType)):
            raise CheckpointError(f"{self.what}: unexpected storage reference {pid!r}")
        _, kind, key, _location, numel = pid
        raw = self.archive.read(f"{self.prefix}data/{key}")
        if len(raw) != int(numel) * kind.dtype.itemsize:
            raise CheckpointError(f"{self.what}: storage {key} holds {len(raw)} bytes, expected {numel} elements")
        return (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(kind.dtype)
            if raw
            else torch.empty(0, dtype=kind.dtype)
        )


def _read_blob(file: Path, offset: int, length: int, what: str) -> Any:
    with open(file, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise CheckpointError(f"{what}: {file.name} is shorter than its metadata says")
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        prefix = pkl[: -len("data.pkl")]
        order = archive.read(prefix + "byteorder").decode() if prefix + "byteorder" in archive.namelist() else "little"
        if order != "little":
            raise CheckpointError(f"{what}: big-endian archives are not supported")
        return _BlobUnpickler(archive.read(pkl), archive, prefix, what).load()
    except CheckpointError:
        raise
    except (
        zipfile.BadZipFile,
        StopIteration,
        KeyError,
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        RuntimeError,
    ) as e:
        raise CheckpointError(f"{what}: unreadable torch.save archive in {file.name}: {e}") from e


def import_dcp(src: str | os.PathLike[str], out: str | os.PathLike[str], **save_kwargs: Any) -> list[str]:
    """Save a torch.distributed.checkpoint directory as a pytreeckpt checkpoint at ``out``.

    Every tensor is stored whole, merged from the chunks any number of ranks wrote;
    plain values (ints, floats, strings, lists and dicts of them) come along; anything
    else in the DCP directory is refused. The checkpoint's tree is a flat dict from
    DCP's fully qualified names (``model.layers.0.weight``) to leaves. Returns the names.
    """
    src = Path(src)
    meta_file = src / ".metadata"
    if not meta_file.is_file():
        raise CheckpointError(f"{src} is not a torch.distributed.checkpoint directory (no .metadata)")
    try:
        md = _MetadataUnpickler(io.BytesIO(meta_file.read_bytes())).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{meta_file}: unreadable DCP metadata: {e}") from None
    try:
        entries = md.state_dict_metadata
        storage = md.storage_data
    except AttributeError:
        raise CheckpointError(f"{meta_file}: not DCP metadata") from None
    by_fqn: dict[str, list[tuple[Any, Any]]] = {}
    for index, info in storage.items():
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(
                f"DCP item {index.fqn!r} is stored transformed ({info.transform_descriptors}); not supported"
            )
        by_fqn.setdefault(index.fqn, []).append((index, info))
    tree: dict[str, Any] = {}
    for fqn, smd in entries.items():
        items = by_fqn.get(fqn, [])
        if type(smd).__name__ == "BytesStorageMetadata":
            if len(items) != 1:
                raise CheckpointError(f"DCP item {fqn!r}: expected one stored object, found {len(items)}")
            _, info = items[0]
            value = _read_blob(_inside(src, info.relative_path), info.offset, info.length, f"DCP item {fqn!r}")
            tree[fqn] = value
            continue
        size = tuple(int(s) for s in smd.size)
        dtype = smd.properties.dtype
        boxes, shards = [], {}
        for rank, (index, info) in enumerate(items):
            t = _read_blob(_inside(src, info.relative_path), info.offset, info.length, f"DCP tensor {fqn!r}")
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                raise CheckpointError(f"DCP tensor {fqn!r}: a chunk is not a {dtype} tensor")
            box = Region(tuple(int(o) for o in index.offset), tuple(int(s) for s in t.shape))
            if not Region.full(size).contains(box):
                raise CheckpointError(f"DCP tensor {fqn!r}: chunk {box} lies outside its shape {size}")
            boxes.append([box])
            shards[rank] = t
        if not boxes:
            tree[fqn] = torch.empty(size, dtype=dtype)
            if tree[fqn].numel():
                raise CheckpointError(f"DCP tensor {fqn!r} has no stored chunks")
            continue
        tree[fqn] = ShardedLeaf(size, dtype, ExplicitRegions(boxes), shards)
    save(out, tree, **save_kwargs)
    return list(tree)


def _inside(root: Path, relative: Any) -> Path:
    path = (root / str(relative)).resolve()
    if not path.is_relative_to(root.resolve()):
        raise CheckpointError(f"DCP metadata names {relative!r}, outside {root}")
    return path
