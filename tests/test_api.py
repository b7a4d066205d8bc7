"""save / async_save / load / metadata end to end, on real files."""

from __future__ import annotations

import json
import math
import os
import pickle
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import torch
from helpers import HANG, bits, unpacked

import pytreeckpt
from pytreeckpt import Abstract, ExplicitRegions, FlatRanges, Mesh, Replicate, Shard, ShardedLeaf, ShardingSpec
from pytreeckpt.storage import Storage


def trained_state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        tokens = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(step))
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 50), tokens.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}


def test_model_and_optimizer_state_dicts_round_trip(tmp_path: Path) -> None:
    model, opt, state = trained_state()
    pytreeckpt.save(tmp_path / "c", state)
    out = pytreeckpt.load(tmp_path / "c")
    assert sorted(out["optim"]["state"]) == [0, 1, 2, 3, 4]  # integer keys stay integers
    assert out["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    fresh = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 50))
    fresh.load_state_dict(out["model"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(out["optim"])
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    for i, st in opt.state_dict()["state"].items():
        for name, v in st.items():
            assert torch.equal(fresh_opt.state_dict()["state"][i][name], v), (i, name)
    # into the fresh model's own state dict as the target
    again = pytreeckpt.load(tmp_path / "c", {"model": fresh.state_dict()}, strict=False)
    assert set(again) == {"model"}
    for k, v in model.state_dict().items():
        assert torch.equal(again["model"][k], v)


def test_every_stored_leaf_opens_with_plain_tensorstore(tmp_path: Path) -> None:
    g = torch.randn(10, 7)
    leaves = {
        "mesh": ShardedLeaf.from_global(g, ShardingSpec(Mesh((2, 2)), [Shard(0), Shard(0)])),
        "flat": ShardedLeaf.from_global(g, FlatRanges([(0, 23), (23, 23), (23, 70)])),
        "boxes": ShardedLeaf.from_global(
            g, ExplicitRegions([[((0, 0), (10, 3))], [((0, 3), (4, 4)), ((4, 3), (6, 4))]])
        ),
        "bf16": g.to(torch.bfloat16),
        "plain": torch.arange(5),
    }
    pytreeckpt.save(
        tmp_path / "c", leaves, chunking=pytreeckpt.ChunkingOptions(single_chunk_bytes=64, max_chunk_bytes=64)
    )
    doc = json.loads((tmp_path / "c" / "pytreeckpt.json").read_text())
    assert any("database" in leaf for leaf in doc["leaves"])  # small arrays are packed by default
    for leaf in doc["leaves"]:
        if "database" in leaf:  # entries of a zip archive (one archive per rank here)
            base = {"driver": "file", "path": str(tmp_path / "c" / leaf["database"] / "0.zip")}
            kvstore = {"driver": "zip", "base": base, "path": leaf["path"] + "/"}
        else:
            kvstore = {"driver": "file", "path": str(tmp_path / "c" / leaf["path"])}
        store = ts.open({"driver": "zarr3", "kvstore": kvstore}).result()
        data = store.read().result()
        want = leaves[leaf["key"]]
        want = want.to_global() if isinstance(want, ShardedLeaf) else want
        assert list(store.shape) == list(want.shape)
        if want.dtype == torch.bfloat16:
            assert data.dtype.name == "bfloat16"
            assert data.view(np.int16).tobytes() == want.view(torch.int16).numpy().tobytes()
        else:
            assert np.array_equal(data, want.numpy())


@pytest.mark.parametrize(
    ("spec_a", "spec_b"),
    [
        (ShardingSpec(Mesh(4), [Shard(0)]), ShardingSpec(Mesh(3), [Shard(1)])),
        (ShardingSpec(Mesh((2, 3)), [Shard(1), Shard(0)]), FlatRanges([(0, 1), (1, 40), (40, 77)])),
        (FlatRanges([(0, 30), (30, 77)]), ShardingSpec(Mesh((2, 2)), [Replicate(), Shard(0)])),
        (ExplicitRegions([[((0, 0), (11, 3))], [((0, 3), (11, 4))]]), ShardingSpec(Mesh(5), [Shard(0)])),
    ],
)
def test_save_in_one_layout_load_in_another(tmp_path: Path, spec_a: object, spec_b: object) -> None:
    g = torch.randn(11, 7)
    pytreeckpt.save(tmp_path / "c", {"g": ShardedLeaf.from_global(g, spec_a)})
    out = pytreeckpt.load(tmp_path / "c", {"g": Abstract((11, 7), torch.float32, spec_b)})["g"]
    assert isinstance(out, ShardedLeaf)
    assert out.spec == spec_b
    assert torch.equal(out.to_global(), g)


def test_targets_with_some_ranks_a_full_tensor_and_a_parameter(tmp_path: Path) -> None:
    g = torch.randn(6, 4)
    pytreeckpt.save(tmp_path / "c", {"g": ShardedLeaf.from_global(g, ShardingSpec(Mesh(2), [Shard(1)]))})
    spec3 = ShardingSpec(Mesh(3), [Shard(0)])
    some = ShardedLeaf((6, 4), torch.float32, spec3, {2: torch.zeros(2, 4)})
    assert torch.equal(pytreeckpt.load(tmp_path / "c", {"g": some})["g"].shards[2], g[4:])
    assert torch.equal(pytreeckpt.load(tmp_path / "c", {"g": torch.zeros(6, 4)})["g"], g)
    param = torch.nn.Parameter(torch.zeros(6, 4), requires_grad=False)
    out = pytreeckpt.load(tmp_path / "c", {"g": param})["g"]
    assert isinstance(out, torch.nn.Parameter)
    assert not out.requires_grad
    assert torch.equal(out, g)


def test_a_tensor_with_a_spec_is_laid_out_for_planning(tmp_path: Path) -> None:
    g = torch.randn(8, 8)
    spec = ShardingSpec(Mesh(4), [Replicate()])
    pytreeckpt.save(
        tmp_path / "c", {"g": g}, spec, chunking=pytreeckpt.ChunkingOptions(single_chunk_bytes=32, max_chunk_bytes=32)
    )
    meta = pytreeckpt.metadata(tmp_path / "c")
    assert meta.arrays["g"].layout == spec
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["g"], g)


def test_metadata_tree_is_a_load_target(tmp_path: Path) -> None:
    pytreeckpt.save(
        tmp_path / "c", {"w": torch.ones(2, 3, dtype=torch.bfloat16), "step": 4}, user_metadata={"run": "x"}
    )
    meta = pytreeckpt.metadata(tmp_path / "c")
    assert meta.tree == {"w": Abstract((2, 3), torch.bfloat16), "step": 4}
    assert meta.user_metadata == {"run": "x"}
    assert meta.nbytes == 12
    out = pytreeckpt.load(tmp_path / "c", meta.tree)
    assert torch.equal(out["w"], torch.ones(2, 3, dtype=torch.bfloat16))


def test_load_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, state = trained_state()
    pytreeckpt.save(tmp_path / "c", state)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used while loading")

    # (the DCP importer's allowlisted unpicklers subclass pickle.Unpickler when imported: imported before
    # pickle is patched, else run alone this test made them subclass the patch, and patched apart)
    from pytreeckpt.interop import _dcp

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    for unpickler in (_dcp._MetadataUnpickler, _dcp._BlobUnpickler):
        monkeypatch.setattr(unpickler, "load", forbidden)
    out = pytreeckpt.load(tmp_path / "c")
    assert out["step"] == 3


def test_async_save_holds_the_state_at_the_call(tmp_path: Path) -> None:
    w = torch.arange(6.0)
    sharded = ShardedLeaf.from_global(torch.arange(4.0), FlatRanges([(0, 3), (3, 4)]))
    h = pytreeckpt.async_save(tmp_path / "c", {"w": w, "s": sharded})
    w.add_(100)
    sharded.shards[0].add_(100)
    h.wait()
    assert h.done()
    assert set(h.timings) >= {"plan", "snapshot", "write", "commit"}
    out = pytreeckpt.load(tmp_path / "c")
    assert torch.equal(out["w"], torch.arange(6.0))
    assert torch.equal(out["s"], torch.arange(4.0))


def _fail_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytreeckpt.saving import _job as _save

    def broken(self: object, *args: object, **kwargs: object) -> int:
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(_save, "write_arrays", broken)


def test_async_failure_surfaces_on_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_writes(monkeypatch)
    h = pytreeckpt.async_save(tmp_path / "c", {"w": torch.ones(2)})
    with pytest.raises(OSError, match="No space left"):
        h.wait()
    assert h.done()
    assert not (tmp_path / "c" / "pytreeckpt.json").exists()
    monkeypatch.undo()
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})  # already reported: not raised again
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], torch.ones(2))


