"""Incremental checkpoints: only changed chunks are written, unchanged ones hard-linked from the base."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import tensorstore as ts
import torch
from torch import nn

import pytreeckpt


def _fine_tuning() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Pretrained with AdamW state for every parameter, then the first 90% of parameters frozen.

    The weights (2 MiB each) are stored in files of their own; arrays of at most 1 MiB
    (biases, step counters) are packed in an OCDBT database and simply rewritten.
    """
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Linear(512, 1024), *[nn.Linear(1024, 512) if i % 2 == 0 else nn.Linear(512, 1024) for i in range(9)]]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(2):
        _step(model, opt, i)
    for layer in list(model)[:9]:
        layer.requires_grad_(False)
    return model, opt


def _step(model: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(i))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def _clone(tree: dict) -> dict:
    return {
        k: _clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in tree.items()
    }


def _equal(a: dict, b: dict) -> bool:
    for k, v in a.items():
        if isinstance(v, dict):
            if not _equal(v, b[k]):
                return False
        elif isinstance(v, torch.Tensor):
            if not torch.equal(v, b[k]):
                return False
        elif v != b[k]:
            return False
    return True


def _written(monitor: pytreeckpt.Monitor) -> int:
    return sum(s.nbytes for s in monitor.spans if s.phase == "write")


def test_a_fine_tuning_save_writes_only_what_changed(tmp_path: Path) -> None:
    model, opt = _fine_tuning()
    full = pytreeckpt.Monitor()
    pytreeckpt.save(tmp_path / "s1", _state(model, opt), chunk_hashes=True, monitor=full)
    for i in range(2, 4):
        _step(model, opt, i)
    expected = _clone(_state(model, opt))
    inc = pytreeckpt.Monitor()
    pytreeckpt.save(tmp_path / "s2", _state(model, opt), base=tmp_path / "s1", monitor=inc)
    ratio = _written(inc) / _written(full)
    assert ratio <= 0.15, ratio  # the last 10% of parameters and their moments (and step counters)
    print(f"incremental save wrote {_written(inc)} of {_written(full)} bytes ({ratio:.3f})")
    out = pytreeckpt.load(tmp_path / "s2", {"model": model.state_dict(), "optim": opt.state_dict()})
    assert _equal(expected["model"], out["model"])
    assert _equal(expected["optim"]["state"], out["optim"]["state"])
    frozen = tmp_path / "s2" / "arrays" / "model.0.weight" / "c" / "0" / "0"
    assert frozen.stat().st_nlink == 2  # the same file as the base's
    # every leaf stays a whole zarr array, and survives the deletion of the base
    pytreeckpt.save(tmp_path / "s3", _state(model, opt), base=tmp_path / "s2", overwrite=True)
    import shutil

    shutil.rmtree(tmp_path / "s1")
    shutil.rmtree(tmp_path / "s2")
    plain = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/s3/arrays/model.0.weight/"}).result()
    assert torch.equal(torch.from_numpy(plain.read().result()), expected["model"]["0.weight"])
    assert pytreeckpt.verify(tmp_path / "s3").ok


def test_the_manager_chooses_bases_and_retention_deletes_freely(tmp_path: Path) -> None:
    model, opt = _fine_tuning()
    written = []
    with pytreeckpt.CheckpointManager(tmp_path, max_to_keep=1, incremental=True, async_=False) as m:
        for step in range(1, 5):
            _step(model, opt, 10 + step)
            mon = pytreeckpt.Monitor()
            m.save(step, _state(model, opt), monitor=mon)
            written.append(_written(mon))
        assert m.all_steps() == [4]  # every earlier step deleted
        out = m.restore(target={"model": model.state_dict(), "optim": opt.state_dict()})
    assert _equal(_clone(model.state_dict()), out["model"])
    assert all(w <= 0.15 * written[0] for w in written[1:]), written
    assert len(os.listdir(tmp_path)) == 1


def test_a_base_without_hashes_is_refused(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "a", {"w": torch.ones(4)})
    with pytest.raises(pytreeckpt.CheckpointError, match="records no chunk hashes"):
        pytreeckpt.save(tmp_path / "b", {"w": torch.ones(4)}, base=tmp_path / "a")


def test_an_async_save_with_a_base_links_too(tmp_path: Path) -> None:
    state = {"a": torch.randn(512, 1024), "b": torch.randn(512, 1024)}
    pytreeckpt.save(tmp_path / "s1", state, chunk_hashes=True)
    state["b"].add_(1.0)
    mon = pytreeckpt.Monitor()
    h = pytreeckpt.async_save(tmp_path / "s2", state, base=tmp_path / "s1", monitor=mon)
    state["a"].zero_()  # after the snapshot: not in the checkpoint
    h.wait()
    assert _written(mon) == 512 * 1024 * 4  # only "b"
    out = pytreeckpt.load(tmp_path / "s2")
    assert torch.equal(out["b"], state["b"])
    assert torch.equal(out["a"], pytreeckpt.load(tmp_path / "s1")["a"])


@pytest.mark.parametrize("packed_base", [False, True])
def test_arrays_packed_on_one_side_only_are_written_not_linked(tmp_path: Path, packed_base: bool) -> None:
    # Packed arrays live in an OCDBT database, not in chunk files: nothing to link from or to.
    state = {"w": torch.randn(64, 64), "b": torch.randn(8)}
    unpacked = pytreeckpt.StorageOptions(pack_small_leaves=False)
    base = tmp_path / "base"
    pytreeckpt.save(base if packed_base else pytreeckpt.Location(base, unpacked), state, chunk_hashes=True)
    nxt = tmp_path / "next"
    pytreeckpt.save(pytreeckpt.Location(nxt, unpacked) if packed_base else nxt, state, base=base)
    assert _equal(pytreeckpt.load(nxt), state)
    stray = [p for p in (nxt / "arrays").rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert not stray  # no directories made for links that could not be
