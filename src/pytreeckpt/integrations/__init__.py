"""Backends for the trainers people run, built on the functional API: each follows its host's conventions.

Each integration is a module of its own, imported only by those who use it (it imports its trainer):
``pytreeckpt.integrations.torchtitan`` (a torchtitan checkpoint manager);
``pytreeckpt.integrations.lightning``: Lightning's ``CheckpointIO`` plugins (``PytreeCheckpointIO`` and
``AsyncPytreeCheckpointIO``), for ``Trainer(plugins=[...])`` and ``Fabric(plugins=[...])``.
Nothing here is imported by ``import pytreeckpt``.
"""
