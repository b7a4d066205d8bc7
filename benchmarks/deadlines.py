"""What the deadlines on every wait cost a save (issue 59), through the public ``save``.

    python -m benchmarks.deadlines [--gib 1] [--ranks 4] [--repeat 7]

Every rank saves its shard of ``--gib`` of DTensors (16 tensors sharded over the ranks,
and a step), durably. With the deadlines (the default) the ranks meet on the rendezvous
store before each collective (``distributed/_meet``); without, the collectives wait inside
gloo as they did before (``_meet.ENABLED = False``, for this measure alone). The two take
turns in every round, each first in turn; the ratio with / without is their cost.
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
from pytreeckpt.distributed import _meet

from ._common import GiB, gloo_rank, round_ratios, spawn_ranks


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    with gloo_rank(rank, world, port) as mesh:
        g = torch.Generator().manual_seed(0)
        n = 16
        rows = args["bytes"] // n // 4 // 1024 // world * world
        tree: dict[str, Any] = {
            f"layers.{i}.weight": distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)])
            for i in range(n)
        }
        tree["step"] = 100
        work = Path(args["dir"])
        times: dict[str, list[float]] = {"deadlines": [], "without": []}
        meetings: dict[str, int] = {}
        for r in range(args["repeat"]):
            names = list(times)
            for name in names[r % 2 :] + names[: r % 2]:  # (each first in turn)
                path = work / name
                if rank == 0 and path.exists():
                    shutil.rmtree(path)
                _meet.ENABLED = name == "deadlines"
                dist.barrier()
                m = pytreeckpt.Monitor()
                t = time.perf_counter()
                pytreeckpt.save(path, tree, monitor=m)
                dist.barrier()
                times[name].append(time.perf_counter() - t)
                meetings[name] = sum(1 for s in m.spans if s.phase.startswith("wait: ") and s.rank == rank)
        _meet.ENABLED = True
        # What one meeting costs alone, the ranks idle otherwise: 200 in a row through the save's own DistComm.
        from pytreeckpt.distributed._comm import distributed_comm

        comm = distributed_comm()
        assert comm is not None
        dist.barrier()
        t = time.perf_counter()
        for i in range(200):
            comm.meet(f"benchmark {i}")  # type: ignore[attr-defined]
        meeting = (time.perf_counter() - t) / 200
        if rank == 0:
            out = {"times": times, "meetings": meetings, "meeting_seconds": meeting}
            Path(args["out"]).write_text(json.dumps(out))


def run(gib: float, ranks: int, repeat: int, workdir: Path) -> dict[str, Any]:
    got = spawn_ranks(_worker, ranks, workdir, {"bytes": int(gib * GiB), "repeat": repeat, "dir": str(workdir)})
    times = got["times"]
    ratios = round_ratios(times["deadlines"], times["without"])
    return {
        "gib": gib,
        "ranks": ranks,
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "rounds": times,
        "meetings_per_save": got["meetings"]["deadlines"],
        "meeting_ms_alone": 1000 * got["meeting_seconds"],
        "meetings_share_of_save": got["meetings"]["deadlines"]
        * got["meeting_seconds"]
        / statistics.median(times["without"]),
        "round_ratios": ratios,
        "ratio": statistics.median(ratios),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--dir", type=Path, default=Path("/tmp/pytreeckpt-deadlines"))
    a = p.parse_args()
    r = run(a.gib, a.ranks, a.repeat, a.dir)
    print(json.dumps(r, indent=2))
    print(f"save with deadlines / without: median of round ratios {r['ratio']:.3f} ({r['meetings_per_save']} meetings)")
    print(
        f"one meeting alone: {r['meeting_ms_alone']:.2f} ms; the save's meetings alone: "
        f"{100 * r['meetings_share_of_save']:.2f}% of its median time without them"
    )


if __name__ == "__main__":
    main()
