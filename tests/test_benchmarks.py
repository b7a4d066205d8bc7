"""The benchmarks run end to end on tiny states, so they cannot rot between the runs that measure."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from helpers import HANG

from benchmarks import small
from benchmarks._common import can_drop_caches


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP's, single process
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_per_leaf_benchmark_times_every_tool_and_checks_its_targets(tmp_path: Path) -> None:
    runs = [small.run(count, 1, tmp_path, cold=False) for count in (20, 200)]
    for r in runs:
        assert set(r["seconds"]) >= {"torch.save", "safetensors.save", "dcp.save", "pytreeckpt.save"}
        assert all(t > 0 for t in r["seconds"].values())
        assert set(r["save_phases"]) == {"plan", "write", "commit"}
        assert len(small.targets(r, cold=False)) == 6  # (issue 18's four, issue 44's stall against two)
        assert r["seconds"]["pytreeckpt.async_save stall"] > 0
        assert len(r["stall_ratios"]["torch.save"]) == 1
    rows = small.scale_targets(runs[0], runs[1], cold=False)
    assert [row[0] for row in rows][:2] == [
        "save time at 10x the leaves / at 1x",
        "load time at 10x the leaves / at 1x",
    ]
    # the growth from both counts saved and loaded in the same rounds
    runs[1]["paired"] = pair = small.paired(20, 200, 3, tmp_path, cold=False)
    assert set(pair["seconds"]) == {"small save", "big save", "small load", "big load"}
    assert all(len(t) == 3 for t in pair["rounds"].values())
    each = pair["rounds"]
    assert pair["ratios"]["save"] == [b / a for a, b in zip(each["small save"], each["big save"], strict=True)]
    assert pair["ratios"]["load"] == [b / a for a, b in zip(each["small load"], each["big load"], strict=True)]
    rows = small.scale_targets(runs[0], runs[1], cold=False)
    assert rows[0][0] == "save time at 10x the leaves / at 1x, median of the rounds' ratios"
    assert rows[0][1] == sorted(pair["ratios"]["save"])[1]
    assert rows[1][1] == sorted(pair["ratios"]["load"])[1]
    mixed = small.run_mixed(0.001, 1, tmp_path, cold=False)
    assert mixed["leaves"] > 1000
    assert mixed["seconds"]["pytreeckpt.save"] > 0


def test_the_revisions_benchmark_runs_each_version_from_its_own_tree(tmp_path: Path) -> None:
    """Against HEAD (a worktree of this repository's last commit): both runs, from their trees, then removed."""
    from benchmarks import revisions

    if not (revisions.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    worktrees = _worktrees()
    r = revisions.run("HEAD", 1, 0.001, tmp_path, cold=False)
    assert set(r["seconds"]) == {"before save", "before load", "now save", "now load"}
    assert r["ratio"]["save"] == r["rounds"]["now"][0]["save"] / r["rounds"]["before"][0]["save"]
    assert not r["cold"]
    rows = revisions.targets(r)
    assert [row[2:] for row in rows] == [("<=", 1.0), ("<=", 1.0)]
    assert "(before issue 18)" in rows[0][0]
    assert _worktrees() == worktrees  # (the earlier revision's checkout is gone)
    with pytest.raises(RuntimeError, match="cannot check out no-such-revision"):
        revisions.run("no-such-revision", 1, 0.001, tmp_path, cold=False)


def _worktrees() -> str:
    import subprocess

    from benchmarks import revisions

    return subprocess.run(
        ["git", "-C", str(revisions.ROOT), "worktree", "list"], capture_output=True, text=True, check=True
    ).stdout


def test_the_scale_benchmark_plans_through_the_public_entry_points() -> None:
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "benchmarks" / "plan_scale.py"), "--model", "8b", "--ranks", "64"]
    cmd += ["--layout", "tp_pp_dp", "fsdp_tp", "--json", "--no-save"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["layout"] for r in rows] == ["tp_pp_dp", "fsdp_tp"]
    for r in rows:
        for key in ("save_rank_plan_ms", "load_rank_plan_ms", "eval8_rank_plan_ms", "cached_plan_ms", "coordinator_s"):
            assert r[key] > 0, (key, r)
        assert 0 < r["metadata_mb"] < 64
        # The layout agreement sends a digest, not the pieces: bytes, not megabytes.
        assert r["exchange_recv_mb_per_rank"] < 0.001
        assert r["rank_writes"] > 0
        assert r["reshard_load"]["rank_reads"] > 0
        # The same state as DTensors on a fake process group of 64 ranks: the same plans, timed.
        assert r["dtensor_save_rank_plan_ms"] > 0
        assert r["dtensor_load_rank_plan_ms"] > 0
        assert r["dtensor_plans_match"] is True


