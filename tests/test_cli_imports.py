"""The command line's ls, inspect and verify import no torch (so they answer at once), nor, on a local
checkpoint of chunk files or zip archives, TensorStore or ml_dtypes (whose 0.7 takes about 2 s to import);
``import pytreeckpt`` imports its public names on first use. (Their wall time is
``benchmarks/cli_latency.py``'s.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import HANG, swap_zip_entries, unpacked

import pytreeckpt
from pytreeckpt import PER_RANK, Compression, FlatRanges, Location, ShardedLeaf, StorageOptions

HEAVY = ("torch", "pytreeckpt.leaves", "pytreeckpt.api", "pytreeckpt.interop", "pytreeckpt.saving")
LOCAL_HEAVY = (*HEAVY, "tensorstore", "ml_dtypes")
"""What reading a local checkpoint of uncompressed arrays (chunk files, zip archives) must not import."""


def imported_after(code: str, heavy: tuple[str, ...] = HEAVY) -> dict[str, object]:
    """What ``code`` (run in a fresh interpreter, its result in ``out``) left in ``out`` and which of
    ``heavy`` it imported."""
    report = f"print(json.dumps({{'out': out, 'heavy': [m for m in {heavy!r} if m in sys.modules]}}))"
    script = f"import json, sys\nout = None\n{code}\n{report}\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def cli(*calls: list[object]) -> str:
    """Code running the command line's ``main`` on each argument list, their exit statuses in ``out``."""
    return "from pytreeckpt._cli import main\nout = [main(a) for a in " + repr([list(map(str, c)) for c in calls]) + "]"


@pytest.fixture
def ckpts(tmp_path: Path) -> Path:
    w = torch.arange(40.0).reshape(8, 5)
    state = {"model": {"w": ShardedLeaf.from_global(w, FlatRanges([(0, 13), (13, 40)]))}, "step": 1, "lr": 0.5}
    # dtypes numpy has not (ml_dtypes'), a 0-d array and an empty one (never packed: in chunk files of its own)
    odd = {
        "b": torch.ones(3, dtype=torch.bfloat16),
        "f8": torch.ones(4, dtype=torch.float8_e4m3fn),
        "s": torch.tensor(2.0),
        "e": torch.zeros(0, 3),
    }
    pytreeckpt.save(tmp_path / "packed", {**state, **odd})  # zip archives
    pytreeckpt.save(unpacked(tmp_path / "files"), {**state, **odd})  # chunk files
    pytreeckpt.save(tmp_path / "zstd", {"w": torch.randn(64, 64)}, compression=Compression("zstd"))
    pytreeckpt.save(Location(tmp_path / "ocdbt", StorageOptions(pack_format="ocdbt")), {"w": torch.ones(4)})
    pytreeckpt.save(tmp_path / "per_rank", {"rng": torch.ones(2), "step": 3}, spec={"rng": PER_RANK})
    return tmp_path


def test_ls_inspect_and_verify_import_no_torch(ckpts: Path) -> None:
    names = ("packed", "files", "zstd", "ocdbt", "per_rank")
    calls = [["ls", ckpts], ["ls", ckpts, "--json"]]
    for n in names:
        calls += [["inspect", ckpts / n], ["inspect", ckpts / n, "--json"], ["verify", ckpts / n, "--json"]]
    got = imported_after(cli(*calls))
    assert got["out"] == [0] * len(calls)
    assert got["heavy"] == []


def test_diff_inspect_stats_and_inspect_layout_import_no_torch(ckpts: Path) -> None:
    names = ("packed", "files", "zstd", "ocdbt", "per_rank")
    calls = [["diff", ckpts / "packed", ckpts / "files"], ["diff", ckpts / "packed", ckpts / "zstd", "--json"]]
    for n in names:
        calls += [["inspect", ckpts / n, "--stats"], ["inspect", ckpts / n, "--stats", "--json"]]
    calls += [["inspect", ckpts / "packed", "--layout", "model.w"], ["inspect", ckpts / "files", "--layout", "model.w"]]
    calls += [["inspect", ckpts / "per_rank", "--layout", "rng.rank0", "--json"]]
    got = imported_after(cli(*calls))
    # (packed and files hold the same state, in zip archives and in chunk files: equal; zstd has only "w")
    assert got["out"] == [0, 1] + [0] * (len(calls) - 2)
    assert got["heavy"] == []


def test_ls_of_a_local_directory_imports_no_tensorstore(ckpts: Path) -> None:
    got = imported_after(cli(["ls", ckpts], ["ls", ckpts / "packed", "--json"]), LOCAL_HEAVY)
    assert got["out"] == [0, 0]
    assert got["heavy"] == []


def test_ls_inspect_and_verify_of_chunk_files_and_zip_archives_import_neither_tensorstore_nor_ml_dtypes(
    ckpts: Path,
) -> None:
    calls = [["ls", ckpts], ["ls", ckpts, "--json"]]
    for n in ("packed", "files", "per_rank"):
        calls += [["inspect", ckpts / n], ["inspect", ckpts / n, "--json"], ["verify", ckpts / n, "--json"]]
    calls += [["inspect", ckpts / "zstd"], ["inspect", ckpts / "ocdbt"]]  # (their metadata alone)
    got = imported_after(cli(*calls), LOCAL_HEAVY)
    assert got["out"] == [0] * len(calls)
    assert got["heavy"] == []


