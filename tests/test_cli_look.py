"""Looking inside without writing code: ``pytreeckpt diff A B`` (and ``pytreeckpt.diff``), ``inspect --stats`` and
``inspect --layout KEY``, on real checkpoints: saved by 4 real ranks, packed, compressed, chunked differently."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import look_workers as w
import numpy as np
import pytest
import torch
from helpers import packed_in, unpacked
from multiproc import run_world

import pytreeckpt
from pytreeckpt import ChunkingOptions, Compression
from pytreeckpt._cli import main
from pytreeckpt.loading import _chunks

KiB = 1024


def cli(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """The command line run in this process: its exit status, stdout and stderr."""
    status = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return status, out, err


def cli_json(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, Any]:
    status, out, _ = cli(capsys, *args, "--json")
    return status, json.loads(out)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints saved by 4 real ranks (gloo), in 1 KiB chunks, differing only in ``grid`` (doubled)."""
    d = tmp_path_factory.mktemp("four_ranks")
    run_world(4, w.save_two, str(d / "a"), str(d / "b"))
    return d / "a", d / "b"


# ---------------------------------------------------------------------------------------------------- diff


def test_diff_of_checkpoints_saved_at_4_ranks_names_the_one_leaf_that_differs(
    four_ranks: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = four_ranks
    report = pytreeckpt.diff(a, b)
    assert not report.equal
    assert [d.key for d in report.differences] == ["grid"]
    grid = w.tensors()["grid"].numpy().astype(np.float64)
    got = report["grid"]
    assert got.status == "values"
    assert got.differing == got.elements == grid.size == np.count_nonzero(grid)
    assert got.max_abs == pytest.approx(np.abs(grid).max())  # 2g - g
    assert got.max_rel == pytest.approx(0.5)  # |2g - g| / |2g|
    assert got.nonfinite == 0
    assert {d.key: d.status for d in report.leaves} == {
        "grid": "values",
        "rep": "equal",
        "flat": "equal",
        "small": "equal",
        "step": "equal",
    }
    status, out, _ = cli(capsys, "diff", a, b)
    assert status == 1
    assert out.splitlines()[1].split()[:2] == ["grid", "differ"]
    assert "rep" not in out  # (equal leaves are listed with --all)
    assert "5 leaves: 4 equal, 1 differ" in out
    status, doc = cli_json(capsys, "diff", a, b)
    assert status == 1
    assert doc["equal"] is False
    assert doc["counts"]["values"] == 1
    assert doc["counts"]["equal"] == 4
    assert [leaf["key"] for leaf in doc["leaves"] if leaf["status"] != "equal"] == ["grid"]
    status, out, _ = cli(capsys, "diff", a, a, "--all")
    assert status == 0
    assert "5 leaves: 5 equal" in out
    assert "rep" in out


def test_diff_of_a_4_rank_checkpoint_and_a_single_process_save_chunked_otherwise_is_equal(
    four_ranks: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = four_ranks
    one = tmp_path / "one"
    pytreeckpt.save(one, w.sharded_state(None, 4, 1.0))  # (default chunks: each leaf one chunk, small ones packed)
    for k in ("grid", "rep", "flat"):
        assert pytreeckpt.metadata(a).arrays[k].chunk_shape != pytreeckpt.metadata(one).arrays[k].chunk_shape, k
    report = pytreeckpt.diff(one, a)
    assert report.equal, report.differences
    assert report.chunks == 16 + 2 + 10 + 1  # a's grids, the finer: read box by box from both
    assert cli(capsys, "diff", one, a)[0] == 0


def test_diff_names_shapes_dtypes_kinds_values_and_leaves_only_in_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = {
        "same": torch.arange(10.0),
        "shape": torch.zeros(3, 4),
        "dtype": torch.zeros(4),
        "kind": torch.zeros(2),
        "only_a": torch.ones(2),
        "int": 1,
        "float": 1.0,
        "flag": True,
        "name": "adam",
        "nan": float("nan"),
        "none": None,
    }
    b = {
        "same": torch.arange(10.0),
        "shape": torch.zeros(4, 3),
        "dtype": torch.zeros(4, dtype=torch.float64),
        "kind": 2,
        "only_b": 3,
        "int": 1.0,
        "float": 1,
        "flag": 1,
        "name": "adamw",
        "nan": float("nan"),
        "none": None,
    }
    pytreeckpt.save(tmp_path / "a", a)
    pytreeckpt.save(tmp_path / "b", b)
    report = pytreeckpt.diff(tmp_path / "a", tmp_path / "b")
    got = {d.key: d.status for d in report.leaves}
    assert got == {
        "same": "equal",
        "shape": "shape",
        "dtype": "dtype",
        "kind": "kind",
        "only_a": "only_a",
        "int": "values",  # 1 and 1.0 differ as stored (types)
        "float": "values",
        "flag": "values",  # True and 1
        "name": "values",
        "nan": "equal",  # a NaN value equals itself as stored
        "none": "equal",
        "only_b": "only_b",
    }
    assert (report["shape"].a, report["shape"].b) == ("float32 (3, 4)", "float32 (4, 3)")
    assert (report["dtype"].a, report["dtype"].b) == ("float32 (4,)", "float64 (4,)")
    assert (report["kind"].a, report["kind"].b) == ("float32 (2,)", "2")
    assert (report["only_b"].a, report["only_b"].b) == (None, "3")
    assert (report["name"].a, report["name"].b) == ("'adam'", "'adamw'")
    assert report.chunks == 1  # only "same" is read: the others differ by their metadata
    status, out, _ = cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert status == 1
    assert "only in A" in out
    assert "only in B" in out
    assert cli(capsys, "diff", tmp_path / "a", tmp_path / "a")[0] == 0


def test_diff_compares_elements_bit_for_bit_and_measures_finite_differences(tmp_path: Path) -> None:
    x = torch.tensor([1.0, 0.0, float("nan"), float("inf"), 2.0, -4.0, 5.0])
    y = torch.tensor([1.0, -0.0, float("nan"), 1.0, float("nan"), -4.5, 5.0])
    ints = torch.tensor([0, 10, -(2**40)], dtype=torch.int64)
    bf = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    z = torch.tensor([1 + 1j, 2 - 2j], dtype=torch.complex64)
    pytreeckpt.save(tmp_path / "a", {"x": x, "ints": ints, "bf": bf, "z": z, "flag": torch.tensor([True, False])})
    pytreeckpt.save(
        tmp_path / "b",
        {
            "x": y,
            "ints": torch.tensor([0, 7, -(2**40)]),
            "bf": torch.tensor([1.0, 2.0, 3.5], dtype=torch.bfloat16),
            "z": torch.tensor([1 + 1j, 2 + 1j], dtype=torch.complex64),
            "flag": torch.tensor([True, True]),
        },
    )
    r = pytreeckpt.diff(tmp_path / "a", tmp_path / "b")
    assert (r["x"].differing, r["x"].nonfinite) == (4, 2)  # -0.0, inf vs 1, 2 vs nan, -4 vs -4.5; nan == nan
    assert r["x"].max_abs == 0.5
    assert r["x"].max_rel == pytest.approx(0.5 / 4.5)
    assert (r["ints"].differing, r["ints"].max_abs, r["ints"].max_rel) == (1, 3.0, 0.3)
    assert (r["bf"].differing, r["bf"].max_abs) == (1, 0.5)
    assert (r["z"].differing, r["z"].max_abs) == (1, 3.0)  # |(2-2j) - (2+1j)|
    assert (r["flag"].differing, r["flag"].max_abs, r["flag"].max_rel) == (1, 1.0, 1.0)


@pytest.mark.parametrize("pack", ["zip", "ocdbt"])
def test_diff_reads_packed_compressed_and_chunk_file_leaves_alike(tmp_path: Path, pack: str) -> None:
    g = torch.Generator().manual_seed(1)
    state = {"small": torch.randn(5, 7, generator=g), "bf": torch.randn(9, generator=g).bfloat16(), "step": 3}
    pytreeckpt.save(packed_in(tmp_path / "packed", pack), state)
    pytreeckpt.save(unpacked(tmp_path / "files"), state)
    pytreeckpt.save(tmp_path / "zstd", state, compression=Compression("zstd"))
    assert pytreeckpt.metadata(tmp_path / "packed").arrays["small"].database is not None
    assert pytreeckpt.metadata(tmp_path / "files").arrays["small"].database is None
    for other in ("files", "zstd"):
        assert pytreeckpt.diff(tmp_path / "packed", tmp_path / other).equal
    changed = {**state, "bf": state["bf"].clone()}
    changed["bf"][4] = float("nan")
    pytreeckpt.save(packed_in(tmp_path / "changed", pack), changed)
    r = pytreeckpt.diff(tmp_path / "packed", tmp_path / "changed")
    assert [(d.key, d.differing, d.nonfinite) for d in r.differences] == [("bf", 1, 1)]


def test_diff_holds_one_batch_of_chunks_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read asks for at most one batch: with a batch of 0 bytes, one chunk a side (counted at the reads)."""
    chunking = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=64 * KiB)
    big = torch.arange(256 * 1024, dtype=torch.float32).reshape(512, 512)  # 1 MiB: 16 chunks of 64 KiB
    pytreeckpt.save(unpacked(tmp_path / "a"), {"big": big, "small": torch.ones(3)}, chunking=chunking)
    pytreeckpt.save(unpacked(tmp_path / "b"), {"big": big + 1, "small": torch.ones(3)}, chunking=chunking)
    chunk = math.prod(pytreeckpt.metadata(tmp_path / "a").arrays["big"].chunk_shape) * 4
    assert chunk == 64 * KiB
    asked: list[int] = []
    real = _chunks.read_arrays

    def counted(storage: Any, metas: Any, plans: Any, dest: Any, rank: Any) -> int:
        asked.append(sum(op.region.size * p.itemsize for p in plans for op in p.reads))
        return real(storage, metas, plans, dest, rank)

    monkeypatch.setattr(_chunks, "read_arrays", counted)
    monkeypatch.setattr(_chunks, "BATCH_BYTES", 0)
    r = pytreeckpt.diff(tmp_path / "a", tmp_path / "b")
    assert r["big"].differing == big.numel()
    assert r["big"].max_abs == 1.0
    assert len(asked) == 2 * (16 + 1)  # each chunk read once from each side
    assert max(asked) == chunk
    assert r.peak_bytes == 2 * chunk
    assert r.chunks == 17
    asked.clear()
    monkeypatch.setattr(_chunks, "BATCH_BYTES", 4 * chunk)  # batches of 4 chunks: 4 calls a side for "big"
    r = pytreeckpt.diff(tmp_path / "a", tmp_path / "b")
    assert max(asked) == 4 * chunk
    assert r.peak_bytes == 8 * chunk
    assert sum(asked) == 2 * (big.numel() * 4 + 12)


def test_diff_of_a_damaged_chunk_or_a_missing_checkpoint_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytreeckpt.save(unpacked(tmp_path / "a"), {"w": torch.ones(64)})
    pytreeckpt.save(unpacked(tmp_path / "b"), {"w": torch.ones(64)})
    chunk = next(p for p in (tmp_path / "b" / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")
    raw = chunk.read_bytes()
    chunk.write_bytes(bytes([raw[0] ^ 0x80]) + raw[1:])
    status, _, err = cli(capsys, "diff", tmp_path / "a", tmp_path / "b")
    assert status == 2
    assert "'w'" in err
    with pytest.raises(pytreeckpt.CheckpointError, match="'w'"):
        pytreeckpt.diff(tmp_path / "a", tmp_path / "b")
    status, _, err = cli(capsys, "diff", tmp_path / "a", tmp_path / "nothing")
    assert status == 2
    assert "nothing" in err
    with pytest.raises(TypeError, match="diff: executor must be an ExecutorOptions"):
        pytreeckpt.diff(tmp_path / "a", tmp_path / "a", executor=4)  # type: ignore[arg-type]


def test_diff_matches_leaves_by_name_in_any_order_and_refuses_truncated_and_foreign_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same names in another order are the same leaves; a truncated chunk file, or a FIFO in its place, is an
    error naming the leaf, never a hang or a wrong answer."""
    import os

    x, y = torch.arange(64.0), torch.full((3, 4), 2.0)
    pytreeckpt.save(unpacked(tmp_path / "a"), {"x": x, "y": y, "n": {"s": "é", "k": 3}})
    pytreeckpt.save(unpacked(tmp_path / "b"), {"n": {"k": 3, "s": "é"}, "y": y, "x": x})
    status, out = cli_json(capsys, "diff", tmp_path / "a", tmp_path / "b", "--json")
    assert status == 0, out
    assert pytreeckpt.diff(tmp_path / "b", tmp_path / "a").equal
    pytreeckpt.save(unpacked(tmp_path / "c"), {"x": x, "y": y, "n": {"s": "é", "k": 3}})
    chunk = next(p for p in (tmp_path / "c" / "arrays" / "x").rglob("*") if p.is_file() and p.name != "zarr.json")
    chunk.write_bytes(chunk.read_bytes()[:-3])
    status, _, err = cli(capsys, "diff", tmp_path / "a", tmp_path / "c")
    assert status == 2
    assert "'x'" in err
    chunk.unlink()
    os.mkfifo(chunk)
    status, _, err = cli(capsys, "diff", tmp_path / "a", tmp_path / "c")
    assert status == 2
    assert "'x'" in err


# --------------------------------------------------------------------------------------------- inspect --stats


def test_inspect_stats_reads_every_chunk_and_flags_nan_and_inf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chunking = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=KiB)
    g = torch.Generator().manual_seed(2)
    w_ = torch.randn(40, 30, generator=g)
    bad = torch.randn(50, generator=g)
    bad[[3, 17]] = float("nan")
    bad[40] = -float("inf")
    state = {
        "w": w_,
        "bad": bad,
        "bf": torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16),
        "ints": torch.tensor([3, -7, 10]),
        "empty": torch.zeros(0, 4),
        "step": 2,
    }
    pytreeckpt.save(tmp_path / "c", state, chunking=chunking)
    assert len(list(_chunks.chunk_boxes(pytreeckpt.metadata(tmp_path / "c").arrays["w"]))) > 1
    status, doc = cli_json(capsys, "inspect", tmp_path / "c", "--stats")
    assert status == 0
    stats = {s["key"]: s for s in doc["arrays"]}
    assert list(stats) == ["w", "bad", "bf", "ints", "empty"]  # arrays only, in the document's order
    x = w_.double().numpy()
    assert stats["w"]["min"] == pytest.approx(x.min())
    assert stats["w"]["max"] == pytest.approx(x.max())
    assert stats["w"]["mean"] == pytest.approx(x.mean())
    assert stats["w"]["norm"] == pytest.approx(np.linalg.norm(x))
    assert (stats["w"]["nan"], stats["w"]["inf"]) == (0, 0)
    finite = bad.double().numpy()[np.isfinite(bad.numpy())]
    assert (stats["bad"]["nan"], stats["bad"]["inf"]) == (2, 1)
    assert stats["bad"]["mean"] == pytest.approx(finite.mean())
    assert stats["bad"]["norm"] == pytest.approx(np.linalg.norm(finite))
    assert (stats["bf"]["min"], stats["bf"]["max"], stats["bf"]["mean"]) == (-2.0, 3.0, pytest.approx(2.5 / 3))
    assert (stats["ints"]["min"], stats["ints"]["max"], stats["ints"]["norm"]) == (-7.0, 10.0, pytest.approx(158**0.5))
    assert stats["empty"]["min"] is None
    assert stats["empty"]["norm"] is None
    assert doc["nonfinite"] == ["bad"]
    status, out, _ = cli(capsys, "inspect", tmp_path / "c", "--stats")
    assert status == 0
    flagged = [line.split()[1] for line in out.splitlines()[1:] if line.startswith("!  ")]
    assert flagged == ["bad"]
    assert "! 1 of 5 arrays hold NaN or infinite values: bad" in out
    assert cli(capsys, "inspect", tmp_path / "c", "--stats", "--fail-on-nonfinite")[0] == 1
    pytreeckpt.save(tmp_path / "fine", {"w": w_})
    status, out, _ = cli(capsys, "inspect", tmp_path / "fine", "--stats", "--fail-on-nonfinite")
    assert status == 0
    assert "every value finite" in out


