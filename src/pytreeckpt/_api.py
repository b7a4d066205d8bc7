"""The functional API: ``save``, ``load`` and ``metadata``, in one process.

One process may hold the shards of every rank (ShardedLeaf.from_global makes such
leaves), which is how layouts are resharded and tested without a process group.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ._dtypes import DType, dtype_of_numpy, dtype_of_torch, numpy_view
from ._errors import CheckpointError, LayoutError, TargetMismatchError
from ._executor import ExecutorOptions, PieceData, Storage
from ._format import ARRAYS_DIR, ArrayMeta, ValueMeta, array_names, build_document, parse_document
from ._leaf import Abstract, ShardedLeaf, piece_view
from ._plan import ArrayLayout, ChunkingOptions, plan_load, plan_save
from ._region import Region
from ._sharding import Layout, Mesh, Piece, Replicate, ShardingSpec
from ._tree import PYTHON_LEAF_TYPES, KeyEntry, Node, broadcast_prefix, encode_value, flatten, keystr

__all__ = ["CheckpointMetadata", "load", "metadata", "save"]

PathLike = str | os.PathLike[str]
_SINGLE = ShardingSpec(Mesh(1), [Replicate()])


def _is_leaf(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray, np.generic, ShardedLeaf, Abstract, *PYTHON_LEAF_TYPES))


def _where(key: str) -> str:
    return repr(key) if key else "(root)"


def _is_dtensor(x: Any) -> bool:
    return type(x).__name__ == "DTensor" and type(x).__module__.startswith("torch.distributed")


@dataclass(slots=True)
class _ArrayIn:
    """A tensor leaf on its way to storage."""

    key: str
    container: str
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout
    saved_layout: Layout | None
    pieces: tuple[tuple[Piece, ...], ...]
    get: PieceData
    present: frozenset[int] | None = None  # ranks whose data is here; None: all


def _global_source(arr: np.ndarray, pieces: tuple[tuple[Piece, ...], ...]) -> PieceData:
    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        region = pieces[rank][pi].region
        return arr[region.slices()], region

    return get


def _sharded_source(leaf: ShardedLeaf, pieces: tuple[tuple[Piece, ...], ...]) -> PieceData:
    cpu = {r: t.detach().cpu() for r, t in leaf.shards.items()}

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        piece = pieces[rank][pi]
        return numpy_view(piece_view(cpu[rank], piece)), piece.region

    return get


def _array_in(key: str, leaf: Any, spec: Any) -> _ArrayIn:
    if isinstance(leaf, Abstract):
        raise CheckpointError(f"leaf {_where(key)} is an Abstract placeholder, which has no data to save")
    if _is_dtensor(leaf):
        raise CheckpointError(
            f"leaf {_where(key)} is a DTensor; convert it with .full_tensor() or to a ShardedLeaf to save it from "
            f"one process"
        )
    if spec is not None and not isinstance(spec, Layout):
        raise CheckpointError(f"spec for leaf {_where(key)} must be a ShardingSpec, FlatRanges, ExplicitRegions or None, found {spec!r}")
    try:
        if isinstance(leaf, ShardedLeaf):
            if spec is not None and spec != leaf.spec:
                raise CheckpointError(
                    f"leaf {_where(key)} is a ShardedLeaf in layout {leaf.spec}, but the spec tree gives {spec}"
                )
            pieces = leaf.spec.rank_pieces(leaf.shape)
            return _ArrayIn(
                key, "torch", dtype_of_torch(leaf.dtype), leaf.shape, leaf.spec, leaf.spec, pieces,
                _sharded_source(leaf, pieces), frozenset(leaf.shards),
            )
        if isinstance(leaf, torch.Tensor):
            dtype = dtype_of_torch(leaf.dtype)
            arr = numpy_view(leaf.detach().cpu())
            container = "torch"
        else:
            arr = np.asarray(leaf)
            dtype = dtype_of_numpy(arr.dtype)
            container = "numpy"
        layout = spec if spec is not None else _SINGLE
        shape = tuple(int(s) for s in arr.shape)
        pieces = layout.rank_pieces(shape)
        return _ArrayIn(key, container, dtype, shape, layout, spec, pieces, _global_source(arr, pieces))
    except (LayoutError, ValueError) as e:
        if isinstance(e, CheckpointError) and not isinstance(e, LayoutError):
            raise
        raise LayoutError(f"leaf {_where(key)}: {e}") from None


def save(
    path: PathLike,
    tree: Any,
    spec: Any = None,
    *,
    overwrite: bool = False,
    user_metadata: Mapping[str, Any] | None = None,
    chunking: ChunkingOptions | None = None,
    executor: ExecutorOptions | None = None,
    namespace: str = "",
) -> None:
    """Save a pytree as a checkpoint at ``path``.

    Args:
      path: a directory; created if missing. An interrupted, uncommitted save there is
        cleared; a committed checkpoint is replaced only with ``overwrite=True``.
      tree: a pytree whose leaves are tensors, numpy arrays, :class:`ShardedLeaf` or
        plain Python values (int, float, bool, str, None).
      spec: a pytree prefix of ``tree`` whose leaves are sharding specs or None. A
        tensor under a spec is the global tensor, laid out as the spec says: this
        decides the chunk grid and which rank writes what.
      overwrite: replace a committed checkpoint at ``path``.
      user_metadata: a JSON object stored with the checkpoint.
      chunking: how stored arrays are chunked.
      executor: concurrency of the I/O.
      namespace: the optree namespace of custom pytree nodes in ``tree``.

    Raises:
      CheckpointError: naming the leaf, for anything that cannot be saved.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> pytreeckpt.save(d + "/ckpt", {"w": torch.ones(2, 3), "step": 7})
    >>> pytreeckpt.load(d + "/ckpt")["step"]
    7
    """
    leaves, paths, root = flatten(tree, _is_leaf, namespace=namespace)
    specs = broadcast_prefix(spec, root, lambda x: isinstance(x, Layout), len(leaves), namespace=namespace)
    keys = [keystr(p) for p in paths]
    arrays: list[_ArrayIn] = []
    entries: list[dict[str, Any] | None] = []
    for key, leaf, sp in zip(keys, leaves, specs, strict=True):
        if isinstance(leaf, PYTHON_LEAF_TYPES):
            entries.append(ValueMeta(key, leaf).to_json(encode_value(leaf)))
        else:
            arrays.append(_array_in(key, leaf, sp))
            entries.append(None)
    world = max((a.layout.world_size for a in arrays), default=1)
    plan = plan_save(
        [ArrayLayout(a.key, a.shape, a.dtype.itemsize, a.pieces) for a in arrays], world, chunking
    )
    for a, ap in zip(arrays, plan.arrays, strict=True):
        if a.present is not None:
            for op in ap.writes:
                for frag in op.sources:
                    if frag.rank not in a.present:
                        raise CheckpointError(
                            f"leaf {_where(a.key)}: elements {frag.region} live only on rank {frag.rank}, whose shard "
                            f"is not in this ShardedLeaf (it holds ranks {sorted(a.present)})"
                        )
    names = array_names([a.key for a in arrays])
    metas = [
        ArrayMeta(a.key, a.container, a.dtype, a.shape, ap.chunk_shape, f"{ARRAYS_DIR}/{name}", a.saved_layout)
        for a, ap, name in zip(arrays, plan.arrays, names, strict=True)
    ]
    it = iter(metas)
    leaf_json = [e if e is not None else next(it).to_json() for e in entries]
    document = build_document(root, leaf_json, dict(user_metadata or {}))
    storage = Storage(path, executor)
    storage.prepare(overwrite)
    storage.write(metas, plan.arrays, [a.get for a in arrays], rank=None)
    storage.commit(document)


# --------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What a checkpoint holds, read from its metadata alone.

    Attributes:
      tree: the stored tree, with an :class:`Abstract` for every tensor leaf (numpy
        leaves too) and plain Python leaves' values; usable as a load target.
      arrays: the stored arrays by key path: dtype, shape, chunk grid, saved layout.
      user_metadata: the JSON object given at save time.
      version: the format version.
    """

    tree: Any
    arrays: Mapping[str, ArrayMeta]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    version: int = 1

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def _open(path: PathLike, namespace: str, executor: ExecutorOptions | None) -> tuple[Storage, Any]:
    storage = Storage(path, executor)
    doc = parse_document(storage.read_metadata(), namespace=namespace)
    return storage, doc


