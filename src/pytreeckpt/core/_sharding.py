"""Declarative sharding specs and the pure function from a spec to each rank's regions.

A spec says how a tensor of some global shape is laid out over ranks. Every spec
answers one question, :meth:`Layout.rank_pieces`: for each rank, which boxes of the
global tensor it holds and where they sit in its local tensor. Nothing here does I/O or
talks to other ranks.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._errors import LayoutError
from ._region import Region

__all__ = [
    "ExplicitRegions",
    "FlatRanges",
    "Layout",
    "Mesh",
    "Piece",
    "Placement",
    "Replicate",
    "Shard",
    "ShardingSpec",
    "StridedShard",
    "chunk_size_and_offset",
    "flat_range_regions",
    "layout_from_json",
]


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """A logical grid of ranks: rank ``r`` sits at the row-major coordinate of ``r``.

    >>> mesh = Mesh((2, 3), ("dp", "tp"))
    >>> mesh.coordinate(4)
    (1, 1)
    >>> mesh.size
    6
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    _hash: int = field(init=False, repr=False, compare=False)  # (hashed once: specs key the plan caches)
    _size: int = field(init=False, repr=False, compare=False)

    def __init__(self, shape: Sequence[int] | int, axis_names: Sequence[str] | None = None) -> None:
        shape_t = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if not shape_t or any(s < 1 for s in shape_t):
            raise LayoutError(f"a mesh needs one or more axes of size >= 1, found shape {shape_t}")
        names = tuple(f"axis{i}" for i in range(len(shape_t))) if axis_names is None else tuple(axis_names)
        if len(names) != len(shape_t):
            raise LayoutError(f"mesh shape {shape_t} has {len(shape_t)} axes but {len(names)} axis names {names}")
        if len(set(names)) != len(names):
            raise LayoutError(f"mesh axis names must be distinct, found {names}")
        object.__setattr__(self, "shape", shape_t)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "_hash", hash((shape_t, names)))
        object.__setattr__(self, "_size", math.prod(shape_t))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:  # (made anew where unpickled: a str's hash differs between processes)
        return (Mesh, (self.shape, self.axis_names))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return self._size

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """The mesh coordinate of ``rank``."""
        if not 0 <= rank < self.size:
            raise LayoutError(f"rank {rank} is outside a mesh of {self.size} ranks")
        coord = []
        for s in reversed(self.shape):
            rank, c = divmod(rank, s)
            coord.append(c)
        return tuple(reversed(coord))

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names)}

    @classmethod
    def from_json(cls, data: Any) -> Mesh:
        return cls(tuple(data["shape"]), tuple(data["axis_names"]))


@dataclass(frozen=True, slots=True)
class Shard:
    """Split tensor dimension ``dim`` over a mesh axis, with torch's chunking rule."""

    dim: int

    def to_json(self) -> list[Any]:
        return ["shard", self.dim]


@dataclass(frozen=True, slots=True)
class StridedShard:
    """Split dimension ``dim`` right to left, as torch's ``_StridedShard`` (FSDP2 with TP).

    The dimension is first cut into ``split_factor`` parts (the shards a later mesh axis
    makes), each part is cut over this mesh axis, and a rank holds its cut of every part:
    with 8 rows, 4 ranks and ``split_factor=2``, rank 0 holds rows 0 and 4.
    """

    dim: int
    split_factor: int

    def to_json(self) -> list[Any]:
        return ["strided", self.dim, self.split_factor]


@dataclass(frozen=True, slots=True)
class Replicate:
    """Every rank along the mesh axis holds the same data."""

    def to_json(self) -> list[Any]:
        return ["replicate"]


Placement = Shard | StridedShard | Replicate


def _placement_from_json(data: Any) -> Placement:
    if data == ["replicate"]:
        return Replicate()
    if isinstance(data, list) and len(data) == 2 and data[0] == "shard" and type(data[1]) is int:
        return Shard(data[1])
    if (
        isinstance(data, list)
        and len(data) == 3
        and data[0] == "strided"
        and type(data[1]) is int
        and type(data[2]) is int
        and data[2] >= 1
    ):
        return StridedShard(data[1], data[2])
    raise LayoutError(f"unknown placement {data!r}")


