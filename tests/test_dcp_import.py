"""Importing torch.distributed.checkpoint directories, safely."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import dist_workers as w
import pytest
import torch
from helpers import bits
from multiproc import run_world

import pytreeckpt

# DCP says this on every save without a process group; the tests below save in one process.
single_process_dcp = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled, unavailable or uninitialized:UserWarning"
)


def test_dcp_written_at_2_ranks_imports_and_loads_at_1_and_4(tmp_path: Path) -> None:
    src, out = tmp_path / "dcp", tmp_path / "ckpt"
    run_world(2, w.dcp_save, str(src))
    names = pytreeckpt.import_dcp(src, out)
    assert set(names) == {"model.w", "model.r", "step", "meta.name", "meta.lrs"}  # DCP's flattened names
    torch.manual_seed(0)
    want_w, want_r = torch.randn(10, 6), torch.randn(5)
    got = pytreeckpt.load(out)  # one process, plain tensors
    assert torch.equal(got["model.w"], want_w)
    assert torch.equal(got["model.r"], want_r)
    assert got["step"] == 7
    assert got["meta.name"] == "run"
    assert got["meta.lrs"] == [0.1, 0.01]
    assert all(run_world(4, w.dcp_imported_load, str(out)))


@single_process_dcp
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_dtypes_torch_saves_as_untyped_storages_import_bit_for_bit(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = {
        "f8": torch.linspace(-4, 4, 12).to(torch.float8_e4m3fn).reshape(3, 4),
        "f8e5": torch.linspace(-4, 4, 5).to(torch.float8_e5m2),
        "u16": torch.arange(7).to(torch.uint16),
        "u64": torch.tensor([2**63 + 5, 1], dtype=torch.uint64),
        "c32": torch.ones(3, dtype=torch.complex32),
        "bf16": torch.arange(4.0).to(torch.bfloat16),
        "strided": torch.arange(12.0).reshape(3, 4)[:, 1],  # a view: a storage larger than the tensor
    }
    dcp.save(state, checkpoint_id=tmp_path / "dcp")
    pytreeckpt.import_dcp(tmp_path / "dcp", tmp_path / "c")
    got = pytreeckpt.load(tmp_path / "c")
    for name, want in state.items():
        assert (got[name].dtype, got[name].shape) == (want.dtype, want.shape), name
        assert torch.equal(bits(got[name]), bits(want)), name


@single_process_dcp
def test_the_command_line_imports_a_dcp_directory(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"a": torch.arange(6.0).reshape(2, 3), "n": 3}, checkpoint_id=tmp_path / "dcp")
    script = Path(sys.executable).parent / "pytreeckpt"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "pytreeckpt"]
    done = subprocess.run([*cmd, "import", str(tmp_path / "dcp"), str(tmp_path / "c")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["a"], torch.arange(6.0).reshape(2, 3))


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@single_process_dcp
def test_a_crafted_dcp_metadata_runs_no_code(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    src = tmp_path / "dcp"
    dcp.save({"a": torch.ones(2)}, checkpoint_id=src)
    marker = tmp_path / "pwned"
    (src / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    with pytest.raises(pytreeckpt.CheckpointError, match=r"posix.system|os.system|not plain checkpoint metadata"):
        pytreeckpt.import_dcp(src, tmp_path / "c")
    assert not marker.exists()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"no \.metadata"):
        pytreeckpt.import_dcp(tmp_path, tmp_path / "c")
