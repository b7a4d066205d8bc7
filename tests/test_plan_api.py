"""pytreeckpt.plan_save and plan_load: the plans save() and load() run, one rank's at any world size."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import pytreeckpt
from pytreeckpt import Abstract, FlatRanges, Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec
from pytreeckpt.testing import SimComm

WORLD = 8


def _state(rank: int | None) -> dict[str, object]:
    """Every rank's shards (rank None), or one rank's, of a small state in three layouts."""
    full = {
        "w": torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48),
        "flat": torch.arange(100, dtype=torch.int16),
        "rep": torch.arange(10, dtype=torch.float64),
    }
    specs = {
        "w": ShardingSpec(Mesh((2, 4)), [Shard(1), Shard(0)]),
        "flat": FlatRanges([(0, 10), (10, 10), (10, 40), (40, 41), (41, 70), (70, 80), (80, 95), (95, 100)]),
        "rep": ShardingSpec(Mesh(WORLD), [Replicate()]),
    }
    out: dict[str, object] = {"step": 3}
    for k, t in full.items():
        leaf = ShardedLeaf.from_global(t, specs[k])
        out[k] = leaf if rank is None else ShardedLeaf(leaf.shape, leaf.dtype, leaf.spec, {rank: leaf.shards[rank]})
    return out


def _ops(plan: pytreeckpt.SavePlan, rank: int) -> list[object]:
    return [[(op.region, op.writer) for op in a.writes if op.writer == rank] for a in plan.arrays]


def test_plan_save_is_what_save_writes(tmp_path: Path) -> None:
    state = _state(None)
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=256, min_chunk_bytes=64, max_chunk_bytes=1024)
    plan = pytreeckpt.plan_save(state, chunking=chunking)
    pytreeckpt.save(tmp_path / "c", state, chunking=chunking)
    stored = pytreeckpt.metadata(tmp_path / "c").arrays
    assert [a.key for a in plan.arrays] == ["w", "flat", "rep"]
    for a in plan.arrays:
        assert stored[a.key].chunk_shape == a.chunk_shape
        covered = torch.zeros(a.shape, dtype=torch.int32)
        for op in a.writes:
            covered[op.region.slices()] += 1
        assert bool((covered == 1).all()), a.key  # every element written once


def test_a_simulated_rank_plans_its_part_of_the_whole_plan() -> None:
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=256, min_chunk_bytes=64, max_chunk_bytes=1024)
    whole = pytreeckpt.plan_save(_state(None), chunking=chunking)
    for rank in range(WORLD):
        comm = SimComm(rank, WORLD)
        part = pytreeckpt.plan_save(_state(rank), chunking=chunking, process_group=comm)
        assert _ops(part, rank) == _ops(whole, rank), rank
        assert [a.chunk_shape for a in part.arrays] == [a.chunk_shape for a in whole.arrays]
        if rank:  # a rank receives only rank 0's verdict that the ranks agree
            assert comm.received == [None]


def test_plan_load_reads_what_each_rank_wants_and_a_simulated_rank_its_part(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", _state(None))
    target = {
        "w": Abstract((64, 48), torch.float32, ShardingSpec(Mesh(4), [Shard(0)])),
        "flat": Abstract((100,), torch.int16, ShardingSpec(Mesh(WORLD), [Shard(0)])),
        "rep": Abstract((10,), torch.float64, ShardingSpec(Mesh(2), [Replicate()])),
        "step": 0,
    }
    whole = pytreeckpt.plan_load(tmp_path / "c", target)
    assert [a.key for a in whole.arrays] == ["w", "flat", "rep"]
    document = (tmp_path / "c" / "pytreeckpt.json").read_bytes()
    for rank in range(WORLD):
        comm = SimComm(rank, WORLD, document=document if rank else None)
        part = pytreeckpt.plan_load(tmp_path / "c", target, process_group=comm)
        for a, b in zip(part.arrays, whole.arrays, strict=True):
            wanted = [op for op in b.reads if any(t.rank == rank for t in op.targets)]
            assert list(a.reads) == wanted, (a.key, rank)


@pytest.mark.parametrize(
    ("target", "found"),
    [
        (
            Abstract((64, 40), torch.float32, ShardingSpec(Mesh(4), [Shard(0)])),
            "shape (64, 48), the target has (64, 40)",
        ),
        (Abstract((64, 48), torch.float64, ShardingSpec(Mesh(4), [Shard(0)])), "dtype float32, the target has float64"),
    ],
)
def test_a_rank_refuses_a_sharded_target_of_another_shape_or_dtype(
    tmp_path: Path, target: Abstract, found: str
) -> None:
    """A rank's new shard of a sharded Abstract target (the lean path of a distributed load) is checked as any."""
    pytreeckpt.save(tmp_path / "c", _state(None))
    document = (tmp_path / "c" / "pytreeckpt.json").read_bytes()
    with pytest.raises(pytreeckpt.TargetMismatchError, match=rf"leaf 'w': the checkpoint has {re.escape(found)}"):
        pytreeckpt.plan_load(tmp_path / "c", {"w": target}, process_group=SimComm(1, 4, document=document))