def test_unseen_async_failure_surfaces_on_the_next_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_writes(monkeypatch)
    h = pytreeckpt.async_save(tmp_path / "a", {"w": torch.ones(2)})
    deadline = time.monotonic() + HANG  # (only a hang guard)
    while not h.done():  # let it fail in the background, without asking
        assert time.monotonic() < deadline, "the failing save never ended"
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(pytreeckpt.CheckpointError, match=r"previous async save.*No space left"):
        pytreeckpt.save(tmp_path / "b", {"w": torch.ones(2)})
    pytreeckpt.save(tmp_path / "b", {"w": torch.ones(2)})


# --------------------------------------------------------------------------- errors


def test_not_a_committed_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(pytreeckpt.NotCommittedError, match="does not exist"):
        pytreeckpt.load(tmp_path / "missing")
    (tmp_path / "partial" / "arrays").mkdir(parents=True)
    with pytest.raises(pytreeckpt.NotCommittedError, match="not a committed checkpoint"):
        pytreeckpt.load(tmp_path / "partial")
    with pytest.raises(pytreeckpt.NotCommittedError):
        pytreeckpt.metadata(tmp_path / "partial")


def test_target_mismatches_are_listed_by_key_path(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"a": torch.ones(2, 3), "b": torch.ones(4), "n": 1})
    target = {
        "a": torch.zeros(3, 2),
        "b": torch.zeros(4, dtype=torch.float16),
        "missing": torch.zeros(1),
        "n": torch.zeros(1),
    }
    with pytest.raises(pytreeckpt.TargetMismatchError) as info:
        pytreeckpt.load(tmp_path / "c", target)
    msg = str(info.value)
    assert "'a': the checkpoint has shape (2, 3), the target has (3, 2)" in msg
    assert "'b': the checkpoint has dtype float32, the target has float16" in msg
    assert "'missing' of the target is not in the checkpoint" in msg
    assert "'n': the checkpoint has the value 1, the target has an array" in msg