@dataclass(frozen=True, slots=True)
class Piece:
    """A box of the global tensor held by one rank, and where it sits in the rank's local tensor.

    With ``local_box`` None, the box starts at ``local_offset`` in the local tensor
    flattened in row-major order (a rank holding one box has ``local_offset == 0`` and a
    local tensor of the box's shape). Otherwise the box sits at offset ``local_box`` of
    the local tensor, which has the same number of dims (a rank of a strided layout
    holding several boxes along a dimension).
    """

    region: Region
    local_offset: int = 0
    local_box: tuple[int, ...] | None = None


def chunk_size_and_offset(size: int, parts: int, index: int) -> tuple[int, int]:
    """Size and offset of part ``index`` when ``size`` is split like ``torch.chunk``.

    Parts hold ``ceil(size / parts)`` elements; trailing parts are smaller or empty.

    >>> [chunk_size_and_offset(10, 4, i) for i in range(4)]
    [(3, 0), (3, 3), (3, 6), (1, 9)]
    """
    full = -(-size // parts)
    start = full * index
    if start >= size:
        return 0, size
    return min(full, size - start), start


class Layout(abc.ABC):
    """Base of every spec: how a tensor of a given global shape sits on ranks."""

    kind: ClassVar[str]

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """The number of ranks (positions) the layout places pieces on."""

    @abc.abstractmethod
    def rank_pieces(self, shape: Sequence[int]) -> tuple[tuple[Piece, ...], ...]:
        """For each rank, the non-empty boxes it holds, in local order."""

    def pieces_of(self, rank: int, shape: Sequence[int]) -> tuple[Piece, ...]:
        """The non-empty boxes ``rank`` holds, in local order: ``rank_pieces(shape)[rank]``, for one rank."""
        return self.rank_pieces(shape)[rank]

    def check(self, shape: Sequence[int]) -> None:
        """Raise a LayoutError unless this layout can lay out a tensor of ``shape``."""
        self.rank_pieces(shape)

    @abc.abstractmethod
    def local_shape(self, rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        """Shape of ``rank``'s local tensor for a global tensor of ``shape``."""

    @abc.abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The layout as JSON, as the metadata records it."""


@dataclass(frozen=True, slots=True, init=False)
class ShardingSpec(Layout):
    """A mesh and one placement per mesh axis, as in DTensor.

    Several mesh axes may shard the same dimension: they split it in mesh-axis order,
    each splitting what the previous left, as torch does.

    >>> spec = ShardingSpec(Mesh((2, 2)), (Shard(0), Replicate()))
    >>> [p[0].region for p in spec.rank_pieces((5, 3))][1:3]
    [Region(offset=(0, 0), shape=(3, 3)), Region(offset=(3, 0), shape=(2, 3))]
    """

    kind: ClassVar[str] = "mesh"
    mesh: Mesh
    placements: tuple[Placement, ...]
    _hash: int = field(init=False, repr=False, compare=False)  # (hashed once: specs key the plan caches)
    # What equality compares, as plain values: equal specs met as distinct objects (each save's
    # new DTensors, a job's specs made anew) are compared in C, not a dataclass __eq__ per field.
    _key: tuple[Any, ...] = field(init=False, repr=False, compare=False)

    def __init__(self, mesh: Mesh, placements: Sequence[Placement] | Placement) -> None:
        # What depends on the tensor (the number of placements, their dims) is checked when
        # the spec meets a shape, where save and load name the leaf.
        placements = (placements,) if isinstance(placements, Shard | StridedShard | Replicate) else tuple(placements)
        for p in placements:
            if not isinstance(p, Shard | StridedShard | Replicate):
                raise LayoutError(
                    f"placements are Shard(dim), StridedShard(dim, split_factor) or Replicate(), found {p!r}"
                )
            if isinstance(p, StridedShard) and p.split_factor < 1:
                raise LayoutError(f"StridedShard split_factor must be >= 1, found {p!r}")
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "placements", placements)
        object.__setattr__(self, "_hash", hash((mesh, placements)))
        fields = [(type(p), *(getattr(p, f.name) for f in dataclasses.fields(p))) for p in placements]
        object.__setattr__(self, "_key", (type(mesh), mesh.shape, mesh.axis_names, *fields))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._key == other._key  # type: ignore[attr-defined, no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:  # (made anew where unpickled: a str's hash differs between processes)
        return (ShardingSpec, (self.mesh, self.placements))

    @property
    def world_size(self) -> int:
        return self.mesh.size

    def check(self, shape: Sequence[int]) -> None:
        self._check(shape)  # (without every rank's pieces: a mesh of 16,384 ranks is checked at once)

    def _check(self, shape: Sequence[int]) -> None:
        """Raise a LayoutError if this spec cannot lay out a tensor of ``shape``."""
        if len(self.placements) != self.mesh.ndim:
            raise LayoutError(
                f"a mesh of {self.mesh.ndim} axes {self.mesh.axis_names} needs {self.mesh.ndim} placements (one "
                f"per axis; Replicate() for an axis that does not split the tensor), found {self.placements}"
            )
        for axis, p in enumerate(self.placements):
            if isinstance(p, Shard | StridedShard) and p.dim < 0:
                same = dataclasses.replace(p, dim=p.dim + len(shape))
                fix = f"; for a tensor of shape {tuple(shape)} that is {same!r}" if same.dim >= 0 else ""
                raise LayoutError(
                    f"{p!r} on mesh axis {self.mesh.axis_names[axis]!r}: a spec counts dims from 0 (negative dims, "
                    f"which DTensor counts from the end, are not taken){fix}"
                )
            if isinstance(p, Shard | StridedShard) and p.dim >= len(shape):
                raise LayoutError(
                    f"Shard({p.dim}) on mesh axis {self.mesh.axis_names[axis]!r} needs a tensor of more than "
                    f"{p.dim} dims, found shape {tuple(shape)}"
                )

    def intervals(self, rank: int, shape: Sequence[int]) -> list[list[tuple[int, int]]]:
        """Per dim, the ``(start, length)`` runs of global indices ``rank`` holds, in local order.

        Placements apply in mesh-axis order, each to what the previous ones left, as
        torch computes a DTensor's local shard.
        """
        return [list(rs) for rs in _spec_intervals(self, rank, tuple(shape))]

    def region(self, rank: int, shape: Sequence[int]) -> Region:
        """The one box of the global tensor that ``rank`` holds.

        Raises:
          LayoutError: with strided placements a rank may hold several boxes; use
            :meth:`rank_pieces`.
        """
        runs = _spec_intervals(self, rank, tuple(shape))
        offset, extent = [], []
        for d, r in enumerate(runs):
            if len(r) > 1:
                raise LayoutError(f"rank {rank} holds {len(r)} separate runs of dim {d}; use rank_pieces")
            offset.append(r[0][0] if r else 0)
            extent.append(r[0][1] if r else 0)
        return Region(tuple(offset), tuple(extent))

    def rank_pieces(self, shape: Sequence[int]) -> tuple[tuple[Piece, ...], ...]:
        return tuple(self.pieces_of(r, shape) for r in range(self.world_size))

    def pieces_of(self, rank: int, shape: Sequence[int]) -> tuple[Piece, ...]:
        return _spec_pieces(self, rank, tuple(shape))

    def local_shape(self, rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        return _spec_local_shape(self, rank, tuple(shape))

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "mesh": self.mesh.to_json(), "placements": [p.to_json() for p in self.placements]}


@functools.lru_cache(maxsize=8192)
def _spec_pieces(spec: ShardingSpec, rank: int, shape: tuple[int, ...]) -> tuple[Piece, ...]:
    """:meth:`ShardingSpec.pieces_of`, once per (spec, rank, shape) (pieces are immutable)."""
    if all(type(p) is Replicate for p in spec.placements) and 0 <= rank < spec.world_size:
        return (Piece(Region.full(shape), 0),)  # every rank holds the whole array (checked as below)
    runs = _spec_intervals(spec, rank, tuple(shape))
    if any(not rs for rs in runs):
        return ()
    if all(len(rs) == 1 for rs in runs):
        return (Piece(Region(tuple(rs[0][0] for rs in runs), tuple(rs[0][1] for rs in runs)), 0),)
    local_starts = []
    for rs in runs:
        starts, pos = [], 0
        for _, length in rs:
            starts.append(pos)
            pos += length
        local_starts.append(starts)
    pieces = []
    for combo in _index_product([len(rs) for rs in runs]):
        region = Region(
            tuple(runs[d][k][0] for d, k in enumerate(combo)), tuple(runs[d][k][1] for d, k in enumerate(combo))
        )
        pieces.append(Piece(region, 0, tuple(local_starts[d][k] for d, k in enumerate(combo))))
    return tuple(pieces)


@functools.lru_cache(maxsize=8192)
def _spec_local_shape(spec: ShardingSpec, rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """:meth:`ShardingSpec.local_shape`, once per (spec, rank, shape)."""
    return tuple(sum(length for _, length in rs) for rs in _spec_intervals(spec, rank, shape))


@functools.lru_cache(maxsize=8192)
def _spec_intervals(spec: ShardingSpec, rank: int, shape: tuple[int, ...]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """:meth:`ShardingSpec.intervals`, once per (spec, rank, shape): the layers of a model share
    their specs and shapes, so a rank describes each combination once."""
    spec._check(shape)
    coord = spec.mesh.coordinate(rank)
    runs = [[(0, int(s))] for s in shape]
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Replicate):
            continue
        n, c = spec.mesh.shape[axis], coord[axis]
        local = sum(length for _, length in runs[p.dim])
        if isinstance(p, StridedShard):
            taken: list[tuple[int, int]] = []
            for j in range(p.split_factor):
                part_size, part_off = chunk_size_and_offset(local, p.split_factor, j)
                size, off = chunk_size_and_offset(part_size, n, c)
                taken.extend(_take(runs[p.dim], part_off + off, size))
            runs[p.dim] = _merge_runs(taken)
        else:
            size, off = chunk_size_and_offset(local, n, c)
            runs[p.dim] = _take(runs[p.dim], off, size)
    return tuple(tuple(r) for r in runs)


def _take(runs: Sequence[tuple[int, int]], offset: int, size: int) -> list[tuple[int, int]]:
    """Positions ``[offset, offset + size)`` of the concatenation of ``runs``, as runs."""
    out: list[tuple[int, int]] = []
    pos = 0
    end = offset + size
    for start, length in runs:
        lo, hi = max(offset, pos), min(end, pos + length)
        if lo < hi:
            out.append((start + lo - pos, hi - lo))
        pos += length
    return out


def _merge_runs(runs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, length in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((start, length))
    return out


def _index_product(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in sizes:
        out = [(*t, k) for t in out for k in range(n)]
    return out


def flat_range_regions(shape: Sequence[int], start: int, stop: int) -> list[Region]:
    """Boxes covering the elements ``[start, stop)`` of a row-major tensor, in order.

    Each box is contiguous in row-major order, so the range is their concatenation.

    >>> flat_range_regions((3, 4), 2, 9)
    [Region(offset=(0, 2), shape=(1, 2)), Region(offset=(1, 0), shape=(1, 4)), Region(offset=(2, 0), shape=(1, 1))]
    """
    shape = tuple(int(s) for s in shape)
    if start >= stop:
        return []
    if not shape:
        return [Region((), ())]
    if len(shape) == 1:
        return [Region((start,), (stop - start,))]
    inner = math.prod(shape[1:])
    r0, r1 = start // inner, stop // inner
    if r0 == r1:
        return [_prefix(r0, s) for s in flat_range_regions(shape[1:], start - r0 * inner, stop - r0 * inner)]
    out: list[Region] = []
    if start % inner:
        out.extend(_prefix(r0, s) for s in flat_range_regions(shape[1:], start % inner, inner))
        r0 += 1
    if r1 > r0:
        out.append(Region((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])))
    if stop % inner:
        out.extend(_prefix(r1, s) for s in flat_range_regions(shape[1:], 0, stop % inner))
    return out


def _prefix(row: int, region: Region) -> Region:
    return Region((row, *region.offset), (1, *region.shape))


def _pieces_in_order(regions: Sequence[Region]) -> tuple[Piece, ...]:
    pieces, offset = [], 0
    for reg in regions:
        if not reg.is_empty:
            pieces.append(Piece(reg, offset))
        offset += reg.size
    return tuple(pieces)


@dataclass(frozen=True, slots=True, init=False)
class FlatRanges(Layout):
    """Irregular sharding by flat ranges of the row-major tensor, as FSDP1 flat parameters.

    Rank ``r`` holds elements ``[start, stop)`` of the flattened tensor as a 1-D local
    tensor. Ranges may overlap (replication) and, for a load target, leave gaps.

    >>> spec = FlatRanges([(0, 5), (5, 12)])
    >>> spec.local_shape(1, (3, 4))
    (7,)
    """

    kind: ClassVar[str] = "flat"
    ranges: tuple[tuple[int, int], ...]

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        rs = tuple((int(a), int(b)) for a, b in ranges)
        if not rs:
            raise LayoutError("FlatRanges needs one range per rank, found none")
        for r, (a, b) in enumerate(rs):
            if a < 0 or b < a:
                raise LayoutError(f"rank {r}: flat range [{a}, {b}) is not 0 <= start <= stop")
        object.__setattr__(self, "ranges", rs)

    @property
    def world_size(self) -> int:
        return len(self.ranges)

    def _check(self, shape: Sequence[int]) -> None:
        numel = math.prod(shape)
        for r, (_, b) in enumerate(self.ranges):
            if b > numel:
                raise LayoutError(
                    f"rank {r}: flat range ends at {b} but a tensor of shape {tuple(shape)} has {numel} elements"
                )

    def rank_pieces(self, shape: Sequence[int]) -> tuple[tuple[Piece, ...], ...]:
        self._check(shape)
        return tuple(_pieces_in_order(flat_range_regions(shape, a, b)) for a, b in self.ranges)

    def pieces_of(self, rank: int, shape: Sequence[int]) -> tuple[Piece, ...]:
        self._check(shape)
        a, b = self.ranges[rank]
        return _pieces_in_order(flat_range_regions(shape, a, b))

    def local_shape(self, rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        a, b = self.ranges[rank]
        return (b - a,)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranges": [list(r) for r in self.ranges]}


@dataclass(frozen=True, slots=True, init=False)
class ExplicitRegions(Layout):
    """Irregular sharding by explicit boxes per rank.

    A rank holding one box has a local tensor of that box's shape; a rank holding
    several has a 1-D local tensor, the row-major concatenation of its boxes.

    >>> spec = ExplicitRegions([[((0, 0), (2, 3))], [((2, 0), (1, 3))]])
    >>> spec.local_shape(0, (3, 3))
    (2, 3)
    """

    kind: ClassVar[str] = "regions"
    regions: tuple[tuple[Region, ...], ...]

    def __init__(self, regions: Sequence[Sequence[Region | tuple[Sequence[int], Sequence[int]]]]) -> None:
        out = []
        for per_rank in regions:
            out.append(
                tuple(
                    r if isinstance(r, Region) else Region(tuple(int(v) for v in r[0]), tuple(int(v) for v in r[1]))
                    for r in per_rank
                )
            )
        if not out:
            raise LayoutError("ExplicitRegions needs a list of boxes per rank, found no ranks")
        object.__setattr__(self, "regions", tuple(out))

    @property
    def world_size(self) -> int:
        return len(self.regions)

    def _check(self, shape: Sequence[int]) -> None:
        full = Region.full(shape)
        for r, regs in enumerate(self.regions):
            for reg in regs:
                if reg.ndim != len(shape) or not full.contains(reg):
                    raise LayoutError(f"rank {r}: box {reg} does not lie inside a tensor of shape {tuple(shape)}")

    def rank_pieces(self, shape: Sequence[int]) -> tuple[tuple[Piece, ...], ...]:
        self._check(shape)
        out: list[tuple[Piece, ...]] = []
        for regs in self.regions:
            if len(regs) == 1:
                out.append(() if regs[0].is_empty else (Piece(regs[0], 0),))
            else:
                out.append(_pieces_in_order(regs))
        return tuple(out)

    def local_shape(self, rank: int, shape: Sequence[int]) -> tuple[int, ...]:
        regs = self.regions[rank]
        if len(regs) == 1:
            return regs[0].shape
        return (sum(r.size for r in regs),)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "regions": [[r.to_json() for r in regs] for regs in self.regions]}


def layout_from_json(data: Any) -> Layout:
    """Rebuild a spec from :meth:`Layout.to_json`."""
    try:
        kind = data["kind"]
        if kind == "mesh":
            return ShardingSpec(Mesh.from_json(data["mesh"]), [_placement_from_json(p) for p in data["placements"]])
        if kind == "flat":
            return FlatRanges([tuple(r) for r in data["ranges"]])
        if kind == "regions":
            return ExplicitRegions([[Region.from_json(r) for r in regs] for regs in data["regions"]])
    except LayoutError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise LayoutError(f"malformed layout {data!r}: {e}") from e
    raise LayoutError(f"unknown layout kind in {data!r}")
