"""Conversions between pytreeckpt checkpoints and Hugging Face safetensors files.

The safetensors format (``_st_format``) is simple enough to write and read here directly,
which keeps memory bounded by one tensor on export to a directory (each is read from the
checkpoint and written in turn; to an object store, where an object is put whole, by one
shard file) and needs no pickle.

An export chooses a part of the checkpoint (key-path globs), renames it (a mapping or a
function), converts its floating-point tensors to one dtype and splits it into files of
a bounded size with Hugging Face's ``model.safetensors.index.json``. Under
torch.distributed every rank calls it and writes its own share of the files, so no rank
holds the whole model; rank 0 writes the index once every file is written.

A checkpoint's plain Python leaves (step counters, learning rates, data positions) are
not tensors: they travel in the header's ``__metadata__`` (whose values are strings),
under :data:`VALUES_KEY`, as the JSON object of their inline encodings by key path, and
come back on import under their key paths.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pytreeckpt.api import metadata, read_array, save
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._keys import keystr
from pytreeckpt.core._tree import flatten
from pytreeckpt.core._values import decode_value, encode_value
from pytreeckpt.distributed._comm import distributed_comm
from pytreeckpt.format import ArrayMeta
from pytreeckpt.interop._files import create_new, make_dir, read_into, remove_file
from pytreeckpt.interop._st_format import (
    INDEX,
    TO_ST,
    Files,
    Header,
    check_index,
    parse_size,
    read_header,
    safetensors_files,
)
from pytreeckpt.leaves import is_leaf as _is_leaf
from pytreeckpt.leaves import is_value as _is_value
from pytreeckpt.storage import Location, Storage, available_memory, describe, resolve

__all__ = ["Rename", "export_safetensors", "import_safetensors", "renamer"]

VALUES_KEY = "pytreeckpt.values"
"""The ``__metadata__`` entry holding a checkpoint's Python values: JSON, ``{key path: encoded value}``."""

_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

Rename = Mapping[str, str] | Callable[[str], str]
"""A renaming of tensors: a mapping (names it lacks are kept) or a function of the name."""


def renamer(rename: Rename | None) -> Callable[[str], str]:
    """``rename`` as a function (the identity for None)."""
    if rename is None:
        return lambda k: k
    if isinstance(rename, Mapping):
        table = dict(rename)
        return lambda k: table.get(k, k)
    return rename


def _renamed(keys: Sequence[str], rename: Rename | None, what: str) -> list[str]:
    """The new names of ``keys``, checked to be non-empty strings, none given twice."""
    fn = renamer(rename)
    out: list[str] = []
    seen: dict[str, str] = {}
    for k in keys:
        new = fn(k)
        if not isinstance(new, str) or not new:
            raise CheckpointError(f"rename gave {new!r} for {what} {k!r}; a name is a non-empty string")
        if new in seen:
            raise CheckpointError(f"rename gives {what}s {seen[new]!r} and {k!r} the same name {new!r}")
        seen[new] = k
        out.append(new)
    return out


def _included(key: str, include: Sequence[str] | None) -> bool:
    return include is None or any(fnmatch.fnmatchcase(key, p) for p in include)


