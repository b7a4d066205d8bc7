"""Every dtype round-trips bit for bit, in every shape."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import bits, unpacked

import pytreeckpt

ALL_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
    torch.uint64, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64,
    torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.bits8, torch.bits16,
]  # fmt: skip


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Every bit pattern is fair game: NaNs with payloads, infinities, -0.0, subnormals."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2 == 1).reshape(shape)
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    tree = {
        "matrix": random_bits((7, 5), dtype, 1),
        "scalar": random_bits((), dtype, 2),
        "empty": random_bits((0, 5), dtype),
        "transposed": random_bits((4, 6), dtype, 3).t(),  # not contiguous
    }
    pytreeckpt.save(tmp_path / "c", tree)
    out = pytreeckpt.load(tmp_path / "c")
    for k, v in tree.items():
        assert out[k].dtype == dtype, k
        assert out[k].shape == v.shape, k
        assert torch.equal(bits(out[k]), bits(v)), k
    # and into a target of the same dtype, sharded
    target = {"matrix": pytreeckpt.Abstract((7, 5), dtype, pytreeckpt.FlatRanges([(0, 11), (11, 35)]))}
    sharded = pytreeckpt.load(tmp_path / "c", target, strict=False)["matrix"]
    assert torch.equal(bits(sharded.to_global()), bits(tree["matrix"]))


def test_special_float_values_survive(tmp_path: Path) -> None:
    special = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, 5e-324, -1.5]
    tree = {
        str(dt): torch.tensor(special, dtype=torch.float64).to(dt)
        for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    }
    payload = torch.tensor([0x7FC00123, 0xFFC00001], dtype=torch.int64).to(torch.int32).view(torch.float32)
    tree["nan_payloads"] = payload
    pytreeckpt.save(tmp_path / "c", tree)
    out = pytreeckpt.load(tmp_path / "c")
    for k, v in tree.items():
        assert torch.equal(bits(out[k]), bits(v)), k


def test_numpy_leaves_come_back_as_numpy(tmp_path: Path) -> None:
    tree = {
        "f32": np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4),
        "bf16": np.array([1.5, -2.25, np.nan], dtype=ml_dtypes.bfloat16),
        "f8": np.array([0.5, 448], dtype=ml_dtypes.float8_e4m3fn),
        "u64": np.array([2**64 - 1, 0], dtype=np.uint64),
        "scalar": np.float64(3.25),
        "bool": np.array([True, False]),
    }
    pytreeckpt.save(tmp_path / "c", tree)
    out = pytreeckpt.load(tmp_path / "c")
    for k, v in tree.items():
        v = np.asarray(v)
        assert isinstance(out[k], np.ndarray), k
        assert out[k].dtype == v.dtype, k
        assert out[k].tobytes() == v.tobytes(), k
    # a numpy leaf loads into a torch target of the same dtype
    t = pytreeckpt.load(tmp_path / "c", {"bf16": torch.zeros(3, dtype=torch.bfloat16)}, strict=False)["bf16"]
    assert t.view(torch.int16).numpy().tobytes() == tree["bf16"].tobytes()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_quantized_dtype_is_refused_naming_the_leaf(tmp_path: Path) -> None:
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'layer\.q'.*cannot be stored"):
        pytreeckpt.save(tmp_path / "c", {"layer": {"q": q}})


def _saves(tmp_path: Path, tree: dict[str, object], packed: bool) -> dict[str, object]:
    """The same tree through save, async_save, a lazy snapshot and an incremental save."""
    paths = {how: tmp_path / how for how in ("save", "async", "lazy", "incremental")}
    at = {how: p if packed else unpacked(p) for how, p in paths.items()}
    pytreeckpt.save(at["save"], tree, chunk_hashes=True)
    pytreeckpt.async_save(at["async"], tree).wait()
    pytreeckpt.async_save(at["lazy"], tree, snapshot="lazy").wait()
    pytreeckpt.async_save(at["incremental"], tree, base=paths["save"]).wait()
    return at


@pytest.mark.parametrize("packed", [True, False])
def test_big_endian_numpy_arrays_come_back_equal_through_every_save(tmp_path: Path, packed: bool) -> None:
    # The staging copy of an asynchronous save used to copy their raw bits into a
    # little-endian buffer: [0, 1, 2, 3] came back as [0, 4.6e-41, 9.0e-44, ...].
    tree = {
        ">f4": np.arange(4, dtype=">f4"),
        ">i8": np.arange(-3, 3, dtype=">i8").reshape(2, 3)[:, ::-1],
        ">c16": np.array([1 + 2j, -3.5j], dtype=">c16"),
        ">u2": np.asfortranarray(np.arange(6, dtype=">u2").reshape(2, 3)),
    }
    for how, path in _saves(tmp_path, tree, packed).items():
        out = pytreeckpt.load(path)
        for k, v in tree.items():
            assert out[k].dtype == v.dtype.newbyteorder("="), (how, k)
            assert np.array_equal(out[k], v), (how, k, out[k])


def test_numpy_uint4_without_a_stored_form_is_refused_by_name_before_writing(tmp_path: Path) -> None:
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'q'.*uint4 cannot be stored"):
        pytreeckpt.save(tmp_path / "c", {"q": np.zeros(4, dtype=ml_dtypes.uint4)})
    assert not (tmp_path / "c").exists()


def test_an_incremental_base_of_empty_arrays_is_a_base(tmp_path: Path) -> None:
    # Arrays of no chunks have no hashes to record; such a base used to be refused.
    tree = {"empty": torch.zeros(0, 3), "none": np.zeros((2, 0), dtype=np.float32)}
    pytreeckpt.save(tmp_path / "a", tree, chunk_hashes=True)
    pytreeckpt.save(tmp_path / "b", tree, base=tmp_path / "a")
    assert pytreeckpt.load(tmp_path / "b")["empty"].shape == (0, 3)


def test_a_masked_array_is_refused_rather_than_lose_its_mask(tmp_path: Path) -> None:
    masked = np.ma.masked_array([1.0, 2.0, 3.0], mask=[False, True, False])
    with pytest.raises(pytreeckpt.CheckpointError, match=r"'m'.*masked array.*mask would be lost"):
        pytreeckpt.save(tmp_path / "c", {"m": masked})
    assert not (tmp_path / "c").exists()
