"""``load``, ``plan_load``, ``metadata``, ``verify``, ``load_slice`` and ``read_array``: each builds a request and
runs the load pipeline (:mod:`pytreeckpt.loading`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pytreeckpt.core._errors import CheckpointError, TargetMismatchError, where
from pytreeckpt.core._region import Region
from pytreeckpt.core._timeout import call_timeout
from pytreeckpt.distributed._comm import comm_monitor, distributed_comm
from pytreeckpt.execute._calls import gc_paused, wait_in_flight
from pytreeckpt.execute._monitor import Monitor
from pytreeckpt.format import ArrayMeta
from pytreeckpt.loading import (
    CheckpointMetadata,
    LoadReport,
    LoadRequest,
    VerifyReport,
    again_if_replaced,
    inspect,
    load_once,
    open_checkpoint,
    read_region,
    region_of,
    verify_once,
)
from pytreeckpt.loading._inspect import Arrays
from pytreeckpt.loading._per_rank import check_policy
from pytreeckpt.plan import LoadPlan
from pytreeckpt.storage import ExecutorOptions, Storage
from pytreeckpt.storage._location import Where, describe

from ._args import check_args

__all__ = [
    "CheckpointMetadata",
    "LoadReport",
    "VerifyReport",
    "load",
    "load_slice",
    "metadata",
    "plan_load_of",
    "read_array",
    "verify",
]

PathLike = Where


def load(
    path: PathLike,
    target: Any = None,
    *,
    namespace: str = "",
    executor: ExecutorOptions | None = None,
    process_group: Any = None,
    include: str | Sequence[str] | None = None,
    monitor: Monitor | None = None,
    inplace: bool = False,
    per_rank: str = "own",
    cast: bool = False,
    strict: bool = True,
    report: LoadReport | None = None,
    timeout: float | None = None,
) -> Any:
    """Load a checkpoint, functionally: return a new tree (or, with ``inplace``, fill the target's tensors).

    Args:
      path: a committed checkpoint: a path, URL, kvstore spec or :class:`Location`.
      target: None to rebuild the stored tree with full tensors (numpy leaves come back
        as numpy arrays); or a tree whose structure the result takes, whose leaves say
        what to load: a tensor or numpy array (full, same shape and dtype, on the
        tensor's device), a :class:`ShardedLeaf` (its spec and ranks: resharding), an
        :class:`Abstract` (a full tensor, or the shards of its spec), a DTensor (its
        mesh and placements), or a plain Python value (replaced by the stored value;
        a stored enum member comes back as a member of the target leaf's enum type, or
        of its own type if that type's module is imported), or an object with
        ``state_dict()`` and ``load_state_dict()`` (a model, optimizer, LR scheduler,
        GradScaler, dataloader: the stored subtree at its key is loaded where its own
        state says, its leaves it lacks or holds in another form as stored, then given
        to it in place, through torch's distributed state-dict helpers for models with
        DTensor parameters or under torch.distributed, and their optimizers; the result
        holds the object itself). Stored leaves the target lacks are an error, or with
        ``strict=False`` not read. A tensor on the meta device holds no memory to load into and is refused.
      namespace: the optree namespace of custom pytree nodes.
      executor: concurrency of the I/O.
      include: key-path globs (``fnmatch``, e.g. ``"model.layers.*.weight"``): load only
        the matching leaves, and return them as a flat dict from key path to leaf.
        Other leaves are not read. Only with ``target=None``.
      process_group: the ranks that load together: those of ``process_group``, else
        the whole world. When torch.distributed is initialised (at any world size) or
        a group is given, each of them calls ``load`` and gets its own part: its
        DTensor shards (nothing of a DTensor whose mesh it is not on), its shard of
        each ShardedLeaf or Abstract spec, and full copies of plain tensors. Each rank
        reads only its regions; a region several ranks want is read once and sent on.
        With one rank it runs as a single process does (DTensors on a mesh of that
        rank alone). If any rank fails, every rank raises the same error.
      monitor: a :class:`Monitor` that records the time and bytes of every phase
        (on rank 0, every rank's).
      inplace: fill the target's own tensors instead of making new ones, and return
        them (the same objects: tensors, Parameters, DTensors, the shards of a
        ShardedLeaf, writeable numpy arrays). Reads land straight in their memory; a
        tensor whose memory cannot take them (on a GPU, or a non-contiguous view) gets a
        buffer of its own size, copied into it once read. Peak memory is the state plus
        at most those buffers, not twice the state as ``load`` then
        ``load_state_dict``; a model given as an object is read into its parameters.
        Leaves with no memory (:class:`Abstract`) and plain Python
        values come back as ``load`` makes them. If the load fails, the target's tensors
        may hold part of the checkpoint (the error says so). Needs ``target``.
      cast: a target leaf of another dtype than the stored array (a tensor, Parameter,
        numpy array, :class:`Abstract`, :class:`ShardedLeaf` or DTensor) gets it converted
        to its own dtype, rounded as ``Tensor.to`` rounds, in place too. Each chunk is read
        into a buffer of the stored dtype and converted into its place, so no copy of the
        state in the stored dtype is made. Casts go between bool, integer, floating
        (float8 included) and complex dtypes, except complex to real (which would drop the
        imaginary part); others are a TargetMismatchError naming the leaf and both dtypes.
        Without ``cast`` another dtype is a mismatch.
      strict: with True (the default) the target and the checkpoint must have the same
        leaves: a target leaf the checkpoint lacks, or a stored leaf the target lacks,
        is a TargetMismatchError listing both. With False the leaves both have are
        loaded, a target leaf the checkpoint lacks stays the target's own (the same
        object), and stored leaves the target lacks are not read; ``report`` says which.
        Only presence is relaxed: a leaf both have but of another shape or kind is still
        an error (and of another dtype, unless ``cast``). Needs ``target``.
      report: a :class:`LoadReport`, filled in with the target's key paths the checkpoint
        lacks (``missing``), the stored key paths the target lacks (``unexpected``) and the
        casts made (``cast``). ``load`` returns the tree, as always: the report is the
        caller's object, filled in (even when the load raises a TargetMismatchError).
      per_rank: what the checkpoint's per-rank parts (saved under a ``PER_RANK`` spec)
        give. At the world size that saved them every rank gets the subtree it saved
        (read by it alone; a single process is rank 0 of a world of one), whatever its
        own structure there (``{"dp_rank_<r>": ...}`` keys). At another world size:
        ``"own"`` (the default) raises a CheckpointError naming each such part and both
        world sizes; ``"keep"`` keeps the target's own leaves there (as they were; they
        need a target); ``"all"`` gives every rank a :class:`PerRank`, every saved
        rank's subtree by rank, in place of the target's subtree (at any world size).
      timeout: seconds any one wait of this load may last (for another rank, a transfer,
        an object store's request); None: the process-wide default, as for :func:`save`.
        Past it every rank still alive raises a :class:`CheckpointTimeoutError` naming
        the phase and the ranks that did not come.

    Raises:
      NotCommittedError: ``path`` holds no committed checkpoint.
      TargetMismatchError: listing every target leaf that the checkpoint lacks or that
        differs in shape, dtype (without ``cast``; or a dtype ``cast`` cannot convert) or
        kind, and (with ``strict``) every stored leaf the target lacks, meta-device
        targets, enum members whose type is neither imported nor given by the target,
        objects whose key holds no subtree in the checkpoint, and a model's keys the
        checkpoint lacks.
      CheckpointError: an object's ``load_state_dict`` refused its loaded state (naming
        its key path; in a distributed load, on every rank, after every rank read); a
        per-rank part saved at another world size, with ``per_rank="own"``.
      MetadataError: the metadata is malformed or unsafe, or ``include`` selects a key
        path that names several leaves (documents of older versions).
    """
    check_args(
        "load",
        namespace=namespace,
        executor=executor,
        monitor=monitor,
        inplace=inplace,
        cast=cast,
        strict=strict,
        report=report,
    )
    # A save in flight may be running collectives on the checkpoint groups, and may be
    # writing the very checkpoint asked for: let it finish first.
    if inplace and (target is None or include is not None):
        raise CheckpointError("load(..., inplace=True) fills the tensors of a target: pass target, and no include")
    if target is None and (cast or not strict):
        raise CheckpointError("load(..., cast=True) and load(..., strict=False) match a target: pass target")
    with call_timeout(timeout):
        check_policy(per_rank)
        wait_in_flight()
        comm = distributed_comm(process_group, op="load")
        request = LoadRequest(
            path, target, namespace, executor, include, comm, inplace, False, cast, strict, report, per_rank
        )
        spans = comm_monitor(comm)  # (with the waits on other ranks, in a distributed load)
        with gc_paused():
            try:
                if comm is not None:
                    return load_once(request, spans)
                return again_if_replaced(path, executor, "loaded", lambda seen: load_once(request, spans, seen))
            except BaseException as e:
                if inplace and not isinstance(e, TargetMismatchError):  # (a mismatch is found before any read)
                    e.add_note("load(..., inplace=True) failed: the target's tensors may hold part of the checkpoint")
                raise
            finally:
                if monitor is not None:
                    monitor.extend(spans.spans)


def plan_load_of(
    path: PathLike,
    target: Any = None,
    *,
    namespace: str = "",
    executor: ExecutorOptions | None = None,
    process_group: Any = None,
    cast: bool = False,
    strict: bool = True,
) -> LoadPlan:
    """The load plan this rank runs for ``load(path, target)``: the metadata is read, no array.

    The same planning ``load`` does (rank 0 reads the metadata and sends it to the
    others, the target is matched against it, the ranks' layouts agreed on, this rank's
    part planned, or every rank's in a single process), for inspecting who reads which
    stored boxes into which ranks' pieces. Call it on every rank of ``process_group`` in
    a distributed job, as ``load``. Each plan array is a target leaf that is an array, in
    the target's order. ``cast`` and ``strict`` match the target as :func:`load`'s do.
    """
    check_args("plan_load", namespace=namespace, executor=executor, cast=cast, strict=strict)
    wait_in_flight()
    comm = distributed_comm(process_group)
    request = LoadRequest(path, target, namespace, executor, None, comm, False, True, cast, strict)
    with gc_paused():
        plan: LoadPlan = load_once(request, Monitor())
    return plan


def metadata(path: PathLike, *, namespace: str = "") -> CheckpointMetadata:
    """Read a committed checkpoint's metadata (no array data is read).

    A checkpoint written by an older pytreeckpt may hold two leaves of one key path
    (``{"a.b": x, "a": {"b": y}}``); ``arrays[key]`` then raises a MetadataError naming
    both, rather than pick one. The tree holds both.
    """
    check_args("metadata", namespace=namespace)
    return inspect(path, namespace)


def verify(path: PathLike, *, executor: ExecutorOptions | None = None) -> VerifyReport:
    """Read every chunk of every array of a checkpoint and check it as a load would.

    Each chunk is checked against the checksum the metadata records for it (so a chunk
    moved, swapped or taken from another checkpoint is found), and its own checksum,
    size, presence, file kind and place are checked; a load fails on exactly these.

    A checkpoint replaced while it is verified (another process saving there) is verified
    again, as :func:`load` starts again; the report is of one checkpoint, whole.

    Raises:
      NotCommittedError: ``path`` holds no committed checkpoint, or it was removed, or
        replaced 4 times, while it was verified.
      MetadataError: the metadata document itself is damaged.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> pytreeckpt.save(d, {"w": torch.ones(4)})
    >>> pytreeckpt.verify(d).ok
    True
    """
    check_args("verify", executor=executor)
    return again_if_replaced(path, executor, "verified", lambda seen: verify_once(path, executor, seen))


def read_array(
    path: PathLike, meta: ArrayMeta, region: Region | None = None, executor: ExecutorOptions | None = None
) -> torch.Tensor:
    """A stored array, or the box ``region`` of it, as a CPU tensor (``meta`` from :func:`metadata`).

    Only the chunks the region touches are read.
    """
    check_args("read_array", executor=executor)
    return read_region(Storage(path, executor), path, meta, region)


def load_slice(path: PathLike, key: str, index: Any = (), *, executor: ExecutorOptions | None = None) -> torch.Tensor:
    """Read part of one stored tensor, by key path and index, reading only the chunks it touches.

    ``index`` is an int, a step-1 slice or a tuple of them, as in ``t[index]`` (ints keep
    their dim, of size 1).

    A checkpoint replaced while it is read (another process saving there) is read again,
    from the new metadata, as :func:`load` does.

    >>> import tempfile, torch, pytreeckpt
    >>> d = tempfile.mkdtemp() + "/ckpt"
    >>> pytreeckpt.save(d, {"emb": torch.arange(12.0).reshape(4, 3)})
    >>> pytreeckpt.load_slice(d, "emb", (slice(1, 3), 2))
    tensor([[5.],
            [8.]])
    """

    check_args("load_slice", executor=executor)

    def attempt(seen: list[bytes]) -> torch.Tensor:
        storage, doc = open_checkpoint(path, "", executor, seen)
        meta = Arrays(path, doc).get(key)
        if meta is None:
            raise TargetMismatchError(f"leaf {where(key)} is not an array of the checkpoint at {describe(path)}")
        return read_region(storage, path, meta, region_of(index, meta.shape, key))

    return again_if_replaced(path, executor, "read", attempt)
