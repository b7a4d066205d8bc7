"""Hypothesis strategies of meshes, placements, shapes, layouts and chunking options."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import strategies as st

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
from pytreeckpt.plan import ChunkingOptions

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
