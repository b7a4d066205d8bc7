"""A leaf kind's handler, the registry every dispatch on a leaf's kind goes through, and what handlers make.

A save asks each leaf's kind to *describe* it (:meth:`LeafKind.describe`: an
:class:`ArrayIn`, its layout and the getters of its pieces, or an inline value's entry); a
load asks the target leaf's kind for its *destination* (:meth:`LeafKind.destination`: a
:class:`Dest`, the memory its reads land in and how the result leaf is made); ``metadata``
asks the stored array's kind for its *abstract* placeholder. A kind's fast path (a plain
CPU tensor in a single process, a small whole array read without a plan) is inside its
own methods, not a branch ahead of the dispatch.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pytreeckpt.core._dtypes import DType, numpy_view
from pytreeckpt.core._errors import CheckpointError, LayoutError, where
from pytreeckpt.core._leaf import Abstract, piece_view
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import Layout, Mesh, Piece, Replicate, ShardingSpec
from pytreeckpt.core._slots import slots_constructor
from pytreeckpt.execute._cast import cast_problem
from pytreeckpt.execute._executor import PieceData
from pytreeckpt.execute._memory import empty_host, empty_numpy
from pytreeckpt.format import ArrayMeta, ValueMeta
from pytreeckpt.plan import ArraySpec, array_spec_of

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

__all__ = [
    "KINDS",
    "SINGLE",
    "ArrayIn",
    "Buffers",
    "Describing",
    "Dest",
    "LeafKind",
    "Matching",
    "Registry",
    "position",
    "rank_of",
    "span",
]

SINGLE = ShardingSpec(Mesh(1), [Replicate()])  # one process, the whole array


@dataclass(slots=True)
class ArrayIn:
    """A tensor leaf on its way to storage."""

    key: str
    container: str
    dtype: DType
    shape: tuple[int, ...]
    layout: Layout
    saved_layout: Layout | None
    pieces: Mapping[int, tuple[Piece, ...]]  # the pieces of the ranks whose data this process holds
    get: PieceData
    present: frozenset[int] | None = None  # ranks whose data is here; None: all
    device: Any = None  # DeviceData for leaves on a CUDA device, else None
    watch: tuple[torch.Tensor, ...] = ()  # tensors whose version counters tell of a change during a snapshot
    ranks: range | tuple[int, ...] | None = None  # the rank of each position of ``layout``; None: position i on rank i
    replica: bool = False  # every rank holds it whole (written once): its content is compared across ranks

    def spec(self) -> ArraySpec:
        """What the planner needs of this array: its key, shape, element size and placed layout."""
        return array_spec_of(self.key, self.shape, self.dtype.itemsize, self.layout, self.ranks)


array_in_of: Any = slots_constructor(ArrayIn)  # (every field, in order)


@dataclass(slots=True)
class Dest:
    """Destination memory of one target leaf."""

    meta: ArrayMeta
    layout: Layout  # the target's layout
    pieces: Mapping[int, tuple[Piece, ...]]  # the pieces of the ranks whose memory this process holds
    locals: dict[int, Any]  # rank -> torch tensor or numpy array (CPU)
    finish: Any  # callable: () -> result leaf
    device_bytes: int = 0  # bytes copied to a device by finish()
    ranks: range | tuple[int, ...] | None = None  # the rank of each position of ``layout``; None: position i on rank i
    cast: DType | None = None  # the dtype of ``locals`` when a load casts to it from the stored ``meta.dtype``

    def spec(self) -> ArraySpec:
        meta = self.meta
        return array_spec_of(meta.key, meta.shape, meta.dtype.itemsize, self.layout, self.ranks)

    def get(self, rank: int, pi: int) -> tuple[np.ndarray, Region]:
        piece = self.pieces[rank][pi]
        local = self.locals[rank]
        if isinstance(local, np.ndarray):
            # numpy destinations are full arrays: the single piece is the whole array
            return local, piece.region
        return numpy_view(piece_view(local, piece)), piece.region


dest_of: Any = slots_constructor(Dest)  # (every field, in order)


@dataclass(slots=True)
class Buffers:
    """Where a load's new host memory comes from.

    ``huge``: its pages advised huge (``ExecutorOptions.huge_pages``); ``meta``: a load that
    is only planned (``plan_load``) gets tensors on the meta device (shapes, no memory),
    one per shape and dtype. ``fresh`` records every buffer made, as (address, bytes), for
    :class:`~pytreeckpt.execute._memory.Prefault` (with ``prefault``; a cold load reading around the page
    cache leaves the faults to its reads).
    """

    huge: bool = True
    meta: bool = False
    prefault: bool = True
    fresh: list[tuple[int, int]] = field(default_factory=list)
    _shapes: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = field(default_factory=dict)
    # this rank's shards in a distributed load, by (spec, shape, placement) objects (a model's layers share
    # theirs): leaves/_sharded.py's own_shard
    shards: dict[tuple[int, tuple[int, ...], int], tuple[Any, ...]] = field(default_factory=dict)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        """Host memory for a read; pinned when it goes on to a CUDA device (the copy is then asynchronous)."""
        if self.meta:
            got = self._shapes.get((shape, dtype))
            if got is None:
                got = self._shapes[shape, dtype] = torch.empty(shape, dtype=dtype, device="meta")
            return got
        t = empty_host(shape, dtype, pin=pinned and torch.cuda.is_available(), huge=self.huge)
        if self.prefault:
            self.fresh.append((t.data_ptr(), t.numel() * t.element_size()))
        return t

    def numpy(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        a = empty_numpy(shape, dtype, huge=self.huge and not self.meta)
        if not self.meta and self.prefault:
            self.fresh.append((a.ctypes.data, a.nbytes))
        return a


@dataclass(slots=True)
class Describing:
    """One save's description of its leaves, as the kinds add to it (in the tree's order)."""

    comm: Comm | None
    plan_only: bool = False  # a plan asked for (plan_save): Abstract leaves are planned, never read
    arrays: list[ArrayIn] = field(default_factory=list)
    entries: list[dict[str, Any] | None] = field(default_factory=list)  # a value's entry; None for an array
    values: list[str] = field(default_factory=list)  # the keys of the plain Python leaves
    kinds: dict[Any, Any] = field(default_factory=dict)  # what Abstract leaves of one spec, shape, dtype and
    # placement objects share (a model's layers do): their layout, this rank's pieces, dtype

    def array(self, a: ArrayIn) -> None:
        self.arrays.append(a)
        self.entries.append(None)


@dataclass(slots=True)
class Matching:
    """One load's target matched against the stored leaves, as the kinds add to it.

    ``results[i]`` is the result leaf ``i`` when it is known now (a value, a small whole
    array read below), ``dests`` the arrays read through the plan (result index, Dest),
    ``small`` the whole small arrays read straight from their archives without one
    (result index, stored, target or None), ``problems`` what does not match.
    """

    comm: Comm | None
    buffers: Buffers
    inplace: bool
    small_whole: Any  # Storage.small_whole, or None when no array may be read without a plan
    results: list[Any]
    dests: list[tuple[int, Dest]] = field(default_factory=list)
    small: list[tuple[int, ArrayMeta, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    kinds: dict[Any, Any] = field(default_factory=dict)  # what targets of one layout share (a model's layers do)
    cast: bool = False  # load(..., cast=True): a target of another dtype gets the stored array converted
    casts: list[tuple[str, str, str]] = field(default_factory=list)  # (key, stored dtype, target dtype) cast
    # a stand-in of a stored array with the target's dtype (what its destination is made of) -> (it, the stored)
    stand_ins: dict[int, tuple[ArrayMeta, ArrayMeta]] = field(default_factory=dict)

    def stored_array(self, key: str, stored: ArrayMeta | ValueMeta) -> ArrayMeta | None:
        """``stored`` if it is an array (an array target was given); else None, the mismatch noted."""
        if isinstance(stored, ValueMeta):
            self.problems.append(
                f"leaf {where(key)}: the checkpoint has the value {stored.value!r}, the target has an array"
            )
            return None
        return stored

    def fitting(self, key: str, stored: ArrayMeta, shape: tuple[int, ...], dtype: DType) -> ArrayMeta | None:
        """What a target of ``shape`` and ``dtype`` loads of ``stored`` (None: a mismatch, noted): ``stored``
        itself, or with ``cast`` a target of another dtype a stand-in of ``stored`` with the target's dtype,
        to make its destination of (the destination is given back ``stored`` to read, see :meth:`unstand`)."""
        if stored.dtype is dtype or not self.cast or stored.shape != shape:
            return None if self.mismatch(key, stored, shape, dtype.name) else stored
        if not self.castable(key, stored, dtype, note=True):
            return None
        stand_in = dataclasses.replace(stored, dtype=dtype)
        self.stand_ins[id(stand_in)] = (stand_in, stored)
        return stand_in

    def castable(self, key: str, stored: ArrayMeta, dtype: DType, note: bool = False) -> bool:
        """Whether ``stored`` casts to ``dtype`` (with ``cast``): if so it is reported; if not and ``note``,
        the problem is noted."""
        problem = cast_problem(stored.dtype, dtype) if self.cast else "no cast asked"
        if problem is None:
            self.casts.append((key, stored.dtype.name, dtype.name))
            return True
        if note:
            self.problems.append(
                f"leaf {where(key)}: the checkpoint's {stored.dtype.name} cannot be cast to the target's "
                f"{dtype.name}: {problem}"
            )
        return False

    def unstand(self) -> None:
        """Give the destinations made of a stand-in (:meth:`fitting`) the stored array to read, and the dtype
        to cast it to."""
        if not self.stand_ins:
            return
        for _, d in self.dests:
            got = self.stand_ins.get(id(d.meta))
            if got is not None and got[0] is d.meta:
                d.cast, d.meta = d.meta.dtype, got[1]

    def mismatch(self, key: str, stored: ArrayMeta, shape: tuple[int, ...], dtype_name: str) -> bool:
        """Whether the target's shape or dtype differs from the stored array's (noted as a problem)."""
        if stored.shape != shape:
            self.problems.append(f"leaf {where(key)}: the checkpoint has shape {stored.shape}, the target has {shape}")
            return True
        if stored.dtype.name != dtype_name:
            self.problems.append(
                f"leaf {where(key)}: the checkpoint has dtype {stored.dtype.name}, the target has {dtype_name}"
                + ("" if self.cast else " (load(..., cast=True) converts it)")
            )
            return True
        return False


class LeafKind(ABC):
    """The handler of one kind of leaf: every place that depends on a leaf's kind is a method here."""

    name = "leaf"
    container: str | None = None  # the stored arrays this kind makes when a load has no target ("torch", "numpy")

    @abstractmethod
    def claims(self, t: type) -> bool:
        """Whether leaves of type ``t`` are of this kind (asked once per type: the registry remembers)."""

    @abstractmethod
    def describe(self, key: str, leaf: Any, spec: Any, d: Describing) -> None:
        """Add ``leaf`` (under the spec tree's ``spec``) to a save's description ``d``."""

    @abstractmethod
    def destination(self, i: int, key: str, stored: ArrayMeta | ValueMeta, leaf: Any, m: Matching) -> None:
        """Add where the stored leaf goes for target ``leaf`` (result ``i``) to a load's ``m``
        (``leaf`` None: a load without a target, a new leaf as stored)."""

    def abstract(self, stored: ArrayMeta | ValueMeta) -> Any:
        """What ``metadata`` shows for a stored leaf this kind loads as: an array's placeholder (an
        :class:`Abstract`; its metadata for dtypes torch lacks), a value itself."""
        if isinstance(stored, ValueMeta):
            return stored.value
        try:
            return Abstract(stored.shape, stored.dtype.torch)
        except KeyError:  # numpy-only dtypes
            return stored


