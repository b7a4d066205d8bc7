"""Example trees shared by the test files."""

from __future__ import annotations

import collections
import dataclasses
import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import optree
import torch

import pytreeckpt

NAMESPACE = "pytreeckpt-tests"

HANG = 600.0
"""Seconds a child process, a rank or a wait in a test may take before it counts as hung: only a guard against
a hang, never a measure of speed (the suite must pass on a busy machine, a load of 8 on 2 cores)."""

_HELD_AFTER = """
import builtins, runpy, sys, threading
step = sys.argv.pop(1)
sys.argv.pop(0)
said = builtins.print

def print(*args, **kwargs):
    said(*args, **kwargs)
    if args and str(args[0]).startswith(f"step {step} "):
        threading.Event().wait()  # the training loop goes no further: it is killed here

builtins.print = print
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def killed_after_step(cmd: list[str], step: int) -> None:
    """Run the training script ``cmd`` (``[python, script, *args]``, printing ``step N ...`` at each step) until it
    has printed step ``step``, and kill it there: held at that line (its saves in flight go on), so that
    it never runs ahead of the kill, however the machine schedules the two processes."""
    held = [cmd[0], "-c", _HELD_AFTER, str(step), *cmd[1:]]
    with subprocess.Popen(held, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(f"step {step} "):
                proc.send_signal(signal.SIGKILL)  # the training process dies
                break
        else:
            proc.kill()
        proc.wait(HANG)
    assert proc.returncode == -signal.SIGKILL, f"{cmd} ended before step {step} ({proc.returncode})"


class Pair:
    """A container registered with optree in the tests' namespace."""

    def __init__(self, left: Any, right: Any, tag: str = "pair") -> None:
        self.left, self.right, self.tag = left, right, tag

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pair) and (self.left, self.right, self.tag) == (other.left, other.right, other.tag)


optree.register_pytree_node(
    Pair,
    lambda p: ((p.left, p.right), p.tag, ("left", "right")),
    lambda tag, children: Pair(*children, tag=tag),
    namespace=NAMESPACE,
)

Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Config:
    lr: float
    betas: tuple[float, float]
    weights: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Frozen:
    name: str
    table: torch.Tensor


def every_node_kind() -> dict[str, Any]:
    """A tree with every kind of node pytreeckpt handles, and tensor and Python leaves."""
    dd: collections.defaultdict[str, Any] = collections.defaultdict(list)
    dd["a"] = [torch.ones(2)]
    return {
        "dict": {"b": torch.arange(3), 7: "seven", (1, "x"): 1.5},
        "ordered": collections.OrderedDict([("z", torch.zeros(2, 2)), ("a", 3)]),
        "default": dd,
        "list": [torch.randn(3), None, True],
        "tuple": (torch.tensor(1.0), "s"),
        "named": Point(torch.full((2,), 4.0), -1),
        "deque": collections.deque([torch.ones(1), 2], maxlen=5),
        "dataclass": Config(0.1, (0.9, 0.999), torch.randn(4)),
        "frozen": Frozen("emb", torch.randn(2, 3)),
        "none": None,
        "structseq": torch.max(torch.tensor([[1.0, 5.0], [3.0, 2.0]]), dim=1),
        "numpy": np.arange(6, dtype=np.int16).reshape(2, 3),
        "custom": Pair(torch.randn(2), {"inner": 5}),
    }


def assert_trees_equal(a: Any, b: Any, path: str = "") -> None:
    """Equal structure, container types and bit-identical leaves."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert torch.equal(bits(a), bits(b)), path
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert_trees_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple | collections.deque):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_trees_equal(x, y, f"{path}.{i}")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_trees_equal(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, Pair):
        assert a.tag == b.tag, path
        assert_trees_equal(a.left, b.left, f"{path}.left")
        assert_trees_equal(a.right, b.right, f"{path}.right")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, (path, a, b)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor, so that NaN payloads and -0.0 compare exactly."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        return t
    if t.dtype.itemsize == 16:
        return torch.view_as_real(t).contiguous().view(torch.int64)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.dtype.itemsize])


def packed_in(path: Any, pack_format: str) -> pytreeckpt.Location:
    """``path`` with small arrays packed in ``pack_format`` ("zip" archives, the local default, or "ocdbt")."""
    return pytreeckpt.Location(path, pytreeckpt.StorageOptions(pack_format=pack_format))


def swap_zip_entries(archive: Any, a: str, b: str) -> None:
    """Exchange the bytes of two entries of equal size in a zip archive (headers and CRC-32s stay)."""
    import zipfile

    with zipfile.ZipFile(archive) as z:
        ia, ib = z.getinfo(a), z.getinfo(b)
    path = Path(archive)
    raw = bytearray(path.read_bytes())

    def data(info: Any) -> slice:
        h = info.header_offset  # local header: 30 bytes, then the name and the extra field
        start = h + 30 + int.from_bytes(raw[h + 26 : h + 28], "little") + int.from_bytes(raw[h + 28 : h + 30], "little")
        return slice(start, start + info.file_size)

    sa, sb = data(ia), data(ib)
    raw[sa], raw[sb] = raw[sb], raw[sa]
    path.write_bytes(bytes(raw))


def unpacked(path: Any) -> pytreeckpt.Location:
    """``path`` with packing off: every array in files of its own, for tests that look at or damage them."""
    return pytreeckpt.Location(path, pytreeckpt.StorageOptions(pack_small_leaves=False))


def document_text(path: Any) -> str:
    """A checkpoint's metadata document as text to edit by hand: without its own checksum (its last member,
    ``,"document_crc32c":"<8 hex digits>"``), which an edit makes stale (a document without one loads)."""
    text = (Path(path) / "pytreeckpt.json").read_text()
    return re.sub(r',"document_crc32c":"[0-9a-f]{8}"\}\Z', "}", text)


def document(path: Any) -> dict[str, Any]:
    """A checkpoint's metadata document, parsed, to edit by hand (see :func:`document_text`)."""
    return json.loads(document_text(path))  # type: ignore[no-any-return]
