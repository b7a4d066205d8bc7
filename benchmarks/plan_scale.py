"""Planning at scale, through the public entry points: Llama 8B/70B/405B training states on up to 16,384 ranks.

    python benchmarks/plan_scale.py                       # the sweep: every model x 64, 512, 4096, 16384 ranks
    python benchmarks/plan_scale.py --model 405b --ranks 16384 --layout tp_pp_dp fsdp_tp --json

Nothing is allocated or written. A training state (``benchmarks/_llama.py``) is a tree of
:class:`pytreeckpt.Abstract` leaves: shape, dtype, sharding spec and placement (the ranks
of a pipeline stage), no data. One rank of an N-rank job runs the planning ``save()``
and ``load()`` run, ``pytreeckpt.plan_save(tree, process_group=SimComm(rank, N))`` and
``pytreeckpt.plan_load(path, target, process_group=SimComm(rank, M, document=...))``:
its leaves described, the layout agreement with the other ranks (simulated: they answer
as ranks holding the same state would), its own part of the plan. For each model and
rank count this measures

- ``save_rank_plan_ms``: one rank's ``plan_save``, cold (every plan cache and memo
  cleared), the median of 3; ``save_rank_plan_max_ms`` the slowest of the sampled ranks;
- ``load_rank_plan_ms``: one rank's ``plan_load`` of that checkpoint into half the
  ranks with another TP (TP/2, PP*2), cold; and into 8 ranks for evaluation (bf16
  parameters only), ``eval8_rank_plan_ms``;
- ``exchange_recv_mb_per_rank``: the bytes a non-coordinator rank receives through the
  object collectives of the save's planning (pickled, as torch.distributed sends them),
  the most over the sampled ranks;
- ``metadata_mb`` and ``coordinator_s``: the metadata document the coordinator writes
  (MB = 10^6 bytes) and the time to build it from the ranks' plans (as ``save()``'s
  commit does, ``format.build_document``); ``checksums_mb``: the file of every chunk's
  crc32c beside it, where they are too many for the document (``format.place_checksums``);
- ``cached_plan_ms``: the next save of a new tree in the same layouts (the plan cache);
- ``dtensor_save_rank_plan_ms`` and ``dtensor_load_rank_plan_ms``: the same save (rank 0)
  and resharded load (rank 1) of the state as users hold it, DTensors, cold, the median of
  3. torch.distributed is initialised with its fake backend as that rank of the job
  (``init_process_group("fake", store=FakeStore(), rank=r, world_size=N)``: a process group
  of any size in one process, whose collectives do nothing); each array is a
  ``DTensor.from_local`` on a ``DeviceMesh`` of its layout (``tp_pp_dp``: one ``dp x tp``
  mesh per pipeline stage, every rank holding every stage's arrays, off its own stage an
  empty shard; ``fsdp_tp``: the world's ``dp x tp`` mesh), its local shard of torch's local
  shape holding one element, expanded. The DTensor kind describes them as ``save()`` and
  ``load()`` do, mapping their meshes to ranks through the communicator a distributed save
  makes (``DistComm`` over the fake group), whose object collectives, which a fake group
  cannot carry, are ``SimComm``'s. ``dtensor_plans_match``: the plans are the ``Abstract``
  rows' (FSDP1's flat ranges are no DTensor placement: no DTensor rows for ``fsdp1``).

The plans' invariants are checked against an independent reference planner by the
property tests (``property_tests/test_planner.py``), not here.

Results go to ``benchmarks/results/plan_scale/`` (JSON, a Markdown table, PNG plots if
matplotlib is installed). With ``--json`` each configuration prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _llama import llama_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

import pytreeckpt
from pytreeckpt import Abstract
from pytreeckpt.core._dtypes import dtype_from_name
from pytreeckpt.core._node import Node
from pytreeckpt.distributed._comm import DistComm
from pytreeckpt.format import (
    ARRAYS_DIR,
    METADATA_FILE,
    ArrayMeta,
    array_names,
    build_document,
    chunk_count,
    place_checksums,
)
from pytreeckpt.loading import LOAD_PLANS
from pytreeckpt.plan import ArraySpec, clear_caches
from pytreeckpt.saving import SAVE_PLANS, _recall
from pytreeckpt.testing import SimComm

PP = {"8b": 1, "70b": 4, "405b": 16}  # 405B: TP8 x PP16, as Llama 3 405B was trained
TP = 8
RANKS = (64, 512, 4096, 16384)


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _parallel(model: str, world: int, tp: int, pp: int) -> tuple[int, int]:
    pp = max(1, min(pp, world // tp))
    while world % (tp * pp):
        pp //= 2
    return tp, pp


def _document(specs: list[ArraySpec], chunk_shapes: list[tuple[int, ...]]) -> tuple[bytes, bytes | None]:
    """The metadata document a save writes, with every chunk's crc32c recorded (arbitrary values, same size),
    in the document or, past ``StorageOptions().max_inline_checksum_bytes``, in a checksums file (its bytes)."""
    names = array_names([s.key for s in specs])
    dtypes = {2: dtype_from_name("bfloat16"), 4: dtype_from_name("float32")}
    metas = [
        ArrayMeta(s.key, "torch", dtypes[s.itemsize], s.shape, c, f"{ARRAYS_DIR}/{n}", s.layout)
        for s, c, n in zip(specs, chunk_shapes, names, strict=True)
    ]
    crcs = [bytes(4 * chunk_count(m.shape, m.chunk_shape)) for m in metas]
    refs, file, blob = place_checksums(crcs, pytreeckpt.StorageOptions().max_inline_checksum_bytes)
    leaves = [m.to_json(c, None, r) for m, c, r in zip(metas, crcs, refs, strict=True)]
    tree = Node("dict", [("s", s.key) for s in specs], [Node("leaf", leaf=i) for i in range(len(specs))])
    return build_document(tree, leaves, {}, file), blob


def _cold() -> None:
    """Forget every plan and memo, as before a job's first save."""
    clear_caches()
    _recall.forget()
    SAVE_PLANS.clear()
    LOAD_PLANS.clear()


