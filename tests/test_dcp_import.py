"""Importing torch.distributed.checkpoint directories, safely."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dist_workers as w
import pytest
import torch
from helpers import bits
from multiproc import run_world
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

import pytreeckpt

SRC = Path(pytreeckpt.__file__).parent.parent

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


# --------------------------------------------------------------------------- hostile DCP directories


def _dcp(path: Path) -> Path:
    """A DCP directory of one process: a tensor ``w`` (one chunk) and a pickled value ``n``, in ``__0_0.distcp``."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "n": 3}, checkpoint_id=path)
    return path


def _edit(path: Path, edit: Callable[[Metadata], Any]) -> None:
    """Rewrite ``path/.metadata`` (trusted here: this test's own) as ``edit`` leaves it, or as it returns."""
    md = pickle.loads((path / ".metadata").read_bytes())
    new = edit(md)
    (path / ".metadata").write_bytes(pickle.dumps(md if new is None else new))


def _info(md: Metadata, fqn: str) -> _StorageInfo:
    return next(info for index, info in md.storage_data.items() if index.fqn == fqn)


def _import_elsewhere(src: Path, out: Path, timeout: float = 60) -> str:
    """``import_dcp`` in a fresh interpreter (a hang is a failure, not a stuck run): what it printed."""
    code = textwrap.dedent(f"""
        import pytreeckpt
        try:
            pytreeckpt.import_dcp({str(src)!r}, {str(out)!r})
            print("imported")
        except pytreeckpt.CheckpointError as e:
            print("CheckpointError", e)
    """)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@single_process_dcp
@pytest.mark.parametrize("name", ["__0_0.distcp", ".metadata"])
def test_a_dcp_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path, name: str) -> None:
    src = _dcp(tmp_path / "dcp")
    (src / name).unlink()
    os.mkfifo(src / name)
    said = _import_elsewhere(src, tmp_path / "c")
    assert said.startswith("CheckpointError"), said
    assert f"{name} is not a regular file" in said, said
    assert not (tmp_path / "c").exists()


@single_process_dcp
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("loop", r"__0_0\.distcp: too many levels of symbolic links"),
        ("outside", r"__0_0\.distcp leads outside the checkpoint"),
        ("directory", r"__0_0\.distcp is not a regular file"),
        ("missing", r"__0_0\.distcp is missing"),
    ],
)
def test_a_distcp_file_that_loops_leads_out_is_a_directory_or_is_missing_is_a_checkpoint_error(
    tmp_path: Path, kind: str, message: str
) -> None:
    src = _dcp(tmp_path / "dcp")
    data = src / "__0_0.distcp"
    outside = tmp_path / "outside.distcp"
    data.rename(outside)
    if kind == "loop":
        os.symlink(data.name, data)
    elif kind == "outside":  # the very bytes DCP wrote, outside the directory: refused whatever they hold
        os.symlink(outside, data)
    elif kind == "directory":
        data.mkdir()
    with pytest.raises(pytreeckpt.CheckpointError, match=message):
        pytreeckpt.import_dcp(src, tmp_path / "c")
    assert not (tmp_path / "c").exists()


@single_process_dcp
def test_a_distcp_file_linked_inside_the_directory_is_followed(tmp_path: Path) -> None:
    src = _dcp(tmp_path / "dcp")
    (src / "__0_0.distcp").rename(src / "real.bin")
    os.symlink("real.bin", src / "__0_0.distcp")
    pytreeckpt.import_dcp(src, tmp_path / "c")
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], torch.arange(6.0).reshape(2, 3))


def _drop(obj: Any, name: str) -> None:
    object.__delattr__(obj, name)  # (MetadataIndex is a frozen dataclass)


