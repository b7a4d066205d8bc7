"""A save's job made ready to write: the request planned, each array's stored metadata, the document's size checked.

What a save derives from a tree's description for one place to store it (the arrays'
metadata, the tree's JSON text, the document's size bound, its array texts) is kept with
the description of a tree recognised again (``_recall``), so a save of the same state
derives it once.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytreeckpt.core._errors import CheckpointError, MetadataError
from pytreeckpt.distributed._agree import Carried
from pytreeckpt.distributed._comm import comm_monitor
from pytreeckpt.execute._executor import ChunkReuse
from pytreeckpt.execute._monitor import Span
from pytreeckpt.format import (
    ARCHIVE_DIR,
    ARRAYS_DIR,
    MAX_PACKED_BYTES,
    PACKED_DIR,
    SEAL_BYTES,
    ArrayMeta,
    DocumentHead,
    array_names,
    chunk_count,
    crc32c_chars,
    plain_array_meta,
)
from pytreeckpt.loading._inspect import Arrays
from pytreeckpt.loading._open import open_checkpoint
from pytreeckpt.plan import ChunkingOptions, SavePlan
from pytreeckpt.storage import ExecutorOptions, Storage
from pytreeckpt.storage._location import Where, describe

from ._describe import Planned, plan_state
from ._job import Derived, SaveJob

if TYPE_CHECKING:
    from pytreeckpt.distributed._comm import Comm

__all__ = ["SaveRequest", "prepare"]


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """What ``save`` and ``async_save`` were asked: their arguments, the process group made a Comm."""

    path: Where
    tree: Any
    spec: Any
    overwrite: bool
    user_metadata: Mapping[str, Any] | None
    chunking: ChunkingOptions | None
    executor: ExecutorOptions | None
    namespace: str
    comm: Comm | None
    compression: Any
    base: Where | None
    chunk_hashes: bool
    check_replicas: str = "small"  # which leaves every rank holds are compared across ranks (saving/_describe.py)


def prepare(request: SaveRequest) -> SaveJob:
    """Plan the request on this rank and make its job: every array's metadata, the document's size checked, the
    location checked writable. In a distributed save a rank that failed raises with the others, at their
    agreement after planning."""
    t0 = time.perf_counter()
    comm = request.comm
    carried = Carried(comm)
    storage: Storage | None = None
    with carried.catch():
        storage = Storage(request.path, request.executor)
    chunking = request.chunking
    if chunking is None:
        chunking = storage.chunking if storage is not None else ChunkingOptions()
    planned = plan_state(
        chunking,
        request.tree,
        request.spec,
        request.user_metadata,
        request.namespace,
        comm,
        request.compression,
        carried,
        check_replicas=request.check_replicas,
    )
    job: SaveJob | None = None
    with carried.catch():
        assert storage is not None  # (else this rank failed before, and carried its error)
        assert planned is not None
        job = _job(storage, planned, request, t0)
    if job is None:  # planning failed on this rank: it raises with the others, at their agreement after planning
        carried.fail("preparing the save")
    return job


def _job(storage: Storage, planned: Planned, request: SaveRequest, t0: float) -> SaveJob:
    comm = request.comm
    # The arrays' metadata and the tree's JSON text depend only on the tree's description and
    # where packed arrays go: a save of a tree recognised (planned.memo) takes them from the last.
    opts = storage.location.options
    memo, where = planned.memo, (storage.packed_prefix(), opts.pack_small_leaves, opts.pack_max_bytes)
    derived = None if memo is None else memo.derived.get(where)
    if derived is None:
        derived = Derived(tuple(_array_metas(storage, planned)), DocumentHead.of(planned.root, {}).tree, {}, {})
        if memo is not None:
            memo.derived[where] = derived
    metas = list(derived.metas)
    # (the tree, values and user metadata serialised now: what cannot be is refused before any write)
    head = DocumentHead.of_tree_text(derived.tree, planned.user)
    values = head.document([e for e in planned.entries if e is not None], ())
    hashed = request.base is not None or request.chunk_hashes
    bound = derived.bounds.get(hashed)
    if bound is None:
        bound = derived.bounds[hashed] = array_bytes_bound(metas, hashed)
    if len(values) + SEAL_BYTES + bound > opts.max_metadata_bytes:  # (SEAL_BYTES: the document's own checksum)
        it = iter(metas)
        leaf_json = [e if e is not None else next(it).to_json() for e in planned.entries]
        _check_document_size(head.document(leaf_json, (m.database for m in metas)), metas, storage)
    if comm is None or comm.rank == 0:
        storage.check_writable(request.overwrite)
    t1 = time.perf_counter()
    monitor = comm_monitor(comm)  # (with the waits of planning, in a distributed save)
    me = 0 if comm is None else comm.rank
    monitor.add(Span("save", "plan", me, time.time() - (t1 - t0), time.time(), 0, threading.current_thread().name))
    reuse = _chunk_reuse(metas, request.base) if hashed else None
    return SaveJob(
        storage,
        metas,
        planned.plan,
        planned.data,
        (head, planned.entries),
        request.overwrite,
        {"plan": t1 - t0},
        monitor,
        comm,
        planned.devices,
        planned.watches,
        reuse,
        derived=derived if memo is not None else None,
    )


def _array_metas(storage: Storage, planned: Planned) -> list[ArrayMeta]:
    """Each array leaf's metadata as it will be stored (its data's checksums aside)."""
    arrays, plan, codecs = planned.arrays, planned.plan, planned.codecs
    names = array_names([a.key for a in arrays])
    databases = _databases(storage, plan, planned.rank, [codecs[a.key] is not None for a in arrays])
    return [
        plain_array_meta(
            a.key,
            a.container,
            a.dtype,
            a.shape,
            ap.chunk_shape,
            f"{ARRAYS_DIR}/{name}",
            a.saved_layout,
            codecs[a.key],
            db,
        )
        for a, ap, name, db in zip(arrays, plan.arrays, names, databases, strict=True)
    ]


def array_bytes_bound(metas: Sequence[ArrayMeta], hashed: bool = False) -> int:
    """More than the array leaves can add to the metadata document (their entries, the
    commas between them, their chunk checksums, and their chunk hashes if ``hashed``;
    generation suffixes on names included)."""
    layouts: dict[int, int] = {}
    total = 0
    for m in metas:
        extra = 0
        if m.layout is not None:
            extra = layouts.get(id(m.layout), -1)
            if extra < 0:
                extra = layouts[id(m.layout)] = len(json.dumps(m.layout.to_json()))
        if m.compression is not None:
            extra += len(json.dumps(m.compression.to_json()))
        # the fixed keys and short values, the key (each character at most a 12-byte escape:
        # a surrogate pair), the path and database (with room for a generation suffix), the shapes
        total += 400 + 12 * len(m.key) + len(m.path) + 44 * len(m.shape) + extra
    per_chunk = 6 + (35 if hashed else 0)  # base64 of a uint32; a quoted hex digest of 32 digits and a comma
    chunks = sum(1 if m.chunk_shape == m.shape else chunk_count(m.shape, m.chunk_shape) for m in metas)
    return total + per_chunk * chunks + 40 * len(metas)


def _check_document_size(document: bytes, metas: list[ArrayMeta], storage: Storage) -> None:
    """Refuse, before writing, a checkpoint whose metadata document its location would refuse to read."""
    options = storage.location.options
    limit = options.max_metadata_bytes
    # and the checksums: in the document (their base64, quoted), or past its limit in their file (as
    # place_checksums decides), the document then naming each array's part and the file
    inline = sum(crc32c_chars(chunk_count(m.shape, m.chunk_shape)) for m in metas)
    in_file = inline > options.max_inline_checksum_bytes
    size = len(document) + SEAL_BYTES + (48 * len(metas) + 80 if in_file else inline + 20 * len(metas))
    if size > limit:
        raise MetadataError(
            f"the metadata document of this checkpoint would hold about {size} bytes, more than the {limit} "
            f"bytes a load reads (StorageOptions.max_metadata_bytes); save it, and load it, through a Location "
            f"with a larger max_metadata_bytes"
        )


def _chunk_reuse(metas: list[ArrayMeta], base: Where | None) -> ChunkReuse:
    """Hash this save's chunks; with a base checkpoint, link its chunks that are unchanged."""
    reuse = ChunkReuse([m.chunk_shape for m in metas], [m.shape for m in metas], [m.path for m in metas])
    if base is None:
        return reuse
    if not isinstance(base, (str, os.PathLike)) or "://" in os.fspath(base):
        raise CheckpointError(f"an incremental base must be a local directory, found {describe(base)}")
    _, doc = open_checkpoint(base, "", None)
    stored = Arrays(base, doc)
    # Arrays of no chunks (a zero in their shape) have no hashes to record.
    chunked = [b for b in stored.values() if chunk_count(b.shape, b.chunk_shape)]
    if chunked and all(b.chunk_hashes is None for b in chunked):
        raise CheckpointError(
            f"the base checkpoint {describe(base)} records no chunk hashes: save it with chunk_hashes=True "
            f"(CheckpointManager(incremental=True) does) to use it as a base"
        )
    reuse.base = Path(base).absolute()
    for m in metas:
        b = stored.get(m.key)
        # Chunks are linked as files: an array packed in an OCDBT database (here or in the
        # base) has none, so it is written (it is small: that is why it was packed).
        same = (
            b is not None
            and b.chunk_hashes is not None
            and b.database is None
            and m.database in (None, PACKED_DIR)  # (PACKED_DIR: packed by another rank, or not; see _databases)
            and (b.shape, b.dtype.name, b.chunk_shape, b.compression)
            == (m.shape, m.dtype.name, m.chunk_shape, m.compression)
        )
        reuse.base_chunks.append((b.path, b.chunk_hashes) if same and b is not None and b.chunk_hashes else None)
    return reuse


