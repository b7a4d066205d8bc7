"""New host memory for loads: huge pages asked for, and pages faulted in from the far end while reads go on."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pytreeckpt
from pytreeckpt.execute._memory import HUGE_PAGE, Prefault, empty_host

MiB = 1 << 20

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc are Linux's")


def _mapping_of(address: int) -> dict[str, str]:
    """The fields /proc/self/smaps gives for the mapping holding ``address``."""
    found: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            if found is not None:
                break
            if int(m.group(1), 16) <= address < int(m.group(2), 16):
                found = {}
        elif found is not None and ":" in line:
            k, v = line.split(":", 1)
            found[k] = v.strip()
    assert found is not None, f"no mapping holds {address:#x}"
    return found


def _huge_on_request() -> bool:
    try:
        return "[madvise]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def _interior(t: torch.Tensor) -> int:
    """The first address of a whole huge page inside ``t``'s memory."""
    return -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@linux_only
@pytest.mark.skipif(not _huge_on_request(), reason="transparent huge pages are not in madvise mode on this kernel")
def test_a_load_through_the_page_cache_asks_for_huge_pages_for_its_new_tensors_unless_told_not_to(
    tmp_path: Path,
) -> None:
    # Above glibc's largest mmap threshold (32 MiB): each tensor a mapping of its own, never
    # heap memory an earlier buffer advised.
    state = {"w": torch.randn(40 * MiB // 4), "b": torch.arange(40 * MiB // 8, dtype=torch.float64)}
    pytreeckpt.save(tmp_path / "c", state)
    for f in (tmp_path / "c").rglob("*"):  # (in the page cache: read through it; a cold load reads around it)
        if f.is_file():
            f.read_bytes()
    out = pytreeckpt.load(tmp_path / "c", state)
    small = pytreeckpt.load(tmp_path / "c", state, executor=pytreeckpt.ExecutorOptions(huge_pages=False))
    for k in state:
        assert torch.equal(out[k], state[k])
        assert torch.equal(small[k], state[k])
        assert _mapping_of(_interior(out[k]))["THPeligible"] == "1", k
        assert _mapping_of(_interior(small[k]))["THPeligible"] == "0", k


@linux_only
def test_prefaulting_maps_every_page_and_changes_no_byte() -> None:
    n = 96 * MiB
    t = empty_host((n,), torch.uint8, huge=False)
    head = torch.randint(0, 256, (3 * MiB,), dtype=torch.uint8)
    t[: head.numel()] = head  # what the reads filled before the prefault got there
    t[-5:] = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    before = _rss()
    Prefault([(t.data_ptr(), n)]).run()
    grown = _rss() - before
    assert grown > n - 16 * MiB, f"RSS grew by {grown} bytes after prefaulting {n}"
    assert torch.equal(t[: head.numel()], head)
    assert t[-5:].tolist() == [1, 2, 3, 4, 5]


@linux_only
def test_a_prefault_stops_when_its_reads_are_done() -> None:
    n = 2048 * MiB
    t = empty_host((n,), torch.uint8, huge=False)
    before = _rss()
    with Prefault([(t.data_ptr(), n)]):
        pass  # reads that finished at once
    assert _rss() - before < n // 2


def test_large_leaves_load_equal_while_their_pages_are_prefaulted(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    state = {f"layer{i}": torch.randn(5 * MiB // 4 + i, generator=g) for i in range(6)}
    state["np"] = np.arange(3 * MiB, dtype=np.int32)
    opts = pytreeckpt.ChunkingOptions(single_chunk_bytes=MiB, max_chunk_bytes=MiB)
    pytreeckpt.save(tmp_path / "c", state, chunking=opts)
    for executor in (None, pytreeckpt.ExecutorOptions(huge_pages=False)):
        out = pytreeckpt.load(tmp_path / "c", state, executor=executor)
        for k, v in state.items():
            if isinstance(v, np.ndarray):
                np.testing.assert_array_equal(out[k], v)
            else:
                assert torch.equal(out[k], v), k
