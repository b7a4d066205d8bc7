"""The plans as plain data: frozen dataclasses of ints, strings and boxes, with exact JSON round trips.

A :class:`SavePlan` says, per stored array, its chunk grid and who writes which box of
whole chunks from which ranks' pieces; a :class:`LoadPlan`, per target array, who reads
which box of the stored array and which ranks' pieces receive it. :class:`ArraySpec` is
the planning input: an array's global shape, element size and layout, placed on world
ranks. Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pytreeckpt.core._errors import LayoutError
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import Layout
from pytreeckpt.core._slots import slots_constructor

__all__ = [
    "ArrayLoadPlan",
    "ArraySavePlan",
    "ArraySpec",
    "ChunkingOptions",
    "Fragment",
    "LoadPlan",
    "ReadOp",
    "SavePlan",
    "WriteOp",
    "check_placement",
]

MiB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkingOptions:
    """How stored arrays are cut into chunks.

    Attributes:
      single_chunk_bytes: arrays up to this size are stored as one chunk.
      min_chunk_bytes: a chunk grid aligned with every shard boundary is used when its
        chunks are at least this large; otherwise a regular grid is used and chunks that
        straddle shards are merged by their writer.
      max_chunk_bytes: chunks are split until they are at most this large.
    """

    single_chunk_bytes: int = 1 * MiB
    min_chunk_bytes: int = 256 * 1024
    max_chunk_bytes: int = 16 * MiB

    def __post_init__(self) -> None:
        for name in ("single_chunk_bytes", "min_chunk_bytes", "max_chunk_bytes"):
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"ChunkingOptions.{name} must be an int, found {type(value).__name__} {value!r}")
            if value < (1 if name == "max_chunk_bytes" else 0):
                raise ValueError(
                    f"ChunkingOptions.{name} must be at least {int(name == 'max_chunk_bytes')}, found {value}"
                )

    def to_json(self) -> dict[str, int]:
        return {
            "single_chunk_bytes": self.single_chunk_bytes,
            "min_chunk_bytes": self.min_chunk_bytes,
            "max_chunk_bytes": self.max_chunk_bytes,
        }


@dataclass(frozen=True, slots=True)
class Fragment:
    """The part ``region`` (global coordinates) of piece ``piece`` of rank ``rank``."""

    rank: int
    piece: int
    region: Region

    def to_json(self) -> list[Any]:
        return [self.rank, self.piece, self.region.to_json()]

    @classmethod
    def from_json(cls, data: Any) -> Fragment:
        return cls(int(data[0]), int(data[1]), Region.from_json(data[2]))


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Write ``region`` (a union of whole chunks) by ``writer``, assembled from ``sources``.

    A direct write has one source, on the writer itself, covering the whole region.
    """

    region: Region
    writer: int
    sources: tuple[Fragment, ...]

    @property
    def is_direct(self) -> bool:
        return len(self.sources) == 1 and self.sources[0].rank == self.writer and self.sources[0].region == self.region

    def to_json(self) -> list[Any]:
        return [self.region.to_json(), self.writer, [s.to_json() for s in self.sources]]

    @classmethod
    def from_json(cls, data: Any) -> WriteOp:
        return cls(Region.from_json(data[0]), int(data[1]), tuple(Fragment.from_json(s) for s in data[2]))


@dataclass(frozen=True, slots=True)
class ArraySavePlan:
    key: str
    shape: tuple[int, ...]
    itemsize: int
    chunk_shape: tuple[int, ...]
    writes: tuple[WriteOp, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "shape": list(self.shape),
            "itemsize": self.itemsize,
            "chunk_shape": list(self.chunk_shape),
            "writes": [w.to_json() for w in self.writes],
        }

    @classmethod
    def from_json(cls, data: Any) -> ArraySavePlan:
        return cls(
            str(data["key"]),
            tuple(int(v) for v in data["shape"]),
            int(data["itemsize"]),
            tuple(int(v) for v in data["chunk_shape"]),
            tuple(WriteOp.from_json(w) for w in data["writes"]),
        )


@dataclass(frozen=True, slots=True)
class SavePlan:
    """Every array's chunk grid and writes; identical on every rank."""

    world_size: int
    arrays: tuple[ArraySavePlan, ...]

    def bytes_per_rank(self) -> tuple[int, ...]:
        """Bytes each rank writes."""
        load = [0] * self.world_size
        for a in self.arrays:
            for w in a.writes:
                load[w.writer] += w.region.size * a.itemsize
        return tuple(load)

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "arrays": [a.to_json() for a in self.arrays]}

    @classmethod
    def from_json(cls, data: Any) -> SavePlan:
        return cls(int(data["world_size"]), tuple(ArraySavePlan.from_json(a) for a in data["arrays"]))


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Read ``region`` of the stored array once, by ``reader``, into every target fragment.

    Every target fragment has the same region; it names the rank piece receiving it.
    """

    region: Region
    reader: int
    targets: tuple[Fragment, ...]

    def to_json(self) -> list[Any]:
        return [self.region.to_json(), self.reader, [[t.rank, t.piece] for t in self.targets]]

    @classmethod
    def from_json(cls, data: Any) -> ReadOp:
        region = Region.from_json(data[0])
        return cls(region, int(data[1]), tuple(Fragment(int(r), int(p), region) for r, p in data[2]))


@dataclass(frozen=True, slots=True)
class ArrayLoadPlan:
    key: str
    shape: tuple[int, ...]
    itemsize: int
    reads: tuple[ReadOp, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "shape": list(self.shape),
            "itemsize": self.itemsize,
            "reads": [r.to_json() for r in self.reads],
        }

    @classmethod
    def from_json(cls, data: Any) -> ArrayLoadPlan:
        return cls(
            str(data["key"]),
            tuple(int(v) for v in data["shape"]),
            int(data["itemsize"]),
            tuple(ReadOp.from_json(r) for r in data["reads"]),
        )


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Every target array's reads; identical on every rank."""

    world_size: int
    arrays: tuple[ArrayLoadPlan, ...]

    def bytes_per_rank(self) -> tuple[int, ...]:
        """Bytes each rank reads from storage."""
        load = [0] * self.world_size
        for a in self.arrays:
            for r in a.reads:
                load[r.reader] += r.region.size * a.itemsize
        return tuple(load)

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "arrays": [a.to_json() for a in self.arrays]}

    @classmethod
    def from_json(cls, data: Any) -> LoadPlan:
        return cls(int(data["world_size"]), tuple(ArrayLoadPlan.from_json(a) for a in data["arrays"]))


