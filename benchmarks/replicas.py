"""What comparing replicated state across ranks costs a save (issue 41 item 2), through the public ``save``.

    python -m benchmarks.replicas [--gib 1] [--ranks 2] [--repeat 5]

Every rank holds the same ``--gib`` of DDP-style weights (16 float32 tensors, each rank a
whole copy) and saves it durably. Saved as plain tensors with ``check_replicas="all"``,
each rank checksums its copy (crc32c) for the ranks to compare before anything is
written (by default only those of at most 1 MiB are); saved as DTensors with
``Replicate()`` placements (the same bytes, the same write plan: replicated, balanced
across the ranks), nothing is compared, since a DTensor promises its replicas agree. The
three (plain with ``"all"``, plain by default, DTensors) take turns in every round; the ratio
plain / DTensor is what the comparison costs.
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

import pytreeckpt

from ._common import GiB, gloo_rank, round_ratios, spawn_ranks


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    with gloo_rank(rank, world, port) as mesh:
        g = torch.Generator().manual_seed(0)  # the same on every rank: replicated
        n = 16
        plain = {f"layers.{i}.weight": torch.randn(args["bytes"] // n // 4, generator=g) for i in range(n)}
        plain["step"] = 100
        dtensors = {
            k: DTensor.from_local(v, mesh, [Replicate()], run_check=False) if isinstance(v, torch.Tensor) else v
            for k, v in plain.items()
        }
        work = Path(args["dir"])
        times: dict[str, list[float]] = {"plain": [], "plain default": [], "dtensor": []}
        for r in range(args["repeat"]):
            names = list(times)
            for name in names[r % 3 :] + names[: r % 3]:  # (each first in turn)
                path = work / name.replace(" ", "_")
                if rank == 0 and path.exists():
                    shutil.rmtree(path)
                dist.barrier()
                t = time.perf_counter()
                if name == "plain":
                    pytreeckpt.save(path, plain, check_replicas="all")
                elif name == "plain default":  # (tensors over 1 MiB not compared)
                    pytreeckpt.save(path, plain)
                else:
                    pytreeckpt.save(path, dtensors)
                dist.barrier()
                times[name].append(time.perf_counter() - t)
        if rank == 0:
            Path(args["out"]).write_text(json.dumps(times))


def run(gib: float, ranks: int, repeat: int, workdir: Path) -> dict[str, Any]:
    times = spawn_ranks(_worker, ranks, workdir, {"bytes": int(gib * GiB), "repeat": repeat, "dir": str(workdir)})
    ratios = round_ratios(times["plain"], times["dtensor"])
    default = round_ratios(times["plain default"], times["dtensor"])
    return {
        "gib": gib,
        "ranks": ranks,
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "rounds": times,
        "round_ratios": ratios,
        "ratio": statistics.median(ratios),
        "default_round_ratios": default,
        "default_ratio": statistics.median(default),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dir", type=Path, default=Path("/tmp/pytreeckpt-replicas"))
    a = p.parse_args()
    r = run(a.gib, a.ranks, a.repeat, a.dir)
    print(json.dumps(r, indent=2))
    print(f"plain, check_replicas='all' / DTensor Replicate: median of round ratios {r['ratio']:.3f}")
    print(f"plain, default (over 1 MiB not compared) / DTensor Replicate: {r['default_ratio']:.3f}")


if __name__ == "__main__":
    main()
