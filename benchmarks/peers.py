"""The peer tier (issue 42 item 4): a lost node's recovery from a peer against the durable tier, and what
replication costs the training loop, through ``PeerTierManager``.

    python -m benchmarks.peers [--gib 1] [--ranks 4] [--ranks-per-node 2] [--repeat 3]

``--ranks`` gloo ranks in nodes of ``--ranks-per-node`` hold a ``--gib`` state (8 float32
matrices, each a DTensor sharded by rows over all ranks). Each node's local directory is
under /dev/shm (the node-local tier in memory), the durable tier a directory on disk.

Recovery: one step saved to both tiers, then, in turns each round (a new order each round;
a first round untimed),
node 1's local directory wiped (its machine lost) and every rank restoring into a fresh
state: from the peers (node 1's part sent back from its peer's replica) or, with the peer's
replica removed too, from the durable tier; the page cache dropped before each where the
machine lets us (root). Times are the slowest rank's ``restore`` (between barriers).

Training loop: managers with ``peers=1`` and ``peers=0`` (the node-local save alone) take
turns; each saves a step and then runs a fixed compute step (matmuls) while the replication
runs on its thread. Per save: the stall of ``save`` (the local save, and the previous
replication's end), the compute step's time, and the ``wait`` for the replication after it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pytreeckpt

from ._common import GiB, drop_caches, free_port, gloo_rank, round_ratios


def _state(mesh: Any, nbytes: int, step: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    world = mesh.size()
    cols = 256
    rows = max(world, nbytes // 8 // 4 // cols // world * world)
    g = torch.Generator().manual_seed(step)
    return {
        f"layers.{i}": distribute_tensor(torch.randn(rows, cols, generator=g), mesh, [Shard(0)]) for i in range(8)
    } | {"step": step}


def _compute(size: int) -> None:
    a = torch.ones(size, size)
    for _ in range(8):
        a = (a @ a) / size


def _timed(fn: Any) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def _worker(rank: int, world: int, port: int, args: dict[str, Any]) -> None:
    warnings.simplefilter("ignore")
    with gloo_rank(rank, world, port) as mesh:
        rpn = args["ranks_per_node"]
        node = rank // rpn
        shm, durable = Path(args["shm"]), Path(args["dir"]) / "durable"
        local = shm / f"node{node}"
        lost = shm / f"node{world // rpn - 1}"  # the last node is the one lost
        state = _state(mesh, args["bytes"], 1)
        out: dict[str, Any] = {}

        # ---------------------------------------------------------------- recovery
        def manager() -> pytreeckpt.PeerTierManager:
            return pytreeckpt.PeerTierManager(
                local, durable, ranks_per_node=rpn, durable_interval_steps=1, async_=False
            )

        with manager() as m:
            m.save(1, state)
        if rank == 0:
            shutil.copytree(shm, Path(args["dir"]) / "pristine", dirs_exist_ok=True)  # (a copy on disk, untimed)
        dist.barrier()
        times: dict[str, list[float]] = {"peers": [], "durable": []}
        for r in range(-1, args["repeat"]):  # (round -1 untimed: a process's first restore pays its warm-up)
            names = list(times)
            random.Random(r).shuffle(names)
            for name in names:
                if rank == 0:
                    shutil.rmtree(shm, ignore_errors=True)
                    shutil.copytree(Path(args["dir"]) / "pristine", shm)
                    shutil.rmtree(lost)
                    if name == "durable":  # the lost node's replicas are gone too
                        for held in shm.glob(f"node*/replicas/node_{world // rpn - 1}"):
                            shutil.rmtree(held)
                    if args["cold"]:
                        drop_caches()
                dist.barrier()
                target = _state(mesh, args["bytes"], 0)
                with manager() as m:
                    seconds = _timed(lambda m=m, target=target: m.restore(target=target))
                    assert m.last_restored_tier == name, (m.last_restored_tier, name)
                if r >= 0:
                    times[name].append(seconds)
                del target
        out["recovery"] = times

        # ---------------------------------------------------------------- training loop
        loop: dict[str, dict[str, list[float]]] = {
            f"peers={k}": {"save": [], "compute": [], "wait": []} for k in (1, 0)
        }
        for r in range(args["repeat"]):
            names = list(loop)
            random.Random(100 + r).shuffle(names)
            for name in names:
                if rank == 0:
                    shutil.rmtree(shm, ignore_errors=True)
                dist.barrier()
                with pytreeckpt.PeerTierManager(
                    local,
                    durable,
                    ranks_per_node=rpn,
                    peers=int(name[-1]),
                    durable_interval_steps=10**9,
                ) as m:
                    m.save(1, state)  # (the first save: no replication ahead of it)
                    m.wait()
                    loop[name]["save"].append(_timed(lambda m=m: m.save(2, state)))
                    loop[name]["compute"].append(_timed(lambda: _compute(args["compute"])))
                    loop[name]["wait"].append(_timed(m.wait))
        out["loop"] = loop
        if rank == 0:
            Path(args["out"]).write_text(json.dumps(out))


def run(gib: float, ranks: int, ranks_per_node: int, repeat: int, workdir: Path, compute: int = 384) -> dict[str, Any]:
    """Run the benchmark (see the module); the seconds of each contender in each round and their medians."""
    workdir.mkdir(parents=True, exist_ok=True)
    shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm = Path(tempfile.mkdtemp(prefix="pytreeckpt-peers-", dir=shm_root))
    out = workdir / "times.json"
    cold = drop_caches()
    args = {
        "bytes": int(gib * GiB),
        "ranks_per_node": ranks_per_node,
        "repeat": repeat,
        "dir": str(workdir),
        "shm": str(shm),
        "out": str(out),
        "cold": cold,
        "compute": compute,
    }
    try:
        mp.start_processes(_worker, args=(ranks, free_port(), args), nprocs=ranks, start_method="spawn")
        times = json.loads(out.read_text())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(workdir, ignore_errors=True)
    rec, loop = times["recovery"], times["loop"]
    with_peers, alone = loop["peers=1"], loop["peers=0"]
    per_save = [
        s + c + w for s, c, w in zip(with_peers["save"], with_peers["compute"], with_peers["wait"], strict=True)
    ]
    per_save0 = [s + c + w for s, c, w in zip(alone["save"], alone["compute"], alone["wait"], strict=True)]
    return {
        "gib": gib,
        "ranks": ranks,
        "ranks_per_node": ranks_per_node,
        "cold_cache": cold,
        "recovery_seconds": {k: statistics.median(v) for k, v in rec.items()},
        "recovery_rounds": rec,
        "durable_over_peers": statistics.median(round_ratios(rec["durable"], rec["peers"])),
        "loop_seconds": {k: {p: statistics.median(v) for p, v in d.items()} for k, d in loop.items()},
        "loop_rounds": loop,
        "save_compute_wait_ratio": statistics.median(round_ratios(per_save, per_save0)),
        "compute_ratio": statistics.median(round_ratios(with_peers["compute"], alone["compute"])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--compute", type=int, default=384, help="the compute step's matrix size")
    p.add_argument("--dir", type=Path, default=Path("/tmp/pytreeckpt-peers"))
    a = p.parse_args()
    r = run(a.gib, a.ranks, a.ranks_per_node, a.repeat, a.dir, a.compute)
    print(json.dumps(r, indent=2))
    s = r["recovery_seconds"]
    print(
        f"recovery of a lost node, {a.gib:g} GiB at {a.ranks} ranks ({'cold' if r['cold_cache'] else 'warm'} cache): "
        f"peers {s['peers']:.2f} s, durable {s['durable']:.2f} s; durable / peers {r['durable_over_peers']:.2f}"
    )
    lp = r["loop_seconds"]
    print(
        f"per save, peers=1 against peers=0: save {lp['peers=1']['save']:.2f} / {lp['peers=0']['save']:.2f} s, "
        f"compute step {lp['peers=1']['compute']:.2f} / {lp['peers=0']['compute']:.2f} s, "
        f"wait {lp['peers=1']['wait']:.2f} / {lp['peers=0']['wait']:.2f} s; "
        f"(save + compute + wait) ratio {r['save_compute_wait_ratio']:.2f}"
    )


if __name__ == "__main__":
    main()
