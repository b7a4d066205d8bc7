"""Import torch.distributed.checkpoint (DCP) directories, without unpickling arbitrary objects.

DCP pickles its metadata and writes each tensor chunk as a ``torch.save`` archive. Both
are read here by unpicklers that resolve an allowlist of names only — DCP's own
metadata classes, torch dtypes and sizes, and the two functions torch uses to rebuild a
tensor, replaced by our own — so a crafted DCP directory cannot run code: anything
outside the list is refused with a CheckpointError.

An allowlist still lets a crafted ``.metadata`` hold DCP's own objects with any fields,
so every field used is checked after unpickling (its type and range), and what the
fields claim is checked against the files (each a regular file of the directory, opened
as the storage layer opens a checkpoint's: ``_files``) and the memory left before it is
read. Two chunks of one tensor that share an element are refused, naming both.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from pytreeckpt.api import save
from pytreeckpt.core._dtypes import dtype_of_torch
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._leaf import ShardedLeaf
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import ExplicitRegions
from pytreeckpt.format import MAX_NDIM
from pytreeckpt.interop._files import open_source, read_exactly
from pytreeckpt.interop._st_format import MAX_BYTES
from pytreeckpt.storage import available_memory, open_regular

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


def _unpickle_blob(data: bytearray, file: Path, what: str) -> Any:
    """The object of a ``torch.save`` archive (a blob of a ``.distcp`` file), through :class:`_BlobUnpickler`."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        big = next((i for i in archive.infolist() if i.file_size > len(data)), None)
        if big is not None:  # (torch.save stores its members uncompressed: no member is larger than the archive)
            raise CheckpointError(
                f"{what}: the torch.save archive in {file.name} claims a member {big.filename!r} of {big.file_size} "
                f"bytes in an archive of {len(data)}"
            )
        pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
        prefix = pkl[: -len("data.pkl")]
        order = archive.read(prefix + "byteorder").decode() if prefix + "byteorder" in archive.namelist() else "little"
        if order != "little":
            raise CheckpointError(f"{what}: big-endian archives are not supported")
        return _BlobUnpickler(archive.read(pkl), archive, prefix, what).load()
    except CheckpointError:
        raise
    except StopIteration:
        raise CheckpointError(f"{what}: the torch.save archive in {file.name} holds no data.pkl") from None
    except Exception as e:  # (whatever a crafted archive or pickle makes zipfile, pickle or torch raise)
        raise CheckpointError(f"{what}: unreadable torch.save archive in {file.name}: {type(e).__name__}: {e}") from e


MAX_METADATA_BYTES = 1 << 30
"""The default cap on the size of a DCP ``.metadata`` file :func:`import_dcp` reads."""


class _Stored(NamedTuple):
    """Where one DCP item (a tensor's chunk, or a pickled object) is: a file of the directory and a byte range."""

    file: str
    offset: int
    length: int
    at: tuple[int, ...] | None
    """The chunk's offset in its tensor (None for an object)."""


def import_dcp(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_metadata_bytes: int = MAX_METADATA_BYTES,
    **save_kwargs: Any,
) -> list[str]:
    """Save a torch.distributed.checkpoint directory as a pytreeckpt checkpoint at ``out``.

    Every tensor is stored whole, merged from the chunks any number of ranks wrote;
    plain values (ints, floats, strings, lists and dicts of them) come along; anything
    else in the DCP directory is refused. The checkpoint's tree is a flat dict from
    DCP's fully qualified names (``model.layers.0.weight``) to leaves. Returns the names.

    The directory is read as untrusted input: ``.metadata`` (at most ``max_metadata_bytes``)
    is unpickled through an allowlist and every field used is checked (type and range);
    each file it names must be a regular file of the directory (a plain name, a symbolic
    link only to a file inside it), holding the byte range named; two chunks of one tensor
    that share an element are refused. Every problem is a CheckpointError naming the file
    and the item.

    Raises:
      CheckpointError: ``src`` is not a DCP directory, or its files are malformed or unsafe.
      ValueError: ``max_metadata_bytes`` is not positive (TypeError: not an int).
    """
    if isinstance(max_metadata_bytes, bool) or not isinstance(max_metadata_bytes, int):
        raise TypeError(f"max_metadata_bytes must be an int, found {type(max_metadata_bytes).__name__}")
    if max_metadata_bytes < 1:
        raise ValueError(f"max_metadata_bytes must be positive, found {max_metadata_bytes}")
    src = Path(src)
    inside = os.path.realpath(src)  # (the directory the caller named: a link to it is followed)
    meta_file = src / ".metadata"
    entries, stored = _checked(_read_metadata(meta_file, inside, max_metadata_bytes), meta_file)
    blobs = _Blobs(src, inside)
    try:
        tree = {fqn: blobs.item(fqn, size, stored.get(fqn, [])) for fqn, size in entries.items()}
    finally:
        blobs.close()
    save(out, tree, **save_kwargs)
    return list(tree)


