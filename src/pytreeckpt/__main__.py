"""``python -m pytreeckpt`` runs the command line."""

from ._cli import _entry

_entry()
