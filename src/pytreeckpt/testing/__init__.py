"""Hypothesis strategies and a resharding check, to verify your own layouts.

These are the strategies pytreeckpt's own property tests use: meshes, placements,
shapes (zero-size and indivisible ones included), every kind of layout (mesh specs,
flat ranges, explicit boxes, with replication and, for load targets, gaps), every
stored dtype, tensors full of special values, and nested sharded trees.
:func:`check_reshard` saves a tree in one layout, loads it in another and checks
every element bit for bit.

They need the ``hypothesis`` package (the ``test`` extra, ``pip install
'pytreeckpt[test]'``); ``import pytreeckpt`` does not import it.

>>> import torch
>>> from pytreeckpt import FlatRanges, Mesh, Shard, ShardingSpec
>>> from pytreeckpt.testing import check_reshard
>>> state = {"w": torch.arange(12.0).reshape(4, 3), "step": 3}
>>> out = check_reshard(state, ShardingSpec(Mesh(2), [Shard(0)]), {"w": FlatRanges([(0, 5), (5, 12)]), "step": None})
>>> out["w"].shards[1]
tensor([ 5.,  6.,  7.,  8.,  9., 10., 11.])
>>> out["step"]
3

With hypothesis, the same check runs on random layouts:

>>> from hypothesis import given, settings, strategies as st
>>> from pytreeckpt.testing import specs
>>> @settings(max_examples=3, deadline=None, derandomize=True)
... @given(st.data())
... def test_reshard(data):
...     t = torch.arange(10, dtype=torch.int16)
...     check_reshard({"t": t}, data.draw(specs((10,))), data.draw(specs((10,), complete=False)))
>>> test_reshard()
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("pytreeckpt.testing needs hypothesis; install it with `pip install 'pytreeckpt[test]'`") from e

from pytreeckpt.api import async_save, load, save
from pytreeckpt.core._dtypes import dtype_of_torch
from pytreeckpt.core._leaf import Abstract, ShardedLeaf
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import (
    ExplicitRegions,
    FlatRanges,
    Layout,
    Mesh,
    Placement,
    Replicate,
    Shard,
    ShardingSpec,
    StridedShard,
)
from pytreeckpt.core._tree import broadcast_prefix, flatten, keystr
from pytreeckpt.leaves import KINDS
from pytreeckpt.leaves import is_leaf as _is_leaf
from pytreeckpt.plan import ChunkingOptions

__all__ = [
    "SimComm",
    "check_reshard",
    "chunking_options",
    "dtypes",
    "meshes",
    "placements",
    "shapes",
    "sharded_trees",
    "specs",
    "target_specs",
    "tensors",
]

_DTYPE_NAMES = (
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bits8", "bits16",
)  # fmt: skip
_STORED_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
)
"""Every torch dtype pytreeckpt stores bit for bit (those this torch has)."""


# --------------------------------------------------------------------------- a simulated world


class SimComm:
    """One rank of a simulated world of ``world`` ranks that all hold the same state, for planning.

    Pass it as ``process_group`` to :func:`pytreeckpt.plan_save` or
    :func:`pytreeckpt.plan_load` to see the plan rank ``rank`` of a job of any size would
    run, in one process and without torch.distributed. The other ranks are simulated by
    what they would send when they describe the same state as this one: rank 0 gathers
    ``world`` copies of this rank's objects, and another rank receives from rank 0 the
    verdict that the ranks agree, or, in a load, the metadata document rank 0 read
    (``document``). Every object this rank receives is kept in ``received``, so a caller
    can measure it. Only planning is simulated: the data transfers of a save or load are
    not.

    >>> import torch, pytreeckpt
    >>> from pytreeckpt import Mesh, Shard, ShardedLeaf, ShardingSpec
    >>> spec = ShardingSpec(Mesh(4096), [Shard(0)])
    >>> leaf = ShardedLeaf((4096 * 256, 256), torch.float32, spec, {5: torch.zeros(256, 256)})
    >>> plan = pytreeckpt.plan_save({"w": leaf}, process_group=SimComm(5, 4096))
    >>> [(op.writer, op.region.offset) for op in plan.arrays[0].writes]
    [(5, (1280, 0))]
    """

    def __init__(self, rank: int, world: int, *, document: bytes | None = None) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not a rank of a world of {world}")
        self.rank, self.world = rank, world
        self.received: list[Any] = []
        self._from_coordinator: list[Any] = [] if document is None else [document]

    def gather(self, obj: Any) -> list[Any]:
        if self.rank != 0:
            return []
        self.received.extend([obj] * (self.world - 1))
        return [obj] * self.world

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self.rank == src:
            return obj
        # What rank 0 sends when every rank holds the same state: the document it read, then "they agree" (None).
        answer = self._from_coordinator.pop(0) if self._from_coordinator and obj is None else None
        self.received.append(answer)
        return answer

    def agree(self, error: BaseException | None, what: str) -> None:
        if error is not None:
            raise error


# --------------------------------------------------------------------------- meshes and placements


def meshes(max_axes: int = 3, max_ranks: int = 8) -> st.SearchStrategy[Mesh]:
    """Meshes of 1 to ``max_axes`` axes with at most ``max_ranks`` ranks in all.

    Args:
      max_axes: the most axes a mesh has.
      max_ranks: the most ranks a mesh has (the product of its axis sizes).

    Returns:
      A strategy of :class:`~pytreeckpt.Mesh`, axes named ``a0``, ``a1``, ...
    """

    @st.composite
    def build(draw: st.DrawFn) -> Mesh:
        n = draw(st.integers(1, max_axes))
        shape: list[int] = []
        for _ in range(n):
            shape.append(draw(st.integers(1, max(1, max_ranks // math.prod(shape)))))
        return Mesh(shape, [f"a{i}" for i in range(n)])

    return build()


def placements(mesh: Mesh, ndim: int, *, strided: bool = False) -> st.SearchStrategy[tuple[Placement, ...]]:
    """One placement per mesh axis: ``Shard(dim)`` or ``Replicate()``.

    Several mesh axes may shard the same dim; a tensor of 0 dims is replicated.

    Args:
      mesh: the mesh.
      ndim: dims of the tensor.
      strided: also draw ``StridedShard(dim, split_factor)`` (FSDP2 with TP).

    Returns:
      A strategy of tuples of ``mesh.ndim`` placements.
    """
    options: list[st.SearchStrategy[Placement]] = [st.just(Replicate())]
    if ndim > 0:
        options.append(st.builds(Shard, st.integers(0, ndim - 1)))
        if strided:
            options.append(st.builds(StridedShard, st.integers(0, ndim - 1), st.integers(1, 3)))
    return st.tuples(*[st.one_of(options) for _ in mesh.shape])


def shapes(
    max_dims: int = 4, max_side: int = 9, *, min_dims: int = 0, max_elements: int = 4096
) -> st.SearchStrategy[tuple[int, ...]]:
    """Global shapes: 0 to ``max_dims`` dims, sides from 0 (zero-size) to ``max_side``.

    Sides are mostly indivisible by mesh axis sizes, so shards come out uneven.

    Args:
      max_dims: the most dims.
      max_side: the largest side.
      min_dims: the fewest dims.
      max_elements: the most elements (sides are drawn again until the shape fits).

    Returns:
      A strategy of shape tuples.
    """
    return (
        st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims)
        .map(tuple)
        .filter(lambda s: math.prod(s) <= max_elements)
    )


# --------------------------------------------------------------------------- layouts


def _flat_ranges(numel: int, complete: bool, max_ranks: int) -> st.SearchStrategy[FlatRanges]:
    @st.composite
    def build(draw: st.DrawFn) -> FlatRanges:
        # A partition of [0, numel) at random cut points (equal cuts: empty ranges).
        parts = draw(st.integers(1, max_ranks))
        cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=parts - 1, max_size=parts - 1)))
        bounds = [0, *cuts, numel]
        ranges = [(bounds[i], bounds[i + 1]) for i in range(parts)]
        # Ranges widened past their neighbours, and extra ranks: replication.
        if draw(st.booleans()):
            ranges = [(draw(st.integers(0, a)), draw(st.integers(b, numel))) for a, b in ranges]
        for _ in range(draw(st.integers(0, max_ranks - len(ranges)))):
            a = draw(st.integers(0, numel))
            ranges.append((a, draw(st.integers(a, numel))))
        if not complete and draw(st.booleans()):  # a load target may leave gaps
            ranges = [(a, draw(st.integers(a, b))) if draw(st.booleans()) else (a, b) for a, b in ranges]
        order = draw(st.permutations(range(len(ranges))))
        return FlatRanges([ranges[i] for i in order])

    return build()


def _boxes(draw: st.DrawFn, shape: tuple[int, ...], max_cuts: int) -> list[Region]:
    """Disjoint boxes covering ``shape``, by cutting a box in two along a dim, repeatedly."""
    boxes = [Region.full(shape)]
    for _ in range(draw(st.integers(0, max_cuts))):
        splittable = [(i, d) for i, b in enumerate(boxes) for d in range(b.ndim) if b.shape[d] > 1]
        if not splittable:
            break
        i, d = draw(st.sampled_from(splittable))
        box = boxes.pop(i)
        cut = draw(st.integers(1, box.shape[d] - 1))
        lo_shape, hi_shape, hi_off = list(box.shape), list(box.shape), list(box.offset)
        lo_shape[d] = cut
        hi_shape[d] -= cut
        hi_off[d] += cut
        boxes += [Region(box.offset, tuple(lo_shape)), Region(tuple(hi_off), tuple(hi_shape))]
    return boxes


def _any_box(draw: st.DrawFn, shape: tuple[int, ...]) -> Region:
    """A box inside ``shape``, possibly empty."""
    offset, extent = [], []
    for side in shape:
        lo = draw(st.integers(0, side))
        offset.append(lo)
        extent.append(draw(st.integers(0, side - lo)))
    return Region(tuple(offset), tuple(extent))


def _explicit_regions(shape: tuple[int, ...], complete: bool, max_ranks: int) -> st.SearchStrategy[ExplicitRegions]:
    @st.composite
    def build(draw: st.DrawFn) -> ExplicitRegions:
        ranks = draw(st.integers(1, max_ranks))
        per_rank: list[list[Region]] = [[] for _ in range(ranks)]
        for box in _boxes(draw, shape, max_cuts=5):  # a cover: ranks with one box, several, or none
            if complete or draw(st.integers(0, 3)) > 0:
                per_rank[draw(st.integers(0, ranks - 1))].append(box)
        for _ in range(draw(st.integers(0, 3))):  # boxes overlapping the cover: replication
            per_rank[draw(st.integers(0, ranks - 1))].append(_any_box(draw, shape))
        return ExplicitRegions(per_rank)

    return build()


def specs(
    shape: Sequence[int],
    *,
    complete: bool = True,
    irregular: bool = True,
    strided: bool = True,
    max_ranks: int = 8,
) -> st.SearchStrategy[Layout]:
    """Any layout of a tensor of ``shape``.

    A :class:`~pytreeckpt.ShardingSpec` over a random mesh with random placements;
    :class:`~pytreeckpt.FlatRanges` cut at random points, some ranges overlapping
    others (replication); :class:`~pytreeckpt.ExplicitRegions` of random boxes, ranks
    holding one box, several or none, some boxes overlapping others.

    Args:
      shape: the global shape.
      complete: every element is held by some rank, as a layout to save from needs.
        With False, irregular layouts may leave gaps, as a load target may.
      irregular: include FlatRanges and ExplicitRegions.
      strided: include ``StridedShard`` placements in mesh specs.
      max_ranks: the most ranks a layout spans.

    Returns:
      A strategy of layouts valid for ``shape``.
    """
    shape = tuple(int(s) for s in shape)

    @st.composite
    def mesh_spec(draw: st.DrawFn) -> Layout:
        mesh = draw(meshes(max_ranks=max_ranks))
        return ShardingSpec(mesh, draw(placements(mesh, len(shape), strided=strided)))

    options: list[st.SearchStrategy[Layout]] = [mesh_spec()]
    if irregular:
        options += [
            _flat_ranges(math.prod(shape), complete, max_ranks),
            _explicit_regions(shape, complete, max_ranks),
        ]
    return st.one_of(options)


def chunking_options() -> st.SearchStrategy[ChunkingOptions | None]:
    """The default chunking (None), or tiny chunks that straddle shards and are merged by their writer.

    Returns:
      A strategy of ``ChunkingOptions`` or None, to pass as ``save(..., chunking=...)``.
    """
    small = st.builds(
        lambda a, b, c: ChunkingOptions(single_chunk_bytes=a, min_chunk_bytes=b, max_chunk_bytes=c),
        st.integers(0, 64),
        st.integers(0, 64),
        st.integers(1, 64),
    )
    return st.one_of(st.none(), small)


# --------------------------------------------------------------------------- dtypes and values


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """Every torch dtype pytreeckpt stores bit for bit.

    bool, signed and unsigned integers of every width, float16, bfloat16, float32,
    float64, complex32, complex64, complex128, the float8 variants, float4 pairs and the
    bits types (those the installed torch has).

    Returns:
      A strategy of ``torch.dtype``.
    """
    return st.sampled_from(_STORED_DTYPES)


@functools.cache
def _special_bits(dtype: torch.dtype) -> np.ndarray:
    """Bit patterns of special values of ``dtype``, one per row of uint8."""
    n = dtype.itemsize
    rows = [
        bytes(n),  # zero
        b"\xff" * n,  # all ones: -1, a NaN
        bytes(n - 1) + b"\x80",  # the sign bit alone: -0.0, the smallest integer
        b"\xff" * (n - 1) + b"\x7f",  # all but the sign bit: the largest integer, a NaN
        b"\x01" + bytes(n - 1),  # the smallest subnormal, 1
    ]
    if dtype.is_floating_point or dtype.is_complex:
        values = [math.inf, -math.inf, math.nan, -math.nan, -0.0, 1.0]
        try:
            info = torch.finfo(dtype)
            values += [info.max, -info.max, info.tiny, info.eps]
        except (NotImplementedError, RuntimeError, TypeError):  # packed types such as float4_e2m1fn_x2
            pass
        for v in values:
            try:
                t = torch.tensor([v], dtype=torch.float64).to(dtype)
            except (NotImplementedError, RuntimeError, TypeError):
                continue
            rows.append(bytes(t.view(torch.uint8).numpy()))
    return np.frombuffer(b"".join(dict.fromkeys(rows)), dtype=np.uint8).reshape(-1, n).copy()


def _from_bits(raw: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    flat = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(-1))  # a writable copy
    if dtype == torch.bool:
        return (flat & 1).view(torch.bool).reshape(shape).clone()
    return flat.view(dtype).reshape(shape).clone()


def tensors(
    shape: Sequence[int], dtype: torch.dtype, *, elementwise_below: int = 64
) -> st.SearchStrategy[torch.Tensor]:
    """Random tensors of ``shape`` and ``dtype``, rich in special values.

    Elements are random bit patterns (so NaNs with payloads and subnormals appear)
    mixed with the special values of the dtype: infinities, NaNs of both signs, -0.0,
    the largest and smallest values, the smallest and largest integers. Small tensors
    are drawn element by element (so failures shrink to simple values); large ones
    from a drawn seed.

    Args:
      shape: the shape.
      dtype: the dtype (any of :func:`dtypes`).
      elementwise_below: tensors with fewer elements are drawn element by element.

    Returns:
      A strategy of CPU tensors.
    """
    shape = tuple(int(s) for s in shape)
    n, width = math.prod(shape), dtype.itemsize
    specials = _special_bits(dtype)
    element = st.one_of(
        st.binary(min_size=width, max_size=width),
        st.sampled_from([bytes(row) for row in specials]),
    )

    @st.composite
    def build(draw: st.DrawFn) -> torch.Tensor:
        if n < elementwise_below:
            raw = np.frombuffer(b"".join(draw(st.lists(element, min_size=n, max_size=n))), dtype=np.uint8)
            return _from_bits(raw.reshape(n, width), shape, dtype)
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        raw = rng.integers(0, 256, size=(n, width), dtype=np.uint8)
        fraction = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
        mask = rng.random(n) < fraction
        raw[mask] = specials[rng.integers(0, len(specials), size=int(mask.sum()))]
        return _from_bits(raw, shape, dtype)

    return build()


_KEYS = st.one_of(
    st.text(alphabet="abcxyz_.0/ ", min_size=0, max_size=4),
    st.integers(-3, 12),
)
_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),  # NaN, infinities and -0.0 included
    st.text(max_size=8),
)


def sharded_trees(
    max_leaves: int = 5,
    *,
    max_side: int = 6,
    leaf_dtypes: st.SearchStrategy[torch.dtype] | None = None,
) -> st.SearchStrategy[Any]:
    """Nested trees of dicts, lists and tuples holding sharded leaves, tensors and Python values.

    Tensor leaves have random shapes and dtypes; a :class:`~pytreeckpt.ShardedLeaf`
    holds every rank's shards of a complete random layout (see :func:`specs`); Python
    leaves are None, bool, int (beyond 64 bits too), float (NaN included) and str. Dict
    keys are strings (with dots and slashes) and integers. The root is a container.

    Args:
      max_leaves: the most leaves.
      max_side: the largest side of a tensor.
      leaf_dtypes: the dtypes of tensor leaves (default: :func:`dtypes`, every stored dtype).

    Returns:
      A strategy of trees that :func:`pytreeckpt.save` takes as they are.
    """
    dtype_st = dtypes() if leaf_dtypes is None else leaf_dtypes

    @st.composite
    def array(draw: st.DrawFn) -> Any:
        shape = draw(shapes(max_dims=3, max_side=max_side))
        t = draw(tensors(shape, draw(dtype_st)))
        if draw(st.booleans()):
            return ShardedLeaf.from_global(t, draw(specs(shape)))
        return t

    leaf = st.one_of(array(), array(), _VALUES)  # mostly arrays

    def containers(kids: st.SearchStrategy[Any], min_size: int = 0) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.dictionaries(_KEYS, kids, min_size=min_size, max_size=3),
            st.lists(kids, min_size=min_size, max_size=3),
            st.lists(kids, min_size=min_size, max_size=3).map(tuple),
        )

    return containers(st.recursive(leaf, containers, max_leaves=max_leaves), min_size=1)


def target_specs(
    tree: Any, *, complete: bool = False, max_ranks: int = 8, namespace: str = ""
) -> st.SearchStrategy[Any]:
    """Load layouts for ``tree``: a tree of its structure with a layout or None per tensor leaf.

    Args:
      tree: a tree of tensors, :class:`~pytreeckpt.ShardedLeaf` and Python values.
      complete: layouts hold every element (False: they may leave gaps).
      max_ranks: the most ranks a layout spans.
      namespace: the optree namespace of custom pytree nodes in ``tree``.

    Returns:
      A strategy of spec trees, to pass as ``spec_a`` or ``spec_b`` of :func:`check_reshard`.
    """
    leaves, _, root = flatten(tree, _is_leaf, namespace=namespace)

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        out: list[Any] = []
        for leaf in leaves:
            if KINDS.kind(leaf).name in ("tensor", "dtensor", "sharded"):
                shape = tuple(leaf.shape)
                out.append(draw(st.one_of(st.none(), specs(shape, complete=complete, max_ranks=max_ranks))))
            else:
                out.append(None)
        return root.unflatten(out)

    return build()


# --------------------------------------------------------------------------- the check


def _is_layout(x: Any) -> bool:
    return isinstance(x, Layout)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of ``t``'s elements, one row per element (NaNs compare equal to themselves)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().reshape(flat.numel(), t.dtype.itemsize)


def _describe(layout: Layout | None, full: str) -> str:
    return full if layout is None else repr(layout)


def _compare(
    key: str, have: torch.Tensor, want: torch.Tensor, saved: Layout | None, loaded: Layout | None, rank: int | None
) -> None:
    where = "" if rank is None else f" in rank {rank}'s shard"
    context = (
        f"leaf {key or '(root)'!r}: saved in layout {_describe(saved, 'unsharded')} and loaded in layout "
        f"{_describe(loaded, 'full tensor')}"
    )
    if have.dtype != want.dtype or tuple(have.shape) != tuple(want.shape):
        raise AssertionError(
            f"{context}: expected{where} shape {tuple(want.shape)} and dtype {want.dtype}, "
            f"loaded shape {tuple(have.shape)} and dtype {have.dtype}"
        )
    a, b = _bits(have), _bits(want)
    differ = (a != b).any(axis=1)
    if differ.any():
        first = int(np.flatnonzero(differ)[0])
        index = tuple(int(i) for i in np.unravel_index(first, tuple(want.shape))) if want.dim() else ()
        raise AssertionError(
            f"{context}: {int(differ.sum())} of {differ.size} elements differ{where}; the first at index {index}: "
            f"saved bits {bytes(b[first]).hex()}, loaded bits {bytes(a[first]).hex()}"
        )


def _same_value(want: Any, got: Any) -> bool:
    if type(want) is not type(got):
        return False
    if isinstance(want, float):
        return repr(want) == repr(got)  # NaN equals NaN, -0.0 differs from 0.0
    return bool(want == got)


def check_reshard(
    tree: Any,
    spec_a: Any,
    spec_b: Any,
    *,
    path: str | Path | None = None,
    chunking: ChunkingOptions | None = None,
    use_save_spec: bool = False,
    asynchronous: bool = False,
    namespace: str = "",
) -> Any:
    """Save ``tree`` in layout ``spec_a``, load it in layout ``spec_b``, and check every element bit for bit.

    Args:
      tree: a pytree whose array leaves are full (global) tensors or
        :class:`~pytreeckpt.ShardedLeaf`; other leaves are plain Python values.
      spec_a: the layouts to save from: a pytree prefix of ``tree`` whose leaves are
        layouts or None. A tensor under a layout is cut into a ShardedLeaf of that
        layout (every rank's shards); under None it is saved whole, and a ShardedLeaf
        in its own layout.
      spec_b: the layouts to load into, in the same form: an
        :class:`~pytreeckpt.Abstract` target with that layout, or a full tensor under None.
      path: the checkpoint directory (replaced if it holds one); by default a temporary
        directory, removed afterwards.
      chunking: chunking options of the save, e.g. tiny chunks so that chunks straddle
        shards and are merged.
      use_save_spec: pass ``spec_a`` as the ``spec`` argument of
        :func:`pytreeckpt.save`, with full tensors, instead of cutting ShardedLeafs.
      asynchronous: save with :func:`pytreeckpt.async_save` and wait.
      namespace: the optree namespace of custom pytree nodes in ``tree``.

    Returns:
      The loaded tree: ShardedLeaf leaves where ``spec_b`` gives a layout, full tensors
      elsewhere, Python values as stored.

    Raises:
      AssertionError: naming the leaf's key path and both layouts where a loaded value,
        shape, dtype or layout differs from the saved one.
    """
    leaves, paths, root = flatten(tree, _is_leaf, namespace=namespace)
    keys = [keystr(p) for p in paths]
    a_specs = broadcast_prefix(spec_a, root, _is_layout, len(leaves), namespace=namespace)
    b_specs = broadcast_prefix(spec_b, root, _is_layout, len(leaves), namespace=namespace)
    wants: list[torch.Tensor | None] = []
    saved_layouts: list[Layout | None] = []
    to_save: list[Any] = []
    save_specs: list[Layout | None] = []
    targets: list[Any] = []
    for key, leaf, a, b in zip(keys, leaves, a_specs, b_specs, strict=True):
        kind = KINDS.kind(leaf).name
        if kind == "value":
            wants.append(None)
            saved_layouts.append(None)
            to_save.append(leaf)
            save_specs.append(None)
            targets.append(leaf)
            continue
        if kind == "sharded":
            full = leaf.to_global()
        elif kind in ("tensor", "dtensor"):
            full = leaf
        else:
            raise TypeError(
                f"check_reshard: leaf {key or '(root)'!r} is a {type(leaf).__name__}; leaves are tensors, "
                f"ShardedLeaf or plain Python values"
            )
        dtype_of_torch(full.dtype)
        wants.append(full)
        saved_layouts.append(a if a is not None else leaf.spec if kind == "sharded" else None)
        if a is None:
            to_save.append(leaf)
            save_specs.append(None)
        elif use_save_spec:
            to_save.append(full)
            save_specs.append(a)
        else:
            to_save.append(ShardedLeaf.from_global(full, a))
            save_specs.append(None)
        targets.append(Abstract(tuple(full.shape), full.dtype, b))

    def roundtrip(where: Path) -> Any:
        state = root.unflatten(to_save)
        spec = root.unflatten(save_specs) if use_save_spec else None
        if asynchronous:
            async_save(where, state, spec, chunking=chunking, overwrite=True, namespace=namespace).wait()
        else:
            save(where, state, spec, chunking=chunking, overwrite=True, namespace=namespace)
        return load(where, root.unflatten(targets), namespace=namespace)

    if path is None:
        with tempfile.TemporaryDirectory(prefix="pytreeckpt-check-") as d:
            out = roundtrip(Path(d) / "ckpt")
    else:
        out = roundtrip(Path(path))
    _check_loaded(out, paths, keys, leaves, wants, saved_layouts, b_specs, namespace)
    return out


def _check_loaded(
    out: Any,
    paths: list[Any],
    keys: list[str],
    leaves: list[Any],
    wants: list[torch.Tensor | None],
    saved_layouts: list[Layout | None],
    b_specs: list[Any],
    namespace: str,
) -> None:
    got_leaves, got_paths, _ = flatten(out, _is_leaf, namespace=namespace)
    if got_paths != paths:
        raise AssertionError(
            f"the loaded tree has leaves {[keystr(p) for p in got_paths]}, the saved one {[keystr(p) for p in paths]}"
        )
    for key, leaf, want, got, a, b in zip(keys, leaves, wants, got_leaves, saved_layouts, b_specs, strict=True):
        if want is None:
            if not _same_value(leaf, got):
                raise AssertionError(f"leaf {key or '(root)'!r}: saved the value {leaf!r}, loaded {got!r}")
            continue
        if b is None:
            if not isinstance(got, torch.Tensor):
                raise AssertionError(f"leaf {key or '(root)'!r}: expected a full tensor, loaded {type(got).__name__}")
            _compare(key, got, want, a, b, None)
            continue
        if not isinstance(got, ShardedLeaf) or got.spec != b or set(got.shards) != set(range(b.world_size)):
            raise AssertionError(
                f"leaf {key or '(root)'!r}: expected a ShardedLeaf in layout {b!r} holding all {b.world_size} ranks, "
                f"loaded {got!r}"
            )
        expected = ShardedLeaf.from_global(want, b)
        for rank in range(b.world_size):
            _compare(key, got.shards[rank], expected.shards[rank], a, b, rank)