def metadata(path: PathLike, *, namespace: str = "") -> CheckpointMetadata:
    """Read a committed checkpoint's metadata (no array data is read)."""
    _, doc = _open(path, namespace, None)
    leaves = [
        leaf.value if isinstance(leaf, ValueMeta) else _abstract_of(leaf) for leaf in doc.leaves
    ]
    arrays = {leaf.key: leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)}
    return CheckpointMetadata(doc.tree.unflatten(leaves), arrays, doc.user_metadata, doc.version)


def _abstract_of(meta: ArrayMeta) -> Any:
    try:
        return Abstract(meta.shape, meta.dtype.torch)
    except KeyError:  # numpy-only dtypes
        return meta


@dataclass(slots=True)
class _Dest:
    """Destination memory of one target leaf."""

    meta: ArrayMeta
    pieces: tuple[tuple[Piece, ...], ...]
    locals: dict[int, Any]  # rank -> torch tensor or numpy array (CPU)
    finish: Any  # callable: () -> result leaf

    def get(self, rank: int, pi: int) -> tuple[np.ndarray, Region]:
        piece = self.pieces[rank][pi]
        local = self.locals[rank]
        if isinstance(local, np.ndarray):
            view = local if piece.local_offset == 0 and local.shape == piece.region.shape else (
                local.reshape(-1)[piece.local_offset : piece.local_offset + piece.region.size].reshape(piece.region.shape)
            )
            return view, piece.region
        return numpy_view(piece_view(local, piece)), piece.region


