"""Worker functions run on several gloo ranks by tests/test_distributed.py."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import pytreeckpt
from pytreeckpt import FlatRanges, ShardedLeaf

VOCAB, DIM, SEQ, BATCH = 64, 32, 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def build(world: int, layout: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, int, int]:
    """A model in ``layout`` ("plain", "fsdp" or "fsdp_tp"); returns (model, optimizer, dp rank, dp size)."""
    torch.manual_seed(seed)
    model = TinyTransformer()
    if layout == "plain":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2), 0, 1
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        dp_mesh = mesh
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for b in model.blocks:
        fully_shard(b, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), dp_mesh.get_local_rank(), dp_mesh.size()


def train(
    model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int, dp_rank: int, dp_size: int
) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        batch = global_batch(step)[dp_rank::dp_size]
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        reported = loss.detach().clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(reported)
            reported /= dist.get_world_size()
        losses.append(float(reported))
    return losses


def _state_dicts(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return get_model_state_dict(model), get_optimizer_state_dict(model, opt)


def _full(sd: Any) -> Any:
    """Every DTensor of a state dict as a full tensor (collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(sd, dict):
        return {k: _full(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [_full(v) for v in sd]
    if isinstance(sd, DTensor):
        return sd.full_tensor().clone()  # (on one rank the full tensor may be the local tensor itself)
    if isinstance(sd, torch.Tensor):
        return sd.clone()
    return sd


def fsdp_train_and_save(rank: int, world: int, path: str, steps: int, more: int) -> dict[str, Any]:
    """Train ``steps`` steps on an FSDP2 model, save, then train ``more`` steps (the uninterrupted run)."""
    model, opt, dp_rank, dp_size = build(world, "fsdp", seed=0)
    train(model, opt, 0, steps, dp_rank, dp_size)
    msd, osd = _state_dicts(model, opt)
    pytreeckpt.save(path, {"model": msd, "optim": osd, "step": steps})
    full = {"model": _full(msd), "optim": _full(osd)}
    losses = train(model, opt, steps, more, dp_rank, dp_size)
    return {"losses": losses, "state": full if rank == 0 else None}


def fsdp_resume(rank: int, world: int, path: str, layout: str, more: int) -> dict[str, Any]:
    """Resume in ``layout`` from a checkpoint and train ``more`` steps."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    model, opt, dp_rank, dp_size = build(world, layout, seed=123)  # other init: the load must matter
    msd, osd = _state_dicts(model, opt)
    loaded = pytreeckpt.load(path, {"model": msd, "optim": osd, "step": 0})
    set_model_state_dict(model, loaded["model"])
    set_optimizer_state_dict(model, opt, loaded["optim"])
    full = {"model": _full(loaded["model"]), "optim": _full(loaded["optim"])}
    losses = train(model, opt, loaded["step"], more, dp_rank, dp_size)
    return {"losses": losses, "state": full if rank == 0 else None, "step": loaded["step"]}


def fsdp_resume_in_place(rank: int, world: int, path: str, layout: str, more: int) -> dict[str, Any]:
    """Resume as examples/fsdp2_resume.py does: load in place into the model's own state dict, then train."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model, opt, dp_rank, dp_size = build(world, layout, seed=123)  # other init: the load must matter
    msd, osd = _state_dicts(model, opt)
    target = {"model": msd, "optim": osd, "step": 0}
    loaded = pytreeckpt.load(path, target, inplace=True)
    same = all(loaded["model"][k] is v for k, v in msd.items())
    set_optimizer_state_dict(model, opt, loaded["optim"])
    again, _ = _state_dicts(model, opt)  # the model's state as the model now holds it
    full = {"model": _full(again), "optim": _full(loaded["optim"])}
    losses = train(model, opt, loaded["step"], more, dp_rank, dp_size)
    return {"losses": losses, "state": full if rank == 0 else None, "step": loaded["step"], "same": same}


# --------------------------------------------------------------------------- byte counting


class _Counter:
    """Counts the bytes this rank hands to TensorStore, by wrapping the executor's entry points."""

    def __init__(self) -> None:
        from pytreeckpt.loading import _run as _load
        from pytreeckpt.saving import _job as _save

        self.written = 0
        self.read = 0
        orig_write, orig_read = _save.write_arrays, _load.read_arrays
        counter = self

        def write(self: Any, *args: Any, **kwargs: Any) -> int:
            n = orig_write(self, *args, **kwargs)
            counter.written += n
            return n

        def read(self: Any, *args: Any, **kwargs: Any) -> int:
            n = orig_read(self, *args, **kwargs)
            counter.read += n
            return n

        _save.write_arrays = write  # type: ignore[assignment]
        _load.read_arrays = read  # type: ignore[assignment]


def count_bytes(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save a sharded + replicated state at ``world`` ranks; count bytes written and read per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    counter = _Counter()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    big = torch.randn(64, 1024)  # 256 KiB, sharded
    rep = torch.randn(96, 1024)  # 384 KiB, replicated DTensor
    plain = torch.randn(32, 1024)  # 128 KiB, plain tensor on every rank
    small = [torch.randn(100) for _ in range(20)]  # small replicated leaves
    state = {
        "big": distribute_tensor(big, mesh, [Shard(0)]),
        "rep": distribute_tensor(rep, mesh, [Replicate()]),
        "plain": plain,
        "small": small,
    }
    pytreeckpt.save(
        path, state, chunking=pytreeckpt.ChunkingOptions(single_chunk_bytes=64 * 1024, max_chunk_bytes=64 * 1024)
    )
    written = counter.written
    # Load at the same ranks into other layouts: big replicated; rep sharded on dim 1.
    target = {
        "big": distribute_tensor(torch.zeros(64, 1024), mesh, [Replicate()]),
        "rep": distribute_tensor(torch.zeros(96, 1024), mesh, [Shard(1)]),
        "plain": torch.zeros(32, 1024),
        "small": [torch.zeros(100) for _ in range(20)],
    }
    out = pytreeckpt.load(path, target)
    ok = (
        torch.equal(out["big"].full_tensor(), big)
        and torch.equal(out["rep"].full_tensor(), rep)
        and torch.equal(out["plain"], plain)
        and all(torch.equal(a, b) for a, b in zip(out["small"], small, strict=True))
    )
    return {"written": written, "read": counter.read, "ok": ok}


# --------------------------------------------------------------------------- irregular layouts


def flat_save(rank: int, world: int, path: str) -> None:
    """FSDP1-style: each rank holds a flat range of every parameter."""
    torch.manual_seed(0)
    params = {"w": torch.randn(10, 7), "b": torch.randn(13)}
    state = {}
    for k, t in params.items():
        n = t.numel()
        per = math.ceil(n / world)
        spec = FlatRanges([(min(r * per, n), min((r + 1) * per, n)) for r in range(world)])
        mine = t.reshape(-1)[min(rank * per, n) : min((rank + 1) * per, n)].clone()
        state[k] = ShardedLeaf(t.shape, t.dtype, spec, {rank: mine})
    pytreeckpt.save(path, state)


def load_shard0_dtensors(rank: int, world: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    expected = {"w": torch.randn(10, 7), "b": torch.randn(13)}
    mesh = init_device_mesh("cpu", (world,))
    target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in expected.items()}
    out = pytreeckpt.load(path, target)
    return all(out[k].placements == (Shard(0),) and torch.equal(out[k].full_tensor(), v) for k, v in expected.items())


def strided_roundtrip(rank: int, world: int, path: str) -> dict[str, Any]:
    """A 1-D mesh with _StridedShard: rank 0 holds rows 0 and 4 (torch.distributed.checkpoint rejects this)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world,))
    g = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    dt = distribute_tensor(g, mesh, [_StridedShard(0, split_factor=2)])
    rows = dt.to_local()[:, 0].div(3).long().tolist()
    pytreeckpt.save(path, {"s": dt})
    back = pytreeckpt.load(path, {"s": distribute_tensor(torch.zeros(8, 3), mesh, [_StridedShard(0, split_factor=2)])})
    resharded = pytreeckpt.load(path, {"s": distribute_tensor(torch.zeros(8, 3), mesh, [Shard(1)])})
    return {
        "rows": rows,
        "same": torch.equal(back["s"].to_local(), dt.to_local()),
        "resharded": torch.equal(resharded["s"].full_tensor(), g),
    }


def failing_save(rank: int, world: int, path: str, bad_rank: int) -> str:
    """``bad_rank``'s writes fail; every rank must raise and nothing may be committed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pytreeckpt.saving import _job as _save

    if rank == bad_rank:

        def broken(self: Any, *args: Any, **kwargs: Any) -> int:
            raise OSError(28, "No space left on device (injected)")

        _save.write_arrays = broken  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]), "step": 1}
    try:
        pytreeckpt.save(path, state)
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "no error"


def partial_and_conversions(rank: int, world: int) -> dict[str, Any]:
    """A Partial DTensor is refused with a clear error; specs convert both ways."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    partial = DTensor.from_local(torch.ones(4), mesh, [Shard(0), Partial()], run_check=False)
    try:
        pytreeckpt.save("/nonexistent/never-written", {"p": partial})
        error = "no error"
    except pytreeckpt.CheckpointError as e:
        error = str(e)
    dt = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    spec, ranks = pytreeckpt.spec_from_dtensor(dt)
    back = pytreeckpt.placements_from_spec(spec)
    return {"error": error, "roundtrip": tuple(back) == tuple(dt.placements), "ranks": ranks, "mesh": spec.mesh.shape}


def direct_state_dict_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """model.state_dict() of an FSDP2 model, saved directly (no state_dict helpers)."""
    model, _, _, _ = build(world, "fsdp", seed=7)
    sd = model.state_dict()
    pytreeckpt.save(path, {"model": sd})
    full = _full(sd)  # collective: every rank takes part
    return {"full": full if rank == 0 else None}


def direct_state_dict_load(rank: int, world: int, path: str) -> dict[str, Any]:
    model, _, _, _ = build(world, "fsdp", seed=99)
    loaded = pytreeckpt.load(path, {"model": model.state_dict()})
    model.load_state_dict(loaded["model"])
    full = _full(model.state_dict())
    return {"full": full if rank == 0 else None}


def manager_steps(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every rank runs a CheckpointManager over the same directory; rank 0 lists and deletes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    with pytreeckpt.CheckpointManager(directory, max_to_keep=2) as m:
        for step in range(1, 5):
            m.save(step, {"w": distribute_tensor(torch.full((4, 2), float(step)), mesh, [Shard(0)]), "step": step})
        m.wait()
        target = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(1)]), "step": 0}
        restored = m.restore(target=target)
        return {
            "steps": m.all_steps(),
            "latest": m.latest_step(),
            "restored": float(restored["w"].full_tensor()[0, 0]),
        }


def dcp_save(rank: int, world: int, path: str) -> None:
    """A torch.distributed.checkpoint directory written by ``world`` ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    w, r = torch.randn(10, 6), torch.randn(5)
    state = {
        "model": {"w": distribute_tensor(w, mesh, [Shard(0)]), "r": distribute_tensor(r, mesh, [Replicate()])},
        "step": 7,
        "meta": {"name": "run", "lrs": [0.1, 0.01]},
    }
    dcp.save(state, checkpoint_id=path)


def dcp_imported_load(rank: int, world: int, path: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    w, r = torch.randn(10, 6), torch.randn(5)
    target = {"model.w": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)]), "model.r": torch.zeros(5), "step": 0}
    out = pytreeckpt.load(path, target, strict=False)  # (not the stored meta.*)
    return torch.equal(out["model.w"].full_tensor(), w) and torch.equal(out["model.r"], r) and out["step"] == 7