def test_the_training_loop_benchmark_times_every_save_behind_the_loop(tmp_path: Path) -> None:
    import json
    import subprocess

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "benchmarks.train_loop", "--gib", "0.02", "--repeat", "1", "--base-steps", "3"]
    cmd += ["--workdir", str(tmp_path), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG, cwd=root)
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(r["variants"]) == {
        "memcpy into warm memory",
        "pytreeckpt.async_save",
        "pytreeckpt.async_save nice 0",
        "pytreeckpt.async_save nice 19",
        "dcp.async_save thread",
        "dcp.async_save process",
    }
    assert r["base_step_ms"]["mean"] > 0
    for name, v in r["variants"].items():
        if name == "memcpy into warm memory":
            assert 0 < v["stall_s"] == v["write_s"]
            continue
        assert 0 < v["stall_s"] < v["write_s"]
        assert v["slowdown"] > 0
    from benchmarks import train_loop

    assert len(train_loop.targets(r)) == 4
    # Every save landed whole: the checkpoints load (pytreeckpt's) and were written durably.
    import pytreeckpt

    loaded = pytreeckpt.load(tmp_path / "pytreeckpt.async_save")
    assert int(loaded["data.position"]) > 0


@pytest.mark.skipif(
    shutil.which("fio") is None or not can_drop_caches(), reason="needs fio and root (drops the page cache)"
)
def test_the_disk_benchmark_sets_saves_and_cold_loads_against_the_limits_at_one_and_at_several_ranks(
    tmp_path: Path,
) -> None:
    from benchmarks import cold

    for r in (cold.run(0.01, 2, 1, 2, tmp_path), cold.run_ranks(2, 0.01, 2, 1, 2, tmp_path)):
        assert set(r["of_limit"]) >= {"fio 2 jobs", cold.BASELINE, "pytreeckpt.load", "pytreeckpt.load inplace"}
        assert set(r["of_limit"]) >= {cold.DIRECT, cold.NEW_MEMORY, cold.DIRECT_SMALL}
        assert r["limit_by"] not in (cold.NEW_MEMORY, cold.BASELINE)
        assert set(r["save_of_limit"]) >= {"fio 2 jobs write direct", cold.WRITE_SMALL, cold.WRITE_BASELINE}
        assert "pytreeckpt.save" in r["save_of_limit"]
        assert not set(r["of_limit"]) & set(r["save_of_limit"])
        assert r["write_limit_by"] in set(r["save_of_limit"]) - {cold.WRITE_BASELINE, "pytreeckpt.save"}
        assert all(len(v) == 1 and v[0] > 0 for v in r["all_seconds"].values())
        assert r["save_of_limit"][r["write_limit_by"]] == 1.0
        assert all(s > 0 for s in r["seconds"].values())
        assert 0.009 * 2**30 < r["bytes"] <= 0.01 * 2**30
        # Beside the in-place load, the raw reads into its own tensors: never a limit.
        into = {w for w in r["of_limit"] if w.endswith(cold.TENSORS)}
        assert len(into) == 2
        assert r["tensors_by"] in into
        assert r["limit_by"] not in into
        assert r["inplace_of_tensors"] == r["tensors_seconds"] / r["seconds"]["pytreeckpt.load inplace"]
    # At several ranks, each rank's own share is also a way to drive the disk, in the limit's race.
    direct, small, write = cold.share_names(2)
    assert {direct, small} <= set(r["of_limit"])
    assert write in r["save_of_limit"]


def test_the_replica_check_benchmark_compares_three_saves(tmp_path: Path) -> None:
    from benchmarks import replicas

    r = replicas.run(1 / 1024, 2, 2, tmp_path / "replicas")
    assert set(r["seconds"]) == {"plain", "plain default", "dtensor"}
    assert len(r["round_ratios"]) == len(r["default_round_ratios"]) == 2
    assert r["ratio"] > 0
    assert r["default_ratio"] > 0


