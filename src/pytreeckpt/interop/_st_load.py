"""Hugging Face safetensors loaded straight into a (sharded) target, each rank reading only its slices.

Each rank checks the files' headers (``_st_format``), matches the stored tensors to the
target's leaves by name, and reads, for each leaf, only the byte ranges of the boxes of
the global tensor its local shard holds (for an FSDP2 DTensor sharded on dim 0, one
contiguous range), into the leaf's own memory. No rank reads a whole tensor it holds
only a shard of, and the ranks need not talk to each other.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pytreeckpt.core._dtypes import dtype_of_torch
from pytreeckpt.core._errors import CheckpointError, TargetMismatchError
from pytreeckpt.core._keys import keystr
from pytreeckpt.core._region import Region
from pytreeckpt.core._tree import flatten
from pytreeckpt.execute._cast import cast_problem
from pytreeckpt.interop._files import read_into
from pytreeckpt.interop._safetensors import Rename, renamer
from pytreeckpt.interop._st_format import Entry, Files, check_index, read_header, safetensors_files
from pytreeckpt.loading._report import LoadReport

__all__ = ["load_safetensors"]


@dataclass(frozen=True, slots=True)
class _Stored:
    file: Path
    entry: Entry
    name: str
    """The tensor's name in the file."""


def _stored(src: Path) -> tuple[Files, dict[str, _Stored]]:
    """The files of ``src``, and every tensor of them by name, its header checked; an index must agree with them."""
    files = safetensors_files(src)
    found: dict[str, _Stored] = {}
    for file in files.paths:
        fd, size = files.open(file)
        try:
            header = read_header(fd, size, file)
        finally:
            os.close(fd)
        for name, entry in header.tensors.items():
            if name in found:
                raise CheckpointError(f"tensor {name!r} appears in {found[name].file.name} and {file.name} of {src}")
            found[name] = _Stored(file, entry, name)
    if files.weight_map is not None:
        check_index(src, files.weight_map, {name: s.file.name for name, s in found.items()})
    return files, found


def _target_leaves(target: Any) -> tuple[Any, list[str], list[torch.Tensor]]:
    tree = target.state_dict() if hasattr(target, "state_dict") and hasattr(target, "load_state_dict") else target
    leaves, paths, _ = flatten(tree, lambda x: isinstance(x, torch.Tensor))
    keys, tensors = [], []
    for leaf, p in zip(leaves, paths, strict=True):
        if isinstance(leaf, torch.Tensor):
            keys.append(keystr(p))
            tensors.append(leaf)
    return tree, keys, tensors


def _memory_groups(tensors: list[torch.Tensor]) -> list[int]:
    """For each tensor, the index of the first of ``tensors`` that is the same memory (itself if none)."""
    from torch.distributed.tensor import DTensor

    first: dict[tuple[Any, ...], int] = {}
    out = []
    for i, t in enumerate(tensors):
        local = t.to_local() if isinstance(t, DTensor) else t
        ident = (local.device, local.untyped_storage().data_ptr(), local.storage_offset(), local.shape, local.stride())
        out.append(first.setdefault(ident, i) if local.numel() else i)
    return out


