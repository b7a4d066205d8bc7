"""Objects with state_dict() / load_state_dict() are leaves: saved as their state dicts, restored in place."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import object_workers as ow
import pytest
import torch
from multiproc import run_world
from torch import nn

import pytreeckpt
from pytreeckpt import CheckpointError, TargetMismatchError

STEPS, MORE = 3, 3


class Loader:
    """A stateful dataloader of a user's: its position and its shuffling generator."""

    def __init__(self, seed: int = 0) -> None:
        self.pos = 0
        self.gen = torch.Generator().manual_seed(seed)

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> torch.Tensor:
        self.pos += 1
        return torch.randn(4, 6, generator=self.gen)

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos, "gen": self.gen.get_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = sd["pos"]
        self.gen.set_state(sd["gen"])


def _job(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, Loader]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, Loader(seed)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, loader: Loader, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        x = next(loader)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _clone(sd: Any) -> Any:
    return copy.deepcopy(sd)


def _equal(a: Any, b: Any) -> bool:
    """Bit-equal state dicts (tensors by torch.equal, the rest by ==)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) or (isinstance(a, float) and math.isnan(a) and math.isnan(b))


def test_training_state_objects_round_trip_and_training_continues_identically(tmp_path: Path) -> None:
    model, opt, sched, loader = _job(0)
    _steps(model, opt, sched, loader, STEPS)
    path = tmp_path / "ckpt"
    pytreeckpt.save(path, {"model": model, "optim": opt, "sched": sched, "data": loader, "step": STEPS})
    model2, opt2, sched2, loader2 = _job(1)  # another init: the load must matter
    out = pytreeckpt.load(path, {"model": model2, "optim": opt2, "sched": sched2, "data": loader2, "step": 0})
    assert out["step"] == STEPS
    assert out["model"] is model2
    assert out["optim"] is opt2
    assert out["sched"] is sched2
    assert out["data"] is loader2
    assert _equal(model.state_dict(), model2.state_dict())
    assert _equal(opt.state_dict(), opt2.state_dict())
    assert _equal(sched.state_dict(), sched2.state_dict())
    assert _equal(loader.state_dict(), loader2.state_dict())
    assert _steps(model2, opt2, sched2, loader2, MORE) == _steps(model, opt, sched, loader, MORE)
    assert _equal(opt.state_dict(), opt2.state_dict())


def test_a_load_without_target_gives_plain_state_dicts(tmp_path: Path) -> None:
    model, opt, sched, loader = _job(0)
    _steps(model, opt, sched, loader, 1)
    pytreeckpt.save(tmp_path / "c", {"model": model, "optim": opt, "sched": sched, "data": loader})
    plain = pytreeckpt.load(tmp_path / "c")
    assert _equal(plain["model"], dict(model.state_dict()))
    assert _equal(plain["sched"], sched.state_dict())
    assert _equal(plain["data"], loader.state_dict())
    # an optimizer with its model in the tree is stored keyed by parameter name, as torch's distributed helpers key it
    names = [n for n, _ in model.named_parameters()]
    assert list(plain["optim"]["state"]) == names
    assert plain["optim"]["param_groups"][0]["params"] == names
    assert torch.equal(plain["optim"]["state"]["0.weight"]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_an_optimizer_without_its_model_is_refused_it_has_no_names(tmp_path: Path) -> None:
    model, opt, sched, loader = _job(0)
    _steps(model, opt, sched, loader, 1)
    with pytest.raises(CheckpointError, match=r"leaf 'optim': .*matched by parameter name.*6 of 6 are in none"):
        pytreeckpt.save(tmp_path / "c", {"optim": opt})
    assert not (tmp_path / "c").exists()
    # a state keyed by number (an optimizer's own state dict, or a checkpoint of an older pytreeckpt) is refused as
    # a target's optimizer state, before anything changes: it cannot be matched by name
    pytreeckpt.save(tmp_path / "d", {"model": model, "optim": opt.state_dict()})
    model2, opt2, _, _ = _job(1)
    before = (_clone(model2.state_dict()), _clone(opt2.state_dict()))
    with pytest.raises(TargetMismatchError, match=r"leaf 'optim': the checkpoint's optimizer state is not keyed by"):
        pytreeckpt.load(tmp_path / "d", {"model": model2, "optim": opt2})
    assert _equal(before, (model2.state_dict(), opt2.state_dict()))
    assert list(pytreeckpt.load(tmp_path / "d")["optim"]["state"]) == [0, 1, 2, 3, 4, 5]


class Recording(nn.Module):
    """A model that notes where the tensors given to its load_state_dict live."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(256, 256)
        self.given: dict[str, int] = {}

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self.given = {k: v.data_ptr() for k, v in state_dict.items()}
        return super().load_state_dict(state_dict, strict, assign)