def test_the_torchtitan_benchmark_times_both_backends(tmp_path: Path) -> None:
    pytest.importorskip("triton", reason="torchtitan's llama3 model imports triton (in the test extras)")
    from benchmarks import torchtitan

    r = torchtitan.run(2, 1, 2, 2, tmp_path / "torchtitan")
    assert set(r["seconds"]) == {"pytreeckpt", "dcp"}
    for m in torchtitan.MEASURES:
        assert len(r["round_ratios"][m]) == 2
        assert r["ratio"][m] > 0


def test_the_peer_tier_benchmark_times_recovery_and_the_loop(tmp_path: Path) -> None:
    from benchmarks import peers

    r = peers.run(1 / 1024, 2, 1, 1, tmp_path / "peers", compute=64)  # (2 nodes of 1 rank: fewer processes)
    assert set(r["recovery_seconds"]) == {"peers", "durable"}
    assert set(r["loop_seconds"]) == {"peers=1", "peers=0"}
    assert r["durable_over_peers"] > 0
    assert r["save_compute_wait_ratio"] > 0


def test_the_packed_leaves_benchmark_times_both_counts_in_the_same_rounds(tmp_path: Path) -> None:
    from benchmarks import packed

    r = packed.run((10, 100), 12, 4, 2, tmp_path, cold=False)
    assert r["packed"]
    assert r["chunks_per_leaf"] == 3
    assert set(r["seconds"]) == {"small save", "big save", "small load", "big load"}
    assert all(len(t) == 2 for t in r["rounds"].values())
    each = r["rounds"]
    assert r["ratios"]["load"] == [b / a for a, b in zip(each["small load"], each["big load"], strict=True)]
    rows = packed.targets(r)
    assert [row[3] for row in rows] == [11.0, 11.0]
    assert len(packed.table(r)) == 7


def test_the_read_limit_is_the_fastest_way_and_never_slower_than_one_thread() -> None:
    """Issue 44: fio's 4 jobs timed from outside were slower than one thread's read() of the same files, and
    were still called the limit. The limit is fio's fastest way; one slower than the baseline is refused."""
    from benchmarks import cold

    seconds = {"fio 4 jobs": 1.5, "fio 4 jobs large files": 0.7, cold.BASELINE: 1.1, "pytreeckpt.load": 0.2}
    ways = ["fio 4 jobs", "fio 4 jobs large files", cold.BASELINE]
    assert cold.sound_limit(seconds, ways) == ("fio 4 jobs large files", 0.7)
    with pytest.raises(RuntimeError, match=r"no sound read limit: the fastest way, 'fio 4 jobs', took 1.500 s"):
        cold.sound_limit(seconds, ["fio 4 jobs", cold.BASELINE])
    with pytest.raises(RuntimeError, match="needs fio's ways and the single-threaded baseline"):
        cold.sound_limit({"fio 4 jobs": 0.5}, ["fio 4 jobs"])
    writes = {"fio 4 jobs write": 0.9, cold.WRITE_BASELINE: 0.8}
    with pytest.raises(RuntimeError, match=r"no sound write limit: the fastest way, 'fio 4 jobs write', took 0.900 s"):
        cold.sound_limit(writes, list(writes), cold.WRITE_BASELINE, "write")
    # 16 threads' direct reads are a way to drive the disk; the same into new memory shows that memory's cost
    seconds = {**seconds, cold.DIRECT: 0.6, cold.NEW_MEMORY: 0.5}
    ways = [*ways, cold.DIRECT, cold.NEW_MEMORY]
    assert cold.sound_limit(seconds, cold.limit_ways(ways)) == (cold.DIRECT, 0.6)
    seconds, ways = {**seconds, cold.DIRECT_SMALL: 0.55}, [*ways, cold.DIRECT_SMALL]
    assert cold.sound_limit(seconds, cold.limit_ways(ways)) == (cold.DIRECT_SMALL, 0.55)