# --------------------------------------------------------------------------- async pipeline


def async_monitored_save(rank: int, world: int, path: str) -> dict[str, Any]:
    """async_save of sharded, replicated and flat-range leaves through a small staging pool, with a monitor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    big = torch.randn(256, 1024)  # 1 MiB, sharded
    plain = torch.randn(64, 1024)  # replicated on every rank
    flat = torch.randn(37, 11)  # flat ranges: chunks straddle ranks and are merged
    n = flat.numel()
    per = math.ceil(n / world)
    spec = FlatRanges([(min(r * per, n), min((r + 1) * per, n)) for r in range(world)])
    mine = flat.reshape(-1)[rank * per : (rank + 1) * per].clone()
    state = {
        "big": distribute_tensor(big, mesh, [Shard(0)]),
        "plain": plain.clone(),
        "flat": ShardedLeaf(flat.shape, flat.dtype, spec, {rank: mine}),
    }
    monitor = pytreeckpt.Monitor()
    opts = pytreeckpt.ExecutorOptions(staging_bytes=64 * 1024, staging_piece_bytes=32 * 1024)
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=16 * 1024, max_chunk_bytes=16 * 1024)
    h = pytreeckpt.async_save(path, state, executor=opts, chunking=chunking, monitor=monitor)
    state["big"].to_local().zero_()  # training goes on
    state["plain"].zero_()
    state["flat"].shards[rank].zero_()
    h.wait()
    loaded = pytreeckpt.Monitor()
    target = {"big": torch.zeros(256, 1024), "plain": torch.zeros(64, 1024), "flat": flat * 0}
    out = pytreeckpt.load(path, target, monitor=loaded)
    same = torch.equal(out["big"], big) and torch.equal(out["plain"], plain) and torch.equal(out["flat"], flat)
    return {
        "load_ranks": sorted({s.rank for s in loaded.spans}),
        "load_phases": sorted({s.phase for s in loaded.spans}),
        "same": same,
        "ranks": sorted({s.rank for s in monitor.spans}),
        "phases": sorted({s.phase for s in monitor.spans}),
        "written": sum(s.nbytes for s in monitor.spans if s.phase == "write"),
        "peak": pytreeckpt.execute._staging.staging_pool().peak_bytes,
    }


def incremental_saves(rank: int, world: int, path: str) -> dict[str, Any]:
    """Two saves of Shard(0) DTensors; between them only rank 0's shard of one tensor changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    a, b = torch.randn(256, 1024), torch.randn(256, 1024)
    state = {"a": distribute_tensor(a, mesh, [Shard(0)]), "b": distribute_tensor(b, mesh, [Shard(0)])}
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=64 * 1024, max_chunk_bytes=64 * 1024)
    full = pytreeckpt.Monitor()
    pytreeckpt.save(f"{path}/s1", state, chunking=chunking, chunk_hashes=True, monitor=full)
    if rank == 0:
        state["a"].to_local().add_(1.0)
    inc = pytreeckpt.Monitor()
    h = pytreeckpt.async_save(f"{path}/s2", state, chunking=chunking, base=f"{path}/s1", monitor=inc)
    h.wait()
    out = pytreeckpt.load(f"{path}/s2", {"a": torch.zeros(256, 1024), "b": torch.zeros(256, 1024)})
    a_now = a.clone()
    a_now[: 256 // world] += 1.0
    return {
        "same": torch.equal(out["a"], a_now) and torch.equal(out["b"], b),
        "full": sum(s.nbytes for s in full.spans if s.phase == "write"),
        "inc": sum(s.nbytes for s in inc.spans if s.phase == "write"),
        "hashes": pytreeckpt.metadata(f"{path}/s2").arrays["a"].chunk_hashes is not None,
    }


# --------------------------------------------------------------------------- a world of one, sub-meshes, groups


def _locals_equal(got: Any, full: torch.Tensor) -> bool:
    """A loaded DTensor holds what torch itself puts on this rank for its mesh and placements (nothing off its mesh)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    want = distribute_tensor(full, got.device_mesh, got.placements).to_local()
    return isinstance(got, DTensor) and torch.equal(got.to_local(), want)


class _GroupCounter:
    """Counts the process groups made while it is on (torch.distributed.new_group calls)."""

    def __init__(self) -> None:
        self.made = 0
        self._orig = dist.new_group

    def __enter__(self) -> _GroupCounter:
        def counting(*args: Any, **kwargs: Any) -> Any:
            self.made += 1
            return self._orig(*args, **kwargs)

        dist.new_group = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.new_group = self._orig


def world_of_one(rank: int, world: int, directory: str) -> dict[str, Any]:
    """An FSDP2 model on a world of one rank: save, async_save, a manager and loads, all with DTensors."""
    from torch.distributed.tensor import DTensor

    model, opt, dp_rank, dp_size = build(world, "fsdp", seed=0)
    train(model, opt, 0, 1, dp_rank, dp_size)
    msd, osd = _state_dicts(model, opt)
    state = {"model": msd, "optim": osd, "step": 1}
    full = {"model": _full(msd), "optim": _full(osd)}
    other, other_opt, _, _ = build(world, "fsdp", seed=5)  # another init: the loads must matter
    train(other, other_opt, 0, 1, dp_rank, dp_size)
    tmsd, tosd = _state_dicts(other, other_opt)
    target = {"model": tmsd, "optim": tosd, "step": 0}
    got: dict[str, Any] = {}
    with _GroupCounter() as groups:
        pytreeckpt.save(f"{directory}/save", state)
        pytreeckpt.async_save(f"{directory}/async", state).wait()
        pytreeckpt.save(f"{directory}/group", state, process_group=dist.group.WORLD)
        with pytreeckpt.CheckpointManager(f"{directory}/manager", max_to_keep=1) as m:
            m.save(1, state)
            m.wait()
            got["manager"] = m.restore(target=target)
        got["save"] = pytreeckpt.load(f"{directory}/save", target)
        got["async"] = pytreeckpt.load(f"{directory}/async", target)
        got["group"] = pytreeckpt.load(f"{directory}/group", target, process_group=dist.group.WORLD)
    dtensors = all(
        isinstance(v, DTensor) for g in got.values() for v in g["model"].values() if isinstance(v, torch.Tensor)
    )
    return {
        "full": full,
        "got": {k: {"model": _full(g["model"]), "optim": _full(g["optim"]), "step": g["step"]} for k, g in got.items()},
        "dtensors": dtensors,
        "groups_made": groups.made,
    }


def sub_meshes(rank: int, world: int, path: str) -> dict[str, Any]:
    """DTensors whose meshes cover some ranks only: two halves of the world and a ``mesh["tp"]`` slice."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    first, second = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [2, 3])
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = {"a": torch.randn(6, 4), "b": torch.randn(5, 3), "c": torch.randn(8, 2)}
    state = {
        "a": distribute_tensor(full["a"], first, [Shard(0)]),  # ranks 2 and 3 hold nothing of it
        "b": distribute_tensor(full["b"], second, [Shard(1)]),  # ranks 0 and 1 hold nothing of it
        "c": distribute_tensor(full["c"], grid["tp"], [Shard(0)]),  # each tp pair holds a copy
        "step": 3,
    }

    def target() -> dict[str, Any]:
        return {
            "a": distribute_tensor(torch.zeros(6, 4), second, [Replicate()]),
            "b": distribute_tensor(torch.zeros(5, 3), first, [Shard(0)]),
            "c": distribute_tensor(torch.zeros(8, 2), grid["dp"], [Shard(1)]),
            "step": 0,
        }

    pytreeckpt.save(f"{path}/save", state)
    pytreeckpt.async_save(f"{path}/async", state).wait()
    loaded = {name: pytreeckpt.load(f"{path}/{name}", target()) for name in ("save", "async")}
    with pytreeckpt.CheckpointManager(f"{path}/manager") as m:
        m.save(1, state)
        m.wait()
        loaded["manager"] = m.restore(target=target())
    plain = pytreeckpt.load(f"{path}/save", {k: torch.zeros_like(v) for k, v in full.items()}, strict=False)
    return {
        "locals": {name: all(_locals_equal(got[k], v) for k, v in full.items()) for name, got in loaded.items()},
        "steps": [got["step"] for got in loaded.values()],
        "plain": all(torch.equal(plain[k], v) for k, v in full.items()),
        "held": state["a"].to_local().numel(),
    }


def subset_groups(rank: int, world: int, path: str) -> dict[str, Any]:
    """Pipeline stages save and load on their own process groups (one stage alone, then both); then groups
    of one rank, then the whole world."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    ones = [DeviceMesh("cpu", [r]) for r in range(world)]  # every rank makes every one-rank mesh
    stage_mesh, group = grid["dp"], grid.get_group("dp")
    coordinate = grid.get_coordinate()
    assert coordinate is not None
    stage = coordinate[0]
    torch.manual_seed(stage)
    w, b = torch.randn(6, 4), torch.full((3,), float(stage))
    state = {"w": distribute_tensor(w, stage_mesh, [Shard(0)]), "b": b.clone(), "stage": stage}

    def target() -> dict[str, Any]:
        return {"w": distribute_tensor(torch.zeros(6, 4), stage_mesh, [Shard(1)]), "b": torch.zeros(3), "stage": -1}

    def round_trip(where: str) -> dict[str, bool]:
        pytreeckpt.save(f"{where}/save", state, process_group=group)
        pytreeckpt.async_save(f"{where}/async", state, process_group=group).wait()
        loaded = {name: pytreeckpt.load(f"{where}/{name}", target(), process_group=group) for name in ("save", "async")}
        with pytreeckpt.CheckpointManager(f"{where}/manager", process_group=group) as m:
            m.save(1, state)
            m.wait()
            loaded["manager"] = m.restore(target=target())
        return {
            name: _locals_equal(got["w"], w) and torch.equal(got["b"], b) and got["stage"] == stage
            for name, got in loaded.items()
        }

    # Stage 0 alone first: the ranks of stage 1 take no part in making its groups.
    first = round_trip(f"{path}/first") if stage == 0 else {}
    # Then both stages at once, each on its own group.
    same = round_trip(f"{path}/stage{stage}")
    # A group of this rank alone, with a DTensor on its one-rank mesh.
    mine = ones[rank]
    x = torch.arange(4.0) + rank
    pytreeckpt.save(f"{path}/solo{rank}", {"x": distribute_tensor(x, mine, [Shard(0)])}, process_group=mine.get_group())
    solo = pytreeckpt.load(
        f"{path}/solo{rank}",
        {"x": distribute_tensor(torch.zeros(4), mine, [Replicate()])},
        process_group=mine.get_group(),
    )
    # Then the whole world, without a group: its checkpoint groups are unaffected by the others.
    g = torch.arange(48.0).reshape(8, 6)
    pytreeckpt.save(f"{path}/world", {"g": distribute_tensor(g, grid, [Shard(0), Shard(1)])})
    whole = pytreeckpt.load(f"{path}/world", {"g": torch.zeros(8, 6)})
    return {
        "stage": stage,
        "first": first,
        "same": same,
        "solo": _locals_equal(solo["x"], x),
        "world": torch.equal(whole["g"], g),
    }


# --------------------------------------------------------------------------- one rank's error


def one_rank_fails(rank: int, world: int, path: str) -> list[dict[str, Any]]:
    """One rank at a time fails before any collective (a bad leaf, a meta tensor, another tree, another target).

    Every case records what each rank raised and how long it took; after each, a save
    and a load, and a collective on the default group, must still work.
    """
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = torch.arange(8.0).reshape(4, 2)

    def good() -> dict[str, Any]:
        return {"w": distribute_tensor(w, mesh, [Shard(0)]), "b": torch.ones(3), "step": 1}

    def meta_dtensor() -> Any:
        return DTensor.from_local(torch.empty(2, 2, device="meta"), mesh, [Shard(0)], run_check=False)

    pytreeckpt.save(f"{path}/base", good())
    spec = pytreeckpt.ShardingSpec(pytreeckpt.Mesh(world), [pytreeckpt.Shard(0)])
    out: list[dict[str, Any]] = []
    for bad in range(world):
        me = rank == bad

        def save_meta_tensor(me: bool = me) -> None:
            pytreeckpt.save(f"{path}/x", {**good(), "b": torch.empty(3, device="meta") if me else torch.ones(3)})

        def save_meta_dtensor(me: bool = me) -> None:
            tree = good()  # (every rank makes it: distribute_tensor is a collective)
            pytreeckpt.save(f"{path}/x", {**tree, "w": meta_dtensor()} if me else tree)

        def async_save_bad_spec(me: bool = me) -> None:
            specs = {"w": None, "b": spec if me else None, "step": None}
            pytreeckpt.async_save(f"{path}/x", good(), specs).wait()

        def async_save_meta_dtensor(me: bool = me) -> None:
            tree = good()
            pytreeckpt.async_save(f"{path}/x", {**tree, "w": meta_dtensor()} if me else tree).wait()

        def save_another_tree(me: bool = me) -> None:
            pytreeckpt.save(f"{path}/x", {**good(), "extra": torch.ones(2)} if me else good())

        def load_another_shape(me: bool = me) -> None:
            pytreeckpt.load(f"{path}/base", {**good(), "b": torch.zeros(4 if me else 3)})

        def load_another_tree(me: bool = me) -> None:
            pytreeckpt.load(f"{path}/base", {**good(), "extra": torch.ones(2)} if me else good())

        def load_from_nowhere(me: bool = me) -> None:  # (rank 0 sends the document, or its failure, to the others)
            pytreeckpt.load("nosuch://x" if me else f"{path}/base", good())

        cases = [
            ("save_meta_tensor", "b", save_meta_tensor),
            ("save_meta_dtensor", "w", save_meta_dtensor),
            ("async_save_bad_spec", "b", async_save_bad_spec),
            ("async_save_meta_dtensor", "w", async_save_meta_dtensor),
            ("save_another_tree", "extra", save_another_tree),
            ("load_another_shape", "b", load_another_shape),
            ("load_another_tree", "extra", load_another_tree),
            ("load_from_nowhere", None, load_from_nowhere),
        ]
        if bad == 0:  # a step after the exchange that only rank 0 takes: the committed checkpoint is not replaced

            def save_over_committed() -> None:
                pytreeckpt.save(f"{path}/base", good())

            cases.append(("save_over_committed", None, save_over_committed))
        for name, leaf, fn in cases:
            start = time.perf_counter()
            try:
                fn()
                kind, message, checkpoint_error = "none", "no error", False
            except Exception as e:
                kind, message = type(e).__name__, str(e)
                checkpoint_error = isinstance(e, pytreeckpt.CheckpointError)
            seconds = time.perf_counter() - start
            # The checkpoint's groups and the default group are still usable.
            n = len(out)
            pytreeckpt.save(f"{path}/after{n}", good())
            back = pytreeckpt.load(f"{path}/after{n}", {"w": torch.zeros(4, 2), "b": torch.zeros(3), "step": 0})
            total = torch.ones(1)
            dist.all_reduce(total)
            out.append(
                {
                    "case": name,
                    "bad": bad,
                    "leaf": leaf,
                    "kind": kind,
                    "message": message,
                    "checkpoint_error": checkpoint_error,
                    "seconds": seconds,
                    "after": torch.equal(back["w"], w) and float(total) == world,
                }
            )
    return out


def collective_bytes(rank: int, world: int, path: str) -> dict[str, int]:
    """The bytes this rank receives through object collectives inside one save and one load of the same state.

    The state is the same at every world size: 240 leaves, DTensors sharded over the
    world's mesh (and some replicated), with a few plain values.
    """
    import pickle

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    received = [0]

    def size(obj: Any) -> int:
        return len(pickle.dumps(obj))

    real_gather, real_all_gather, real_broadcast = (
        dist.gather_object,
        dist.all_gather_object,
        dist.broadcast_object_list,
    )

    def gather_object(obj: Any, object_gather_list: Any = None, dst: int = 0, group: Any = None) -> None:
        real_gather(obj, object_gather_list, dst=dst, group=group)
        if object_gather_list is not None:
            received[0] += sum(size(o) for i, o in enumerate(object_gather_list) if i != dist.get_rank(group))

    def all_gather_object(object_list: Any, obj: Any, group: Any = None) -> None:
        real_all_gather(object_list, obj, group=group)
        received[0] += sum(size(o) for i, o in enumerate(object_list) if i != dist.get_rank(group))

    def broadcast_object_list(object_list: Any, src: int = 0, group: Any = None, device: Any = None) -> None:
        real_broadcast(object_list, src=src, group=group, device=device)
        if dist.get_rank() != src:
            received[0] += size(object_list)

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    state: dict[str, Any] = {"step": 7, "lr": 0.1, "data": {"epoch": 2, "offset": 1234}}
    for layer in range(40):
        for name, shape, placement in (
            ("wq", (64, 32), Shard(0)),
            ("wk", (64, 32), Shard(0)),
            ("wv", (64, 32), Shard(1)),
            ("wo", (32, 64), Shard(1)),
            ("norm", (32,), Replicate()),
        ):
            state[f"layers.{layer}.{name}"] = distribute_tensor(torch.randn(shape), mesh, [placement])
    state["embed"] = distribute_tensor(torch.randn(128, 32), mesh, [Shard(0)])
    dist.gather_object, dist.all_gather_object, dist.broadcast_object_list = (
        gather_object,
        all_gather_object,
        broadcast_object_list,
    )
    try:
        received[0] = 0
        pytreeckpt.save(path, state)
        saved = received[0]
        received[0] = 0
        target = {
            k: distribute_tensor(torch.zeros_like(v.full_tensor()), mesh, [Replicate()])
            if hasattr(v, "full_tensor")
            else v
            for k, v in state.items()
        }
        pytreeckpt.load(path, target)
        loaded = received[0]
    finally:
        dist.gather_object, dist.all_gather_object, dist.broadcast_object_list = (
            real_gather,
            real_all_gather,
            real_broadcast,
        )
    import os

    return {"save": saved, "load": loaded, "metadata": os.path.getsize(f"{path}/pytreeckpt.json")}


def placed_stages(rank: int, world: int, path: str) -> dict[str, Any]:
    """Two pipeline stages of ShardedLeaf weights, each on half the ranks (a placement), saved and loaded."""
    from pytreeckpt import Abstract, Mesh, Shard, ShardingSpec

    half = world // 2
    spec = ShardingSpec(Mesh(half), [Shard(0)])
    full = {s: torch.arange(12 * 5, dtype=torch.float32).reshape(12, 5) + 100 * s for s in (0, 1)}
    mine = rank // half  # this rank's stage
    state: dict[str, Any] = {}
    for s in (0, 1):
        placement = range(s * half, (s + 1) * half)
        leaf = ShardedLeaf.from_global(full[s], spec, placement=placement)
        held = {rank - s * half: leaf.shards[rank - s * half]} if s == mine else {}
        state[f"stage{s}"] = ShardedLeaf(leaf.shape, leaf.dtype, spec, held, placement)
    pytreeckpt.save(path, state)
    target = {f"stage{s}": Abstract((12, 5), torch.float32, spec, range(s * half, (s + 1) * half)) for s in (0, 1)}
    out = pytreeckpt.load(path, target)
    ok = {}
    for s in (0, 1):
        got = out[f"stage{s}"]
        if s == mine:
            p = rank - s * half
            ok[s] = list(got.shards) == [p] and torch.equal(got.shards[p], state[f"stage{s}"].shards[p])
        else:
            ok[s] = not got.shards
    return {"stage": mine, "ok": ok}


def dtensor_state_saved_again(rank: int, world: int, path: str) -> dict[str, Any]:
    """One DTensor state saved five times, changed between saves: its values in place, its
    placements, a new mesh object, a shape. Each checkpoint must load as the state was when it was
    saved (a save remembers the trees it saved: saving/_recall.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {
        "w": distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.randn(6), mesh, [Replicate()]),
        "step": 1,
    }

    def change_values() -> None:
        state["w"].add_(1)  # (a DTensor op: every rank's shard)
        state["step"] = 2

    def change_placements() -> None:
        state["w"] = state["w"].redistribute(mesh, [Shard(1)])

    def new_mesh() -> None:
        other = init_device_mesh("cpu", (world,))
        state["b"] = distribute_tensor(state["b"].full_tensor() * 3, other, [Replicate()])

    def new_shape() -> None:
        state["w"] = distribute_tensor(torch.randn(32, 8), mesh, [Shard(0)])

    changes = [None, change_values, change_placements, new_mesh, new_shape]
    expected = []
    for i, change in enumerate(changes):
        if change is not None:
            change()
        pytreeckpt.save(f"{path}/{i}", state)
        expected.append({k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state.items()})
    dist.barrier()
    same = []
    for i, want in enumerate(expected):
        got = pytreeckpt.load(f"{path}/{i}")
        same.append(
            list(got) == list(want)
            and all(torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v for k, v in want.items())
        )
    return {"same": same}


def comm_gather_and_agree(rank: int, world: int) -> dict[str, Any]:
    """The checkpoint groups' gather of objects of very different sizes (none, a few bytes, a MiB), and agree:
    silent when every rank succeeded, else the same error on every rank, one failing rank after another."""
    from pytreeckpt.distributed._comm import distributed_comm

    comm = distributed_comm(None)
    assert comm is not None
    objects = [None, b"", "x" * rank, {"rank": rank, "big": bytes(range(256)) * (4096 * rank)}]
    gathered = [comm.gather(obj) for obj in objects]
    raised = []
    for bad in range(world):
        comm.agree(None, "nothing")
        try:
            comm.agree(ValueError(f"broken on {rank}") if rank == bad else None, "testing the agreement")
        except pytreeckpt.CheckpointError as e:
            raised.append(str(e))
    # all_same: every rank's bytes against rank 0's, one rank after another differing or holding none.
    same = [comm.all_same(b"digest"), comm.all_same(b"")]
    for odd in range(world):
        same.append(comm.all_same(b"other" if rank == odd else b"digest"))
        same.append(comm.all_same(None if rank == odd else b"digest"))
    # agree_on_specs: when every rank agrees, no object collective; when one differs, every rank raises.
    from pytreeckpt.distributed._agree import agree_on_specs

    objects = [0]
    real_gather, real_broadcast = dist.gather_object, dist.broadcast_object_list

    def gather_object(*args: Any, **kwargs: Any) -> None:
        objects[0] += 1
        real_gather(*args, **kwargs)

    def broadcast_object_list(*args: Any, **kwargs: Any) -> None:
        objects[0] += 1
        real_broadcast(*args, **kwargs)

    dist.gather_object, dist.broadcast_object_list = gather_object, broadcast_object_list
    try:
        known = agree_on_specs(comm, [], [], "load", values=["step"])
        agreeing = objects[0]
        try:
            agree_on_specs(comm, [], [], "load", values=["step", "lr"] if rank == world - 1 else ["step"])
            differing = ""
        except pytreeckpt.CheckpointError as e:
            differing = str(e)
    finally:
        dist.gather_object, dist.broadcast_object_list = real_gather, real_broadcast
    return {
        "gathered": gathered,
        "raised": raised,
        "same": same,
        "known": known is not None,
        "agreeing_objects": agreeing,
        "differing": differing,
    }