def _shards(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive groups of the indices of ``sizes``, each at most ``limit`` bytes (or one item)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(sizes):
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += n
    return shards


def _owners(sizes: Sequence[int], world: int) -> list[int]:
    """The rank writing each shard: the largest shards first, each to the rank with the fewest bytes so far."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class _Out:
    """Where the files go: a local directory (each file streamed to a temporary name, fsynced, renamed) or an
    object store prefix (each file put whole, through the storage layer)."""

    def __init__(self, out: str | os.PathLike[str] | Location) -> None:
        r = resolve(out)
        self.dir = r.path
        self.kv = None if r.path is not None else Storage(out).kv
        self.url = r.url

    def where(self, name: str) -> Path | str:
        return self.dir / name if self.dir is not None else f"{self.url}/{name}"

    def prepare(self) -> None:
        if self.dir is not None:
            make_dir(self.dir, "export_safetensors: out")

    def remove_stale(self, keep: Sequence[str]) -> None:
        """Remove the files an earlier export left here that this one did not write (transformers would read a
        stale ``model.safetensors`` or index before this export's files)."""
        names = [p.name for p in self.dir.iterdir()] if self.dir is not None else self.kv.list() if self.kv else []
        for name in names:
            if name in keep or not (name in ("model.safetensors", INDEX) or _SHARD.fullmatch(name)):
                continue
            if self.dir is not None:
                remove_file(self.dir / name, "export_safetensors: a file an earlier export left")
            elif self.kv is not None:
                self.kv.delete(name)

    def write(self, name: str, header: bytes, parts: Callable[[], Any]) -> None:
        """Write ``name``: ``header`` then each buffer ``parts()`` yields."""
        if self.dir is None:
            assert self.kv is not None
            buf = bytearray(header)
            for p in parts():
                buf += memoryview(p).cast("B")
            self.kv.write(name, buf)  # type: ignore[arg-type]
            return
        tmp, what = self.dir / f".{name}.tmp", f"export_safetensors: {name}"
        try:
            with os.fdopen(create_new(tmp, what), "wb") as f:  # (a link planted at its name: removed, not followed)
                f.write(header)
                for p in parts():
                    f.write(p)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dir / name)
        except OSError as e:
            remove_file(tmp, what)
            raise CheckpointError(f"{what}: cannot write {self.dir / name}: {e.strerror or e}") from e
        except BaseException:
            remove_file(tmp, what)
            raise


def export_safetensors(
    path: str | os.PathLike[str] | Location,
    out: str | os.PathLike[str] | Location,
    *,
    include: str | Sequence[str] | None = None,
    rename: Rename | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "5GB",
    process_group: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Write a checkpoint's tensors as Hugging Face safetensors files in directory or prefix ``out``.

    Tensors are named by their key paths (or as ``rename`` says) and stored whole. Up to
    ``max_shard_size`` they go to ``model.safetensors``; above it, to
    ``model-0000i-of-0000n.safetensors`` files with a ``model.safetensors.index.json``,
    as Hugging Face writes them. Each tensor is read from the checkpoint and written in
    turn, so memory holds one tensor (on an object store, one file: an object is put
    whole). Plain Python leaves (step counters, learning rates) go in the first file's
    header metadata, under ``"pytreeckpt.values"``, and :func:`import_safetensors` puts
    them back.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> pytreeckpt.save(d + "/c", {"model": {"w": torch.ones(2, 2)}, "optim": {"m": torch.zeros(2, 2)}})
    >>> files = pytreeckpt.export_safetensors(
    ...     d + "/c", d + "/hf", include="model.*", rename=lambda k: k.removeprefix("model."), dtype=torch.bfloat16
    ... )
    >>> [f.name for f in files]
    ['model.safetensors']

    Args:
      path: a committed checkpoint (a path, URL or :class:`Location`).
      out: the directory, or object store prefix (``s3://bucket/prefix`` or a
        :class:`Location`), to write into.
      include: key-path globs (``fnmatch``, e.g. ``"model.*"``): export only the
        matching leaves (tensors and values).
      rename: the name of each exported leaf: a mapping from key path to name (key
        paths it lacks keep their own) or a function of the key path.
      dtype: convert floating-point tensors to this dtype (``torch.bfloat16`` or its
        name); integer and bool tensors keep theirs.
      max_shard_size: the most bytes of tensors per file (``"5GB"``, ``"500MiB"`` or
        an int); a larger tensor gets a file of its own.
      process_group: the ranks exporting together: those of ``process_group``, else the
        whole world when torch.distributed is initialised. Each of them calls this with
        the same arguments; the files are shared out among them by bytes and each
        writes its own, reading one tensor at a time, so no rank holds the whole model.
        Rank 0 writes the index once all are written; if any rank fails every rank raises.
      progress: ``progress(done_bytes, total_bytes)``, called after each tensor this
        rank writes.

    Returns:
      Every file of the export (local paths as :class:`~pathlib.Path`, object store
      ones as URLs), the same list on every rank.

    Raises:
      CheckpointError: ``include`` matches nothing, ``rename`` gives two leaves one name
        (or a tensor ``__metadata__``, the header's own), a dtype safetensors cannot hold,
        ``out`` or a file name there that is not a file this writes (a directory), or a
        checkpoint problem.
      ValueError: ``max_shard_size`` is not a positive size (a TypeError if it is neither
        an int nor a string).
    """
    limit = parse_size(max_shard_size, "max_shard_size")
    comm = distributed_comm(process_group)
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world)
    error: BaseException | None = None
    try:  # (a failure on one rank fails the export on every rank, as soon as the ranks agree)
        plan = _plan(path, include, rename, dtype, limit, world)
        target = _Out(out)
        _write_files(path, plan, target, rank, progress)
    except Exception as e:
        if comm is None:
            raise
        error = e
    if comm is not None:
        comm.agree(error, "export_safetensors")
    if rank == 0:
        try:
            target.remove_stale([*plan.files, INDEX] if len(plan.files) > 1 else plan.files)
            if len(plan.files) > 1:
                index = {
                    "metadata": {"total_size": sum(plan.sizes)},
                    "weight_map": {plan.names[i]: plan.files[n] for n, s in enumerate(plan.shards) for i in s},
                }
                target.write(INDEX, json.dumps(index, indent=2).encode(), lambda: ())
        except Exception as e:
            if comm is None:
                raise
            error = e
    if comm is not None:
        comm.agree(error, "export_safetensors (the index)")
    return [target.where(f) for f in [*plan.files, *([INDEX] if len(plan.files) > 1 else [])]]


@dataclass(frozen=True)
class _Plan:
    """What an export writes: the arrays, their names and dtypes, which go in which file, and who writes it."""

    arrays: list[ArrayMeta]
    names: list[str]
    dtypes: list[torch.dtype]
    sizes: list[int]
    """Bytes of each array as exported."""
    shards: list[list[int]]
    """The arrays of each file, by index."""
    files: list[str]
    owners: list[int]
    """The rank writing each file."""
    values: dict[str, Any]
    """The encoded Python values, by exported name."""


def _plan(
    path: str | os.PathLike[str] | Location,
    include: str | Sequence[str] | None,
    rename: Rename | None,
    dtype: torch.dtype | str | None,
    limit: int,
    world: int,
) -> _Plan:
    """The export's plan, the same on every rank (made from the checkpoint's metadata alone)."""
    patterns = [include] if isinstance(include, str) else None if include is None else list(include)
    want = _dtype(dtype)
    meta = metadata(path)
    arrays = [a for a in meta.arrays.values() if _included(a.key, patterns)]
    values = {k: v for k, v in _values_of(meta.tree).items() if _included(k, patterns)}
    if patterns is not None and not arrays and not values:
        raise CheckpointError(f"include={patterns} matches no leaf of the checkpoint at {describe(path)}")
    names = _renamed([a.key for a in arrays], rename, "leaf")
    if "__metadata__" in names:
        raise CheckpointError(
            f"rename gives leaf {arrays[names.index('__metadata__')].key!r} the name '__metadata__', the safetensors "
            f"header's own entry (its metadata); give it another name"
        )
    values = dict(zip(_renamed(list(values), rename, "value"), values.values(), strict=True))
    clash = next((k for k in values if k in set(names)), None)
    if clash is not None:
        raise CheckpointError(f"{clash!r} would name both a tensor and a value of the export")
    dtypes = [want if want is not None and a.dtype.torch.is_floating_point else a.dtype.torch for a in arrays]
    for a, d in zip(arrays, dtypes, strict=True):
        if str(d).removeprefix("torch.") not in TO_ST:
            raise CheckpointError(f"leaf {a.key!r}: safetensors has no type for dtype {d}")
    sizes = [math.prod(a.shape) * d.itemsize for a, d in zip(arrays, dtypes, strict=True)]
    shards = _shards(sizes, limit)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    owners = _owners([sum(sizes[i] for i in s) for s in shards], world)
    return _Plan(arrays, names, dtypes, sizes, shards, files, owners, values)


def _write_files(
    path: str | os.PathLike[str] | Location,
    plan: _Plan,
    target: _Out,
    rank: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """Write the files ``rank`` owns, each tensor read from the checkpoint in turn."""
    mine = [n for n, o in enumerate(plan.owners) if o == rank]
    total = sum(plan.sizes[i] for n in mine for i in plan.shards[n])
    done = 0
    target.prepare()
    for n in mine:
        header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "pytreeckpt"}}
        if plan.values and n == 0:
            header["__metadata__"][VALUES_KEY] = json.dumps(plan.values, allow_nan=False, separators=(",", ":"))
        offset = 0
        for i in plan.shards[n]:
            header[plan.names[i]] = {
                "dtype": TO_ST[str(plan.dtypes[i]).removeprefix("torch.")],
                "shape": list(plan.arrays[i].shape),
                "data_offsets": [offset, offset + plan.sizes[i]],
            }
            offset += plan.sizes[i]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the tensors start 8-byte aligned

        def parts(group: list[int] = plan.shards[n]) -> Any:
            nonlocal done
            for i in group:
                t = read_array(path, plan.arrays[i]).to(plan.dtypes[i])
                yield t.contiguous().reshape(-1).view(torch.uint8).numpy()
                del t
                done += plan.sizes[i]
                if progress is not None:
                    progress(done, total)

        target.write(plan.files[n], struct.pack("<Q", len(raw)) + raw, parts)


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = vars(torch).get(str(dtype).removeprefix("torch."))
    if not isinstance(found, torch.dtype):
        raise CheckpointError(f"dtype {dtype!r} is not a torch dtype (such as bfloat16 or float16)")
    return found


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


def _headers(files: Files) -> list[tuple[Path, int, Header]]:
    """Each file of ``files`` opened, with its checked header (the descriptors are the caller's to close)."""
    opened: list[tuple[Path, int, Header]] = []
    try:
        for file in files.paths:
            fd, size = files.open(file)
            try:
                header = read_header(fd, size, file)
            except BaseException:
                os.close(fd)
                raise
            opened.append((file, fd, header))
    except BaseException:
        for _, fd, _ in opened:
            os.close(fd)
        raise
    return opened


def _read_tensors(opened: list[tuple[Path, int, Header]]) -> dict[str, torch.Tensor]:
    """The tensors of the files, read into new memory with ``pread`` (never mapped: a file cut short while it is
    read is a CheckpointError naming it, not a SIGBUS), once the memory they need is known to be there."""
    need = sum(e.nbytes for _, _, header in opened for e in header.tensors.values())
    room = available_memory()
    if room is not None and need > room:
        raise CheckpointError(
            f"importing {[str(f) for f, _, _ in opened][:3]} reads {need} bytes of tensors into memory; this process "
            f"may allocate about {room} more"
        )
    out: dict[str, torch.Tensor] = {}
    for file, fd, header in opened:
        for name, e in header.tensors.items():
            t = torch.empty(e.shape, dtype=e.dtype)
            if e.nbytes:
                buf = memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                read_into(fd, buf, e.start, file, f"tensor {name!r}")
            out[name] = t
    return out


def _header_values(meta: Any, file: Path) -> dict[str, Any]:
    """The Python values a header's ``__metadata__`` carries (see :func:`export_safetensors`)."""
    if not isinstance(meta, dict) or VALUES_KEY not in meta:
        return {}
    try:
        encoded = json.loads(meta[VALUES_KEY])
        if not isinstance(encoded, dict):
            raise ValueError(f"expected a JSON object, found {type(encoded).__name__}")
        return {str(k): decode_value(v) for k, v in encoded.items()}
    except (TypeError, ValueError, RecursionError, CheckpointError) as e:  # (RecursionError: nested too deep)
        raise CheckpointError(f"{file}: malformed {VALUES_KEY!r} in the header metadata: {e}") from None


def import_safetensors(src: str | os.PathLike[str], out: str | os.PathLike[str], **save_kwargs: Any) -> list[str]:
    """Save the tensors of safetensors files as a pytreeckpt checkpoint at ``out``.

    ``src`` is a ``.safetensors`` file, a directory holding one, or a directory with a
    ``model.safetensors.index.json`` naming several. The checkpoint's tree is a flat
    dict from tensor name to tensor, followed by the Python values the files carry (as
    :func:`export_safetensors` writes them) under their key paths. Returns the tensor
    names. (:func:`~pytreeckpt.load_safetensors` loads such files into a model directly.)

    The files are read as untrusted input (``SECURITY.md``): every header is checked, and
    the index agrees with the files (each tensor it names is in the file it names, and it
    names every tensor they hold), before the tensors are read into memory (all of them:
    the memory they need is checked first). A file cut short while it is read, a special
    file, or a shard that is a symbolic link leading out of ``src`` is a CheckpointError
    naming it.
    """
    src = Path(src)
    files = safetensors_files(src)
    opened = _headers(files)
    try:
        held: dict[str, str] = {}
        values: dict[str, Any] = {}
        for file, _, header in opened:
            for name in header.tensors:
                if name in held:
                    raise CheckpointError(f"tensor {name!r} appears in {held[name]} and {file.name} of {src}")
                held[name] = file.name
            for key, v in _header_values(header.metadata, file).items():
                if key in values:
                    raise CheckpointError(f"value {key!r} appears in more than one file of {src}")
                values[key] = v
        if files.weight_map is not None:
            check_index(src, files.weight_map, held)
        clash = next((k for k in values if k in held), None)
        if clash is not None:
            raise CheckpointError(f"{src}: {clash!r} names both a tensor and a value")
        tensors = _read_tensors(opened)
    finally:
        for _, fd, _ in opened:
            os.close(fd)
    save(out, {**tensors, **values}, **save_kwargs)
    return list(tensors)
