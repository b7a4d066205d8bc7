"""Child processes for tests/test_reliability.py and tests/test_storage.py: saves killed at a chosen step,
and racing writers; and the parent's side of a killed save (save_in_a_child, killed_at_steps)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
from typing import Any

import torch
from helpers import HANG

import pytreeckpt
from pytreeckpt.format import METADATA_FILE


def state(seed: int) -> dict[str, Any]:
    """About 20 MiB in 8 large and 150 small leaves, mixed dtypes, and Python values."""
    g = torch.Generator().manual_seed(seed)
    big = {
        f"w{i}": torch.randn(512, 1024, generator=g).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(8)
    }
    small = {f"b{i}": torch.randn(64, generator=g) for i in range(150)}
    return {"big": big, "small": small, "step": seed, "name": f"state {seed}"}


FILE_STEPS = ("open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.link", "os.truncate")
"""The audit events of a local save's steps: each opening, renaming or removal of a file or folder."""


class _Steps:
    """A save's steps, counted; at step ``kill`` = (``"start"`` or ``"commit"``, n), the n-th from the save's start
    or the n-th after the step that commits it (the document's rename or write), the process is killed."""

    def __init__(self, kill: tuple[str, int] | None) -> None:
        self.kill = kill
        self.lock = threading.Lock()  # (the files are written by several threads)
        self.count, self.committed_at = 0, 0
        self.committing = False  # the next step commits

    def step(self, commits: bool = False) -> None:
        with self.lock:
            self.count += 1
            if self.kill == ("start", self.count) or (
                self.committed_at and self.kill == ("commit", self.count - self.committed_at)
            ):
                os.kill(os.getpid(), signal.SIGKILL)  # before the step is taken
            if commits or self.committing:
                self.committed_at, self.committing = self.count, False

    def count_files(self, root: str) -> None:
        """Each opening, renaming or removal of a file or folder below ``root`` (a local save) is a step."""

        def hook(event: str, args: tuple[Any, ...]) -> None:
            named = event in FILE_STEPS and args and isinstance(args[0], str | bytes | os.PathLike)
            if named and root in os.fsdecode(args[0]):
                self.step(commits=event == "os.rename" and str(args[1]).endswith(METADATA_FILE))

        sys.addaudithook(hook)

    def count_objects(self) -> None:
        """Each operation on whole objects, the opening of the arrays and each packed entry written (a save to an
        object store) is a step; the operation that writes the document commits."""
        from pytreeckpt.storage import _arrays, _location, _objects, _packed

        def counted(cls: Any, name: str) -> None:
            real = getattr(cls, name)

            def step(*args: Any, **kwargs: Any) -> Any:
                self.step()
                return real(*args, **kwargs)

            setattr(cls, name, step)

        for cls, name in [
            (_location.KvPrefix, "_run"),
            (_arrays.ArrayIO, "open_arrays"),
            (_packed.PackedStores, "write"),
        ]:
            counted(cls, name)
        write_document = _objects.ObjectPrefix.write_document

        def committing(*args: Any, **kwargs: Any) -> Any:
            self.committing = True
            return write_document(*args, **kwargs)

        _objects.ObjectPrefix.write_document = committing  # type: ignore[method-assign]


def save_killed_at(path: Any, seed: int, use_async: bool, kill: tuple[str, int] | None, out: Any) -> None:
    """Save state(seed) at ``path`` (a replacing save), killed at step ``kill`` of the save (see _Steps), or, with
    None, not killed: then put (its steps up to the one that committed it, its steps after that one)."""
    tree = state(seed)
    steps = _Steps(kill)
    if pytreeckpt.storage.Storage(path).kv is None:
        steps.count_files(os.fspath(path))
    else:
        steps.count_objects()
    if use_async:
        pytreeckpt.async_save(path, tree, overwrite=True).wait()
    else:
        pytreeckpt.save(path, tree, overwrite=True)
    assert steps.committed_at, "no step committed the save"
    out.put((steps.committed_at, steps.count - steps.committed_at))


def spread(n: int, steps: int) -> list[int]:
    """``n`` steps of ``steps`` (numbered from 1), evenly spread from the first to the last."""
    return sorted({1 + round(i * (steps - 1) / max(n - 1, 1)) for i in range(n)})