def _databases(storage: Storage, plan: SavePlan, rank: int | None, compressed: Sequence[bool]) -> list[str | None]:
    """Where each array goes: the database of its writer (zip archives or OCDBT) if it is small, has one writer
    and packing is on.

    In zip archives (``Storage.packed_prefix``) only uncompressed arrays are packed: the archives
    hold raw chunks, and a compressed small array is stored on its own.

    A rank planning its own part (``rank``) knows whether it alone writes an array: its
    writes cover it. A small array it writes only part of, or nothing of, gets the
    placeholder ``PACKED_DIR``: whether one other rank writes it whole is settled with the
    other ranks before the writes (:meth:`SaveJob._settle_packing`), and its database
    reaches the coordinator after them.
    """
    opts = storage.location.options
    prefix = storage.packed_prefix()
    out: list[str | None] = []
    limit = min(opts.pack_max_bytes, MAX_PACKED_BYTES) if opts.pack_small_leaves else 0
    names: dict[int, str] = {}  # writer -> its database (one string for its many arrays)
    for ap, squeezed in zip(plan.arrays, compressed, strict=True):
        size = math.prod(ap.shape)
        if not (0 < size * ap.itemsize <= limit) or (squeezed and prefix == ARCHIVE_DIR):
            out.append(None)
            continue
        writes = ap.writes
        writers = {writes[0].writer} if len(writes) == 1 else {op.writer for op in writes}
        if rank is None:  # every write planned
            if len(writers) == 1:
                w = writers.pop()
                out.append(names.get(w) or names.setdefault(w, f"{prefix}/{w}"))
            else:
                out.append(None)
        elif writers == {rank} and sum(op.region.size for op in writes) == size:
            out.append(names.get(rank) or names.setdefault(rank, f"{prefix}/{rank}"))
        else:
            out.append(PACKED_DIR)
    return out