def _full_dest(meta: ArrayMeta, as_numpy: bool, device: torch.device | None, param: torch.Tensor | None) -> _Dest:
    pieces = _SINGLE.rank_pieces(meta.shape)
    if as_numpy:
        arr = np.empty(meta.shape, dtype=meta.dtype.numpy)
        return _Dest(meta, pieces, {0: arr}, lambda: arr)
    t = torch.empty(meta.shape, dtype=meta.dtype.torch)

    def finish() -> Any:
        out = t if device is None or device.type == "cpu" else t.to(device)
        if isinstance(param, torch.nn.Parameter):
            return torch.nn.Parameter(out, requires_grad=param.requires_grad)
        return out

    return _Dest(meta, pieces, {0: t}, finish)


def _sharded_dest(meta: ArrayMeta, spec: Layout, ranks: list[int], devices: dict[int, torch.device]) -> _Dest:
    all_pieces = spec.rank_pieces(meta.shape)
    pieces = tuple(p if r in ranks else () for r, p in enumerate(all_pieces))
    locals_ = {r: torch.empty(spec.local_shape(r, meta.shape), dtype=meta.dtype.torch) for r in ranks}

    def finish() -> ShardedLeaf:
        shards = {r: t.to(devices[r]) if r in devices else t for r, t in locals_.items()}
        return ShardedLeaf(meta.shape, meta.dtype.torch, spec, shards)

    return _Dest(meta, pieces, dict(locals_), finish)


def _target_problem(key: str, stored: ArrayMeta, shape: tuple[int, ...], dtype_name: str) -> str | None:
    if stored.shape != shape:
        return f"leaf {_where(key)}: the checkpoint has shape {stored.shape}, the target has {shape}"
    if stored.dtype.name != dtype_name:
        return f"leaf {_where(key)}: the checkpoint has dtype {stored.dtype.name}, the target has {dtype_name}"
    return None