class Registry:
    """The leaf kinds, in the order they are asked; every dispatch on a leaf's kind goes through :meth:`of`.

    Which kind a type belongs to is found once per type and kept (``_by_type``: for the
    process's lifetime, one entry per leaf or container type met, types being few).
    """

    def __init__(self) -> None:
        self._kinds: list[LeafKind] = []
        self._by_type: dict[type, LeafKind | None] = {}
        self._by_container: dict[str, LeafKind] = {}
        self._value: LeafKind | None = None
        self._fallback: LeafKind | None = None
        self._met: dict[type, tuple[int, frozenset[type]]] = {}  # kind class -> (len(_by_type), its types met)

    def register(self, kind: LeafKind, *, value: bool = False, fallback: bool = False) -> None:
        """Add ``kind`` after those registered (earlier kinds are asked first: a subclass's kind goes before).

        ``value``: the kind of stored values; ``fallback``: the kind a leaf of no kind's type is
        taken as when a save or load meets it (a tree flattens only into leaves and containers).
        """
        self._kinds.append(kind)
        self._by_type.clear()
        self._met.clear()
        if kind.container is not None:
            self._by_container.setdefault(kind.container, kind)
        if value:
            self._value = kind
        if fallback:
            self._fallback = kind

    def of(self, leaf: Any) -> LeafKind | None:
        """The kind of ``leaf``, or None if it is not a leaf (a container, or a type no kind takes)."""
        t = type(leaf)
        try:
            return self._by_type[t]
        except KeyError:
            kind = self._by_type[t] = next((k for k in self._kinds if k.claims(t)), None)
            return kind

    def kind(self, leaf: Any) -> LeafKind:
        """The kind that handles ``leaf`` in a save or load: its own, else the fallback kind."""
        t = type(leaf)
        try:
            kind = self._by_type[t]
        except KeyError:
            kind = self.of(leaf)
        if kind is None:
            assert self._fallback is not None
            return self._fallback
        return kind

    def met(self, cls: type[LeafKind]) -> frozenset[type]:
        """The types met so far (asked :meth:`of`) whose kind is a ``cls``: none means a tree just flattened
        holds no leaf of such a kind, known without a look at its leaves."""
        n = len(self._by_type)
        got = self._met.get(cls)
        if got is None or got[0] != n:
            types = frozenset(t for t, k in self._by_type.items() if isinstance(k, cls))
            got = self._met[cls] = (n, types)
        return got[1]

    def is_leaf(self, x: Any) -> bool:
        """Whether ``x`` is a leaf of some kind (what flattening a tree stops at)."""
        t = type(x)
        try:
            return self._by_type[t] is not None
        except KeyError:
            return self.of(x) is not None

    def stored(self, stored: ArrayMeta | ValueMeta) -> LeafKind:
        """The kind that makes a new leaf of a stored one (a load without a target, ``metadata``)."""
        if isinstance(stored, ValueMeta):
            assert self._value is not None
            return self._value
        kind = self._by_container.get(stored.container)
        if kind is None:
            raise CheckpointError(
                f"leaf {where(stored.key)}: no leaf kind loads arrays of container {stored.container!r}"
            )
        return kind


