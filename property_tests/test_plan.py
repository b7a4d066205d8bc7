"""Invariants of the pure save and load plans, checked exactly with numpy count arrays."""

from __future__ import annotations

import json
import math

import numpy as np
from _oracle import ArrayLayout, plan_load, plan_save
from hypothesis import event, given
from hypothesis import strategies as st

from pytreeckpt import ChunkingOptions, ExplicitRegions, FlatRanges, Layout, Mesh, Replicate, ShardingSpec
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.core._sharding import Piece
from pytreeckpt.plan import ArraySavePlan, LoadPlan, SavePlan
from pytreeckpt.testing import chunking_options, shapes, specs

Pieces = tuple[tuple[Piece, ...], ...]
SaveInputs = tuple[list[ArrayLayout], int, ChunkingOptions | None]


@st.composite
def save_inputs(draw: st.DrawFn) -> SaveInputs:
    """Up to three arrays in random complete layouts, a world at least as large, and chunking options."""
    layouts = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(shapes(max_side=8))
        spec = draw(specs(shape))
        layouts.append(ArrayLayout(f"a{i}", shape, draw(st.sampled_from([1, 2, 4, 8])), spec.rank_pieces(shape)))
    world = max(len(a.pieces) for a in layouts) + draw(st.integers(0, 2))  # idle ranks too
    return layouts, world, draw(chunking_options())


def load_targets(layouts: list[ArrayLayout]) -> st.SearchStrategy[list[Pieces]]:
    """Any target layout (gaps allowed) of every array."""
    return st.tuples(*[specs(a.shape, complete=False) for a in layouts]).map(
        lambda ss: [s.rank_pieces(a.shape) for s, a in zip(ss, layouts, strict=True)]
    )


def _stored(layouts: list[ArrayLayout], plan: SavePlan) -> list[tuple[str, tuple[int, ...], int, tuple[int, ...]]]:
    return [(a.key, a.shape, a.itemsize, ap.chunk_shape) for a, ap in zip(layouts, plan.arrays, strict=True)]


