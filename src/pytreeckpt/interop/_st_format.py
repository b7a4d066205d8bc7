"""The safetensors format, read as untrusted input: headers and index files checked before any tensor is read.

A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range (relative to the end of the header), then the raw
bytes. A header is refused unless it is at most :data:`MAX_HEADER` bytes and fits the
file, is one JSON object with no key twice, and each tensor's entry names a known dtype,
a shape of non-negative integers and a byte range that is exactly its shape's bytes,
lies within the file and overlaps no other tensor's. An index
(``model.safetensors.index.json``) may only name plain ``.safetensors`` files beside it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytreeckpt.core._errors import CheckpointError

__all__ = [
    "FROM_ST",
    "INDEX",
    "MAX_HEADER",
    "TO_ST",
    "Entry",
    "Header",
    "open_regular",
    "parse_size",
    "read_header",
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


def parse_size(text: str | int) -> int:
    """A size in bytes from ``5GB``, ``500MiB`` or an int."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    if unit not in units or not num:
        raise ValueError(f"cannot read {text!r} as a size such as 5GB or 500MiB")
    return int(float(num) * units[unit])


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


def open_regular(file: Path) -> Any:
    """``file`` opened for reading if it is a regular file (a FIFO or device is refused before any read)."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CheckpointError(f"cannot open {file}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{file} is not a regular file")
    return os.fdopen(fd, "rb")


def _int(v: Any) -> int:
    if type(v) is not int:
        raise ValueError(f"{v!r} is not an integer")
    return v


def read_header(f: Any, size: int, file: Path | str) -> Header:
    """The checked header of the safetensors file open as ``f`` (at its start), which holds ``size`` bytes.

    Raises:
      CheckpointError: naming the file (and the tensor) for a header that is too large, is
        not a JSON object, or describes a tensor that does not fit its bytes or the file.
    """
    head = f.read(8)
    if len(head) != 8:
        raise CheckpointError(f"{file} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_HEADER, size - 8):
        raise CheckpointError(
            f"{file}: header of {n} bytes does not fit the file ({size} bytes) or the limit ({MAX_HEADER} bytes)"
        )
    try:
        raw = json.loads(f.read(n), object_pairs_hook=_no_duplicates)
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


def safetensors_files(src: Path) -> list[Path]:
    """The safetensors files of ``src``: a file, a directory with an index naming them, or a directory of them."""
    if not src.is_dir():
        return [src]
    index = src / INDEX
    if index.exists():
        weight_map = read_index(index)
        files = sorted({src / f for f in weight_map.values()})
    else:
        files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src} holds no .safetensors files")
    return files


def read_index(index: Path) -> dict[str, str]:
    """The weight map of an index file, each file a plain ``.safetensors`` name beside it."""
    with open_regular(index) as f:
        text = f.read(MAX_INDEX + 1)
    if len(text) > MAX_INDEX:
        raise CheckpointError(f"{index} is larger than {MAX_INDEX} bytes")
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
