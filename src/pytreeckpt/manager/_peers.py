"""A node-local tier replicated to peer nodes, over a durable tier: a lost node restores from its peers."""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import stat
import threading
import uuid
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pytreeckpt.api import load
from pytreeckpt.core._errors import CheckpointError, NotCommittedError
from pytreeckpt.core._per_rank import PER_RANK
from pytreeckpt.core._timeout import call_timeout
from pytreeckpt.core._timeout import resolve as resolve_timeout
from pytreeckpt.distributed._comm import Comm, DistComm
from pytreeckpt.distributed._peers import node_groups, receive_files, send_files, world
from pytreeckpt.distributed._vote import vote_max
from pytreeckpt.storage import Storage, Where, describe, remove_tree, resolve

from ._fallback import CheckpointDamageWarning, first_that_loads
from ._local_view import local_view, put_back
from ._manager import CheckpointManager, ClosesOnExit, check_step, only_a_save_wrote, step_dirs

__all__ = ["PeerTierManager", "node_layout"]

logger = logging.getLogger("pytreeckpt")

_INCOMING = ".pytreeckpt-incoming-"
"""A step arriving from a peer is written under this prefix, then renamed to its name (it is never half there)."""


def node_layout(
    world: int, peers: int, ranks_per_node: int | None = None, node_ids: Sequence[int] | None = None
) -> list[int]:
    """Each rank's node, from ``node_ids`` (one per rank), ``ranks_per_node``, or ``LOCAL_WORLD_SIZE``.

    >>> node_layout(4, 1, ranks_per_node=2)
    [0, 0, 1, 1]

    Raises:
      ValueError: the nodes are not given, do not divide the ranks, or are too few for ``peers``.
    """
    if ranks_per_node is not None and node_ids is not None:
        raise ValueError("give ranks_per_node or node_ids, not both")
    if node_ids is not None:
        node_of = [int(n) for n in node_ids]
        if len(node_of) != world:
            raise ValueError(f"node_ids gives a node for each rank: {world} ranks, found {len(node_of)} node ids")
    else:
        how = "ranks_per_node"
        if ranks_per_node is None and world == 1:
            ranks_per_node = 1
        elif ranks_per_node is None:
            env = os.environ.get("LOCAL_WORLD_SIZE")
            if env is None:
                raise ValueError(
                    "which ranks share a node is not known: pass ranks_per_node or node_ids (or run under torchrun, "
                    "which sets LOCAL_WORLD_SIZE)"
                )
            ranks_per_node, how = int(env), "LOCAL_WORLD_SIZE"
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"{how}={ranks_per_node} does not divide the {world} ranks into nodes")
        node_of = [r // ranks_per_node for r in range(world)]
    nodes = len(set(node_of))
    if not 0 <= peers < nodes:
        raise ValueError(
            f"peers={peers}: each node's steps go to that many other nodes, but there are {nodes} node(s) "
            f"({world} ranks); peers must be between 0 and {nodes - 1}"
        )
    return node_of


def _make_way(final: Path) -> None:
    """Remove what is at ``final`` before a step arriving from a peer is renamed there: a step's directory,
    committed, or what a crashed save left. Anything else there is foreign and left alone: a CheckpointError."""
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        try:
            ours = Storage(final).is_committed() or only_a_save_wrote(os.listdir(final))
        except OSError:
            ours = False
        if ours:
            remove_tree(final)
            return
    if stat.S_ISDIR(mode):
        kind = "a directory holding files no save writes"
    else:
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
    raise CheckpointError(
        f"{final} is {kind}, not a step this manager wrote; it is left alone, and the step arriving from a peer is "
        f"not put there (move it away)"
    )


class PeerTierManager(ClosesOnExit):
    """Checkpoints to each node's own local directory, replicated to ``peers`` other nodes, and to durable storage.

    A node is a group of ranks on one machine (``ranks_per_node``, a node id per rank in
    ``node_ids``, or torchrun's ``LOCAL_WORLD_SIZE``). Every ``local_interval_steps``
    each node saves what its ranks hold (each rank's own part: a DTensor as its shard)
    into ``local_directory``, a directory of that machine that no other node sees
    (``/dev/shm/<run>``), committed per node; then the node's leader (its first rank)
    sends that step's files whole to the next ``peers`` nodes (node ``n`` to ``n+1``, ...,
    ``n+peers``, modulo the nodes) over the checkpoint's own gloo groups, on a thread
    beside the training loop; they keep them under ``local_directory/replicas/``. Every
    ``durable_interval_steps`` the step also goes to ``durable_directory``, as a
    :class:`CheckpointManager` saves it (any world size may load it).

    :meth:`restore` takes the newest step whose every node's part is on its node or in
    a peer's replica: a node whose local directory was lost (a new machine, restarted)
    gets its part sent back from a peer, into its local directory, and loads it there,
    its checksums verified as every load does; durable storage is not read. When no
    step of the peer tier is whole (or none loads), it restores from the durable tier,
    with a :class:`CheckpointDamageWarning`. The ranks agree on every choice.
    Restoring from the peer tier needs the same ranks and nodes as the save; give
    :meth:`restore` the target (DTensors on their meshes, models, optimizers) so the
    shards go back into them (without one, it returns each rank's own part as saved).

    ``save_on_signals`` saves the step of a preemption signal to both tiers, synchronously.
    """

    def __init__(
        self,
        local_directory: Where,
        durable_directory: Where,
        *,
        durable_interval_steps: int,
        local_interval_steps: int = 1,
        peers: int = 1,
        ranks_per_node: int | None = None,
        node_ids: Sequence[int] | None = None,
        local_max_to_keep: int = 2,
        durable_max_to_keep: int | None = None,
        async_: bool = True,
        save_on_signals: Iterable[int] = (),
        timeout: float | None = None,
    ) -> None:
        """See the class.

        Args:
          local_directory: this node's own directory (the same path on every machine is fine).
          durable_directory: the durable tier, seen by every rank.
          durable_interval_steps: save to the durable tier every this many steps.
          local_interval_steps: save to the node-local tier (and replicate) every this many steps.
          peers: to how many other nodes each node's steps are copied (0 to nodes - 1).
          ranks_per_node: ranks ``r`` with the same ``r // ranks_per_node`` share a node.
          node_ids: each rank's node, by rank (instead of ``ranks_per_node``).
          local_max_to_keep: steps kept in each local directory, and of each peer's replicas.
          durable_max_to_keep: steps kept in the durable tier (None: all).
          async_: save to the durable tier asynchronously.
          save_on_signals: see :class:`CheckpointManager`.
          timeout: see :class:`CheckpointManager`: of each wait of either tier, and of the
            copies to and from peers.

        Raises:
          ValueError: a bad interval, the nodes not given or not dividing the ranks,
            ``peers`` not below the number of nodes, or one directory for both tiers.
        """
        if local_interval_steps < 1 or durable_interval_steps < 1:
            raise ValueError(
                f"intervals must be at least 1, found local {local_interval_steps} and durable {durable_interval_steps}"
            )
        where = resolve(local_directory)
        if where.path is None:
            raise ValueError(f"the local tier is a directory of the machine, found {describe(local_directory)}")
        if describe(local_directory) == describe(durable_directory):
            raise ValueError(f"the two tiers need two directories, both are {describe(local_directory)}")
        rank, size = world()
        self.node_of = node_layout(size, peers, ranks_per_node, node_ids)
        self._ids = sorted(set(self.node_of))
        self.peers = peers
        self.node = self._ids.index(self.node_of[rank])
        """This rank's node, numbered from 0 in the order of the node ids."""
        self._leaders = [self.node_of.index(i) for i in self._ids]
        self._is_leader = rank == self._leaders[self.node]
        node_group, xfer = node_groups(self.node_of) if size > 1 else (None, None)
        self._node_group = node_group
        self._xfer = xfer
        self.timeout = None if timeout is None else resolve_timeout(timeout)
        self._comm: Comm | None = DistComm((xfer, xfer), self.timeout) if xfer is not None else None
        if isinstance(self._comm, DistComm):
            self._comm.monitor, self._comm.op = None, "manager"
        self.local_interval_steps = local_interval_steps
        self.durable_interval_steps = durable_interval_steps
        self.local_max_to_keep = local_max_to_keep
        self.local = CheckpointManager(
            local_directory, max_to_keep=local_max_to_keep, async_=False, process_group=node_group, timeout=timeout
        )
        self.durable = CheckpointManager(
            durable_directory,
            max_to_keep=durable_max_to_keep,
            async_=async_,
            save_on_signals=save_on_signals,
            timeout=timeout,
        )
        self._root: Path = where.path
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self.last_restored_step: int | None = None
        """The step the last :meth:`restore` loaded."""
        self.last_restored_tier: str | None = None
        """``"peers"`` (each node's directory or a peer's replica) or ``"durable"``."""
        self.last_restored_sources: dict[int, str] = {}
        """Where each node's part (by node id) came from at the last restore from the peer tier: ``"local"`` or
        ``"node <id>"`` (a peer's replica)."""
        if self._is_leader:
            for d in (self._root, *self._root.glob("replicas/node_*")):
                for p in d.glob(f"{_INCOMING}*") if d.is_dir() else ():
                    remove_tree(p)  # what a crash left of a transfer

    # ------------------------------------------------------------------ save
    def save(self, step: int, tree: Any, spec: Any = None, *, force: bool = False, **kwargs: Any) -> tuple[str, ...]:
        """Save ``step`` to the tiers whose interval it is on: returns the tiers (``("local", "durable")``, ...).

        A step due for the durable tier (its interval, ``force``, a preemption signal) is
        saved to both. The local save is synchronous; its replication to the peers runs
        on a thread until the next call that waits (``save``, ``wait``, ``restore``,
        ``close``), which raises its failure on every rank. ``spec`` is the durable
        tier's (the local tier stores each rank's own part). Other arguments go to
        :meth:`CheckpointManager.save`.
        """
        step = check_step(step)
        triggers = self.durable._triggers
        preempt = triggers.flag is not None and triggers.preemption_step is None and triggers.due(step)[0]
        durable = force or preempt or step % self.durable_interval_steps == 0
        if not (durable or step % self.local_interval_steps == 0):
            return ()
        self._finish_replication()
        self.durable.wait()  # one save runs at a time
        self.local.save(step, local_view(tree), PER_RANK, force=True, **kwargs)
        if self.peers:
            self._thread_error = None
            with call_timeout(self.timeout):  # (the thread's copies wait as long as the manager's calls)
                run = contextvars.copy_context().run
            self._thread = threading.Thread(target=run, args=(self._replicate, step), name="pytreeckpt-peers")
            self._thread.start()
        if not durable:
            return ("local",)
        self.durable.save(step, tree, spec, force=force, **kwargs)
        return ("local", "durable")

    def _replica_dir(self, node: int) -> Path:
        return self._root / "replicas" / f"node_{self._ids[node]}"

    def _replicate(self, step: int) -> None:
        """(thread) The leaders send this node's ``step`` to the next ``peers`` nodes and keep the previous ones'."""
        try:
            if not self._is_leader:
                return
            nodes = len(self._ids)
            path = self.local.step_path(step)
            assert isinstance(path, Path)
            for j in range(1, self.peers + 1):
                to, frm = (self.node + j) % nodes, (self.node - j) % nodes
                sent = send_files(self._xfer, self._leaders[to], path, f"step {step} of node {self._ids[self.node]}")
                try:
                    self._receive(frm, step, self._replica_dir(frm))
                finally:
                    sent()  # (the buffers being sent stay alive until they are)
                self._prune(self._replica_dir(frm))
        except BaseException as e:
            self._thread_error = e

    def _receive(self, frm: int, step: int, into: Path) -> None:
        """Receive node ``frm``'s ``step`` from its leader into ``into/step_<step>``, whole or not at all."""
        into.mkdir(parents=True, exist_ok=True)
        incoming = into / f"{_INCOMING}step_{step}-{uuid.uuid4().hex[:12]}"
        try:
            receive_files(self._xfer, self._leaders[frm], incoming, f"step {step} of node {self._ids[frm]}")
            final = into / f"step_{step}"
            _make_way(final)
            os.rename(incoming, final)
        finally:
            if incoming.exists():
                remove_tree(incoming)

    def _prune(self, replicas: Path) -> None:
        for _, path in step_dirs(replicas)[: -self.local_max_to_keep]:
            remove_tree(path)

    def _finish_replication(self) -> None:
        """Wait for the replication in flight; its failure on any rank is raised on every rank."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, error = None, self._thread_error
        self._thread_error = None
        if vote_max(self._comm, [error is not None], "the vote on the replication to peers")[0]:
            if error is not None:
                raise CheckpointError(f"replicating to the peer nodes failed: {error}") from error
            raise CheckpointError("replicating to the peer nodes failed on another rank (see its error)")

    # ------------------------------------------------------------------ listing
    def _held(self) -> dict[int, list[int]]:
        """The committed steps of each node's replicas held here."""
        out: dict[int, list[int]] = {}
        for n in range(len(self._ids)):
            d = self._replica_dir(n)
            if d.is_dir():
                out[n] = [s for s, path in step_dirs(d) if Storage(path).is_committed()]
        return out

    def _whole_steps(self) -> tuple[dict[int, dict[int, int]], dict[int, list[int]]]:
        """Every step of the peer tier whose every node's part is somewhere: {step: {node: the peer holding it}}
        (nodes that hold their own part are not named), and the steps some node's part is missing of, by node."""
        local = self.local.all_steps()
        mine = (self.node, local, self._held()) if self._is_leader else None
        if self._comm is None:
            listing = [mine]
        else:
            listing = self._comm.broadcast(self._comm.gather(mine))
        own = {n: set(steps) for n, steps, _ in (x for x in listing if x is not None)}
        held = {(h, n): set(steps) for h, _, by in (x for x in listing if x is not None) for n, steps in by.items()}
        whole: dict[int, dict[int, int]] = {}
        missing: dict[int, list[int]] = {}
        for s in sorted(set().union(*own.values(), *held.values()), reverse=True):
            sources: dict[int, int] = {}
            for n in range(len(self._ids)):
                if s in own[n]:
                    continue
                holders = [h for h in range(len(self._ids)) if s in held.get((h, n), ())]
                if not holders:
                    missing.setdefault(n, []).append(s)
                    break
                sources[n] = holders[0]
            else:
                whole[s] = sources
        return whole, missing

    def all_steps(self) -> dict[str, list[int]]:
        """The steps the peer tier can restore (each node's part on it or a peer) and the durable tier's."""
        self._finish_replication()
        whole, _ = self._whole_steps()
        return {"peers": sorted(whole), "durable": self.durable.all_steps()}

    # ------------------------------------------------------------------ restore
    def reached_preemption(self, step: int) -> bool:
        """Whether the loop should stop at ``step`` (see :meth:`CheckpointManager.reached_preemption`)."""
        return self.durable.reached_preemption(step)

    def restore(self, step: int | None = None, target: Any = None, **kwargs: Any) -> Any:
        """Load ``step``, or without one the newest step of the peer tier that loads, else of the durable tier.

        A node lacking its part of the step gets it from a peer's replica (written into
        its local directory, then loaded there); durable storage is not read unless no
        step of the peer tier is whole and loads (a :class:`CheckpointDamageWarning` says
        which nodes lacked what). ``restore(step=N)`` loads N from the peer tier if it is
        whole there, else from the durable tier, and raises if neither loads it. Other
        arguments go to :func:`pytreeckpt.load`.

        Raises:
          NotCommittedError: no step loads from either tier (or ``step`` from neither).
          CheckpointError: the target does not match.
        """
        if step is not None:
            step = check_step(step)
        self.wait()
        whole, missing = self._whole_steps()
        candidates = [
            (s, "peers", functools.partial(self._load_peer, s, sources, target, kwargs))
            for s, sources in sorted(whole.items(), reverse=True)
            if step is None or s == step
        ]
        newest = max((*whole, *(s for steps in missing.values() for s in steps)), default=None)
        try:
            result, self.last_restored_step, _ = first_that_loads(
                lambda: candidates, self._comm, f"no whole step in the peer tier of {self._root}"
            )
        except NotCommittedError as e:
            if newest is not None:
                lacking = "; ".join(f"node {self._ids[n]} lacks steps {steps}" for n, steps in sorted(missing.items()))
                warnings.warn(
                    f"the peer tier has no step that loads ({lacking or e}); restoring from the durable tier "
                    f"{self.durable.directory}",
                    CheckpointDamageWarning,
                    stacklevel=2,
                )
            result = self.durable.restore(step, target, **kwargs)
            self.last_restored_step, self.last_restored_tier, self.last_restored_sources = (
                self.durable.last_restored_step,
                "durable",
                {},
            )
            return result
        sources = whole[self.last_restored_step]
        self.last_restored_tier = "peers"
        self.last_restored_sources = {
            i: f"node {self._ids[sources[n]]}" if n in sources else "local" for n, i in enumerate(self._ids)
        }
        return result

    def _load_peer(self, step: int, sources: dict[int, int], target: Any, kwargs: dict[str, Any]) -> Any:
        """Fetch the parts of ``step`` that nodes lack from their peers, then load this rank's part."""
        with call_timeout(kwargs.get("timeout", self.timeout)):
            return self._fetch_and_load(step, sources, target, kwargs)

    def _fetch_and_load(self, step: int, sources: dict[int, int], target: Any, kwargs: dict[str, Any]) -> Any:
        error: BaseException | None = None
        try:
            for needer, holder in sorted(sources.items()):
                if self._is_leader and self.node == holder:
                    path = self._replica_dir(needer) / f"step_{step}"
                    send_files(self._xfer, self._leaders[needer], path, f"node {self._ids[needer]}'s step {step}")()
                elif self._is_leader and self.node == needer:
                    self._receive(holder, step, self._root)
        except Exception as e:  # every rank hears of it before any raises
            error = e
        if vote_max(self._comm, [error is not None], f"the vote on fetching step {step} from peers")[0]:
            if isinstance(error, CheckpointError):
                raise error
            raise CheckpointError(f"fetching step {step} from a peer failed: {error or 'on another rank'}") from error
        loaded = load(self.local.step_path(step), None, process_group=self._node_group, per_rank="own", **kwargs)
        return put_back(target, loaded)

    # ------------------------------------------------------------------ lifetime
    def wait(self) -> None:
        """Block until the replication in flight and both tiers' saves are done."""
        self._finish_replication()
        self.local.wait()
        self.durable.wait()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.local.close()
            self.durable.close()

    def __repr__(self) -> str:
        return (
            f"PeerTierManager(local={str(self._root)!r}, durable={str(self.durable.directory)!r}, "
            f"peers={self.peers}, nodes={len(self._ids)})"
        )
