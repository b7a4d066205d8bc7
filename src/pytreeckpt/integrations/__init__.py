"""Backends for the trainers people run, built on the functional API: each follows its host's conventions.

``integrations.lightning``: Lightning's ``CheckpointIO`` plugins (``PytreeCheckpointIO`` and
``AsyncPytreeCheckpointIO``), for ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``.
Nothing here is imported by ``import pytreeckpt``: each integration imports its trainer.
"""
