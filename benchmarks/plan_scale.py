"""Planning at scale, by simulation: Llama 8B/70B/405B training states on up to 16,384 ranks.

    python benchmarks/plan_scale.py                       # the sweep: every model x 64, 512, 4096, 16384 ranks
    python benchmarks/plan_scale.py --model 405b --ranks 16384 --json

Nothing is allocated or written: the planning layer is pure, so the plans of a 16,384-rank
job are computed on one machine from the layouts alone (``pytreeckpt._llama``). For each
model and rank count this measures

- ``rank_plan_ms``: one rank computing its own part of the save plan, cold (no memo),
  median of 3 runs; the slowest of a few sampled ranks is ``rank_plan_max_ms``;
- ``global_plan_s``: the coordinator computing the whole save plan and the metadata
  document, cold;
- ``metadata_mb``: the size of that document (MB = 10^6 bytes), every chunk's crc32c included;
- ``exchange_*``: the layout-exchange payload per rank (what ``_exchange_layouts`` sends
  today: each rank's own pieces, pickled, all-gathered to every rank);
- ``cached_plan_ms``: a save in the same layouts as the last one, served by the plan cache;
- the same for resharded loads (to half the ranks with TP/2 and PP*2, and to 8 ranks for
  evaluation with bf16 parameters only);
- plan invariants (each element written once, each needed element read once), checked
  exactly with numpy on the global plans.

Results go to ``benchmarks/results/plan_scale/`` (JSON, a Markdown table, PNG plots if
matplotlib is installed). With ``--json`` the last line printed is one JSON object (the
last configuration's figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pytreeckpt._dtypes import dtype_from_name
from pytreeckpt._format import ARRAYS_DIR, ArrayMeta, array_names, build_document, chunk_count
from pytreeckpt._llama import llama_state
from pytreeckpt._plan import ChunkingOptions
from pytreeckpt._plan_cache import PlanCache, spec_plan_key
from pytreeckpt._plan_check import check_load, check_save
from pytreeckpt._plan_load_table import plan_load_rank, plan_load_tables
from pytreeckpt._plan_table import ArraySpec, clear_caches, piece_table, plan_save_rank, plan_save_tables
from pytreeckpt._tree import Node

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


def _document(specs: list[ArraySpec], chunk_shapes: list[tuple[int, ...]]) -> bytes:
    """The metadata document a save writes, with every chunk's crc32c recorded (arbitrary values, same size)."""
    names = array_names([s.key for s in specs])
    dtypes = {2: dtype_from_name("bfloat16"), 4: dtype_from_name("float32")}
    metas = [
        ArrayMeta(
            s.key,
            "torch",
            dtypes[s.itemsize],
            s.shape,
            c,
            f"{ARRAYS_DIR}/{n}",
            s.layout,
            chunk_crc32c=bytes(4 * chunk_count(s.shape, c)),
        ).to_json()
        for s, c, n in zip(specs, chunk_shapes, names, strict=True)
    ]
    tree = Node("dict", [("s", s.key) for s in specs], [Node("leaf", leaf=i) for i in range(len(specs))])
    return build_document(tree, metas, {})


def _exchange(specs: list[ArraySpec], world: int, rank: int) -> int:
    """Bytes rank ``rank`` contributes to today's all-gather of layouts: its own pieces of every array, pickled.

    Pieces are taken from the piece tables (offset, shape; local placement as for a rank
    holding one box), so the count is exact for one-box layouts and close otherwise.
    """
    mine = []
    for s in specs:
        table = piece_table(s.layout, s.shape)
        ranks = s.rank_array()
        rows = []
        at = int(np.searchsorted(ranks, rank))
        if at < len(ranks) and ranks[at] == rank:
            sel = np.flatnonzero(table.pos == at)
            rows = [(tuple(table.lo[i].tolist()), tuple(table.ext[i].tolist()), 0, None) for i in sel.tolist()]
        mine.append((s.key, "bfloat16" if s.itemsize == 2 else "float32", list(s.shape), rows))
    return len(pickle.dumps(mine))


