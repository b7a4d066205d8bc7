"""pytreeckpt quickstart: train, save, async-save, and load into another layout.

A tiny byte-level language model trains on the source of Python's ``json`` module.
Its state (model, AdamW moments, step, RNG, data position) is a pytree; the
parameters are laid out as if on 4 ranks (2-way data parallel x 2-way tensor parallel)
and the optimizer moments as FSDP1-style flat ranges. We save it, save it again
asynchronously while training goes on, then load it into a 3-rank layout and into
plain tensors, and check that resumed training continues exactly where it left off.

Run: python examples/quickstart.py [--dir DIR]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import pytreeckpt
from pytreeckpt import Abstract, FlatRanges, Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec

torch.manual_seed(0)
DATA = torch.tensor(list(inspect.getsource(json.decoder).encode()), dtype=torch.long)
CONTEXT, BATCH = 32, 16


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(CONTEXT * dim, 4 * dim)
        self.norm = nn.LayerNorm(4 * dim)
        self.head = nn.Linear(4 * dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(1)
        return self.head(torch.relu(self.norm(self.mix(h))))


def batch(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = (position * BATCH + torch.arange(BATCH) * 97) % (len(DATA) - CONTEXT - 1)
    x = torch.stack([DATA[s : s + CONTEXT] for s in starts.tolist()])
    y = DATA[starts + CONTEXT]
    return x, y


def train(model: nn.Module, opt: torch.optim.Optimizer, position: int, steps: int) -> tuple[int, float]:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        x, y = batch(position)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        position += 1
    return position, loss.item()


def flat_ranges(numel: int, ranks: int) -> FlatRanges:
    per = math.ceil(numel / ranks)
    return FlatRanges([(min(r * per, numel), min((r + 1) * per, numel)) for r in range(ranks)])


def sharded_state(model: nn.Module, opt: torch.optim.Optimizer, position: int) -> dict:
    """The training state as 4 ranks would hold it: TP-sharded weights, flat-sharded moments."""
    mesh = Mesh((2, 2), ("dp", "tp"))
    params = {}
    for name, p in model.state_dict().items():
        spec = ShardingSpec(mesh, [Replicate(), Shard(0)])
        params[name] = ShardedLeaf.from_global(p, spec)
    optim = opt.state_dict()
    optim["state"] = {
        i: {
            k: ShardedLeaf.from_global(v, flat_ranges(v.numel(), 4)) if k.startswith("exp_avg") else v
            for k, v in st.items()
        }
        for i, st in optim["state"].items()
    }
    return {"model": params, "optim": optim, "data_position": position, "rng": torch.get_rng_state()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write checkpoints (default: a temp dir)")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="pytreeckpt-quickstart-"))
    # Step 4 compares losses bit for bit, so the arithmetic must not depend on how many threads
    # a matmul gets (MKL may pick fewer while the async save writes behind the training).
    torch.set_num_threads(1)

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    position, loss = train(model, opt, 0, 20)
    print(f"trained 20 steps on {len(DATA):,} bytes of json/decoder.py source: loss {loss:.3f}")

    # 1. A blocking save of the 4-rank layout.
    state = sharded_state(model, opt, position)
    t0 = time.perf_counter()
    pytreeckpt.save(root / "step_20", state, overwrite=True)
    meta = pytreeckpt.metadata(root / "step_20")
    print(
        f"saved step 20: {len(meta.arrays)} arrays, {meta.nbytes / 2**20:.2f} MiB in {time.perf_counter() - t0:.3f} s "
        f"-> {root / 'step_20'}"
    )

    # 2. An asynchronous save: the call returns after the snapshot; training goes on.
    position, loss = train(model, opt, position, 10)
    state = sharded_state(model, opt, position)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    handle = pytreeckpt.async_save(root / "step_30", state, overwrite=True)
    stall = handle.timings["snapshot"]
    _, original_loss = train(model, opt, position, 5)  # mutates the live state meanwhile
    handle.wait()
    print(
        f"async-saved step 30: the caller was blocked {stall * 1e3:.1f} ms (snapshot); write "
        f"{handle.timings['write']:.3f} s and commit {handle.timings['commit'] * 1e3:.1f} ms ran behind "
        f"5 more training steps"
    )

    # 3. Load step 30 into another layout: 3 ranks sharding dim 1 (dim 0 for vectors).
    mesh3 = Mesh(3, ("tp",))
    target = {
        "model": {
            k: Abstract(v.shape, v.dtype, ShardingSpec(mesh3, [Shard(1 if v.dim() > 1 else 0)]))
            for k, v in expected.items()
        },
    }
    t0 = time.perf_counter()
    # (strict=False: the model alone, of a checkpoint that holds the optimizer and more)
    resharded = pytreeckpt.load(root / "step_30", target, strict=False)
    print(f"loaded step 30 into a 3-rank layout in {time.perf_counter() - t0:.3f} s")
    for k, v in resharded["model"].items():
        assert set(v.shards) == {0, 1, 2}
        assert torch.equal(v.to_global(), expected[k]), k
    print("  every parameter equals the state at the moment of the async save, not the state after it")

    # 4. Resume into a fresh model and optimizer from plain tensors: training continues exactly.
    restored = pytreeckpt.load(root / "step_30")
    resumed = TinyLM()
    resumed.load_state_dict(restored["model"])
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
    resumed_opt.load_state_dict(restored["optim"])
    torch.set_rng_state(restored["rng"])
    _, resumed_loss = train(resumed, resumed_opt, restored["data_position"], 5)
    assert resumed_loss == original_loss, (resumed_loss, original_loss)
    print(
        f"resumed at data position {restored['data_position']}: 5 steps later the loss is {resumed_loss:.6f}, "
        f"bit-identical to the uninterrupted run"
    )
    files = sum(1 for p in (root / "step_30").rglob("*") if p.is_file())
    print(f"step_30 holds {files} files; each array is a zarr v3 array that plain tensorstore opens")


if __name__ == "__main__":
    main()
