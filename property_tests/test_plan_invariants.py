"""Invariants of the pure plans, checked exactly with numpy count arrays on random layouts."""

from __future__ import annotations

import json
import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt import Mesh, Replicate, ShardingSpec
from pytreeckpt._plan import ArrayLayout, LoadPlan, SavePlan, plan_load, plan_save
from pytreeckpt._region import Region, chunk_region
from pytreeckpt.testing import chunking_options, shapes, specs


@st.composite
def save_inputs(draw: st.DrawFn) -> tuple:
    layouts = []
    for i in range(draw(st.integers(1, 3))):
        shape = draw(shapes(max_side=8))
        spec = draw(specs(shape))
        layouts.append(ArrayLayout(f"a{i}", shape, draw(st.sampled_from([1, 2, 4])), spec.rank_pieces(shape)))
    world = max(len(a.pieces) for a in layouts)
    return layouts, world, draw(chunking_options())


def _count(shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, dtype=np.int64)


@given(save_inputs())
def test_every_element_written_once_by_one_writer_per_chunk(inputs: tuple) -> None:
    layouts, world, chunking = inputs
    plan = plan_save(layouts, world, chunking)
    for layout, ap in zip(layouts, plan.arrays, strict=True):
        written = _count(layout.shape)
        writer_of_chunk: dict[tuple[int, ...], int] = {}
        for op in ap.writes:
            written[op.region.slices()] += 1
            covered = _count(op.region.shape)
            for frag in op.sources:
                assert op.region.contains(frag.region)
                piece = layout.pieces[frag.rank][frag.piece]
                assert piece.region.contains(frag.region)  # a source holds what it sends
                covered[frag.region.relative_to(op.region).slices()] += 1
            assert (covered == 1).all()  # sources partition the write
            for idx in op.region.chunk_indices(ap.chunk_shape):
                chunk = chunk_region(idx, ap.chunk_shape, layout.shape)
                assert op.region.contains(chunk)  # writes are unions of whole chunks
                assert writer_of_chunk.setdefault(idx, op.writer) == op.writer
                assert idx not in writer_of_chunk or writer_of_chunk[idx] == op.writer
        assert (written == 1).all()


@given(save_inputs(), st.data())
def test_every_target_element_read_once(inputs: tuple, data: st.DataObject) -> None:
    layouts, world, chunking = inputs
    saved = plan_save(layouts, world, chunking)
    targets = [data.draw(specs(a.shape, complete=False)).rank_pieces(a.shape) for a in layouts]
    t_world = max(len(t) for t in targets)
    stored = [(a.key, a.shape, a.itemsize, ap.chunk_shape) for a, ap in zip(layouts, saved.arrays, strict=True)]
    plan = plan_load(stored, targets, t_world)
    for layout, pieces, ap in zip(layouts, targets, plan.arrays, strict=True):
        delivered = {(r, p): _count(piece.region.shape) for r, ps in enumerate(pieces) for p, piece in enumerate(ps)}
        for op in ap.reads:
            assert op.reader in {t.rank for t in op.targets}
            assert Region.full(layout.shape).contains(op.region)
            for t in op.targets:
                piece = pieces[t.rank][t.piece]
                delivered[(t.rank, t.piece)][t.region.relative_to(piece.region).slices()] += 1
        for counts in delivered.values():
            assert (counts == 1).all()
        # identical wanted regions are read once: no two reads share a region
        regions = [op.region for op in ap.reads]
        assert len(regions) == len(set(regions))


@given(save_inputs(), st.data())
def test_plans_round_trip_through_json_and_are_deterministic(inputs: tuple, data: st.DataObject) -> None:
    layouts, world, chunking = inputs
    plan = plan_save(layouts, world, chunking)
    assert SavePlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    assert plan_save(layouts, world, chunking) == plan
    stored = [(a.key, a.shape, a.itemsize, ap.chunk_shape) for a, ap in zip(layouts, plan.arrays, strict=True)]
    targets = [data.draw(specs(a.shape, complete=False)).rank_pieces(a.shape) for a in layouts]
    t_world = max(len(t) for t in targets)
    lp = plan_load(stored, targets, t_world)
    assert LoadPlan.from_json(json.loads(json.dumps(lp.to_json()))) == lp
    assert plan_load(stored, targets, t_world) == lp


@given(st.lists(st.tuples(shapes(min_dims=1, max_side=40), st.sampled_from([1, 2, 4])), min_size=1, max_size=6),
       st.integers(1, 6), chunking_options())  # fmt: skip
def test_replicated_data_is_balanced_across_holders(arrays: list, ranks: int, chunking: object) -> None:
    spec = ShardingSpec(Mesh(ranks), [Replicate()])
    layouts = [ArrayLayout(f"a{i}", s, n, spec.rank_pieces(s)) for i, (s, n) in enumerate(arrays)]
    plan = plan_save(layouts, ranks, chunking)  # type: ignore[arg-type]
    load = plan.bytes_per_rank()
    assert sum(load) == sum(math.prod(s) * n for s, n in arrays)
    largest = max((math.prod(ap.chunk_shape) * ap.itemsize for ap in plan.arrays if math.prod(ap.shape)), default=0)
    assert max(load) - min(load) <= largest
