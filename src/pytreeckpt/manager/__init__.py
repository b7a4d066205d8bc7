"""Checkpoints over a training run: :class:`CheckpointManager` and :class:`TwoTierManager`.

Steps in one directory (``step_<n>``); retention by count, by a metric (``_policy``) and by
time, with deletions on a thread of their own; the newest committed step found and
restored, falling back past damaged steps (``_fallback``); an asynchronous save per step
with at most one in flight; a synchronous save of the step a preemption signal arrives at
(``_preempt``); a fast local tier mirrored to a durable one (``_tiered``); and a node-local tier
replicated to peer nodes over a durable one (``_peers``: each rank's own view in ``_local_view``, the
transfers in ``distributed._peers``). Built on the
functional API (``save``, ``async_save``, ``load``, ``metadata``), the storage interface
(``pytreeckpt.storage``: locations, a step's commit state, its removal, the writer's lock),
and four internals: the staging pool it frees between steps (``execute._staging``), the
stored form's names (``pytreeckpt.format``: the metadata file, a step directory's pattern),
the process group as a Comm (``distributed._comm``) and the ranks' votes
(``distributed._vote``).
"""
