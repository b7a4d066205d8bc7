"""load(..., cast=True): stored arrays converted to the target's dtype as Tensor.to does, a chunk at a time;
load(..., strict=False): the leaves both have loaded, the others reported in a LoadReport."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from cast_workers import disagreeing_casts, dtensor_cast, special_values
from helpers import unpacked
from multiproc import run_world

import pytreeckpt
from pytreeckpt import (
    Abstract,
    ChunkingOptions,
    Location,
    Mesh,
    Shard,
    ShardedLeaf,
    ShardingSpec,
    StorageOptions,
    TargetMismatchError,
)
from pytreeckpt.storage import Storage


def _bits(x: Any) -> bytes:
    if isinstance(x, np.ndarray):
        return x.tobytes()
    return bytes(x.detach().contiguous().view(-1).view(torch.uint8).numpy())


# Where arrays are stored: small ones packed in zip archives (read whole without a plan), in an OCDBT
# database, in chunk files of their own cut in several chunks, compressed (through TensorStore).
STORES = ["zip", "ocdbt", "files", "compressed"]
_SMALL = ChunkingOptions(single_chunk_bytes=4096, min_chunk_bytes=1024, max_chunk_bytes=4096)


def _save(tmp: Path, store: str, state: Any) -> Any:
    if store == "zip":
        pytreeckpt.save(tmp / "c", state)
        return tmp / "c"
    if store == "ocdbt":
        loc = Location(tmp / "c", StorageOptions(pack_format="ocdbt"))
        pytreeckpt.save(loc, state)
        return loc
    if store == "files":
        pytreeckpt.save(unpacked(tmp / "c"), state, chunking=_SMALL)
        return unpacked(tmp / "c")
    pytreeckpt.save(tmp / "c", state, compression="zstd", chunking=_SMALL)
    return tmp / "c"


def _state() -> dict[str, Any]:
    return {
        "w": special_values((48, 40), 1),  # 7.5 KiB: several chunks with _SMALL
        "p": torch.nn.Parameter(special_values((6, 5), 2)),
        "d": special_values((10, 3), 3).double(),
        "i": torch.arange(-20, 20, dtype=torch.int64).reshape(4, 10) * 100_000_007,
        "b": special_values((16, 4), 4).to(torch.bfloat16),
        "np": special_values((5, 7), 5).double().numpy(),
        "step": 7,
    }


# target dtype of each array leaf, and the torch dtype its numpy target has
_TO = {"w": torch.bfloat16, "p": torch.float16, "d": torch.float32, "i": torch.int32, "b": torch.float32}


def _target(state: dict[str, Any]) -> dict[str, Any]:
    t: dict[str, Any] = {k: torch.zeros(state[k].shape, dtype=d) for k, d in _TO.items()}
    t["p"] = torch.nn.Parameter(t["p"], requires_grad=False)
    t["np"] = np.zeros(state["np"].shape, np.float32)
    t["step"] = 0
    return t


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("inplace", [False, True])
def test_cast_rounds_as_tensor_to_for_every_store(tmp_path: Path, store: str, inplace: bool) -> None:
    state = _state()
    path = _save(tmp_path, store, state)
    target = _target(state)
    report = pytreeckpt.LoadReport()
    out = pytreeckpt.load(path, target, cast=True, inplace=inplace, report=report)
    for k, d in _TO.items():
        want = state[k].detach().to(d)
        assert out[k].dtype == d, k
        assert _bits(out[k]) == _bits(want), k
        assert (out[k] is target[k]) == inplace, k
    assert type(out["p"]) is torch.nn.Parameter
    assert not out["p"].requires_grad
    assert out["np"].dtype == np.float32
    assert _bits(out["np"]) == _bits(state["np"].astype(np.float32))
    assert (out["np"] is target["np"]) == inplace
    assert out["step"] == 7
    assert sorted(report.cast) == sorted(
        [(k, str(state[k].dtype).removeprefix("torch."), str(d).removeprefix("torch.")) for k, d in _TO.items()]
        + [("np", "float64", "float32")]
    )
    assert report.missing == []
    assert report.unexpected == []


def test_small_packed_arrays_are_cast_on_the_lean_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"a": special_values((8, 8), 1), "i": torch.arange(-3, 3) * 3_000_000_019}
    pytreeckpt.save(tmp_path / "c", state)
    leaned: list[str] = []
    original = Storage.read_small

    def read_small(self: Storage, metas: Any) -> list[bytes]:
        leaned.extend(m.key for m in metas)
        return original(self, metas)

    monkeypatch.setattr(Storage, "read_small", read_small)
    target = {"a": torch.zeros(8, 8, dtype=torch.bfloat16), "i": torch.zeros(6, dtype=torch.int32)}
    out = pytreeckpt.load(tmp_path / "c", target, cast=True)
    assert sorted(leaned) == ["a", "i"]  # read whole from the archive, without a plan, and cast
    assert _bits(out["a"]) == _bits(state["a"].to(torch.bfloat16))
    assert _bits(out["i"]) == _bits(state["i"].to(torch.int32))  # (wrapped, as Tensor.to wraps)


def test_float32_to_bfloat16_is_bit_equal_to_tensor_to_with_nan_inf_and_subnormals(tmp_path: Path) -> None:
    x = special_values((256, 64), 9)
    ties = torch.tensor([1 + k / 256 for k in range(256)])  # every rounding case of bfloat16's last bit
    pytreeckpt.save(tmp_path / "c", {"x": x, "ties": ties})
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float64):
        target = {"x": torch.empty(x.shape, dtype=dtype), "ties": torch.empty(256, dtype=dtype)}
        out = pytreeckpt.load(tmp_path / "c", target, cast=True)
        assert _bits(out["x"]) == _bits(x.to(dtype)), dtype
        assert _bits(out["ties"]) == _bits(ties.to(dtype)), dtype
        assert out["x"].isnan().sum() == x.to(dtype).isnan().sum()


def test_cast_into_sharded_and_abstract_targets_resharded(tmp_path: Path) -> None:
    full = special_values((24, 40), 4)
    saved = ShardedLeaf.from_global(full, ShardingSpec(Mesh(2), [Shard(0)]))
    pytreeckpt.save(tmp_path / "c", {"s": saved, "a": full, "f": full}, chunking=_SMALL)
    spec3 = ShardingSpec(Mesh(3), [Shard(1)])
    into = ShardedLeaf.from_global(torch.zeros(24, 40, dtype=torch.bfloat16), spec3)
    target = {
        "s": into,
        "a": Abstract((24, 40), torch.float16, spec3),
        "f": Abstract((24, 40), torch.bfloat16),
    }
    out = pytreeckpt.load(tmp_path / "c", target, cast=True)
    assert out["s"].dtype == torch.bfloat16
    assert _bits(out["s"].to_global()) == _bits(full.to(torch.bfloat16))
    assert out["a"].dtype == torch.float16
    assert _bits(out["a"].to_global()) == _bits(full.to(torch.float16))
    assert out["f"].dtype == torch.bfloat16
    assert _bits(out["f"]) == _bits(full.to(torch.bfloat16))
    shards = dict(into.shards)
    again = pytreeckpt.load(tmp_path / "c", {"s": into}, cast=True, inplace=True, strict=False)
    assert again["s"] is into
    assert all(into.shards[p] is t for p, t in shards.items())
    assert _bits(into.to_global()) == _bits(full.to(torch.bfloat16))


def test_a_dtype_mismatch_without_cast_stays_an_error(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"w": torch.randn(4, 4)})
    with pytest.raises(TargetMismatchError, match=r"'w'.*float32.*bfloat16.*cast=True"):
        pytreeckpt.load(tmp_path / "c", {"w": torch.zeros(4, 4, dtype=torch.bfloat16)})


def test_casts_that_would_lose_data_or_have_no_arithmetic_are_refused(tmp_path: Path) -> None:
    pytreeckpt.save(
        tmp_path / "c",
        {"z": torch.randn(3, dtype=torch.complex64), "raw": torch.zeros(4, dtype=torch.uint8).view(torch.bits8)},
    )
    target = {"z": torch.zeros(3), "raw": torch.zeros(4, dtype=torch.float32)}
    with pytest.raises(TargetMismatchError) as e:
        pytreeckpt.load(tmp_path / "c", target, cast=True)
    text = str(e.value)
    assert "leaf 'z': the checkpoint's complex64 cannot be cast to the target's float32" in text
    assert "imaginary" in text
    assert "leaf 'raw': the checkpoint's bits8 cannot be cast to the target's float32" in text
    # complex to a wider complex, bool to float, float to int: as torch does
    pytreeckpt.save(
        tmp_path / "d", {"z": torch.tensor([1 + 2j]), "b": torch.tensor([True, False]), "f": torch.tensor([2.7, -2.7])}
    )
    out = pytreeckpt.load(
        tmp_path / "d",
        {"z": torch.zeros(1, dtype=torch.complex128), "b": torch.zeros(2), "f": torch.zeros(2, dtype=torch.int8)},
        cast=True,
    )
    assert out["z"].dtype == torch.complex128
    assert out["z"].item() == 1 + 2j
    assert out["b"].tolist() == [1.0, 0.0]
    assert out["f"].tolist() == [2, -2]


def test_a_string_value_into_an_array_target_is_a_mismatch_even_with_cast(tmp_path: Path) -> None:
    pytreeckpt.save(tmp_path / "c", {"name": "run-1"})
    with pytest.raises(TargetMismatchError, match=r"'name'.*value 'run-1'.*array"):
        pytreeckpt.load(tmp_path / "c", {"name": torch.zeros(1)}, cast=True)


_PEAK = """
import sys, torch, pytreeckpt
def status(field):  # kB
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024
path, n, inplace = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
pytreeckpt.load(sys.argv[4], {"t": torch.zeros(4)})  # everything a load loads and starts, on a tiny checkpoint
target = {"w": torch.ones(n, dtype=torch.bfloat16)}  # its pages touched
opts = pytreeckpt.ExecutorOptions(max_inflight_bytes=4 << 20, huge_pages=False)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set size (VmHWM) starts again from the resident set now
before = status("VmRSS:")
out = pytreeckpt.load(path, target, cast=True, inplace=inplace, executor=opts)
peak = status("VmHWM:")
assert out["w"].dtype == torch.bfloat16 and float(out["w"][-1]) == float(torch.tensor(n - 1.0).bfloat16())
print(peak - before, before)
"""


@pytest.mark.parametrize("inplace", [True, False])
def test_a_cast_load_holds_a_few_chunks_of_the_stored_dtype_not_the_array(tmp_path: Path, inplace: bool) -> None:
    n = 24 << 20  # 24 Mi float32 elements: 96 MiB stored, 48 MiB in bfloat16
    pytreeckpt.save(
        unpacked(tmp_path / "c"),
        {"w": torch.arange(n, dtype=torch.float32)},
        chunking=ChunkingOptions(max_chunk_bytes=1 << 20),
    )
    pytreeckpt.save(tmp_path / "tiny", {"t": torch.zeros(4)})
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_PEAK),
            str(tmp_path / "c"),
            str(n),
            str(int(inplace)),
            str(tmp_path / "tiny"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    extra = int(run.stdout.split()[-2])
    stored = 4 * n
    # in place: the reads' buffers only (4 MiB in flight, 1 MiB chunks); a new tensor: its 48 MiB besides
    bound = (16 << 20) if inplace else (48 << 20) + (16 << 20)
    assert extra < bound, f"the peak grew by {extra / 2**20:.1f} MiB during a cast load of {stored / 2**20:.0f} MiB"
    assert extra < stored / 1.4  # (never a float32 copy of the array)


# ---------------------------------------------------------------- strict


def _saved(tmp: Path) -> Path:
    pytreeckpt.save(
        tmp / "c",
        {"model": {"w": torch.randn(4, 3), "b": torch.randn(3)}, "optim": {"m": torch.randn(4, 3)}, "step": 5},
    )
    return tmp / "c"


def test_strict_lists_both_sides(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    target = {"model": {"w": torch.zeros(4, 3), "extra": torch.zeros(2)}, "step": 0}
    report = pytreeckpt.LoadReport()
    with pytest.raises(TargetMismatchError) as e:
        pytreeckpt.load(path, target, report=report)
    text = str(e.value)
    assert "leaf 'model.extra' of the target is not in the checkpoint" in text
    assert "leaf 'model.b' of the checkpoint is not in the target" in text
    assert "leaf 'optim.m' of the checkpoint is not in the target" in text
    assert "strict=False" in text
    assert report.missing == ["model.extra"]
    assert report.unexpected == ["model.b", "optim.m"]


def test_strict_refuses_a_target_that_asks_for_a_subset(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(TargetMismatchError, match=r"'optim.m' of the checkpoint is not in the target"):
        pytreeckpt.load(path, {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "step": 0})


def test_non_strict_loads_what_both_have_and_reports_the_rest(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    whole = pytreeckpt.load(path)
    extra, b = torch.full((2,), 9.0), torch.zeros(3)
    target = {"model": {"w": torch.zeros(4, 3), "extra": extra, "b": b}, "new_step": 11}
    report = pytreeckpt.LoadReport(missing=["stale"])
    out = pytreeckpt.load(path, target, strict=False, report=report)
    assert torch.equal(out["model"]["w"], whole["model"]["w"])
    assert torch.equal(out["model"]["b"], whole["model"]["b"])
    assert out["model"]["extra"] is extra
    assert out["new_step"] == 11
    assert report.missing == ["model.extra", "new_step"]
    assert report.unexpected == ["optim.m", "step"]
    assert report.cast == []
    # in place too: the kept leaves are the target's, the loaded ones filled
    out = pytreeckpt.load(path, target, strict=False, inplace=True)
    assert out["model"]["b"] is b
    assert torch.equal(b, whole["model"]["b"])
    assert out["model"]["extra"] is extra


def test_non_strict_does_not_read_the_leaves_not_asked_for(tmp_path: Path) -> None:
    state = {"keep": torch.randn(64, 64), "gone": torch.randn(64, 64)}
    pytreeckpt.save(unpacked(tmp_path / "c"), state)
    meta = pytreeckpt.metadata(tmp_path / "c").arrays["gone"]
    for f in (tmp_path / "c" / meta.path).rglob("*"):
        if f.is_file() and "zarr.json" not in f.name:
            f.write_bytes(b"damaged")  # a read of it would fail its checksum
    out = pytreeckpt.load(tmp_path / "c", {"keep": torch.zeros(64, 64)}, strict=False)
    assert torch.equal(out["keep"], state["keep"])


def test_non_strict_still_refuses_other_shapes_and_kinds(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(
        TargetMismatchError, match=r"'model.w': the checkpoint has shape \(4, 3\), the target has \(3, 4\)"
    ):
        pytreeckpt.load(path, {"model": {"w": torch.zeros(3, 4)}}, strict=False)
    with pytest.raises(TargetMismatchError, match=r"'step'.*value 5.*array"):
        pytreeckpt.load(path, {"step": torch.zeros(1)}, strict=False)
    with pytest.raises(TargetMismatchError, match=r"'model.b'.*float32.*float16"):
        pytreeckpt.load(path, {"model": {"b": torch.zeros(3, dtype=torch.float16)}}, strict=False)


def test_cast_and_strict_need_a_target_and_include_is_unaffected(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(pytreeckpt.CheckpointError, match="pass target"):
        pytreeckpt.load(path, strict=False)
    with pytest.raises(pytreeckpt.CheckpointError, match="pass target"):
        pytreeckpt.load(path, cast=True)
    assert set(pytreeckpt.load(path, include="model.*")) == {"model.w", "model.b"}


def test_plan_load_matches_as_load_does(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    target = {"model": {"w": Abstract((4, 3), torch.bfloat16)}}
    with pytest.raises(TargetMismatchError):
        pytreeckpt.plan_load(path, target)
    plan = pytreeckpt.plan_load(path, target, cast=True, strict=False)
    assert len(plan.arrays) == 1


# ---------------------------------------------------------------- distributed


@pytest.mark.parametrize("inplace", [False, True])
def test_dtensor_cast_on_gloo_ranks(tmp_path: Path, inplace: bool) -> None:
    results = run_world(2, dtensor_cast, str(tmp_path / "c"), inplace)
    unexpected = ["step"] if not inplace else ["s", "step"]
    casts = [["w", "float32", "bfloat16"], ["v", "float32", "float16"], ["n", "int64", "int32"]]
    if not inplace:
        casts.append(["s", "float32", "float16"])
    for got in results:
        assert got["missing"] == ["extra"]
        assert got["unexpected"] == unexpected
        assert [list(c) for c in got["cast"]] == casts
        for k in ("w_dtensor", "w", "v", "n", "extra_kept"):
            assert got[k], (k, got)
        assert got["same_objects"] == inplace
        if not inplace:
            assert got["s"]
    assert json.dumps(results[0]) == json.dumps(results[1])  # the same report on every rank


def test_ranks_casting_one_array_to_different_dtypes_all_raise_on_gloo(tmp_path: Path) -> None:
    said = run_world(2, disagreeing_casts, str(tmp_path / "c"))
    for text in said:
        assert "loaded" not in text
        assert "disagree" in text or "differ" in text, text
