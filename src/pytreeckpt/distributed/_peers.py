"""The peer tier's traffic: each node's process group, and whole checkpoint directories sent from node to node.

A node is a group of ranks that share a local directory (a machine). The peer tier of the
manager (``manager/_peers.py``) saves each node's part of a step into its own directory
with the node's ranks as the process group, then sends that step's files whole to ``k``
other nodes, and at a restore sends a lost node's files back from a node holding them.
Everything runs on gloo groups of its own: one per node, and one of the whole world for
the transfers (a replication runs on a thread of its own beside the training loop, so it
must share no group with the saves and loads). A transfer is a header (the files'
names, sizes and crc32c, or the sender's error) and then each file as one message; the
receiver checks every file's crc32c before it keeps any.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pytreeckpt.core._checksum import crc32c
from pytreeckpt.core._errors import CheckpointError

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


def step_files(root: Path) -> list[str]:
    """The files under ``root``, as paths relative to it, in a stable order."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _tensor(data: np.ndarray | bytes) -> torch.Tensor:
    array = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    return torch.from_numpy(array.copy() if not array.flags.writeable else array)


def _mapped(path: Path) -> np.ndarray:
    """The bytes of the file ``path``, mapped (copy on write: nothing is copied to send them)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY), dtype=np.uint8)


def _receive_into(path: Path, n: int, group: Any, src: int) -> int:
    """Receive ``n`` bytes from ``src`` straight into the new file ``path`` (mapped): their crc32c."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w+b") as f:
        if not n:
            return crc32c(b"")
        f.truncate(n)
        mapped = mmap.mmap(f.fileno(), n)
        try:
            array = np.frombuffer(mapped, dtype=np.uint8)
            dist.recv(torch.from_numpy(array), src, group=group)
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
    or missing) is sent as the error, which :func:`receive_files` raises on the
    receiver, and the returned function raises here.

    Raises:
      CheckpointError: (the returned function) the files could not be read (``what`` names them).
    """
    files: list[tuple[str, np.ndarray]] = []
    error = None
    try:
        if root is None or not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory")
        files = [(name, _mapped(root / name)) for name in step_files(root)]
    except OSError as e:
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
                w.wait()
        if error is not None:
            raise CheckpointError(error)

    return finish


def receive_files(group: Any, src: int, into: Path, what: str) -> None:
    """Receive the files global rank ``src`` sends (:func:`send_files`) and write them under ``into`` (made).

    Raises:
      CheckpointError: the sender could not read them, or a file arrived with another
        crc32c than the sender's (``what`` names them); ``into`` then holds what arrived.
    """
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    raw = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(raw, src, group=group)
    header = json.loads(raw.numpy().tobytes())
    if header["error"] is not None:
        raise CheckpointError(header["error"])
    bad = [name for name, n, crc in header["files"] if _receive_into(into / name, n, group, src) != crc]
    if bad:
        raise CheckpointError(f"{what}: files arrived damaged from rank {src} (crc32c differs): {', '.join(bad)}")
