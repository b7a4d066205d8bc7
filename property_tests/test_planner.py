"""The planner equals the reference oracle: whole plans, one rank's part, every kind of layout and placement."""

from __future__ import annotations

import pytest
from _oracle import array_layout, load_rank_part, rank_part
from _oracle import plan_load as oracle_load
from _oracle import plan_save as oracle_save
from hypothesis import assume, event, given
from hypothesis import strategies as st

from pytreeckpt import ChunkingOptions, Layout, LayoutError
from pytreeckpt.plan import ArraySpec, check_complete, clear_caches, plan_load, plan_save
from pytreeckpt.testing import chunking_options, shapes, specs

Inputs = tuple[list[ArraySpec], int, ChunkingOptions | None]


def _placement(draw: st.DrawFn, n: int) -> range | tuple[int, ...] | None:
    """Where a layout's positions sit: ranks 0..n-1, a run of ranks further on, or ranks in another order."""
    kind = draw(st.sampled_from(["identity", "run", "permuted"]))
    offset = draw(st.integers(0, 3))
    if kind == "identity":
        return None
    if kind == "run":
        return range(offset, offset + n)
    return tuple(offset + r for r in draw(st.permutations(range(n))))


def _world(arrays: list[ArraySpec], extra: int) -> int:
    return max(int(a.rank_array().max()) + 1 for a in arrays) + extra


@st.composite
def placed_specs(draw: st.DrawFn, complete: bool = True) -> Inputs:
    """Up to four arrays in random layouts (mesh, flat ranges, explicit boxes, replicated or overlapping), placed."""
    arrays = []
    for i in range(draw(st.integers(1, 4))):
        shape = draw(shapes(max_side=9))
        layout: Layout = draw(specs(shape, complete=complete))
        ranks = _placement(draw, layout.world_size)
        arrays.append(ArraySpec(f"a{i}", shape, draw(st.sampled_from([1, 2, 4])), layout, ranks))
    return arrays, _world(arrays, draw(st.integers(0, 2))), draw(chunking_options())


def _oracle_plan(arrays: list[ArraySpec], world: int, options: ChunkingOptions | None) -> object:
    try:
        return oracle_save([array_layout(a, world) for a in arrays], world, options)
    except LayoutError as e:
        return e


@given(placed_specs(), st.data())
def test_save_plans_equal_the_oracle_whole_and_per_rank(inputs: Inputs, data: st.DataObject) -> None:
    arrays, world, options = inputs
    want = _oracle_plan(arrays, world, options)
    if isinstance(want, LayoutError):
        event("a layout leaves elements unheld")
        with pytest.raises(LayoutError, match="held by no rank"):
            plan_save(arrays, world, options=options)
        messages = []
        for a in arrays:
            try:
                check_complete(a, options)
            except LayoutError as e:
                messages.append(str(e))
        assert messages, "check_complete found no array with unheld elements"
        assert all("held by no rank" in m for m in messages), messages
        return
    for a in arrays:
        check_complete(a, options)
    assert plan_save(arrays, world, options=options) == want
    for rank in sorted({0, world - 1, data.draw(st.integers(0, world - 1))}):
        if data.draw(st.booleans()):
            clear_caches()  # cold and memoised planning agree
        assert plan_save(arrays, world, rank=rank, options=options) == rank_part(want, rank)  # type: ignore[arg-type]


@given(placed_specs(), st.data())
def test_load_plans_equal_the_oracle_whole_and_per_rank(inputs: Inputs, data: st.DataObject) -> None:
    arrays, world, options = inputs
    chunks = [ap.chunk_shape for ap in plan_save(arrays, world, options=options).arrays]
    targets = []
    for a in arrays:
        layout: Layout = data.draw(specs(a.shape, complete=False))
        targets.append(ArraySpec(a.key, a.shape, a.itemsize, layout, _placement(data.draw, layout.world_size)))
    t_world = _world(targets, data.draw(st.integers(0, 1)))
    stored = [(a.key, a.shape, a.itemsize, c) for a, c in zip(arrays, chunks, strict=True)]
    want = oracle_load(stored, [array_layout(t, t_world).pieces for t in targets], t_world)
    assert plan_load(chunks, targets, t_world) == want
    for rank in sorted({0, t_world - 1, data.draw(st.integers(0, t_world - 1))}):
        if data.draw(st.booleans()):
            clear_caches()
        assert plan_load(chunks, targets, t_world, rank=rank) == load_rank_part(want, rank)


@given(placed_specs(), placed_specs(), st.data())
def test_a_ranks_part_does_not_depend_on_arrays_it_holds_nothing_of(
    inputs: Inputs, others: Inputs, data: st.DataObject
) -> None:
    # Balancing is per scope (the ranks able to take a chunk); every scope deciding a rank's
    # writes contains the rank, so arrays the rank holds no piece of cannot move its writes.
    arrays, world, options = inputs
    rank = data.draw(st.integers(0, world - 1))
    foreign = [
        ArraySpec(f"x{a.key}", a.shape, a.itemsize, a.layout, a.ranks)
        for a in others[0]
        if rank not in a.rank_array().tolist() and int(a.rank_array().max()) < world
    ]
    mixed = list(arrays)
    for f in foreign:
        mixed.insert(data.draw(st.integers(0, len(mixed))), f)
    alone = plan_save(arrays, world, rank=rank, options=options).arrays
    together = {a.key: a for a in plan_save(mixed, world, rank=rank, options=options).arrays}
    assert [together[a.key] for a in alone] == list(alone)
    assert all(not together[f.key].writes for f in foreign)


@given(st.data())
def test_a_ranks_own_structure_is_its_part_of_the_whole_one(data: st.DataObject) -> None:
    # A rank planning a mesh layout (pieces equal or disjoint) builds only its own cells,
    # groups and merged chunks (plan/_save.py _make_rank_structure); they must be exactly
    # the whole structure's that involve it, for every position.
    from pytreeckpt.plan import _structure as planner
    from pytreeckpt.plan._tables import placed

    shape = data.draw(shapes(max_side=9, min_dims=1))
    layout = data.draw(specs(shape, irregular=False))
    itemsize = data.draw(st.sampled_from([1, 2, 4]))
    options = data.draw(chunking_options()) or ChunkingOptions()
    p = placed(ArraySpec("a", shape, itemsize, layout))
    assume(p.table.disjoint)  # (every mesh table but a zero-size array's)
    whole = planner._make_structure(p.table, shape, itemsize, options)
    for pos in range(p.table.positions):
        own = planner._make_rank_structure(p.table, shape, itemsize, options, pos)
        assert own.grid == whole.grid
        w_singles, w_groups, w_merged = whole.involving(pos)
        o_singles, o_groups, o_merged = own.involving(pos)
        assert o_merged == w_merged
        assert [(g.holders, g.chunks, g.sizes, g.pieces) for g in o_groups] == [
            (g.holders, g.chunks, g.sizes, g.pieces) for g in w_groups
        ]
        for name in ("single_pos", "single_piece", "single_lo", "single_hi"):
            assert (getattr(own, name)[o_singles] == getattr(whole, name)[w_singles]).all(), name
        assert own.single_box == whole.single_box
