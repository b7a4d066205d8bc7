"""Single-process save/load benchmark, every tool measured in the same run on the same state.

    python -m benchmarks [--size-mib 512] [--leaves 8] [--repeat 3] [--out benchmarks/results]

Compared: a bare memcpy (the stall's physical limit), a raw write+fsync and read of the
same bytes (the disk's limit), torch.save/torch.load, torch.distributed.checkpoint
(save, async_save, load), and pytreeckpt (save, async_save stall and total, load, and a
resharded load into a 4-rank layout). Results go to JSON and a Markdown table; times
are medians over ``--repeat`` runs. Reads are served from the page cache unless the
machine drops it; the raw read is measured the same way, so ratios stay fair.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import pytreeckpt
from pytreeckpt import Abstract, Mesh, Shard, ShardingSpec


def _median_time(fn: Callable[[], Any], repeat: int, setup: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _state(size_mib: int, leaves: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    per = size_mib * 2**20 // leaves
    out = {}
    for i in range(leaves):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        n = per // (4 if dtype == torch.float32 else 2)
        cols = 1024
        out[f"layer{i}.weight"] = torch.randn(n // cols, cols, generator=g).to(dtype)
    return out


def _raw_write(state: dict[str, torch.Tensor], d: Path) -> None:
    for k, v in state.items():
        with open(d / k, "wb") as f:
            f.write(memoryview(v.contiguous().view(torch.uint8).numpy()))
            f.flush()
            os.fsync(f.fileno())


def _raw_read(state: dict[str, torch.Tensor], d: Path) -> None:
    for k, v in state.items():
        buf = torch.empty(v.numel() * v.element_size(), dtype=torch.uint8)
        with open(d / k, "rb") as f:
            f.readinto(memoryview(buf.numpy()))


def run(size_mib: int, leaves: int, repeat: int, workdir: Path) -> dict[str, Any]:
    state = _state(size_mib, leaves)
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    results: dict[str, float] = {}

    def fresh(name: str) -> Path:
        p = workdir / name
        shutil.rmtree(p, ignore_errors=True)
        return p

    results["memcpy"] = _median_time(lambda: {k: v.clone() for k, v in state.items()}, repeat)
    raw = workdir / "raw"
    raw.mkdir(exist_ok=True)
    results["raw write+fsync"] = _median_time(lambda: _raw_write(state, raw), repeat)
    results["raw read"] = _median_time(lambda: _raw_read(state, raw), repeat)

    tpath = workdir / "torch.pt"

    def torch_save() -> None:
        torch.save(state, tpath)
        with open(tpath, "rb+") as f:
            os.fsync(f.fileno())

    results["torch.save"] = _median_time(torch_save, repeat)
    results["torch.load"] = _median_time(lambda: torch.load(tpath, weights_only=True), repeat)

    try:
        import torch.distributed.checkpoint as dcp

        dpath = workdir / "dcp"
        results["dcp.save"] = _median_time(lambda: dcp.save(state, checkpoint_id=dpath), repeat, lambda: fresh("dcp"))

        stalls = []

        def dcp_async_timed() -> None:
            t0 = time.perf_counter()
            fut = dcp.async_save(state, checkpoint_id=dpath)
            stalls.append(time.perf_counter() - t0)
            fut.result()

        results["dcp.async_save total"] = _median_time(dcp_async_timed, repeat, lambda: fresh("dcp"))
        results["dcp.async_save stall"] = statistics.median(stalls)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        results["dcp.load"] = _median_time(lambda: dcp.load(target, checkpoint_id=dpath), repeat)
    except Exception as e:  # report, keep the other figures
        print(f"torch.distributed.checkpoint skipped: {type(e).__name__}: {e}")

    ppath = workdir / "ptc"
    results["pytreeckpt.save"] = _median_time(
        lambda: pytreeckpt.save(ppath, state, overwrite=True), repeat, lambda: fresh("ptc")
    )
    stalls = []

    def ptc_async() -> None:
        t0 = time.perf_counter()
        h = pytreeckpt.async_save(ppath, state, overwrite=True)
        stalls.append(time.perf_counter() - t0)
        h.wait()

    results["pytreeckpt.async_save total"] = _median_time(ptc_async, repeat, lambda: fresh("ptc"))
    results["pytreeckpt.async_save stall"] = statistics.median(stalls)
    results["pytreeckpt.load"] = _median_time(lambda: pytreeckpt.load(ppath), repeat)
    spec = ShardingSpec(Mesh(4), [Shard(1)])
    target = {k: Abstract(v.shape, v.dtype, spec) for k, v in state.items()}
    results["pytreeckpt.load resharded (4 ranks, Shard(1))"] = _median_time(
        lambda: pytreeckpt.load(ppath, target), repeat
    )
    return {
        "bytes": nbytes,
        "leaves": leaves,
        "repeat": repeat,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "seconds": results,
    }


def _table(report: dict[str, Any]) -> str:
    s = report["seconds"]
    gib = report["bytes"] / 2**30
    lines = [
        f"State: {report['bytes'] / 2**20:.0f} MiB in {report['leaves']} leaves (float32/bfloat16); "
        f"median of {report['repeat']}; torch {report['torch']}; {report['machine']}.",
        "",
        "| operation | seconds | GiB/s | vs raw write or read | vs memcpy |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, sec in s.items():
        if name.startswith("_"):
            continue
        base = s["raw read"] if "load" in name or "read" in name else s["raw write+fsync"]
        lines.append(f"| {name} | {sec:.3f} | {gib / sec:.2f} | {sec / base:.2f}x | {sec / s['memcpy']:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description="pytreeckpt benchmarks")
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--leaves", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--workdir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="pytreeckpt-bench-"))
    try:
        report = run(args.size_mib, args.leaves, args.repeat, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "single_process.json").write_text(json.dumps(report, indent=2))
    table = _table(report)
    (args.out / "single_process.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
