"""Hypothesis strategies and a resharding check, to verify your own layouts.

These are the strategies pytreeckpt's own property tests use. They need the
``hypothesis`` package (the ``test`` extra); ``import pytreeckpt`` does not import it.

>>> import torch
>>> from pytreeckpt import Mesh, Shard, ShardingSpec, FlatRanges
>>> from pytreeckpt.testing import check_reshard
>>> t = {"w": torch.arange(12.0).reshape(4, 3)}
>>> out = check_reshard(t, ShardingSpec(Mesh(2), [Shard(0)]), FlatRanges([(0, 5), (5, 12)]))
>>> out["w"].shards[1]
tensor([ 5.,  6.,  7.,  8.,  9., 10., 11.])
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st

from ._api import load, save
from ._dtypes import dtype_of_torch
from ._leaf import Abstract, ShardedLeaf
from ._plan import ChunkingOptions
from ._region import Region
from ._sharding import (
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
from ._tree import flatten, keystr

__all__ = [
    "check_reshard",
    "chunking_options",
    "dtypes",
    "meshes",
    "placements",
    "shapes",
    "sharded_trees",
    "specs",
    "tensors",
]

DTYPES = (
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
)  # fmt: skip


def meshes(max_axes: int = 3, max_ranks: int = 8) -> st.SearchStrategy[Mesh]:
    """Meshes of 1 to ``max_axes`` axes with at most ``max_ranks`` ranks."""

    @st.composite
    def build(draw: st.DrawFn) -> Mesh:
        n = draw(st.integers(1, max_axes))
        shape: list[int] = []
        for _ in range(n):
            room = max_ranks // max(1, math.prod(shape))
            shape.append(draw(st.integers(1, max(1, min(4, room)))))
        return Mesh(shape, [f"a{i}" for i in range(n)])

    return build()


def placements(mesh: Mesh, ndim: int, strided: bool = True) -> st.SearchStrategy[tuple[Placement, ...]]:
    """One placement per mesh axis; several axes may shard the same dim."""
    options: list[st.SearchStrategy[Placement]] = [st.just(Replicate())]
    if ndim > 0:
        options.append(st.builds(Shard, st.integers(0, ndim - 1)))
        if strided:
            options.append(st.builds(StridedShard, st.integers(0, ndim - 1), st.integers(1, 3)))
    return st.tuples(*[st.one_of(options) for _ in mesh.shape])


def shapes(max_dims: int = 4, max_side: int = 9, min_dims: int = 0) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes of ``min_dims`` to ``max_dims`` dims; sides from 0 (zero-size) to ``max_side``."""
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def dtypes() -> st.SearchStrategy[torch.dtype]:
    """Torch dtypes pytreeckpt stores bit for bit."""
    return st.sampled_from(DTYPES)


def _flat_ranges(numel: int, complete: bool) -> st.SearchStrategy[FlatRanges]:
    @st.composite
    def build(draw: st.DrawFn) -> FlatRanges:
        ranks = draw(st.integers(1, 5))
        cuts = sorted(draw(st.lists(st.integers(0, numel), min_size=ranks - 1, max_size=ranks - 1)))
        bounds = [0, *cuts, numel]
        ranges = [(bounds[i], bounds[i + 1]) for i in range(ranks)]
        if draw(st.booleans()) and numel:  # an extra rank overlapping the others: replication
            a = draw(st.integers(0, numel))
            ranges.append((a, draw(st.integers(a, numel))))
        if not complete and draw(st.booleans()):  # a load target may leave gaps
            ranges = [(a, draw(st.integers(a, b))) for a, b in ranges]
        return FlatRanges(ranges)

    return build()


