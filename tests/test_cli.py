"""The real `pytreeckpt` command line, run as a subprocess on real checkpoints."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import HANG, unpacked
from safetensors.torch import load_file, save_file

import pytreeckpt
from pytreeckpt import FlatRanges, ShardedLeaf

SCRIPT = Path(sys.executable).parent / "pytreeckpt"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "pytreeckpt"]
    # (a crash of the command, not only its exceptions, leaves a traceback in its stderr)
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=HANG, env=env)


def run_json(*args: str | Path) -> Any:
    """The command's ``--json`` output; a failure shows its stderr."""
    done = run(*map(str, args))
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{args}: exit status {done.returncode}, no JSON on stdout; stderr:\n{done.stderr}")


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    w = torch.arange(40.0).reshape(8, 5)
    pytreeckpt.save(
        tmp_path / "step_1",
        {"model": {"w": ShardedLeaf.from_global(w, FlatRanges([(0, 13), (13, 40)]))}, "step": 1, "lr": float("nan")},
    )
    pytreeckpt.save(unpacked(tmp_path / "step_2"), {"model": {"w": w + 1}, "step": 2})
    (tmp_path / "step_3" / "arrays").mkdir(parents=True)  # a crashed save
    return tmp_path


def test_ls_lists_a_crashed_save_that_wrote_only_packed_leaves(ckpts: Path) -> None:
    """As a key-value store's listing does: any directory a save writes marks a checkpoint."""
    (ckpts / "step_4" / "packed" / "0").mkdir(parents=True)
    (ckpts / "step_4" / "packed" / "0" / "0.zip").write_bytes(b"PK")
    (ckpts / "step_5" / "ocdbt" / "0").mkdir(parents=True)
    (ckpts / "notes").mkdir()  # not a checkpoint
    data = run_json("ls", ckpts, "--json")
    assert [(e["name"], e["committed"]) for e in data] == [
        ("step_1", True),
        ("step_2", True),
        ("step_3", False),
        ("step_4", False),
        ("step_5", False),
    ]


def test_ls_lists_committed_and_uncommitted(ckpts: Path) -> None:
    done = run("ls", ckpts)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["checkpoint", "state", "size", "time"]
    assert [line.split()[:2] for line in lines[1:]] == [
        ["step_1", "committed"],
        ["step_2", "committed"],
        ["step_3", "UNCOMMITTED"],
    ]
    data = run_json("ls", ckpts, "--json")
    assert [(e["name"], e["committed"]) for e in data] == [("step_1", True), ("step_2", True), ("step_3", False)]
    assert data[0]["bytes"] > 160


def test_inspect_shows_the_tree(ckpts: Path) -> None:
    done = run("inspect", ckpts / "step_1")
    assert done.returncode == 0, done.stderr
    for text in ("model.w", "float32", "(8, 5)", "flat x2 ranks", "nan"):
        assert text in done.stdout, text
    data = run_json("inspect", ckpts / "step_1", "--json")
    assert data["arrays"][0]["key"] == "model.w"
    assert data["arrays"][0]["layout"]["kind"] == "flat"
    assert data["values"]["step"] == 1


def test_verify_exit_status(ckpts: Path) -> None:
    ok = run("verify", ckpts / "step_2")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok:")
    chunk = next(p for p in (ckpts / "step_2" / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x80
    chunk.write_bytes(bytes(data))
    bad = run("verify", ckpts / "step_2")
    assert bad.returncode == 1
    assert "DAMAGED model.w" in bad.stdout
    assert run_json("verify", ckpts / "step_2", "--json")["ok"] is False
    missing = run("verify", ckpts / "step_3")
    assert missing.returncode == 2
    assert "not a committed checkpoint" in missing.stderr


def test_safetensors_round_trip_through_the_command_line(tmp_path: Path) -> None:
    tensors = {
        "embed.weight": torch.randn(50, 16),
        "layers.0.bias": torch.randn(16).to(torch.bfloat16),
        "count": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False]),
        "f8": torch.randn(9).to(torch.float8_e4m3fn),
    }
    save_file(tensors, tmp_path / "in.safetensors")
    imported = run("import", tmp_path / "in.safetensors", tmp_path / "ckpt")
    assert imported.returncode == 0, imported.stderr
    exported = run("export", tmp_path / "ckpt", tmp_path / "out", "--format", "safetensors", "--max-shard-size", "2KB")
    assert exported.returncode == 0, exported.stderr
    files = sorted((tmp_path / "out").iterdir())
    assert (tmp_path / "out" / "model.safetensors.index.json") in files
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    back: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            back.update(load_file(f))  # the safetensors library's own reader
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype
        assert torch.equal(back[name].view(torch.uint8), t.view(torch.uint8)), name
    again = run("import", tmp_path / "out", tmp_path / "ckpt2")  # an indexed directory
    assert again.returncode == 0, again.stderr
    loaded = pytreeckpt.load(tmp_path / "ckpt2")
    for name, t in tensors.items():
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_single_file_export_and_bad_inputs(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(3), "step": 4})
    done = run("export", tmp_path / "c", tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["w"], torch.ones(3))
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 20)
    bad = run("import", tmp_path / "junk.safetensors", tmp_path / "c2")
    assert bad.returncode == 2
    assert "header" in bad.stderr
    for size in ("1e400GB", "-5MB", "lots"):  # an option's value refused with its name, not a traceback
        bad = run("export", tmp_path / "c", tmp_path / f"out{size}", f"--max-shard-size={size}")
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.startswith("pytreeckpt export:"), bad.stderr
        assert "max_shard_size" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr


def test_verify_says_when_the_metadata_records_no_chunk_checksums() -> None:
    golden = Path(__file__).parent / "golden" / "v1"  # written before chunk checksums were recorded
    done = run("verify", golden)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok:")
    assert "records no chunk checksums" in done.stdout
    assert run_json("verify", golden, "--json")["unrecorded"]


def test_verify_prints_a_status_when_nothing_can_be_checked(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(3)})
    (tmp_path / "c" / "pytreeckpt.json").write_text("{")
    done = run("verify", tmp_path / "c")
    assert done.returncode == 2
    assert done.stdout.startswith("FAILED:")
    assert "metadata is not valid JSON" in done.stderr
    data = run_json("verify", tmp_path / "c", "--json")
    assert data["ok"] is False
    assert "not valid JSON" in data["error"]


def test_python_values_survive_export_and_import_on_the_command_line(tmp_path: Path) -> None:
    state = {"model": {"w": torch.randn(4, 4)}, "step": 900, "lr": 1e-4, "data": {"pos": 31337, "name": "c4"}}
    pytreeckpt.save(tmp_path / "c", state)
    exported = run("export", tmp_path / "c", tmp_path / "out", "--max-shard-size", "16B")
    assert exported.returncode == 0, exported.stderr
    imported = run("import", tmp_path / "out", tmp_path / "back")
    assert imported.returncode == 0, imported.stderr
    back = pytreeckpt.load(tmp_path / "back")
    assert {k: back[k] for k in ("step", "lr", "data.pos", "data.name")} == {
        "step": 900,
        "lr": 1e-4,
        "data.pos": 31337,
        "data.name": "c4",
    }
    assert torch.equal(back["model.w"], state["model"]["w"])
    shown = run_json("inspect", tmp_path / "back", "--json")
    assert shown["values"]["step"] == 900
