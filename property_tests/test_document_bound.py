"""save() checks its metadata document's size before writing with a bound, not the document: the bound holds."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import pytreeckpt
from pytreeckpt.core._values import encode_value
from pytreeckpt.format import SEAL_BYTES, ArrayMeta, ValueMeta, build_document, parse_document
from pytreeckpt.saving import array_bytes_bound as _array_bytes_bound
from pytreeckpt.testing import shapes, specs

_KEYS = st.text(st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=12)


@st.composite
def trees(draw: st.DrawFn) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in draw(st.lists(_KEYS, min_size=1, max_size=6, unique_by=lambda k: k.replace(".", "_"))):
        kind = draw(st.sampled_from(["tensor", "sharded", "numpy", "value"]))
        shape = draw(shapes(max_side=6))
        if kind == "tensor":
            out[key] = torch.zeros(shape, dtype=draw(st.sampled_from([torch.float32, torch.int8, torch.bfloat16])))
        elif kind == "numpy":
            out[key] = np.zeros(shape, dtype=np.float64)
        elif kind == "sharded":
            spec = draw(specs(shape))
            out[key] = pytreeckpt.ShardedLeaf.from_global(torch.zeros(shape), spec)
        else:
            out[key] = draw(st.one_of(st.integers(), st.text(max_size=20), st.none(), st.floats(allow_nan=False)))
    return out


@settings(max_examples=200)
@given(trees(), st.booleans(), st.sampled_from([None, "zstd"]))
def test_the_bound_is_at_least_the_document(tree: dict[str, Any], hashed: bool, compression: str | None) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "c"
        try:
            pytreeckpt.save(path, tree, chunk_hashes=hashed, compression=compression)
        except pytreeckpt.CheckpointError as e:
            event(f"refused: {str(e)[:40]}")
            return  # (colliding dotted keys and the like are refused; not this test's subject)
        event("saved")
        raw = (path / "pytreeckpt.json").read_bytes()
    doc = parse_document(raw)
    metas = [leaf for leaf in doc.leaves if isinstance(leaf, ArrayMeta)]
    values = [leaf.to_json(encode_value(leaf.value)) for leaf in doc.leaves if isinstance(leaf, ValueMeta)]
    bound = len(build_document(doc.tree, values, doc.user_metadata)) + SEAL_BYTES + _array_bytes_bound(metas, hashed)
    assert bound >= len(raw)