def test_overwrite_and_foreign_directories(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"v": 1})
    with pytest.raises(pytreeckpt.CheckpointError, match="already holds a committed checkpoint"):
        pytreeckpt.save(tmp_path / "c", {"v": 2})
    pytreeckpt.save(tmp_path / "c", {"v": 2}, overwrite=True)
    assert pytreeckpt.load(tmp_path / "c") == {"v": 2}
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(pytreeckpt.CheckpointError, match="not a pytreeckpt checkpoint"):
        pytreeckpt.save(foreign, {"v": 1})
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_an_interrupted_save_is_cleared_by_the_next(tmp_path: Path) -> None:
    path = tmp_path / "c"
    (path / "arrays" / "old").mkdir(parents=True)
    (path / "arrays" / "old" / "junk").write_bytes(b"x")
    (path / ".tmp-abc").write_bytes(b"half a metadata document")
    pytreeckpt.save(unpacked(path), {"w": torch.ones(3)})
    assert sorted(p.name for p in (path / "arrays").iterdir()) == ["w"]
    assert not (path / ".tmp-abc").exists()
    assert torch.equal(pytreeckpt.load(path)["w"], torch.ones(3))


def test_saving_leaves_of_unsupported_types_names_them(tmp_path: Path) -> None:
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'a\.0'.*object"):
        pytreeckpt.save(tmp_path / "c", {"a": [object()]})
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'x'.*Abstract placeholder"):
        pytreeckpt.save(tmp_path / "c", {"x": Abstract((2,), torch.float32)})


