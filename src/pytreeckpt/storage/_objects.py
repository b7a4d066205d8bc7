"""A checkpoint below a key-value store prefix (``memory://``, S3, GCS): objects are put whole, there is no
rename and no lock; the metadata document, put last in one request, is the commit."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pytreeckpt.core._errors import CheckpointError, CheckpointTimeoutError, MetadataError
from pytreeckpt.core._region import Region
from pytreeckpt.format import CHECKSUMS_DIR, METADATA_FILE, STEP_DIR, STORED_DIRS, ArrayMeta, chunk_count
from pytreeckpt.storage._location import OBJECT_STORE_CHUNKING, KvPrefix
from pytreeckpt.storage._place import Lock, Place, not_committed


class ObjectPrefix(Place):
    """A key-value store prefix: what the commit protocol, the checks and durability do there.

    There is no lock: one writer per prefix is the caller's responsibility. Every write is
    durable once its request has succeeded, so there is nothing to sync. Listings carry no
    sizes, so a stored array is checked by counting its chunk objects.
    """

    has_files = False
    default_chunking = OBJECT_STORE_CHUNKING

    def __init__(self, kv: KvPrefix, url: str) -> None:
        self.kv = kv
        self.url = url

    # ------------------------------------------------------------------ commit protocol
    def is_committed(self) -> bool:
        return self.kv.read(METADATA_FILE) is not None

    def lock(self) -> Lock:
        return Lock()

    def try_lock(self) -> Lock | None:
        return Lock()

    def check_writable(self, overwrite: bool) -> None:
        self.kv.check_reachable()
        keys = self.kv.list()
        if METADATA_FILE in keys and not overwrite:
            raise CheckpointError(f"{self.url} already holds a committed checkpoint; pass overwrite=True to replace it")
        unknown = [k for k in keys if k != METADATA_FILE and k.split("/")[0] not in STORED_DIRS]
        if unknown:
            raise CheckpointError(
                f"{self.url} is not empty and is not a pytreeckpt checkpoint (it holds {unknown[:5]}); "
                f"refusing to write into it"
            )

    def make_ready(self) -> None:
        pass  # (no folders, and a put is never half done)

    def write_document(self, body: bytes | bytearray | memoryview, tail: bytes) -> None:
        """One PUT of the whole document, after every array write has finished.

        If the store does not answer it within the call's timeout, the commit's outcome is
        unknown: the PUT, once sent, cannot be recalled and may land when the store answers
        again (see :mod:`pytreeckpt.storage._deadline`). Nothing the new document names is
        deleted then (``waits.stuck``: the failed save's clean-up is skipped).
        """
        doing = f"the PUT of the metadata document {METADATA_FILE!r} (the commit)"
        try:
            self.kv.write(METADATA_FILE, b"".join((body, tail)), doing)
        except CheckpointTimeoutError as e:
            raise self.kv.waits.timed_out(
                doing,
                e.timeout,
                "the commit's outcome is unknown: its PUT was sent and may still land when the store answers "
                "again, committing the new checkpoint (whole: every array was written before it); until then "
                "the checkpoint committed before, if any, stays. Load or list the location to see which",
            ) from None

    def write_checksums(self, name: str, data: bytes) -> None:
        self.kv.write(name, data)

    def read_checksums(self, name: str, start: int, stop: int) -> bytes:
        got = self.kv.read_range(name, start, stop)
        if got is None:
            raise CheckpointError(f"{self.url}: the chunk checksums {name!r} the metadata names are missing")
        return got

    def committed_document(self) -> bytes | None:
        return self.kv.read(METADATA_FILE)

    def stored_names(self, refuse_links: bool) -> set[str]:
        out: set[str] = set()
        for key in self.kv.list():
            parts = key.split("/")
            if len(parts) > 1 and parts[0] in STORED_DIRS:
                out.add(f"{parts[0]}/{parts[1]}")
        return out

    def delete(self, names: Iterable[str]) -> None:
        for name in sorted(names):
            self.kv.delete_prefix(name + "/")
            if name.startswith(CHECKSUMS_DIR + "/"):  # (a file, not a prefix)
                self.kv.delete(name)

    def after_failure(self, committed: bool) -> None:
        pass  # (no temporaries, folders or lock file)

    def remove(self) -> None:
        self.kv.delete(METADATA_FILE)
        self.kv.delete_prefix("")

    def read_metadata(self, limit: int) -> bytes:
        if self.kv.longer_than(METADATA_FILE, limit):
            raise MetadataError(
                f"{self.url}/{METADATA_FILE} holds more than {limit} bytes, the limit on a metadata document "
                f"(StorageOptions(max_metadata_bytes=...) raises it); refusing to read it"
            )
        raw = self.kv.read(METADATA_FILE)
        if raw is None:
            self.kv.check_reachable()  # a missing bucket reads as a missing object: say which it is
            steps: dict[int, bool] = {}  # step -> committed
            for key in self.kv.list("step_"):
                name, _, rest = key.partition("/")
                m = STEP_DIR.match(name)
                if m:
                    steps[int(m.group(1))] = steps.get(int(m.group(1)), False) or rest == METADATA_FILE
            raise not_committed(self.url, steps, ", or nothing at all")
        return raw

    # ------------------------------------------------------------------ checks before a read
    def check_inside(self, where: str, key: str) -> None:
        pass  # (keys have no links)

    def check_files(self, where: str, key: str) -> None:
        pass  # (objects are read whole by their key; a short or missing one fails its read)

    def check_chunks_stored(self, meta: ArrayMeta) -> None:
        """Every chunk object must be present (listings carry no sizes; a chunk shorter than claimed fails its
        read)."""
        if meta.nbytes == 0:
            return
        prefix = meta.path + "/"
        listed = set(self.kv.list(prefix))
        expected = chunk_count(meta.shape, meta.chunk_shape)
        chunks = sum(1 for k in listed if k.startswith(prefix + "c"))
        if chunks < expected:
            raise MetadataError(
                f"leaf {meta.key!r}: the metadata claims a {meta.dtype.name} array of shape {meta.shape} "
                f"in {expected} chunks but {self.url}/{meta.path} holds only {chunks} chunk objects"
            )

    def stored_bytes(self, meta: ArrayMeta) -> int | None:
        return None

    # ------------------------------------------------------------------ durability
    def note_chunks(self, meta: ArrayMeta, region: Region) -> None:
        pass  # (durable once written)

    def note_array(self, meta: ArrayMeta) -> None:
        pass

    def sync(self) -> None:
        pass

    def link_chunk(self, base: Any, base_path: str, path: str, index: tuple[int, ...]) -> bool:
        return False  # (no links; the executor copies the chunk instead)
