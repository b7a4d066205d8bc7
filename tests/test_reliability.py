"""Crashes, full disks, racing writers: a checkpoint is committed whole or not at all."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import subprocess
import threading
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from crash_workers import (
    killed_at_steps,
    manage,
    many_leaves,
    race,
    save_in_a_child,
    save_too_much,
    state,
)
from helpers import HANG, bits, unpacked
from multiproc import run_world

import pytreeckpt


def _ctx() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pytreeckpt", "crash_workers"])
    return ctx


def assert_state(got: dict, seed: int) -> None:
    want = state(seed)
    assert got["step"] == want["step"]
    assert got["name"] == want["name"]
    for group in ("big", "small"):
        assert got[group].keys() == want[group].keys()
        for k, v in want[group].items():
            assert torch.equal(bits(got[group][k]), bits(v)), (group, k)


def stored_but_unreferenced(path: Path) -> list[str]:
    """Arrays and databases in a checkpoint directory that its metadata does not name: leftovers."""
    doc = json.loads((path / "pytreeckpt.json").read_bytes())
    named = {leaf.get("database") or leaf["path"] for leaf in doc["leaves"] if leaf["kind"] == "array"}
    tops = ("arrays", "ocdbt", "packed")
    stored = {f"{top}/{p.name}" for top in tops if (path / top).is_dir() for p in (path / top).iterdir()}
    return sorted(stored - named)


@pytest.mark.parametrize("replacing", [False, True], ids=["beside", "replacing"])
def test_a_save_killed_at_any_step_leaves_the_old_checkpoint_whole(tmp_path: Path, replacing: bool) -> None:
    """SIGKILL at any step of a save, to a new path beside a checkpoint or replacing it (overwrite=True).

    The old checkpoint loads bit for bit until the new one's commit; the new one is whole
    or not there; what a killed save left is reclaimed by the next save.

    A step is each opening, renaming or removal of a file or folder of the save (an audit hook in the
    saving process counts them, and kills it before the chosen one): killed up to the step that
    commits it (the document's rename), the save committed nothing; after it, it is committed.
    """
    ctx = _ctx()
    old, new = tmp_path / "step_1", tmp_path / "step_2"
    pytreeckpt.save(old, state(1))
    target = old if replacing else new
    steps = {}
    for use_async in (False, True):  # how many steps a save takes (not killed)
        steps[use_async] = save_in_a_child(ctx, str(target), 1, use_async, None)
        if not replacing:
            shutil.rmtree(new)
    kills = [(mode, kill) for mode in (False, True) for kill in killed_at_steps(*steps[mode], 8)]
    outcomes = {"before the commit": 0, "after the commit": 0}
    current = 1  # the seed of the checkpoint at `target` (replacing), or of `old`
    for use_async, kill in kills:
        seed = 3 - current if replacing else 2
        save_in_a_child(ctx, str(target), seed, use_async, kill)
        if replacing:
            got = pytreeckpt.load(old)  # never uncommitted: the old one, or the new one whole
            assert got["step"] in (current, seed)
            committed = got["step"] == seed
            assert_state(got, got["step"])
            if committed:
                current = seed
        else:
            assert_state(pytreeckpt.load(old), 1)  # the checkpoint beside it, bit for bit
            try:
                got = pytreeckpt.load(new)
            except pytreeckpt.NotCommittedError:
                committed = False
                with pytest.raises(pytreeckpt.NotCommittedError):
                    pytreeckpt.metadata(new)
            else:
                committed = True
                assert_state(got, 2)
                shutil.rmtree(new)  # the next kill hits a save to a new path again
        assert committed == (kill[0] == "commit"), (kill, use_async)
        outcomes["after the commit" if committed else "before the commit"] += 1
        assert pytreeckpt.verify(old).ok
    assert outcomes["before the commit"] >= len(kills) // 2, outcomes
    assert outcomes["after the commit"] > 0, outcomes
    pytreeckpt.save(target, state(2), overwrite=True)  # a retry after the last kill succeeds
    assert_state(pytreeckpt.load(target), 2)
    assert stored_but_unreferenced(target) == []  # and reclaimed what the killed saves left
    print(f"steps (up to the commit, after it) of save and async_save: {steps}; after {len(kills)} kills: {outcomes}")


def test_two_writers_racing_to_one_path_never_mix(tmp_path: Path) -> None:
    ctx = _ctx()
    path = tmp_path / "ckpt"
    for attempt in range(8):
        ready = [ctx.Event(), ctx.Event()]
        go = ctx.Event()
        out = ctx.Queue()
        procs = [ctx.Process(target=race, args=(str(path), seed, ready[i], go, out)) for i, seed in enumerate((3, 4))]
        for p in procs:
            p.start()
        assert all(r.wait(HANG) for r in ready)
        go.set()
        results = dict(out.get(timeout=HANG) for _ in procs)
        for p in procs:
            p.join(HANG)
        assert "ok" in results.values(), results  # one succeeds
        for seed, result in results.items():
            assert result == "ok" or result.startswith("CheckpointError: another process is saving"), (
                attempt,
                seed,
                result,
            )
        got = pytreeckpt.load(path)
        assert got["step"] in (3, 4)
        assert_state(got, got["step"])  # every leaf from the same writer


def _run_together(ctx: mp.context.BaseContext, jobs: list[tuple[Any, tuple[Any, ...]]]) -> dict:
    """Run ``fn(*args, ready, go, stop, out)`` processes from one start; their ``(name, result)`` puts, by name.

    The first result sets ``stop``: the others then finish (or ignore it). Processes still
    running when this returns (a failure) are killed.
    """
    ready = [ctx.Event() for _ in jobs]
    go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=fn, args=(*args, r, go, stop, out), daemon=True)
        for (fn, args), r in zip(jobs, ready, strict=True)
    ]
    for p in procs:
        p.start()
    try:
        assert all(r.wait(HANG) for r in ready)
        go.set()
        results = [out.get(timeout=HANG)]
        stop.set()
        results += [out.get(timeout=HANG) for _ in procs[1:]]
        return dict(results)
    finally:
        stop.set()
        for p in procs:
            p.join(HANG)
            if p.is_alive():
                p.kill()


REPLACER = """
import sys, torch, pytreeckpt
from crash_workers import many_leaves
path, kind = sys.argv[1:]
for i, _ in enumerate(sys.stdin, start=2):  # version i, saved when asked (a line), said once committed
    if kind == "versions":  # every element of every leaf is i
        v = float(i)
        tree = {"big": torch.full((300, 1024), v), "small": {"x": torch.full((300,), v)}}
        pytreeckpt.save(path, tree, overwrite=True)
    else:  # the state of seed i: 60 leaves, each in files of its own
        where = pytreeckpt.Location(path, pytreeckpt.StorageOptions(pack_small_leaves=False))
        pytreeckpt.save(where, many_leaves(i), overwrite=True)
    print(i, flush=True)
"""


class _Replacer:
    """Another process that replaces the checkpoint at ``path`` (REPLACER) each time it is asked to."""

    def __init__(self, path: Path, kind: str) -> None:
        import sys

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        cmd = [sys.executable, "-c", REPLACER, str(path), kind]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        self.said: queue.Queue[str | None] = queue.Queue()
        self.listener = threading.Thread(target=self._listen, daemon=True)
        self.listener.start()

    def _listen(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.said.put(line)
        self.said.put(None)  # it ended

    def replace(self) -> int:
        """The number of the new version, once it is committed and the arrays it replaced are deleted."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        line = self.said.get(timeout=HANG)
        assert line is not None, f"the replacing process ended ({self.proc.wait()})"
        return int(line)

    def __enter__(self) -> _Replacer:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(HANG)
        finally:
            self.proc.kill()
            self.listener.join(HANG)
            assert self.proc.stdout is not None
            self.proc.stdout.close()


class _ReadSteps:
    """A read's steps, counted (each read of the checkpoint's document, after it; each opening of one of its
    files and each read of a packed archive, before it); at the planned ones, ``replacer`` replaces it."""

    def __init__(self, replacer: _Replacer) -> None:
        self.replacer = replacer
        self.lock = threading.Lock()  # (the files are read by several threads)
        self.count, self.restarts = 0, 0
        self.plan: set[int] = set()
        self.every_document = False
        self.met: list[int] = []  # the versions made at the planned steps

    def start(self, plan: set[int] = set(), every_document: bool = False) -> None:  # noqa: B006 (never changed)
        self.count, self.restarts, self.plan, self.every_document, self.met = 0, 0, plan, every_document, []

    def step(self, document: bool) -> None:
        with self.lock:
            self.count += 1
            if self.count in self.plan or (document and self.every_document):
                self.met.append(self.replacer.replace())

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from pytreeckpt.loading import _open
        from pytreeckpt.storage import _archive, _chunkfiles, _commit

        read_metadata = _commit.CommitProtocol.read_metadata
        open_regular = _chunkfiles.open_regular
        pread = _archive.ArchiveReader._pread
        raise_unless_replaced = _open.raise_unless_replaced

        def document(storage: Any) -> bytes:
            got = read_metadata(storage)
            self.step(document=True)
            return got

        def opened(*args: Any) -> Any:
            self.step(document=False)
            return open_regular(*args)

        def read(reader: Any, *args: Any) -> bytes:
            self.step(document=False)
            return pread(reader, *args)

        def counting(*args: Any) -> None:
            raise_unless_replaced(*args)
            self.restarts += 1  # it returned: the checkpoint was replaced under this read, which starts again

        monkeypatch.setattr(_commit.CommitProtocol, "read_metadata", document)
        monkeypatch.setattr(_chunkfiles, "open_regular", opened)
        monkeypatch.setattr(_archive.ArchiveReader, "_pread", read)
        monkeypatch.setattr(_open, "raise_unless_replaced", counting)


def _replaced_at_each_step(steps: _ReadSteps, op: Callable[[], int | None]) -> list[tuple[int, int, int | None]]:
    """``op`` (a read of version 1 or later, giving the version it read whole, or None: verify) with the checkpoint
    replaced at one of its steps, for each of them (some of many): (step, restarts, the version read less the
    new one).

    Replaced after the document was read (step 1), what the read was to read is gone: it starts again,
    from the new document. At any step, a read that started again read the new version; one that did
    not, the version it was reading.
    """
    steps.start()
    op()
    count = steps.count
    runs: list[tuple[int, int, int | None]] = []
    for at in sorted({1, 2, 3, count // 4, count // 2, 3 * count // 4, count - 1, count} - {0}):
        steps.start({at})
        got = op()
        assert len(steps.met) == 1, (at, steps.met)  # it was replaced there
        runs.append((at, steps.restarts, None if got is None else got - steps.met[0]))
    assert runs[0][:2] == (1, 1), runs
    assert runs[0][2] in (0, None), runs
    assert all((restarts, new) in {(1, 0), (0, -1), (1, None), (0, None)} for _, restarts, new in runs), runs
    return runs


def _one_version(got: torch.Tensor) -> int:
    """The version all of ``got`` is (every element of version i is i)."""
    first = float(got.flatten()[0])
    assert first.is_integer(), f"not a version: {got}"
    assert first >= 1, f"not a version: {got}"
    assert bool((got == first).all()), f"not one version: {got}"
    return int(first)


def test_a_load_of_a_checkpoint_another_process_replaces_between_two_reads_gets_one_state_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load sees the old checkpoint or the new one, whole; never an OS error nor a half-deleted one.

    The other process replaces it at a chosen step of the load (after its document is read, before one
    of its files is opened; some of them in turn); replaced at every read of the document, the load
    gives up after LOAD_ATTEMPTS, saying so.
    """
    from pytreeckpt.loading._open import LOAD_ATTEMPTS

    path = tmp_path / "c"
    pytreeckpt.save(unpacked(path), many_leaves(1))

    def load() -> int:
        got = pytreeckpt.load(path)
        want = many_leaves(got["step"])
        mixed = [k for k, v in want["w"].items() if not torch.equal(got["w"][k], v)]
        assert not mixed, f"state {got['step']} with leaves {mixed[:5]} of another state"
        return int(got["step"])

    with _Replacer(path, "many_leaves") as replacer:
        steps = _ReadSteps(replacer)
        steps.install(monkeypatch)
        runs = _replaced_at_each_step(steps, load)
        steps.start(every_document=True)
        with pytest.raises(pytreeckpt.NotCommittedError, match=f"replaced {LOAD_ATTEMPTS} times while it was being"):
            load()
    print(f"replaced at these steps of a load (step, restarts, version read less the new one's): {runs}")


def test_load_slice_and_verify_of_a_checkpoint_another_process_replaces_between_two_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each load_slice reads one version whole and each verify finds no damage, or they say it was replaced.

    The arrays of a replaced checkpoint are deleted after the new commit: a read that lost that race
    starts again from the new document, as load does; never an error blaming the document. The other
    process replaces it at a chosen step of each read, as in the test above.
    """
    from pytreeckpt.loading._open import LOAD_ATTEMPTS

    path = tmp_path / "c"
    pytreeckpt.save(path, {"big": torch.full((300, 1024), 1.0), "small": {"x": torch.full((300,), 1.0)}})

    def verify() -> None:
        report = pytreeckpt.verify(path)
        assert report.ok, report.problems

    ops: dict[str, Callable[[], int | None]] = {
        "load_slice big": lambda: _one_version(pytreeckpt.load_slice(path, "big", (slice(100, 102),))),
        "load_slice small.x": lambda: _one_version(pytreeckpt.load_slice(path, "small.x", ())),
        "verify": verify,
    }
    with _Replacer(path, "versions") as replacer:
        steps = _ReadSteps(replacer)
        steps.install(monkeypatch)
        runs = {name: _replaced_at_each_step(steps, op) for name, op in ops.items()}
        for op in ops.values():
            steps.start(every_document=True)
            with pytest.raises(pytreeckpt.NotCommittedError, match=f"replaced {LOAD_ATTEMPTS} times while it was"):
                op()
    print(f"replaced at these steps (step, restarts, version read less the new one's): {runs}")


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_two_managers_in_two_processes_share_one_directory(tmp_path: Path, async_: bool) -> None:
    """Each saves its own steps; retention and cleanup of either never fail the other's saves or restores.

    The directory starts with 30 old steps, which the first saves' retention in both
    processes removes at once.
    """
    ctx = _ctx()
    directory = tmp_path / "run"
    pytreeckpt.save(unpacked(directory / "step_0"), many_leaves(0))
    for s in range(1, 30):
        shutil.copytree(directory / "step_0", directory / f"step_{s}")
    together = ctx.Barrier(2)
    jobs = [(manage, (str(directory), list(range(100 + parity, 112, 2)), async_, together)) for parity in (0, 1)]
    results = _run_together(ctx, jobs)
    for parity, (restored, errors) in results.items():
        assert errors == [], (parity, errors[:5])
        assert restored > 0
    m = pytreeckpt.CheckpointManager(directory)
    assert m.all_steps() == [110, 111]
    assert sorted(p.name for p in directory.iterdir()) == ["step_110", "step_111"]
    for s in (110, 111):
        got = m.restore(s)
        assert got["step"] == s
        assert all(torch.equal(got["w"][k], v) for k, v in many_leaves(s)["w"].items())


def test_a_second_writer_gets_a_clear_error_while_the_first_holds_the_path(tmp_path: Path) -> None:
    from pytreeckpt.storage import Storage

    lock = Storage(tmp_path / "c").lock()
    try:
        with pytest.raises(pytreeckpt.CheckpointError, match="another process is saving to"):
            pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})
    finally:
        lock.release()
    pytreeckpt.save(tmp_path / "c", {"w": torch.ones(2)})


def _spy_on_staging(monkeypatch: pytest.MonkeyPatch) -> list[weakref.ref]:
    """Weak references to the staging memory an async save takes."""
    from pytreeckpt.execute import _staging

    refs: list[weakref.ref] = []
    pool = _staging.staging_pool()
    original = pool.reserve

    def spy(capacity: int, *, pin: bool = False, huge: bool = True) -> None:
        original(capacity, pin=pin, huge=huge)
        assert pool._arena is not None
        refs.append(weakref.ref(pool._arena))

    monkeypatch.setattr(pool, "reserve", spy)
    return refs


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root in a namespace that allows mounts): {done.stderr}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