def test_an_in_place_load_reads_into_the_models_own_parameters(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Recording()
    pytreeckpt.save(tmp_path / "c", {"model": model})
    target = Recording()
    own = {k: v.data_ptr() for k, v in target.state_dict().items()}
    out = pytreeckpt.load(tmp_path / "c", {"model": target}, inplace=True)
    assert out["model"] is target
    assert target.given == own  # what load_state_dict got is the parameters' own memory: no second copy
    assert {k: v.data_ptr() for k, v in target.state_dict().items()} == own
    assert _equal(model.state_dict(), target.state_dict())
    other = Recording()
    pytreeckpt.load(tmp_path / "c", {"model": other})  # (without inplace: new tensors, copied in)
    assert other.given != {k: v.data_ptr() for k, v in other.state_dict().items()}


def _schedulers(opt: torch.optim.Optimizer) -> dict[str, Any]:
    lr = torch.optim.lr_scheduler
    return {
        "step": lr.StepLR(opt, step_size=2, gamma=0.5),
        "lambda": lr.LambdaLR(opt, lambda epoch: 0.9**epoch),
        "cosine": lr.CosineAnnealingLR(opt, T_max=7, eta_min=1e-4),
        "linear": lr.LinearLR(opt, start_factor=0.25, total_iters=4),
        "sequential": lr.SequentialLR(
            opt, [lr.LinearLR(opt, start_factor=0.5, total_iters=2), lr.ExponentialLR(opt, gamma=0.9)], milestones=[2]
        ),
    }


@pytest.mark.parametrize("name", ["step", "lambda", "cosine", "linear", "sequential"])
def test_every_builtin_lr_scheduler_round_trips(tmp_path: Path, name: str) -> None:
    def made() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        model = nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, _schedulers(opt)[name]

    model, opt, sched = made()
    for _ in range(3):
        opt.step()
        sched.step()
    pytreeckpt.save(tmp_path / "c", {"model": model, "optim": opt, "sched": sched})
    model2, opt2, sched2 = made()
    pytreeckpt.load(tmp_path / "c", {"model": model2, "optim": opt2, "sched": sched2})
    assert _equal(sched.state_dict(), sched2.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    lrs, lrs2 = [], []
    for o, s, out in ((opt, sched, lrs), (opt2, sched2, lrs2)):
        for _ in range(4):
            o.step()
            s.step()
            out.append(s.get_last_lr())
    assert lrs == lrs2


def test_grad_scaler_state_round_trips(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    scaler.scale(torch.ones(1))  # (its scale made)
    scaler.update(new_scale=64.0)
    pytreeckpt.save(tmp_path / "c", {"scaler": scaler})
    again = torch.amp.GradScaler("cpu")
    pytreeckpt.load(tmp_path / "c", {"scaler": again})
    assert again.state_dict() == scaler.state_dict()
    assert again.get_scale() == 64.0


def test_objects_nested_in_containers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    models = [nn.Linear(3, 3), nn.Linear(3, 2)]
    opts = {
        "a": torch.optim.SGD(models[0].parameters(), lr=0.1, momentum=0.9),
        "b": torch.optim.Adam(models[1].parameters()),
    }
    for m, o in zip(models, opts.values(), strict=True):
        m(torch.ones(3)).sum().backward()
        o.step()
    pytreeckpt.save(tmp_path / "c", {"models": models, "opts": opts, "pair": (Loader(3), 5)})
    models2 = [nn.Linear(3, 3), nn.Linear(3, 2)]
    opts2 = {
        "a": torch.optim.SGD(models2[0].parameters(), lr=0.1, momentum=0.9),
        "b": torch.optim.Adam(models2[1].parameters()),
    }
    out = pytreeckpt.load(tmp_path / "c", {"models": models2, "opts": opts2, "pair": (Loader(), 0)})
    assert out["models"][1] is models2[1]
    assert out["opts"]["b"] is opts2["b"]
    assert out["pair"][1] == 5
    for a, b in zip(models + list(opts.values()), models2 + list(opts2.values()), strict=True):
        assert _equal(a.state_dict(), b.state_dict())
    assert out["pair"][0].pos == 0
    assert _equal(out["pair"][0].state_dict(), Loader(3).state_dict())


def test_a_model_at_the_root(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    pytreeckpt.save(tmp_path / "c", model)
    target = nn.Linear(4, 4)
    assert pytreeckpt.load(tmp_path / "c", target) is target
    assert _equal(model.state_dict(), target.state_dict())


class Refusing:
    def __init__(self) -> None:
        self.t = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "ok": True}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise ValueError("wrong version")


def test_a_failing_restore_names_the_key_path(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"user": [Refusing()]})
    with pytest.raises(
        CheckpointError, match=r"user\.0.*Refusing\.load_state_dict refused it: ValueError: wrong version"
    ):
        pytreeckpt.load(tmp_path / "c", {"user": [Refusing()]})


def test_mismatched_objects_are_listed_before_any_read(tmp_path: Path) -> None:
    torch.manual_seed(0)
    pytreeckpt.save(tmp_path / "c", {"model": nn.Linear(3, 3), "n": 1})
    with pytest.raises(
        TargetMismatchError, match=r"leaf 'model\.weight': the checkpoint has shape \(3, 3\), the target has \(2, 3\)"
    ):
        pytreeckpt.load(tmp_path / "c", {"model": nn.Linear(3, 2), "n": 0})
    with pytest.raises(
        TargetMismatchError, match=r"leaf 'other': the target holds a Linear object, the checkpoint has nothing"
    ):
        pytreeckpt.load(tmp_path / "c", {"model": nn.Linear(3, 3), "n": 0, "other": nn.Linear(3, 3)})
    with pytest.raises(
        TargetMismatchError, match=r"leaf 'n': the target holds a Linear object, the checkpoint has a single leaf"
    ):
        pytreeckpt.load(tmp_path / "c", {"model": nn.Linear(3, 3), "n": nn.Linear(3, 3)})
    bigger = nn.Linear(3, 3)
    bigger.register_buffer("extra", torch.zeros(1))
    with pytest.raises(TargetMismatchError, match=r"leaf 'model\.extra' of the target is not in the checkpoint"):
        pytreeckpt.load(tmp_path / "c", {"model": bigger, "n": 0})


def test_a_prefix_at_an_objects_key_covers_its_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    pytreeckpt.save(tmp_path / "c", {"model": model, "n": 1}, compression={"model": "zstd", "n": None})
    arrays = pytreeckpt.metadata(tmp_path / "c").arrays
    assert {k: arrays[k].compression is not None for k in ("model.weight", "model.bias")} == {
        "model.weight": True,
        "model.bias": True,
    }


def test_async_save_and_plan_save_take_objects(tmp_path: Path) -> None:
    model, opt, sched, loader = _job(0)
    _steps(model, opt, sched, loader, 1)
    plan = pytreeckpt.plan_save({"model": model, "optim": opt})
    assert "optim.state.0.weight.exp_avg" in [a.key for a in plan.arrays]
    h = pytreeckpt.async_save(tmp_path / "c", {"model": model, "optim": opt})
    want = {k: v.clone() for k, v in model.state_dict().items()}
    _steps(model, opt, sched, loader, 1)  # training goes on: the checkpoint holds the state at the call
    h.wait()
    assert _equal(pytreeckpt.load(tmp_path / "c")["model"], want)


@pytest.fixture(scope="module")
def fsdp_objects(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("objects") / "ckpt"
    results = run_world(4, ow.fsdp_objects_save, str(path), STEPS, MORE)
    return path, results[0]


def _same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert list(got["optim"]["state"]) == list(want["optim"]["state"])
    for fqn, st in want["optim"]["state"].items():
        for name, v in st.items():
            assert torch.equal(got["optim"]["state"][fqn][name], v), (fqn, name)


@pytest.mark.parametrize("inplace", [False, True])
def test_fsdp2_objects_resume_at_the_same_world_exactly(
    fsdp_objects: tuple[Path, dict[str, Any]], inplace: bool
) -> None:
    path, saved = fsdp_objects
    results = run_world(4, ow.fsdp_objects_resume, str(path), MORE, inplace)
    assert all(r["same"] and r["sharded"] and r["kept"] for r in results)
    _same_state(results[0]["state"], saved["state"])
    assert results[0]["step"] == STEPS
    assert results[0]["losses"] == saved["losses"]
    assert results[0]["sched"] == saved["sched"]


def test_fsdp2_objects_resume_at_two_ranks(fsdp_objects: tuple[Path, dict[str, Any]]) -> None:
    path, saved = fsdp_objects
    results = run_world(2, ow.fsdp_objects_resume, str(path), MORE, False)
    assert all(r["same"] and r["sharded"] for r in results)
    _same_state(results[0]["state"], saved["state"])  # resharded: the model and AdamW state equal the saved
    assert results[0]["losses"] == pytest.approx(saved["losses"], rel=1e-4)


def test_fsdp2_objects_resume_on_a_2x2_fsdp_tp_mesh(fsdp_objects: tuple[Path, dict[str, Any]]) -> None:
    path, saved = fsdp_objects
    results = run_world(4, ow.fsdp_objects_resume, str(path), MORE, False, "fsdp_tp")
    assert all(r["same"] and r["sharded"] for r in results)
    _same_state(results[0]["state"], saved["state"])
    assert results[0]["losses"] == pytest.approx(saved["losses"], rel=1e-4)


def test_a_failing_restore_on_one_rank_fails_every_rank(tmp_path: Path) -> None:
    results = run_world(2, ow.restore_fails_on_one_rank, str(tmp_path / "c"))
    for r in results:
        assert "'thing'" in r, r
        assert "refused it: ValueError: no thanks" in r, r


def test_a_checkpoint_saved_by_either_route_loads_by_the_other(tmp_path: Path) -> None:
    from dist_workers import build, train

    model, opt, _, _ = build(1, "plain", seed=0)
    train(model, opt, 0, 2, 0, 1)
    path = str(tmp_path / "c")
    pytreeckpt.save(path, {"model": model, "optim": opt})  # no torch.distributed: the model's own state_dict()
    (got,) = run_world(1, ow.helpers_route_load, path)  # in a world: torch's distributed helpers
    for k, v in model.state_dict().items():
        assert torch.equal(got["model"][k], v), k
    names = dict(enumerate(n for n, _ in model.named_parameters()))
    for i, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(got["optim"]["state"][names[i]][name], v)
    model2, opt2, _, _ = build(1, "plain", seed=9)  # and back, saved by the helpers, loaded here
    pytreeckpt.load(path + "_again", {"model": model2, "optim": opt2})
    assert _equal(opt.state_dict(), opt2.state_dict())
    assert _equal(model.state_dict(), model2.state_dict())


class Growing:
    """A user's object whose state changes structure as it runs: a value that becomes a dict, a history tensor."""

    def __init__(self) -> None:
        self.cursor: dict[str, Any] | None = None
        self.history = torch.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "history": self.history}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.cursor, self.history = sd["cursor"], sd["history"]


def test_an_objects_state_is_the_checkpoints_whatever_its_own_holds(tmp_path: Path) -> None:
    g = Growing()
    g.cursor, g.history = {"epoch": 2, "seed": torch.tensor([7])}, torch.arange(5.0)
    pytreeckpt.save(tmp_path / "c", {"g": g})
    fresh = Growing()  # a value where the checkpoint has a dict, an empty tensor where it has five elements
    pytreeckpt.load(tmp_path / "c", {"g": fresh})
    assert _equal(fresh.state_dict(), g.state_dict())
    pytreeckpt.save(tmp_path / "d", {"g": Growing()})
    pytreeckpt.load(tmp_path / "d", {"g": g})  # and back: a dict where the checkpoint has None
    assert g.cursor is None
    assert g.history.shape == (0,)


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_a_stateful_dataloader_resumes_where_it_was(tmp_path: Path) -> None:
    import torchdata.stateful_dataloader as sdl  # (pinned in the test extras: never skipped)

    def loader() -> Any:
        return sdl.StatefulDataLoader(list(range(40)), batch_size=3, shuffle=True)

    torch.manual_seed(0)
    dl = loader()
    it = iter(dl)
    for _ in range(4):
        next(it)
    pytreeckpt.save(tmp_path / "c", {"data": dl, "step": 4})
    rest = [b.tolist() for b in it]
    torch.manual_seed(1)
    dl2 = loader()
    out = pytreeckpt.load(tmp_path / "c", {"data": dl2, "step": 0})
    assert out["data"] is dl2
    assert [b.tolist() for b in dl2] == rest


def test_ranks_that_disagree_on_objects_are_refused(tmp_path: Path) -> None:
    for r in run_world(2, ow.objects_on_one_rank_only, str(tmp_path / "c")):
        assert "ranks disagree on the state to load" in r, r
        assert "'model (a Linear object)' only on rank 0" in r, r


def test_a_distributed_optimizer_needs_its_model_in_the_tree(tmp_path: Path) -> None:
    for r in run_world(2, ow.optimizer_without_its_model, str(tmp_path / "c")):
        assert "leaf 'optim'" in r, r
        assert "helpers, which need its model): put the model whose parameters it optimizes in the same tree" in r, r


class Named(nn.Module):
    """Two layers of the same shape, declared in the order ``order`` names them."""

    def __init__(self, order: str) -> None:
        super().__init__()
        for n in order:
            setattr(self, n, nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).square().sum() + 3 * self.b(x).sum()


def _trained(order: str = "ab", groups: bool = False) -> tuple[Named, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Named(order)
    params: Any = model.parameters()
    if groups:
        params = [{"params": model.a.parameters(), "lr": 0.5}, {"params": model.b.parameters(), "lr": 0.01}]
    opt = torch.optim.AdamW(params, lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(4)).backward()
        opt.step()
    return model, opt


def _by_name(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Each parameter's optimizer state and learning rate, by the parameter's name."""
    lr = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    return {n: (opt.state[p], lr[id(p)]) for n, p in sorted(model.named_parameters())}


@pytest.mark.parametrize(
    "target",
    ["declared in the other order", "parameters listed reversed", "groups in the other order", "all three"],
)
def test_optimizer_state_is_matched_by_parameter_name_whatever_the_order(tmp_path: Path, target: str) -> None:
    groups = target != "declared in the other order" and target != "parameters listed reversed"
    model, opt = _trained("ab", groups)
    pytreeckpt.save(tmp_path / "c", {"model": model, "optim": opt})
    torch.manual_seed(1)
    model2 = Named("ba" if target in ("declared in the other order", "all three") else "ab")
    if groups:
        a, b = list(model2.a.parameters()), list(model2.b.parameters())
        if target == "all three":
            a, b = a[::-1], b[::-1]
        params: Any = [{"params": b, "lr": 0.01}, {"params": a, "lr": 0.5}]
    else:
        params = list(model2.parameters())
        if target == "parameters listed reversed":
            params = params[::-1]
    opt2 = torch.optim.AdamW(params, lr=0.1)
    pytreeckpt.load(tmp_path / "c", {"model": model2, "optim": opt2})
    assert _equal(_by_name(model, opt), _by_name(model2, opt2))
    assert _equal(dict(sorted(model.state_dict().items())), dict(sorted(model2.state_dict().items())))
    for m, o in ((model, opt), (model2, opt2)):  # training goes on identically
        o.zero_grad()
        m(torch.ones(4)).backward()
        o.step()
    assert _equal(_by_name(model, opt), _by_name(model2, opt2))


def test_optimizer_moments_are_matched_by_name_at_two_ranks(tmp_path: Path) -> None:
    for got in run_world(2, ow.moments_by_name_in_another_order, str(tmp_path / "c")):
        assert set(got) == {"a.weight", "a.bias", "b.weight", "b.bias"}
        for name, (saved, loaded) in got.items():
            assert torch.equal(saved, loaded), name


def _refused_unchanged(path: Path, target: dict[str, Any], match: str) -> None:
    """load(path, target) is refused with ``match``, and leaves every object of the target as it was."""
    before = {k: _clone(v.state_dict()) for k, v in target.items()}
    with pytest.raises(CheckpointError, match=match):
        pytreeckpt.load(path, target)
    for k, v in target.items():
        assert _equal(before[k], v.state_dict()), k


def test_a_parameter_name_on_one_side_only_is_refused_before_anything_changes(tmp_path: Path) -> None:
    model, opt = _trained("ab")
    pytreeckpt.save(tmp_path / "c", {"model": model, "optim": opt})
    model2 = Named("ab")
    partial = torch.optim.AdamW(model2.a.parameters())  # it lacks b's parameters
    _refused_unchanged(
        tmp_path / "c",
        {"model": model2, "optim": partial},
        r"leaf 'optim': the optimizer's parameters differ by name: only in the checkpoint \['b.bias', 'b.weight'\], "
        r"only in the target \[\]",
    )
    model3, opt3 = _trained("ab", groups=True)  # the same names, in two groups where the checkpoint has one
    _refused_unchanged(
        tmp_path / "c", {"model": model3, "optim": opt3}, r"leaf 'optim': the optimizer's parameter groups differ"
    )
    outside = nn.Linear(4, 4)  # a parameter no model of the tree holds
    model4 = Named("ab")
    opt4 = torch.optim.AdamW([*model4.parameters(), *outside.parameters()])
    _refused_unchanged(
        tmp_path / "c", {"model": model4, "optim": opt4}, r"leaf 'optim': .*2 of 6 are in none of its models"
    )


def test_a_model_lacking_a_stored_parameter_is_refused_before_any_parameter_changes(tmp_path: Path) -> None:
    model, opt = _trained("ab")
    pytreeckpt.save(tmp_path / "c", {"model": model, "optim": opt})
    torch.manual_seed(3)
    smaller = nn.Module()
    smaller.a = nn.Linear(4, 4)  # no b: the checkpoint's b.weight and b.bias have nowhere to go
    _refused_unchanged(
        tmp_path / "c", {"model": smaller}, r"leaf 'model.b.weight' of the checkpoint is not in the target"
    )
    report = pytreeckpt.LoadReport()
    out = pytreeckpt.load(tmp_path / "c", {"model": smaller}, strict=False, report=report)  # asked for: a's only
    assert out["model"] is smaller
    assert torch.equal(smaller.a.weight, model.a.weight)
    assert report.unexpected[:2] == ["model.b.weight", "model.b.bias"]
    assert all(k.startswith("optim.") for k in report.unexpected[2:])


class RefusingLast:
    """A user object whose load_state_dict always raises."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise ValueError("not this version")


def test_an_object_refusing_its_state_names_the_objects_restored_before_it(tmp_path: Path) -> None:
    model, opt = _trained("ab")
    pytreeckpt.save(tmp_path / "c", {"model": model, "optim": opt, "user": RefusingLast(), "later": Loader(2)})
    model2 = Named("ab")
    opt2 = torch.optim.AdamW(model2.parameters())
    with pytest.raises(
        CheckpointError,
        match=r"leaf 'user': .*RefusingLast.load_state_dict refused it: ValueError: not this version \(the target's "
        r"objects restored before it: 'model', 'optim'; those after it were not restored\)",
    ):
        pytreeckpt.load(tmp_path / "c", {"model": model2, "optim": opt2, "user": RefusingLast(), "later": Loader()})
