"""A stuck object store: the S3 server is stopped (SIGSTOP, not killed) in the middle of a save or a load.

The call fails within its timeout with a CheckpointTimeoutError naming the store's URL and
endpoint and what was in flight; nothing new is committed (the checkpoint committed before
stays loadable); once the server resumes (SIGCONT) the next save and load of the same
process work. The server is stopped from a hook at a fixed point of the call, with real
requests to it in flight or about to be sent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import seaweed
import torch

import pytreeckpt
from pytreeckpt import ChunkingOptions
from pytreeckpt.storage import Storage, describe
from pytreeckpt.storage._objects import ObjectPrefix

TIMEOUT = 5.0
GUARD = TIMEOUT + 30  # a hang guard, not a performance bound


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.Server]:
    """SeaweedFS of this module's own (its tests stop it)."""
    yield from seaweed.module_server(tmp_path_factory)


@contextlib.contextmanager
def resumed_after(server: seaweed.Server) -> Iterator[None]:
    """Whatever the block does (stop the server), it runs again after it."""
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def location(server: seaweed.Server) -> pytreeckpt.Location:
    # 4 MiB in chunks of 1 MiB, not packed: several chunk objects, each its own PUT
    chunking = ChunkingOptions(single_chunk_bytes=1 << 20, min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 20)
    return server.location(f"t-{uuid.uuid4().hex[:10]}/run", chunking=chunking, pack_small_leaves=False)


def tree(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1024, 1024, generator=g), "step": seed}


def assert_tree(got: dict[str, Any], seed: int) -> None:
    want = tree(seed)
    assert got["step"] == want["step"]
    assert torch.equal(got["w"], want["w"])


def stop_once(server: seaweed.Server, monkeypatch: pytest.MonkeyPatch, cls: type, name: str, before: bool) -> None:
    """Patch ``cls.name`` so that its first call stops the server (before the call, or after it returns)."""
    original = getattr(cls, name)
    stopped: list[bool] = []

    def hooked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before and not stopped:
            stopped.append(True)
            os.kill(server.pid, signal.SIGSTOP)
        out = original(self, *args, **kwargs)
        if not before and not stopped:
            stopped.append(True)
            os.kill(server.pid, signal.SIGSTOP)
        return out

    monkeypatch.setattr(cls, name, hooked)


def assert_timed_out(e: pytreeckpt.CheckpointTimeoutError, server: seaweed.Server, loc: pytreeckpt.Location) -> None:
    text = str(e)
    assert server.endpoint in text, text
    assert describe(loc) in text, text
    assert e.timeout == TIMEOUT
    assert isinstance(e, pytreeckpt.CheckpointError)


def round_trip(loc: pytreeckpt.Location, seed: int) -> None:
    """A save and a load at ``loc``, in this process, after the server resumed."""
    pytreeckpt.save(loc, tree(seed), overwrite=True, timeout=60)
    assert_tree(pytreeckpt.load(loc, timeout=60), seed)


def test_a_save_whose_chunk_writes_get_no_answer_times_out_and_the_old_checkpoint_stays(
    s3: seaweed.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    loc = location(s3)
    pytreeckpt.save(loc, tree(1))
    with monkeypatch.context() as m, resumed_after(s3):
        stop_once(s3, m, Storage, "note_chunks", before=False)  # (right after the first chunk write was issued)
        t0 = time.monotonic()
        with pytest.raises(pytreeckpt.CheckpointTimeoutError) as got:
            pytreeckpt.save(loc, tree(2), overwrite=True, timeout=TIMEOUT)
        assert time.monotonic() - t0 < GUARD
    assert_timed_out(got.value, s3, loc)
    assert "in flight: leaf 'w': writing" in str(got.value)
    assert "a save commits nothing then" in str(got.value)
    assert_tree(pytreeckpt.load(loc, timeout=60), 1)  # (the server answers again)
    round_trip(loc, 3)


def test_an_async_save_whose_writes_get_no_answer_fails_its_wait_and_commits_nothing(
    s3: seaweed.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    loc = location(s3)
    with monkeypatch.context() as m, resumed_after(s3):
        stop_once(s3, m, Storage, "note_chunks", before=False)
        t0 = time.monotonic()
        handle = pytreeckpt.async_save(loc, tree(4), timeout=TIMEOUT)
        with pytest.raises(pytreeckpt.CheckpointTimeoutError) as got:
            handle.wait(GUARD)
        assert time.monotonic() - t0 < GUARD
    assert_timed_out(got.value, s3, loc)
    if "outcome is unknown" in str(got.value):
        # (the chunks' PUTs were answered before the server stopped: the commit was in flight, and may land
        # when it resumes; then the new checkpoint is there whole, else nothing)
        with contextlib.suppress(pytreeckpt.NotCommittedError):
            assert_tree(pytreeckpt.load(loc, timeout=60), 4)
    else:
        assert "in flight: leaf 'w': writing" in str(got.value)
        with pytest.raises(pytreeckpt.NotCommittedError):
            pytreeckpt.load(loc, timeout=60)
    round_trip(loc, 5)


def test_a_save_whose_commit_gets_no_answer_says_its_outcome_is_unknown_and_leaves_a_whole_checkpoint(
    s3: seaweed.Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    loc = location(s3)
    pytreeckpt.save(loc, tree(6))
    with monkeypatch.context() as m, resumed_after(s3):
        stop_once(s3, m, ObjectPrefix, "write_document", before=True)
        t0 = time.monotonic()
        with pytest.raises(pytreeckpt.CheckpointTimeoutError) as got:
            pytreeckpt.save(loc, tree(7), overwrite=True, timeout=TIMEOUT)
        assert time.monotonic() - t0 < GUARD
    assert_timed_out(got.value, s3, loc)
    assert "the PUT of the metadata document" in str(got.value)
    assert "the commit's outcome is unknown" in str(got.value)
    # The PUT sent to the stopped server may land once it resumes: either checkpoint, whole, never a broken one.
    got_tree = pytreeckpt.load(loc, timeout=60)
    assert_tree(got_tree, got_tree["step"])
    assert got_tree["step"] in (6, 7)
    assert pytreeckpt.verify(loc).ok
    round_trip(loc, 8)


def test_a_load_whose_chunk_reads_get_no_answer_times_out_and_the_next_load_works(
    s3: seaweed.Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loc = location(s3)
    pytreeckpt.save(loc, tree(9))
    with monkeypatch.context() as m, resumed_after(s3):
        stop_once(s3, m, Storage, "read_chunks", before=False)  # (the first chunk reads are started next)
        t0 = time.monotonic()
        with pytest.raises(pytreeckpt.CheckpointTimeoutError) as got:
            pytreeckpt.load(loc, timeout=TIMEOUT)
        assert time.monotonic() - t0 < GUARD
    assert_timed_out(got.value, s3, loc)
    assert "in flight: leaf 'w': reading" in str(got.value)
    assert_tree(pytreeckpt.load(loc, timeout=60), 9)
    round_trip(loc, 10)
