"""Export a checkpoint as a torch.distributed.checkpoint (DCP) directory: ``.metadata`` and ``.distcp`` files.

The files are written by torch's own DCP writer (``FileSystemWriter``) driven by a
``DefaultSavePlanner`` subclass, in this process alone (``no_dist``): the format is
DCP's own at the installed torch version by construction, and the names are those
``DefaultSavePlanner`` gives the stored tree, flattened by DCP's own traversal. What
differs from ``dcp.save`` of a state dict in memory is where the data comes from: the
planner is handed a state dict of meta tensors (shape and dtype, no data) and reads
each tensor, or each box of a large one, from the checkpoint only when the writer asks
for it (``resolve_data``); and the writer puts at most ``max_file_size`` bytes in each
``.distcp`` file, because it holds a file's tensors until the file is closed.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import os
import queue
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint._traverse import traverse_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.futures import Future

from pytreeckpt.api import metadata
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._keys import keystr
from pytreeckpt.core._leaf import Abstract
from pytreeckpt.core._per_rank import PerRank
from pytreeckpt.core._region import Region
from pytreeckpt.core._tree import flatten
from pytreeckpt.core._values import StoredEnum
from pytreeckpt.format import ArrayMeta
from pytreeckpt.interop._files import create_new, make_dir, remove_file
from pytreeckpt.interop._st_format import parse_size
from pytreeckpt.leaves import is_leaf as _is_leaf
from pytreeckpt.loading._inspect import read_region
from pytreeckpt.storage import Storage

__all__ = ["export_dcp"]


def export_dcp(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_file_size: int | str = "256MB",
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Write a checkpoint as a torch.distributed.checkpoint directory ``out`` (``.metadata`` + ``.distcp`` files).

    ``torch.distributed.checkpoint.load`` reads it at any world size, into plain tensors
    or DTensors of any placement. Each item is named as DCP names the stored tree's
    leaves: dicts are flattened to dotted names (``model.layers.0.weight``), lists by
    index where they hold tensors or dicts; every other value (ints, floats, strings,
    lists and tuples of them) is stored as DCP stores non-tensor values, one pickled
    object per name (``step``, ``optim.param_groups.0.betas``). Tensors, numpy arrays,
    DTensors and sharded leaves are stored whole, as tensors (their global shape), in
    boxes of at most ``max_file_size`` bytes. A per-rank part (saved under ``PER_RANK``)
    is a dict of its ranks' subtrees, ``part.rank0...``, as its key paths say. Empty
    dicts, which DCP does not store, are not stored.

    Memory is bounded: the tree of values is in memory, the tensors are read one box at
    a time as the writer asks, and each ``.distcp`` file holds at most ``max_file_size``
    bytes of tensors (torch's writer keeps a file's tensors until it closes it), so the
    peak is about ``max_file_size`` beyond the values.

    Args:
      path: a committed pytreeckpt checkpoint (a directory or an object-store location).
      out: the local directory to write; made if missing.
      max_file_size: the most tensor bytes in one ``.distcp`` file (an int, or ``"256MB"``);
        a larger tensor is stored as several boxes.
      overwrite: replace a DCP checkpoint already in ``out`` (its ``.metadata`` and
        ``.distcp`` files are removed first); otherwise one there is an error.
      progress: ``progress(done_bytes, total_bytes)``, called after each box is read.

    Returns:
      The DCP names written (the keys of ``.metadata``'s ``state_dict_metadata``).

    Raises:
      CheckpointError: a leaf DCP cannot store as a tensor of its own, named: a tensor
        inside a tuple, namedtuple, dataclass or other container that DCP pickles whole
        (DCP keeps tensors in dicts and lists only; make it a list), or an enum member of
        a type not importable here; a checkpoint whose root is not a dict (a DCP state
        dict is one); ``out`` already holding a DCP checkpoint without ``overwrite``; ``out``
        not a directory, or a directory where a file of the export goes; or a problem
        reading the checkpoint.
      ValueError: ``max_file_size`` is not a positive size (a TypeError if it is neither
        an int nor a string).

    Every file is made exclusively: a symbolic link an earlier run left (or someone
    planted) at its name is removed, never written through.
    """
    limit = parse_size(max_file_size, "max_file_size")
    meta = metadata(path)
    if not isinstance(meta.tree, Mapping):
        raise CheckpointError(
            f"the checkpoint's root is a {type(meta.tree).__name__}; a DCP state dict is a dict, so only a "
            f"checkpoint of a dict can be exported to DCP"
        )
    stored: dict[int, ArrayMeta] = {}  # id of a meta tensor standing for a stored array -> the array
    state = _state_dict(meta.tree, "", meta.arrays, stored)
    _check_terminals(state)
    out_dir = _clear(Path(out), overwrite)
    total = sum(a.nbytes for a in stored.values())
    planner = _ExportPlanner(Storage(path), path, stored, limit, total, progress)
    writer = _BoundedFileWriter(out_dir, limit)
    with warnings.catch_warnings():  # the one process, on purpose: DCP says so on every save without a group
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        try:
            md = dcp_save(state, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as e:  # DCP's wrapper of what its one rank raised: that error itself
            raise next(iter(e.failures.values()))[0] from None
    return list(md.state_dict_metadata)


def _state_dict(x: Any, key: str, arrays: Mapping[str, ArrayMeta], stored: dict[int, ArrayMeta]) -> Any:
    """The DCP state dict of a stored tree: dicts and lists rebuilt, each stored array a meta tensor."""

    def child(name: str) -> str:
        return f"{key}.{name}" if key else name

    if isinstance(x, Abstract):
        a = arrays[key]
        t = torch.empty(a.shape, dtype=a.dtype.torch, device="meta")
        stored[id(t)] = a
        return t
    if isinstance(x, PerRank):  # stored as <part>.rank<r>: DCP names it so too
        return {f"rank{r}": _state_dict(v, child(f"rank{r}"), arrays, stored) for r, v in x.items()}
    if isinstance(x, Mapping):
        return {k: _state_dict(v, child(_entry(k)), arrays, stored) for k, v in x.items()}
    if isinstance(x, list):
        return [_state_dict(v, child(str(i)), arrays, stored) for i, v in enumerate(x)]
    return x  # a value or a container DCP pickles whole (checked by _check_terminals)


def _entry(k: Any) -> str:
    """A dict key as a dotted key path shows it (core._keys.keystr)."""
    if isinstance(k, tuple):
        return "(" + ",".join(_entry(e) for e in k) + ")"
    return str(k)


def _check_terminals(state: dict[str, Any]) -> None:
    """Refuse two items of one DCP name, and what DCP would store as one pickled object but that holds arrays
    (DCP's own traversal decides both)."""
    names: set[str] = set()

    def visit(path: tuple[Any, ...], value: Any) -> None:
        name = ".".join(map(str, path))  # (as DCP's flatten_state_dict names it)
        if name in names:
            raise CheckpointError(f"two leaves have the DCP name {name!r}: rename one of them to export to DCP")
        names.add(name)
        if isinstance(value, torch.Tensor):
            return
        leaves, paths, _ = flatten(value, _is_leaf)
        for leaf, p in zip(leaves, paths, strict=True):
            where = f"{name}.{keystr(p)}" if p else name
            if isinstance(leaf, Abstract):
                raise CheckpointError(
                    f"leaf {where!r}: a tensor inside a {type(value).__name__} at {name!r}, which DCP stores as one "
                    f"pickled object; DCP keeps tensors as its own items only in dicts and lists, so make the "
                    f"{type(value).__name__} a list (or a dict) to export it"
                )
            if isinstance(leaf, StoredEnum):
                raise CheckpointError(
                    f"leaf {where!r}: an enum member of {leaf.type_name}, a type not importable here; DCP pickles "
                    f"the member itself, so import its module before exporting"
                )

    traverse_state_dict(state, visit)


def _clear(out: Path, overwrite: bool) -> Path:
    """``out``, a directory (made if missing) without a DCP checkpoint: one there is removed with ``overwrite``
    (its files as themselves, links unfollowed), else refused."""
    make_dir(out, "export_dcp: out")
    if os.path.lexists(out / ".metadata"):
        if not overwrite:
            raise CheckpointError(f"{out} already holds a DCP checkpoint; pass overwrite=True to replace it")
        remove_file(out / ".metadata", "export_dcp: the DCP checkpoint being replaced")
        for f in out.glob(f"*{DEFAULT_SUFFIX}"):
            remove_file(f, "export_dcp: the DCP checkpoint being replaced")
    return out


def _boxes(shape: tuple[int, ...], itemsize: int, limit: int) -> list[Region]:
    """``shape`` cut into C-order boxes of at most ``limit`` bytes (one element at the least), or whole."""
    if math.prod(shape) * itemsize <= limit:
        return [Region.full(shape)]
    # the first dim d whose one index holds at most limit bytes: dims before it are cut into single
    # indices, dim d into runs of as many indices as fit
    d = next((d for d in range(len(shape)) if math.prod(shape[d + 1 :]) * itemsize <= limit), len(shape) - 1)
    rest = shape[d + 1 :]
    step = max(1, limit // (math.prod(rest) * itemsize))
    return [
        Region((*head, lo, *(0,) * len(rest)), ((1,) * d + (min(step, shape[d] - lo),) + rest))
        for head in itertools.product(*(range(n) for n in shape[:d]))
        for lo in range(0, shape[d], step)
    ]


class _ExportPlanner(DefaultSavePlanner):
    """DCP's default planner, whose tensors are meta tensors read from the checkpoint box by box when written."""

    def __init__(
        self,
        storage: Storage,
        path: Any,
        stored: dict[int, ArrayMeta],
        limit: int,
        total: int,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self._storage, self._path, self._stored, self._limit = storage, path, stored, limit
        self._total, self._done, self._progress = total, 0, progress

    def _array(self, fqn: str) -> ArrayMeta:
        return self._stored[id(self.state_dict[fqn])]

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            if item.type != WriteItemType.TENSOR or item.tensor_data is None:
                items.append(item)
                continue
            a = self._array(item.index.fqn)
            boxes = _boxes(a.shape, a.dtype.itemsize, self._limit)
            if len(boxes) == 1:
                items.append(item)
                continue
            for box in boxes:  # the boxes of one tensor are DCP's chunks of it, as the shards of a DTensor are
                chunk = ChunkStorageMetadata(offsets=torch.Size(box.offset), sizes=torch.Size(box.shape))
                items.append(
                    WriteItem(
                        index=MetadataIndex(item.index.fqn, chunk.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            try:
                return super().resolve_data(write_item)
            except Exception as e:  # torch.save of the value: what cannot be pickled
                raise CheckpointError(f"leaf {fqn!r}: DCP stores it pickled, and it cannot be: {e}") from e
        a = self._array(fqn)
        td: TensorWriteData | None = write_item.tensor_data
        assert td is not None
        box = Region(tuple(td.chunk.offsets), tuple(td.chunk.sizes))
        t = read_region(self._storage, self._path, a, None if box == Region.full(a.shape) else box)
        self._done += t.nbytes
        if self._progress is not None:
            self._progress(self._done, self._total)
        return t


class _BoundedFileWriter(FileSystemWriter):
    """torch's writer, with ``.distcp`` files of at most ``limit`` tensor bytes each (in plan order).

    Its own ``single_file_per_rank`` puts a rank's items in ``thread_count`` files, and it
    keeps each file's tensors until the file is closed: one file would hold them all.
    """

    def __init__(self, path: Path, limit: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        self._limit = limit
        self.fs = _NewFiles()

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[Any]]:
        files: list[list[WriteItem]] = [[]]
        size = 0
        for item in plan.items:
            td = item.tensor_data  # (WriteItem.tensor_storage_size is the whole tensor's, not this box's)
            n = 0 if td is None else math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
            if files[-1] and size + n > self._limit:
                files.append([])
                size = 0
            files[-1].append(item)
            size += n
        todo: queue.Queue[tuple[Any, str, list[WriteItem]]] = queue.Queue()
        for i, items in enumerate(files):
            name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
            todo.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, todo)


class _NewFiles(FileSystem):
    """torch's local file system for DCP, whose files (``.distcp`` files, ``.metadata.tmp``) are made exclusively:
    whatever is at a name first (a file or a symbolic link an earlier run left, or one planted) is removed as
    itself, never written through."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with os.fdopen(create_new(Path(path), "export_dcp"), mode) as f:
            yield cast(io.IOBase, f)