def _grid(ap: ArraySavePlan) -> tuple[int, ...]:
    return tuple(-(-s // c) for s, c in zip(ap.shape, ap.chunk_shape, strict=True))


@given(save_inputs())
def test_every_element_is_written_exactly_once(inputs: SaveInputs) -> None:
    layouts, world, chunking = inputs
    plan = plan_save(layouts, world, chunking)
    assert [ap.key for ap in plan.arrays] == [a.key for a in layouts]
    for layout, ap in zip(layouts, plan.arrays, strict=True):
        assert ap.shape == layout.shape
        written = np.zeros(layout.shape, dtype=np.int64)
        for op in ap.writes:
            assert 0 <= op.writer < world
            written[op.region.slices()] += 1
        assert (written == 1).all()


@given(save_inputs())
def test_sources_partition_each_write_and_lie_in_their_pieces(inputs: SaveInputs) -> None:
    layouts, world, chunking = inputs
    plan = plan_save(layouts, world, chunking)
    for layout, ap in zip(layouts, plan.arrays, strict=True):
        for op in ap.writes:
            covered = np.zeros(op.region.shape, dtype=np.int64)
            for frag in op.sources:
                assert 0 <= frag.rank < len(layout.pieces)
                assert 0 <= frag.piece < len(layout.pieces[frag.rank])
                assert layout.pieces[frag.rank][frag.piece].region.contains(frag.region)
                assert op.region.contains(frag.region)
                covered[frag.region.relative_to(op.region).slices()] += 1
            assert (covered == 1).all()
            if op.is_direct:
                assert op.sources[0].rank == op.writer
            else:
                event("a write merged from fragments")


@given(save_inputs())
def test_every_chunk_has_exactly_one_writer(inputs: SaveInputs) -> None:
    layouts, world, chunking = inputs
    plan = plan_save(layouts, world, chunking)
    for ap in plan.arrays:
        assert len(ap.chunk_shape) == len(ap.shape)
        assert all(c >= 1 for c in ap.chunk_shape)
        writes_of_chunk = np.zeros(_grid(ap), dtype=np.int64)
        for op in ap.writes:
            lo, hi = [], []
            for o, e, c, n in zip(op.region.offset, op.region.stop, ap.chunk_shape, ap.shape, strict=True):
                assert o % c == 0  # a write starts on a chunk boundary
                assert e % c == 0 or e == n  # and ends on one: it is a union of whole chunks
                lo.append(o // c)
                hi.append(-(-e // c))
            writes_of_chunk[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))] += 1
        assert (writes_of_chunk == 1).all()


@given(save_inputs(), st.data())
def test_every_element_of_every_target_piece_is_read_exactly_once(inputs: SaveInputs, data: st.DataObject) -> None:
    layouts, world, chunking = inputs
    saved = plan_save(layouts, world, chunking)
    targets = data.draw(load_targets(layouts))
    t_world = max(len(t) for t in targets) + data.draw(st.integers(0, 2))
    plan = plan_load(_stored(layouts, saved), targets, t_world)
    for layout, ap, pieces, lp in zip(layouts, saved.arrays, targets, plan.arrays, strict=True):
        delivered = {
            (r, i): np.zeros(p.region.shape, dtype=np.int64) for r, ps in enumerate(pieces) for i, p in enumerate(ps)
        }
        for op in lp.reads:
            assert Region.full(layout.shape).contains(op.region)
            assert len(list(ChunkGrid(ap.shape, ap.chunk_shape).touching(op.region))) == 1  # within one stored chunk
            assert op.reader in {t.rank for t in op.targets}  # read by a rank that wants it
            for t in op.targets:
                piece = pieces[t.rank][t.piece]
                assert t.region == op.region
                assert piece.region.contains(t.region)
                delivered[(t.rank, t.piece)][t.region.relative_to(piece.region).slices()] += 1
        for counts in delivered.values():
            assert (counts == 1).all()
        assert len({op.region for op in lp.reads}) == len(lp.reads)  # a region wanted twice is read once


@given(save_inputs(), st.data())
def test_plans_round_trip_through_json_and_are_deterministic(inputs: SaveInputs, data: st.DataObject) -> None:
    layouts, world, chunking = inputs
    plan = plan_save(layouts, world, chunking)
    assert SavePlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert plan_save(layouts, world, chunking) == plan
    stored = _stored(layouts, plan)
    targets = data.draw(load_targets(layouts))
    t_world = max(len(t) for t in targets)
    lp = plan_load(stored, targets, t_world)
    assert LoadPlan.from_json(json.loads(json.dumps(lp.to_json()))) == lp
    assert plan_load(stored, targets, t_world) == lp


def _replicated(kind: int, world: int, shape: tuple[int, ...]) -> Layout:
    """A layout in which each of ``world`` ranks holds the whole array, in one of four spellings."""
    if kind == 0:
        return ShardingSpec(Mesh(world), [Replicate()])
    if kind == 1:
        return ShardingSpec(Mesh((1, world)), [Replicate(), Replicate()])
    if kind == 2:
        return FlatRanges([(0, math.prod(shape))] * world)
    return ExplicitRegions([[Region.full(shape)]] * world)


@given(
    st.lists(st.tuples(shapes(min_dims=1, max_side=40), st.sampled_from([1, 2, 4]), st.integers(0, 3)), min_size=1,
             max_size=6),
    st.integers(1, 6),
    st.integers(0, 2),
    chunking_options(),
)  # fmt: skip
def test_purely_replicated_data_is_balanced_across_its_holders(
    arrays: list[tuple[tuple[int, ...], int, int]], holders: int, idle: int, chunking: ChunkingOptions | None
) -> None:
    layouts = [
        ArrayLayout(f"a{i}", shape, size, _replicated(kind, holders, shape).rank_pieces(shape))
        for i, (shape, size, kind) in enumerate(arrays)
    ]
    plan = plan_save(layouts, holders + idle, chunking)
    load = plan.bytes_per_rank()
    assert sum(load) == sum(math.prod(shape) * size for shape, size, _ in arrays)
    assert not any(load[holders:])  # ranks holding nothing write nothing
    largest = max(
        (ChunkGrid(ap.shape, ap.chunk_shape).region((0,) * len(ap.shape)).size * ap.itemsize for ap in plan.arrays),
        default=0,
    )
    spread = max(load[:holders]) - min(load[:holders])
    assert spread <= largest, (load, largest)


@given(
    st.lists(st.integers(1, 5000), min_size=1, max_size=3),
    st.sampled_from([1, 2, 4, 8]),
    st.data(),
)
def test_chunks_are_never_tiny(shape_list: list[int], itemsize: int, data: st.DataObject) -> None:
    """Above one chunk, every chunk holds at least the smaller of min_chunk_bytes and half of
    max_chunk_bytes (whatever the extents' divisors: a prime extent once gave one-element
    chunks), and at most max_chunk_bytes."""
    from pytreeckpt.plan._chunking import chunk_shape_from_cuts

    shape = tuple(shape_list)
    cuts = [data.draw(st.one_of(st.just(0), st.integers(1, max(1, n - 1)))) for n in shape]
    cuts = [g if 0 < g < n else 0 for g, n in zip(cuts, shape, strict=True)]
    max_bytes = data.draw(st.integers(itemsize, 1 << 16))
    opts = ChunkingOptions(
        single_chunk_bytes=data.draw(st.integers(0, 1 << 16)),
        min_chunk_bytes=data.draw(st.integers(0, max_bytes)),
        max_chunk_bytes=max_bytes,
    )
    chunk = chunk_shape_from_cuts(shape, itemsize, cuts, opts)
    total = math.prod(shape) * itemsize
    nbytes = math.prod(chunk) * itemsize
    assert all(1 <= c <= n for c, n in zip(chunk, shape, strict=True))
    if total <= opts.single_chunk_bytes:
        assert chunk == shape
        return
    assert nbytes <= max(opts.max_chunk_bytes, itemsize)
    assert nbytes >= min(total, opts.min_chunk_bytes, opts.max_chunk_bytes // 2), (shape, cuts, opts, chunk)
    aligned = all(g == 0 or g % c == 0 for g, c in zip(cuts, chunk, strict=True))
    event("aligned grid" if aligned else "regular grid")


@given(
    st.lists(st.tuples(shapes(max_side=40), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=6),
    chunking_options(),
)
def test_plan_whole_is_what_plan_save_plans_for_an_array_held_whole_in_one_chunk(
    arrays: list[tuple[tuple[int, ...], int]], options: ChunkingOptions | None
) -> None:
    """save() plans small arrays one process holds whole with plan_whole, without tables: the same plans."""
    from pytreeckpt.plan import ArraySpec, plan_whole
    from pytreeckpt.plan import plan_save as real_plan_save

    one = ShardingSpec(Mesh(1), [Replicate()])
    limit = (options or ChunkingOptions()).single_chunk_bytes
    specs_ = [ArraySpec(f"a{i}", shape, itemsize, one) for i, (shape, itemsize) in enumerate(arrays)]
    planned = real_plan_save(specs_, 1, options=options).arrays
    for spec, plan in zip(specs_, planned, strict=True):
        if 0 not in spec.shape and math.prod(spec.shape) * spec.itemsize <= limit:
            event("one chunk")
            assert plan_whole(spec.key, spec.shape, spec.itemsize) == plan


@st.composite
def int_rows(draw: st.DrawFn) -> np.ndarray:
    """Up to 600 rows of 0 to 4 int64 columns: values few (many equal rows) or spread to 2**40 and below
    zero (no number per row fits)."""
    n, d = draw(st.integers(0, 600)), draw(st.integers(0, 4))
    spread = draw(st.sampled_from([2, 5, 1000, 1 << 40]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    a = rng.integers(-spread, spread, size=(n, d), dtype=np.int64)
    if draw(st.booleans()):  # (mostly in order already, as the planner's rows come)
        a = a[np.lexsort(a.T[::-1])] if d else a
    return a


@given(int_rows())
def test_unique_rows_is_numpys_unique_of_rows(a: np.ndarray) -> None:
    """The planner's distinct rows (a number per row sorted once, when it fits, past 256 rows; else a
    lexsort): numpy's ``unique(axis=0)`` with first indices and inverse, whatever the values' spread."""
    from pytreeckpt.plan._tables import unique_rows

    u, inverse, first = unique_rows(a)
    if not len(a):
        assert len(u) == len(inverse) == len(first) == 0
        return
    want, want_first, want_inverse = np.unique(a, axis=0, return_index=True, return_inverse=True)
    assert u.tolist() == want.tolist()
    assert first.tolist() == want_first.tolist()
    assert inverse.tolist() == want_inverse.ravel().tolist()


@given(
    st.integers(1, 40),
    st.lists(
        st.tuples(st.sampled_from(["least", "least", "least", "some", "all"]), st.integers(0, 39), st.integers(0, 3)),
        max_size=120,
    ),
)
def test_the_least_loaded_rank_is_the_argmin_of_the_loads(size: int, steps: list[tuple[str, int, int]]) -> None:
    """Loads.least() (the last found or the next, else a scan) is ``argmin`` of the loads after any growth the
    planner makes: to the rank it picked (by 0 to 3 bytes), to another rank, or to every rank at once."""
    from pytreeckpt.plan._balance import Loads

    loads = Loads(size)
    for what, at, nbytes in steps:
        got = loads.least()
        assert got == int(loads.values.argmin()), (loads.values.tolist(), got)
        if what == "least":
            loads.values[got] += nbytes
        elif what == "some":
            loads.values[at % size] += nbytes
        else:
            loads.values += np.arange(size) % (nbytes + 1)
