"""Checkpoints written by earlier versions of the format still load, bit for bit."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import bits, document_text, packed_in, unpacked

import pytreeckpt

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))

from make_golden import golden_state  # noqa: E402


def test_format_v1_golden_checkpoint_loads() -> None:
    want = golden_state()
    got = pytreeckpt.load(GOLDEN / "v1")
    for k in ("w", "flat", "rep"):
        assert torch.equal(bits(got["model"][k]), bits(want["model"][k].to_global())), k
    for k, v in want["dtypes"].items():
        assert torch.equal(bits(got["dtypes"][k]), bits(v)), k
    assert torch.equal(bits(got["optim"]["state"][0]["exp_avg"]), bits(want["optim"]["state"][0]["exp_avg"]))
    assert list(got["optim"]["state"]) == [0]
    assert tuple(got["point"]) == (1, "two")
    assert got["step"] == 3
    assert math.isnan(got["nan"])
    assert got["none"] is None
    assert pytreeckpt.metadata(GOLDEN / "v1").version == 1


def test_saving_the_golden_state_today_writes_the_golden_checkpoint_byte_for_byte(tmp_path: Path) -> None:
    # The same state, chunking and (unpacked) layout as tests/golden/make_golden.py used: every
    # chunk file is the same bytes, every array's zarr.json and the metadata say the same.

    where = pytreeckpt.Location(tmp_path / "v1", pytreeckpt.StorageOptions(pack_small_leaves=False))
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=64, max_chunk_bytes=64)
    pytreeckpt.save(where, golden_state(), chunking=chunking)
    old, new = GOLDEN / "v1", tmp_path / "v1"
    files = sorted(p.relative_to(old) for p in old.rglob("*") if p.is_file())
    written = sorted(p.relative_to(new) for p in new.rglob("*") if p.is_file() and p.name != ".pytreeckpt.lock")
    assert files == written
    for f in files:
        if f.name == "pytreeckpt.json":
            # (make_golden.py ran as a script, so its namedtuple's module was __main__)
            doc = json.loads((new / f).read_text().replace('"make_golden:Point"', '"__main__:Point"'))
            assert re.fullmatch(r"[0-9a-f]{8}", doc.pop("document_crc32c"))  # recorded since: the document's crc32c
            for leaf in doc["leaves"]:  # recorded since: every chunk's crc32c, that of its chunk file
                assert leaf.pop("chunk_crc32c", None) is not None or leaf["kind"] == "value", leaf["key"]
            assert doc == json.loads((old / f).read_text())
        elif f.name.endswith(".json"):
            assert json.loads((new / f).read_text()) == json.loads((old / f).read_text()), f
        else:
            assert (new / f).read_bytes() == (old / f).read_bytes(), f


@pytest.mark.parametrize(("pack", "version"), [("", 1), ("ocdbt", 2), ("zip", 3)])
def test_documents_of_every_version_written_without_their_own_checksum_still_load(
    tmp_path: Path, pack: str, version: int
) -> None:
    # Writers before the document recorded its crc32c (document_crc32c, its last member) wrote it
    # without: such documents of each format version load as before.
    path = tmp_path / "c"
    state = golden_state()
    pytreeckpt.save(packed_in(path, pack) if pack else unpacked(path), state)
    sealed = (path / "pytreeckpt.json").read_text()
    old = document_text(path)
    assert old != sealed
    assert json.loads(old)["version"] == version
    (path / "pytreeckpt.json").write_text(old)
    got = pytreeckpt.load(path)
    assert torch.equal(bits(got["model"]["w"]), bits(state["model"]["w"].to_global()))
    assert pytreeckpt.verify(path).ok
    assert pytreeckpt.metadata(path).version == version
