"""Ranks of tests/test_dcp_export.py: a save of DTensors by pytreeckpt, loads of its DCP export by DCP."""

from __future__ import annotations

from typing import Any

import torch

import pytreeckpt


def original() -> dict[str, Any]:
    """The state every test saves, as global tensors and values."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "w": torch.randn(10, 6, generator=g),
            "b": torch.randn(5, generator=g),
            "layers": [{"k": torch.randn(4, 8, generator=g).to(torch.bfloat16)}],
        },
        "optim": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}]},
        "step": 7,
        "name": "run",
    }


def save_dtensors(rank: int, world: int, path: str) -> None:
    """``original()`` saved by pytreeckpt from DTensors on a 1-D mesh of ``world`` ranks, with a per-rank part."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    s = original()
    m = s["model"]
    m["w"] = distribute_tensor(m["w"], mesh, [Shard(0)])
    m["b"] = distribute_tensor(m["b"], mesh, [Replicate()])
    m["layers"][0]["k"] = distribute_tensor(m["layers"][0]["k"], mesh, [Shard(1)])
    s["rng"] = {"seed": torch.tensor([100 + rank])}
    pytreeckpt.save(path, s, spec={"rng": pytreeckpt.PER_RANK})


def dcp_load_resharded(rank: int, world: int, path: str) -> dict[str, Any]:
    """torch.distributed.checkpoint.load of an export into DTensors placed otherwise than they were saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    target: dict[str, Any] = {
        "model": {
            "w": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)]),
            "b": distribute_tensor(torch.zeros(5), mesh, [Shard(0)]),
            "layers": [{"k": distribute_tensor(torch.zeros(4, 8, dtype=torch.bfloat16), mesh, [Replicate()])}],
        },
        "optim": {"param_groups": [{"lr": 0.0, "betas": None, "params": None}]},
        "step": 0,
        "name": "",
        "rng": {"rank1": {"seed": torch.zeros(1, dtype=torch.int64)}},
    }
    dcp.load(target, checkpoint_id=path)
    m = target["model"]
    return {
        "w": m["w"].full_tensor(),
        "b": m["b"].full_tensor(),
        "k": m["layers"][0]["k"].full_tensor().view(torch.int16),  # (bf16's bits: the result queue takes numpy)
        "w_local": tuple(m["w"].to_local().shape),
        "values": (target["step"], target["name"], target["optim"]),
        "seed1": target["rng"]["rank1"]["seed"],
    }
