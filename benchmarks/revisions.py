"""The mixed state saved and loaded by this tree's pytreeckpt and by an earlier revision's, in turns.

    python -m benchmarks.revisions [--before 9da069d] [--rounds 4] [--mixed-gib 0.5]

Issue 18 asks the mixed state (``small.mixed_state``: a 1B-class model's 300 weights, its
AdamW state and 1,000 small values) to be "no worse than today", the code it was filed
against. Ratios to other tools cannot tell that across runs: safetensors' own cold load of
this state took 0.83 s in one run and 1.31-1.63 s in later ones. So both versions run here,
side by side: the earlier one from a ``git worktree`` of ``--before``, this tree's from its
``src/``. Each round runs one process per version (in a new order each round, seeded); a
process builds the state, saves it once untimed (the first save of a tree in a process
describes it in full; training saves after that), then times one save (until durable, as
every pytreeckpt save) and one load from a cold page cache where the machine lets us
drop it (root), warm otherwise. The result: each version's median seconds and this tree's
over the earlier one's, as the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks._common import round_ratios

ROOT = Path(__file__).resolve().parent.parent
BEFORE = "9da069d"
"""The last commit before issue 18's work began (its first, 1d285ea, added ``load(..., inplace=True)``)."""


def _child(src: str, workdir: Path, gib: float, cold: bool) -> dict[str, Any]:
    """In a process whose ``pytreeckpt`` is ``src``'s: the mixed state's save and load, timed."""
    import warnings

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import pytreeckpt

    here = Path(pytreeckpt.__file__).resolve()
    if not here.is_relative_to(Path(src).resolve()):
        raise RuntimeError(f"pytreeckpt was imported from {here}, not from {src}")
    from benchmarks._common import drop_caches, nbytes_of
    from benchmarks.small import _flat, mixed_state

    state = mixed_state(gib)
    nbytes = nbytes_of(_flat(state))  # (its tensors' bytes, as run_mixed counts them)
    pytreeckpt.save(workdir / "first", state)  # (untimed: the first save of the tree in the process)
    shutil.rmtree(workdir / "first")
    os.sync()
    t0 = time.perf_counter()
    pytreeckpt.save(workdir / "ckpt", state)
    save = time.perf_counter() - t0  # (a save returns once its files are durable)
    cold = cold and drop_caches()
    t0 = time.perf_counter()
    pytreeckpt.load(workdir / "ckpt")
    load = time.perf_counter() - t0
    shutil.rmtree(workdir / "ckpt")
    return {"save": save, "load": load, "cold": cold, "bytes": nbytes}


def _worktree(rev: str, where: Path) -> Path:
    """A checkout of ``rev`` at ``where`` (RuntimeError, with git's words, where there is none to make)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--force", str(where), rev],
            capture_output=True,
            text=True,
        )
    except OSError as e:  # (no git)
        raise RuntimeError(f"cannot check out {rev}: {e}") from e
    if out.returncode != 0:
        raise RuntimeError(f"cannot check out {rev} of {ROOT}: {out.stderr.strip()}")
    return where


def _run_child(src: Path, workdir: Path, gib: float, cold: bool) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "src"), str(ROOT)]))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.revisions",
            "--child",
            str(src),
            "--workdir",
            str(workdir),
            "--mixed-gib",
            str(gib),
            *([] if cold else ["--warm"]),
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"the run of {src} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run(
    before: str = BEFORE, rounds: int = 4, gib: float = 0.5, workdir: Path | None = None, cold: bool = True
) -> dict[str, Any]:
    """Both versions' times over ``rounds`` rounds, and this tree's over ``before``'s (median of the rounds' ratios).

    With ``cold``, each load starts from an empty page cache where the machine lets us drop it.
    RuntimeError where ``before`` cannot be checked out or a run fails.
    """
    tmp = Path(tempfile.mkdtemp(prefix="pytreeckpt-revisions-"))
    work = workdir or tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    tree = tmp / "before"
    try:
        _worktree(before, tree)
        versions = {"before": tree, "now": ROOT}
        times: dict[str, list[dict[str, Any]]] = {name: [] for name in versions}
        for r in range(rounds):
            names = list(versions)
            random.Random(r).shuffle(names)
            for name in names:
                times[name].append(_run_child(versions[name], work, gib, cold))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = {
        op: round_ratios([t[op] for t in times["now"]], [t[op] for t in times["before"]]) for op in ("save", "load")
    }
    return {
        "before": before,
        "bytes": times["now"][0]["bytes"],
        "rounds": times,
        "seconds": {
            f"{name} {op}": statistics.median(t[op] for t in ts)
            for name, ts in times.items()
            for op in ("save", "load")
        },
        "ratios": ratios,
        "ratio": {op: statistics.median(r) for op, r in ratios.items()},
        "cold": all(t["cold"] for ts in times.values() for t in ts),
    }


def targets(r: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """Issue 18's "no worse than today" for the mixed state: this tree against the revision before the issue's work."""
    load = "cold load" if r["cold"] else "load (warm)"
    rev = r["before"]
    return [
        (
            f"pytreeckpt save time / at {rev} (before issue 18), median of the rounds' ratios",
            r["ratio"]["save"],
            "<=",
            1.0,
        ),
        (
            f"pytreeckpt {load} time / at {rev} (before issue 18), median of the rounds' ratios",
            r["ratio"]["load"],
            "<=",
            1.0,
        ),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--before", default=BEFORE, help="the earlier revision (a commit of this repository)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--mixed-gib", type=float, default=0.5)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--warm", action="store_true", help="loads from the page cache as it is (no drop)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.workdir, args.mixed_gib, not args.warm)))
        return
    r = run(args.before, args.rounds, args.mixed_gib, args.workdir, not args.warm)
    print(json.dumps(r, indent=2))
    for name, value, op, bound in targets(r):
        print(f"{name}: {value:.2f} ({op} {bound})")


if __name__ == "__main__":
    main()
