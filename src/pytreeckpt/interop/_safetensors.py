"""Conversions between pytreeckpt checkpoints and Hugging Face safetensors files.

The safetensors format is an 8-byte little-endian header length, a JSON header giving
each tensor's dtype, shape and byte range, then the tensors' raw bytes. It is simple
enough to write and read here directly, which keeps memory bounded by one tensor on
export (each is read from the checkpoint and written in turn) and needs no pickle.

A checkpoint's plain Python leaves (step counters, learning rates, data positions) are
not tensors: they travel in the header's ``__metadata__`` (whose values are strings),
under :data:`VALUES_KEY`, as the JSON object of their inline encodings by key path, and
come back on import under their key paths.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pytreeckpt.api import metadata, read_array, save
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._keys import keystr
from pytreeckpt.core._tree import flatten
from pytreeckpt.core._values import decode_value, encode_value
from pytreeckpt.format import ArrayMeta
from pytreeckpt.leaves import is_leaf as _is_leaf
from pytreeckpt.leaves import is_value as _is_value

__all__ = ["export_safetensors", "import_safetensors"]

_TO_ST = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "int16": "I16", "uint16": "U16", "float16": "F16",
    "bfloat16": "BF16", "int32": "I32", "uint32": "U32", "float32": "F32", "float64": "F64", "int64": "I64",
    "uint64": "U64", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "complex64": "C64",
    "float8_e8m0fnu": "F8_E8M0",
}  # fmt: skip
_FROM_ST = {v: getattr(torch, k) for k, v in _TO_ST.items()}
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 * 1024 * 1024
VALUES_KEY = "pytreeckpt.values"
"""The ``__metadata__`` entry holding a checkpoint's Python values: JSON, ``{key path: encoded value}``."""


def _parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    if unit not in units or not num:
        raise ValueError(f"cannot read {text!r} as a size such as 5GB or 500MiB")
    return int(float(num) * units[unit])


