"""export_safetensors and import_safetensors: tensors and Python values make the round trip."""

from __future__ import annotations

import enum
import json
import math
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import pytreeckpt
from pytreeckpt.interop._st_format import INDEX


class Stage(enum.IntEnum):
    PRETRAIN = 1
    FINETUNE = 2


def _state() -> dict[str, object]:
    return {
        "model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4, dtype=torch.bfloat16)},
        "optim": {"step": 1200, "lr": 3e-4, "betas": (0.9, 0.95), "warm": True, "nan": math.nan},
        "data": {"epoch": 2, "position": 123_456_789, "file": "shard-00007.bin", "skip": None},
        "stage": Stage.FINETUNE,
    }


def _values() -> dict[str, object]:
    """The Python values of ``_state()`` by key path (tuples are containers: their items are leaves)."""
    return {
        "optim.step": 1200,
        "optim.lr": 3e-4,
        "optim.betas.0": 0.9,
        "optim.betas.1": 0.95,
        "optim.warm": True,
        "optim.nan": math.nan,
        "data.epoch": 2,
        "data.position": 123_456_789,
        "data.file": "shard-00007.bin",
        "data.skip": None,
        "stage": Stage.FINETUNE,
    }


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("max_shard_size", ["5GB", "40B"])
def test_python_values_survive_export_and_import(tmp_path: Path, max_shard_size: str) -> None:
    state = _state()
    pytreeckpt.save(tmp_path / "c", state)
    files = pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out", max_shard_size=max_shard_size)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) == (1 if max_shard_size == "5GB" else 2)
    with safe_open(str(shards[0]), "pt") as f:  # the safetensors library's own reader
        stored = json.loads(f.metadata()["pytreeckpt.values"])
    assert stored["optim.step"] == 1200
    assert stored["optim.nan"] == {"float": "nan"}
    assert stored["stage"] == {"enum": f"{__name__}:Stage", "value": 2}
    names = pytreeckpt.import_safetensors(tmp_path / "out", tmp_path / "back")
    assert sorted(names) == ["model.b", "model.w"]
    back = pytreeckpt.load(tmp_path / "back")
    want = _values()
    assert set(back) == {"model.w", "model.b", *want}
    for key, value in want.items():
        assert _same(back[key], value), (key, back[key], value)
    assert torch.equal(back["model.w"], torch.arange(12.0).reshape(3, 4))


def test_a_checkpoint_of_values_only_exports_and_imports(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"step": 7, "note": "no tensors"})
    pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out")
    pytreeckpt.import_safetensors(tmp_path / "out" / "model.safetensors", tmp_path / "back")
    assert pytreeckpt.load(tmp_path / "back") == {"step": 7, "note": "no tensors"}


