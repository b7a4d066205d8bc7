"""``save``, ``async_save`` and ``plan_save``: each builds a :class:`~pytreeckpt.saving.SaveRequest` and runs the
save pipeline (:mod:`pytreeckpt.saving`).

One process may hold the shards of every rank (ShardedLeaf.from_global makes such
leaves), which is how layouts are resharded and tested without a process group.

A program whose main thread ends with an asynchronous save in flight finishes it: the
writer is not a daemon thread, and Python joins it before the interpreter finalises.
That wait is bounded by ``ExecutorOptions.exit_timeout``: past it the save is cancelled
(it stops writing, waits for the writes issued, and commits nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytreeckpt.core._timeout import call_timeout
from pytreeckpt.distributed._agree import Carried
from pytreeckpt.distributed._comm import distributed_comm
from pytreeckpt.execute._calls import gc_paused, wait_in_flight
from pytreeckpt.execute._monitor import Monitor
from pytreeckpt.plan import ChunkingOptions, SavePlan
from pytreeckpt.saving import SaveHandle, SaveRequest, plan_state, prepare, start
from pytreeckpt.storage import ExecutorOptions
from pytreeckpt.storage._location import Where
from pytreeckpt.storage._options import per_rank

from ._args import check_args

__all__ = ["SaveHandle", "async_save", "plan_save_of", "save"]

PathLike = Where  # a local path, a URL (file://, memory://, s3://, gs://), a kvstore spec or a Location


def save(
    path: PathLike,
    tree: Any,
    spec: Any = None,
    *,
    overwrite: bool = False,
    user_metadata: Mapping[str, Any] | None = None,
    chunking: ChunkingOptions | None = None,
    executor: ExecutorOptions | None = None,
    namespace: str = "",
    process_group: Any = None,
    monitor: Monitor | None = None,
    compression: Any = None,
    base: PathLike | None = None,
    chunk_hashes: bool = False,
    check_replicas: str = "small",
    timeout: float | None = None,
) -> None:
    """Save a pytree as a checkpoint at ``path``, returning once it is committed.

    Args:
      path: a directory (created if missing), a URL (``file://``, ``memory://``,
        ``s3://bucket/prefix``, ``gs://bucket/prefix``), a TensorStore kvstore spec, or a
        :class:`Location` with its :class:`StorageOptions`. An interrupted, uncommitted save there is
        cleared; a committed checkpoint is replaced only with ``overwrite=True``.
      tree: a pytree whose leaves are tensors, numpy arrays, :class:`ShardedLeaf` or
        plain Python values (int, float, bool, str, None, and enum members of those),
        nested at most 100 levels, with arrays of at most 32 dims. Every leaf's dotted
        key path must name it alone: ``{"a.b": x, "a": {"b": y}}`` is refused. A leaf
        may also be an object with ``state_dict()`` and ``load_state_dict()`` (an
        ``nn.Module``, an optimizer, an LR scheduler, a ``GradScaler``, a stateful
        dataloader, a class of the user's): it is saved as its state dict's subtree.
        A model with DTensor parameters, or any model once torch.distributed is
        initialised, and its optimizer (paired with the model of the tree whose
        parameters it optimizes) give their state through torch's distributed
        state-dict helpers; an optimizer with its model is stored keyed by parameter name.
      spec: a pytree prefix of ``tree`` whose leaves are sharding specs or None (a
        prefix at an object's key covers its whole state dict). A
        tensor under a spec is the global tensor, laid out as the spec says: this
        decides the chunk grid and which rank writes what.
      overwrite: replace a committed checkpoint at ``path``.
      user_metadata: a JSON object stored with the checkpoint (str keys; str, int,
        float, bool, None, lists and dicts), refused unless it would come back equal.
      chunking: how stored arrays are chunked.
      executor: concurrency of the I/O, staging memory, progress bar.
      namespace: the optree namespace of custom pytree nodes in ``tree``.
      process_group: the ranks that save together: those of ``process_group``, else
        the whole world. When torch.distributed is initialised (at any world size) or
        a group is given, each of them calls ``save`` with its own part of the state:
        DTensors (on a mesh of all or some of the ranks: the others hold nothing of
        them), ShardedLeafs holding its shard, and plain tensors and values that every
        rank holds whole (written once in total). Checkpoint traffic runs on gloo
        groups of its own with those ranks, made once, by those ranks alone. With one
        rank (a world of one, a group of one) it runs as a single process does, with
        no group and no collective; DTensors must then be on a mesh of that rank alone.
      monitor: a :class:`Monitor` that records the time and bytes of every phase
        (on rank 0, every rank's).
      compression: lossless compression of stored chunks, off by default: a
        :class:`Compression`, ``"zstd"``, ``"blosc"`` or None, or a pytree prefix of
        ``tree`` with one of those per subtree (like ``spec``).
      base: an earlier committed checkpoint (on a local file system): chunks whose
        content equals the base's are hard-linked from it instead of written, so a save
        after a small change writes little, and every checkpoint stays whole on its own
        (deleting the base frees nothing the new one uses). The base must have been
        saved with ``chunk_hashes`` (or a base of its own).
      chunk_hashes: record a content hash of every chunk, so that this checkpoint can be
        a ``base``; implied by ``base``.
      check_replicas: in a distributed save, which of the leaves every rank holds whole
        (and which are written once, as replicas) the ranks compare before writing, each
        a crc32c of its own copy: ``"small"`` (the default) every Python value and every
        plain tensor or numpy array in host memory of at most 1 MiB; ``"all"`` every one
        (a crc32c of 1 GiB of DDP weights on every rank made their save 1.19-1.22x as long). Copies
        that differ are refused, naming the leaf: mark state each rank holds for itself
        ``PER_RANK`` in ``spec``.
      timeout: seconds any one wait of this save may last: for another rank at a meeting
        (planning, writing, commit) or a transfer, or for an object store's request.
        None: the process-wide default (:func:`set_default_timeout`, else
        ``PYTREECKPT_TIMEOUT``, else 600). Past it every rank still alive raises a
        :class:`CheckpointTimeoutError` naming the phase and the ranks that did not
        come; nothing is committed.

    Raises:
      CheckpointError: naming the leaf, for anything that cannot be saved (meta, sparse,
        nested and quantized tensors, subclasses of int, float and str that are not
        enums, colliding key paths, an object whose ``state_dict()`` fails, a
        distributed optimizer without its model in the tree), before anything is written. In a distributed save
        every rank raises if any rank failed (the same error, naming the failed ranks and
        what failed there), and nothing is committed.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> pytreeckpt.save(d + "/ckpt", {"w": torch.ones(2, 3), "step": 7})
    >>> pytreeckpt.load(d + "/ckpt")["step"]
    7
    """
    with call_timeout(timeout):
        request = _request(
            "save",
            path,
            tree,
            spec,
            overwrite,
            user_metadata,
            chunking,
            executor,
            namespace,
            process_group,
            monitor,
            compression,
            base,
            chunk_hashes,
            check_replicas,
        )
        with gc_paused():  # the caller waits for the whole save
            job = prepare(request)
            # The caller is blocked until the commit, so the state cannot change under the
            # writes: they read straight from the caller's memory, without a snapshot.
            try:
                job.ready()
                job.persist()
            finally:
                if monitor is not None:
                    monitor.extend(job.monitor.spans)
                # Its objects go now, while the collector is paused: alive when it resumes, they would be
                # traversed by its first pass (15 ms for 10,000 leaves) though nothing holds them after this.
                del job


def async_save(
    path: PathLike,
    tree: Any,
    spec: Any = None,
    *,
    overwrite: bool = False,
    user_metadata: Mapping[str, Any] | None = None,
    chunking: ChunkingOptions | None = None,
    executor: ExecutorOptions | None = None,
    namespace: str = "",
    process_group: Any = None,
    monitor: Monitor | None = None,
    snapshot: str = "eager",
    compression: Any = None,
    base: PathLike | None = None,
    chunk_hashes: bool = False,
    check_replicas: str = "small",
    timeout: float | None = None,
) -> SaveHandle:
    """Like :func:`save`, but returns once the state is copied; writing and commit run behind.

    The caller may change the tree's tensors as soon as this returns. The copy goes into
    a staging pool (``ExecutorOptions.staging_bytes``), reused from save to save, piece
    by piece while the writer thread writes the pieces already copied; with a pool
    smaller than the state, the call also waits for the writes that free its memory.
    CUDA tensors are copied to pinned memory on a side stream; the caller's stream waits
    for those copies, the host does not. A new save first waits for the one in flight.
    Other arguments are those of :func:`save`.

    Args:
      snapshot: ``"eager"`` returns once the state is copied. ``"lazy"`` returns at
        once and copies on a thread of its own while training goes on, which is right
        while forward and backward passes leave parameters and optimizer state alone:
        the first in-place change must wait for :meth:`SaveHandle.wait_snapshot`
        (:meth:`SaveHandle.guard` makes an optimizer's step do so). A change that
        overtakes the copy is detected by the tensors' version counters and fails the
        save, which then commits nothing.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp()
    >>> w = torch.ones(3)
    >>> h = pytreeckpt.async_save(d + "/ckpt", {"w": w})
    >>> w.add_(1.0)  # training goes on; the checkpoint holds the state at the call
    tensor([2., 2., 2.])
    >>> h.wait()
    >>> pytreeckpt.load(d + "/ckpt")["w"]
    tensor([1., 1., 1.])
    """
    if snapshot not in ("eager", "lazy"):
        raise ValueError(f"snapshot must be 'eager' or 'lazy', found {snapshot!r}")
    with call_timeout(timeout):
        request = _request(
            "async_save",
            path,
            tree,
            spec,
            overwrite,
            user_metadata,
            chunking,
            executor,
            namespace,
            process_group,
            monitor,
            compression,
            base,
            chunk_hashes,
            check_replicas,
        )
        with gc_paused():  # planning, in the caller's thread (the writes run with the collector as the caller left it)
            job = prepare(request)
        return start(job, path, monitor, lazy=snapshot == "lazy")


def _request(
    entry: str,
    path: PathLike,
    tree: Any,
    spec: Any,
    overwrite: bool,
    user_metadata: Mapping[str, Any] | None,
    chunking: ChunkingOptions | None,
    executor: ExecutorOptions | None,
    namespace: str,
    process_group: Any,
    monitor: Monitor | None,
    compression: Any,
    base: PathLike | None,
    chunk_hashes: bool,
    check_replicas: str,
) -> SaveRequest:
    """What ``save`` and ``async_save`` (``entry``) were asked, checked before any I/O, once a save in flight has
    finished (it may be running collectives on the checkpoint groups)."""
    check_args(
        entry,
        overwrite=overwrite,
        chunking=chunking,
        executor=executor,
        namespace=namespace,
        monitor=monitor,
        chunk_hashes=chunk_hashes,
    )
    wait_in_flight()
    comm = distributed_comm(process_group)
    return SaveRequest(
        path,
        tree,
        spec,
        overwrite,
        user_metadata,
        chunking,
        executor if comm is None else per_rank(executor),
        namespace,
        comm,
        compression,
        base,
        chunk_hashes,
        _check_replicas(check_replicas),
    )


def _check_replicas(check: str) -> str:
    if check not in ("small", "all"):
        raise ValueError(f"check_replicas must be 'small' or 'all', found {check!r}")
    return check


def plan_save_of(
    tree: Any,
    spec: Any = None,
    *,
    chunking: ChunkingOptions | None = None,
    namespace: str = "",
    process_group: Any = None,
) -> SavePlan:
    """The save plan this rank runs for ``save(path, tree, spec)``: nothing is read or written.

    The same planning ``save`` and ``async_save`` do (the leaves described, the ranks'
    layouts agreed on, this rank's part planned, or every rank's in a single process),
    for inspecting who writes which chunks. Call it on every rank of ``process_group``
    in a distributed job, as ``save``. Leaves may be :class:`Abstract` (shape, dtype,
    spec and placement, no data): a job's plan is known before its state exists.

    >>> import torch
    >>> plan = plan_save_of({"w": torch.zeros(4, 4)})
    >>> [(a.key, a.chunk_shape, [op.writer for op in a.writes]) for a in plan.arrays]
    [('w', (4, 4), [0])]
    """
    check_args("plan_save", chunking=chunking, namespace=namespace)
    comm = distributed_comm(process_group)
    carried = Carried(comm)
    with gc_paused():  # as save() plans
        options = chunking if chunking is not None else ChunkingOptions()
        planned = plan_state(options, tree, spec, None, namespace, comm, None, carried, plan_only=True)
    if planned is None:
        carried.fail("planning the save")
    if comm is not None:
        carried.agree("planning the save")
    return planned.plan