def test_inspect_stats_reads_one_batch_of_chunks_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    chunking = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=16 * KiB)
    big = torch.linspace(-1, 1, 64 * 1024).reshape(256, 256)  # 256 KiB: 16 chunks of 16 KiB
    pytreeckpt.save(unpacked(tmp_path / "c"), {"big": big}, chunking=chunking)
    asked: list[int] = []
    real = _chunks.read_arrays

    def counted(storage: Any, metas: Any, plans: Any, dest: Any, rank: Any) -> int:
        asked.append(sum(op.region.size * p.itemsize for p in plans for op in p.reads))
        return real(storage, metas, plans, dest, rank)

    monkeypatch.setattr(_chunks, "read_arrays", counted)
    monkeypatch.setattr(_chunks, "BATCH_BYTES", 0)
    status, doc = cli_json(capsys, "inspect", tmp_path / "c", "--stats")
    assert status == 0
    assert asked == [16 * KiB] * 16
    assert (doc["arrays"][0]["min"], doc["arrays"][0]["max"]) == (-1.0, 1.0)
    assert doc["arrays"][0]["norm"] == pytest.approx(float(big.double().norm()))


def test_inspect_stats_of_a_4_rank_checkpoint_are_the_global_tensors(
    four_ranks: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = four_ranks
    for path, scale in ((a, 1.0), (b, 2.0)):
        status, doc = cli_json(capsys, "inspect", path, "--stats")
        assert status == 0
        stats = {s["key"]: s for s in doc["arrays"]}
        for key, t in w.tensors().items():
            x = (t.double() * (scale if key == "grid" else 1.0)).numpy()
            assert stats[key]["min"] == pytest.approx(x.min()), key
            assert stats[key]["max"] == pytest.approx(x.max()), key
            assert stats[key]["norm"] == pytest.approx(np.linalg.norm(x)), key


def test_inspect_refuses_stats_with_layout_and_fail_on_nonfinite_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})
    status, _, err = cli(capsys, "inspect", tmp_path / "c", "--stats", "--layout", "w")
    assert status == 2
    assert "--stats and --layout" in err
    status, _, err = cli(capsys, "inspect", tmp_path / "c", "--fail-on-nonfinite")
    assert status == 2
    assert "--fail-on-nonfinite goes with --stats" in err