def test_a_sharded_leaf_missing_a_rank_cannot_be_saved(tmp_path: Path) -> None:
    spec = ShardingSpec(Mesh(2), [Shard(0)])
    leaf = ShardedLeaf((4,), torch.float32, spec, {0: torch.ones(2)})
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'w'.*rank 1"):
        pytreeckpt.save(tmp_path / "c", {"w": leaf})
    gap = ShardedLeaf.from_global(torch.ones(4), FlatRanges([(0, 1), (2, 4)]))
    with pytest.raises(pytreeckpt.LayoutError, match=r"'w'.*held by no rank"):
        pytreeckpt.save(tmp_path / "c", {"w": gap})


def test_layout_errors_name_axis_and_shape() -> None:
    with pytest.raises(pytreeckpt.LayoutError, match=r"Shard\(2\) on mesh axis 'tp'.*\(4, 4\)"):
        ShardingSpec(Mesh(2, ["tp"]), [Shard(2)]).rank_pieces((4, 4))
    with pytest.raises(pytreeckpt.LayoutError, match="local shard has shape"):
        ShardedLeaf((4,), torch.float32, ShardingSpec(Mesh(2), [Shard(0)]), {0: torch.ones(3)})


def test_files_are_where_the_metadata_says(tmp_path: Path) -> None:
    pytreeckpt.save(unpacked(tmp_path / "c"), {"a/b": torch.ones(1), "A.B": torch.ones(1), "a.b": torch.ones(1)})
    names = sorted(os.listdir(tmp_path / "c" / "arrays"))
    assert len(names) == 3  # distinct even on case-insensitive file systems
    assert all(bits(v).numel() == 1 for v in pytreeckpt.load(tmp_path / "c").values())


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    from pytreeckpt.execute import _executor
    from pytreeckpt.loading import _run

    counted: list[int] = []
    original = _run.read_arrays

    def read(self: object, *args: object, **kwargs: object) -> int:
        n = original(self, *args, **kwargs)  # type: ignore[arg-type]
        counted.append(n)
        return n

    monkeypatch.setattr(_run, "read_arrays", read)  # (load's reads)
    monkeypatch.setattr(_executor, "read_arrays", read)  # (load_slice's and read_array's, imported as they run)
    small = Storage.read_small

    def read_small(self: Storage, metas: Any) -> list[bytes]:
        out = small(self, metas)
        counted.append(sum(m.nbytes for m in metas))
        return out

    monkeypatch.setattr(Storage, "read_small", read_small)
    return counted


def test_partial_restore_by_glob_reads_only_the_matching_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, state = trained_state()
    pytreeckpt.save(tmp_path / "c", state)
    counted = _count_reads(monkeypatch)
    out = pytreeckpt.load(tmp_path / "c", include=["model.*.weight", "step"])
    assert set(out) == {"model.0.weight", "model.1.weight", "model.2.weight", "step"}
    assert out["step"] == 3
    assert torch.equal(out["model.0.weight"], state["model"]["0.weight"])
    assert sum(counted) == sum(state["model"][k].numel() * 4 for k in ("0.weight", "1.weight", "2.weight"))
    with pytest.raises(pytreeckpt.TargetMismatchError, match="target=None"):
        pytreeckpt.load(tmp_path / "c", {"step": 0}, include="step")