KINDS = Registry()  # the process's leaf kinds (leaves/__init__.py registers the library's own)


_PLACED: dict[int, tuple[Any, int, dict[int, int]]] = {}  # placement -> its highest rank and positions (bounded)


def placed(placement: Any) -> tuple[int, dict[int, int]]:
    """The highest rank of a placement, and each rank's position; once per placement object (the
    arrays of a pipeline stage share theirs)."""
    got = _PLACED.get(id(placement))
    if got is not None and got[0] is placement:
        return got[1], got[2]
    if len(_PLACED) > 256:
        _PLACED.clear()
    positions = {r: p for p, r in enumerate(placement)}
    last = max(positions, default=-1)
    _PLACED[id(placement)] = (placement, last, positions)
    return last, positions


def span(layout: Any, ranks: Any) -> int:
    """The world a layout needs: its positions, or the ranks a placement puts them on."""
    return int(layout.world_size) if ranks is None else placed(ranks)[0] + 1


def rank_of(placement: range | tuple[int, ...] | None) -> Any:
    """Position -> global rank under ``placement``."""
    if placement is None:
        return lambda p: p
    return placement.__getitem__


def position(key: str, spec: Layout, placement: range | tuple[int, ...] | None, comm: Comm) -> int | None:
    """This rank's position in ``spec`` placed on ``placement`` (None: it holds nothing of the leaf)."""
    if placement is None:
        if spec.world_size > comm.world:
            raise LayoutError(f"its spec spans {spec.world_size} ranks but the process group has {comm.world}")
        return comm.rank if comm.rank < spec.world_size else None
    last, positions = placed(placement)
    if last >= comm.world:
        raise LayoutError(f"its placement names rank {last} but the process group has {comm.world}")
    return positions.get(comm.rank)