# -------------------------------------------------------------------------------------------- inspect --layout


def test_inspect_layout_draws_each_chunk_with_the_ranks_that_held_it(
    four_ranks: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = four_ranks
    status, doc = cli_json(capsys, "inspect", a, "--layout", "grid")  # rows and columns split on a 2 x 2 mesh
    assert status == 0
    assert doc["chunk_shape"] == [8, 24]
    cells = {tuple(c["cell"]): c["ranks"] for c in doc["cells"]}
    assert cells == {(r, c): [2 * (r >= 4) + c] for r in range(8) for c in range(2)}
    status, out, _ = cli(capsys, "inspect", a, "--layout", "grid")
    assert status == 0
    rows = [line for line in out.splitlines() if "|" in line]
    assert [[c.strip() for c in row.split("|")[1:-1]] for row in rows] == [["0", "1"]] * 4 + [["2", "3"]] * 4
    assert [row.split("|")[0].strip() for row in rows] == [str(8 * r) for r in range(8)]  # each row's offset
    assert "mesh(2, 2) [S(0),S(1)] over 4 ranks" in out
    # replicated along the mesh's first axis: each chunk held by two ranks (one of them wrote it)
    status, doc = cli_json(capsys, "inspect", a, "--layout", "rep")
    assert {tuple(c["cell"]): c["ranks"] for c in doc["cells"]} == {(0, 0): [0, 2], (1, 0): [1, 3]}
    status, out, _ = cli(capsys, "inspect", a, "--layout", "rep")
    assert [line.split("|")[1].strip() for line in out.splitlines() if "|" in line] == ["0,2", "1,3"]
    assert "replicated (one of them wrote it)" in out
    # 1-D, uneven flat ranges of 10, 20, 30 and 40 elements, 10-element chunks: a bar
    status, out, _ = cli(capsys, "inspect", a, "--layout", "flat")
    bar = [line for line in out.splitlines() if "|" in line]
    assert len(bar) == 1
    assert [c.strip() for c in bar[0].split("|")[1:-1]] == ["0", "1", "1", "2", "2", "2", "3", "3", "3", "3"]
    # packed: its database names the rank that wrote it
    status, out, _ = cli(capsys, "inspect", a, "--layout", "small")
    assert "packed in packed/0: written whole by rank 0" in out
    assert [line.split("|")[1].strip() for line in out.splitlines() if "|" in line] == ["0"]


def test_inspect_layout_of_more_dims_a_straddling_chunk_a_per_rank_leaf_and_a_missing_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chunking = ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=64)
    t = torch.zeros(4, 4, 6)
    spec = pytreeckpt.ExplicitRegions([[((0, 0, 0), (3, 4, 6))], [((3, 0, 0), (1, 4, 6))]])
    state = {"t": pytreeckpt.ShardedLeaf.from_global(t, spec), "rng": torch.ones(2)}
    pytreeckpt.save(unpacked(tmp_path / "c"), state, chunking=chunking, spec={"rng": pytreeckpt.PER_RANK})
    meta = pytreeckpt.metadata(tmp_path / "c").arrays["t"]
    status, out, _ = cli(capsys, "inspect", tmp_path / "c", "--layout", "t")
    assert status == 0
    assert "dims 2.. not drawn" in out
    status, doc = cli_json(capsys, "inspect", tmp_path / "c", "--layout", "t")
    rows = 4 // meta.chunk_shape[0] + (4 % meta.chunk_shape[0] > 0)
    want = {}
    for r in range(rows):
        lo, hi = r * meta.chunk_shape[0], min(4, (r + 1) * meta.chunk_shape[0])
        want[r] = sorted({0 if i < 3 else 1 for i in range(lo, hi)})
    assert {c["cell"][0]: c["ranks"] for c in doc["cells"]} == want
    status, out, _ = cli(capsys, "inspect", tmp_path / "c", "--layout", "rng.rank0")
    assert status == 0
    assert "saved per rank: rank 0 of 1" in out
    status, _, err = cli(capsys, "inspect", tmp_path / "c", "--layout", "nope")
    assert status == 2
    assert "'nope'" in err
