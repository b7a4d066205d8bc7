"""A checkpoint location's state, which every part of :class:`~pytreeckpt.storage.Storage` shares: its
location, options, TensorStore context (made on first use) and :class:`~pytreeckpt.storage._place.Place`
(a local directory or a key-value store prefix)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pytreeckpt.plan import ChunkingOptions
from pytreeckpt.storage._deadline import StoreWaits
from pytreeckpt.storage._local import LocalDir
from pytreeckpt.storage._location import ContextOnUse, KvPrefix, Where, resolve
from pytreeckpt.storage._objects import ObjectPrefix
from pytreeckpt.storage._options import ExecutorOptions
from pytreeckpt.storage._place import Place


class StorageBase:
    """A checkpoint location's state; the parts of :class:`Storage` each add one responsibility."""

    def __init__(self, path: Where, options: ExecutorOptions | None = None) -> None:
        self.location = resolve(path)
        self.url = self.location.url
        self.options = options or ExecutorOptions()
        self.contexts = ContextOnUse(
            self.location, self.options.file_io_concurrency, self.options.data_copy_concurrency
        )
        # The place's way of doing what differs between a directory and an object store; ``files``
        # is the same place where arrays are files this package reads and writes itself.
        self.kv: KvPrefix | None = None
        self.files: LocalDir | None = None
        self.place: Place
        # Every wait on the store's requests, bounded by the call's timeout (not a local directory's).
        self.waits: StoreWaits
        if self.location.path is not None:
            self.place = self.files = LocalDir(self.location.path, self.url)
            self.waits = StoreWaits(None)
        else:
            self.kv = KvPrefix(self.location, self.context)
            self.place = ObjectPrefix(self.kv, self.url)
            self.waits = self.kv.waits
        self._packed: Any = None  # the OCDBT databases' key-value stores, once used (ArrayIO.packed)
        # The commit protocol's state for one save: what the committed document referenced
        # when the save began (None: unreadable, so all is kept), and whether it prepared.
        self._kept: frozenset[str] | None = None
        self._prepared = False

    @property
    def context(self) -> Any:
        """The TensorStore context of this location's arrays and databases, made on first use: a local checkpoint
        whose arrays are all chunk files or zip archives is read without importing TensorStore."""
        return self.contexts.get()

    @property
    def root(self) -> Path:
        """The directory of a local checkpoint."""
        assert self.location.path is not None, "a key-value store location has no directory"
        return self.location.path

    @property
    def chunking(self) -> ChunkingOptions:
        """How arrays are chunked here when the caller says nothing."""
        if self.location.options.chunking is not None:
            return self.location.options.chunking
        return self.place.default_chunking