@dataclass(frozen=True, slots=True)
class ArraySpec:
    """One array to plan: its key path, global shape, element size and layout, placed on world ranks.

    ``ranks`` gives the world rank of each of the layout's positions (a DTensor's mesh,
    a pipeline stage's sub-mesh); None places position ``i`` on rank ``i``.
    """

    key: str
    shape: tuple[int, ...]
    itemsize: int
    layout: Layout
    ranks: range | tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def placed_on(self, rank: int) -> bool:
        """True when a position of the layout sits on world rank ``rank``."""
        if self.ranks is None:
            return 0 <= rank < self.layout.world_size
        return rank in self.ranks

    def rank_array(self) -> np.ndarray:
        """The world rank of each layout position."""
        n = self.layout.world_size
        if self.ranks is None:
            return np.arange(n, dtype=np.int64)
        if len(self.ranks) != n:
            raise LayoutError(
                f"leaf {self.key!r}: its layout has {n} ranks but it is placed on {len(self.ranks)} ranks"
            )
        if isinstance(self.ranks, range):
            return np.arange(self.ranks.start, self.ranks.stop, self.ranks.step, dtype=np.int64)
        return np.asarray(self.ranks, dtype=np.int64)

    def check_world(self, world: int) -> None:
        """Raise unless every position of the layout sits on a rank of a world of ``world`` ranks."""
        if self.ranks is None or (isinstance(self.ranks, range) and len(self.ranks) == self.layout.world_size):
            span = range(self.layout.world_size) if self.ranks is None else self.ranks  # distinct ranks
            if len(span) and (min(span[0], span[-1]) < 0 or max(span[0], span[-1]) >= world):
                raise LayoutError(f"leaf {self.key!r}: its layout spans ranks beyond the world of {world}")
            return
        ranks = self.rank_array()
        if len(ranks) and (int(ranks.min()) < 0 or int(ranks.max()) >= world):
            raise LayoutError(f"leaf {self.key!r}: its layout spans ranks beyond the world of {world}")
        if len(np.unique(ranks)) != len(ranks):
            raise LayoutError(f"leaf {self.key!r}: its layout places two positions on one rank: {self.ranks}")


def placement_of(spec: ArraySpec) -> tuple[int, Any]:
    """``spec``'s layout and placement *objects*, as a key (a range or None by value: equal ones are the same
    placement). Arrays sharing them, as a model's layers do, are planned alike; the specs keep the objects
    alive, so their ids are theirs while they are planned."""
    ranks = spec.ranks
    return id(spec.layout), ranks if ranks is None or type(ranks) is range else id(ranks)


def check_placement(spec: ArraySpec, world: int, checked: set[tuple[int, Any]], what: str) -> None:
    """Raise unless ``spec``'s layout sits on ranks of the world; each placement is checked once."""
    where = placement_of(spec)
    if where in checked:
        return
    if spec.layout.world_size > world:
        raise LayoutError(
            f"leaf {spec.key!r}: its {what} spans {spec.layout.world_size} ranks but the world has {world}"
        )
    spec.check_world(world)
    checked.add(where)


# The planner's many small objects, made by setting their slots (core/_slots.py): each takes
# every field of its class, in order, and skips the frozen dataclass's __init__.
fragment_of: Callable[[int, int, Region], Fragment] = slots_constructor(Fragment)
write_of: Callable[[Region, int, tuple[Fragment, ...]], WriteOp] = slots_constructor(WriteOp)
read_of: Callable[[Region, int, tuple[Fragment, ...]], ReadOp] = slots_constructor(ReadOp)
# (a save or load describes each of its leaves so: 0.7 us against 1.4 us)
array_spec_of: Callable[[str, tuple[int, ...], int, Layout, range | tuple[int, ...] | None], ArraySpec] = (
    slots_constructor(ArraySpec)
)
array_save_plan_of: Callable[[str, tuple[int, ...], int, tuple[int, ...], tuple[WriteOp, ...]], ArraySavePlan] = (
    slots_constructor(ArraySavePlan)
)
array_load_plan_of: Callable[[str, tuple[int, ...], int, tuple[ReadOp, ...]], ArrayLoadPlan] = slots_constructor(
    ArrayLoadPlan
)
