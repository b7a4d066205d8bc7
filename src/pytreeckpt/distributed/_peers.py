"""The peer tier's traffic: each node's process group, and whole checkpoint directories sent from node to node.

A node is a group of ranks that share a local directory (a machine). The peer tier of the
manager (``manager/_peers.py``) saves each node's part of a step into its own directory
with the node's ranks as the process group, then sends that step's files whole to ``k``
other nodes, and at a restore sends a lost node's files back from a node holding them.
Everything runs on gloo groups of its own: one per node, and one of the whole world for
the transfers (a replication runs on a thread of its own beside the training loop, so it
must share no group with the saves and loads). A transfer is a header (the files'
names, sizes and crc32c, or the sender's error) and then each file as one message; the
receiver checks every file's crc32c before it keeps any. Nothing is followed at either end:
the sender refuses a symbolic link, FIFO, socket or device among a step's files (sent as its
error), and the receiver creates each file anew below the step (a name that is not a
relative path of plain components is refused: its bytes are received and dropped).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.core._timeout import current_timeout
from pytreeckpt.distributed._comm import wait_work
from pytreeckpt.storage._chunkfiles import make_dirs, open_regular

__all__ = ["as_shard_of", "is_dtensor", "node_groups", "receive_files", "send_files", "step_files", "world"]


def world() -> tuple[int, int]:
    """This process's rank and the world's size ((0, 1) without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_dtensor(x: Any) -> bool:
    """Whether ``x`` is a DTensor (without importing torch.distributed's tensor package for other values)."""
    if not isinstance(x, torch.Tensor) or type(x) is torch.Tensor:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(x, DTensor)


def as_shard_of(like: Any, local: torch.Tensor) -> Any:
    """The DTensor of ``like``'s mesh, placements, shape and strides whose shard on this rank is ``local``."""
    from torch.distributed.tensor import DTensor

    mesh, placements = like.device_mesh, like.placements
    return DTensor.from_local(
        local.to(like.device), mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def node_groups(node_of: Sequence[int]) -> tuple[Any, Any]:
    """This rank's node group and a world group for the transfers (gloo, both): every rank calls it, alike.

    ``node_of[r]`` is rank ``r``'s node. Each node's group is made by every rank (torch
    makes groups collectively), in the order of the nodes' numbers.
    """
    rank = dist.get_rank()
    mine = None
    for node in sorted(set(node_of)):
        group = dist.new_group([r for r, n in enumerate(node_of) if n == node], backend="gloo")
        if node == node_of[rank]:
            mine = group
    return mine, dist.new_group(backend="gloo")


_NEW_FILE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
"""A received file is created anew: never over a file there, never through a link planted there."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"


def step_files(root: Path) -> list[str]:
    """The files under ``root``, as ``/``-separated paths relative to it, in a stable order.

    Nothing is followed: a symbolic link (``root`` itself too), FIFO, socket or device
    there is a CheckpointError naming it; its bytes are never read and sent to a peer.
    """
    if root.is_symlink():
        raise CheckpointError(f"{root} is a symbolic link, not a step's directory; refused")
    files: list[str] = []
    todo = [""]
    while todo:
        folder = todo.pop()
        with os.scandir(root / folder) as entries:
            for entry in entries:
                name = f"{folder}/{entry.name}" if folder else entry.name
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISDIR(mode):
                    todo.append(name)
                elif stat.S_ISREG(mode):
                    files.append(name)
                else:
                    raise CheckpointError(
                        f"{entry.path} is {_kind(mode)}, not a regular file; refused (a step's files are sent to "
                        f"its peers as they are, never through a link)"
                    )
    return sorted(files)


def _tensor(data: np.ndarray | bytes) -> torch.Tensor:
    array = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    return torch.from_numpy(array.copy() if not array.flags.writeable else array)


def _mapped(path: Path) -> np.ndarray:
    """The bytes of the regular file ``path`` (not a link), mapped (copy on write: nothing is copied to send them)."""
    fd, st = open_regular(path, None, "a file to send to a peer")
    try:
        if not st.st_size:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(mmap.mmap(fd, st.st_size, access=mmap.ACCESS_COPY), dtype=np.uint8)
    finally:
        os.close(fd)


def _plain(name: str) -> bool:
    """Whether ``name`` is a relative path of plain components: none empty (no leading ``/``), ``.`` or ``..``,
    nor holding a backslash or NUL."""
    return all(part not in ("", ".", "..") and "\\" not in part and "\0" not in part for part in name.split("/"))


def _new_file(into: Path, name: str, what: str) -> Any:
    """The file ``name`` below ``into``, created anew (its directories made, none followed) and opened to write."""
    if not _plain(name):
        raise CheckpointError(f"{what}: the name {name!r} is not a path inside the step")
    path = into / name
    try:
        make_dirs(into, path.parent, what)
        return os.fdopen(os.open(path, _NEW_FILE, 0o666), "w+b")
    except OSError as e:
        raise CheckpointError(f"{what}: cannot create {path} anew ({e.strerror}: sent twice, or planted there)") from e


def _sink(into: Path) -> Any:
    """A nameless file below ``into``, open to write, for the bytes of a refused file (dropped once closed)."""
    fd, path = tempfile.mkstemp(dir=into)
    os.unlink(path)
    return os.fdopen(fd, "w+b")


def _header(raw: bytes, src: int, what: str) -> list[tuple[str, int, int]]:
    """The files a transfer's header lists (name, size, crc32c); CheckpointError for the sender's error, or a
    header that is not one."""
    try:
        header = json.loads(raw)
        error, files = header["error"], [(name, n, crc) for name, n, crc in header["files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: rank {src} sent a malformed header ({type(e).__name__}: {e})") from e
    if error is not None:
        raise CheckpointError(str(error))
    for name, n, crc in files:
        if not (isinstance(name, str) and type(n) is int and n >= 0 and type(crc) is int):
            raise CheckpointError(f"{what}: rank {src} sent a malformed header (the file {[name, n, crc]!r})")
    return files


def _receive_into(f: Any, n: int, group: Any, src: int) -> int:
    """Receive ``n`` bytes from ``src`` straight into the new, open file ``f`` (mapped): their crc32c."""
    with f:
        if not n:
            return crc32c(b"")
        f.truncate(n)
        mapped = mmap.mmap(f.fileno(), n)
        try:
            array = np.frombuffer(mapped, dtype=np.uint8)
            _recv(torch.from_numpy(array), src, group)
            crc = crc32c(array)
            del array  # (the map closes once no view of it is left)
            mapped.flush()
        finally:
            with contextlib.suppress(BufferError):
                mapped.close()
        os.fsync(f.fileno())
    return crc


def send_files(group: Any, dst: int, root: Path | None, what: str) -> Callable[[], None]:
    """Start sending the files under ``root`` to global rank ``dst`` (which calls :func:`receive_files`).

    Returns the function that waits until they are sent (this rank may receive
    meanwhile). The files are read first: a file that cannot be read (or ``root`` None,
    or missing, or a link, FIFO, socket or device among its files) is sent as the error,
    which :func:`receive_files` raises on the receiver, and the returned function raises here.

    Raises:
      CheckpointError: (the returned function) the files could not be read (``what`` names them).
    """
    files: list[tuple[str, np.ndarray]] = []
    error = None
    try:
        if root is None or not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        files = [(name, _mapped(root / name)) for name in step_files(root)]
    except (OSError, CheckpointError) as e:
        error = f"{what} could not be read on rank {dist.get_rank()}: {e}"
        files = []
    header = json.dumps({"error": error, "files": [[name, int(a.size), crc32c(a)] for name, a in files]}).encode()
    works = [
        dist.isend(torch.tensor([len(header)], dtype=torch.int64), dst, group=group),
        dist.isend(_tensor(header), dst, group=group),
    ]
    works += [dist.isend(_tensor(a), dst, group=group) for _, a in files if a.size]

    def finish() -> None:
        for w in works:
            if w is not None:
                wait_work(w, current_timeout(), "sending a step to a peer", dst)
        if error is not None:
            raise CheckpointError(error)

    return finish


def receive_files(group: Any, src: int, into: Path, what: str) -> None:
    """Receive the files global rank ``src`` sends (:func:`send_files`) and write them under ``into`` (made).

    Each file is created anew below ``into``; one whose name is not a relative path of
    plain components, or that cannot be created so (a link or a file there), is refused:
    its bytes are received (the transfer stays in step) and dropped.

    Raises:
      CheckpointError: the sender could not read them, its header is malformed, a file
        was refused, or a file arrived with another crc32c than the sender's (``what``
        names them); ``into`` then holds what arrived.
    """
    size = torch.zeros(1, dtype=torch.int64)
    _recv(size, src, group)
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    _recv(raw, src, group)
    files = _header(raw.numpy().tobytes(), src, what)
    into.mkdir(parents=True, exist_ok=True)
    refused: list[str] = []
    bad: list[str] = []
    for name, n, crc in files:
        try:
            f = _new_file(into, name, what)
        except CheckpointError as e:
            refused.append(str(e))
            f = _sink(into)
        if _receive_into(f, n, group, src) != crc:
            bad.append(name)
    if refused:
        more = f" (and {len(refused) - 5} more)" if len(refused) > 5 else ""
        raise CheckpointError(f"files from rank {src} refused: {'; '.join(refused[:5])}{more}")
    if bad:
        raise CheckpointError(f"{what}: files arrived damaged from rank {src} (crc32c differs): {', '.join(bad)}")


def _recv(into: torch.Tensor, src: int, group: Any) -> None:
    """Receive ``into`` from global rank ``src``, waiting at most the call's timeout."""
    wait_work(dist.irecv(into, src, group=group), current_timeout(), "receiving a step from a peer", src)
