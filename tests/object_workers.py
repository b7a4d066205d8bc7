"""Worker functions run on several gloo ranks by tests/test_objects.py: models, optimizers and schedulers as objects."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from dist_workers import _full, _state_dicts, build, train

import pytreeckpt


def _sched(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _train(model: Any, opt: Any, sched: Any, start: int, steps: int, dp_rank: int, dp_size: int) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        losses += train(model, opt, step, 1, dp_rank, dp_size)
        sched.step()
    return losses


def fsdp_objects_save(rank: int, world: int, path: str, steps: int, more: int) -> dict[str, Any]:
    """Train an FSDP2 model ``steps`` steps, save it, its AdamW and its scheduler as objects, train ``more``."""
    model, opt, dp_rank, dp_size = build(world, "fsdp", seed=0)
    sched = _sched(opt)
    _train(model, opt, sched, 0, steps, dp_rank, dp_size)
    pytreeckpt.save(path, {"model": model, "optim": opt, "sched": sched, "step": steps})
    msd, osd = _state_dicts(model, opt)
    full = {"model": _full(msd), "optim": _full(osd)}
    losses = _train(model, opt, sched, steps, more, dp_rank, dp_size)
    return {"losses": losses, "state": full if rank == 0 else None, "sched": sched.state_dict()}


def fsdp_objects_resume(
    rank: int, world: int, path: str, more: int, inplace: bool, layout: str = "fsdp"
) -> dict[str, Any]:
    """Resume from objects: a model of another init in ``layout``, a fresh AdamW and scheduler, loaded with no glue."""
    model, opt, dp_rank, dp_size = build(world, layout, seed=123)
    sched = _sched(opt)
    before = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    out = pytreeckpt.load(path, {"model": model, "optim": opt, "sched": sched, "step": 0}, inplace=inplace)
    same = out["model"] is model and out["optim"] is opt and out["sched"] is sched
    kept = before == {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    msd, osd = _state_dicts(model, opt)
    full = {"model": _full(msd), "optim": _full(osd)}
    sharded = all(isinstance(v, torch.distributed.tensor.DTensor) for v in msd.values())
    losses = _train(model, opt, sched, out["step"], more, dp_rank, dp_size)
    return {
        "losses": losses,
        "state": full if rank == 0 else None,
        "step": out["step"],
        "same": same,
        "kept": kept,
        "sharded": sharded,
        "sched": sched.state_dict(),
    }


class Refuses:
    """A user object whose load_state_dict fails on rank 1 only."""

    def __init__(self) -> None:
        self.n = torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if dist.get_rank() == 1:
            raise ValueError("no thanks")
        self.n = sd["n"]


def restore_fails_on_one_rank(rank: int, world: int, path: str) -> str:
    pytreeckpt.save(path, {"thing": Refuses(), "step": 1})
    try:
        pytreeckpt.load(path, {"thing": Refuses(), "step": 0})
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "no error"


def helpers_route_load(rank: int, world: int, path: str) -> dict[str, Any]:
    """Load, in a world (the helpers' route: optimizer state keyed by name), what a process without
    torch.distributed saved (its own route, converted to names): then save it by this route."""
    model, opt, _, _ = build(world, "plain", seed=5)
    pytreeckpt.load(path, {"model": model, "optim": opt})
    msd, osd = _state_dicts(model, opt)
    pytreeckpt.save(path + "_again", {"model": model, "optim": opt})
    return {"model": _full(msd), "optim": _full(osd)}


def objects_on_one_rank_only(rank: int, world: int, path: str) -> str:
    """Rank 0's target holds the model as an object, rank 1's its state dict: refused on both, not a hang."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 3)
    pytreeckpt.save(path, {"model": model})
    try:
        pytreeckpt.load(path, {"model": model if rank == 0 else model.state_dict()})
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "no error"


def optimizer_without_its_model(rank: int, world: int, path: str) -> str:
    _, opt, _, _ = build(world, "plain", seed=0)
    try:
        pytreeckpt.save(path, {"optim": opt})
    except pytreeckpt.CheckpointError as e:
        return str(e)
    return "no error"


class Named(torch.nn.Module):
    """Two layers of the same shape, declared in the order ``order`` names them."""

    def __init__(self, order: str) -> None:
        super().__init__()
        for n in order:
            setattr(self, n, torch.nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).square().sum() + 3 * self.b(x).sum()


def moments_by_name_in_another_order(rank: int, world: int, path: str) -> dict[str, Any]:
    """Save a model and its AdamW at one order of declaration; load them (torch's distributed helpers' route)
    into the other order, the optimizer listing its parameters reversed: each name's moments, from both."""
    torch.manual_seed(0)
    model = Named("ab")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(4)).backward()
    opt.step()
    pytreeckpt.save(path, {"model": model, "optim": opt})
    torch.manual_seed(1)
    model2 = Named("ba")
    opt2 = torch.optim.AdamW(list(model2.parameters())[::-1], lr=0.1)
    pytreeckpt.load(path, {"model": model2, "optim": opt2})
    mine = dict(model.named_parameters())
    theirs = dict(model2.named_parameters())
    return {n: (opt.state[mine[n]]["exp_avg"], opt2.state[theirs[n]]["exp_avg"]) for n in mine}