def _put(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


# (what is done to the metadata, what the CheckpointError says): each raised another exception before
HAND_MADE = {
    "no state_dict_metadata": (lambda md: _drop(md, "state_dict_metadata"), r"state_dict_metadata is missing"),
    "storage_data None": (lambda md: _put(md, "storage_data", None), r"storage_data is None, expected a dict"),
    "not Metadata": (lambda md: {"state_dict_metadata": {}}, r"not DCP metadata \(it holds a dict\)"),
    "no properties": (
        lambda md: _drop(md.state_dict_metadata["w"], "properties"),
        r"state_dict_metadata\['w'\]\.properties is missing",
    ),
    "dtype a string": (
        lambda md: _put(md.state_dict_metadata["w"].properties, "dtype", "float32"),
        r"state_dict_metadata\['w'\]\.properties\.dtype is 'float32', expected a torch dtype",
    ),
    "no size": (lambda md: _drop(md.state_dict_metadata["w"], "size"), r"state_dict_metadata\['w'\]\.size is missing"),
    "size of strings": (
        lambda md: _put(md.state_dict_metadata["w"], "size", ["2", "3"]),
        r"state_dict_metadata\['w'\]\.size is a list, expected a sequence of at most 32 non-negative integers",
    ),
    "size past any memory": (
        lambda md: _put(md.state_dict_metadata["w"], "size", [0, 2**62]),
        r"state_dict_metadata\['w'\]\.size is \[0, 4611686018427387904\], whose extents span more than",
    ),
    "no relative_path": (
        lambda md: _drop(_info(md, "w"), "relative_path"),
        r"storage_data\['w'\]\.relative_path is missing",
    ),
    "no offset": (lambda md: _drop(_info(md, "w"), "offset"), r"storage_data\['w'\]\.offset is missing"),
    "no length": (lambda md: _drop(_info(md, "n"), "length"), r"storage_data\['n'\]\.length is missing"),
    "offset a string": (
        lambda md: _put(_info(md, "w"), "offset", "0"),
        r"storage_data\['w'\]\.offset is '0', expected a non-negative integer",
    ),
    "offset -5": (lambda md: _put(_info(md, "w"), "offset", -5), r"storage_data\['w'\]\.offset is -5, expected"),
    "length 2**40": (
        lambda md: _put(_info(md, "w"), "length", 2**40),
        r"DCP tensor 'w': the metadata puts it at bytes \d+\.\.\d+ of .*__0_0\.distcp, which holds \d+",
    ),
    "a path outside": (
        lambda md: _put(_info(md, "w"), "relative_path", "../__0_0.distcp"),
        r"storage_data\['w'\]\.relative_path is '\.\./__0_0\.distcp', expected the plain name of a file",
    ),
    "the directory itself": (
        lambda md: _put(_info(md, "w"), "relative_path", "."),
        r"storage_data\['w'\]\.relative_path is '\.', expected the plain name of a file",
    ),
    "fqn not a string": (
        lambda md: _put(md, "storage_data", {MetadataIndex(5, (0, 0)): _info(md, "w")}),  # type: ignore[arg-type]
        r"a key of storage_data has the fqn 5, expected a string",
    ),
    "chunk offset of another rank": (
        lambda md: _put(md, "storage_data", {MetadataIndex("w", (0,)): _info(md, "w"), **md.storage_data}),
        r"DCP tensor 'w': a chunk's offset \(0,\) does not have the 2 dims",
    ),
}


@single_process_dcp
@pytest.mark.parametrize("case", list(HAND_MADE))
def test_hand_made_dcp_metadata_is_a_checkpoint_error_naming_the_file_and_field(tmp_path: Path, case: str) -> None:
    edit, message = HAND_MADE[case]
    src = _dcp(tmp_path / "dcp")
    _edit(src, edit)
    with pytest.raises(pytreeckpt.CheckpointError, match=message) as caught:
        pytreeckpt.import_dcp(src, tmp_path / "c")
    assert str(src) in str(caught.value)
    assert not (tmp_path / "c").exists()


def _blob(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


@single_process_dcp
@pytest.mark.parametrize(
    ("first", "second"),
    [((0, 3), (2, 2)), ((0, 4), (1, 2))],  # (offset, length) of each chunk of a tensor of 4: overlapping, within
    ids=["overlapping", "within"],
)
def test_two_chunks_of_one_tensor_sharing_elements_are_refused_naming_both(
    tmp_path: Path, first: tuple[int, int], second: tuple[int, int]
) -> None:
    src = tmp_path / "dcp"
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(4)}, checkpoint_id=src)
    a = _blob(torch.arange(float(first[1])))
    b = _blob(torch.arange(float(second[1])) + 10)
    (src / "__0_0.distcp").write_bytes(a + b)

    def two_chunks(md: Metadata) -> None:
        md.storage_data = {
            MetadataIndex("w", (first[0],)): _StorageInfo("__0_0.distcp", 0, len(a)),
            MetadataIndex("w", (second[0],)): _StorageInfo("__0_0.distcp", len(a), len(b)),
        }

    _edit(src, two_chunks)
    with pytest.raises(
        pytreeckpt.CheckpointError,
        match=rf"DCP tensor 'w': chunks Region\(offset=\({first[0]},\), shape=\({first[1]},\)\) \(in __0_0\.distcp at "
        rf"byte 0\) and Region\(offset=\({second[0]},\), shape=\({second[1]},\)\) \(in __0_0\.distcp at byte "
        rf"{len(a)}\) share elements",
    ):
        pytreeckpt.import_dcp(src, tmp_path / "c")
    assert not (tmp_path / "c").exists()


