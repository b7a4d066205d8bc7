"""Exporting checkpoints to torch.distributed.checkpoint's format, read back by DCP itself at other world sizes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dcp_export_workers as w
import pytest
import torch
import torch.distributed.checkpoint as dcp
from multiproc import run_world

import pytreeckpt
from pytreeckpt import CheckpointError
from pytreeckpt._cli import main
from pytreeckpt.core._keys import keystr
from pytreeckpt.core._tree import flatten
from pytreeckpt.leaves import is_leaf

# dcp.load says this on every load without a process group; these tests load in one process on purpose.
single_process_dcp = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"
)


def by_key(tree: Any) -> dict[str, Any]:
    leaves, paths, _ = flatten(tree, is_leaf)
    return {keystr(p): leaf for leaf, p in zip(leaves, paths, strict=True)}


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(type(a) is type(b) and a == b)


@single_process_dcp
def test_saved_at_2_ranks_exported_loads_in_dcp_at_3_ranks_and_in_1_process_and_imports_back(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "dcp"
    run_world(2, w.save_dtensors, str(ckpt))
    names = pytreeckpt.export_dcp(ckpt, out, max_file_size=64)  # w (240 bytes) in boxes, in several files
    assert set(names) == {
        "model.w",
        "model.b",
        "model.layers.0.k",
        "optim.param_groups.0.lr",
        "optim.param_groups.0.betas",
        "optim.param_groups.0.params",
        "step",
        "name",
        "rng.rank0.seed",
        "rng.rank1.seed",
    }
    assert len(list(out.glob("*.distcp"))) > 3
    want = w.original()

    # 3 ranks, into DTensors sharded otherwise
    for got in run_world(3, w.dcp_load_resharded, str(out)):
        assert torch.equal(got["w"], want["model"]["w"])
        assert got["w_local"] == (10, 2)
        assert torch.equal(got["b"], want["model"]["b"])
        assert torch.equal(got["k"], want["model"]["layers"][0]["k"].view(torch.int16))
        assert got["values"] == (7, "run", want["optim"])
        assert torch.equal(got["seed1"], torch.tensor([101]))

    # 1 process, into plain tensors, nested as saved
    target: dict[str, Any] = {
        "model": {"w": torch.zeros(10, 6), "b": torch.zeros(5), "layers": [{"k": torch.zeros(4, 8).bfloat16()}]},
        "optim": {"param_groups": [{"lr": 0.0, "betas": None, "params": None}]},
        "step": 0,
        "name": "",
    }
    dcp.load(target, checkpoint_id=out)
    assert all(same(by_key(target)[k], v) for k, v in by_key(want).items())

    # import_dcp of the export: the same leaves under the same key paths as the checkpoint exported
    pytreeckpt.import_dcp(out, tmp_path / "back")
    saved = pytreeckpt.load(ckpt, per_rank="all")
    saved["rng"] = {f"rank{r}": part for r, part in saved["rng"].items()}  # (its key paths: rng.rank<r>...)
    original = by_key(saved)
    back = by_key(pytreeckpt.load(tmp_path / "back"))
    assert back.keys() == original.keys()
    assert all(same(back[k], original[k]) for k in original), [k for k in original if not same(back[k], original[k])]


@single_process_dcp
def test_a_large_tensor_goes_in_boxes_over_files_of_bounded_size(tmp_path: Path) -> None:
    big = torch.arange(3 * 40 * 50, dtype=torch.float32).reshape(3, 40, 50)  # 24,000 bytes; a row of dim 1: 200
    pytreeckpt.save(tmp_path / "c", {"big": big, "small": torch.ones(3)})
    pytreeckpt.export_dcp(tmp_path / "c", tmp_path / "d", max_file_size="1KiB")
    md = dcp.FileSystemReader(tmp_path / "d").read_metadata()
    chunks = md.state_dict_metadata["big"].chunks  # type: ignore[union-attr]
    assert len(chunks) == 3 * 8
    assert {tuple(c.sizes) for c in chunks} == {(1, 5, 50)}
    assert len(list((tmp_path / "d").glob("*.distcp"))) == 24
    boxes_in: dict[str, int] = {}
    for index, info in md.storage_data.items():
        boxes_in[info.relative_path] = boxes_in.get(info.relative_path, 0) + (index.fqn == "big")
    assert sorted(boxes_in.values()) == [1] * 24  # one 1,000-byte box a file (the small tensor beside one)
    got = {"big": torch.zeros(3, 40, 50), "small": torch.zeros(3)}
    dcp.load(got, checkpoint_id=tmp_path / "d")
    assert torch.equal(got["big"], big)
    assert torch.equal(got["small"], torch.ones(3))


def test_what_dcp_cannot_store_is_refused_naming_the_leaf(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "tuple", {"opt": {"pair": (torch.ones(2), 3)}, "w": torch.ones(1)})
    with pytest.raises(CheckpointError, match=r"leaf 'opt\.pair\.0': a tensor inside a tuple at 'opt\.pair'"):
        pytreeckpt.export_dcp(tmp_path / "tuple", tmp_path / "out")
    pytreeckpt.save(tmp_path / "list", [torch.ones(2)])
    with pytest.raises(CheckpointError, match="root is a list; a DCP state dict is a dict"):
        pytreeckpt.export_dcp(tmp_path / "list", tmp_path / "out")


def test_a_damaged_checkpoint_is_a_checkpoint_error_naming_the_leaf(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"model": {"w": torch.randn(64, 64)}})
    (stored,) = [f for f in (tmp_path / "c").rglob("*") if f.is_file() and f.stat().st_size > 16_000]
    with stored.open("r+b") as f:
        f.seek(stored.stat().st_size // 2)
        f.write(b"\xde\xad")
    with pytest.raises(CheckpointError, match=r"leaf 'model\.w'.*damaged"):  # (not DCP's wrapper of it)
        pytreeckpt.export_dcp(tmp_path / "c", tmp_path / "out")
    # two leaves DCP names alike (a tuple key, which DCP names by str(), beside a string key spelling it)
    pytreeckpt.save(tmp_path / "two", {"a": {(1, 2): torch.ones(1), "(1, 2)": torch.zeros(1)}})
    with pytest.raises(CheckpointError, match=r"two leaves have the DCP name 'a\.\(1, 2\)'"):
        pytreeckpt.export_dcp(tmp_path / "two", tmp_path / "out")


@single_process_dcp
def test_an_existing_dcp_checkpoint_is_replaced_only_when_asked(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "a", {"w": torch.ones(300)})
    pytreeckpt.save(tmp_path / "b", {"v": torch.zeros(2)})
    pytreeckpt.export_dcp(tmp_path / "a", tmp_path / "d", max_file_size=400)
    with pytest.raises(CheckpointError, match="already holds a DCP checkpoint; pass overwrite=True"):
        pytreeckpt.export_dcp(tmp_path / "b", tmp_path / "d")
    assert pytreeckpt.export_dcp(tmp_path / "b", tmp_path / "d", overwrite=True) == ["v"]
    assert [f.name for f in (tmp_path / "d").glob("*.distcp")] == ["__0_0.distcp"]  # the older files gone
    got = {"v": torch.ones(2)}
    dcp.load(got, checkpoint_id=tmp_path / "d")
    assert torch.equal(got["v"], torch.zeros(2))


@single_process_dcp
def test_the_command_line_exports_to_dcp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytreeckpt.save(tmp_path / "c", {"model": {"w": torch.arange(6.0)}, "step": 3})
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "d"), "--format", "dcp", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["names"] == ["model.w", "step"]
    assert len(shown["files"]) == 1
    got: dict[str, Any] = {"model": {"w": torch.zeros(6)}, "step": 0}
    dcp.load(got, checkpoint_id=tmp_path / "d")
    assert torch.equal(got["model"]["w"], torch.arange(6.0))
    assert got["step"] == 3
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "d"), "--format", "dcp"]) == 2
    assert "already holds a DCP checkpoint" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "d"), "--format", "dcp", "--overwrite"]) == 0
    assert capsys.readouterr().out.startswith(f"exported 2 items to {tmp_path / 'd'}")
    # the safetensors-only options are refused, not silently dropped
    assert main(["export", str(tmp_path / "c"), str(tmp_path / "e"), "--format", "dcp", "--dtype", "bfloat16"]) == 2
    assert "--dtype apply to safetensors only" in capsys.readouterr().err
    assert not (tmp_path / "e").exists()


def test_the_memory_benchmark_runs_both_routes_at_a_tiny_size(tmp_path: Path) -> None:
    """``benchmarks/dcp_export.py`` end to end (its figures are not asserted: this machine is shared)."""
    from benchmarks import dcp_export

    r = dcp_export.run(0.5, 2, "64KB", 1, tmp_path)
    assert set(r["routes"]) == set(dcp_export.ROUTES)
    for got in r["routes"].values():
        assert got["peak"] >= got["before"] > 0
    assert r["routes"]["export_dcp"]["files"] > 2


# --------------------------------------------------------------------------- an out directory made hostile


@single_process_dcp
@pytest.mark.parametrize("name", [".metadata.tmp", "__0_0.distcp"])
def test_a_link_planted_at_a_name_the_export_writes_is_removed_not_written_through(tmp_path: Path, name: str) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.arange(6.0)})
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / name).symlink_to(victim)
    pytreeckpt.export_dcp(tmp_path / "c", tmp_path / "d")
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "d" / name).is_symlink()
    got = {"w": torch.zeros(6)}
    dcp.load(got, checkpoint_id=tmp_path / "d")
    assert torch.equal(got["w"], torch.arange(6.0))


@single_process_dcp
def test_an_out_that_is_a_file_or_holds_a_directory_at_a_files_name_is_a_checkpoint_error(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.arange(6.0)})
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"export_dcp: out: .*file exists and is not a directory"):
        pytreeckpt.export_dcp(tmp_path / "c", tmp_path / "file")
    (tmp_path / "d" / "__0_0.distcp").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is a directory, not a file this writes"):
        pytreeckpt.export_dcp(tmp_path / "c", tmp_path / "d")
    (tmp_path / "d" / "__0_0.distcp").rmdir()
    (tmp_path / "d" / ".metadata").mkdir()  # a DCP checkpoint there, to replace: its .metadata is no file
    with pytest.raises(CheckpointError, match=r"\.metadata is a directory, not a file this writes"):
        pytreeckpt.export_dcp(tmp_path / "c", tmp_path / "d", overwrite=True)
    assert (tmp_path / "d" / ".metadata").is_dir()


@pytest.mark.parametrize(
    ("size", "error", "message"),
    [
        ("1e400GB", ValueError, "max_file_size: '1e400GB' is not a finite size"),
        ("nanMB", ValueError, "max_file_size: 'nanMB' is not a finite size"),
        ("5 parsecs", ValueError, "max_file_size: cannot read '5 parsecs' as a size"),
        (0, ValueError, "max_file_size must be a positive size, found 0"),
        (2.5e9, TypeError, "max_file_size must be an int or a string such as '5GB', found float"),
    ],
)
def test_a_max_file_size_that_is_no_size_is_refused_naming_the_argument(
    tmp_path: Path, size: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        pytreeckpt.export_dcp(tmp_path / "never-read", tmp_path / "d", max_file_size=size)
    assert not (tmp_path / "d").exists()
