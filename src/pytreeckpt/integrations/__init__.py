"""Backends for the trainers people run, on pytreeckpt's public API (the top layer, beside ``manager``).

Each integration is a module of its own, imported only by those who use it (it imports its trainer):
``pytreeckpt.integrations.torchtitan`` (a torchtitan checkpoint manager).
"""
