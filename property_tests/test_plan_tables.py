"""The planning tables equal the reference planner; a rank's own part equals its part of the global plan."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt import ChunkingOptions
from pytreeckpt._plan import ArrayLayout, LoadPlan, plan_load, plan_save
from pytreeckpt._plan_cache import plan_save_fast
from pytreeckpt._plan_check import check_load, check_save
from pytreeckpt._plan_load_table import ArrayLoadTable, load_rank_part, plan_load_rank, plan_load_tables
from pytreeckpt._plan_table import ArraySpec, clear_caches, piece_table, plan_save_rank, plan_save_tables, rank_part
from pytreeckpt.testing import chunking_options, shapes, specs

Inputs = tuple[list[ArraySpec], int, ChunkingOptions | None]


@st.composite
def placed_specs(draw: st.DrawFn, complete: bool = True) -> Inputs:
    """Up to four arrays in random layouts, each placed on a random run of ranks of a larger world."""
    arrays = []
    for i in range(draw(st.integers(1, 4))):
        shape = draw(shapes(max_side=9))
        layout = draw(specs(shape, complete=complete))
        offset = draw(st.integers(0, 3))
        ranks = None if offset == 0 else range(offset, offset + layout.world_size)
        arrays.append(ArraySpec(f"a{i}", shape, draw(st.sampled_from([1, 2, 4])), layout, ranks))
    world = max(a.layout.world_size + (a.ranks.start if a.ranks else 0) for a in arrays) + draw(st.integers(0, 2))
    return arrays, world, draw(chunking_options())


@given(st.data())
def test_piece_tables_hold_the_regions_of_rank_pieces(data: st.DataObject) -> None:
    shape = data.draw(shapes(max_side=9))
    layout = data.draw(specs(shape, complete=False))
    want = [tuple(p.region for p in ps) for ps in layout.rank_pieces(shape)]
    got = [tuple(p.region for p in ps) for ps in piece_table(layout, shape).pieces()]
    assert got == want


@given(placed_specs())
def test_the_tables_plan_exactly_what_plan_save_plans(inputs: Inputs) -> None:
    arrays, world, options = inputs
    layouts = [a.array_layout(world) for a in arrays]
    want = plan_save(layouts, world, options)
    assert plan_save_fast(layouts, world, options) == want
    tables = plan_save_tables(arrays, world, options)
    assert [t.to_plan() for t in tables] == list(want.arrays)
    assert check_save(arrays, tables, world) == []


@given(placed_specs(), st.data())
def test_a_ranks_own_part_equals_its_part_of_the_global_plan(inputs: Inputs, data: st.DataObject) -> None:
    arrays, world, options = inputs
    tables = plan_save_tables(arrays, world, options)
    for rank in sorted({0, world - 1, data.draw(st.integers(0, world - 1))}):
        clear_caches()
        assert plan_save_rank(arrays, world, rank, options) == rank_part(tables, world, rank)


@given(placed_specs(), placed_specs(), st.data())
def test_a_ranks_writes_do_not_depend_on_arrays_it_holds_nothing_of(
    inputs: Inputs, others: Inputs, data: st.DataObject
) -> None:
    # Balancing is per scope (the ranks able to take a chunk); every scope deciding a rank's
    # writes contains the rank, so arrays the rank holds no piece of cannot move its writes.
    arrays, world, options = inputs
    rank = data.draw(st.integers(0, world - 1))
    foreign = []
    for a in others[0]:
        ranks = a.rank_array().tolist()
        if rank not in ranks and max(ranks, default=0) < world:
            foreign.append(ArraySpec(f"x{a.key}", a.shape, a.itemsize, a.layout, a.ranks))
    mixed = list(arrays)
    for f in foreign:
        mixed.insert(data.draw(st.integers(0, len(mixed))), f)
    alone = plan_save_rank(arrays, world, rank, options).arrays
    together = {a.key: a for a in rank_part(plan_save_tables(mixed, world, options), world, rank).arrays}
    assert [together[a.key] for a in alone] == list(alone)
    assert all(not together[f.key].writes for f in foreign)


@given(placed_specs(), st.data())
def test_load_tables_equal_plan_load_and_a_ranks_part_its_part(inputs: Inputs, data: st.DataObject) -> None:
    arrays, world, options = inputs
    chunks = [t.chunk_shape for t in plan_save_tables(arrays, world, options)]
    targets = []
    for a in arrays:
        layout = data.draw(specs(a.shape, complete=False))
        targets.append(ArraySpec(a.key, a.shape, a.itemsize, layout))
    t_world = max(t.layout.world_size for t in targets) + data.draw(st.integers(0, 1))
    stored = [(a.key, a.shape, a.itemsize, c) for a, c in zip(arrays, chunks, strict=True)]
    want = plan_load(stored, [t.array_layout(t_world).pieces for t in targets], t_world)
    tables = plan_load_tables(chunks, targets, t_world)
    got = LoadPlan(t_world, tuple(t.to_plan() if isinstance(t, ArrayLoadTable) else t for t in tables))
    assert got == want
    assert check_load(targets, chunks, tables, t_world) == []
    rank = data.draw(st.integers(0, t_world - 1))
    assert plan_load_rank(chunks, targets, t_world, rank) == load_rank_part(tables, t_world, rank)


def test_plan_save_fast_keeps_the_errors_of_plan_save() -> None:
    import pytest

    from pytreeckpt import ExplicitRegions, LayoutError

    gap = ExplicitRegions([[((0, 0), (2, 4))], [((3, 0), (1, 4))]])
    layouts = [ArrayLayout("w", (4, 4), 4, gap.rank_pieces((4, 4)))]
    with pytest.raises(LayoutError, match=r"'w'.*held by no rank"):
        plan_save(layouts, 2)
    with pytest.raises(LayoutError, match=r"'w'.*held by no rank"):
        plan_save_fast(layouts, 2)