def _explicit_regions(shape: tuple[int, ...], complete: bool) -> st.SearchStrategy[ExplicitRegions]:
    @st.composite
    def build(draw: st.DrawFn) -> ExplicitRegions:
        # Cut every dim at random points: a grid of boxes covering the tensor.
        cells: list[list[tuple[int, int]]] = []
        for side in shape:
            cuts = sorted(set(draw(st.lists(st.integers(1, max(1, side - 1)), max_size=2)))) if side > 1 else []
            b = [0, *[c for c in cuts if 0 < c < side], side]
            cells.append([(b[i], b[i + 1] - b[i]) for i in range(len(b) - 1)])
        boxes = [Region(tuple(c[0] for c in combo), tuple(c[1] for c in combo)) for combo in _product(cells)]
        ranks = draw(st.integers(1, 4))
        owner = [draw(st.integers(0, ranks - 1)) for _ in boxes]
        per_rank: list[list[Region]] = [[] for _ in range(ranks)]
        for box, r in zip(boxes, owner, strict=True):
            keep: bool = complete or draw(st.booleans())
            if keep:
                per_rank[r].append(box)
        replicate: bool = bool(boxes) and draw(st.booleans())
        if replicate:  # one box also on another rank
            per_rank[draw(st.integers(0, ranks - 1))].append(boxes[draw(st.integers(0, len(boxes) - 1))])
        return ExplicitRegions(per_rank)

    return build()


def _product(lists: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [()]
    for options in lists:
        out = [(*t, o) for t in out for o in options]
    return out


def specs(shape: Sequence[int], *, complete: bool = True, irregular: bool = True) -> st.SearchStrategy[Layout]:
    """Any layout of a tensor of ``shape``: a mesh spec, flat ranges or explicit boxes.

    Args:
      shape: the global shape.
      complete: every element is held by some rank (needed to save; a load target
        may leave gaps).
      irregular: include FlatRanges and ExplicitRegions.
    """
    shape = tuple(shape)

    @st.composite
    def mesh_spec(draw: st.DrawFn) -> Layout:
        mesh = draw(meshes())
        return ShardingSpec(mesh, draw(placements(mesh, len(shape))))

    options: list[st.SearchStrategy[Layout]] = [mesh_spec()]
    if irregular:
        options += [_flat_ranges(math.prod(shape), complete), _explicit_regions(shape, complete)]
    return st.one_of(options)


def tensors(shape: Sequence[int], dtype: torch.dtype) -> st.SearchStrategy[torch.Tensor]:
    """Random tensors of ``shape`` and ``dtype``: random bits, so NaNs, infinities and -0.0 appear."""
    itemsize = dtype.itemsize
    n = math.prod(shape)

    def make(data: bytes) -> torch.Tensor:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        t = raw.view(dtype) if n else torch.empty(0, dtype=dtype)
        if dtype == torch.bool:
            t = raw.view(torch.uint8) % 2 == 1
        return t.reshape(tuple(shape)).clone()

    return st.binary(min_size=n * itemsize, max_size=n * itemsize).map(make)


def sharded_trees(max_leaves: int = 4) -> st.SearchStrategy[tuple[dict[str, Any], dict[str, Layout]]]:
    """``(tree, specs)``: a dict of random tensors and Python values, and a complete spec per tensor."""

    @st.composite
    def build(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Layout]]:
        tree: dict[str, Any] = {}
        spec: dict[str, Layout] = {}
        for i in range(draw(st.integers(1, max_leaves))):
            if draw(st.integers(0, 4)) == 0:
                tree[f"v{i}"] = draw(st.one_of(st.integers(), st.floats(allow_nan=False), st.booleans(), st.text()))
                continue
            shape = draw(shapes())
            tree[f"t{i}"] = draw(tensors(shape, draw(dtypes())))
            spec[f"t{i}"] = draw(specs(shape))
        return tree, spec

    return build()


