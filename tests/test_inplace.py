"""load(..., inplace=True): the target's own tensors are filled with the stored values and returned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import unpacked
from multiproc import run_world

import pytreeckpt
from pytreeckpt import Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=g),
        "half": torch.randn(33, 7, generator=g).to(torch.bfloat16),
        "ints": torch.randint(-1000, 1000, (5, 9), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(float(seed)),
        "param": torch.nn.Parameter(torch.randn(16, 16, generator=g)),
        "np": np.arange(12, dtype=np.float32).reshape(3, 4) * seed,
        "step": seed,
    }


def _bits(x: Any) -> bytes:
    if isinstance(x, np.ndarray):
        return x.tobytes()
    return bytes(x.detach().contiguous().view(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("store", ["packed", "files", "zstd"])
def test_a_load_in_place_returns_the_targets_own_tensors_filled(tmp_path: Path, store: str) -> None:
    saved = _state(1)
    where: Any = tmp_path / "c" if store != "files" else unpacked(tmp_path / "c")
    pytreeckpt.save(where, saved, compression="zstd" if store == "zstd" else None)
    target = _state(2)
    ids = {k: id(v) for k, v in target.items()}
    pointers = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    out = pytreeckpt.load(where, target, inplace=True)
    for k in ("w", "half", "ints", "scalar", "param", "np"):
        assert id(out[k]) == ids[k], k  # the very objects of the target
        assert _bits(out[k]) == _bits(saved[k]), k  # holding the stored values, bit for bit
    assert all(out[k].data_ptr() == p for k, p in pointers.items())  # in their own memory
    assert isinstance(out["param"], torch.nn.Parameter)
    assert out["param"].requires_grad
    assert out["step"] == 1  # a plain value comes back as stored


def test_views_that_cannot_take_reads_directly_are_filled_through_a_buffer(tmp_path: Path) -> None:
    saved = {"t": torch.arange(24.0).reshape(4, 6), "n": np.arange(6, dtype=np.int32)}
    pytreeckpt.save(tmp_path / "c", saved)
    base = torch.zeros(6, 4)
    strided = np.zeros(12, dtype=np.int32)[::2]  # not contiguous
    target = {"t": base.t(), "n": strided}  # a transposed view: not contiguous
    out = pytreeckpt.load(tmp_path / "c", target, inplace=True)
    assert out["t"] is target["t"]
    assert out["n"] is strided
    assert torch.equal(base, saved["t"].t())  # the memory under the view was written
    assert np.array_equal(strided, saved["n"])


def test_a_sharded_leaf_is_filled_in_place_in_another_layout(tmp_path: Path) -> None:
    full = torch.arange(60.0).reshape(10, 6)
    pytreeckpt.save(tmp_path / "c", {"w": ShardedLeaf.from_global(full, ShardingSpec(Mesh(2), [Shard(0)]))})
    spec = ShardingSpec(Mesh((3, 2)), [Shard(1), Replicate()])
    target = ShardedLeaf.from_global(torch.zeros(10, 6), spec)
    shards = dict(target.shards)
    out = pytreeckpt.load(tmp_path / "c", {"w": target}, inplace=True)
    assert out["w"] is target
    for r, t in out["w"].shards.items():
        assert t is shards[r]
    assert torch.equal(out["w"].to_global(), full)


def test_a_mismatched_target_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"a": torch.ones(4), "b": torch.ones(3)})
    target = {"a": torch.zeros(4), "b": torch.zeros(3, dtype=torch.float64)}
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"leaf 'b'.*float32.*float64"):
        pytreeckpt.load(tmp_path / "c", target, inplace=True)
    assert torch.equal(target["a"], torch.zeros(4))  # untouched


def test_a_failed_load_in_place_says_the_target_may_be_partly_overwritten(tmp_path: Path) -> None:
    pytreeckpt.save(unpacked(tmp_path / "c"), {"a": torch.ones(4)})
    chunk = next(p for p in (tmp_path / "c" / "arrays").rglob("c/*") if p.is_file())
    chunk.write_bytes(b"\0" * chunk.stat().st_size)  # its checksum no longer matches
    with pytest.raises(pytreeckpt.CheckpointError) as caught:
        pytreeckpt.load(tmp_path / "c", {"a": torch.zeros(4)}, inplace=True)
    assert "may hold part of the checkpoint" in "".join(caught.value.__notes__)


def test_in_place_needs_a_target(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"a": torch.ones(4)})
    with pytest.raises(pytreeckpt.CheckpointError, match="pass target"):
        pytreeckpt.load(tmp_path / "c", inplace=True)


def _dtensor_in_place(rank: int, world: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor import distribute_tensor

    full = torch.arange(96.0).reshape(12, 8)
    mesh = init_device_mesh("cpu", (world,))
    pytreeckpt.save(path, {"w": distribute_tensor(full, mesh, [DShard(0)]), "step": 3})
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    target = {"w": distribute_tensor(torch.zeros(12, 8), mesh2, [DShard(1), DReplicate()]), "step": 0}
    local = target["w"].to_local()
    out = pytreeckpt.load(path, target, inplace=True)
    same = out["w"] is target["w"] and out["w"].to_local().data_ptr() == local.data_ptr()
    return bool(same and torch.equal(out["w"].full_tensor(), full) and out["step"] == 3)


def test_dtensors_are_filled_in_place_across_ranks_in_another_layout(tmp_path: Path) -> None:
    assert run_world(4, _dtensor_in_place, str(tmp_path / "c")) == [True] * 4
