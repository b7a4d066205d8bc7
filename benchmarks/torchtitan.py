"""torchtitan's checkpointer with pytreeckpt's backend against its own DCP backend, side by side (issue 43 item 1).

    python -m benchmarks.torchtitan [--ranks 2] [--layers 6] [--saves 3] [--repeat 3]

(Run it as a module: ``benchmarks/`` on the path would hide the ``torchtitan`` package.)

The job of ``benchmarks/_titan.py`` on gloo ranks (torchtitan's llama3 ``debugmodel``, its first
``--layers`` layers, FSDP2 over the ranks, AdamW, a dataloader), its checkpointer built from
``pytreeckpt.integrations.torchtitan.CheckpointManager.Config`` or from torchtitan's own
``CheckpointManager.Config`` (DCP), with the same options. Per backend, in every round:

- **stall**: ``checkpointer.save(step)`` with ``async_mode="async"`` after a training step, the time
  the loop is blocked (the previous save waited for first, outside the timing): the first save
  (planning, DCP's process group) and the median of the next ``--saves - 1``;
- **save**: ``async_mode="disabled"``, the time to a committed checkpoint;
- **load**: a new job's ``checkpointer.load()`` of that checkpoint.

Each time is the slowest rank's (barriers around it). The backends alternate which goes first in
each round; ratios are pytreeckpt / DCP per round, and their medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ._common import free_port, gloo_rank, round_ratios

BACKENDS = ("pytreeckpt", "dcp")
MEASURES = ("stall first", "stall", "save", "load")


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _timed(fn: Any) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    return _slowest(time.perf_counter() - t)


def _round(rank: int, world: int, base: Path, backend: str, args: dict[str, Any]) -> dict[str, float]:
    from ._titan import Job

    if rank == 0:
        shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    common = {"backend": backend, "layers": args["layers"], "interval": 1, "keep_latest_k": 0}
    job = Job(rank, world, str(base / "async"), 100, seed=0, async_mode="async", **common)
    batches = iter(job.dataloader)
    stalls = []
    for _ in range(args["saves"]):
        job.step(batches)
        job.checkpointer.maybe_wait_for_saving()
        step = job.train_state.step
        stalls.append(_timed(lambda step=step: job.checkpointer.save(step)))
    job.checkpointer.maybe_wait_for_saving()
    job.close()

    sync = Job(rank, world, str(base / "sync"), 100, seed=0, async_mode="disabled", **common)
    sync.step(iter(sync.dataloader))
    save = _timed(lambda: sync.checkpointer.save(1))
    sync.close()
    fresh = Job(rank, world, str(base / "sync"), 100, seed=1, async_mode="disabled", **common)
    load = _timed(lambda: fresh.checkpointer.load())
    assert fresh.train_state.step == 1
    fresh.close()
    return {
        "stall first": stalls[0],
        "stall": statistics.median(stalls[1:] or stalls),
        "save": save,
        "load": load,
    }


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    with gloo_rank(rank, world, port):
        from ._titan import Job

        probe = Job(rank, world, args["dir"] + "/probe", 100, seed=0, layers=args["layers"], interval=1)
        params = sum(p.numel() for p in probe.model.parameters())  # (global: DTensors)
        probe.close()
        work = Path(args["dir"])
        times: dict[str, dict[str, list[float]]] = {b: {m: [] for m in MEASURES} for b in BACKENDS}
        for r in range(args["repeat"]):
            for backend in BACKENDS if r % 2 == 0 else BACKENDS[::-1]:
                for m, sec in _round(rank, world, work / backend, backend, args).items():
                    times[backend][m].append(sec)
        if rank == 0:
            Path(args["out"]).write_text(json.dumps({"times": times, "params": params}))


def run(ranks: int, layers: int, saves: int, repeat: int, workdir: Path) -> dict[str, Any]:
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    out = workdir / "times.json"
    args = {"layers": layers, "saves": saves, "repeat": repeat, "dir": str(workdir), "out": str(out)}
    mp.start_processes(_worker, args=(ranks, free_port(), args), nprocs=ranks, start_method="spawn")
    got = json.loads(out.read_text())
    times = got["times"]
    shutil.rmtree(workdir, ignore_errors=True)
    ratios = {m: round_ratios(times["pytreeckpt"][m], times["dcp"][m]) for m in MEASURES}
    return {
        "ranks": ranks,
        "layers": layers,
        "params": got["params"],
        "state_mib": got["params"] * 3 * 4 / 2**20,  # float32 weights and AdamW's two moments
        "seconds": {b: {m: statistics.median(v) for m, v in times[b].items()} for b in BACKENDS},
        "rounds": times,
        "round_ratios": ratios,
        "ratio": {m: statistics.median(v) for m, v in ratios.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", type=Path, default=Path("/tmp/pytreeckpt-torchtitan"))
    a = p.parse_args()
    r = run(a.ranks, a.layers, a.saves, a.repeat, a.dir)
    print(json.dumps(r, indent=2))
    print(f"llama3 debugmodel, {a.layers} layers, {r['params']:,} parameters ({r['state_mib']:.0f} MiB with AdamW)")
    print(f"{a.ranks} gloo ranks; seconds, median of {a.repeat} rounds; pytreeckpt / DCP (median of round ratios)")
    for m in MEASURES:
        s = r["seconds"]
        print(f"  {m:12s} pytreeckpt {s['pytreeckpt'][m]:.3f}  DCP {s['dcp'][m]:.3f}  ratio {r['ratio'][m]:.2f}")


if __name__ == "__main__":
    main()
