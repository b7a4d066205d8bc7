"""Saving in one layout and loading in another gives back exactly the saved values."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from pytreeckpt import ChunkingOptions
from pytreeckpt.testing import check_reshard, chunking_options, dtypes, shapes, sharded_trees, specs, tensors

_DIR = Path(tempfile.mkdtemp(prefix="pytreeckpt-props-"))


@st.composite
def reshard_cases(draw: st.DrawFn) -> tuple:
    shape = draw(shapes())
    dtype = draw(dtypes())
    t = draw(tensors(shape, dtype))
    a = draw(st.one_of(st.none(), specs(shape)))
    b = draw(st.one_of(st.none(), specs(shape, complete=False)))
    return t, a, b, draw(chunking_options())


@given(reshard_cases())
def test_save_in_layout_a_load_in_layout_b_is_exact(case: tuple) -> None:
    t, a, b, chunking = case
    check_reshard({"x": t}, {"x": a}, {"x": b}, path=_DIR / "ckpt", chunking=chunking)


@given(sharded_trees(), st.data())
def test_trees_of_several_leaves_reshard_exactly(tree_and_specs: tuple, data: st.DataObject) -> None:
    tree, spec_a = tree_and_specs
    spec_b = {
        k: data.draw(specs(tuple(v.shape), complete=False)) for k, v in tree.items() if isinstance(v, torch.Tensor)
    }
    small = ChunkingOptions(single_chunk_bytes=16, min_chunk_bytes=8, max_chunk_bytes=64)
    check_reshard(tree, spec_a, spec_b, path=_DIR / "tree", chunking=data.draw(st.sampled_from([None, small])))