FULL = r"No space left|RESOURCE_EXHAUSTED"


def used(disk: Path) -> int:
    return shutil.disk_usage(disk).used


@pytest.mark.parametrize("use_async", [False, True])
def test_a_disk_that_fills_fails_cleanly(small_disk: Path, use_async: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    small = {"w": torch.randn(256, 1024)}  # 1 MiB
    pytreeckpt.save(small_disk / "step_1", small)
    before = used(small_disk)
    big = {f"w{i}": torch.randn(512, 1024) for i in range(4)}  # 8 MiB: more than is left
    if use_async:
        staged = _spy_on_staging(monkeypatch)
        h = pytreeckpt.async_save(small_disk / "step_2", big)
        with pytest.raises(pytreeckpt.CheckpointError, match=FULL):
            h.wait()
        gc.collect()
        assert staged
        assert all(ref() is None for ref in staged)  # the staging memory is released
        assert pytreeckpt.execute._staging.staging_pool().capacity == 0
    else:
        with pytest.raises(pytreeckpt.CheckpointError, match=FULL):
            pytreeckpt.save(small_disk / "step_2", big)
    # The failed save removed what it wrote before it reported: its directory is gone,
    # and the disk holds what it held before.
    assert not (small_disk / "step_2").exists()
    assert used(small_disk) == before
    with pytest.raises(pytreeckpt.NotCommittedError):
        pytreeckpt.load(small_disk / "step_2")
    assert torch.equal(pytreeckpt.load(small_disk / "step_1")["w"], small["w"])  # earlier one intact
    most = {"w": torch.randn(1024, 1024)}  # 4 MiB: fits only in the room the failed save gave back
    pytreeckpt.save(small_disk / "step_3", most)
    assert torch.equal(pytreeckpt.load(small_disk / "step_3")["w"], most["w"])


@pytest.mark.parametrize("use_async", [False, True])
def test_an_overwrite_that_fails_keeps_the_old_checkpoint(small_disk: Path, use_async: bool) -> None:
    old = {"w": torch.randn(256, 1024), "b": torch.randn(16), "step": 1}  # 1 MiB, one leaf packed
    pytreeckpt.save(small_disk / "c", old)
    before = used(small_disk)
    big = {"w": torch.randn(2048, 1024), "b": torch.randn(16), "step": 2}  # 8 MiB: more than is left
    if use_async:
        h = pytreeckpt.async_save(small_disk / "c", big, overwrite=True)
        with pytest.raises(pytreeckpt.CheckpointError, match=FULL):
            h.wait()
    else:
        with pytest.raises(pytreeckpt.CheckpointError, match=FULL):
            pytreeckpt.save(small_disk / "c", big, overwrite=True)
    got = pytreeckpt.load(small_disk / "c")  # the old checkpoint, whole
    assert got["step"] == 1
    assert torch.equal(got["w"], old["w"])
    assert torch.equal(got["b"], old["b"])
    assert pytreeckpt.verify(small_disk / "c").ok
    assert stored_but_unreferenced(small_disk / "c") == []
    assert used(small_disk) == before


def test_an_overwrite_of_a_checkpoint_whose_files_cannot_be_deleted_keeps_it(tmp_path: Path) -> None:
    """A leftover the new save cannot remove (an immutable file) fails the save before anything is written."""
    path = tmp_path / "c"
    old = {"w": torch.randn(64, 64), "step": 1}
    pytreeckpt.save(unpacked(path), old)
    stuck = path / "arrays" / "w~g7" / "c" / "0"  # a leftover of a killed save, one file made immutable
    stuck.mkdir(parents=True)
    (stuck / "0").write_bytes(b"x")
    done = subprocess.run(["chattr", "+i", str(stuck / "0")], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot make a file immutable here: {done.stderr.strip()}")
    try:
        with pytest.raises(pytreeckpt.CheckpointError, match=r"cannot prepare .* Operation not permitted"):
            pytreeckpt.save(unpacked(path), {"w": torch.zeros(64, 64), "step": 2}, overwrite=True)
    finally:
        subprocess.run(["chattr", "-i", str(stuck / "0")], check=True)
    got = pytreeckpt.load(path)
    assert got["step"] == 1
    assert torch.equal(got["w"], old["w"])
    pytreeckpt.save(unpacked(path), {"w": torch.zeros(64, 64), "step": 2}, overwrite=True)
    assert pytreeckpt.load(path)["step"] == 2
    assert stored_but_unreferenced(path) == []


@pytest.mark.parametrize("async_", [False, True])
def test_a_manager_carries_on_after_a_step_that_filled_the_disk(small_disk: Path, async_: bool) -> None:
    with pytreeckpt.CheckpointManager(small_disk / "run", async_=async_) as m:
        m.save(1, {"w": torch.randn(256, 1024)})  # 1 MiB
        m.wait()
        before = used(small_disk)
        big = {f"w{i}": torch.randn(512, 1024) for i in range(4)}  # 8 MiB

        def step_2() -> None:
            m.save(2, big)
            m.wait()  # where an asynchronous step fails

        with pytest.raises(pytreeckpt.CheckpointError, match=FULL):
            step_2()
        assert used(small_disk) == before
        most = torch.randn(1024, 1024)  # 4 MiB: fits only in the room the failed step gave back
        assert m.save(3, {"w": most})
        m.wait()
        assert m.all_steps() == [1, 3]
        assert torch.equal(m.restore()["w"], most)
    assert sorted(p.name for p in (small_disk / "run").iterdir()) == ["step_1", "step_3"]


def test_a_distributed_save_that_fills_the_disk_leaves_nothing(small_disk: Path) -> None:
    pytreeckpt.save(small_disk / "step_1", {"w": torch.ones(4)})
    before = used(small_disk)
    results = run_world(2, save_too_much, str(small_disk / "step_2"))
    for rank, (error, left) in enumerate(results):
        assert re.search(FULL, error), (rank, error)
        assert error.startswith("CheckpointError"), (rank, error)
        assert not left, (rank, left)  # gone before any rank reported
    assert not (small_disk / "step_2").exists()
    assert used(small_disk) == before
    assert torch.equal(pytreeckpt.load(small_disk / "step_1")["w"], torch.ones(4))


def test_a_read_only_file_system_is_a_clear_error(small_disk: Path) -> None:
    pytreeckpt.save(small_disk / "step_1", {"w": torch.ones(3)})
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot remount read-only here: {done.stderr}")
    with pytest.raises(pytreeckpt.CheckpointError, match=r"Read-only file system"):
        pytreeckpt.save(small_disk / "step_2", {"w": torch.ones(3)})
    with pytest.raises(pytreeckpt.CheckpointError, match=r"Read-only file system"):
        pytreeckpt.save(small_disk / "step_1", {"w": torch.zeros(3)}, overwrite=True)
    assert torch.equal(pytreeckpt.load(small_disk / "step_1")["w"], torch.ones(3))  # loading needs no writes


def test_a_process_exiting_with_a_save_in_flight_finishes_it(tmp_path: Path) -> None:
    import sys

    code = (
        "import torch, pytreeckpt\n"
        f"pytreeckpt.async_save({str(tmp_path / 'c')!r}, {{'w': torch.arange(1 << 20, dtype=torch.float32)}})\n"
        "print('returned', flush=True)\n"  # and the interpreter exits with the save in flight
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG)
    assert done.returncode == 0, done.stderr
    assert "returned" in done.stdout
    assert torch.equal(pytreeckpt.load(tmp_path / "c")["w"], torch.arange(1 << 20, dtype=torch.float32))


@pytest.mark.parametrize("fails", [False, True])
def test_an_io_thread_lets_go_of_a_buffer_before_it_settles_the_future(fails: bool) -> None:
    # A failed async save's caller is woken by the future's callbacks, on the I/O thread; it
    # must not find that thread still holding the buffer (test_a_disk_that_fills_fails_cleanly
    # once saw a staging buffer alive after wait() raised).
    import threading
    import weakref

    import numpy as np

    from pytreeckpt.storage._chunkfiles import IOPool

    go = threading.Event()

    def write(buf: np.ndarray) -> int:
        go.wait(HANG)
        if fails:
            raise OSError(28, "No space left on device")
        return int(buf.sum())

    pool = IOPool()
    buf = np.ones(1024)
    ref = weakref.ref(buf)
    future = pool.submit(1, write, buf)
    del buf
    alive: list[bool] = []
    future.add_done_callback(lambda f: alive.append(ref() is not None))
    go.set()
    if fails:
        with pytest.raises(OSError, match="No space"):
            future.result(HANG)
    else:
        assert future.result(HANG) == 1024
    assert alive == [False]
    assert pool.quiesce(HANG)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_disk_that_fills_while_small_leaves_are_packed_fails_naming_the_archives(
    small_disk: Path, use_async: bool
) -> None:
    # 9,000 leaves of 1 KiB: about 9 MiB of zip archive entries on a 6 MiB disk.
    small = {f"b{i}": torch.full((256,), float(i)) for i in range(9000)}
    if use_async:
        h = pytreeckpt.async_save(small_disk / "c", small)
        with pytest.raises(pytreeckpt.CheckpointError, match=rf"packed archives 'packed/0'.*({FULL})"):
            h.wait()
    else:
        with pytest.raises(pytreeckpt.CheckpointError, match=rf"packed archives 'packed/0'.*({FULL})"):
            pytreeckpt.save(small_disk / "c", small)
    assert not (small_disk / "c").exists()
    assert used(small_disk) < 1 << 20