def test_verify_finds_a_damaged_chunk_file_and_swapped_zip_entries_without_tensorstore(ckpts: Path) -> None:
    chunk = ckpts / "files" / "arrays" / "b" / "c" / "0"  # (bfloat16)
    chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 0x80]) + chunk.read_bytes()[1:])
    scalar = ckpts / "files" / "arrays" / "s" / "c"  # (0-d)
    scalar.write_bytes(scalar.read_bytes()[:-1])
    archive = ckpts / "packed" / "packed" / "0" / "0.zip"
    swap_zip_entries(archive, "arrays/f8/c/0", "arrays/s/c")  # (8 bytes each: the zip headers stay)
    code = (
        "import contextlib, io\nfrom pytreeckpt._cli import main\nout = []\n"
        f"for path in {[str(ckpts / 'files'), str(ckpts / 'packed')]!r}:\n"
        "    with contextlib.redirect_stdout(io.StringIO()) as shown:\n"
        "        status = main(['verify', path, '--json'])\n"
        "    out.append([status, [p['key'] for p in json.loads(shown.getvalue())['problems']]])"
    )
    got = imported_after(code, LOCAL_HEAVY)
    assert got["out"] == [[1, ["b", "s"]], [1, ["f8", "s"]]]
    assert got["heavy"] == []


def test_compressed_and_ocdbt_checkpoints_are_still_verified_through_tensorstore(ckpts: Path) -> None:
    """What still needs TensorStore: decoding compressed chunks, and reading OCDBT databases."""
    chunk = ckpts / "zstd" / "arrays" / "w" / "c" / "0" / "0"
    got = imported_after(cli(["verify", ckpts / "zstd"], ["verify", ckpts / "ocdbt", "--json"]), LOCAL_HEAVY)
    assert got["out"] == [0, 0]
    assert got["heavy"] == ["tensorstore", "ml_dtypes"]
    chunk.write_bytes(chunk.read_bytes()[:-8] + bytes(8))
    got = imported_after(cli(["verify", ckpts / "zstd"]), LOCAL_HEAVY)
    assert got["out"] == [1]
    assert "torch" not in got["heavy"]  # type: ignore[operator]


def test_verify_of_a_damaged_or_missing_checkpoint_imports_no_torch(ckpts: Path) -> None:
    chunk = next(p for p in (ckpts / "files" / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(bytes([chunk.read_bytes()[0] ^ 0x80]) + chunk.read_bytes()[1:])
    got = imported_after(
        cli(["verify", ckpts / "files"], ["verify", ckpts / "nothing"], ["inspect", ckpts / "nothing"])
    )
    assert got["out"] == [1, 2, 2]
    assert got["heavy"] == []


def test_the_console_script_and_python_m_import_no_torch(ckpts: Path) -> None:
    code = (
        "import runpy\nsys.argv = ['pytreeckpt', 'inspect', " + repr(str(ckpts / "packed")) + "]\n"
        "try:\n    runpy.run_module('pytreeckpt', run_name='__main__')\nexcept SystemExit as e:\n    out = e.code\n"
    )
    got = imported_after(code)
    assert got["out"] == 0
    assert got["heavy"] == []


def test_version_prints_the_package_version_and_imports_no_torch() -> None:
    code = (
        "import contextlib, io\nfrom pytreeckpt._cli import main\nshown = io.StringIO()\n"
        "with contextlib.redirect_stdout(shown):\n    try:\n        main(['--version'])\n"
        "    except SystemExit as e:\n        out = [e.code, shown.getvalue()]\n"
    )
    got = imported_after(code)
    assert got["out"] == [0, f"pytreeckpt {pytreeckpt.__version__}\n"]
    assert got["heavy"] == []


def test_import_pytreeckpt_is_lazy_and_every_public_name_resolves() -> None:
    got = imported_after("import pytreeckpt\nout = sorted(dir(pytreeckpt))")
    assert got["heavy"] == []
    assert set(pytreeckpt.__all__) <= set(got["out"])  # type: ignore[arg-type]
    got = imported_after("from pytreeckpt import *\nout = sorted(k for k in dir() if not k.startswith('_'))")
    assert set(pytreeckpt.__all__) <= set(got["out"])  # type: ignore[arg-type]
    for name in pytreeckpt.__all__:
        assert getattr(pytreeckpt, name) is not None, name
    assert pytreeckpt.plan_load.__name__ == "plan_load_of"
    assert pytreeckpt.api.save is pytreeckpt.save  # the layers stay reachable as attributes
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        pytreeckpt.nonesuch  # type: ignore[attr-defined]  # noqa: B018


def test_the_latency_benchmark_times_each_command_of_each_version() -> None:
    """``benchmarks/cli_latency.py`` end to end, once, beside this repository's last commit (no wall time asserted)."""
    from benchmarks import cli_latency

    if not (cli_latency.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    r = cli_latency.run("HEAD", repeat=1)
    assert set(r["seconds"]) == {"now", "before"}
    assert all(set(s) == {"ls", "inspect", "verify"} for s in r["seconds"].values())
    assert all(len(t) == 1 and t[0] > 0 for ts in r["rounds"].values() for t in ts.values())
    assert [row[2:] for row in cli_latency.targets(r)] == [("<=", 0.3)] * 3
    with pytest.raises(RuntimeError, match="cannot read no-such-revision"):
        cli_latency.run("no-such-revision", repeat=1)