def test_load_slice_reads_only_the_chunks_it_touches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    emb = torch.randn(64, 32)
    opts = pytreeckpt.ChunkingOptions(single_chunk_bytes=0, min_chunk_bytes=0, max_chunk_bytes=32 * 4 * 8)
    pytreeckpt.save(tmp_path / "c", {"emb": emb}, chunking=opts)  # chunks of 8 rows
    counted = _count_reads(monkeypatch)
    assert torch.equal(pytreeckpt.load_slice(tmp_path / "c", "emb", (slice(10, 12),)), emb[10:12])
    assert sum(counted) == 2 * 32 * 4  # the region itself: rows 10-11
    assert torch.equal(pytreeckpt.load_slice(tmp_path / "c", "emb", (-1, slice(3, 5))), emb[-1:, 3:5])
    assert pytreeckpt.load_slice(tmp_path / "c", "emb", (slice(5, 5),)).shape == (0, 32)
    with pytest.raises(pytreeckpt.TargetMismatchError, match="out of range"):
        pytreeckpt.load_slice(tmp_path / "c", "emb", 64)
    with pytest.raises(pytreeckpt.TargetMismatchError, match="step-1 slices"):
        pytreeckpt.load_slice(tmp_path / "c", "emb", slice(0, 10, 2))
    with pytest.raises(pytreeckpt.TargetMismatchError, match="'nope'"):
        pytreeckpt.load_slice(tmp_path / "c", "nope")


# --------------------------------------------------------------------------- inputs refused by name, before writing


def test_a_meta_device_target_is_refused_naming_the_leaf(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"layer": {"w": torch.ones(2, 3)}, "step": 1})
    with torch.device("meta"):
        model = torch.nn.Linear(3, 2)
    meta_target = {"layer": {"w": model.weight}, "step": 0}
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"'layer\.w'.*meta device.*to_empty.*Abstract"):
        pytreeckpt.load(tmp_path / "c", meta_target)
    sharded = ShardedLeaf.from_global(torch.empty(2, 3, device="meta"), ShardingSpec(Mesh(2), [Shard(0)]))
    with pytest.raises(pytreeckpt.TargetMismatchError, match=r"'layer\.w'.*meta device"):
        pytreeckpt.load(tmp_path / "c", {"layer": {"w": sharded}, "step": 0})
    model.to_empty(device="cpu")  # materialised as the message says: then it loads
    out = pytreeckpt.load(tmp_path / "c", {"layer": {"w": model.weight}, "step": 0})
    assert torch.equal(out["layer"]["w"], torch.ones(2, 3))


def _unstorable_tensors() -> list[tuple[str, torch.Tensor, str]]:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    return [
        ("meta", torch.empty(3, device="meta"), "meta device"),
        ("sparse", torch.eye(3).to_sparse(), "layout torch.sparse_coo"),
        ("csr", torch.eye(3).to_sparse_csr(), "layout torch.sparse_csr"),
        ("nested", nested, "nested tensor"),
        ("dims", torch.ones([1] * 64), "64 dims; a stored array has at most 32"),
        ("dims33", torch.ones([1] * 33), "33 dims"),
    ]


