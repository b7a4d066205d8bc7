"""Cold loads against the disk's parallel read limit (issue 19), in one run.

    python -m benchmarks.cold [--gib 1 4] [--leaves 16] [--repeat 3] [--jobs 4] [--ranks 4]

For each size: the state saved once, then, in turns (a new order each round) and with the
page cache dropped before each, medians of ``--repeat``: ``fio`` reading the checkpoint's own chunk files
(``--jobs`` jobs, each a quarter of the files, 4 MiB blocks: the physical limit with the
same bytes, files and queue depth), a single-threaded raw read of the same files,
``pytreeckpt.load`` (functional; also with ``ExecutorOptions(huge_pages=False)``, its new
memory in 4 KiB pages) and ``pytreeckpt.load(..., inplace=True)``. Prints one
JSON object per size with the seconds and each load's rate as a fraction of fio's.

With ``--ranks N`` (N > 1) the same is done by N gloo ranks, each holding a
``Shard(0)`` row block of every matrix (a DTensor): the state is saved by the N ranks,
and each load is every rank loading its own share, timed between barriers (the slowest
rank's time); fio reads the same files in ``--jobs`` jobs (the same bytes, files and
queue depth as N ranks reading a share each when ``--jobs`` is N).
Needs root (to drop the page cache) and fio (Debian's package ``fio``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pytreeckpt

from ._common import GiB, can_drop_caches, drop_caches, free_port, gloo_rank, make_state


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


_SMALL_PAGES = pytreeckpt.ExecutorOptions(huge_pages=False)  # new memory as before huge pages were asked for


def _chunk_files(path: Path) -> list[Path]:
    return sorted(p for p in (path / "arrays").rglob("*") if p.is_file() and p.name != "zarr.json")


def _summary(times: dict[str, list[float]], limit_name: str, nbytes: int) -> dict[str, Any]:
    seconds = {k: statistics.median(v) for k, v in times.items()}
    limit = seconds[limit_name]
    return {
        "bytes": nbytes,
        "seconds": seconds,
        "all_seconds": times,
        "of_fio": {k: limit / s for k, s in seconds.items()},
    }


def run(gib: float, leaves: int, repeat: int, jobs: int, workdir: Path) -> dict[str, Any]:
    state = make_state(int(gib * GiB), leaves)
    path = workdir / f"cold_{gib:g}"
    pytreeckpt.save(path, state, overwrite=True)
    files = _chunk_files(path)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    del state
    variants = {
        f"fio {jobs} jobs": lambda: _fio(path / "arrays", files, jobs),
        "raw read (1 thread)": lambda: _raw(files),
        "pytreeckpt.load": lambda: pytreeckpt.load(path, target),
        "pytreeckpt.load 4 KiB pages": lambda: pytreeckpt.load(path, target, executor=_SMALL_PAGES),
        "pytreeckpt.load inplace": lambda: pytreeckpt.load(path, target, inplace=True),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = random.Random(0)
    for _ in range(repeat):
        names = list(variants)
        order.shuffle(names)  # none always follows the same one (what it freed, what the disk still does)
        for name in names:
            fn = variants[name]
            drop_caches()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    shutil.rmtree(path, ignore_errors=True)
    return _summary(times, f"fio {jobs} jobs", nbytes)


def _rank_state(rank: int, world: int, gib: float, leaves: int, mesh: Any, fresh: bool) -> dict[str, Any]:
    """This rank's ``Shard(0)`` rows of ``leaves`` matrices of ``gib`` GiB in all (a fresh
    ``torch.empty`` target when ``fresh``; random values otherwise)."""
    from torch.distributed.tensor import DTensor, Shard

    g = torch.Generator().manual_seed(rank)
    out: dict[str, Any] = {}
    per = int(gib * GiB) // leaves
    for i in range(leaves):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        cols = 1024
        rows = per // (cols * dtype.itemsize) // world * world
        local = (rows // world, cols)
        data = torch.empty(local, dtype=dtype) if fresh else torch.randn(local, generator=g).to(dtype)
        out[f"layer{i}.weight"] = DTensor.from_local(
            data, mesh, [Shard(0)], run_check=False, shape=(rows, cols), stride=(cols, 1)
        )
    return out


def _rank_worker(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    with gloo_rank(rank, world, port) as mesh:
        path, jobs = Path(args["path"]), args["jobs"]
        state = _rank_state(rank, world, args["gib"], args["leaves"], mesh, fresh=False)
        pytreeckpt.save(path, state, overwrite=True)
        dist.barrier()
        files = _chunk_files(path)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())  # (a DTensor's numel is global)
        inplace_target = dict(state)  # memory already faulted in, as a training job's
        del state

        def fio() -> None:
            if rank == 0:
                _fio(path / "arrays", files, jobs)

        def load(executor: pytreeckpt.ExecutorOptions | None = None) -> None:
            target = _rank_state(rank, world, args["gib"], args["leaves"], mesh, fresh=True)
            pytreeckpt.load(path, target, executor=executor)

        variants: dict[str, Callable[[], Any]] = {
            f"fio {jobs} jobs": fio,
            "pytreeckpt.load": load,
            "pytreeckpt.load 4 KiB pages": lambda: load(_SMALL_PAGES),
            "pytreeckpt.load inplace": lambda: pytreeckpt.load(path, inplace_target, inplace=True),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        order = random.Random(0)  # the same order on every rank
        for _ in range(args["repeat"]):
            names = list(variants)
            order.shuffle(names)
            for name in names:
                fn = variants[name]
                dist.barrier()
                if rank == 0:
                    drop_caches()
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
        if rank == 0:
            (path.parent / "result-cold-ranks.json").write_text(json.dumps({"times": times, "bytes": nbytes}))


def run_ranks(ranks: int, gib: float, leaves: int, repeat: int, jobs: int, workdir: Path) -> dict[str, Any]:
    """:func:`run` at ``ranks`` gloo ranks, each loading its ``Shard(0)`` share (no raw read)."""
    path = workdir / f"cold_{gib:g}_{ranks}ranks"
    args = {"path": str(path), "gib": gib, "leaves": leaves, "repeat": repeat, "jobs": jobs}
    mp.spawn(_rank_worker, args=(ranks, free_port(), args), nprocs=ranks, join=True)
    got = json.loads((workdir / "result-cold-ranks.json").read_text())
    shutil.rmtree(path, ignore_errors=True)
    return {"ranks": ranks, **_summary(got["times"], f"fio {jobs} jobs", got["bytes"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--ranks", type=int, default=1, help="gloo ranks loading a share each (1: one process)")
    args = p.parse_args()
    if shutil.which("fio") is None or not can_drop_caches():
        raise SystemExit("benchmarks.cold needs fio (apt-get install fio) and root, to drop the page cache")
    with tempfile.TemporaryDirectory(prefix="pytreeckpt-cold-") as d:
        for gib in args.gib:
            if args.ranks > 1:
                r = run_ranks(args.ranks, gib, args.leaves, args.repeat, args.jobs, Path(d))
            else:
                r = run(gib, args.leaves, args.repeat, args.jobs, Path(d))
            print(json.dumps({"gib": gib, **r}), flush=True)


if __name__ == "__main__":
    main()