def export_safetensors(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    progress: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write a checkpoint's tensors as consolidated safetensors files in directory ``out``.

    Tensors are named by their key paths and stored whole (resharded to one piece).
    Up to ``max_shard_size`` they go to ``model.safetensors``; above it, to
    ``model-0000i-of-0000n.safetensors`` files with a ``model.safetensors.index.json``,
    as Hugging Face writes them. Memory is bounded by the largest tensor. Plain Python
    leaves (step counters, learning rates) go in the first file's header metadata,
    under ``"pytreeckpt.values"``, and :func:`import_safetensors` puts them back.
    ``progress(done_bytes, total_bytes)`` is called after each tensor.

    Returns:
      The files written.

    Raises:
      CheckpointError: a dtype safetensors cannot hold, or a checkpoint problem.
    """
    limit = _parse_size(max_shard_size)
    meta = metadata(path)
    arrays = list(meta.arrays.values())
    values = _values_of(meta.tree)
    for a in arrays:
        if a.dtype.name not in _TO_ST:
            raise CheckpointError(f"leaf {a.key!r}: safetensors has no type for dtype {a.dtype.name}")
    shards: list[list[ArrayMeta]] = [[]]
    size = 0
    for a in arrays:
        if shards[-1] and size + a.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(a)
        size += a.nbytes
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(a.nbytes for a in arrays)
    done = 0
    written = []
    for name, group in zip(names, shards, strict=True):
        header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "pytreeckpt"}}
        if values and name == names[0]:
            header["__metadata__"][VALUES_KEY] = json.dumps(values, allow_nan=False, separators=(",", ":"))
        offset = 0
        for a in group:
            header[a.key] = {
                "dtype": _TO_ST[a.dtype.name],
                "shape": list(a.shape),
                "data_offsets": [offset, offset + a.nbytes],
            }
            offset += a.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the tensors start 8-byte aligned
        tmp = out_dir / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for a in group:
                t = read_array(path, a)
                f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
                done += a.nbytes
                if progress is not None:
                    progress(done, total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_dir / name)
        written.append(out_dir / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {a.key: name for name, group in zip(names, shards, strict=True) for a in group},
        }
        (out_dir / INDEX).write_text(json.dumps(index, indent=2))
        written.append(out_dir / INDEX)
    return written


def _values_of(tree: Any) -> dict[str, Any]:
    """The encoded Python values of a stored tree, by key path."""
    leaves, paths, _ = flatten(tree, lambda x: _is_leaf(x) or isinstance(x, ArrayMeta))
    out: dict[str, Any] = {}
    for leaf, p in zip(leaves, paths, strict=True):
        if not _is_value(leaf):
            continue
        key = keystr(p)
        if key in out:
            raise CheckpointError(
                f"key path {key!r} names several values of the checkpoint (written by an older pytreeckpt); "
                f"a safetensors file cannot tell them apart"
            )
        out[key] = encode_value(leaf)
    return out


def _read_header(f: Any, size: int, file: Path) -> dict[str, Any]:
    head = f.read(8)
    if len(head) != 8:
        raise CheckpointError(f"{file} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    if n > min(MAX_HEADER, size - 8):
        raise CheckpointError(f"{file}: header of {n} bytes does not fit the file ({size} bytes)")
    try:
        header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: the safetensors header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: the safetensors header is not a JSON object")
    header["__start__"] = 8 + n
    return header


def _tensors_of(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors of one safetensors file, mapped copy-on-write (read lazily, never written back), and its values."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        header = _read_header(f, size, file)
        start = header.pop("__start__")
        values = _header_values(header.pop("__metadata__", None), file)
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
    out = {}
    for name, info in header.items():
        try:
            dtype = _FROM_ST[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            lo, hi = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{file}: tensor {name!r} has a malformed or unsupported entry {info!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if any(s < 0 for s in shape) or hi - lo != nbytes or lo < 0 or start + hi > size:
            raise CheckpointError(
                f"{file}: tensor {name!r} claims bytes {lo}..{hi} that do not fit its shape or the file"
            )
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start + lo)  # type: ignore[arg-type]
        out[name] = raw.view(dtype).reshape(shape)
    return out, values


def _header_values(meta: Any, file: Path) -> dict[str, Any]:
    """The Python values a header's ``__metadata__`` carries (see :func:`export_safetensors`)."""
    if not isinstance(meta, dict) or VALUES_KEY not in meta:
        return {}
    try:
        encoded = json.loads(meta[VALUES_KEY])
        if not isinstance(encoded, dict):
            raise ValueError(f"expected a JSON object, found {type(encoded).__name__}")
        return {str(k): decode_value(v) for k, v in encoded.items()}
    except (TypeError, ValueError, CheckpointError) as e:
        raise CheckpointError(f"{file}: malformed {VALUES_KEY!r} in the header metadata: {e}") from None


def import_safetensors(src: str | os.PathLike[str], out: str | os.PathLike[str], **save_kwargs: Any) -> list[str]:
    """Save the tensors of safetensors files as a pytreeckpt checkpoint at ``out``.

    ``src`` is a ``.safetensors`` file, a directory holding one, or a directory with a
    ``model.safetensors.index.json`` naming several. The checkpoint's tree is a flat
    dict from tensor name to tensor, followed by the Python values the files carry (as
    :func:`export_safetensors` writes them) under their key paths. Returns the tensor
    names.
    """
    src = Path(src)
    if src.is_dir():
        if (src / INDEX).exists():
            index = json.loads((src / INDEX).read_text())
            files = sorted({src / f for f in index.get("weight_map", {}).values()})
            for f in files:
                if f.parent != src or not f.name.endswith(".safetensors"):
                    raise CheckpointError(f"{src / INDEX} names {f.name!r}, which is not a safetensors file beside it")
        else:
            files = sorted(src.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{src} holds no .safetensors files")
    else:
        files = [src]
    tensors: dict[str, torch.Tensor] = {}
    values: dict[str, Any] = {}
    for f in files:
        got, vals = _tensors_of(f)
        for name, t in got.items():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} appears in more than one file of {src}")
            tensors[name] = t
        for key, v in vals.items():
            if key in values:
                raise CheckpointError(f"value {key!r} appears in more than one file of {src}")
            values[key] = v
    clash = next((k for k in values if k in tensors), None)
    if clash is not None:
        raise CheckpointError(f"{src}: {clash!r} names both a tensor and a value")
    save(out, {**tensors, **values}, **save_kwargs)
    return list(tensors)
