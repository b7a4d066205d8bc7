"""The memory reading a metadata document takes is bounded by its size: a valid document (its checksum
right, legal JSON, under the size limit) whose JSON values or tree nodes would take more is refused
before they are made, with a MetadataError saying how much it could take and the limit."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import document_text

import pytreeckpt
from pytreeckpt.format import parse_document, seal_document
from pytreeckpt.format._paths import PARSE_BASE_BYTES, PARSE_BYTES_PER_BYTE

SRC = Path(pytreeckpt.__file__).parent.parent
REFUSED = r"could take up to \d+ bytes of memory .*more than the \d+ bytes a document of \d+ bytes may take"


def _rewritten(path: Path, edit: Callable[[str], str]) -> int:
    """A checkpoint of one tensor whose document is rewritten by ``edit`` (its text, without its checksum) and
    sealed again, as a save seals it: a valid document. Its size."""
    pytreeckpt.save(path, {"w": torch.ones(2)})
    body, tail = seal_document(edit(document_text(path)).encode())
    raw = bytes(body) + tail
    (path / "pytreeckpt.json").write_bytes(raw)
    return len(raw)


def _member(name: str, text: Callable[[], str]) -> Callable[[str], str]:
    """An edit that makes the document's member ``name`` hold ``text()``."""

    def edit(doc: str) -> str:
        data = json.loads(doc)
        data[name] = "@@"
        return json.dumps(data, separators=(",", ":")).replace('"@@"', text())

    return edit


def _many(item: str, n: int, head: str = "[", tail: str = "]") -> Callable[[], str]:
    return lambda: head + ",".join([item] * n) + tail


def _beside_w(children: Callable[[], str]) -> Callable[[], str]:
    """A tree of the leaf ``w`` beside a list of ``children()``."""
    return lambda: '{"k":"dict","keys":["w","x"],"c":[0,{"k":"list","c":[' + children() + "]}]}"