def load(
    path: PathLike,
    target: Any = None,
    *,
    namespace: str = "",
    executor: ExecutorOptions | None = None,
) -> Any:
    """Load a checkpoint, functionally: return a new tree.

    Args:
      path: a committed checkpoint.
      target: None to rebuild the stored tree with full tensors (numpy leaves come back
        as numpy arrays); or a tree whose structure the result takes, whose leaves say
        what to load: a tensor or numpy array (full, same shape and dtype, on the
        tensor's device), a :class:`ShardedLeaf` (its spec and ranks: resharding), an
        :class:`Abstract` (a full tensor, or every rank's shards of its spec), or a
        plain Python value (replaced by the stored value). Stored leaves the target
        lacks are not read.
      namespace: the optree namespace of custom pytree nodes.
      executor: concurrency of the I/O.

    Raises:
      NotCommittedError: ``path`` holds no committed checkpoint.
      TargetMismatchError: listing every target leaf that the checkpoint lacks or that
        differs in shape, dtype or kind.
      MetadataError: the metadata is malformed or unsafe.
    """
    storage, doc = _open(path, namespace, executor)
    stored_paths = doc.tree.paths()
    by_path: dict[tuple[KeyEntry, ...], ArrayMeta | ValueMeta] = dict(zip(stored_paths, doc.leaves, strict=True))
    if target is None:
        t_leaves: list[Any] = [None] * len(doc.leaves)
        t_paths = stored_paths
        structure: Node = doc.tree
    else:
        t_leaves, t_paths, structure = flatten(target, _is_leaf, namespace=namespace)
    problems: list[str] = []
    results: list[Any] = [None] * len(t_leaves)
    dests: list[tuple[int, _Dest]] = []
    for i, (leaf, p) in enumerate(zip(t_leaves, t_paths, strict=True)):
        key = keystr(p)
        stored = by_path.get(p)
        if stored is None:
            problems.append(f"leaf {_where(key)} of the target is not in the checkpoint")
            continue
        if target is None:
            if isinstance(stored, ValueMeta):
                results[i] = stored.value
            else:
                dests.append((i, _full_dest(stored, stored.container == "numpy", None, None)))
            continue
        if isinstance(leaf, PYTHON_LEAF_TYPES):
            if isinstance(stored, ValueMeta):
                results[i] = stored.value
            else:
                problems.append(
                    f"leaf {_where(key)}: the checkpoint has an array of shape {stored.shape} and dtype "
                    f"{stored.dtype.name}, the target has a {type(leaf).__name__}"
                )
            continue
        if isinstance(stored, ValueMeta):
            problems.append(
                f"leaf {_where(key)}: the checkpoint has the value {stored.value!r}, the target has an array"
            )
            continue
        problem, dest = _dest_for(key, stored, leaf)
        if problem is not None:
            problems.append(problem)
        elif dest is not None:
            dests.append((i, dest))
    if problems:
        raise TargetMismatchError(
            f"the target does not match the checkpoint at {os.fspath(path)}:\n  " + "\n  ".join(problems)
        )
    world = max((len(d.pieces) for _, d in dests), default=1)
    plan = plan_load(
        [(d.meta.key, d.meta.shape, d.meta.dtype.itemsize, d.meta.chunk_shape) for _, d in dests],
        [d.pieces for _, d in dests],
        world,
    )
    storage.read([d.meta for _, d in dests], plan.arrays, [d.get for _, d in dests], rank=None)
    for i, d in dests:
        results[i] = d.finish()
    return structure.unflatten(results)


def _dest_for(key: str, stored: ArrayMeta, leaf: Any) -> tuple[str | None, _Dest | None]:
    if isinstance(leaf, ShardedLeaf):
        problem = _target_problem(key, stored, leaf.shape, dtype_of_torch(leaf.dtype).name)
        devices = {r: t.device for r, t in leaf.shards.items()}
        return problem, None if problem else _sharded_dest(stored, leaf.spec, sorted(leaf.shards), devices)
    if isinstance(leaf, Abstract):
        problem = _target_problem(key, stored, leaf.shape, dtype_of_torch(leaf.dtype).name)
        if problem:
            return problem, None
        if leaf.spec is None:
            return None, _full_dest(stored, False, None, None)
        return None, _sharded_dest(stored, leaf.spec, list(range(leaf.spec.world_size)), {})
    if isinstance(leaf, torch.Tensor):
        if _is_dtensor(leaf):
            return f"leaf {_where(key)}: DTensor targets need the distributed load path", None
        problem = _target_problem(key, stored, tuple(leaf.shape), dtype_of_torch(leaf.dtype).name)
        return problem, None if problem else _full_dest(stored, False, leaf.device, leaf)
    arr = np.asarray(leaf)
    try:
        name = dtype_of_numpy(arr.dtype).name
    except ValueError as e:
        return f"leaf {_where(key)}: {e}", None
    problem = _target_problem(key, stored, tuple(arr.shape), name)
    return problem, None if problem else _full_dest(stored, True, None, None)
