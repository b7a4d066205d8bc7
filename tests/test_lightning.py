"""integrations.lightning with the real Lightning: Trainer fits resumed bit for bit, Fabric, the plugin's calls.

Lightning takes seconds to import: everything is in this one module, and the losses of the
uninterrupted run are computed once for the module.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path, PurePosixPath
from typing import Any

import lightning as L
import pytest
import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_workers import rank_zero_saves_every_rank_loads
from multiproc import run_world

import pytreeckpt
from pytreeckpt.integrations.lightning import AsyncPytreeCheckpointIO, PytreeCheckpointIO

pytestmark = [
    # Lightning 2.6.6's own CombinedLoader calls a LeafSpec torch 2.x deprecates: not ours to fix.
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    # ModelCheckpoint says so when a resumed run writes into the directory of the run it resumes: as meant here.
    pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning"),
]

EPOCHS = 4  # of 4 steps each; the interrupted runs stop after 2


class Tiny(L.LightningModule):
    """Adam with a step LR schedule, so a resume that lost the optimizer's or the scheduler's state shows."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, _index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


def _data() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(1)
    ds = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def _fit(epochs: int, root: Path | None, io: Any = None, ckpt_path: str | None = None, last: Any = True) -> list[float]:
    model = Tiny()
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=root is not None,
        default_root_dir=root,
        plugins=[io] if io is not None else None,
        callbacks=[ModelCheckpoint(dirpath=root / "ckpt", save_last=last)] if root is not None else None,
    )
    trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return [float(x) for x in model.losses]


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    return _fit(EPOCHS, None)