def _boxes(t: torch.Tensor) -> list[tuple[Region, torch.Tensor]]:
    """The boxes of the global tensor this rank holds of ``t``, each with the view of the local tensor it fills."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return [(Region.full(tuple(t.shape)), t.detach())]
    from pytreeckpt.distributed._dtensor import spec_from_dtensor

    spec, ranks = spec_from_dtensor(t)
    me = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if me not in ranks:
        return []
    local = t.to_local().detach()
    out = []
    for piece in spec.pieces_of(ranks.index(me), tuple(t.shape)):
        box = piece.region
        if piece.local_box is None and piece.local_offset == 0 and tuple(local.shape) == box.shape:
            view = local  # (the whole local tensor, contiguous or not)
        elif piece.local_box is None:
            flat = local.view(-1)  # (a view: an error for memory that is not one run, never a copy written to)
            view = flat[piece.local_offset : piece.local_offset + box.size].view(box.shape)
        else:
            view = local[tuple(slice(o, o + s) for o, s in zip(piece.local_box, box.shape, strict=True))]
        out.append((box, view))
    return out


def _runs(shape: tuple[int, ...], box: Region, itemsize: int) -> Iterator[tuple[int, int]]:
    """The contiguous byte ranges ``(offset, length)`` of ``box`` in a C-ordered array of ``shape``, in order."""
    if box.size == 0:
        return
    k = len(shape)  # the dims from k on are whole in the box, so each run spans them
    while k > 0 and box.offset[k - 1] == 0 and box.shape[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        yield 0, math.prod(shape) * itemsize
        return
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = box.shape[k - 1] * strides[k - 1] * itemsize
    base = box.offset[k - 1] * strides[k - 1]
    for idx in np.ndindex(*box.shape[: k - 1]):
        start = base + sum((box.offset[d] + i) * strides[d] for d, i in enumerate(idx))
        yield start * itemsize, length


def _read_box(fd: int, stored: _Stored, box: Region, into: torch.Tensor) -> int:
    """Read ``box`` of the stored tensor into ``into`` (of the box's shape and the stored dtype, contiguous)."""
    e = stored.entry
    buf = memoryview(into.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    pos = 0
    for offset, length in _runs(e.shape, box, e.dtype.itemsize):
        read_into(fd, buf[pos : pos + length], e.start + offset, stored.file, f"tensor {stored.name!r}")
        pos += length
    return pos


def load_safetensors(
    src: str | os.PathLike[str],
    target: Any,
    *,
    rename: Rename | None = None,
    cast: bool = False,
    strict: bool = True,
    report: LoadReport | None = None,
) -> Any:
    """Load Hugging Face safetensors files into ``target``'s tensors, in place, each rank reading only its slices.

    No import step: the files (``save_pretrained``'s, or :func:`export_safetensors`'s)
    are read where they are. For each target tensor this rank holds a shard of (an FSDP2
    or tensor-parallel DTensor), only the byte ranges of that shard are read, straight into
    it; a plain tensor is read whole. The ranks do not talk to each other: each calls
    this with its own target. Headers are checked before any tensor is read
    (``SECURITY.md``): their size, their JSON, and each tensor's dtype, shape and bytes,
    which must lie in the file and overlap no other's.

    >>> import tempfile, torch, pytreeckpt
    >>> from safetensors.torch import save_file
    >>> f = tempfile.mkdtemp() + "/model.safetensors"
    >>> save_file({"w": torch.ones(2, 3), "b": torch.zeros(3)}, f)
    >>> got = pytreeckpt.load_safetensors(f, {"w": torch.empty(2, 3, dtype=torch.bfloat16)}, cast=True, strict=False)
    >>> got["w"].sum().item()
    6.0

    Args:
      src: a ``.safetensors`` file, a directory holding some, or a directory with a
        ``model.safetensors.index.json`` naming them.
      target: a tree whose tensor leaves (tensors, Parameters, DTensors) are filled in
        place, matched by key path (``{"model": {"w": t}}`` is ``model.w``); or a module
        (an object with ``state_dict()`` and ``load_state_dict()``), whose state dict's
        tensors, which share its parameters' memory, are filled. Tensors that share
        memory (tied weights, which ``save_pretrained`` writes once) are loaded when the
        files hold any of their names. A tensor on the meta device is refused.
      rename: the target key path of each stored tensor: a mapping from the stored name
        (names it lacks keep their own) or a function of it.
      cast: a target tensor of another dtype than the stored one gets it converted, as
        ``Tensor.to`` rounds (as ``load(cast=True)``); without it another dtype is a
        mismatch.
      strict: with True (the default) every target tensor must be stored and every
        stored tensor wanted; with False a target tensor the files lack keeps its
        values and stored tensors the target lacks are not read.
      report: a :class:`LoadReport`, filled in with the target's key paths the files
        lack (``missing``), the stored names the target lacks (``unexpected``) and the
        casts made (``cast``).

    Returns:
      The target's tree (the state dict for a module), its tensors filled.

    Raises:
      TargetMismatchError: naming each key whose tensor is missing, unexpected (with
        ``strict``) or of another shape, or of another dtype (without ``cast``).
      CheckpointError: a file that is not valid safetensors.
    """
    src = Path(src)
    source, stored = _stored(src)
    names = renamer(rename)
    by_key: dict[str, _Stored] = {}
    for name, found in stored.items():
        key = names(name)
        if key in by_key:
            raise CheckpointError(f"rename gives stored tensors {by_key[key].name!r} and {name!r} the same key {key!r}")
        by_key[key] = found
    tree, keys, tensors = _target_leaves(target)
    for key, t in zip(keys, tensors, strict=True):
        if t.is_meta:
            raise TargetMismatchError(f"leaf {key!r} is a tensor on the meta device: it holds no memory to load into")
    report = report if report is not None else LoadReport()
    # Tensors sharing memory (tied weights: a model's state dict names them twice, save_pretrained once)
    # are loaded when the files hold any of their names.
    group = _memory_groups(tensors)
    loaded = {group[i] for i, k in enumerate(keys) if k in by_key}
    report.missing[:] = [k for i, k in enumerate(keys) if k not in by_key and group[i] not in loaded]
    wanted = set(keys)
    report.unexpected[:] = [s.name for k, s in by_key.items() if k not in wanted]
    report.cast.clear()
    problems = []
    if strict and (report.missing or report.unexpected):
        problems.append(
            f"the target's keys {report.missing} are not in the files, and the files' tensors {report.unexpected} "
            f"are not in the target (strict=False loads the tensors both have)"
        )
    for key, t in zip(keys, tensors, strict=True):
        s = by_key.get(key)
        if s is None:
            continue
        e = s.entry
        if tuple(t.shape) != e.shape:
            problems.append(f"{key!r}: the files hold {s.name!r} of shape {list(e.shape)}, the target {list(t.shape)}")
        elif t.dtype != e.dtype:
            stored_dt, target_dt = dtype_of_torch(e.dtype), dtype_of_torch(t.dtype)
            why = cast_problem(stored_dt, target_dt) if cast else "load with cast=True to convert it"
            if why is not None:
                problems.append(
                    f"{key!r}: the files hold {s.name!r} as {stored_dt.name}, the target {target_dt.name}: {why}"
                )
            else:
                report.cast.append((key, stored_dt.name, target_dt.name))
    if problems:
        raise TargetMismatchError(f"cannot load {src} into the target: " + "; ".join(problems))
    files: dict[Path, int] = {}
    try:
        for key, t in zip(keys, tensors, strict=True):
            s = by_key.get(key)
            if s is None:
                continue
            if s.file not in files:
                files[s.file] = source.open(s.file)[0]
            for box, view in _boxes(t):
                direct = view.dtype == s.entry.dtype and view.device.type == "cpu" and view.is_contiguous()
                into = view if direct else torch.empty(box.shape, dtype=s.entry.dtype)
                _read_box(files[s.file], s, box, into)
                if not direct:
                    view.copy_(into)
    finally:
        for fd in files.values():
            os.close(fd)
    return tree
