"""Worker functions run on several gloo ranks by tests/test_hf.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import pytreeckpt


def config() -> Any:
    """A tiny Llama: 2 layers, hidden size 64, about 420 KB of float32 weights."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )


def model(seed: int) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config())


def _imported() -> None:
    """Import what a load imports on first use (module files are read too, which the byte counts must not see)."""
    import pytreeckpt.distributed._dtensor
    import pytreeckpt.execute._cast
    import pytreeckpt.interop._st_load  # noqa: F401


def bytes_read() -> int:
    """The bytes this process has read through read system calls so far (``rchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def export(rank: int, world: int, ckpt: str, out: str) -> dict[str, Any]:
    """Every rank exports its share of the checkpoint's model; the bytes it read doing so, and the error every
    rank raises when rank 1 cannot write."""
    # a first export of one small tensor imports what an export imports (module files are read too)
    pytreeckpt.export_safetensors(ckpt, f"{out}-warm-{rank}", include="model.model.norm.weight")
    before = bytes_read()
    pytreeckpt.export_safetensors(
        ckpt, out, include=["model.*"], rename=lambda k: k.removeprefix("model."), max_shard_size="60KB"
    )
    read = bytes_read() - before
    # a rank that cannot write (its directory is under a file) fails the export on every rank
    where = f"{out}-ok" if rank == 0 else f"{out}-blocked/sub"
    try:
        pytreeckpt.export_safetensors(ckpt, where, include=["model.*"], max_shard_size="60KB")
    except pytreeckpt.CheckpointError as e:
        return {"read": read, "error": str(e)}
    return {"read": read, "error": None}


def load_fsdp(rank: int, world: int, src: str) -> dict[str, Any]:
    """An FSDP2-sharded Llama of other weights, loaded from ``save_pretrained``'s files; its full weights, the
    bytes this rank read and the bytes of its shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    m = model(seed=1)
    mesh = init_device_mesh("cpu", (world,))
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    header = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in Path(src).glob("*.safetensors"))
    _imported()
    before = bytes_read()
    report = pytreeckpt.LoadReport()
    pytreeckpt.load_safetensors(src, m, report=report)
    read = bytes_read() - before
    local = sum(p.to_local().numel() * p.element_size() for p in m.parameters())
    full = {k: v.full_tensor() for k, v in m.state_dict().items()}
    # a tensor-parallel style target, sharded on its last dim: each rank reads its columns, row by row
    columns = {"lm_head.weight": distribute_tensor(torch.zeros(256, 64), mesh, [Shard(1)])}
    before = bytes_read()
    pytreeckpt.load_safetensors(src, columns, strict=False)
    return {
        "full": full,
        "read": read,
        "local": local,
        "header": header,
        "missing": report.missing,
        "columns": columns["lm_head.weight"].full_tensor(),
        "columns_read": bytes_read() - before,
    }