def _staged(rank: int | None, abstract: bool = False) -> dict[str, object]:
    """A two-stage pipeline over 8 ranks: stage 0's weights on ranks 0-3, stage 1's on ranks 4-7 (TP 2 x DP 2)."""
    spec = ShardingSpec(Mesh((2, 2), ("dp", "tp")), [Replicate(), Shard(0)])
    out: dict[str, object] = {}
    for stage in range(2):
        placement = range(4 * stage, 4 * stage + 4)
        full = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6) + 1000 * stage
        if abstract:
            out[f"stage{stage}.w"] = Abstract(full.shape, full.dtype, spec, placement)
            continue
        leaf = ShardedLeaf.from_global(full, spec, placement=placement)
        if rank is not None:
            mine = {p: t for p, t in leaf.shards.items() if placement[p] == rank}
            leaf = ShardedLeaf(leaf.shape, leaf.dtype, spec, mine, placement)
        out[f"stage{stage}.w"] = leaf
    return out


def test_a_placed_leaf_is_written_by_the_ranks_of_its_placement(tmp_path: Path) -> None:
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=64, min_chunk_bytes=16, max_chunk_bytes=256)
    whole = pytreeckpt.plan_save(_staged(None), chunking=chunking)
    writers = [{op.writer for op in a.writes} for a in whole.arrays]
    assert writers[0] <= {0, 1, 2, 3}
    assert writers[1] <= {4, 5, 6, 7}
    for rank in range(8):  # each rank's part, alone in a simulated world of 8: the same ops
        part = pytreeckpt.plan_save(_staged(rank), chunking=chunking, process_group=SimComm(rank, 8))
        assert _ops(part, rank) == _ops(whole, rank), rank
        abstract = pytreeckpt.plan_save(_staged(rank, True), chunking=chunking, process_group=SimComm(rank, 8))
        assert _ops(abstract, rank) == _ops(whole, rank), rank
    state = _staged(None)
    pytreeckpt.save(tmp_path / "c", state, chunking=chunking)
    back = pytreeckpt.load(tmp_path / "c", _staged(None, abstract=True))
    for k, leaf in state.items():
        got = back[k]
        assert isinstance(got, ShardedLeaf)
        assert isinstance(leaf, ShardedLeaf)
        assert got.placement == leaf.placement == (None if k.startswith("stage0") else range(4, 8))
        assert torch.equal(got.to_global(), leaf.to_global())


def test_a_placement_is_checked() -> None:
    spec = ShardingSpec(Mesh(4), [Shard(0)])
    with pytest.raises(pytreeckpt.LayoutError, match="4 positions but the placement gives 3"):
        Abstract((8,), torch.float32, spec, [1, 2, 3])
    with pytest.raises(pytreeckpt.LayoutError, match="distinct and non-negative"):
        Abstract((8,), torch.float32, spec, [1, 2, 2, 3])
    with pytest.raises(pytreeckpt.LayoutError, match="give a spec"):
        Abstract((8,), torch.float32, None, [0])
    assert Abstract((8,), torch.float32, spec, [4, 5, 6, 7]).placement == (4, 5, 6, 7)
    assert Abstract((8,), torch.float32, spec, range(4)).placement is None  # the identity
    with pytest.raises(pytreeckpt.LayoutError, match="4 positions but the placement gives 2"):
        Abstract((8,), torch.float32, spec, range(4, 6))
    leaf = Abstract((8,), torch.float32, spec, range(4, 8))
    with pytest.raises(pytreeckpt.CheckpointError, match="names rank 7 but the process group has 4"):
        pytreeckpt.plan_save({"w": leaf}, process_group=SimComm(0, 4))
    with pytest.raises(pytreeckpt.CheckpointError, match="Abstract placeholder, which has no data to save"):
        pytreeckpt.save("/nonexistent/never", {"w": leaf})


def test_a_single_process_plans_small_whole_arrays_as_the_planner_does(tmp_path: Path) -> None:
    """Arrays held whole in one chunk skip the planner's tables in save(): the plan is the planner's."""
    import numpy as np

    from pytreeckpt.plan import ArraySpec, plan_save

    tree = {
        "small": [
            torch.randn(3, 5),
            torch.tensor(2.0),
            np.arange(7, dtype=np.int8),
            torch.arange(12.0).reshape(3, 4).t(),
        ],
        "empty": torch.zeros(0, 4),
        "big": torch.zeros(600, 1000),  # 2.4 MB: more than single_chunk_bytes
        "edge": torch.zeros(256 * 1024),  # exactly single_chunk_bytes
        "value": 7,
    }
    one = ShardingSpec(Mesh(1), [Replicate()])
    leaves = {f"small.{i}": t for i, t in enumerate(tree["small"])} | {k: tree[k] for k in ("empty", "big", "edge")}
    arrays = [(k, tuple(t.shape), t.itemsize) for k, t in leaves.items()]
    expected = plan_save([ArraySpec(k, s, n, one) for k, s, n in sorted(arrays)], 1)
    got = pytreeckpt.plan_save(tree)
    assert sorted(got.arrays, key=lambda a: a.key) == list(expected.arrays)
    pytreeckpt.save(tmp_path / "c", tree)
    out = pytreeckpt.load(tmp_path / "c")
    assert torch.equal(out["small"][3], tree["small"][3])
    assert out["value"] == 7
