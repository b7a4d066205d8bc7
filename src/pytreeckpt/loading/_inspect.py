"""What a checkpoint holds, read from its metadata; every chunk checked; a box of one array read.

The read-only calls' stages: ``metadata`` (:func:`inspect`), ``verify``
(:func:`verify_once`), ``load_slice`` and ``read_array`` (:func:`read_region`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pytreeckpt.core._errors import CheckpointError, MetadataError, TargetMismatchError, where
from pytreeckpt.core._keys import KeyEntry, keystr, typed_keystr
from pytreeckpt.core._region import Region
from pytreeckpt.format import ArrayMeta, CheckpointDoc
from pytreeckpt.storage import ExecutorOptions, Storage
from pytreeckpt.storage._location import Where, describe

from ._open import again_if_replaced, check_memory, open_checkpoint, replaced
from ._per_rank import per_rank_sites

if TYPE_CHECKING:  # (the leaf kinds, the plan and the executor imported where used: metadata and verify need none)
    import numpy as np
    import torch

__all__ = [
    "Arrays",
    "CheckpointMetadata",
    "VerifyReport",
    "inspect",
    "read_region",
    "region_of",
    "verify_checkpoint",
    "verify_once",
]

PathLike = Where


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """What a checkpoint holds, read from its metadata alone.

    Attributes:
      tree: the stored tree, with an :class:`Abstract` for every tensor leaf (numpy
        leaves too) and plain Python leaves' values; usable as a load target.
      arrays: the stored arrays by key path: dtype, shape, chunk grid, saved layout.
      user_metadata: the JSON object given at save time.
      version: the format version.
      per_rank: the key path of each per-rank part (saved under a ``PER_RANK`` spec) and how
        many ranks saved it; ``tree`` holds a :class:`PerRank` there, and rank ``r``'s
        leaves are keyed ``<part>.rank<r>...``.
    """

    tree: Any
    arrays: Mapping[str, ArrayMeta]
    user_metadata: dict[str, Any] = field(default_factory=dict)
    version: int = 1
    per_rank: Mapping[str, int] = field(default_factory=dict)

    def saved_by(self, key: str) -> tuple[int, int] | None:
        """The rank that saved leaf ``key`` of a per-rank part and how many ranks saved the part; None for a
        leaf of no per-rank part."""
        for part, world in self.per_rank.items():
            prefix = f"{part}.rank" if part else "rank"
            if key.startswith(prefix):
                rank, _, _ = key[len(prefix) :].partition(".")
                if rank.isdigit() and int(rank) < world:
                    return int(rank), world
        return None

    @property
    def nbytes(self) -> int:
        if isinstance(self.arrays, Arrays):
            return self.arrays.nbytes
        return sum(a.nbytes for a in self.arrays.values())


class Arrays(Mapping[str, ArrayMeta]):
    """The stored arrays by key path; a key path two leaves share raises instead of naming one of them."""

    def __init__(self, path: PathLike, doc: CheckpointDoc) -> None:
        self._where = describe(path)
        self._ambiguous = ambiguous_keys(doc)
        self._metas = {leaf.key: leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)}
        self._all = tuple(leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta))

    def __getitem__(self, key: str) -> ArrayMeta:
        if key in self._ambiguous:
            raise ambiguity_error(key, self._ambiguous[key], self._where)
        return self._metas[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._metas)

    def __len__(self) -> int:
        return len(self._metas)

    def __repr__(self) -> str:
        many = self._ambiguous
        return repr({k: f"<{len(many[k])} leaves>" if k in many else v for k, v in self._metas.items()})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._all)


def ambiguous_keys(doc: CheckpointDoc) -> dict[str, list[tuple[KeyEntry, ...]]]:
    """Key paths that name several leaves (documents of older versions), with their typed paths."""
    by_key: dict[str, list[tuple[KeyEntry, ...]]] = {}
    for p, leaf in zip(doc.tree.paths(), doc.leaves, strict=True):
        by_key.setdefault(leaf.key, []).append(p)
    return {k: ps for k, ps in by_key.items() if len(ps) > 1}


def ambiguity_error(key: str, paths: Sequence[tuple[KeyEntry, ...]], where: str) -> MetadataError:
    return MetadataError(
        f"key path {key!r} names {len(paths)} leaves of the checkpoint at {where} "
        f"({' and '.join(typed_keystr(p) for p in paths)}; it was written by an older pytreeckpt, which allowed "
        f"that): load it whole, with load(path) or a target tree, which tells them apart"
    )


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What :func:`verify` found.

    Attributes:
      path: the checkpoint.
      problems: ``(key path, chunk index or None for the whole array, message)`` for
        every damaged array or chunk.
      arrays: arrays checked.
      chunks: chunks read.
      nbytes: bytes read.
      unrecorded: arrays whose metadata records no chunk checksums (checkpoints written
        before it did): each chunk's own checksum was checked, not that it is the chunk
        the metadata describes.
      unreadable: ``(key path, chunk index or None, message)`` for every array directory
        or chunk this process may not read (permission denied): not checked, and not
        damage either; ``ok`` is False while any remain.
    """

    path: str
    problems: tuple[tuple[str, tuple[int, ...] | None, str], ...]
    arrays: int
    chunks: int
    nbytes: int
    unrecorded: tuple[str, ...] = ()
    unreadable: tuple[tuple[str, tuple[int, ...] | None, str], ...] = ()

    @property
    def ok(self) -> bool:
        """Every chunk was read and found as the metadata describes it."""
        return not self.problems and not self.unreadable

    @property
    def damaged_leaves(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(key for key, _, _ in self.problems))