@single_process_dcp
def test_chunks_that_tile_a_tensor_import_whole(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.zeros(2, 4)}, checkpoint_id=src)
    blobs = [_blob(torch.arange(4.0).reshape(2, 2) + 10 * i) for i in range(2)]
    (src / "__0_0.distcp").write_bytes(b"".join(blobs))
    _edit(
        src,
        lambda md: _put(
            md,
            "storage_data",
            {
                MetadataIndex("w", (0, 2 * i)): _StorageInfo("__0_0.distcp", sum(map(len, blobs[:i])), len(blobs[i]))
                for i in range(2)
            },
        ),
    )
    pytreeckpt.import_dcp(src, tmp_path / "c")
    want = torch.cat([torch.arange(4.0).reshape(2, 2), torch.arange(4.0).reshape(2, 2) + 10], dim=1)
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], want)


@single_process_dcp
def test_an_oversized_dcp_metadata_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    src = _dcp(tmp_path / "dcp")
    size = (src / ".metadata").stat().st_size
    with pytest.raises(pytreeckpt.CheckpointError, match=f"holds {size} bytes, more than the limit of {size - 1}"):
        pytreeckpt.import_dcp(src, tmp_path / "c", max_metadata_bytes=size - 1)
    with pytest.raises(ValueError, match="max_metadata_bytes must be positive"):
        pytreeckpt.import_dcp(src, tmp_path / "c", max_metadata_bytes=0)
    os.truncate(src / ".metadata", 3 << 30)  # sparse: 3 GiB of zeros, past the default limit
    code = textwrap.dedent(f"""
        import resource, pytreeckpt
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        try:
            pytreeckpt.import_dcp({str(src)!r}, {str(tmp_path / "c")!r})
        except pytreeckpt.CheckpointError as e:
            print("CheckpointError", e)
        print("grew", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)
    """)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert f"holds {3 << 30} bytes, more than the limit of {1 << 30}" in done.stdout, done.stdout
    assert int(done.stdout.split("grew")[-1]) < 256 << 20  # the file was not read
    assert not (tmp_path / "c").exists()


@single_process_dcp
def test_a_torch_save_archive_claiming_a_member_larger_than_itself_is_refused(tmp_path: Path) -> None:
    src = _dcp(tmp_path / "dcp")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:  # 64 MiB of zeros deflated into about 64 KiB
        z.writestr("archive/data.pkl", pickle.dumps([1, 2]))
        z.writestr("archive/padding", b"\0" * (64 << 20))
    bomb = buf.getvalue()
    (src / "__0_0.distcp").write_bytes(bomb)

    def point_at_the_bomb(md: Metadata) -> None:
        for fqn in ("w", "n"):
            _put(_info(md, fqn), "offset", 0)
            _put(_info(md, fqn), "length", len(bomb))

    _edit(src, point_at_the_bomb)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"claims a member 'archive/padding' of 67108864 bytes"):
        pytreeckpt.import_dcp(src, tmp_path / "c")