def test_the_small_direct_ways_move_every_byte(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 256 KiB direct ways a disk limit may be set by write each file whole (rounded down to 4 KiB, as fio's)
    and read each file's whole blocks: a way that skipped bytes would set a limit too fast."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    from benchmarks import cold

    sizes = [(1 << 20) + 5, 3 << 18, 4096 * 3]
    monkeypatch.setattr(cold.shutil, "rmtree", lambda *a, **k: None)  # (keep what it wrote, to look at)
    try:
        assert cold._write_small(tmp_path / "w", sizes) > 0
    except OSError as e:  # (tmpfs and some others take no O_DIRECT)
        pytest.skip(f"no direct writes here: {e}")
    written = sorted((p.name, p.stat().st_size) for p in (tmp_path / "w").iterdir())
    assert written == sorted((f"f{i}", n // 4096 * 4096) for i, n in enumerate(sizes))
    files = []
    for i, n in enumerate(sizes):
        files.append(tmp_path / f"r{i}")
        files[-1].write_bytes(bytes([i + 1]) * n)
    buffer = cold._private(1 << 20)
    reads: list[int] = []
    real = os.preadv
    monkeypatch.setattr(cold.os, "preadv", lambda fd, bufs, at: reads.append(at) or real(fd, bufs, at))
    cold._read_direct(files, buffer, 256 << 10)
    assert reads == [0, 256 << 10, 512 << 10, 768 << 10, 0, 256 << 10, 512 << 10, 0]


def test_the_reads_into_the_loads_tensors_land_every_files_blocks_in_the_tensors_memory(tmp_path: Path) -> None:
    """The reference reads beside the in-place load (not limits) put each file's whole 4 KiB blocks into the
    tensors' own memory, one file after another, the first tensor again where the files hold more: a way that
    skipped bytes, or read them elsewhere, would show that memory cheaper than it is."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("no O_DIRECT on this platform")
    import torch

    from benchmarks import cold

    sizes = [(1 << 20) + 4, 3 << 18, 4096 * 3 + 100]
    files = []
    for i, n in enumerate(sizes):
        files.append(tmp_path / f"r{i}")
        files[-1].write_bytes(bytes((i + k) % 256 for k in range(256)) * (n // 256) + bytes(n % 256))
    stream = b"".join(f.read_bytes()[: f.stat().st_size // 4096 * 4096] for f in files)
    whole = len(stream)
    rest = (whole - (1 << 20)) // 6  # (bfloat16 elements, in threes)
    tensors = [torch.zeros(1 << 18), torch.zeros(0), torch.zeros(rest, 1, 3, dtype=torch.bfloat16)]
    assert sum(t.numel() * t.element_size() for t in tensors) == whole
    for name in (cold.INTO_TENSORS, cold.INTO_TENSORS_DIRECT):
        for t in tensors:
            t.zero_()
        try:
            cold.tensor_ways(files, tensors, threads=2)[name]()
        except OSError as e:  # (tmpfs and some others take no O_DIRECT)
            pytest.skip(f"no direct reads here: {e}")
        assert b"".join(t.view(torch.uint8).reshape(-1).numpy().tobytes() for t in tensors) == stream, name
    # Fewer tensor bytes than the files hold: the reads go round again from the first tensor's first byte.
    small = torch.zeros(1000, dtype=torch.float32)
    placed = cold._placed(files, [small])
    assert [sum(v.nbytes for v in views) for _, views in placed] == [1 << 20, 3 << 18, 4096 * 3]
    at = 0
    for _, views in placed:
        for v in views:
            assert v.ctypes.data == small.data_ptr() + at % 4000
            assert 0 < v.nbytes <= 4000 - at % 4000
            at += v.nbytes
    assert cold.limit_ways([cold.DIRECT, cold.INTO_TENSORS, "each of 2 ranks 8 threads into the load's tensors"]) == [
        cold.DIRECT
    ]


def test_the_diff_benchmark_measures_its_peak_memory_and_time_against_loading_both(tmp_path: Path) -> None:
    from benchmarks import diff

    r = diff.run(0.01, 2, 1, tmp_path)
    assert r["differences"] == [r["changed"]] == ["layer0.weight"]
    assert r["chunks"] == 2
    assert len(r["time_ratios"]) == len(r["memory_ratios"]) == 1
    assert r["diff_extra_rss"][0] > 0
    assert r["memory_ratios"] == [r["diff_extra_rss"][0] / r["largest_chunk_bytes"]]
    assert [row[0] for row in diff.targets(r)] == ["diff peak memory / largest chunk", "diff time / load of both"]
    assert len(diff.table(r)) == 11