def inspect(path: PathLike, namespace: str, *, tree: bool = True) -> CheckpointMetadata:
    """The stored tree (a placeholder for each array, from its kind), its arrays, user metadata and version.

    ``tree=False`` leaves the tree out (``None``): what the command line shows needs no leaf kinds, nor torch.
    """
    _, doc = open_checkpoint(path, namespace, None)
    parts = {keystr(p): len(node.children) for p, node in per_rank_sites(doc.tree)}
    if not tree:
        return CheckpointMetadata(None, Arrays(path, doc), doc.user_metadata, doc.version, parts)
    from pytreeckpt.leaves import KINDS

    leaves = [KINDS.stored(leaf).abstract(leaf) for leaf in doc.leaves]
    return CheckpointMetadata(doc.tree.unflatten(leaves), Arrays(path, doc), doc.user_metadata, doc.version, parts)


def verify_checkpoint(path: PathLike, executor: ExecutorOptions | None) -> VerifyReport:
    """:func:`~pytreeckpt.verify`: every chunk read and checked, again if the checkpoint is replaced meanwhile."""
    return again_if_replaced(path, executor, "verified", lambda seen: verify_once(path, executor, seen))


def verify_once(path: PathLike, executor: ExecutorOptions | None, seen: list[bytes]) -> VerifyReport:
    """One reading of every chunk (the checkpoint's document appended to ``seen``)."""
    storage, doc = open_checkpoint(path, "", executor, seen)
    metas = [leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)]
    problems, unreadable, chunks, nbytes = storage.verify(metas)
    if problems and replaced(storage, seen[0]):  # (its arrays deleted by the new commit: not damage)
        raise CheckpointError(f"{describe(path)} was replaced while it was verified: {problems[0][2]}")
    unrecorded = tuple(m.key for m in metas if not m.records_crc32c)
    return VerifyReport(
        describe(path), tuple(problems), len(metas), chunks, nbytes, unrecorded, unreadable=tuple(unreadable)
    )


def read_region(storage: Storage, path: PathLike, meta: ArrayMeta, region: Region | None) -> torch.Tensor:
    """:func:`read_array` on ``storage`` (the location ``path``)."""
    from pytreeckpt.core._dtypes import numpy_view
    from pytreeckpt.core._sharding import ExplicitRegions
    from pytreeckpt.execute._executor import read_arrays
    from pytreeckpt.execute._memory import AllocationFailed, Prefault
    from pytreeckpt.leaves import Buffers
    from pytreeckpt.plan import ArraySpec, plan_load

    storage.check_stored_sizes([meta])
    region = Region.full(meta.shape) if region is None else region
    check_memory(path, [(meta.key, region.size * meta.dtype.itemsize)])
    buffers = Buffers(huge=storage.options.huge_pages)
    try:
        out = buffers.tensor(region.shape, meta.dtype.torch, pinned=False)
    except AllocationFailed as e:
        raise CheckpointError(f"leaf {meta.key!r}: {e}") from e

    def get(rank: int, pi: int) -> tuple[np.ndarray, Region]:
        return numpy_view(out), region

    plan = plan_load(
        [meta.chunk_shape], [ArraySpec(meta.key, meta.shape, meta.dtype.itemsize, ExplicitRegions([[region]]))], 1
    )
    with Prefault(buffers.fresh):
        read_arrays(storage, [meta], plan.arrays, [get], rank=None)
    return out


def region_of(index: Any, shape: tuple[int, ...], key: str) -> Region:
    """A box from an index of ints and step-1 slices (missing trailing dims are whole)."""
    items = index if isinstance(index, tuple) else (index,)
    if len(items) > len(shape):
        raise TargetMismatchError(f"leaf {where(key)}: index {index!r} has more dims than shape {shape}")
    offset, extent = [], []
    for d, n in enumerate(shape):
        it = items[d] if d < len(items) else slice(None)
        if isinstance(it, int) and not isinstance(it, bool):
            i = it + n if it < 0 else it
            if not 0 <= i < n:
                raise TargetMismatchError(f"leaf {where(key)}: index {it} is out of range for dim {d} of size {n}")
            offset.append(i)
            extent.append(1)
        elif isinstance(it, slice) and it.step in (None, 1):
            lo, hi, _ = it.indices(n)
            offset.append(lo)
            extent.append(max(0, hi - lo))
        else:
            raise TargetMismatchError(f"leaf {where(key)}: only ints and step-1 slices select a box, found {it!r}")
    return Region(tuple(offset), tuple(extent))
