"""Simulated training states at scale: Llama-style models under real parallel layouts, as plain specs.

Nothing here allocates a tensor: a state is a list of :class:`~pytreeckpt._piece_table.ArraySpec`
(key path, global shape, element size, layout, and the world ranks the layout's mesh
sits on), which is all the planning layer needs. Used by ``benchmarks/plan_scale.py``
and by the tests that check plan invariants on simulated layouts.

Layouts:

- ``"tp_pp_dp"``: Megatron-style tensor x pipeline x data parallelism with a ZeRO-1
  distributed optimizer. Ranks are numbered ``((stage * dp) + d) * tp + t``. A layer's
  tensors live on the ``dp x tp`` ranks of its pipeline stage; bf16 parameters are split
  by TP and replicated over DP; the fp32 master weights and both AdamW moments are split
  by TP and further by DP.
- ``"fsdp_tp"``: 2D FSDP2 x TP DTensors on a ``(dp, tp)`` mesh of the whole world, with
  torch's ``_StridedShard`` where both axes split one dimension.
- ``"fsdp1"``: FSDP1 flat parameters: each transformer block (and the embedding, and the
  head) is one unit whose flattened parameters are padded and cut into equal flat ranges,
  one per rank; every tensor of the unit is then a :class:`~pytreeckpt.FlatRanges` leaf.

>>> arrays = llama_state("8b", "tp_pp_dp", world=64, tp=8, pp=4)
>>> len(arrays), arrays[0].key, arrays[0].shape
(1164, 'model.tok_embeddings.weight', (128256, 4096))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pytreeckpt.core._errors import LayoutError
from pytreeckpt.core._sharding import FlatRanges, Layout, Mesh, Placement, Replicate, Shard, ShardingSpec, StridedShard
from pytreeckpt.plan import ArraySpec

__all__ = ["MODELS", "LlamaConfig", "llama_params", "llama_state"]


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The shapes of a Llama-3-style decoder."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 128256

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * self.kv_heads


MODELS = {
    "8b": LlamaConfig(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336),
    "70b": LlamaConfig(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672),
    "405b": LlamaConfig(dim=16384, layers=126, heads=128, kv_heads=8, ffn=53248),
}

# The dimension tensor parallelism splits: 0 for column-parallel weights (and the
# vocabulary-parallel embedding and head), 1 for row-parallel ones; None: replicated.
_TP_DIM: dict[str, int | None] = {
    "attention.wq": 0,
    "attention.wk": 0,
    "attention.wv": 0,
    "attention.wo": 1,
    "feed_forward.w1": 0,
    "feed_forward.w3": 0,
    "feed_forward.w2": 1,
    "attention_norm": None,
    "ffn_norm": None,
}


def llama_params(model: str | LlamaConfig) -> list[tuple[str, tuple[int, ...], int | None, int]]:
    """Every parameter as ``(key, shape, tp_dim, unit)``; ``unit`` is the block (-1 embedding, layers: head).

    >>> llama_params("8b")[1][:2]
    ('layers.0.attention.wq.weight', (4096, 4096))
    """
    cfg = MODELS[model] if isinstance(model, str) else model
    d, kv, f = cfg.dim, cfg.kv_dim, cfg.ffn
    shapes = {
        "attention.wq": (d, d),
        "attention.wk": (kv, d),
        "attention.wv": (kv, d),
        "attention.wo": (d, d),
        "feed_forward.w1": (f, d),
        "feed_forward.w3": (f, d),
        "feed_forward.w2": (d, f),
        "attention_norm": (d,),
        "ffn_norm": (d,),
    }
    out: list[tuple[str, tuple[int, ...], int | None, int]] = [("tok_embeddings.weight", (cfg.vocab, d), 0, -1)]
    for i in range(cfg.layers):
        for name, shape in shapes.items():
            out.append((f"layers.{i}.{name}.weight", shape, _TP_DIM[name], i))
    out.append(("norm.weight", (d,), None, cfg.layers))
    out.append(("output.weight", (cfg.vocab, d), 0, cfg.layers))
    return out


# The state: bf16 parameters, then the fp32 master weights and the two AdamW moments.
_STATE = (("model", 2), ("optim.master", 4), ("optim.exp_avg", 4), ("optim.exp_avg_sq", 4))


def llama_state(
    model: str | LlamaConfig, layout: str, world: int, *, tp: int = 8, pp: int = 1, optimizer: bool = True
) -> list[ArraySpec]:
    """Every array of a Llama training state in a parallel layout.

    Args:
      model: ``"8b"``, ``"70b"``, ``"405b"`` or a :class:`LlamaConfig`.
      layout: ``"tp_pp_dp"``, ``"fsdp_tp"`` or ``"fsdp1"`` (module docstring).
      world: ranks; ``tp * pp`` must divide it (``tp_pp_dp``), ``tp`` must (``fsdp_tp``).
      tp, pp: tensor- and pipeline-parallel degrees (``pp`` only for ``tp_pp_dp``).
      optimizer: include the fp32 master weights and AdamW moments; else bf16 parameters only.
    """
    cfg = MODELS[model] if isinstance(model, str) else model
    params = llama_params(cfg)
    kinds = _STATE if optimizer else _STATE[:1]
    if layout == "tp_pp_dp":
        if world % (tp * pp):
            raise LayoutError(f"a world of {world} ranks is not divisible into tp={tp} x pp={pp}")
        dp = world // (tp * pp)
        per_stage = dp * tp
        stages = _stage_of_units(cfg.layers, pp)
        stage_ranks = [range(s * per_stage, (s + 1) * per_stage) for s in range(pp)]
        out = []
        for prefix, itemsize in kinds:
            sharded_opt = prefix != "model"
            for key, shape, tp_dim, unit in params:
                stage = stages[unit]
                spec = _megatron_spec(shape, tp_dim, dp, tp, sharded_opt)
                ranks = stage_ranks[stage]
                out.append(ArraySpec(f"{prefix}.{key}", shape, itemsize, spec, None if pp == 1 else ranks))
        return out
    if layout == "fsdp_tp":
        if world % tp:
            raise LayoutError(f"a world of {world} ranks is not divisible by tp={tp}")
        dp = world // tp
        mesh = Mesh((dp, tp), ("dp", "tp"))
        shared: dict[tuple[Placement, ...], Layout] = {}
        specs = {}
        for key, shape, tp_dim, _ in params:
            placements = tuple(_fsdp_tp_placements(shape, tp_dim, tp))
            specs[key] = shared.setdefault(placements, ShardingSpec(mesh, placements))
        return [
            ArraySpec(f"{prefix}.{key}", shape, itemsize, specs[key], None)
            for prefix, itemsize in kinds
            for key, shape, _, _ in params
        ]
    if layout == "fsdp1":
        flat = _fsdp1_layouts(params, world)
        return [
            ArraySpec(f"{prefix}.{key}", shape, itemsize, flat[key], None)
            for prefix, itemsize in kinds
            for key, shape, _, _ in params
        ]
    raise LayoutError(f"unknown layout {layout!r}: expected 'tp_pp_dp', 'fsdp_tp' or 'fsdp1'")


def _stage_of_units(layers: int, pp: int) -> dict[int, int]:
    """Pipeline stage of each unit: blocks split like torch.chunk, the embedding first, the head last."""
    per = -(-layers // pp)
    stages = {i: min(i // per, pp - 1) for i in range(layers)}
    stages[-1] = 0
    stages[layers] = pp - 1
    return stages


@functools.lru_cache(maxsize=256)
def _megatron_spec(shape: tuple[int, ...], tp_dim: int | None, dp: int, tp: int, sharded: bool) -> Layout:
    mesh = Mesh((dp, tp), ("dp", "tp"))
    tp_p: Placement = Replicate() if tp_dim is None else Shard(tp_dim)
    if not sharded:
        return ShardingSpec(mesh, [Replicate(), tp_p])
    # ZeRO-1: the optimizer state is split over DP too, along the other dimension.
    dp_dim = 0 if tp_dim is None or len(shape) == 1 else 1 - tp_dim
    return ShardingSpec(mesh, [Shard(dp_dim), tp_p])


def _fsdp_tp_placements(shape: tuple[int, ...], tp_dim: int | None, tp: int) -> list[Placement]:
    if tp_dim is None:
        return [Shard(0), Replicate()]
    if tp_dim == 0:  # FSDP2 over TP on the same dimension: torch's _StridedShard
        return [StridedShard(0, tp), Shard(0)]
    return [Shard(0), Shard(tp_dim)]


def _fsdp1_layouts(params: Sequence[tuple[str, tuple[int, ...], int | None, int]], world: int) -> dict[str, Layout]:
    units: dict[int, list[tuple[str, int]]] = {}
    for key, shape, _, unit in params:
        units.setdefault(unit, []).append((key, math.prod(shape)))
    out: dict[str, Layout] = {}
    for members in units.values():
        total = sum(n for _, n in members)
        per_rank = -(-total // world)
        start = 0
        for key, n in members:
            ranges = [(0, 0)] * world
            for r in range(start // per_rank, min(world, -(-(start + n) // per_rank))):
                a, b = max(start, r * per_rank), min(start + n, (r + 1) * per_rank)
                if a < b:
                    ranges[r] = (a - start, b - start)
            out[key] = FlatRanges(ranges)
            start += n
    return out
