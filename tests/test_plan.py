"""The pure planning layer, on hand-made layouts (no I/O)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pytreeckpt import ExplicitRegions, FlatRanges, Layout, LayoutError, Mesh, Replicate, Shard, ShardingSpec
from pytreeckpt.plan import ArraySpec, ChunkingOptions, LoadPlan, SavePlan, plan_load, plan_save

KiB = 1024


def layout(key: str, shape: tuple[int, ...], spec: Layout, itemsize: int = 4) -> ArraySpec:
    return ArraySpec(key, shape, itemsize, spec)


def chunk_shape(shape: tuple[int, ...], spec: Layout, options: ChunkingOptions) -> tuple[int, ...]:
    return plan_save([layout("a", shape, spec)], spec.world_size, options=options).arrays[0].chunk_shape


def written_counts(plan: SavePlan, shape: tuple[int, ...], index: int = 0) -> np.ndarray:
    counts = np.zeros(shape, dtype=int)
    for op in plan.arrays[index].writes:
        counts[op.region.slices()] += 1
    return counts


def test_aligned_shards_are_written_directly_by_their_owner() -> None:
    spec = ShardingSpec(Mesh(4), [Shard(0)])
    plan = plan_save([layout("w", (1024, 512), spec)], 4, options=ChunkingOptions(single_chunk_bytes=0))
    ap = plan.arrays[0]
    assert ap.chunk_shape == (256, 512)  # one chunk per shard
    assert [(op.writer, op.is_direct) for op in ap.writes] == [(0, True), (1, True), (2, True), (3, True)]
    assert (written_counts(plan, (1024, 512)) == 1).all()


def test_replicated_data_is_written_once_balanced_across_holders() -> None:
    spec = ShardingSpec(Mesh(4), [Replicate()])
    opts = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=64 * KiB)
    plan = plan_save([layout("r", (1024, 64), spec)], 4, options=opts)  # 256 KiB in 64 KiB chunks
    assert plan.bytes_per_rank() == (64 * KiB,) * 4
    assert (written_counts(plan, (1024, 64)) == 1).all()


def test_many_small_replicated_arrays_spread_over_ranks() -> None:
    spec = ShardingSpec(Mesh(3), [Replicate()])
    plan = plan_save([layout(f"b{i}", (100,), spec) for i in range(30)], 3)
    assert plan.bytes_per_rank() == (4000, 4000, 4000)


def test_chunks_straddling_shards_are_merged_by_one_writer() -> None:
    spec = FlatRanges([(0, 7), (7, 20), (20, 30)])
    opts = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=1000, max_chunk_bytes=40)
    plan = plan_save([layout("f", (5, 6), spec)], 3, options=opts)
    merged = [op for op in plan.arrays[0].writes if not op.is_direct]
    assert merged  # irregular pieces routed to the writer of their chunk
    for op in merged:
        assert {f.rank for f in op.sources} != {op.writer}
    assert (written_counts(plan, (5, 6)) == 1).all()


def test_a_prime_extent_is_not_cut_into_one_element_chunks() -> None:
    # Prime extents above the largest chunk. Cut only at divisors of the extent, the first
    # was 4,194,319 chunk files of 4 bytes, the second 32,003 of 2 KiB (a 5 MiB array with
    # max_chunk_bytes=1 MiB took two minutes to save and two to load).
    for shape, spec in [
        ((4_194_319,), ShardingSpec(Mesh(1), [Replicate()])),
        ((32_003, 1024), ShardingSpec(Mesh(2), [Shard(1)])),
    ]:
        plan = plan_save([layout("p", shape, spec)], spec.world_size)
        ap = plan.arrays[0]
        grid = [-(-n // c) for n, c in zip(shape, ap.chunk_shape, strict=True)]
        assert math.prod(ap.chunk_shape) * 4 <= ChunkingOptions().max_chunk_bytes
        assert math.prod(grid) <= 2 * -(-math.prod(shape) * 4 // ChunkingOptions().max_chunk_bytes), (
            shape,
            ap.chunk_shape,
        )
        assert (written_counts(plan, shape) == 1).all()
    # a cut between pieces stays a chunk boundary
    spec = ShardingSpec(Mesh(2), [Shard(1)])
    ap = plan_save([layout("p", (32_003, 1024), spec)], 2).arrays[0]
    assert 512 % ap.chunk_shape[1] == 0


def test_small_arrays_are_one_chunk() -> None:
    spec = ShardingSpec(Mesh(4), [Shard(0)])
    plan = plan_save([layout("b", (10,), spec)], 4)
    assert plan.arrays[0].chunk_shape == (10,)
    assert len(plan.arrays[0].writes) == 1


def test_a_gap_in_the_layout_names_the_leaf() -> None:
    with pytest.raises(LayoutError, match=r"leaf 'g'.*held by no rank"):
        plan_save([layout("g", (10,), FlatRanges([(0, 4), (5, 10)]))], 2)


def test_load_reads_identical_regions_once_for_all_ranks_that_want_them() -> None:
    target = layout("w", (8, 8), ShardingSpec(Mesh((2, 2)), [Replicate(), Shard(0)]))
    plan = plan_load([(4, 8)], [target], 4)
    reads = plan.arrays[0].reads
    assert len(reads) == 2
    assert sorted(sorted(t.rank for t in op.targets) for op in reads) == [[0, 2], [1, 3]]
    assert sum(plan.bytes_per_rank()) == 8 * 8 * 4  # every stored byte read once
    assert len({op.reader for op in reads}) == 2  # spread over ranks


def test_load_cuts_target_pieces_along_stored_chunks() -> None:
    target = layout("w", (10,), ExplicitRegions([[((1,), (7,))]]))
    reads = plan_load([(3,)], [target], 1).arrays[0].reads
    assert [(op.region.offset, op.region.shape) for op in reads] == [((1,), (2,)), ((3,), (3,)), ((6,), (2,))]


def test_plans_round_trip_through_json() -> None:
    spec = FlatRanges([(0, 7), (7, 30)])
    plan = plan_save([layout("f", (5, 6), spec), layout("r", (3,), ShardingSpec(Mesh(2), [Replicate()]))], 2)
    assert SavePlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    lp = plan_load([plan.arrays[0].chunk_shape], [layout("f", (5, 6), spec)], 2)
    assert LoadPlan.from_json(json.loads(json.dumps(lp.to_json()))) == lp


def test_chunk_shape_choice() -> None:
    opts = ChunkingOptions(single_chunk_bytes=1024, min_chunk_bytes=256, max_chunk_bytes=4096)
    one = ShardingSpec(Mesh(1), [Replicate()])
    assert chunk_shape((16,), one, opts) == (16,)  # small: one chunk
    assert chunk_shape((0, 5), one, opts) == (1, 5)  # zero-size
    four = ShardingSpec(Mesh(4), [Shard(0)])
    assert chunk_shape((64, 32), four, opts) == (16, 32)  # aligned, 2 KiB
    big = ShardingSpec(Mesh(2), [Shard(0)])
    assert chunk_shape((64, 64), big, opts) == (16, 64)  # shards of 8 KiB split to 4 KiB, still aligned


def test_a_ranks_part_is_built_once_per_layout_and_shared_by_its_layers() -> None:
    # A model's layers share a few layouts: a rank's writes follow from the layout and the
    # balancing decisions, so layers deciding alike share one tuple of writes (planning
    # 16,384 ranks' parts stays at the cost of a few layouts, not of every array).
    sharded = ShardingSpec(Mesh(4), [Shard(0)])
    layers = [layout(f"layers.{i}.w", (1024, 512), sharded) for i in range(6)]
    opts = ChunkingOptions(single_chunk_bytes=0)
    part = plan_save(layers, 4, rank=1, options=opts)
    assert len({id(a.writes) for a in part.arrays}) == 1
    assert part == plan_save(layers, 4, rank=1, options=opts)  # memoised and cold agree
    # merged chunks: what a rank sends is the same fragments whoever writes them
    flat = FlatRanges([(0, 7), (7, 20), (20, 30)])
    tiny = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=1000, max_chunk_bytes=40)
    merged = plan_save([layout(f"m{i}", (5, 6), flat) for i in range(6)], 3, rank=1, options=tiny)
    sent = [f for a in merged.arrays for op in a.writes if op.writer != 1 for f in op.sources]
    assert sent
    assert len({id(f) for f in sent}) < len(sent)


def test_a_ranks_load_part_is_built_once_per_layout_and_shared_by_its_layers() -> None:
    sharded = ShardingSpec(Mesh(4), [Shard(0)])
    layers = [layout(f"layers.{i}.w", (1024, 512), sharded) for i in range(6)]
    part = plan_load([(64, 512)] * 6, layers, 4, rank=2)
    assert len({id(a.reads) for a in part.arrays}) == 1
    # replicated targets: the reader rotates, the ranks receiving each region do not
    replicated = ShardingSpec(Mesh((2, 2)), [Replicate(), Shard(0)])
    part = plan_load([(64, 512)] * 6, [layout(f"r{i}", (1024, 512), replicated) for i in range(6)], 4, rank=2)
    targets = [op.targets for a in part.arrays for op in a.reads]
    assert len({id(t) for t in targets}) < len(targets)
    assert part == plan_load([(64, 512)] * 6, [layout(f"r{i}", (1024, 512), replicated) for i in range(6)], 4, rank=2)


def test_plan_objects_made_by_their_slots_are_the_ones_init_makes() -> None:
    """The planner makes its many small objects by setting their slots (``*_of``): every field is what
    the dataclass's ``__init__`` gives, and a field added and not set there fails here."""
    import dataclasses

    from pytreeckpt.core._region import Region, region_of
    from pytreeckpt.plan._types import (
        ArrayLoadPlan,
        ArraySavePlan,
        ArraySpec,
        Fragment,
        ReadOp,
        WriteOp,
        array_load_plan_of,
        array_save_plan_of,
        array_spec_of,
        fragment_of,
        read_of,
        write_of,
    )

    layout = ShardingSpec(Mesh((2, 2)), [Replicate(), Shard(0)])
    region = Region((0, 2), (3, 4))
    frag = Fragment(1, 0, region)
    write, read = WriteOp(region, 1, (frag,)), ReadOp(region, 1, (frag,))
    pairs = [
        (region_of((0, 2), (3, 4)), region),
        (fragment_of(1, 0, region), frag),
        (write_of(region, 1, (frag,)), write),
        (read_of(region, 1, (frag,)), read),
        (array_spec_of("w", (8, 4), 2, layout, (4, 5, 6, 7)), ArraySpec("w", (8, 4), 2, layout, (4, 5, 6, 7))),
        (array_spec_of("w", (8, 4), 2, layout, None), ArraySpec("w", (8, 4), 2, layout)),
        (array_save_plan_of("w", (8, 4), 2, (4, 4), (write,)), ArraySavePlan("w", (8, 4), 2, (4, 4), (write,))),
        (array_load_plan_of("w", (8, 4), 2, (read,)), ArrayLoadPlan("w", (8, 4), 2, (read,))),
    ]
    for made, want in pairs:
        assert type(made) is type(want)
        for f in dataclasses.fields(want):
            assert getattr(made, f.name) == getattr(want, f.name), (type(want).__name__, f.name)
        assert made == want
        assert hash(made) == hash(want)