def _read_metadata(meta_file: Path, inside: str, limit: int) -> Any:
    """The unpickled ``.metadata`` (allowlisted names only), its size checked before it is read."""
    try:
        fd, st = open_regular(meta_file, inside, "the DCP metadata")
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(
            f"{meta_file.parent} is not a torch.distributed.checkpoint directory (no .metadata)"
        ) from None
    try:
        if st.st_size > limit:
            raise CheckpointError(
                f"{meta_file} holds {st.st_size} bytes, more than the limit of {limit} (import_dcp's "
                f"max_metadata_bytes)"
            )
        data = read_exactly(fd, st.st_size, 0, meta_file, "the DCP metadata")
    finally:
        os.close(fd)
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError as e:
        raise CheckpointError(f"{meta_file}: {e}") from None
    except Exception as e:  # (whatever a crafted pickle makes the unpickler or an allowed class raise)
        raise CheckpointError(f"{meta_file}: unreadable DCP metadata: {type(e).__name__}: {e}") from None


_MISSING = object()


def _show(value: Any) -> str:
    """A short description of a value found in metadata (a crafted one may be huge or nested deep)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    if value is None or isinstance(value, bool | int | float | str):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(value).__name__}"


def _get(obj: Any, name: str, at: str, meta_file: Path) -> Any:
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise CheckpointError(f"{meta_file}: {at}.{name} is missing")
    return value


def _ints(value: Any, field: str, meta_file: Path) -> tuple[int, ...]:
    """``value`` as a tuple of non-negative ints (a torch.Size, tuple or list of them, at most MAX_NDIM)."""
    if not isinstance(value, tuple | list) or len(value) > MAX_NDIM or any(type(v) is not int or v < 0 for v in value):
        raise CheckpointError(
            f"{meta_file}: {field} is {_show(value)}, expected a sequence of at most {MAX_NDIM} non-negative integers"
        )
    return tuple(value)


def _tensor_meta(smd: Any, at: str, meta_file: Path) -> tuple[torch.dtype, tuple[int, ...]]:
    """The dtype and size of a TensorStorageMetadata, checked."""
    props = _get(smd, "properties", at, meta_file)
    if type(props) is not TensorProperties:
        raise CheckpointError(f"{meta_file}: {at}.properties is {_show(props)}, expected a TensorProperties")
    dtype = _get(props, "dtype", f"{at}.properties", meta_file)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{meta_file}: {at}.properties.dtype is {_show(dtype)}, expected a torch dtype")
    try:
        dtype_of_torch(dtype)
    except ValueError as e:
        raise CheckpointError(f"{meta_file}: {at}: {e}") from None
    size = _ints(_get(smd, "size", at, meta_file), f"{at}.size", meta_file)
    if math.prod(s for s in size if s) * dtype.itemsize > MAX_BYTES:
        raise CheckpointError(
            f"{meta_file}: {at}.size is {list(size)}, whose extents span more than {MAX_BYTES} bytes of {dtype}"
        )
    return dtype, size


def _stored_at(index: Any, info: Any, meta_file: Path) -> tuple[str, _Stored]:
    """The name and place of one entry of ``storage_data`` (a MetadataIndex and a _StorageInfo), checked."""
    if type(index) is not MetadataIndex:
        raise CheckpointError(f"{meta_file}: a key of storage_data is {_show(index)}, expected a MetadataIndex")
    fqn = _get(index, "fqn", "a key of storage_data", meta_file)
    if type(fqn) is not str:
        raise CheckpointError(f"{meta_file}: a key of storage_data has the fqn {_show(fqn)}, expected a string")
    at = f"storage_data[{fqn!r}]"
    offset = _get(index, "offset", f"the key of {at}", meta_file)
    chunk_at = None if offset is None else _ints(offset, f"the key of {at}: offset", meta_file)
    if type(info) is not _StorageInfo:
        raise CheckpointError(f"{meta_file}: {at} is {_show(info)}, expected a _StorageInfo")
    name = _get(info, "relative_path", at, meta_file)
    if type(name) is not str or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise CheckpointError(
            f"{meta_file}: {at}.relative_path is {_show(name)}, expected the plain name of a file beside .metadata"
        )
    start, length = _get(info, "offset", at, meta_file), _get(info, "length", at, meta_file)
    for field, v in (("offset", start), ("length", length)):
        if type(v) is not int or v < 0:
            raise CheckpointError(f"{meta_file}: {at}.{field} is {_show(v)}, expected a non-negative integer")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{meta_file}: DCP item {fqn!r} is stored transformed; not supported")
    return fqn, _Stored(name, start, length, chunk_at)


def _checked(md: Any, meta_file: Path) -> tuple[dict[str, Any], dict[str, list[_Stored]]]:
    """The items of unpickled DCP metadata (for a tensor its dtype and size, for a pickled object None) and where
    each is stored, every field used checked: a CheckpointError naming the file and the field otherwise."""
    if type(md) is not Metadata:
        raise CheckpointError(f"{meta_file}: not DCP metadata (it holds {_show(md)})")
    items = _get(md, "state_dict_metadata", "the Metadata", meta_file)
    storage = _get(md, "storage_data", "the Metadata", meta_file)
    for field, v in (("state_dict_metadata", items), ("storage_data", storage)):
        if not isinstance(v, dict):
            raise CheckpointError(f"{meta_file}: {field} is {_show(v)}, expected a dict")
    entries: dict[str, Any] = {}
    for fqn, smd in items.items():
        if type(fqn) is not str:
            raise CheckpointError(f"{meta_file}: a key of state_dict_metadata is {_show(fqn)}, expected a string")
        if type(smd) is BytesStorageMetadata:
            entries[fqn] = None
        elif type(smd) is TensorStorageMetadata:
            entries[fqn] = _tensor_meta(smd, f"state_dict_metadata[{fqn!r}]", meta_file)
        else:
            raise CheckpointError(
                f"{meta_file}: state_dict_metadata[{fqn!r}] is {_show(smd)}, expected a TensorStorageMetadata or "
                f"BytesStorageMetadata"
            )
    stored: dict[str, list[_Stored]] = {}
    for index, info in storage.items():
        fqn, where = _stored_at(index, info, meta_file)
        stored.setdefault(fqn, []).append(where)
    return entries, stored


def _first_overlap(boxes: list[Region]) -> tuple[int, int] | None:
    """Two of ``boxes`` (by index) that share an element, or None: a sweep along the dim where they start at the
    most places (for chunks cut along one dim, about n log n)."""
    full = [i for i, b in enumerate(boxes) if not b.is_empty]
    if len(full) < 2:
        return None
    ndim = boxes[full[0]].ndim
    d = max(range(ndim), key=lambda d: len({boxes[i].offset[d] for i in full}), default=None)
    order = full if d is None else sorted(full, key=lambda i: boxes[i].offset[d])
    active: list[int] = []
    for i in order:
        if d is not None:
            active = [j for j in active if boxes[j].stop[d] > boxes[i].offset[d]]
        j = next((j for j in active if boxes[i].intersect(boxes[j]) is not None), None)
        if j is not None:
            return j, i
        active.append(i)
    return None


class _Blobs:
    """The files of a DCP directory, each opened once as a checkpoint's own (``_files``), and the items in them."""

    def __init__(self, src: Path, inside: str) -> None:
        self.src, self.inside = src, inside
        self.files: dict[str, tuple[int, int]] = {}  # name -> descriptor, size

    def close(self) -> None:
        for fd, _ in self.files.values():
            os.close(fd)
        self.files.clear()

    def read(self, s: _Stored, what: str) -> Any:
        """The object pickled at ``s``: its byte range checked against the file and the memory left first."""
        path = self.src / s.file
        if s.file not in self.files:
            fd, st = open_source(path, self.inside, what)
            self.files[s.file] = (fd, st.st_size)
        fd, size = self.files[s.file]
        if s.offset + s.length > size:
            raise CheckpointError(
                f"{what}: the metadata puts it at bytes {s.offset}..{s.offset + s.length} of {path}, which holds {size}"
            )
        room = available_memory()
        if room is not None and s.length > room:
            raise CheckpointError(f"{what}: {s.length} bytes of {path} to read; this process may allocate about {room}")
        return _unpickle_blob(read_exactly(fd, s.length, s.offset, path, what), path, what)

    def item(self, fqn: str, meta: Any, stored: list[_Stored]) -> Any:
        """The leaf of one DCP item: a pickled object, or a tensor merged from its chunks."""
        if meta is None:
            if len(stored) != 1:
                raise CheckpointError(f"{self.src}: DCP item {fqn!r}: expected one stored object, found {len(stored)}")
            return self.read(stored[0], f"{self.src}: DCP item {fqn!r}")
        dtype, size = meta
        what = f"{self.src}: DCP tensor {fqn!r}"
        boxes, shards = [], {}
        for rank, s in enumerate(stored):
            if s.at is None or len(s.at) != len(size):
                raise CheckpointError(f"{what}: a chunk's offset {s.at} does not have the {len(size)} dims of {size}")
            t = self.read(s, what)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != len(size):
                raise CheckpointError(
                    f"{what}: the chunk in {s.file} at {list(s.at)} is not a {dtype} tensor of {size}"
                )
            box = Region(s.at, tuple(t.shape))
            if not Region.full(size).contains(box):
                raise CheckpointError(f"{what}: chunk {box} lies outside its shape {size}")
            boxes.append(box)
            shards[rank] = t
        pair = _first_overlap(boxes)
        if pair is not None:
            a, b = (stored[i] for i in pair)
            raise CheckpointError(
                f"{what}: chunks {boxes[pair[0]]} (in {a.file} at byte {a.offset}) and {boxes[pair[1]]} (in {b.file} "
                f"at byte {b.offset}) share elements; DCP stores each element once"
            )
        if not boxes:
            if math.prod(size):
                raise CheckpointError(f"{what} has no stored chunks")
            return torch.empty(size, dtype=dtype)
        return ShardedLeaf(size, dtype, ExplicitRegions([[b] for b in boxes]), shards)