MB = 1 << 20
# Legal documents of 5 to 6 MB, each of which a reading before this bound made into hundreds of MB to GB
# of Python objects (the bytes a byte of the document took, by tracemalloc, in the comment).
HOSTILE = {
    # the one reported (there, 1.5 GB for 50 MB), refused then only once read for not being an object
    "user metadata, a list of empty objects": _member("user_metadata", _many("{}", 2 * MB)),  # 29
    "user metadata, an object of empty objects": _member("user_metadata", _many("{}", 2 * MB, '{"x":[', "]}")),  # 29
    "user metadata, arrays of one array": _member("user_metadata", _many("[[]]", MB, '{"x":[', "]}")),  # 32
    "tree, empty list nodes": _member("tree", _beside_w(_many('{"k":"list","c":[]}', 300_000, "", ""))),  # 35
    "tree, one leaf named three million times": _member("tree", _beside_w(_many("0", 3 * MB, "", ""))),  # 110
    "tree, deque nodes": _member("tree", _beside_w(_many('{"k":"deque","c":[]}', 300_000, "", ""))),  # 62
    "tree, namedtuple nodes of types not imported": _member(
        "tree",
        _beside_w(lambda: ",".join(f'{{"k":"namedtuple","type":"m:T{i:x}","keys":[],"c":[]}}' for i in range(120_000))),
    ),  # 115
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_document_that_would_take_more_memory_than_its_size_allows_is_refused(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c"
    _rewritten(path, HOSTILE[name])
    with pytest.raises(pytreeckpt.MetadataError, match=REFUSED):
        parse_document((path / "pytreeckpt.json").read_bytes())


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter, after pytreeckpt's imports and a first metadata() and load()."""
    warm = """
        import tempfile, pytreeckpt, torch
        first = tempfile.mkdtemp() + "/c"
        pytreeckpt.save(first, {"w": torch.ones(2)})
        pytreeckpt.metadata(first), pytreeckpt.load(first)
        def memory(name):
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith(name + ":"))
        def grown(op):
            # op(), and how far the process's peak resident memory rose above what it held before
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # (the peak set back to what it holds now)
            before = memory("VmRSS")
            try:
                return op(), memory("VmHWM") - before
            except BaseException as e:
                e.grown = memory("VmHWM") - before
                raise
    """
    script = textwrap.dedent(warm) + textwrap.dedent(code)
    environ = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=environ)


_READS = """
for name, read in [("metadata", pytreeckpt.metadata), ("load", pytreeckpt.load), ("verify", pytreeckpt.verify)]:
    try:
        _, grew = grown(lambda: read(PATH))
        print(name, "read")
    except pytreeckpt.CheckpointError as e:
        print(name, type(e).__name__, e)
        grew = e.grown
    print("grew", grew)
"""


@pytest.mark.parametrize(
    "name", ["user metadata, an object of empty objects", "tree, one leaf named three million times"]
)
def test_a_refused_document_takes_little_memory_in_metadata_load_and_verify(tmp_path: Path, name: str) -> None:
    """Measured in a process of its own: its peak memory (resident) grows by a few times the document,
    not the tens of times its values would take."""
    path = tmp_path / "c"
    size = _rewritten(path, HOSTILE[name])
    done = _run(f"PATH = {str(path)!r}" + _READS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 6, done.stdout
    for said, grew in zip(lines[::2], lines[1::2], strict=True):
        assert re.match(r"\w+ MetadataError reading the metadata document .*" + REFUSED, said), said
        assert int(grew.split()[1]) < 4 * size + 32 * MB, (said, grew, size)


# Documents a reading takes many bytes of memory a byte of, yet within the bound: read, within it.
HEAVY = {
    "user metadata, arrays of one number": _member("user_metadata", _many("[0]", 3 * MB // 2, '{"x":[', "]}")),  # 26
    "user metadata, one-member objects": _member("user_metadata", _many('{"a":0}', 800_000, '{"x":[', "]}")),  # 26
}


@pytest.mark.parametrize("name", list(HEAVY))
def test_a_document_within_the_bound_is_read_within_it(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c"
    size = _rewritten(path, HEAVY[name])
    done = _run(f"PATH = {str(path)!r}" + _READS)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[::2] == ["metadata read", "load read", "verify read"], done.stdout
    for grew in lines[1::2]:
        assert int(grew.split()[1]) <= PARSE_BYTES_PER_BYTE * size + PARSE_BASE_BYTES, (grew, size)
    assert max(int(grew.split()[1]) for grew in lines[1::2]) > 8 * size  # (heavy indeed: the bound is not idle)


def test_what_is_available_bounds_it_too() -> None:
    raw = json.dumps({"format": "pytreeckpt", "version": 1, "tree": 0, "leaves": [], "user_metadata": {}}).encode()
    with pytest.raises(
        pytreeckpt.MetadataError, match=r"could take up to \d+ bytes .*more than the 1000 bytes available"
    ):
        parse_document(raw, available=1000)


def test_a_saved_document_of_many_leaves_and_values_is_read(tmp_path: Path) -> None:
    """What a save writes stays far within the bound: 20,000 arrays and 100,000 Python values in nested
    containers (a document of some MB: bound a few times its size, short of the limit)."""
    tree = {
        "model": {f"layers.{i}.w": torch.zeros(1) for i in range(20_000)},
        "history": [{"step": i, "loss": i / 7, "tag": "x"} for i in range(25_000)],
        "seen": [(i, -i) for i in range(12_500)],
    }
    path = tmp_path / "c"
    pytreeckpt.save(path, tree)
    size = (path / "pytreeckpt.json").stat().st_size
    assert size > 4 * MB
    meta = pytreeckpt.metadata(path)
    assert meta.tree["history"][24_999] == {"step": 24_999, "loss": 24_999 / 7, "tag": "x"}
    assert meta.tree["seen"][3] == (3, -3)


def test_namedtuple_nodes_of_one_type_not_imported_share_one_type_made_for_them(tmp_path: Path) -> None:
    """A type made for a stored namedtuple takes some KB: 10,000 nodes of one type make one, not 10,000."""
    pair = '{"k":"namedtuple","type":"nowhere:Pair","keys":["a","b"],"c":[{"k":"list","c":[]},{"k":"list","c":[]}]}'
    path = tmp_path / "c"
    _rewritten(path, _member("tree", _beside_w(_many(pair, 10_000, "", ""))))
    pairs = pytreeckpt.metadata(path).tree["x"]
    assert len(pairs) == 10_000
    assert type(pairs[0]).__name__ == "Pair"
    assert type(pairs[0])._fields == ("a", "b")
    assert len({type(p) for p in pairs}) == 1
