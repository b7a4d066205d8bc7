"""The safetensors format, read as untrusted input: headers and index files checked before any tensor is read.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range (relative to the end of the header), then the raw
bytes. A header is refused unless it is at most :data:`MAX_HEADER` bytes and fits the
file, is one JSON object with no key twice, and each tensor's entry names a known dtype,
a shape of non-negative integers spanning at most :data:`MAX_BYTES` and a byte range
that is exactly its shape's bytes, lies within the file and overlaps no other tensor's.
An index (``model.safetensors.index.json``) may only name plain ``.safetensors`` files
beside it, and must place each tensor in the file that holds it and name every tensor
the files hold. The files are opened as a checkpoint's own (``_files``): only regular
files, never a symbolic link leading out of their directory, read with ``pread``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.interop._files import open_source, read_exactly

__all__ = [
    "FROM_ST",
    "INDEX",
    "MAX_BYTES",
    "MAX_HEADER",
    "TO_ST",
    "Entry",
    "Files",
    "Header",
    "check_index",
    "parse_size",
    "read_header",
    "read_index",
    "safetensors_files",
]

TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
    "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
    "float8_e8m0fnu": "F8_E8M0",
}  # fmt: skip
FROM_ST = {v: getattr(torch, k) for k, v in TO_ST.items()}
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024
"""The largest header read (the safetensors library's own limit)."""
MAX_INDEX = 100 * 1024 * 1024
"""The largest index file read."""


def parse_size(text: str | int, name: str) -> int:
    """A positive size in bytes from ``5GB``, ``500MiB`` or an int, given as the argument ``name``.

    Raises:
      TypeError: ``text`` is neither an int nor a string (naming the argument).
      ValueError: ``text`` is no size, or not a positive finite one (naming the argument).
    """
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise TypeError(f"{name} must be an int or a string such as '5GB', found {type(text).__name__} {text!r}")
    if isinstance(text, int):
        size = text
    else:
        units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
        t = text.strip().upper()
        num = t.rstrip("KMGIB")
        unit = t[len(num) :]
        try:
            value = float(num) * units[unit]
        except (KeyError, ValueError):
            raise ValueError(f"{name}: cannot read {text!r} as a size such as 5GB or 500MiB") from None
        if not math.isfinite(value):
            raise ValueError(f"{name}: {text!r} is not a finite size")
        size = int(value)
    if size < 1:
        raise ValueError(f"{name} must be a positive size, found {text!r}")
    return size


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a safetensors file: its dtype, shape and where its bytes start in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """The offset in the file of the tensor's first byte."""
    nbytes: int


@dataclass(frozen=True, slots=True)
class Header:
    """A checked safetensors header."""

    tensors: dict[str, Entry]
    metadata: dict[str, Any] | None
    """The ``__metadata__`` object, if the header has one."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"the key {k!r} appears twice")
        out[k] = v
    return out


def _int(v: Any) -> int:
    if type(v) is not int:
        raise ValueError(f"{v!r} is not an integer")
    return v


MAX_BYTES = 2**63 - 1
"""The most bytes a tensor's shape may span, its zero extents aside (what numpy and torch can address)."""


def read_header(fd: int, size: int, file: Path) -> Header:
    """The checked header of the safetensors file open as ``fd``, which holds ``size`` bytes.

    Raises:
      CheckpointError: naming the file (and the tensor) for a header that is too large, is
        not a JSON object, or describes a tensor that does not fit its bytes or the file.
    """
    if size < 8:
        raise CheckpointError(f"{file} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", read_exactly(fd, 8, 0, file, "the safetensors file"))
    if n > min(MAX_HEADER, size - 8):
        raise CheckpointError(
            f"{file}: header of {n} bytes does not fit the file ({size} bytes) or the limit ({MAX_HEADER} bytes)"
        )
    try:
        raw = json.loads(read_exactly(fd, n, 8, file, "the safetensors file"), object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    meta = raw.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise CheckpointError(f"{file}: the header's __metadata__ is not a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    tensors: dict[str, Entry] = {}
    spans = []
    for name, info in raw.items():
        try:
            dtype = FROM_ST[info["dtype"]]
            shape = tuple(_int(s) for s in info["shape"])
            lo, hi = (_int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r} has a malformed or unsupported entry {info!r}") from None
        if any(s < 0 for s in shape):
            raise CheckpointError(f"{file}: tensor {name!r} has a negative extent in its shape {list(shape)}")
        if math.prod(s for s in shape if s) * dtype.itemsize > MAX_BYTES:
            raise CheckpointError(
                f"{file}: tensor {name!r} has the shape {list(shape)}, whose extents span more than {MAX_BYTES} bytes "
                f"of {info['dtype']} (what numpy and torch can address)"
            )
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= lo <= hi <= data_size or hi - lo != nbytes:
            raise CheckpointError(
                f"{file}: tensor {name!r} claims bytes {lo}..{hi} of the data, which do not fit its shape "
                f"{list(shape)} of {info['dtype']} ({nbytes} bytes) or the file's {data_size} data bytes"
            )
        tensors[name] = Entry(dtype, shape, data_start + lo, nbytes)
        if nbytes:
            spans.append((lo, hi, name))
    spans.sort()
    for (_, hi, a), (lo, _, b) in itertools.pairwise(spans):
        if lo < hi:
            raise CheckpointError(f"{file}: tensors {a!r} and {b!r} claim overlapping bytes")
    return Header(tensors, meta)


@dataclass(frozen=True, slots=True)
class Files:
    """The safetensors files of a source, and how to open them."""

    paths: list[Path]
    inside: str | None
    """The real path of the directory they are in, which a symbolic link among them must not leave (None: the one
    file the caller named, whose link was resolved)."""
    weight_map: dict[str, str] | None
    """The index's map from tensor name to file name, if there is an index."""

    def open(self, file: Path) -> tuple[int, int]:
        """``file`` opened for reading, and its size (a FIFO, device or directory refused, and a link leading out of
        the directory)."""
        fd, st = open_source(file, self.inside, "the safetensors file")
        return fd, st.st_size


def safetensors_files(src: Path) -> Files:
    """The safetensors files of ``src``: a file, a directory with an index naming them, or a directory of them."""
    if not src.is_dir():
        return Files([Path(os.path.realpath(src))], None, None)  # (the file the caller named: its link followed)
    inside = _links_stay_in(os.path.realpath(src))
    weight_map = None
    if os.path.lexists(src / INDEX):
        weight_map = read_index(src / INDEX, inside)
        files = sorted({src / f for f in weight_map.values()})
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src} holds no .safetensors files")
    return Files(files, inside, weight_map)


def _links_stay_in(real: str) -> str:
    """Where the links among the files of the directory ``real`` may lead: inside it, or, for a snapshot of the Hugging
    Face cache (``models--<org>--<name>/snapshots/<revision>``, whose files link to ``../../blobs/<hash>``), inside
    that one model's folder of the cache."""
    snapshots = os.path.dirname(real)
    repo = os.path.dirname(snapshots)
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(os.path.join(repo, "blobs")):
        return repo
    return real


def check_index(src: Path, weight_map: dict[str, str], held: dict[str, str]) -> None:
    """Refuse an index that does not place each tensor in the file holding it (``held``: tensor name to file name),
    or that omits a tensor a file holds."""
    for name, file_name in weight_map.items():
        if held.get(name) != file_name:
            also = f" ({held[name]} does)" if name in held else ""
            raise CheckpointError(f"{src / INDEX} puts tensor {name!r} in {file_name}, which does not hold it{also}")
    for name, file_name in held.items():
        if name not in weight_map:
            raise CheckpointError(f"{src / INDEX} does not name tensor {name!r}, which {file_name} holds")


def read_index(index: Path, inside: str) -> dict[str, str]:
    """The weight map of an index file, each file a plain ``.safetensors`` name beside it."""
    fd, st = open_source(index, inside, "the safetensors index")
    try:
        if st.st_size > MAX_INDEX:
            raise CheckpointError(f"{index} holds {st.st_size} bytes, more than the {MAX_INDEX} an index may")
        text = read_exactly(fd, st.st_size, 0, index, "the safetensors index")
    finally:
        os.close(fd)
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{index} is not JSON: {e}") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map object")
    for name, f in weight_map.items():
        if not isinstance(f, str) or "/" in f or "\\" in f or f.startswith(".") or not f.endswith(".safetensors"):
            raise CheckpointError(f"{index} names {f!r} for {name!r}, which is not a safetensors file beside it")
    return weight_map
