"""Checkpoints over a training run: :class:`CheckpointManager` and :class:`TwoTierManager`.

Steps in one directory (``step_<n>``), retention, the newest committed step found and
restored, an asynchronous save per step with at most one in flight, and a fast local tier
mirrored to a durable one. Built on the functional API (``save``, ``async_save``, ``load``,
``metadata``), the storage interface (``pytreeckpt.storage``: locations, a step's
commit state, its removal, the writer's lock), and three internals: the staging pool it
frees between steps (``execute._staging``), the stored form's names (``pytreeckpt.format``:
the metadata file, a step directory's pattern) and the process group as a Comm
(``distributed._comm``).
"""