_DTYPES = {2: torch.bfloat16, 4: torch.float32}


def _tree(specs: list[ArraySpec]) -> dict[str, Abstract]:
    """The state as a tree of Abstract leaves: each array's shape, dtype, layout and placement."""
    out = {}
    for s in specs:
        ranks = s.ranks
        placement = None if ranks is None or ranks == range(len(ranks)) else ranks
        out[s.key] = Abstract(s.shape, _DTYPES[s.itemsize], s.layout, placement)
    return out


def _received_mb(comm: SimComm) -> float:
    return sum(len(pickle.dumps(x)) for x in comm.received) / 1e6


def _samples(world: int) -> list[int]:
    return sorted({0, world // 2 + 3, world - 1})


def run_one(model: str, world: int, layout: str) -> dict[str, Any]:
    tp, pp = _parallel(model, world, TP, PP[model])
    if layout != "tp_pp_dp":
        pp = 1
    t_gen, specs = _timed(lambda: llama_state(model, layout, world, tp=tp, pp=pp))
    tree = _tree(specs)
    out: dict[str, Any] = {
        "model": model,
        "layout": layout,
        "ranks": world,
        "tp": tp,
        "pp": pp,
        "arrays": len(specs),
        "state_gb": sum(s.itemsize * _numel(s.shape) for s in specs) / 1e9,
        "layout_gen_s": t_gen,
    }
    # One rank's part, cold: every cache cleared, as a rank's first save. This machine's
    # timings swing by 2x from run to run, so each rank's figure is the median of 3 cold runs.
    times, received = [], []
    for r in _samples(world):
        runs = []
        for _ in range(3):
            _cold()
            comm = SimComm(r, world)
            dt, part = _timed(lambda r=r, comm=comm: pytreeckpt.plan_save(tree, process_group=comm))
            runs.append(dt)
        times.append(sorted(runs)[1])
        if r != 0:
            received.append(_received_mb(comm))
        if r == 0:
            out["rank_writes"] = sum(len(a.writes) for a in part.arrays)
            chunk_shapes = [a.chunk_shape for a in part.arrays]
            rank0_plan = part
    out["save_rank_plan_ms"] = times[0] * 1e3
    out["save_rank_plan_max_ms"] = max(times) * 1e3
    out["exchange_recv_mb_per_rank"] = max(received)
    # The plan cache: a save of new objects in the same layouts, as the next save of a job.
    hits = []
    for _ in range(5):
        fresh = _tree(llama_state(model, layout, world, tp=tp, pp=pp))
        gc.collect()
        dt, _ = _timed(lambda fresh=fresh: pytreeckpt.plan_save(fresh, process_group=SimComm(0, world)))
        hits.append(dt)
    out["cached_plan_ms"] = sorted(hits)[len(hits) // 2] * 1e3
    # The coordinator's metadata document, from the plans' chunk shapes.
    dt, (doc, sums) = _timed(lambda: _document(specs, chunk_shapes))
    out["coordinator_s"] = dt
    out["metadata_mb"] = len(doc) / 1e6
    out["checksums_mb"] = len(sums or b"") / 1e6
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / METADATA_FILE).write_bytes(doc)
        if sums is not None:
            (Path(d) / "checksums").mkdir()
            (Path(d) / "checksums" / "crc32c").write_bytes(sums)
        for name in ("reshard", "eval8"):
            got, load_plan = _run_load(model, world, tp, pp, layout, Path(d), doc, name)
            out["load_rank_plan_ms" if name == "reshard" else "eval8_rank_plan_ms"] = got["rank_plan_ms"]
            out[f"{name}_load"] = got
            if name == "reshard":
                reshard_plan = load_plan
        if layout != "fsdp1":  # (FSDP1's flat ranges are no DTensor placement)
            # What users save: the same state as DTensors, rank 0's save and rank 1's load, on a fake process group.
            try:
                dt_ms, dt_plan = _dtensor_save(specs, world, 0)
                dt_load, dt_load_plan = _run_load(model, world, tp, pp, layout, Path(d), doc, "reshard", dtensor=True)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
            out["dtensor_save_rank_plan_ms"] = dt_ms
            out["dtensor_load_rank_plan_ms"] = dt_load["rank_plan_ms"]
            out["dtensor_plans_match"] = dt_plan == rank0_plan and dt_load_plan == reshard_plan
    return out


def _run_load(
    model: str, world: int, tp: int, pp: int, layout: str, path: Path, doc: bytes, name: str, dtensor: bool = False
) -> tuple[dict[str, Any], Any]:
    if name == "reshard":
        t_world = max(8, world // 2)
        t_tp, t_pp = _parallel(model, t_world, max(1, tp // 2), 2 * pp if layout == "tp_pp_dp" else 1)
        optimizer = True
    else:
        t_world, t_tp, t_pp, optimizer = 8, 8, 1, False
    t_layout = layout if name == "reshard" else "tp_pp_dp"
    t_specs = llama_state(model, t_layout, t_world, tp=t_tp, pp=t_pp, optimizer=optimizer)
    out: dict[str, Any] = {"ranks": t_world, "tp": t_tp, "pp": t_pp, "arrays": len(t_specs)}
    targets: dict[str, Any] = {} if dtensor else _tree(t_specs)
    runs = []
    for _ in range(3):
        _cold()
        if dtensor:  # (the communicator made inside, as load() makes it)
            _fake_world(1, t_world)
            targets = _dtensors(t_specs, t_world)

            def plan(targets: dict[str, Any] = targets) -> Any:
                comm = _FakeGroupComm(SimComm(1, t_world, document=doc))
                return pytreeckpt.plan_load(path, targets, process_group=comm, strict=optimizer)
        else:
            comm = SimComm(1, t_world, document=doc)  # a non-coordinator rank: the document comes from rank 0

            def plan(targets: dict[str, Any] = targets, comm: SimComm = comm) -> Any:
                return pytreeckpt.plan_load(path, targets, process_group=comm, strict=optimizer)

        dt, part = _timed(plan)
        runs.append(dt)
    out["rank_plan_ms"] = sorted(runs)[1] * 1e3
    out["rank_reads"] = sum(len(a.reads) for a in part.arrays)
    return out, part


# DTensors, as a training job holds its state: torch.distributed initialised with the fake
# backend (a process group of any size in one process, whose collectives do nothing),
# each array a DTensor on the DeviceMesh of its layout.


def _fake_world(rank: int, world: int) -> None:
    """This process as rank ``rank`` of a ``world``-rank job, on torch's fake process group."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


class _FakeGroupComm(DistComm):
    """The communicator a distributed save or load makes, over the fake default group.

    The DTensor kind maps its leaves' meshes to ranks through it (``data_comm``, as for a
    real job); its object collectives, which a fake group cannot carry, are a
    :class:`SimComm`'s: the other ranks answer as ranks holding the same state would.
    """

    def __init__(self, sim: SimComm) -> None:
        group = dist.group.WORLD
        super().__init__((group, group))
        self.sim = sim

    def meet(self, phase: str) -> None:
        """No meeting: the fake group has no store and no other rank to wait for (see distributed._meet)."""

    def gather(self, obj: Any, what: str = "") -> list[Any]:
        return self.sim.gather(obj)

    def broadcast(self, obj: Any, src: int = 0, what: str = "", meet: bool = True) -> Any:
        return self.sim.broadcast(obj, src)

    def agree(self, error: BaseException | None, what: str) -> None:
        self.sim.agree(error, what)


def _dtensors(specs: list[ArraySpec], world: int) -> dict[str, DTensor]:
    """The state as this rank's DTensors, on new meshes: what the Abstract leaves of ``_tree`` describe.

    Each array is a DTensor on a DeviceMesh of its layout's mesh over its ranks
    (``tp_pp_dp``: a pipeline stage's ``dp x tp`` ranks, one mesh per stage, every rank
    holding every stage's arrays as ``_tree``'s placements say, off its own stage's mesh an
    empty shard; ``fsdp_tp``: the ``dp x tp`` mesh of the world). The meshes make no
    process groups (planning uses none); the local shard has the shape torch gives this
    rank and holds one element, expanded.
    """
    meshes: dict[Any, DeviceMesh] = {}
    local_shapes: dict[Any, tuple[int, ...]] = {}
    one = {n: torch.empty((), dtype=d) for n, d in _DTYPES.items()}
    out = {}
    for s in specs:
        ranks = range(world) if s.ranks is None else s.ranks
        mesh_of = s.layout.mesh
        key = (ranks, mesh_of.shape, mesh_of.axis_names)
        mesh = meshes.get(key)
        if mesh is None:
            grid = torch.tensor(list(ranks)).reshape(mesh_of.shape)
            mesh = meshes[key] = DeviceMesh("cpu", grid, mesh_dim_names=tuple(mesh_of.axis_names), _init_backend=False)
        placements = pytreeckpt.placements_from_spec(s.layout)
        shape = torch.Size(s.shape)
        local = local_shapes.get((key, s.shape, s.layout))
        if local is None:  # (torch computes a _StridedShard's in milliseconds: a model's layers share theirs)
            local = local_shapes[key, s.shape, s.layout] = tuple(
                compute_local_shape_and_global_offset(shape, mesh, placements)[0]
            )
        out[s.key] = DTensor.from_local(
            one[s.itemsize].expand(local), mesh, placements, run_check=False, shape=shape, stride=_contiguous(s.shape)
        )
    return out


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


def _dtensor_save(specs: list[ArraySpec], world: int, rank: int) -> tuple[float, Any]:
    """One rank's cold ``plan_save`` of the state as DTensors (ms, median of 3), and its plan."""
    runs = []
    for _ in range(3):
        _cold()
        _fake_world(rank, world)
        tree = _dtensors(specs, world)

        def plan(tree: dict[str, DTensor] = tree) -> Any:  # (the communicator made inside, as save() makes it)
            return pytreeckpt.plan_save(tree, process_group=_FakeGroupComm(SimComm(rank, world)))

        dt, part = _timed(plan)
        runs.append(dt)
    return sorted(runs)[1] * 1e3, part


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | layout | ranks | TPxPP | arrays | save rank plan ms (max) | metadata MB | "
        "exchange recv bytes/rank | coordinator s | cached ms | load reshard rank ms | eval8 rank ms | "
        "DTensor save rank ms | DTensor load reshard rank ms |\n|" + " --- |" * 14
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['ranks']} | {r['tp']}x{r['pp']} | {r['arrays']} | "
            f"{r['save_rank_plan_ms']:.0f} ({r['save_rank_plan_max_ms']:.0f}) | {r['metadata_mb']:.2f} | "
            f"{r['exchange_recv_mb_per_rank'] * 1e6:.0f} | {r['coordinator_s']:.2f} | {r['cached_plan_ms']:.2f} | "
            f"{r['load_rank_plan_ms']:.0f} | {r['eval8_rank_plan_ms']:.0f} | "
            f"{_ms(r.get('dtensor_save_rank_plan_ms'))} | {_ms(r.get('dtensor_load_rank_plan_ms'))} |"
        )
    return "\n".join(lines) + "\n"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _plot(rows: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    metrics = [
        ("save_rank_plan_ms", "one rank's save plan (ms)", lambda r: r["save_rank_plan_ms"]),
        ("metadata_mb", "metadata document (MB)", lambda r: r["metadata_mb"]),
        (
            "exchange_recv_mb_per_rank",
            "layout agreement received per rank (MB)",
            lambda r: r["exchange_recv_mb_per_rank"],
        ),
        ("cached_plan_ms", "cached plan (ms)", lambda r: r["cached_plan_ms"]),
        ("load_rank_plan_ms", "one rank's resharded load plan (ms)", lambda r: r["load_rank_plan_ms"]),
        (
            "dtensor_save_rank_plan_ms",
            "one rank's save plan of DTensors (ms)",
            lambda r: r.get("dtensor_save_rank_plan_ms"),
        ),
        (
            "dtensor_load_rank_plan_ms",
            "one rank's resharded DTensor load plan (ms)",
            lambda r: r.get("dtensor_load_rank_plan_ms"),
        ),
    ]
    files = []
    for name, label, get in metrics:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            if get(r) is not None:  # (no DTensor figures for fsdp1, or in results from before they were measured)
                series.setdefault((r["model"], r["layout"]), []).append((r["ranks"], get(r)))
        if not series:
            plt.close(fig)
            continue
        for (model, layout), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{model} {layout}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files


def _save(rows: list[dict[str, Any]], out: Path, plots: bool) -> None:
    """Results so far: JSON and a Markdown table after every configuration, the plots at the end."""
    out.mkdir(parents=True, exist_ok=True)
    env = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor()}
    ordered = sorted(rows, key=lambda r: (r["layout"], ["8b", "70b", "405b"].index(r["model"]), r["ranks"]))
    (out / "plan_scale.json").write_text(json.dumps({"env": env, "rows": ordered}, indent=1))
    (out / "plan_scale.md").write_text(_table(ordered))
    if plots:
        files = _plot(ordered, out)
        print(f"wrote {out} ({len(files)} plots)", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["8b", "70b", "405b", "all"], default="all")
    p.add_argument("--ranks", type=int, nargs="*", default=list(RANKS))
    p.add_argument("--layout", nargs="*", default=["tp_pp_dp"], choices=["tp_pp_dp", "fsdp_tp", "fsdp1"])
    p.add_argument("--json", action="store_true", help="print one JSON object per configuration")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_scale"))
    p.add_argument("--no-save", action="store_true", help="do not write the results directory")
    p.add_argument("--plot-only", action="store_true", help="redraw the plots and table from the saved JSON")
    args = p.parse_args(argv)
    if args.plot_only:
        out = Path(args.out)
        _save(json.loads((out / "plan_scale.json").read_text())["rows"], out, plots=True)
        return
    models = ["405b", "70b", "8b"] if args.model == "all" else [args.model]
    rows: list[dict[str, Any]] = []
    for layout in args.layout:
        for model in models:
            for world in args.ranks:
                row = run_one(model, world, layout)
                rows.append(row)
                if not args.no_save:
                    _save(rows, Path(args.out), plots=False)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(
                        f"{model} {layout} {world}: rank {row['save_rank_plan_ms']:.0f} ms, load "
                        f"{row['load_rank_plan_ms']:.0f} ms, metadata {row['metadata_mb']:.2f} MB, cached "
                        f"{row['cached_plan_ms']:.2f} ms; DTensors: rank {_ms(row.get('dtensor_save_rank_plan_ms'))} "
                        f"ms, load {_ms(row.get('dtensor_load_rank_plan_ms'))} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    if not args.no_save:
        _save(rows, Path(args.out), plots=True)
    if not args.json:
        print(_table(rows))


if __name__ == "__main__":
    main()
