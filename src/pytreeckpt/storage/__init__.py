"""Where bytes live, and the rules for changing them.

Locations (local directories, ``memory://``, S3-compatible and GCS buckets), the commit
protocol (one writer, the metadata document written last and atomically, leftovers of
failed saves removed), stored arrays and their chunk files and OCDBT databases,
durability (fsync) and integrity (every chunk checked against the crc32c the metadata
records). :class:`Storage` is one checkpoint location with all of these parts; what a local
directory and an object store do differently is one :class:`~pytreeckpt.storage._place.Place`
per kind, so the parts are written once. Only this package and :mod:`pytreeckpt.execute` do
I/O; what they and :mod:`pytreeckpt.manager` use of it is exported here.
"""

from typing import TYPE_CHECKING

from pytreeckpt.core._lazy import lazy_exports

if TYPE_CHECKING:
    from pytreeckpt.storage._chunkfiles import chunk_crc as chunk_crc
    from pytreeckpt.storage._chunkfiles import open_regular as open_regular
    from pytreeckpt.storage._integrity import ChunkSums as ChunkSums
    from pytreeckpt.storage._integrity import available_memory as available_memory
    from pytreeckpt.storage._integrity import chunk_hash as chunk_hash
    from pytreeckpt.storage._io import Window as Window
    from pytreeckpt.storage._io import in_background as in_background
    from pytreeckpt.storage._local import LOCK_WAIT as LOCK_WAIT
    from pytreeckpt.storage._local import remove_tree as remove_tree
    from pytreeckpt.storage._location import Location as Location
    from pytreeckpt.storage._location import Where as Where
    from pytreeckpt.storage._location import describe as describe
    from pytreeckpt.storage._location import resolve as resolve
    from pytreeckpt.storage._options import ExecutorOptions as ExecutorOptions
    from pytreeckpt.storage._storage import Storage as Storage

# Each name imported on first use (``core._lazy``): what the command line's ls, inspect and verify
# reach of this package imports no more than they need.
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "chunk_crc": "pytreeckpt.storage._chunkfiles",
        "open_regular": "pytreeckpt.storage._chunkfiles",
        "ChunkSums": "pytreeckpt.storage._integrity",
        "available_memory": "pytreeckpt.storage._integrity",
        "chunk_hash": "pytreeckpt.storage._integrity",
        "Window": "pytreeckpt.storage._io",
        "in_background": "pytreeckpt.storage._io",
        "LOCK_WAIT": "pytreeckpt.storage._local",
        "remove_tree": "pytreeckpt.storage._local",
        "Location": "pytreeckpt.storage._location",
        "Where": "pytreeckpt.storage._location",
        "describe": "pytreeckpt.storage._location",
        "resolve": "pytreeckpt.storage._location",
        "ExecutorOptions": "pytreeckpt.storage._options",
        "Storage": "pytreeckpt.storage._storage",
    },
)

__all__ = [
    "LOCK_WAIT",
    "ChunkSums",
    "ExecutorOptions",
    "Location",
    "Storage",
    "Where",
    "Window",
    "available_memory",
    "chunk_crc",
    "chunk_hash",
    "describe",
    "in_background",
    "open_regular",
    "remove_tree",
    "resolve",
]
