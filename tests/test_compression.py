"""Lossless compression of stored chunks, chosen per leaf."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tensorstore as ts
import torch
from helpers import document

import pytreeckpt
from pytreeckpt import Compression


def _state() -> dict:
    torch.manual_seed(0)
    w = torch.randn(1024, 768)  # arrays over 1 MiB have files of their own (smaller ones are packed)
    return {
        "model": {"w": w, "w_bf16": w.to(torch.bfloat16), "zeros": torch.zeros(1024, 512)},
        "optim": {"m": torch.randn(1024, 512) * 1e-3, "step": torch.tensor(7)},
        "note": "hello",
    }


def _stored(path: Path, name: str) -> int:
    return sum(f.stat().st_size for f in (path / "arrays" / name).rglob("*") if f.is_file() and f.name != "zarr.json")


@pytest.mark.parametrize("codec", ["zstd", "blosc", Compression("blosc", level=5, cname="zstd", shuffle="bitshuffle")])
def test_compressed_leaves_round_trip_bit_for_bit_and_open_with_plain_tensorstore(tmp_path: Path, codec) -> None:  # type: ignore[no-untyped-def]
    state = _state()
    pytreeckpt.save(tmp_path / "c", state, compression=codec)
    out = pytreeckpt.load(tmp_path / "c")
    for k in ("w", "w_bf16", "zeros"):
        assert torch.equal(out["model"][k], state["model"][k])
        assert out["model"][k].dtype == state["model"][k].dtype
    assert torch.equal(out["optim"]["m"], state["optim"]["m"])
    assert _stored(tmp_path / "c", "model.zeros") < 1024 * 512 * 4 // 100  # zeros all but vanish
    assert _stored(tmp_path / "c", "model.w_bf16") < 1024 * 768 * 2  # bf16 exponents compress
    zarr = json.loads((tmp_path / "c" / "arrays" / "model.w" / "zarr.json").read_text())
    names = [c["name"] for c in zarr["codecs"]]
    assert names[0] == "bytes"
    assert names[-1] == "crc32c"  # still checked on every read
    assert names[1] in ("zstd", "blosc")
    plain = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/c/arrays/model.w/"}).result()
    assert torch.equal(torch.from_numpy(plain.read().result()), state["model"]["w"])


def test_compression_is_chosen_per_subtree_and_shown_by_inspect(tmp_path: Path) -> None:
    state = _state()
    h = pytreeckpt.async_save(tmp_path / "c", state, compression={"model": "blosc", "optim": None, "note": None})
    h.wait()
    arrays = pytreeckpt.metadata(tmp_path / "c").arrays
    assert arrays["model.w"].compression == Compression("blosc")
    assert arrays["optim.m"].compression is None
    done = subprocess.run(
        [sys.executable, "-m", "pytreeckpt", "inspect", str(tmp_path / "c"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {a["key"]: a for a in json.loads(done.stdout)["arrays"]}
    assert rows["model.zeros"]["ratio"] > 100
    assert rows["model.zeros"]["compression"] == {"codec": "blosc", "level": 3, "cname": "lz4", "shuffle": "shuffle"}
    assert rows["optim.m"]["compression"] is None
    assert 0.9 < rows["optim.m"]["ratio"] <= 1.0
    text = subprocess.run(
        [sys.executable, "-m", "pytreeckpt", "inspect", str(tmp_path / "c")], capture_output=True, text=True, check=True
    ).stdout
    assert "blosc-lz4-3-shuffle" in text
    assert "ratio" in text


def test_bad_compressions_are_errors_naming_the_leaf(tmp_path: Path) -> None:
    with pytest.raises(pytreeckpt.CheckpointError, match=r"leaf 'model.w'.*'gzip'"):
        pytreeckpt.save(tmp_path / "c", {"model": {"w": torch.ones(3)}}, compression={"model": "gzip"})
    with pytest.raises(ValueError, match="level"):
        Compression("zstd", level=99)


def test_a_compressed_leaf_claiming_a_huge_shape_is_refused(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.zeros(1024, 512)}, compression="zstd")
    doc = document(tmp_path / "c")
    leaf = next(leaf for leaf in doc["leaves"] if leaf["key"] == "w")
    leaf["shape"] = [1 << 20, 1 << 20]
    del leaf["chunk_crc32c"]  # recorded for the true grid, it would be refused first
    (tmp_path / "c" / "pytreeckpt.json").write_text(json.dumps(doc))
    with pytest.raises(pytreeckpt.MetadataError, match="claims"):
        pytreeckpt.load(tmp_path / "c")
    leaf["shape"] = [1024, 512]
    leaf["compression"] = {"codec": "zstd", "level": "high"}
    (tmp_path / "c" / "pytreeckpt.json").write_text(json.dumps(doc))
    with pytest.raises(pytreeckpt.MetadataError, match="malformed compression"):
        pytreeckpt.load(tmp_path / "c")
