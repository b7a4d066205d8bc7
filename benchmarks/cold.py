"""Cold loads against the disk's parallel read limit (issue 19), in one run.

    python -m benchmarks.cold [--gib 1 4] [--leaves 16] [--repeat 3] [--jobs 4]

For each size: the state saved once, then, alternated and with the page cache dropped
before each, medians of ``--repeat``: ``fio`` reading the checkpoint's own chunk files
(``--jobs`` jobs, each a quarter of the files, 4 MiB blocks: the physical limit with the
same bytes, files and queue depth), a single-threaded raw read of the same files,
``pytreeckpt.load`` (functional) and ``pytreeckpt.load(..., inplace=True)``. Prints one
JSON object per size with the seconds and each load's rate as a fraction of fio's.
Needs root (to drop the page cache) and fio (Debian's package ``fio``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import pytreeckpt

from ._common import GiB, can_drop_caches, drop_caches, make_state


def _fio(root: Path, files: list[Path], jobs: int) -> None:
    """fio reading ``files`` (under ``root``) in ``jobs`` jobs, each a share of the files, one after another."""
    groups = [files[k::jobs] for k in range(jobs)]
    # Paths relative to the directory given: fio caps the length of an option's value.
    cmd = ["fio", "--output-format=json", f"--directory={root}", "--rw=read", "--bs=4M", "--ioengine=psync"]
    for k, group in enumerate(g for g in groups if g):
        names = ":".join(str(f.relative_to(root)).replace(":", "\\:") for f in group)
        cmd += [f"--name=j{k}", f"--filename={names}", "--file_service_type=sequential"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed: {done.stderr[-2000:]}")


def _raw(files: list[Path]) -> None:
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.read(1 << 24):
                pass


def run(gib: float, leaves: int, repeat: int, jobs: int, workdir: Path) -> dict[str, Any]:
    state = make_state(int(gib * GiB), leaves)
    path = workdir / f"cold_{gib:g}"
    pytreeckpt.save(path, state, overwrite=True)
    files = sorted(p for p in (path / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    del state
    variants = {
        f"fio {jobs} jobs": lambda: _fio(path / "arrays", files, jobs),
        "raw read (1 thread)": lambda: _raw(files),
        "pytreeckpt.load": lambda: pytreeckpt.load(path, target),
        "pytreeckpt.load inplace": lambda: pytreeckpt.load(path, target, inplace=True),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeat):
        for name, fn in variants.items():
            drop_caches()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    seconds = {k: statistics.median(v) for k, v in times.items()}
    limit = seconds[f"fio {jobs} jobs"]
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "all_seconds": times,
        "of_fio": {k: limit / s for k, s in seconds.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--jobs", type=int, default=4)
    args = p.parse_args()
    if shutil.which("fio") is None or not can_drop_caches():
        raise SystemExit("benchmarks.cold needs fio (apt-get install fio) and root, to drop the page cache")
    with tempfile.TemporaryDirectory(prefix="pytreeckpt-cold-") as d:
        for gib in args.gib:
            print(json.dumps({"gib": gib, **run(gib, args.leaves, args.repeat, args.jobs, Path(d))}), flush=True)


if __name__ == "__main__":
    main()