def chunking_options() -> st.SearchStrategy[ChunkingOptions | None]:
    """Default chunking, or tiny chunks so that chunks straddle shards and get merged."""
    small = st.builds(
        lambda a, b, c: ChunkingOptions(single_chunk_bytes=a, min_chunk_bytes=b, max_chunk_bytes=c),
        st.integers(0, 64),
        st.integers(0, 64),
        st.integers(1, 64),
    )
    return st.one_of(st.none(), small)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}[t.dtype.itemsize]
    flat = t.contiguous().reshape(-1)
    if t.dtype.itemsize == 16:
        return torch.view_as_real(flat).contiguous().view(torch.int64)
    return flat.view(width)


def _layout_at(specs_tree: Any, key: str) -> Layout | None:
    if isinstance(specs_tree, Layout) or specs_tree is None:
        return specs_tree
    if isinstance(specs_tree, dict):
        return specs_tree.get(key)
    raise TypeError("check_reshard takes a spec, None, or a dict of specs by key path")


def check_reshard(
    tree: Any, spec_a: Any, spec_b: Any, *, path: str | Path | None = None, chunking: ChunkingOptions | None = None
) -> Any:
    """Save ``tree`` in layout ``spec_a``, load it in layout ``spec_b``, and check every element.

    Args:
      tree: a pytree whose tensor leaves are full (global) tensors.
      spec_a: the layout to save from: one spec for every tensor, None (unsharded), or a
        dict from key path to spec.
      spec_b: the layout to load into, in the same form.
      path: where to write (default: a temporary directory, removed afterwards).
      chunking: chunking options for the save.

    Returns:
      The loaded tree (ShardedLeaf leaves where ``spec_b`` gives a spec).

    Raises:
      AssertionError: naming the leaf and both layouts where a value differs.
    """
    leaves, paths, root = flatten(tree, lambda x: not isinstance(x, dict | list | tuple))
    keys = [keystr(p) for p in paths]
    saved, target = [], []
    for key, leaf in zip(keys, leaves, strict=True):
        if isinstance(leaf, torch.Tensor):
            a, b = _layout_at(spec_a, key), _layout_at(spec_b, key)
            saved.append(ShardedLeaf.from_global(leaf, a) if a is not None else leaf)
            dtype_of_torch(leaf.dtype)
            target.append(Abstract(tuple(leaf.shape), leaf.dtype, b))
        else:
            saved.append(leaf)
            target.append(leaf)
    if path is None:
        with tempfile.TemporaryDirectory(prefix="pytreeckpt-check-") as d:
            out = _roundtrip(Path(d) / "ckpt", root, saved, target, chunking)
    else:
        out = _roundtrip(Path(path), root, saved, target, chunking)
    got_leaves, _, _ = flatten(out, lambda x: not isinstance(x, dict | list | tuple))
    for key, want, got in zip(keys, leaves, got_leaves, strict=True):
        a, b = _layout_at(spec_a, key), _layout_at(spec_b, key)
        if isinstance(want, torch.Tensor):
            pairs: list[tuple[torch.Tensor, torch.Tensor, int | None]]
            if isinstance(got, ShardedLeaf):
                pairs = [
                    (got.shards[rank], ShardedLeaf.from_global(want, got.spec, ranks=[rank]).shards[rank], rank)
                    for rank in range(got.spec.world_size)
                ]
            else:
                pairs = [(got, want, None)]
            for have, expected, rank in pairs:
                same = have.dtype == expected.dtype and have.shape == expected.shape
                if not same or not torch.equal(_bits(have), _bits(expected)):
                    where = "" if rank is None else f" (rank {rank}'s shard)"
                    raise AssertionError(
                        f"leaf {key!r}: saved in layout {a} and loaded in layout {b}, the values differ{where} "
                        f"(shape {tuple(want.shape)}, dtype {want.dtype})"
                    )
        elif want != got and not (want != want and got != got):
            raise AssertionError(f"leaf {key!r}: saved {want!r}, loaded {got!r}")
    return out


def _roundtrip(path: Path, root: Any, saved: list[Any], target: list[Any], chunking: ChunkingOptions | None) -> Any:
    save(path, root.unflatten(saved), chunking=chunking, overwrite=True)
    return load(path, root.unflatten(target))
