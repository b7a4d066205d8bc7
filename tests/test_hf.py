"""Hugging Face weights: transformers' save_pretrained files loaded into FSDP2 shards, checkpoints exported
for from_pretrained (a part, renamed, in a dtype, in shards with the index, from 2 ranks, to S3), hostile
headers refused."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hf_workers as w
import pytest
import seaweed
import torch
from helpers import HANG
from multiproc import run_world
from safetensors.torch import load_file, save_file

import pytreeckpt

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # (nothing here reaches the hub: models are built from configs)


def _logits(model: Any) -> torch.Tensor:
    x = torch.arange(16).reshape(2, 8) % 256
    with torch.no_grad():
        return model.eval()(x).logits


def test_save_pretrained_files_load_into_an_fsdp2_model_each_rank_reading_its_shards(tmp_path: Path) -> None:
    ref = w.model(seed=0)
    ref.save_pretrained(tmp_path / "hf")
    want = load_file(tmp_path / "hf" / "model.safetensors")
    total = sum(t.numel() * t.element_size() for t in want.values())
    got = run_world(2, w.load_fsdp, str(tmp_path / "hf"))
    for r in got:
        assert r["missing"] == []
        assert set(r["full"]) == set(want)
        for k, t in want.items():
            assert torch.equal(r["full"][k], t), k
        # only its shards' bytes (and the header) were read: half the model, not all of it
        assert r["local"] <= r["read"] <= r["local"] + r["header"] + 4096, r
        assert r["read"] < 0.6 * total
        assert torch.equal(r["columns"], want["lm_head.weight"])
        half = want["lm_head.weight"].nbytes // 2
        assert half <= r["columns_read"] <= half + r["header"] + 4096, r["columns_read"]  # its columns, row by row


def test_a_checkpoint_part_exported_renamed_in_bfloat16_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model = w.model(seed=0)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(8)[None]).logits.sum().backward()
    opt.step()
    pytreeckpt.save(tmp_path / "ckpt", {"model": model, "optim": opt, "step": 7})
    files = pytreeckpt.export_safetensors(
        tmp_path / "ckpt",
        tmp_path / "hf",
        include="model.*",
        rename=lambda k: k.removeprefix("model."),
        dtype=torch.bfloat16,
        max_shard_size="100KB",
    )
    assert files[-1].name == "model.safetensors.index.json"
    assert len(files) > 3
    index = json.loads(files[-1].read_text())
    assert set(index["weight_map"]) == set(model.state_dict())  # no optimizer state, no "model." prefix
    for f in files[:-1]:
        assert f.stat().st_size <= 100_000 + 4096
        assert all(t.dtype == torch.bfloat16 for t in load_file(f).values())
    model.config.save_pretrained(tmp_path / "hf")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "theirs")  # transformers' own files, cast to bfloat16 as they load
    theirs = LlamaForCausalLM.from_pretrained(tmp_path / "theirs", dtype=torch.bfloat16)
    assert torch.equal(_logits(back), _logits(theirs))


def test_an_export_from_2_ranks_shares_the_files_out_and_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model = w.model(seed=0)
    pytreeckpt.save(tmp_path / "ckpt", {"model": model, "step": 7})
    total = pytreeckpt.metadata(tmp_path / "ckpt").nbytes
    (tmp_path / "hf-blocked").write_text("a file, where rank 1 is told to write a directory")
    got = run_world(2, w.export, str(tmp_path / "ckpt"), str(tmp_path / "hf"))
    for r in got:
        assert "export_safetensors failed on 1 of 2 ranks: rank 1" in (r["error"] or ""), r["error"]
    read = [r["read"] for r in got]
    assert all(r < 0.75 * total for r in read), (read, total)  # each rank read its own share, not the model
    assert sum(read) >= total
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model.config.save_pretrained(tmp_path / "hf")
    back = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(_logits(back), _logits(model))


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.Server]:
    yield from seaweed.module_server(tmp_path_factory)


def test_an_export_to_s3_writes_the_files_and_the_index(s3: seaweed.Server, tmp_path: Path) -> None:
    state = {"w": torch.randn(64, 16), "b": torch.randn(16), "n": torch.arange(8)}
    pytreeckpt.save(tmp_path / "ckpt", state)
    where = s3.location(f"hf-{uuid.uuid4().hex[:8]}")
    files = pytreeckpt.export_safetensors(tmp_path / "ckpt", where, dtype="float16", max_shard_size="2KB")
    assert files[-1].endswith("/model.safetensors.index.json")
    assert len(files) == 3
    kv = pytreeckpt.storage.Storage(where).kv
    assert kv is not None
    for url in files:
        name = url.rsplit("/", 1)[-1]
        (tmp_path / name).write_bytes(kv.read(name) or b"")
    back: dict[str, torch.Tensor] = {}
    for url in files[:-1]:
        back.update(load_file(tmp_path / url.rsplit("/", 1)[-1]))
    assert torch.equal(back["w"], state["w"].half())
    assert torch.equal(back["n"], state["n"])
    assert set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == set(state)


def test_the_command_line_exports_a_part_renamed_in_a_dtype(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "ckpt", {"model": {"w": torch.ones(4, 4), "b": torch.ones(4)}, "optim": torch.ones(2)})
    args = ["--include", "model.*", "--rename-prefix", "model.=net.", "--rename", "model.b=bias", "--dtype", "bfloat16"]
    cmd = [sys.executable, "-m", "pytreeckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == ["bias", "net.w"]
    assert got["net.w"].dtype == torch.bfloat16


def test_load_errors_name_the_key_and_strict_false_loads_what_both_have(tmp_path: Path) -> None:
    save_file({"w": torch.arange(6.0).reshape(2, 3), "extra": torch.ones(1)}, tmp_path / "m.safetensors")
    f = tmp_path / "m.safetensors"
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"'w'.*shape \[2, 3\], the target \[3, 2\]"):
        pytreeckpt.load_safetensors(f, {"w": torch.empty(3, 2)}, strict=False)
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"'w'.*float32, the target float16.*cast=True"):
        pytreeckpt.load_safetensors(f, {"w": torch.empty(2, 3, dtype=torch.float16)}, strict=False)
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"\['gone'\] are not in the files.*\['extra'\]"):
        pytreeckpt.load_safetensors(f, {"w": torch.empty(2, 3), "gone": torch.empty(1)})
    report = pytreeckpt.LoadReport()
    keep = torch.full((1,), 5.0)
    target = {"layer": {"w": torch.empty(2, 3, dtype=torch.float16)}, "gone": keep}
    out = pytreeckpt.load_safetensors(f, target, rename={"w": "layer.w"}, cast=True, strict=False, report=report)
    assert out is target
    assert torch.equal(out["layer"]["w"], torch.arange(6.0).reshape(2, 3).half())
    assert out["gone"] is keep
    assert keep.item() == 5.0
    assert (report.missing, report.unexpected, report.cast) == (
        ["gone"],
        ["extra"],
        [("layer.w", "float32", "float16")],
    )


def _file(path: Path, header: dict[str, Any] | bytes, data: bytes = b"\0" * 16, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


def _t(lo: int, hi: int, shape: list[int]) -> dict[str, Any]:
    return {"dtype": "F32", "shape": shape, "data_offsets": [lo, hi]}


@pytest.mark.parametrize(
    ("header", "length", "message"),
    [
        ({"a": _t(0, 8, [2]), "b": _t(4, 12, [2])}, None, "'a' and 'b' claim overlapping bytes"),
        ({"a": _t(8, 24, [4])}, None, "'a' claims bytes 8..24 .* 16 data bytes"),
        ({"a": _t(0, 8, [3])}, None, r"'a' claims bytes 0..8 .* shape \[3\]"),
        ({"a": _t(0, 4, [-1, -1])}, None, "negative extent"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, None, "malformed"),
        (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', None, "appears twice"),
        ({"a": _t(0, 4, [1])}, 1 << 40, "does not fit the file"),
    ],
)
def test_hostile_headers_are_refused_before_any_read(
    tmp_path: Path, header: dict[str, Any] | bytes, length: int | None, message: str
) -> None:
    f = _file(tmp_path / "bad.safetensors", header, length=length)
    with pytest.raises(pytreeckpt.CheckpointError, match=message):
        pytreeckpt.load_safetensors(f, {"a": torch.empty(1)}, strict=False)
    with pytest.raises(pytreeckpt.CheckpointError, match=message):
        pytreeckpt.import_safetensors(f, tmp_path / "c")


def test_an_index_naming_files_elsewhere_or_wrongly_is_refused(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "../model.safetensors"}}))
    with pytest.raises(pytreeckpt.CheckpointError, match="not a safetensors file beside it"):
        pytreeckpt.load_safetensors(tmp_path, {"w": torch.empty(2)})
    index.write_text(json.dumps({"weight_map": {"w": "model.safetensors", "v": "model.safetensors"}}))
    with pytest.raises(
        pytreeckpt.CheckpointError, match=r"puts tensor 'v' in model\.safetensors, which does not hold it"
    ):
        pytreeckpt.load_safetensors(tmp_path, {"w": torch.empty(2)})


def test_an_export_over_an_earlier_one_leaves_only_its_own_files(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "ckpt", {"a": torch.ones(16), "b": torch.ones(16)})
    sharded = pytreeckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=64)
    (tmp_path / "hf" / "config.json").write_text("{}")
    single = pytreeckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert pytreeckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "hf", max_shard_size=64) == sharded
    assert sorted((tmp_path / "hf").iterdir()) == sorted([*sharded, tmp_path / "hf" / "config.json"])
    assert single == [tmp_path / "hf" / "model.safetensors"]


def test_gpt2_with_tied_weights_both_ways(tmp_path: Path) -> None:
    """save_pretrained writes the tied embedding once; the model's state dict names it twice: both loads agree."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path / "theirs")
    torch.manual_seed(1)
    other = GPT2LMHeadModel(config)
    pytreeckpt.load_safetensors(tmp_path / "theirs", other)  # strict: lm_head.weight is wte's memory
    assert torch.equal(_logits(other), _logits(model))
    pytreeckpt.save(tmp_path / "ckpt", {"model": model, "step": 1})
    pytreeckpt.export_safetensors(tmp_path / "ckpt", tmp_path / "ours", include="model.*", rename=lambda k: k[6:])
    config.save_pretrained(tmp_path / "ours")
    assert torch.equal(_logits(GPT2LMHeadModel.from_pretrained(tmp_path / "ours")), _logits(model))
    with pytest.raises(pytreeckpt.TargetMismatchError, match="'w' is a tensor on the meta device"):
        pytreeckpt.load_safetensors(tmp_path / "theirs", {"w": torch.empty(2, device="meta")}, strict=False)
