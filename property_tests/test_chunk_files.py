"""The executor's own chunk files are TensorStore's, byte for byte, and it reads TensorStore's exactly.

For any shape, chunk shape and element type, a chunk written by ``write_chunk`` is the
file TensorStore writes for that chunk (edge padding and checksum included), its
checksum is ``chunk_crc`` of the chunk's elements (what the metadata records, whatever
the source's strides or byte order), and ``read_chunk`` puts any box of a chunk
TensorStore wrote into any destination view, contiguous or strided, bit for bit.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np
import tensorstore as ts
from hypothesis import given, settings
from hypothesis import strategies as st

from pytreeckpt.core._dtypes import dtype_of_numpy
from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.core._region import Region
from pytreeckpt.format import zarr_metadata
from pytreeckpt.storage import _chunkfiles as chunkfiles
from pytreeckpt.storage._chunkfiles import chunk_crc, read_chunk, write_chunk

DTYPES = [np.dtype(t) for t in (np.float32, ml_dtypes.bfloat16, np.int8, np.bool_, np.complex64)]


@st.composite
def arrays(draw: st.DrawFn) -> tuple[np.ndarray, tuple[int, ...]]:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    chunk = tuple(draw(st.integers(1, n + 2)) for n in shape)  # edge chunks, and chunks past the array
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    data = raw.view(dtype).reshape(shape) if dtype != np.bool_ else (raw % 2).astype(np.bool_).reshape(shape)
    return data, chunk


def _tensorstore_array(root: Path, data: np.ndarray, chunk: tuple[int, ...]) -> ts.TensorStore:
    meta = zarr_metadata(dtype_of_numpy(data.dtype), data.shape, chunk)
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(root) + "/"},
        "metadata": meta,
        "store_data_equal_to_fill_value": True,
    }
    return ts.open(spec, create=True).result()


def _key(index: tuple[int, ...]) -> str:
    return "/".join(["c", *map(str, index)])


@settings(max_examples=60)
@given(arrays())
def test_a_chunk_written_here_is_the_file_tensorstore_writes(case: tuple[np.ndarray, tuple[int, ...]]) -> None:
    data, chunk = case
    with tempfile.TemporaryDirectory() as d:
        store = _tensorstore_array(Path(d) / "ts", data, chunk)
        store.write(data).result()
        for index in ChunkGrid(data.shape, chunk).touching(Region.full(data.shape)):
            box = ChunkGrid(data.shape, chunk).region(index)
            mine = Path(d) / "mine" / _key(index)
            mine.parent.mkdir(parents=True, exist_ok=True)
            # a strided source: every chunk's box as a view of a bigger array
            wide = np.zeros((*box.shape[:-1], box.shape[-1] * 2), dtype=data.dtype)
            wide[..., ::2] = data[box.slices()]
            crc = write_chunk(mine, wide[..., ::2], chunk, fsync=False)
            theirs = (Path(d) / "ts" / _key(index)).read_bytes()
            assert mine.read_bytes() == theirs, index
            assert crc == int.from_bytes(theirs[-4:], "little") == chunk_crc(wide[..., ::2], chunk), index
            if data.dtype.kind in "iufc" and data.dtype.itemsize > 1:  # big-endian sources: the stored bytes
                swapped = data[box.slices()].astype(data.dtype.newbyteorder(">"))
                assert chunk_crc(swapped, chunk) == crc == chunk_crc(swapped, chunk, data.dtype), index


@settings(max_examples=60)
@given(arrays(), st.data())
def test_any_box_of_a_tensorstore_chunk_reads_exactly(
    case: tuple[np.ndarray, tuple[int, ...]], draw: st.DataObject
) -> None:
    data, chunk = case
    with tempfile.TemporaryDirectory() as d:
        store = _tensorstore_array(Path(d), data, chunk)
        store.write(data).result()
        for index in ChunkGrid(data.shape, chunk).touching(Region.full(data.shape)):
            whole = ChunkGrid(data.shape, chunk).region(index)
            lo = [draw.draw(st.integers(0, n - 1)) for n in whole.shape]
            hi = [draw.draw(st.integers(a + 1, n)) for a, n in zip(lo, whole.shape, strict=True)]
            if draw.draw(st.booleans()):  # the whole valid part: the straight-into-memory path
                lo, hi = [0] * len(chunk), list(whole.shape)
            box = tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))
            shape = tuple(b - a for a, b in zip(lo, hi, strict=True))
            strided = draw.draw(st.booleans())
            out = np.zeros((*shape[:-1], shape[-1] * (2 if strided else 1)), dtype=data.dtype)
            dest = out[..., ::2] if strided else out
            other = np.zeros(whole.shape, dtype=data.dtype)  # a second target: the whole chunk
            targets = (
                [(box, dest)] if draw.draw(st.booleans()) else [(box, dest), (whole.relative_to(whole).slices(), other)]
            )
            read_chunk(Path(d) / _key(index), chunk, whole.shape, targets, f"chunk {list(index)}")
            expected = data[whole.slices()][box]
            assert dest.tobytes() == expected.tobytes(), (index, box)
            if len(targets) == 2:
                assert other.tobytes() == data[whole.slices()].tobytes(), index


def _written_in_a_new_thread(path: Path, data: np.ndarray, chunk: tuple[int, ...], direct: bool) -> int:
    """``write_chunk`` on a thread of its own: its bounce buffer is made anew, at the size patched in."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(write_chunk(path, data, chunk, fsync=True, direct=direct)))
    t.start()
    t.join()
    assert out, "write_chunk raised"
    return int(out[0])


@settings(max_examples=60)
@given(arrays(), st.sampled_from([4096, 8192]))
def test_a_chunk_written_around_the_page_cache_is_the_same_file(
    case: tuple[np.ndarray, tuple[int, ...]], bounce: int
) -> None:
    """``direct=True`` (O_DIRECT through a bounce buffer, the tail buffered) writes the file the buffered path
    writes: here every chunk, however small, goes the direct way, through a buffer of one or two blocks."""
    data, chunk = case
    with (
        tempfile.TemporaryDirectory() as d,
        mock.patch.object(chunkfiles, "DIRECT_MIN_BYTES", 0),
        mock.patch.object(chunkfiles, "_BOUNCE_BYTES", bounce),
        mock.patch.object(chunkfiles, "_pwrite_direct", wraps=chunkfiles._pwrite_direct) as direct_writes,
    ):
        for index in ChunkGrid(data.shape, chunk).touching(Region.full(data.shape)):
            box = ChunkGrid(data.shape, chunk).region(index)
            plain, direct = Path(d) / "plain" / _key(index), Path(d) / "direct" / _key(index)
            for p in (plain, direct):
                p.parent.mkdir(parents=True, exist_ok=True)
            crc = _written_in_a_new_thread(plain, data[box.slices()], chunk, direct=False)
            assert _written_in_a_new_thread(direct, data[box.slices()], chunk, direct=True) == crc
            assert direct.read_bytes() == plain.read_bytes(), index
        nbytes = int(np.prod(chunk)) * data.dtype.itemsize + 4
        assert direct_writes.called == (nbytes >= 4096)  # (a file under one block is all tail)
