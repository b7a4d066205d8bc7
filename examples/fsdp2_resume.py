"""Train a small transformer with FSDP2, checkpoint it, and resume at another world size.

    torchrun --nproc-per-node 4 examples/fsdp2_resume.py --dir /tmp/fsdp2-ckpt --steps 20
    torchrun --nproc-per-node 2 examples/fsdp2_resume.py --dir /tmp/fsdp2-ckpt --steps 10

The first run trains from scratch and saves every ``--save-every`` steps; the second
finds the newest checkpoint, loads it into its own FSDP2 layout (2 ranks instead of 4:
pytreeckpt reshards at load time) and goes on. Runs on CPU with gloo, or on GPUs with
NCCL when CUDA is available. Data: the source text of Python's standard library
modules, tokenised as bytes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import textwrap
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import pytreeckpt

SEQ, BATCH = 64, 8
TEXT = torch.tensor(list("".join(inspect.getsource(m) for m in (json, textwrap, argparse)).encode()), dtype=torch.long)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ByteTransformer(nn.Module):
    def __init__(self, dim: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.pos = nn.Parameter(torch.zeros(SEQ, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch * seq, 256)."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        # The head on rows of a 2-d input: on a 3-d input, nn.Linear returns a view of its
        # 2-d result, and FSDP2 warns about a module returning a view (an in-place op on it
        # would skip FSDP2's pre-backward hook).
        return self.head(self.norm(x).flatten(0, 1))


def batch(step: int, rank: int, world: int, device: torch.device) -> torch.Tensor:
    """This rank's slice of the global batch of ``step``: the same global batch at any world size."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(0, len(TEXT) - SEQ - 1, (BATCH,), generator=g)
    rows = torch.stack([TEXT[s : s + SEQ + 1] for s in starts.tolist()])
    return rows[rank::world].to(device)


def latest(directory: Path) -> Path | None:
    """The newest committed checkpoint in ``directory`` (uncommitted ones are skipped)."""
    steps = []
    for p in directory.glob("step_*"):
        try:
            pytreeckpt.metadata(p)
        except pytreeckpt.CheckpointError:
            continue
        steps.append((int(p.name.split("_")[1]), p))
    return max(steps)[1] if steps else None


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP2 training with pytreeckpt checkpoints")
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20, help="steps to train in this run")
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))

    torch.manual_seed(0)
    model = ByteTransformer().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = 0
    found = latest(args.dir)
    if found is not None:
        t0 = time.perf_counter()
        # The model and optimizer are restored in place, resharded into this run's FSDP2
        # layout; in place, the stored values land in the model's own sharded parameters,
        # with no second copy of the state.
        state = pytreeckpt.load(found, {"model": model, "optim": opt, "step": 0}, inplace=True)
        start = state["step"]
        saved_world = pytreeckpt.metadata(found).user_metadata.get("world_size")
        if rank == 0:
            print(
                f"resumed {found.name} (saved by {saved_world} ranks) on {world} ranks in "
                f"{time.perf_counter() - t0:.2f} s"
            )

    handle = None
    loss = torch.tensor(0.0)
    for step in range(start, start + args.steps):
        tokens = batch(step, rank, world, device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        done = step + 1
        if done % args.save_every == 0 or done == start + args.steps:
            state = {"model": model, "optim": opt, "step": done}
            # Returns once the state is copied; writing overlaps the next training steps.
            handle = pytreeckpt.async_save(
                args.dir / f"step_{done}", state, overwrite=True, user_metadata={"world_size": world}
            )
            if rank == 0:
                print(
                    f"step {done}: loss {loss.item():.4f}; saving, training stalled "
                    f"{handle.timings['snapshot'] * 1e3:.1f} ms"
                )
    if handle is not None:
        handle.wait()
    if rank == 0:
        print(f"done at step {start + args.steps}; checkpoints in {args.dir}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
