"""Leaves pytreeckpt adds to a pytree: the sharded leaf and the abstract placeholder."""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ._dtypes import dtype_of_torch
from ._errors import LayoutError
from ._sharding import Layout, Piece

__all__ = ["Abstract", "ShardedLeaf", "piece_view"]


def piece_view(local: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The view of ``local`` (a rank's local tensor) holding ``piece``."""
    if piece.local_box is not None:
        return local[tuple(slice(o, o + s) for o, s in zip(piece.local_box, piece.region.shape, strict=True))]
    if piece.local_offset == 0 and tuple(local.shape) == piece.region.shape:
        return local
    flat = local.reshape(-1)
    return flat[piece.local_offset : piece.local_offset + piece.region.size].view(piece.region.shape)


def check_placement(placement: Sequence[int] | None, spec: Layout) -> range | tuple[int, ...] | None:
    """``placement`` as distinct non-negative ranks, one per position of ``spec`` (a range stays a range,
    other sequences become tuples); None, or the identity, is None."""
    if placement is None:
        return None
    if isinstance(placement, range):  # a pipeline stage's contiguous ranks: checked without a loop
        if len(placement) != spec.world_size:
            raise LayoutError(
                f"the spec has {spec.world_size} positions but the placement gives {len(placement)} ranks"
            )
        if len(placement) and (min(placement[0], placement[-1]) < 0 or placement.step == 0):
            raise LayoutError(f"a placement's ranks must be distinct and non-negative, found {placement}")
        return None if placement == range(len(placement)) else placement
    try:
        ranks = tuple(operator.index(r) for r in placement)
    except TypeError:
        raise LayoutError(f"a placement is a sequence of integer ranks, found {placement!r}") from None
    if len(ranks) != spec.world_size:
        raise LayoutError(f"the spec has {spec.world_size} positions but the placement gives {len(ranks)} ranks")
    if min(ranks, default=0) < 0 or len(set(ranks)) != len(ranks):
        raise LayoutError(f"a placement's ranks must be distinct and non-negative, found {list(ranks)[:16]}")
    return None if ranks == tuple(range(len(ranks))) else ranks


def _as_dtype(dtype: Any) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)  # type: ignore[no-any-return]
    raise TypeError(f"expected a torch dtype, found {dtype!r}")


class ShardedLeaf:
    """A tensor sharded over ranks, described by a spec, holding the shards of some ranks.

    Like a DTensor, it has a global shape and dtype; unlike one, it needs no process
    group: one process may hold the shards of every rank (as :meth:`from_global` makes),
    which is how single-process code and tests reshard.

    >>> from pytreeckpt import Mesh, Shard, ShardingSpec
    >>> leaf = ShardedLeaf.from_global(torch.arange(6.0), ShardingSpec(Mesh(2), [Shard(0)]))
    >>> leaf.shards[1]
    tensor([3., 4., 5.])
    >>> leaf.to_global()
    tensor([0., 1., 2., 3., 4., 5.])
    """

    __slots__ = ("_dtype", "_placement", "_shape", "_shards", "_spec")

    def __init__(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        spec: Layout,
        shards: Mapping[int, torch.Tensor],
        placement: Sequence[int] | None = None,
    ) -> None:
        self._shape = tuple(int(s) for s in shape)
        self._dtype = _as_dtype(dtype)
        dtype_of_torch(self._dtype)
        if not isinstance(spec, Layout):
            raise LayoutError(f"spec must be a ShardingSpec, FlatRanges or ExplicitRegions, found {spec!r}")
        self._spec = spec
        spec.check(self._shape)
        self._placement = check_placement(placement, spec)
        checked = {}
        for rank, t in shards.items():
            if not 0 <= rank < spec.world_size:
                raise LayoutError(f"shard for rank {rank}, but the spec has {spec.world_size} ranks")
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"rank {rank}: a shard must be a torch.Tensor, found {type(t).__name__}")
            want = spec.local_shape(rank, self._shape)
            if tuple(t.shape) != want:
                raise LayoutError(f"rank {rank}: local shard has shape {tuple(t.shape)}, the spec expects {want}")
            if t.dtype != self._dtype:
                raise LayoutError(f"rank {rank}: local shard has dtype {t.dtype}, expected {self._dtype}")
            checked[int(rank)] = t
        self._shards = MappingProxyType(dict(sorted(checked.items())))

    @classmethod
    def from_global(
        cls,
        tensor: torch.Tensor,
        spec: Layout,
        ranks: Iterable[int] | None = None,
        placement: Sequence[int] | None = None,
    ) -> ShardedLeaf:
        """Cut a global tensor into the shards of ``ranks`` (spec positions; every one by default), as copies."""
        shape = tuple(tensor.shape)
        pieces = spec.rank_pieces(shape)
        shards = {}
        for rank in range(spec.world_size) if ranks is None else ranks:
            local = torch.empty(spec.local_shape(rank, shape), dtype=tensor.dtype, device=tensor.device)
            for piece in pieces[rank]:
                piece_view(local, piece).copy_(tensor[piece.region.slices()])
            shards[rank] = local
        return cls(shape, tensor.dtype, spec, shards, placement)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def spec(self) -> Layout:
        return self._spec

    @property
    def shards(self) -> Mapping[int, torch.Tensor]:
        """Local tensors by rank (the spec's position), for the ranks present here."""
        return self._shards

    @property
    def placement(self) -> range | tuple[int, ...] | None:
        """The global rank of each of the spec's positions (None: position ``p`` is rank ``p``).

        A layout over some ranks of a job, as a pipeline stage's arrays on its stage's
        ranks: ``ShardedLeaf(shape, dtype, ShardingSpec(Mesh((2, 4)), ...), shards,
        placement=range(8, 16))`` sits on ranks 8 to 15 of the job, its shards keyed by
        position (0 to 7) all the same.
        """
        return self._placement

    @property
    def numel(self) -> int:
        return math.prod(self._shape)

    def to_global(self) -> torch.Tensor:
        """Assemble the global tensor from the shards present; every element must be held."""
        device = next(iter(self._shards.values())).device if self._shards else torch.device("cpu")
        out = torch.empty(self._shape, dtype=self._dtype, device=device)
        covered = torch.zeros(self._shape, dtype=torch.bool)
        pieces = self._spec.rank_pieces(self._shape)
        for rank, local in self._shards.items():
            for piece in pieces[rank]:
                sl = piece.region.slices()
                out[sl] = piece_view(local, piece)
                covered[sl] = True
        if not bool(covered.all()):
            missing = int((~covered).sum())
            raise LayoutError(
                f"cannot assemble a tensor of shape {self._shape}: {missing} elements are held by none of ranks "
                f"{list(self._shards)}"
            )
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardedLeaf):
            return NotImplemented
        return (
            self._shape == other._shape
            and self._dtype == other._dtype
            and self._spec == other._spec
            and self._placement == other._placement
            and self._shards.keys() == other._shards.keys()
            and all(torch.equal(self._shards[r], other._shards[r]) for r in self._shards)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ShardedLeaf(shape={self._shape}, dtype={self._dtype}, spec={self._spec!r}, ranks={list(self._shards)})"


@dataclass(frozen=True, slots=True, init=False)
class Abstract:
    """A placeholder leaf with a shape, a dtype and optionally a spec, like ``jax.ShapeDtypeStruct``.

    As a load target it asks for a full tensor (``spec=None``) or a :class:`ShardedLeaf`
    in ``spec``'s layout, holding every rank's shards. ``placement`` puts the spec's
    positions on global ranks (see :attr:`ShardedLeaf.placement`). Given to
    :func:`pytreeckpt.plan_save`, it is planned as a tensor of that layout whose data is
    never read.

    >>> Abstract((2, 3), torch.float32)
    Abstract(shape=(2, 3), dtype=torch.float32, spec=None, placement=None)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: Layout | None
    placement: range | tuple[int, ...] | None

    def __init__(
        self,
        shape: Sequence[int],
        dtype: torch.dtype | str,
        spec: Layout | None = None,
        placement: Sequence[int] | None = None,
    ) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in shape))
        object.__setattr__(self, "dtype", _as_dtype(dtype))
        if spec is not None and not isinstance(spec, Layout):
            raise LayoutError(f"spec must be a ShardingSpec, FlatRanges, ExplicitRegions or None, found {spec!r}")
        object.__setattr__(self, "spec", spec)
        # (whether the spec fits the shape is checked where the leaf is used, load or plan_save, naming it)
        if spec is None and placement is not None:
            raise LayoutError("a placement places a spec's positions on ranks: give a spec with it")
        object.__setattr__(self, "placement", None if spec is None else check_placement(placement, spec))

    @classmethod
    def like(cls, x: torch.Tensor | ShardedLeaf, spec: Layout | None = None) -> Abstract:
        """The placeholder of a tensor or sharded leaf (keeping its spec unless one is given)."""
        if isinstance(x, ShardedLeaf):
            if spec is not None:
                return cls(x.shape, x.dtype, spec)
            return cls(x.shape, x.dtype, x.spec, x.placement)
        return cls(tuple(x.shape), x.dtype, spec)
