"""Loading in place and loading functionally agree bit for bit, whatever the layouts."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pytreeckpt
from pytreeckpt import ShardedLeaf
from pytreeckpt.testing import dtypes, shapes, specs, tensors


@st.composite
def case(draw: st.DrawFn) -> tuple[torch.Tensor, Any, Any]:
    shape = draw(shapes())
    t = draw(tensors(shape, draw(dtypes())))
    return t, draw(specs(shape)), draw(specs(shape, complete=False))


def _bits(x: torch.Tensor) -> bytes:
    return bytes(x.contiguous().view(-1).view(torch.uint8).numpy())


@settings(max_examples=40, deadline=None)
@given(case(), st.booleans())
def test_a_load_in_place_gives_the_bits_a_functional_load_gives_in_the_targets_own_shards(
    c: tuple[torch.Tensor, Any, Any], packed: bool
) -> None:
    t, save_spec, load_spec = c
    with tempfile.TemporaryDirectory() as d:
        where: Any = Path(d) / "c"
        if not packed:
            where = pytreeckpt.Location(where, pytreeckpt.StorageOptions(pack_small_leaves=False))
        pytreeckpt.save(where, {"x": ShardedLeaf.from_global(t, save_spec)})
        functional = pytreeckpt.load(where, {"x": pytreeckpt.Abstract(tuple(t.shape), t.dtype, load_spec)})["x"]
        filler = torch.full((t.numel() * t.element_size(),), 7, dtype=torch.uint8).view(t.dtype).view(t.shape)
        target = ShardedLeaf.from_global(filler, load_spec)  # holding other bits than the stored ones
        shards = dict(target.shards)
        got = pytreeckpt.load(where, {"x": target}, inplace=True)["x"]
    assert got is target
    assert set(got.shards) == set(functional.shards)
    for r, s in got.shards.items():
        assert s is shards[r]
        assert _bits(s) == _bits(functional.shards[r]), r
