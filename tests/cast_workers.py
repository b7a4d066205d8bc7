"""Worker functions run on several gloo ranks by tests/test_cast_strict.py: casts into DTensors, non-strict loads."""

from __future__ import annotations

from typing import Any

import torch

import pytreeckpt
from pytreeckpt import Abstract, Mesh, Shard, ShardingSpec


def special_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 values whose bfloat16 / float16 conversions round: ties, NaN, infinities, subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-40, 30, shape[-1])
    flat = x.view(-1)
    flat[:8] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -3e-39, 1.00390625, 1.01171875, 0.0])
    flat[8] = -0.0
    flat[9] = 3.0e38  # past float16's range: inf there
    return x


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def dtensor_cast(rank: int, world: int, path: str, inplace: bool) -> dict[str, Any]:
    """Save float32 / int64 DTensors sharded on dim 0, load them into bfloat16 / float16 / int32 targets sharded on
    dim 1 (resharded), with cast and strict=False; what each rank got, compared with ``Tensor.to``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor import Shard as TShard

    mesh = init_device_mesh("cpu", (world,))
    full = special_values((64, 40), 3)
    small = torch.arange(-5, 7, dtype=torch.int64) * 1_000_003
    state = {
        "w": distribute_tensor(full, mesh, [TShard(0)]),
        "v": distribute_tensor(full[:, :8].contiguous(), mesh, [Replicate()]),
        "n": small,
        "s": distribute_tensor(full, mesh, [TShard(0)]),
        "step": 3,
    }
    pytreeckpt.save(path, state)
    target_w = distribute_tensor(torch.zeros(64, 40, dtype=torch.bfloat16), mesh, [TShard(1)])
    target_v = distribute_tensor(torch.zeros(64, 8, dtype=torch.float16), mesh, [TShard(0)])
    target_n = torch.zeros(12, dtype=torch.int32)
    extra = torch.ones(3)
    target: dict[str, Any] = {"w": target_w, "v": target_v, "n": target_n, "extra": extra}
    if not inplace:  # an Abstract target: this rank's new shard of its spec
        target["s"] = Abstract((64, 40), torch.float16, ShardingSpec(Mesh(world), [Shard(1)]))
    report = pytreeckpt.LoadReport()
    out = pytreeckpt.load(path, target, cast=True, strict=False, inplace=inplace, report=report)
    want_w = distribute_tensor(full.to(torch.bfloat16), mesh, [TShard(1)]).to_local()
    want_v = distribute_tensor(full[:, :8].contiguous().to(torch.float16), mesh, [TShard(0)]).to_local()
    got: dict[str, Any] = {
        "missing": report.missing,
        "unexpected": report.unexpected,
        "cast": report.cast,
        "w_dtensor": isinstance(out["w"], DTensor) and out["w"].dtype == torch.bfloat16,
        "w": _bits(out["w"].to_local()) == _bits(want_w),
        "v": _bits(out["v"].to_local()) == _bits(want_v),
        "n": out["n"].dtype == torch.int32 and torch.equal(out["n"], small.to(torch.int32)),
        "extra_kept": out["extra"] is extra,
        "same_objects": out["w"] is target_w and out["v"] is target_v and out["n"] is target_n,
    }
    if not inplace:
        shard = out["s"].shards[rank]
        want_s = distribute_tensor(full.to(torch.float16), mesh, [TShard(1)]).to_local()
        got["s"] = shard.dtype == torch.float16 and _bits(shard) == _bits(want_s)
    return got


def disagreeing_casts(rank: int, world: int, path: str) -> str:
    """Ranks whose targets ask for different dtypes of one stored array: every rank raises, none reads."""
    full = special_values((16, 8), 5)
    pytreeckpt.save(path, {"w": full})
    dtype = torch.bfloat16 if rank == 0 else torch.float16
    try:
        pytreeckpt.load(path, {"w": torch.zeros(16, 8, dtype=dtype)}, cast=True)
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "loaded"
