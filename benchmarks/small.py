"""Per-leaf cost: many small leaves (MoE states hold 10^4-10^5 tensors per rank), and a mixed state.

    python -m benchmarks --only small [--small 10000 100000] [--mixed-gib 1]

- ``run(count)``: ``count`` float32 tensors of 64 elements in ``count / 10`` dicts of 10.
  Saved by torch.save, safetensors, torch.distributed.checkpoint and pytreeckpt, each
  made durable (fsynced) inside its timing; loaded by torch.load, safetensors, DCP and
  pytreeckpt; every tool takes its turn in every round (order shuffled, seeded). The
  save's own monitor splits pytreeckpt's save into planning (everything before the
  first write: flattening, describing the leaves, the plan, the metadata's leaves),
  writing, and committing (the metadata document and the rename). The rounds time the
  saves a training job makes after its first, which recognise the state saved before;
  the first save of the state in the process (described in full) is timed alone, as
  ``first_save``. ``pytreeckpt.async_save`` takes its turn too: its caller's stall, and its
  total until committed; the stall is held to the blocking save's and 1.2x torch.save's
  time (issue 44), each round's ratio.
- ``run_mixed(gib)``: a model state as training saves it: 300 weight matrices in the
  proportions of a 1B-parameter transformer (scaled so the weights take ``gib`` GiB), an
  AdamW state (``exp_avg``, ``exp_avg_sq`` and a ``step`` tensor per weight) and 1,000
  small values (Python ints and floats, 0-d and 16-element tensors).
"""

from __future__ import annotations

import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import pytreeckpt

from ._common import (
    GiB,
    alternating,
    count_files,
    drop_caches,
    fresh,
    fsync_tree,
    growth_rounds,
    nbytes_of,
    round_ratios,
    rounds,
)