def test_equal_scope_keys_are_one_object() -> None:
    """A scope's key is interned: the planner's dict of scopes finds it by identity, not by comparing its bytes."""
    import numpy as np

    from pytreeckpt.plan._balance import scope_key

    a = scope_key(np.arange(16384, dtype=np.int64))
    b = scope_key(list(range(16384)))
    assert a is b
    assert a == np.arange(16384, dtype=np.int64).tobytes()
    assert scope_key([1, 2]) is not a


def test_the_plan_cache_key_compares_shapes_by_value() -> None:
    """Every leaf's shape is a tuple of its own: equal shapes key alike, and one different shape keys apart."""
    from pytreeckpt import Mesh, Shard, ShardingSpec
    from pytreeckpt.plan import ArraySpec
    from pytreeckpt.plan._cache import spec_plan_key

    spec = ShardingSpec(Mesh(4), [Shard(0)])

    def specs(rows: list[int]) -> list[ArraySpec]:
        return [ArraySpec(f"w{i}", (r, 8), 4, spec) for i, r in enumerate(rows)]  # (a new tuple each)

    same = [16] * 300
    assert spec_plan_key(specs(same), 4) == spec_plan_key(specs(same), 4)
    other = [*same[:150], 32, *same[151:]]
    assert spec_plan_key(specs(other), 4) != spec_plan_key(specs(same), 4)