def _with_metadata(path: Path, meta: dict[str, str], tensor_name: str = "w") -> None:
    header = json.dumps(
        {"__metadata__": meta, tensor_name: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<f", 1.0))


def test_malformed_or_clashing_values_in_a_header_are_refused(tmp_path: Path) -> None:
    _with_metadata(tmp_path / "bad.safetensors", {"pytreeckpt.values": "[1, 2]"})
    with pytest.raises(pytreeckpt.CheckpointError, match=r"bad\.safetensors.*malformed 'pytreeckpt\.values'"):
        pytreeckpt.import_safetensors(tmp_path / "bad.safetensors", tmp_path / "c1")
    _with_metadata(tmp_path / "clash.safetensors", {"pytreeckpt.values": '{"w": 1}'})
    with pytest.raises(pytreeckpt.CheckpointError, match="'w' names both a tensor and a value"):
        pytreeckpt.import_safetensors(tmp_path / "clash.safetensors", tmp_path / "c2")
    _with_metadata(tmp_path / "plain.safetensors", {"format": "pt"})  # other writers' files: tensors only
    assert pytreeckpt.import_safetensors(tmp_path / "plain.safetensors", tmp_path / "c3") == ["w"]
    assert list(pytreeckpt.load(tmp_path / "c3")) == ["w"]


# --------------------------------------------------------------------------- hostile files and arguments

SRC = Path(pytreeckpt.__file__).parent.parent


def _run(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (a crash is a return code, a hang a failure, neither the test run's)."""
    script = "import pytreeckpt, torch, os\n" + textwrap.dedent(code)
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=env)


# The import reads the file, and then (the hook) the file is cut to a few bytes: between the header and the
# tensors, or after the tensors, while the checkpoint is being saved from them.
TRUNCATE = """
from pytreeckpt.interop import _safetensors
FILE, WHEN = {file!r}, {when!r}
original = getattr(_safetensors, WHEN)

def cut_first(*args, **kwargs):
    if WHEN == "save":
        os.truncate(FILE, 16)
        return original(*args, **kwargs)
    out = original(*args, **kwargs)
    os.truncate(FILE, 16)
    return out

setattr(_safetensors, WHEN, cut_first)
try:
    _safetensors.import_safetensors(FILE, {out!r})
    print("imported")
except pytreeckpt.CheckpointError as e:
    print("CheckpointError", e)
"""


@pytest.mark.parametrize("when", ["read_header", "save"])
def test_a_file_cut_short_while_it_is_imported_is_a_checkpoint_error_never_a_crash(tmp_path: Path, when: str) -> None:
    from safetensors.torch import save_file

    want = {"w": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(1000)}  # 4 MiB: many pages
    save_file(want, tmp_path / "m.safetensors")
    done = _run(TRUNCATE.format(file=str(tmp_path / "m.safetensors"), when=when, out=str(tmp_path / "c")))
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # (a SIGBUS: -7)
    if when == "read_header":  # the tensors' bytes are gone before they are read
        assert done.stdout.startswith("CheckpointError"), done.stdout
        assert "m.safetensors holds 16 bytes now" in done.stdout, done.stdout
    else:  # they were read before the cut: the import has them all
        assert done.stdout.strip() == "imported", done.stdout
        got = pytreeckpt.load(tmp_path / "c")
        assert all(torch.equal(got[k], v) for k, v in want.items())


FIRST, SECOND = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _shards(path: Path, index: dict[str, str] | None = None) -> Path:
    """Two files, ``a`` and ``c`` in the first and ``b`` in the second, and an index (theirs by default)."""
    from safetensors.torch import save_file

    path.mkdir()
    save_file({"a": torch.ones(2), "c": torch.ones(1)}, path / FIRST)
    save_file({"b": torch.zeros(3)}, path / SECOND)
    weight_map = index or {"a": FIRST, "b": SECOND, "c": FIRST}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


@pytest.mark.parametrize(
    ("index", "message"),
    [
        (
            {"a": SECOND, "b": SECOND, "c": FIRST},
            rf"puts tensor 'a' in {SECOND}, which does not hold it \({FIRST} does\)",
        ),
        ({"a": SECOND, "b": SECOND}, rf"puts tensor 'a' in {SECOND}, which does not hold it$"),  # (the first: unread)
        ({"a": FIRST, "b": SECOND}, rf"does not name tensor 'c', which {FIRST} holds"),
        ({"a": FIRST, "b": SECOND, "c": "x.safetensors"}, r"x\.safetensors is missing"),
    ],
    ids=["placed in another file", "placed in a file without it", "omitted", "in a file that is not there"],
)
def test_an_index_that_disagrees_with_its_files_is_refused_by_import_and_load(
    tmp_path: Path, index: dict[str, str], message: str
) -> None:
    src = _shards(tmp_path / "hf", index)
    with pytest.raises(pytreeckpt.CheckpointError, match=message):
        pytreeckpt.import_safetensors(src, tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with pytest.raises(pytreeckpt.CheckpointError, match=message):
        pytreeckpt.load_safetensors(src, {"a": torch.empty(2), "b": torch.empty(3)}, strict=False)


@pytest.mark.parametrize("where", ["outside", "loop"])
def test_a_shard_beside_an_index_that_is_a_link_out_of_the_directory_is_refused(tmp_path: Path, where: str) -> None:
    src = _shards(tmp_path / "hf")
    shard = src / "model-00001-of-00002.safetensors"
    shard.rename(tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors" if where == "outside" else shard.name)
    message = "leads outside the checkpoint" if where == "outside" else "too many levels of symbolic links"
    with pytest.raises(pytreeckpt.CheckpointError, match=rf"model-00001-of-00002\.safetensors:? {message}"):
        pytreeckpt.import_safetensors(src, tmp_path / "c")
    with pytest.raises(pytreeckpt.CheckpointError, match=message):
        pytreeckpt.load_safetensors(src, {"a": torch.empty(2), "b": torch.empty(3)})


def test_links_inside_the_directory_and_a_linked_file_named_directly_are_followed(tmp_path: Path) -> None:
    src = _shards(tmp_path / "hf")
    shard = src / "model-00001-of-00002.safetensors"
    shard.rename(src / "blob")
    shard.symlink_to("blob")
    assert sorted(pytreeckpt.import_safetensors(src, tmp_path / "c")) == ["a", "b", "c"]
    (tmp_path / "named.safetensors").symlink_to(src / "blob")  # the file the caller names: its link is theirs
    assert pytreeckpt.import_safetensors(tmp_path / "named.safetensors", tmp_path / "d") == ["a", "c"]


def test_a_snapshot_of_the_hugging_face_cache_reads_through_its_links_to_blobs_and_no_further(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"  # the cache's layout: snapshots/<rev>/<file> -> ../../blobs/<hash>
    src = _shards(tmp_path / "made")
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        f.rename(repo / "blobs" / f"{i:040x}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"{i:040x}"))
    assert sorted(pytreeckpt.import_safetensors(snapshot, tmp_path / "c")) == ["a", "b", "c"]
    out = pytreeckpt.load_safetensors(snapshot, {"a": torch.empty(2), "b": torch.empty(3), "c": torch.empty(1)})
    assert torch.equal(out["b"], pytreeckpt.load(tmp_path / "c")["b"])
    shard = snapshot / "model-00001-of-00002.safetensors"  # a link out of the model's own folder: refused still
    target = shard.resolve()
    shard.unlink()
    target.rename(tmp_path / "hub" / "elsewhere")
    shard.symlink_to(tmp_path / "hub" / "elsewhere")
    with pytest.raises(pytreeckpt.CheckpointError, match="leads outside the checkpoint"):
        pytreeckpt.import_safetensors(snapshot, tmp_path / "d")


def test_a_fifo_beside_an_index_is_refused_not_waited_on(tmp_path: Path) -> None:
    src = _shards(tmp_path / "hf")
    (src / "model-00002-of-00002.safetensors").unlink()
    os.mkfifo(src / "model-00002-of-00002.safetensors")
    done = _run(f"""
        try:
            pytreeckpt.import_safetensors({str(src)!r}, {str(tmp_path / "c")!r})
        except pytreeckpt.CheckpointError as e:
            print("CheckpointError", e)
    """)
    assert done.returncode == 0, done.stderr
    assert "model-00002-of-00002.safetensors is not a regular file" in done.stdout, done.stdout


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (
            {"w": {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [0, 0]}},
            r"tensor 'w' has the shape \[0, 4611686018427387904\], whose extents span more than",
        ),
        (
            {"__metadata__": {"pytreeckpt.values": '{"v": ' + "[" * 100_000 + "]" * 100_000 + "}"}},
            r"malformed 'pytreeckpt\.values' in the header metadata",
        ),
    ],
    ids=["a shape past any memory", "values nested 100,000 deep"],
)
def test_a_header_numpy_or_json_cannot_take_is_a_checkpoint_error_naming_the_file(
    tmp_path: Path, header: dict[str, Any], message: str
) -> None:
    raw = json.dumps(header).encode()
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(pytreeckpt.CheckpointError, match=rf"bad\.safetensors: .*{message}"):
        pytreeckpt.import_safetensors(tmp_path / "bad.safetensors", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_tensors_claiming_more_memory_than_the_process_may_have_are_refused_before_reading(tmp_path: Path) -> None:
    head = json.dumps({"w": {"dtype": "F32", "shape": [1 << 30], "data_offsets": [0, 4 << 30]}}).encode()
    f = tmp_path / "big.safetensors"
    f.write_bytes(struct.pack("<Q", len(head)) + head)
    os.truncate(f, 8 + len(head) + (4 << 30))  # sparse: 4 GiB of zeros
    done = _run(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, resource.RLIM_INFINITY))
        try:
            pytreeckpt.import_safetensors({str(f)!r}, {str(tmp_path / "c")!r})
        except pytreeckpt.CheckpointError as e:
            print("CheckpointError", e)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"reads {4 << 30} bytes of tensors into memory; this process may allocate about" in done.stdout, done.stdout


def test_a_tensor_renamed_to_the_headers_own_metadata_entry_is_refused_naming_both(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2), "step": 3})
    with pytest.raises(pytreeckpt.CheckpointError, match="rename gives leaf 'w' the name '__metadata__'"):
        pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out", rename={"w": "__metadata__"})
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("shards", [1, 2])
def test_links_planted_at_the_exports_temporary_names_are_removed_not_written_through(
    tmp_path: Path, shards: int
) -> None:
    pytreeckpt.save(tmp_path / "c", {"a": torch.ones(16), "b": torch.zeros(16)})
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    names = ["model.safetensors"] if shards == 1 else ["model-00001-of-00002.safetensors", INDEX]
    for name in names:
        (out / f".{name}.tmp").symlink_to(victim)
    files = pytreeckpt.export_safetensors(tmp_path / "c", out, max_shard_size="5GB" if shards == 1 else 64)
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == sorted(f.name for f in files)  # the links gone, no temporaries
    back = pytreeckpt.import_safetensors(out, tmp_path / "back")
    assert sorted(back) == ["a", "b"]


def test_an_out_that_is_a_file_or_holds_a_directory_at_a_files_name_is_refused(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"a": torch.ones(16), "b": torch.zeros(16)})
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"out: .*file exists and is not a directory"):
        pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "file")
    stale = tmp_path / "out" / "model-00001-of-00002.safetensors"
    stale.mkdir(parents=True)  # where an earlier sharded export's file was: a directory now, not removed
    with pytest.raises(pytreeckpt.CheckpointError, match=r"model-00001-of-00002\.safetensors is a directory"):
        pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out")
    assert stale.is_dir()
    stale.rmdir()
    (tmp_path / "out" / "model.safetensors").unlink()  # (written before the stale names were cleared)
    (tmp_path / "out" / "model.safetensors").mkdir()  # where this export's file goes
    with pytest.raises(pytreeckpt.CheckpointError, match=r"cannot write .*model\.safetensors: Is a directory"):
        pytreeckpt.export_safetensors(tmp_path / "c", tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["model.safetensors"]  # (no temporary left)


@pytest.mark.parametrize(
    ("size", "error", "message"),
    [
        ("1e400GB", ValueError, "max_shard_size: '1e400GB' is not a finite size"),
        ("-5GB", ValueError, "max_shard_size must be a positive size, found '-5GB'"),
        (None, TypeError, "max_shard_size must be an int or a string such as '5GB', found NoneType"),
    ],
)
def test_a_max_shard_size_that_is_no_size_is_refused_naming_the_argument(
    tmp_path: Path, size: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        pytreeckpt.export_safetensors(tmp_path / "never-read", tmp_path / "out", max_shard_size=size)
    assert not (tmp_path / "out").exists()
