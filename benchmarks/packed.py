"""Many multi-chunk packed leaves: saves and loads stay linear in the leaves and their chunks (issue 44 item 6).

    python -m benchmarks --only packed [--packed 2000 20000] [--packed-leaf-kib 36] [--packed-chunk-kib 12]
    python -m benchmarks.packed [--counts 2000 20000] [--leaf-kib 36] [--chunk-kib 12] [--repeat 5]

Each leaf is one float32 tensor of ``leaf_kib`` KiB saved in chunks of ``chunk_kib`` KiB, so it
is packed (``StorageOptions.pack_max_bytes``, 1 MiB: an entry of the writer's zip archives per
chunk) and has several chunks (3 by default). Issue 44 measured 3,000 leaves of 360 KB in 128 KB
chunks loading in 11.8 s and 22,000 in about 4 minutes: each array's chunk entries were found
by a scan of every entry of the archives. The default shape is that one with a tenth of the
bytes (the same 3 chunks a leaf), so 20,000 leaves (720 MB) fit this machine's memory twice;
``--leaf-kib 360 --chunk-kib 128`` runs the issue's own.

Both counts are saved and loaded by pytreeckpt in the same rounds (in turns, the order shuffled
per round, seeded), each save until durable, each load from a cold page cache where the machine
lets us drop it (root), warm otherwise; the growth is the median of each round's ratio, held to
1.1x the growth in leaves.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

import pytreeckpt

from ._common import can_drop_caches, fresh, growth_rounds

KiB = 1024


def packed_state(count: int, leaf_kib: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` float32 leaves of ``leaf_kib`` KiB each."""
    g = torch.Generator().manual_seed(seed)
    return {f"leaf{i}": torch.randn(leaf_kib * KiB // 4, generator=g) for i in range(count)}


def run(
    counts: tuple[int, int], leaf_kib: int, chunk_kib: int, repeat: int, workdir: Path, cold: bool
) -> dict[str, Any]:
    """pytreeckpt's save and load of ``counts[0]`` and ``counts[1]`` multi-chunk packed leaves, alternated."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    chunk = chunk_kib * KiB
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=chunk, min_chunk_bytes=chunk, max_chunk_bytes=chunk)
    small, big = counts
    states = {"small": packed_state(small, leaf_kib), "big": packed_state(big, leaf_kib, seed=1)}
    paths = {name: workdir / f"packed-{name}" for name in states}

    r = growth_rounds(paths, lambda name: pytreeckpt.save(paths[name], states[name], chunking=chunking), repeat, cold)
    # packed: the chunks are entries of the zip archives, no array has files of its own
    where = paths["small"]
    packed = any((where / "packed").rglob("*.zip")) and not any(f.is_file() for f in (where / "arrays").rglob("*"))
    for p in paths.values():
        fresh(p)()
    return {
        "leaves": [small, big],
        "leaf_bytes": leaf_kib * KiB,
        "chunk_bytes": chunk,
        "chunks_per_leaf": -(-leaf_kib * KiB // chunk),
        "packed": packed,
        "cold": cold,
        **r,
    }


def targets(r: dict[str, Any]) -> list[tuple[str, float, str, float]]:
    """10x the leaves: save and load time grow at most 11x (the median of the rounds' ratios)."""
    small, big = r["leaves"]
    n = big / small
    what = f"{r['chunks_per_leaf']}-chunk packed leaves"
    return [
        (f"save time at {n:g}x the {what} / at 1x", r["growth"]["save"], "<=", 1.1 * n),
        (f"load time at {n:g}x the {what} / at 1x", r["growth"]["load"], "<=", 1.1 * n),
    ]


def table(r: dict[str, Any]) -> list[str]:
    """bench.md's rows: each count's save and load (medians), and the growth."""
    small, big = r["leaves"]
    s = r["seconds"]
    lines = ["| operation | seconds | leaves/s |", "| --- | ---: | ---: |"]
    for name, count in (("small", small), ("big", big)):
        for op in ("save", "load"):
            lines.append(f"| {op} {count} leaves | {s[f'{name} {op}']:.3f} | {count / s[f'{name} {op}']:.0f} |")
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", type=int, nargs=2, default=[2_000, 20_000])
    p.add_argument("--leaf-kib", type=int, default=36)
    p.add_argument("--chunk-kib", type=int, default=12)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="pytreeckpt-packed-") as tmp:
        workdir = args.workdir or Path(tmp)
        r = run(tuple(args.counts), args.leaf_kib, args.chunk_kib, args.repeat, workdir, can_drop_caches())
    print(json.dumps({k: v for k, v in r.items() if k != "rounds"}, indent=2))
    for name, value, op, bound in targets(r):
        print(f"{name}: {value:.2f} ({op} {bound:g})")


if __name__ == "__main__":
    main()


__all__ = ["packed_state", "run", "table", "targets"]
