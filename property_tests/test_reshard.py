"""Saving in one layout and loading in another gives back exactly the saved values, bit for bit."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import event, given
from hypothesis import strategies as st

from pytreeckpt import ChunkingOptions
from pytreeckpt.testing import (
    check_reshard,
    chunking_options,
    dtypes,
    shapes,
    sharded_trees,
    specs,
    target_specs,
    tensors,
)


@st.composite
def one_leaf(draw: st.DrawFn) -> tuple[torch.Tensor, Any, Any]:
    """A tensor of random shape and dtype, a complete layout to save from and any layout to load into."""
    shape = draw(shapes())
    t = draw(tensors(shape, draw(dtypes())))
    # Unsharded (None) one time in five on either side.
    a = draw(specs(shape)) if draw(st.integers(0, 4)) else None
    b = draw(specs(shape, complete=False)) if draw(st.integers(0, 4)) else None
    return t, a, b


@given(one_leaf(), chunking_options(), st.booleans())
def test_a_leaf_saved_in_layout_a_loads_in_layout_b_bit_for_bit(
    case: tuple[torch.Tensor, Any, Any], chunking: ChunkingOptions | None, use_save_spec: bool
) -> None:
    t, a, b = case
    event(f"save from {type(a).__name__}, load into {type(b).__name__}")
    event("tiny chunks" if chunking is not None else "default chunks")
    check_reshard({"x": t}, {"x": a}, {"x": b}, chunking=chunking, use_save_spec=use_save_spec)


@given(sharded_trees(), chunking_options(), st.booleans(), st.booleans(), st.data())
def test_a_tree_saved_in_its_layouts_loads_in_other_layouts_bit_for_bit(
    tree: Any, chunking: ChunkingOptions | None, use_save_spec: bool, asynchronous: bool, data: st.DataObject
) -> None:
    # Sharded leaves are saved in their own layouts; plain tensors whole, or in a
    # layout given by spec_a when it names one.
    spec_a = data.draw(target_specs(tree, complete=True))
    spec_b = data.draw(target_specs(tree))
    check_reshard(tree, spec_a, spec_b, chunking=chunking, use_save_spec=use_save_spec, asynchronous=asynchronous)