@pytest.mark.parametrize(
    ("plugin", "last"),
    [(PytreeCheckpointIO, True), (AsyncPytreeCheckpointIO, True), (PytreeCheckpointIO, "link")],
    ids=["sync", "async", "sync-last-link"],
)
def test_a_fit_stopped_and_resumed_from_last_matches_an_uninterrupted_one_bit_for_bit(
    tmp_path: Path, uninterrupted: list[float], plugin: type[PytreeCheckpointIO], last: Any
) -> None:
    io = plugin()
    first = _fit(EPOCHS // 2, tmp_path, io, last=last)
    assert getattr(io, "_in_flight", None) is None  # the async plugin's teardown waited for its last save
    ckpt = tmp_path / "ckpt"
    # ModelCheckpoint kept the newest (epoch=0's was removed) and last.ckpt: pytreeckpt checkpoint directories
    assert sorted(os.listdir(ckpt)) == ["epoch=1-step=8.ckpt", "last.ckpt"]
    assert (ckpt / "last.ckpt").is_symlink() == (last == "link")
    assert pytreeckpt.load(ckpt / "epoch=1-step=8.ckpt")["global_step"] == 8
    second = _fit(EPOCHS, tmp_path, plugin(), ckpt_path="last", last=last)
    assert first + second == uninterrupted  # floats compared exactly
    assert sorted(os.listdir(ckpt)) == ["epoch=3-step=16.ckpt", "last.ckpt"]


def test_fabric_saves_and_loads_through_the_plugin(tmp_path: Path) -> None:
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[PytreeCheckpointIO()])

    def setup() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))

    def step(model: Any, opt: Any, i: int) -> None:
        loss = model(torch.full((3, 4), float(i))).square().mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()

    model, opt = setup()
    for i in range(3):
        step(model, opt, i)
    cfg = AttributeDict(
        root=PurePosixPath("/data/x"), dtype=torch.bfloat16, args=argparse.Namespace(n=3), betas=(0.9, 0.99)
    )
    fabric.save(tmp_path / "f.ckpt", {"model": model, "optimizer": opt, "step": 3, "cfg": cfg})

    model2, opt2 = setup()
    rest = fabric.load(tmp_path / "f.ckpt", {"model": model2, "optimizer": opt2})
    assert rest == {"step": 3, "cfg": cfg}
    assert type(rest["cfg"]) is AttributeDict
    assert type(rest["cfg"]["args"]) is argparse.Namespace
    for m, o in ((model, opt), (model2, opt2)):
        step(m, o, 3)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_values_that_would_not_come_back_are_refused_naming_the_key(tmp_path: Path) -> None:
    io = PytreeCheckpointIO()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'hyper_parameters\.loss_fn'.*save_hyperparameters\(ignore"):
        io.save_checkpoint({"state_dict": {}, "hyper_parameters": {"loss_fn": torch.nn.MSELoss()}}, tmp_path / "a")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'callbacks\.Mine\.seen'.*builtins\.set.*state_dict\(\)"):
        io.save_checkpoint({"callbacks": {"Mine": {"seen": {1, 2}}}}, tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_storage_options_are_those_of_save_or_refused(tmp_path: Path) -> None:
    io = PytreeCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a", storage_options={"user_metadata": {"run": "r1"}})
    assert pytreeckpt.metadata(tmp_path / "a").user_metadata == {"run": "r1"}
    with pytest.raises(TypeError, match=r"\['bucket'\].*'compression', 'chunking', 'executor', 'user_metadata'"):
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b", storage_options={"bucket": "x"})
    with pytest.raises(TypeError, match="must be a dict"):
        io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b", storage_options="zstd")
    for options, message in (  # a value of the wrong type is refused by save, naming it, before anything is written
        ({"chunking": "abc"}, r"save: chunking must be a ChunkingOptions or None, found str 'abc'"),
        ({"executor": "fast"}, r"save: executor must be an ExecutorOptions or None, found str 'fast'"),
    ):
        with pytest.raises(TypeError, match=message):
            io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "b", storage_options=options)
        assert not (tmp_path / "b").exists()


def test_load_places_tensors_and_says_what_it_cannot_read(tmp_path: Path) -> None:
    io = PytreeCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3), "n": 1}, tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "a.ckpt", map_location="meta")["w"].is_meta
    got = io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage, weights_only=True)
    assert got["w"].device.type == "cpu"
    assert got["n"] == 1
    with pytest.raises(FileNotFoundError, match="Checkpoint file not found"):
        io.load_checkpoint(tmp_path / "none.ckpt")
    torch.save({"w": torch.ones(1)}, tmp_path / "torch.ckpt")
    with pytest.raises(pytreeckpt.CheckpointError, match="is a file, not a pytreeckpt checkpoint directory"):
        io.load_checkpoint(tmp_path / "torch.ckpt")


def test_remove_takes_a_link_not_its_target_and_a_missing_path_is_no_error(tmp_path: Path) -> None:
    io = AsyncPytreeCheckpointIO()
    io.save_checkpoint({"w": torch.ones(3)}, tmp_path / "a.ckpt")
    (tmp_path / "last.ckpt").symlink_to("a.ckpt")
    io.remove_checkpoint(tmp_path / "last.ckpt")  # (waits for nothing: the save in flight is another's)
    io.teardown()
    assert not (tmp_path / "last.ckpt").exists()
    assert pytreeckpt.load(tmp_path / "a.ckpt")["w"].sum() == 3
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    io.save_checkpoint({"w": torch.ones(3)}, "memory://lightning/b.ckpt")  # a URL: an object store's prefix
    assert io.load_checkpoint("memory://lightning/b.ckpt")["w"].sum() == 3
    io.remove_checkpoint("memory://lightning/b.ckpt")
    with pytest.raises(pytreeckpt.NotCommittedError):
        pytreeckpt.load("memory://lightning/b.ckpt")


def test_under_ddp_rank_zero_saves_alone_and_every_rank_loads(tmp_path: Path) -> None:
    results = run_world(2, rank_zero_saves_every_rank_loads, str(tmp_path / "d.ckpt"))
    assert results == [{"equal": True, "step": 5}] * 2