def small_state(count: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """``count`` float32 leaves of 64 elements, in ``count // 10`` dicts of 10."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}": {f"p{j}": torch.randn(64, generator=g) for j in range(10)} for i in range(count // 10)}


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _flat(v).items()})
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _tools(state: dict[str, Any], workdir: Path, cold: bool, repeat: int) -> dict[str, Any]:
    """Every tool's save and load of ``state``, alternated; pytreeckpt's save phases."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file

    flat = _flat(state)
    paths = {
        "torch": workdir / "small.pt",
        "safetensors": workdir / "small.safetensors",
        "dcp": workdir / "small-dcp",
        "pytreeckpt": workdir / "small-ptc",
        "async": workdir / "small-ptc-async",
    }

    def torch_save() -> None:
        torch.save(state, paths["torch"])
        fsync_tree(paths["torch"])

    def st_save() -> None:
        save_file(flat, paths["safetensors"])
        fsync_tree(paths["safetensors"])

    phases: dict[str, list[float]] = {"plan": [], "write": [], "commit": []}

    def ptc_save() -> None:
        m = pytreeckpt.Monitor()
        pytreeckpt.save(paths["pytreeckpt"], state, monitor=m)
        for span in m.spans:
            if span.phase in phases:
                phases[span.phase].append(span.seconds)

    # A job's first save describes its state in full; each later save of that state recognises
    # it and describes only its data (src/pytreeckpt/saving/_recall.py). The first is timed here on
    # its own; the rounds below are the later saves a training job makes.
    fresh(paths["pytreeckpt"])()
    t0 = time.perf_counter()
    ptc_save()
    first = {"seconds": time.perf_counter() - t0, **{k: v.pop() for k, v in phases.items() if v}}

    stalls: list[float] = []

    def ptc_async() -> None:  # timed until written and committed; the caller's stall recorded alone
        t0 = time.perf_counter()
        h = pytreeckpt.async_save(paths["async"], state)
        stalls.append(time.perf_counter() - t0)
        h.wait()

    saves = {
        "torch.save": (torch_save, fresh(paths["torch"])),
        "safetensors.save": (st_save, fresh(paths["safetensors"])),
        "dcp.save": (lambda: dcp.save(flat, checkpoint_id=paths["dcp"]), fresh(paths["dcp"])),
        "pytreeckpt.save": (ptc_save, fresh(paths["pytreeckpt"])),
        "pytreeckpt.async_save total": (ptc_async, fresh(paths["async"])),
    }
    times = rounds(saves, repeat)
    s = {name: statistics.median(t) for name, t in times.items()}
    s["pytreeckpt.async_save stall"] = statistics.median(stalls)
    # the stall against the blocking save and torch.save of each round (issue 44 item 5): times taken at one speed
    stall_ratios = {
        "pytreeckpt.save": round_ratios(stalls, times["pytreeckpt.save"]),
        "torch.save": round_ratios(stalls, times["torch.save"]),
    }
    del saves["pytreeckpt.async_save total"]
    files = {name: count_files(paths[name.split(".")[0]]) for name in saves}
    for fn, setup in saves.values():  # each tool's checkpoint, for the loads
        setup()
        fn()

    def dcp_load() -> None:
        dcp.load({k: torch.empty_like(v) for k, v in flat.items()}, checkpoint_id=paths["dcp"])

    mode = "cold" if cold else "warm"
    setup = drop_caches if cold else None
    loads = {
        f"torch.load {mode}": (lambda: torch.load(paths["torch"], weights_only=True), setup),
        f"safetensors.load {mode}": (lambda: load_file(paths["safetensors"]), setup),
        f"dcp.load {mode}": (dcp_load, setup),
        f"pytreeckpt.load {mode}": (lambda: pytreeckpt.load(paths["pytreeckpt"]), setup),
    }
    s.update(alternating(loads, repeat))
    for p in paths.values():
        fresh(p)()
    median = {k: sorted(v)[len(v) // 2] for k, v in phases.items() if v}
    return {"seconds": s, "files": files, "save_phases": median, "first_save": first, "stall_ratios": stall_ratios}


def run(count: int, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    r = _tools(small_state(count), workdir, cold, repeat)
    return {"leaves": count, "bytes": count * 64 * 4, **r}


def paired(small_count: int, big_count: int, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    """pytreeckpt's save and load of ``small_count`` and of ``big_count`` small leaves, alternated in the same
    rounds: how its time grows with the leaves, without the machine's drift between the two runs above
    (minutes apart, this machine's speed can differ by 2x)."""
    states = {"small": small_state(small_count), "big": small_state(big_count)}
    paths = {name: workdir / f"paired-{name}" for name in states}
    r = growth_rounds(paths, lambda name: pytreeckpt.save(paths[name], states[name]), repeat, cold)
    for p in paths.values():
        fresh(p)()
    return {"leaves": [small_count, big_count], **r}


def mixed_state(gib: float, seed: int = 0) -> dict[str, Any]:
    """Weights in a 1B-class transformer's proportions (embeddings, 33 layers of 4 attention, 3 MLP
    and 2 norm weights, final norm and head: 300 tensors; matrices scaled so the weights take
    ``gib`` GiB), an AdamW state, and 1,000 small values."""
    g = torch.Generator().manual_seed(seed)
    d = 2048
    shapes: list[tuple[str, tuple[int, ...]]] = [("embed", (32000, d))]
    for layer in range(33):
        for name, shape in (
            ("q", (d, d)),
            ("k", (d // 4, d)),
            ("v", (d // 4, d)),
            ("o", (d, d)),
            ("gate", (5632, d)),
            ("up", (5632, d)),
            ("down", (d, 5632)),
            ("norm1", (d,)),
            ("norm2", (d,)),
        ):
            shapes.append((f"layers.{layer}.{name}", shape))
    shapes += [("norm", (d,)), ("head", (32000, d))]
    full = sum(torch.Size(s).numel() for _, s in shapes) * 4
    scale = (gib * GiB / full) ** 0.5  # both dims of a matrix shrink
    weights: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        small = tuple(max(1, int(n * scale)) for n in shape) if len(shape) == 2 else shape
        weights[name] = torch.randn(small, generator=g)
    optim = {
        name: {"exp_avg": torch.randn_like(w), "exp_avg_sq": torch.rand_like(w), "step": torch.tensor(1000.0)}
        for name, w in weights.items()
    }
    extras: dict[str, Any] = {}
    for i in range(1000):
        kind = i % 4
        extras[f"v{i}"] = (
            i if kind == 0 else float(i) / 7 if kind == 1 else torch.tensor(float(i)) if kind == 2 else torch.randn(16)
        )
    return {"model": weights, "optim": optim, "extras": extras, "step": 1000}


def run_mixed(gib: float, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = mixed_state(gib)
    tensors = _flat(state)
    nbytes = nbytes_of(tensors)
    r = _tools(state, workdir, cold, repeat)
    return {"leaves": len(tensors) + 501, "bytes": nbytes, **r}


def targets(r: dict[str, Any], cold: bool, mixed: bool = False) -> list[tuple[str, float, str, float]]:
    """Issue 18's bounds for small leaves, and issue 44's for the stall of ``async_save``; for the ``mixed`` state
    issue 18's are a stretch.

    The issue asks the mixed state to be no worse than before its work, which
    ``revisions.targets`` checks (both versions run in turns); the 10,000-leaf bounds are
    kept beside it as a stretch. Its load reads 1,011 files against safetensors' one.
    """
    s = r["seconds"]
    mode = "cold" if cold else "warm"
    stretch = " (stretch: the 10,000-leaf bound)" if mixed else ""
    return [
        (f"pytreeckpt save time / torch.save's{stretch}", s["pytreeckpt.save"] / s["torch.save"], "<=", 1.2),
        (
            f"pytreeckpt load time / safetensors.load's{stretch}",
            s[f"pytreeckpt.load {mode}"] / s[f"safetensors.load {mode}"],
            "<=",
            1.2,
        ),
        ("DCP save time / pytreeckpt save time", s["dcp.save"] / s["pytreeckpt.save"], ">", 1.0),
        ("DCP load time / pytreeckpt load time", s[f"dcp.load {mode}"] / s[f"pytreeckpt.load {mode}"], ">", 1.0),
        *stall_targets(r)[: 1 if mixed else 2],  # (the bound to torch.save's time is the small leaves')
    ]


def stall_targets(r: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """Issue 44 item 5: the caller's stall in ``async_save`` at most the blocking save's time and 1.2x torch.save's
    (the median of each round's ratio)."""
    ratios = r.get("stall_ratios")
    if not ratios:
        return []
    return [
        (
            "pytreeckpt.async_save stall / pytreeckpt.save time, median of the rounds' ratios",
            statistics.median(ratios["pytreeckpt.save"]),
            "<=",
            1.0,
        ),
        (
            "pytreeckpt.async_save stall / torch.save's time, median of the rounds' ratios",
            statistics.median(ratios["torch.save"]),
            "<=",
            1.2,
        ),
    ]


def scale_targets(
    small_run: dict[str, Any], big_run: dict[str, Any], cold: bool
) -> list[tuple[str, float, str, float]]:
    """10x the leaves: time grows at most 11x; planning and committing stay under 20% of the save.

    The growth is taken from the big run's ``paired`` rounds when it has them (both states
    saved and loaded in the same rounds, :func:`paired`: the median of each round's ratio), else
    from the two runs.
    """
    mode = "cold" if cold else "warm"
    a, b = small_run["seconds"], big_run["seconds"]
    n = big_run["leaves"] / small_run["leaves"]
    ph = big_run["save_phases"]
    share = (ph.get("plan", 0.0) + ph.get("commit", 0.0)) / b["pytreeckpt.save"]
    pair = big_run.get("paired")
    if pair is not None and "growth" in pair:
        how = ", median of the rounds' ratios"
        save, load = pair["growth"]["save"], pair["growth"]["load"]
    elif pair is not None:
        p, how = pair["seconds"], ", alternated in the same rounds"
        save, load = p["big save"] / p["small save"], p["big load"] / p["small load"]
    else:
        how = ""
        save = b["pytreeckpt.save"] / a["pytreeckpt.save"]
        load = b[f"pytreeckpt.load {mode}"] / a[f"pytreeckpt.load {mode}"]
    return [
        (f"save time at {n:g}x the leaves / at 1x{how}", save, "<=", 1.1 * n),
        (f"load time at {n:g}x the leaves / at 1x{how}", load, "<=", 1.1 * n),
        ("(plan + commit) / save, most leaves", share, "<", 0.2),
    ]


__all__ = ["mixed_state", "paired", "run", "run_mixed", "scale_targets", "small_state", "stall_targets", "targets"]