@pytest.mark.filterwarnings("ignore:.*[Ss]parse.*:UserWarning")
@pytest.mark.filterwarnings("ignore:.*nested tensors.*:UserWarning")
@pytest.mark.parametrize("save", [pytreeckpt.save, pytreeckpt.async_save])
def test_tensors_that_cannot_be_stored_are_refused_by_name_before_writing(tmp_path: Path, save: object) -> None:
    for name, t, why in _unstorable_tensors():
        with pytest.raises(pytreeckpt.CheckpointError, match=rf"'model\.{name}'.*{why}"):
            save(tmp_path / "c", {"model": {"ok": torch.ones(2), name: t}})  # type: ignore[operator]
        assert not (tmp_path / "c").exists(), name
    leaf = ShardedLeaf.from_global(torch.empty(4, device="meta"), ShardingSpec(Mesh(2), [Shard(0)]))
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'s'.*meta device"):
        save(tmp_path / "c", {"s": leaf})  # type: ignore[operator]
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'a'.*33 dims"):
        save(tmp_path / "c", {"a": np.ones([1] * 33)})  # type: ignore[operator]
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("save", [pytreeckpt.save, pytreeckpt.async_save])
def test_conjugate_and_negative_views_are_stored_resolved(tmp_path: Path, save: object) -> None:
    z = torch.randn(4, 3, dtype=torch.complex64)
    tree = {"conj": z.conj(), "neg": z.conj().imag, "conj_t": z.t().conj()}
    assert tree["conj"].is_conj()
    assert tree["neg"].is_neg()
    want = {k: v.resolve_conj().resolve_neg() for k, v in tree.items()}
    leaf = ShardedLeaf.from_global(want["conj"], ShardingSpec(Mesh(2), [Shard(0)]))
    conj_shards = ShardedLeaf(leaf.shape, leaf.dtype, leaf.spec, {r: s.conj().resolve_conj().conj()
                                                                   for r, s in leaf.shards.items()})  # fmt: skip
    tree["sharded"] = conj_shards
    want["sharded"] = want["conj"]
    handle = save(tmp_path / "c", tree)  # type: ignore[operator]
    if handle is not None:
        handle.wait()
    out = pytreeckpt.load(tmp_path / "c")
    for k, v in want.items():
        assert torch.equal(out[k], v), k


def test_a_nul_byte_in_a_path_is_refused_by_name(tmp_path: Path) -> None:
    bad = str(tmp_path / "c\0x")
    for call in (
        lambda: pytreeckpt.save(bad, {"w": torch.ones(1)}),
        lambda: pytreeckpt.async_save(bad, {"w": torch.ones(1)}),
        lambda: pytreeckpt.load(bad),
        lambda: pytreeckpt.metadata(bad),
        lambda: pytreeckpt.verify(bad),
        lambda: pytreeckpt.save({"driver": "memory", "path": "a\0b"}, {"w": torch.ones(1)}),
    ):
        with pytest.raises(pytreeckpt.CheckpointError, match=r"c\\x00x|a\\x00b.*NUL"):
            call()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    ("user", "why"),
    [
        ([1, 2], "mapping from str.*found list"),
        ({"betas": (0.9, 0.99)}, "would not come back equal.*tuples"),
        ({1: "x"}, "would not come back equal"),
        ({"nan": float("nan")}, "not a JSON object"),
        ({"t": torch.ones(1)}, "not a JSON object"),
    ],
)
def test_user_metadata_that_is_not_a_json_object_is_refused(tmp_path: Path, user: object, why: str) -> None:
    with pytest.raises(pytreeckpt.CheckpointError, match=f"user_metadata.*{why}"):
        pytreeckpt.save(tmp_path / "c", {"w": torch.ones(1)}, user_metadata=user)  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(1)}, user_metadata={"run": {"lr": [0.1, None, True]}})
    assert pytreeckpt.metadata(tmp_path / "c").user_metadata == {"run": {"lr": [0.1, None, True]}}


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (lambda: ShardingSpec(Mesh(2), [Shard(-1)]), r"Shard\(dim=-1\).*counts dims from 0.*Shard\(dim=1\)"),
        (lambda: ShardingSpec(Mesh((2, 2)), [Shard(0)]), r"a mesh of 2 axes .* needs 2 placements"),
        (lambda: ShardingSpec(Mesh(2), [Shard(2)]), r"Shard\(2\) .*more than 2 dims"),
        (lambda: FlatRanges([(0, 3), (3, 99)]), r"rank 1: flat range ends at 99"),
    ],
)
def test_spec_errors_name_the_leaf(tmp_path: Path, spec: Any, why: str) -> None:
    for save in (pytreeckpt.save, pytreeckpt.async_save):
        with pytest.raises(pytreeckpt.LayoutError, match=rf"leaf 'model\.w': {why}"):
            save(tmp_path / "c", {"model": {"w": torch.ones(4, 6)}}, {"model": {"w": spec()}})
        assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (lambda: ShardingSpec(Mesh(2), [Shard(2)]), r"Shard\(2\) .*more than 2 dims"),
        (lambda: ShardingSpec(Mesh((2, 2)), [Shard(0)]), r"a mesh of 2 axes .* needs 2 placements"),
        (lambda: FlatRanges([(0, 3), (3, 99)]), r"rank 1: flat range ends at 99"),
        (lambda: ExplicitRegions([[((0, 0), (6, 3))]]), r"rank 0: box .* does not lie inside"),
    ],
)
def test_an_abstract_whose_spec_does_not_fit_its_shape_is_an_error_naming_the_leaf(
    tmp_path: Path, spec: Any, why: str
) -> None:
    pytreeckpt.save(tmp_path / "c", {"model": {"w": torch.ones(5, 3)}})
    target = {"model": {"w": Abstract((5, 3), torch.float32, spec())}}
    fits = rf"leaf 'model\.w': the target's spec does not fit its shape \(5, 3\): {why}"
    with pytest.raises(pytreeckpt.CheckpointError, match=fits):
        pytreeckpt.load(tmp_path / "c", target)
    with pytest.raises(pytreeckpt.CheckpointError, match=rf"leaf 'model\.w': {why}"):
        pytreeckpt.plan_save(target)