def _samples(world: int) -> list[int]:
    return sorted({0, world // 2 + 3, world - 1})


def run_one(model: str, world: int, layout: str, check: bool = True) -> dict[str, Any]:
    tp, pp = _parallel(model, world, TP, PP[model])
    if layout != "tp_pp_dp":
        pp = 1
    t_gen, specs = _timed(lambda: llama_state(model, layout, world, tp=tp, pp=pp))
    options = ChunkingOptions()
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
    # One rank's part, cold: every memo cleared, as a rank's first save. This machine's
    # timings swing by 2x from run to run, so each rank's figure is the median of 3 cold runs.
    times = []
    for r in _samples(world):
        runs = []
        for _ in range(3):
            clear_caches()
            dt, part = _timed(lambda r=r: plan_save_rank(specs, world, r, options))
            runs.append(dt)
        times.append(sorted(runs)[1])
        if r == 0:
            out["rank_writes"] = sum(len(a.writes) for a in part.arrays)
    out["rank_plan_ms"] = times[0] * 1e3
    out["rank_plan_max_ms"] = max(times) * 1e3
    dt, _ = _timed(lambda: plan_save_rank(specs, world, 0, options))
    out["rank_plan_warm_ms"] = dt * 1e3
    # The plan cache: a save in the same layouts as the last one, on a rank (which holds its
    # own plan, not the coordinator's global one: measured before that is built).
    cache = PlanCache(4)
    cache.get_or(spec_plan_key(specs, world, options, 0), lambda: plan_save_rank(specs, world, 0, options))
    hits = []
    gc.collect()
    for _ in range(5):
        fresh = llama_state(model, layout, world, tp=tp, pp=pp)  # equal layouts, new objects, as on the next save
        t0 = time.perf_counter()
        key = spec_plan_key(fresh, world, options, 0)
        cache.get_or(key, lambda fresh=fresh: plan_save_rank(fresh, world, 0, options))
        hits.append(time.perf_counter() - t0)
    assert cache.hits == 5
    out["cached_plan_ms"] = sorted(hits)[len(hits) // 2] * 1e3
    # The coordinator: the whole plan and the metadata document, cold.
    clear_caches()

    def global_plan() -> tuple[Any, bytes]:
        tables = plan_save_tables(specs, world, options)
        return tables, _document(specs, [t.chunk_shape for t in tables])

    dt, (tables, doc) = _timed(global_plan)
    out["global_plan_s"] = dt
    out["writes"] = sum(len(t) for t in tables)
    out["metadata_mb"] = len(doc) / 1e6
    # Layout exchange as done today (all-gather of every rank's own pieces), sampled ranks.
    sent = [_exchange(specs, world, r) for r in _samples(world)]
    out["exchange_sent_kb_per_rank"] = max(sent) / 1e3
    out["exchange_recv_mb_per_rank"] = sum(sent) / len(sent) * world / 1e6
    if check:
        dt, problems = _timed(lambda: check_save(specs, tables, world))
        out["save_check_s"] = dt
        out["save_invariants_ok"] = not problems
        if problems:
            out["save_problems"] = problems[:5]
    chunks = dict(zip([s.key for s in specs], _chunks(specs, world, options), strict=True))
    out["loads"] = [_run_load(model, world, tp, pp, layout, chunks, name, check) for name in ("reshard", "eval8")]
    return out


def _chunks(specs: list[ArraySpec], world: int, options: ChunkingOptions) -> list[tuple[int, ...]]:
    from pytreeckpt._plan_table import grid_info

    return [grid_info(s.layout, s.shape, s.itemsize, options).chunk_shape for s in specs]


def _run_load(
    model: str, world: int, tp: int, pp: int, layout: str, chunks: dict[str, tuple[int, ...]], name: str, check: bool
) -> dict[str, Any]:
    if name == "reshard":
        t_world = max(8, world // 2)
        t_tp, t_pp = _parallel(model, t_world, max(1, tp // 2), 2 * pp if layout == "tp_pp_dp" else 1)
        optimizer = True
    else:
        t_world, t_tp, t_pp, optimizer = 8, 8, 1, False
    t_layout = layout if name == "reshard" else "tp_pp_dp"
    targets = llama_state(model, t_layout, t_world, tp=t_tp, pp=t_pp, optimizer=optimizer)
    stored = [chunks[s.key] for s in targets]
    out: dict[str, Any] = {"load": name, "ranks": t_world, "tp": t_tp, "pp": t_pp, "arrays": len(targets)}
    runs = []
    for _ in range(3):
        clear_caches()
        dt, part = _timed(lambda: plan_load_rank(stored, targets, t_world, 0))
        runs.append(dt)
    out["rank_plan_ms"] = sorted(runs)[1] * 1e3
    out["rank_reads"] = sum(len(a.reads) for a in part.arrays)
    clear_caches()
    dt, tables = _timed(lambda: plan_load_tables(stored, targets, t_world))
    out["global_plan_s"] = dt
    out["reads"] = sum(len(t) if hasattr(t, "rows") else len(t.reads) for t in tables)  # type: ignore[union-attr]
    if check:
        dt, problems = _timed(lambda: check_load(targets, stored, tables, t_world))
        out["check_s"] = dt
        out["invariants_ok"] = not problems
        if problems:
            out["problems"] = problems[:5]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | layout | ranks | TPxPP | arrays | rank plan ms (max) | global plan+meta s | metadata MB | "
        "exchange recv MB/rank | cached ms | load reshard: rank ms / global s | eval8: rank ms / global s | "
        "invariants |\n|" + " --- |" * 13
    )
    lines = [head]
    for r in rows:
        ld = {x["load"]: x for x in r["loads"]}
        ok = r.get("save_invariants_ok", True) and all(x.get("invariants_ok", True) for x in r["loads"])
        lines.append(
            f"| {r['model']} | {r['layout']} | {r['ranks']} | {r['tp']}x{r['pp']} | {r['arrays']} | "
            f"{r['rank_plan_ms']:.0f} ({r['rank_plan_max_ms']:.0f}) | {r['global_plan_s']:.2f} | "
            f"{r['metadata_mb']:.2f} | {r['exchange_recv_mb_per_rank']:.1f} | {r['cached_plan_ms']:.2f} | "
            f"{ld['reshard']['rank_plan_ms']:.0f} / {ld['reshard']['global_plan_s']:.2f} | "
            f"{ld['eval8']['rank_plan_ms']:.0f} / {ld['eval8']['global_plan_s']:.2f} | {'ok' if ok else 'FAILED'} |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    metrics = [
        ("rank_plan_ms", "one rank's save plan (ms)", lambda r: r["rank_plan_ms"]),
        ("global_plan_s", "global save plan + metadata (s)", lambda r: r["global_plan_s"]),
        ("metadata_mb", "metadata document (MB)", lambda r: r["metadata_mb"]),
        (
            "exchange_recv_mb_per_rank",
            "layout all-gather received per rank (MB)",
            lambda r: r["exchange_recv_mb_per_rank"],
        ),
        ("cached_plan_ms", "cached plan (ms)", lambda r: r["cached_plan_ms"]),
        ("load_rank_plan_ms", "one rank's resharded load plan (ms)", lambda r: r["loads"][0]["rank_plan_ms"]),
        ("load_global_plan_s", "global resharded load plan (s)", lambda r: r["loads"][0]["global_plan_s"]),
    ]
    files = []
    for name, label, get in metrics:
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        series: dict[tuple[str, str], list[tuple[int, float]]] = {}
        for r in rows:
            series.setdefault((r["model"], r["layout"]), []).append((r["ranks"], get(r)))
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
    p.add_argument("--no-check", action="store_true", help="skip the invariant checks")
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
                row = run_one(model, world, layout, check=not args.no_check)
                rows.append(row)
                if not args.no_save:
                    _save(rows, Path(args.out), plots=False)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(
                        f"{model} {layout} {world}: rank {row['rank_plan_ms']:.0f} ms, global "
                        f"{row['global_plan_s']:.2f} s, metadata {row['metadata_mb']:.2f} MB, cached "
                        f"{row['cached_plan_ms']:.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
    if not args.no_save:
        _save(rows, Path(args.out), plots=True)
    if args.json:
        print(json.dumps(rows[-1]))
    else:
        print(_table(rows))


if __name__ == "__main__":
    main()
