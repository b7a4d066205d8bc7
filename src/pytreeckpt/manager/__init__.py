"""Checkpoints over a training run: :class:`CheckpointManager` and :class:`TwoTierManager`.

Steps in one directory (``step_<n>``), retention, the newest committed step found and
restored, an asynchronous save per step with at most one in flight, and a fast local tier
mirrored to a durable one. Built on the functional API only.
"""
