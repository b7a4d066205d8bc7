"""Planning at scale on simulated Llama layouts: invariants checked exactly, the plan cache, rank parts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pytreeckpt._llama import MODELS, LlamaConfig, llama_state
from pytreeckpt._plan import ChunkingOptions, LoadPlan, plan_load, plan_save
from pytreeckpt._plan_cache import PlanCache, cached_plan_save, plan_save_fast, spec_plan_key
from pytreeckpt._plan_check import check_load, check_save
from pytreeckpt._plan_load_table import ArrayLoadTable, load_rank_part, plan_load_rank, plan_load_tables
from pytreeckpt._plan_table import clear_caches, plan_save_rank, plan_save_tables, rank_part

TINY = LlamaConfig(dim=512, layers=4, heads=8, kv_heads=2, ffn=1536, vocab=1000)
LAYOUTS = [("tp_pp_dp", {"tp": 4, "pp": 2}), ("fsdp_tp", {"tp": 4}), ("fsdp1", {})]


def test_llama_shapes_are_the_real_ones() -> None:
    arrays = llama_state("405b", "tp_pp_dp", 16384, tp=8, pp=16)
    assert len(arrays) == 4 * (126 * 9 + 3)
    numel = sum(int(np.prod(a.shape)) for a in arrays if a.key.startswith("model."))
    assert 405e9 < numel < 406e9
    assert MODELS["70b"].kv_dim == 1024
    # a layer's tensors live on the ranks of its pipeline stage
    assert {a.ranks for a in arrays if ".layers.0." in a.key} == {range(1024)}
    assert {a.ranks for a in arrays if ".layers.125." in a.key} == {range(15 * 1024, 16 * 1024)}


@pytest.mark.parametrize(("layout", "kw"), LAYOUTS)
def test_tables_equal_the_reference_plan_on_llama_layouts(layout: str, kw: dict[str, int]) -> None:
    arrays = llama_state(TINY, layout, 16, **kw)
    want = plan_save([a.array_layout(16) for a in arrays], 16)
    tables = plan_save_tables(arrays, 16)
    assert [t.to_plan() for t in tables] == list(want.arrays)
    for rank in (0, 5, 15):
        clear_caches()
        assert plan_save_rank(arrays, 16, rank) == rank_part(tables, 16, rank)


@pytest.mark.parametrize(("model", "layout", "world", "kw"), [
    ("8b", "tp_pp_dp", 64, {"tp": 8, "pp": 2}),
    (TINY, "tp_pp_dp", 512, {"tp": 8, "pp": 4}),
    (TINY, "fsdp_tp", 512, {"tp": 8}),
    (TINY, "fsdp1", 256, {}),
])  # fmt: skip
def test_save_and_load_invariants_hold_at_scale(
    model: str | LlamaConfig, layout: str, world: int, kw: dict[str, int]
) -> None:
    arrays = llama_state(model, layout, world, **kw)
    tables = plan_save_tables(arrays, world)
    assert check_save(arrays, tables, world) == []
    # resharded onto half the ranks, and onto 8 ranks for evaluation
    chunks = {t.key: t.chunk_shape for t in tables}
    for t_world, t_layout, t_kw, optimizer in [
        (world // 2, layout, {k: max(1, v // 2) for k, v in kw.items()}, True),
        (8, "tp_pp_dp", {"tp": 8, "pp": 1}, False),
    ]:
        targets = llama_state(model, t_layout, t_world, optimizer=optimizer, **t_kw)
        stored = [chunks[t.key] for t in targets]
        loads = plan_load_tables(stored, targets, t_world)
        assert check_load(targets, stored, loads, t_world) == []
        assert plan_load_rank(stored, targets, t_world, 1) == load_rank_part(loads, t_world, 1)


def test_the_checks_catch_a_chunk_written_twice_and_one_never_read() -> None:
    arrays = llama_state(TINY, "tp_pp_dp", 16, tp=4, pp=2)
    tables = plan_save_tables(arrays, 16)
    i = next(i for i, t in enumerate(tables) if len(t) > 1)
    t = tables[i]
    twice = dataclasses.replace(t, offset=np.concatenate([t.offset[:1], t.offset[:-1]]))
    problems = check_save(arrays, [*tables[:i], twice, *tables[i + 1 :]], 16)
    assert problems
    assert all(f"leaf {t.key!r}" in p for p in problems)
    assert "1 written twice" in problems[0]
    targets = llama_state(TINY, "tp_pp_dp", 8, tp=2, pp=2)
    stored = [tables[[a.key for a in arrays].index(s.key)].chunk_shape for s in targets]
    loads = plan_load_tables(stored, targets, 8)
    j = next(j for j, ld in enumerate(loads) if isinstance(ld, ArrayLoadTable) and len(ld) > 1)
    short = loads[j]
    assert isinstance(short, ArrayLoadTable)
    short = dataclasses.replace(short, rows=short.rows[1:], reader=short.reader[1:])
    assert check_load(targets, stored, [*loads[:j], short, *loads[j + 1 :]], 8)


def test_load_tables_equal_the_reference_on_a_reshard() -> None:
    src = llama_state(TINY, "tp_pp_dp", 16, tp=4, pp=2)
    chunks = {t.key: t.chunk_shape for t in plan_save_tables(src, 16)}
    targets = llama_state(TINY, "fsdp1", 8)
    stored = [(t.key, t.shape, t.itemsize, chunks[t.key]) for t in targets]
    want = plan_load(stored, [t.array_layout(8).pieces for t in targets], 8)
    tables = plan_load_tables([chunks[t.key] for t in targets], targets, 8)
    assert LoadPlan(8, tuple(t.to_plan() if isinstance(t, ArrayLoadTable) else t for t in tables)) == want


def test_a_save_in_the_same_layouts_reuses_its_plan() -> None:
    arrays = llama_state(TINY, "tp_pp_dp", 16, tp=4, pp=2)
    layouts = [a.array_layout(16) for a in arrays]
    cache = PlanCache(2)
    first = cached_plan_save(layouts, 16, None, cache)
    again = cached_plan_save([a.array_layout(16) for a in arrays], 16, None, cache)  # equal, not identical
    assert again is first
    assert (cache.hits, cache.misses) == (1, 1)
    assert first == plan_save_fast(layouts, 16) == plan_save(layouts, 16)
    other = cached_plan_save(layouts, 16, ChunkingOptions(max_chunk_bytes=1 << 20), cache)
    assert other is not first
    assert cache.misses == 2
    cached_plan_save(layouts[:3], 16, None, cache)  # a third plan evicts the least recently used
    cached_plan_save(layouts, 16, None, cache)
    assert cache.misses == 4


def test_spec_plan_keys_are_equal_exactly_when_the_layouts_are() -> None:
    a = llama_state(TINY, "tp_pp_dp", 16, tp=4, pp=2)
    b = llama_state(TINY, "tp_pp_dp", 16, tp=4, pp=2)
    assert spec_plan_key(a, 16) == spec_plan_key(b, 16)
    assert spec_plan_key(a, 16) != spec_plan_key(a, 32)
    c = llama_state(TINY, "tp_pp_dp", 16, tp=2, pp=2)
    assert spec_plan_key(a, 16) != spec_plan_key(c, 16)
    d = [*a[:-1], dataclasses.replace(a[-1], ranks=range(8))]
    assert spec_plan_key(a, 16) != spec_plan_key(d, 16)