def killed_at_steps(commit: int, after: int, kills: int) -> list[tuple[str, int]]:
    """``kills`` steps of a save of ``commit`` steps up to the one that commits it and ``after`` more (see
    crash_workers._Steps), spread over them: a quarter of them after the commit, where there are so many."""
    late = min(after, kills // 4)
    return [("start", n) for n in spread(kills - late, commit)] + [("commit", n) for n in spread(late, after)]


def save_in_a_child(ctx: mp.context.BaseContext, where: Any, seed: int, use_async: bool, kill: Any) -> Any:
    """A save in a new process, killed at step ``kill`` (see crash_workers._Steps); None: not killed, then its
    steps, (up to the one that commits it, after that one)."""
    out = ctx.Queue()
    p = ctx.Process(target=save_killed_at, args=(where, seed, use_async, kill, out))
    p.start()
    try:
        steps = out.get(timeout=HANG) if kill is None else None
        p.join(HANG)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == (0 if kill is None else -signal.SIGKILL), (kill, p.exitcode)  # killed there, before its end
    return steps


def race(path: str, seed: int, ready: Any, go: Any, out: Any) -> None:
    tree = state(seed)
    ready.set()
    go.wait()
    try:
        pytreeckpt.save(path, tree, overwrite=True)
        out.put((seed, "ok"))
    except pytreeckpt.CheckpointError as e:
        out.put((seed, f"CheckpointError: {e}"))
    except Exception as e:  # anything else is a bug the test reports
        out.put((seed, f"{type(e).__name__}: {e}"))


def save_too_much(rank: int, world: int, path: str) -> tuple[str, list[str]]:
    """A distributed save of 8 MiB, written by both ranks, into a disk with less room: the error, and what is left."""
    g = torch.Generator().manual_seed(0)
    tree = {f"w{i}": torch.randn(512, 1024, generator=g) for i in range(4)}
    try:
        pytreeckpt.save(path, tree)
    except pytreeckpt.CheckpointError as e:
        error = f"CheckpointError: {e}"
    except Exception as e:  # anything else is a bug the test reports
        error = f"{type(e).__name__}: {e}"
    else:
        error = "saved"
    left = sorted(os.listdir(path)) if os.path.isdir(path) else []
    return error, left


def many_leaves(seed: int) -> dict[str, Any]:
    """60 leaves of 4 KiB, each in files of its own when saved unpacked: saves, loads and removals of many files."""
    g = torch.Generator().manual_seed(seed)
    return {"w": {f"{i}": torch.randn(32, 32, generator=g) for i in range(60)}, "step": seed}


def _unpacked(path: str) -> pytreeckpt.Location:
    return pytreeckpt.Location(path, pytreeckpt.StorageOptions(pack_small_leaves=False))


def manage(
    directory: str, steps: list[int], async_: bool, together: Any, ready: Any, go: Any, stop: Any, out: Any
) -> None:
    """A CheckpointManager saving ``steps`` into a directory another one shares, restoring the newest now and then.

    The two managers start each save together (``together``, a barrier), so that their
    retention runs, removing the same old steps, overlap.
    """
    ready.set()
    go.wait()
    errors, restored = [], 0
    try:
        with pytreeckpt.CheckpointManager(_unpacked(directory), max_to_keep=2, async_=async_) as m:
            for step in steps:
                try:
                    together.wait(HANG)
                    m.save(step, many_leaves(step))
                    if step % 3 == 0:
                        got = m.restore()  # the newest step of either manager
                        if not torch.equal(got["w"]["0"], many_leaves(got["step"])["w"]["0"]):
                            errors.append(f"restored step {got['step']} is not whole")
                        restored += 1
                except Exception as e:
                    errors.append(f"step {step}: {type(e).__name__}: {e}")
    except Exception as e:
        errors.append(f"closing: {type(e).__name__}: {e}")
    out.put((steps[0] % 2, (restored, errors)))


def replace_distributed(rank: int, world: int, path: str, checksums_file: bool = False) -> dict[str, Any]:
    """Two ranks save, then replace, a checkpoint of arrays both write and small ones packed per rank
    (``checksums_file``: with the chunk checksums in a file of their own)."""
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    where: Any = path
    if checksums_file:
        where = pytreeckpt.Location(path, pytreeckpt.StorageOptions(max_inline_checksum_bytes=0))

    mesh = DeviceMesh("cpu", list(range(world)))

    def tree(seed: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(seed)
        big = torch.randn(1024, 512, generator=g)  # 2 MiB: stored on its own, written by both ranks
        small = {f"b{i}": torch.randn(16, generator=g) for i in range(8)}  # packed, spread over the ranks
        return {"big": distribute_tensor(big, mesh, [Shard(0)]), "small": small, "step": seed}

    tops = ("arrays", "ocdbt", "packed", "checksums")
    pytreeckpt.save(where, tree(1))
    first = sorted(p for top in tops for p in _names(path, top))
    pytreeckpt.save(where, tree(2), overwrite=True)
    second = sorted(p for top in tops for p in _names(path, top))
    got = pytreeckpt.load(path)
    want = tree(2)
    whole = torch.equal(got["big"], want["big"].full_tensor()) and all(
        torch.equal(got["small"][k], v) for k, v in want["small"].items()
    )
    return {"first": first, "second": second, "step": got["step"], "whole": whole}


def _names(path: str, top: str) -> list[str]:
    folder = os.path.join(path, top)
    return [f"{top}/{n}" for n in os.listdir(folder)] if os.path.isdir(folder) else []