# --------------------------------------------------------------------------- many dims


MANY_DIMS = [
    (2,) + (1,) * 19,  # the shape that hung: 20 dims, 2 elements
    (1,) * 32,
    (2,) + (1,) * 31,
    (3, 1, 2, 1, 1, 4) + (1,) * 20 + (2, 1, 1, 3, 1, 1),
    (1,) * 10 + (5,) + (1,) * 10 + (3,) + (1,) * 9 + (2,),
    (2,) * 8 + (1,) * 24,
]


@pytest.mark.parametrize("shape", MANY_DIMS, ids=lambda s: f"{len(s)}d-{math.prod(s)}")
def test_arrays_of_up_to_32_dims_save_and_load(tmp_path: Path, shape: tuple[int, ...]) -> None:
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    chunking = pytreeckpt.ChunkingOptions(single_chunk_bytes=16, min_chunk_bytes=8, max_chunk_bytes=32)
    big = max(range(len(shape)), key=lambda d: shape[d])
    sharded = ShardedLeaf.from_global(t, ShardingSpec(Mesh((2, 2)), [Shard(big), Replicate()]))
    pytreeckpt.save(tmp_path / "s", {"w": t, "sh": sharded}, chunking=chunking)
    pytreeckpt.async_save(tmp_path / "a", {"w": t, "sh": sharded}, chunking=chunking).wait()
    assert math.prod(pytreeckpt.metadata(tmp_path / "s").arrays["w"].chunk_shape) < t.numel() or t.numel() <= 4
    index = tuple(slice(n // 2, n) for n in shape)
    for where in ("s", "a"):
        out = pytreeckpt.load(tmp_path / where)
        assert torch.equal(out["w"], t)
        assert torch.equal(out["sh"], t)
        again = pytreeckpt.load(tmp_path / where, {"w": Abstract(shape, torch.float32), "sh": sharded})
        assert torch.equal(again["sh"].to_global(), t)
        assert torch.equal(pytreeckpt.load_slice(tmp_path / where, "w", index), t[index])


_BAD_ARGS = [
    ("save", "chunking", "abc", TypeError, r"save: chunking must be a ChunkingOptions or None, found str 'abc'"),
    ("save", "executor", "fast", TypeError, r"save: executor must be an ExecutorOptions or None, found str 'fast'"),
    ("save", "overwrite", "yes", TypeError, r"save: overwrite must be True or False, found str 'yes'"),
    ("save", "namespace", 3, TypeError, r"save: namespace must be a str, found int 3"),
    ("save", "monitor", [], TypeError, r"save: monitor must be a Monitor or None, found list \[\]"),
    ("save", "chunk_hashes", 1, TypeError, r"save: chunk_hashes must be True or False, found int 1"),
    ("save", "check_replicas", "some", ValueError, r"check_replicas must be 'small' or 'all', found 'some'"),
    ("async_save", "chunking", {"max_chunk_bytes": 1}, TypeError, r"async_save: chunking must be a ChunkingOptions"),
    ("async_save", "snapshot", "now", ValueError, r"snapshot must be 'eager' or 'lazy', found 'now'"),
    ("load", "executor", 16, TypeError, r"load: executor must be an ExecutorOptions or None, found int 16"),
    ("load", "inplace", None, TypeError, r"load: inplace must be True or False, found NoneType None"),
    ("load", "strict", "no", TypeError, r"load: strict must be True or False"),
    ("load", "cast", 0, TypeError, r"load: cast must be True or False"),
    ("load", "report", {}, TypeError, r"load: report must be a LoadReport or None, found dict \{\}"),
    ("verify", "executor", "fast", TypeError, r"verify: executor must be an ExecutorOptions or None"),
    ("metadata", "namespace", None, TypeError, r"metadata: namespace must be a str"),
]


@pytest.mark.parametrize(("entry", "name", "value", "error", "message"), _BAD_ARGS)
def test_an_argument_of_the_wrong_type_or_value_is_refused_naming_it_before_any_io(
    tmp_path: Path, entry: str, name: str, value: Any, error: type[Exception], message: str
) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})
    before = sorted(p.name for p in tmp_path.rglob("*"))
    fn = getattr(pytreeckpt, entry)
    args: tuple[Any, ...] = (tmp_path / "new", {"w": torch.ones(2)}) if "save" in entry else (tmp_path / "c",)
    if entry == "load":
        args = (tmp_path / "c", {"w": torch.zeros(2)})
    with pytest.raises(error, match=message):
        fn(*args, **{name: value})
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing made, nothing changed


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: pytreeckpt.ExecutorOptions(file_io_concurrency=0),
            ValueError,
            r"file_io_concurrency must be at least 1",
        ),
        (lambda: pytreeckpt.ExecutorOptions(max_inflight_bytes="1GB"), TypeError, r"max_inflight_bytes must be an int"),
        (lambda: pytreeckpt.ExecutorOptions(staging_bytes=-1), ValueError, r"staging_bytes must be at least 1"),
        (lambda: pytreeckpt.ExecutorOptions(progress="yes"), TypeError, r"progress must be True or False"),
        (lambda: pytreeckpt.ExecutorOptions(exit_timeout=-1), ValueError, r"exit_timeout must be seconds"),
        (lambda: pytreeckpt.ExecutorOptions(exit_timeout=float("nan")), ValueError, r"exit_timeout must be seconds"),
        (lambda: pytreeckpt.ExecutorOptions(background_nice=2.5), ValueError, r"background_nice is a niceness"),
        (lambda: pytreeckpt.ChunkingOptions(max_chunk_bytes=0), ValueError, r"max_chunk_bytes must be at least 1"),
        (lambda: pytreeckpt.ChunkingOptions(single_chunk_bytes=1.5), TypeError, r"single_chunk_bytes must be an int"),
        (lambda: pytreeckpt.ChunkingOptions(min_chunk_bytes=-3), ValueError, r"min_chunk_bytes must be at least 0"),
    ],
)
def test_options_of_the_wrong_type_or_value_are_refused_when_made(
    make: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make()
