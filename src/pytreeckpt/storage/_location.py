"""Where a checkpoint lives: local paths, URLs and TensorStore kvstore specs.

A location is a local directory (a path, ``file://`` URL or ``{"driver": "file"}``
spec), handled with the file system's own guarantees (``flock``, rename, fsync), or a
prefix of a key-value store reached through TensorStore (``memory://``, ``s3://``,
``gs://`` or any other kvstore spec), where objects are written whole and there is no
rename. This module parses locations and runs the few whole-object operations the
commit protocol needs on a key-value store; arrays themselves are opened by the
executor with the kvstore spec given here.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import stat
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.plan import ChunkingOptions
from pytreeckpt.storage._deadline import StoreWaits

# (TensorStore is imported where used: ``pytreeckpt ls`` of a local directory needs none)

__all__ = ["KvPrefix", "Location", "Resolved", "StorageOptions", "describe", "resolve"]

MiB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageOptions:
    """How a location is reached and how data is laid out there.

    Attributes:
      endpoint: the S3 endpoint URL (``http://host:port``); default ``AWS_ENDPOINT_URL``
        (or ``AWS_ENDPOINT_URL_S3``), else AWS itself.
      region: the S3 region; default ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, else
        ``us-east-1`` when an endpoint is set.
      access_key_id, secret_access_key: S3 credentials; default the usual chain
        (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, instance roles).
        Given here, they reach TensorStore through a private (0600) credentials file that
        is removed when the process exits.
      aws_credentials: a TensorStore ``aws_credentials`` spec (e.g. ``{"type": "profile",
        "profile": "ckpt"}``), used instead of the above when given.
      request_concurrency: concurrent requests to an object store (S3 or GCS).
      max_retries: retries of a request that failed with a transient error (throttling,
        5xx, a refused connection), with exponential backoff from ``initial_retry_delay``
        up to ``max_retry_delay`` seconds. Bounded, so a dead endpoint fails in seconds.
      chunking: how arrays are chunked when ``save`` is given no ``chunking``; None: the
        backend's default (several MiB per chunk on object stores, fewer requests).
      pack_small_leaves: store arrays of at most ``pack_max_bytes`` together, per writing
        rank (see ``pack_format``), instead of as files / objects of their own.
      pack_max_bytes: the largest array packed.
      pack_format: ``"zip"`` (the default): packed arrays are entries of zip archives,
        ``packed/<rank>/<n>.zip``, written by appending and read from the mapped files, in
        local directories (on object stores, and on a big-endian host, they go to OCDBT;
        compressed small arrays are stored on their own); ``"ocdbt"``: keys of an OCDBT
        database per writing rank, ``ocdbt/<rank>/``, as before format version 3. Either
        way each packed leaf is a zarr v3 array TensorStore opens (through its ``zip`` or
        ``ocdbt`` kvstore).
      max_metadata_bytes: the largest metadata document read (checked before reading
        it): a document past it is refused with a MetadataError, and a save whose document
        would pass it refuses before writing. Parsing a document may take up to about 25
        times its size in memory.
      max_inline_checksum_bytes: the document records every chunk's crc32c (5.4 bytes a
        chunk in it); past this many bytes of them a save keeps them in a file of their
        own, ``checksums/crc32c``, from which a load reads only the arrays it reads (each
        array's part named in the document, with its crc32c). Every rank of a load
        parses the document: a Llama 405B state saved by 16,384 ranks in FSDP2 x TP8 has
        10 million chunks, 55 of its 57 MB their checksums inline.
    """

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    aws_credentials: Mapping[str, Any] | None = None
    request_concurrency: int = 32
    max_retries: int = 4
    initial_retry_delay: float = 0.1
    max_retry_delay: float = 2.0
    chunking: ChunkingOptions | None = None
    pack_small_leaves: bool = True
    pack_max_bytes: int = 1 * MiB
    pack_format: str = "zip"
    max_metadata_bytes: int = 256 * MiB
    max_inline_checksum_bytes: int = 1 * MiB

    def __post_init__(self) -> None:
        if self.pack_format not in ("ocdbt", "zip"):
            raise ValueError(f"pack_format must be 'ocdbt' or 'zip', found {self.pack_format!r}")


OCDBT_CACHE = "cache_pool#ocdbt"
"""The cache of packed arrays' OCDBT b-tree nodes (array data itself is never cached)."""

OBJECT_STORE_CHUNKING = ChunkingOptions(single_chunk_bytes=4 * MiB, min_chunk_bytes=4 * MiB, max_chunk_bytes=64 * MiB)


@dataclass(frozen=True, slots=True)
class Location:
    """A checkpoint location with its storage options.

    ``target`` is a local path, a URL (``file://``, ``memory://``, ``s3://bucket/prefix``,
    ``gs://bucket/prefix``) or a TensorStore kvstore spec. Every call that takes a path
    also takes a ``Location``; a bare path or URL uses default options.

    >>> Location("s3://bucket/run1", StorageOptions(endpoint="http://127.0.0.1:8333")).child("step_3")
    Location('s3://bucket/run1/step_3')
    """

    target: str | os.PathLike[str] | Mapping[str, Any]
    options: StorageOptions = field(default_factory=StorageOptions)

    def child(self, name: str) -> Location:
        """The location ``name`` below this one, with the same options."""
        r = resolve(self).child(name)
        return Location(r.path if r.path is not None else dict(r.spec or {}), self.options)

    def __repr__(self) -> str:
        return f"Location({resolve(self).url!r})"


Where = str | os.PathLike[str] | Mapping[str, Any] | Location


@dataclass(frozen=True)
class Resolved:
    """A parsed location: a local directory (``path``) or a kvstore prefix (``spec``, its path ending in ``/``)."""

    path: Path | None
    spec: dict[str, Any] | None
    options: StorageOptions
    url: str

    @property
    def is_local(self) -> bool:
        return self.path is not None

    def child(self, name: str) -> Resolved:
        if self.path is not None:
            return Resolved(self.path / name, None, self.options, str(self.path / name))
        assert self.spec is not None
        spec = {**self.spec, "path": self.spec["path"] + name + "/"}
        return Resolved(None, spec, self.options, _url_of(spec))

    def kvstore(self, relative: str) -> dict[str, Any]:
        """The kvstore spec of ``relative`` (a path below the location; ``/``-separated)."""
        if self.path is not None:
            tail = "/" if relative.endswith("/") else ""
            return {"driver": "file", "path": str(self.path / relative).rstrip("/") + tail}
        assert self.spec is not None
        return {**self.spec, "path": self.spec["path"] + relative}


def _url_of(spec: Mapping[str, Any]) -> str:
    driver, path = spec.get("driver"), spec.get("path", "")
    if driver == "s3":
        return f"s3://{spec.get('bucket')}/{path}".rstrip("/")
    if driver == "gcs":
        return f"gs://{spec.get('bucket')}/{path}".rstrip("/")
    if driver == "memory":
        return f"memory://{path}".rstrip("/")
    return f"{driver}:{path}"


def _prefix(path: str) -> str:
    path = path.strip("/")
    return path + "/" if path else ""


def resolve(where: Where, options: StorageOptions | None = None) -> Resolved:
    """Parse a path, URL, kvstore spec or :class:`Location`."""
    if isinstance(where, Location):
        return resolve(where.target, where.options)
    opts = options or StorageOptions()
    if isinstance(where, Mapping):
        spec = dict(where)
        driver = spec.get("driver")
        if not isinstance(driver, str):
            raise CheckpointError(f"a kvstore spec needs a 'driver', found {where!r}")
        if driver == "file":
            return _local(str(spec.get("path", "")), opts)
        spec["path"] = _prefix(str(spec.get("path", "")))
        if "\0" in spec["path"]:
            raise CheckpointError(f"{spec['path']!r}: a location's path may not hold a NUL character")
        if driver == "s3":
            spec = _s3_spec(spec, opts)
        return Resolved(None, spec, opts, _url_of(spec))
    text = os.fspath(where)
    if "\0" in text:
        raise CheckpointError(f"{text!r}: a location may not hold a NUL character (no file system can name it)")
    if "://" not in text:
        return _local(text, opts)
    scheme, rest = text.split("://", 1)
    if scheme == "file":
        return _local(rest, opts)
    if scheme == "memory":
        spec = {"driver": "memory", "path": _prefix(rest)}
    elif scheme in ("s3", "gs"):
        bucket, _, path = rest.partition("/")
        if not bucket:
            raise CheckpointError(f"{text}: no bucket in the URL; expected {scheme}://bucket/prefix")
        spec = {"driver": "s3" if scheme == "s3" else "gcs", "bucket": bucket, "path": _prefix(path)}
        if scheme == "s3":
            spec = _s3_spec(spec, opts)
    else:
        raise CheckpointError(
            f"{text}: unsupported location scheme {scheme!r}; use a local path, file://, memory://, s3:// or gs://, "
            f"or a TensorStore kvstore spec"
        )
    return Resolved(None, spec, opts, _url_of(spec))


def _local(path: str, opts: StorageOptions) -> Resolved:
    if not path:
        raise CheckpointError("an empty path is not a checkpoint location")
    if "\0" in path:
        raise CheckpointError(f"{path!r}: a path may not hold a NUL character (no file system can name it)")
    p = Path(path).absolute()
    return Resolved(p, None, opts, str(p))


def _s3_spec(spec: dict[str, Any], opts: StorageOptions) -> dict[str, Any]:
    endpoint = opts.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint and "endpoint" not in spec:
        spec["endpoint"] = endpoint
    region = opts.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if "aws_region" not in spec and (region or "endpoint" in spec):
        spec["aws_region"] = region or "us-east-1"
    return spec


def store_name(r: Resolved) -> str | None:
    """A key-value store location as its errors name it: the URL and the endpoint it is reached at
    (``s3://bucket/prefix at http://127.0.0.1:8333``); None for a local directory.

    >>> store_name(resolve(Location("s3://b/run", StorageOptions(endpoint="http://127.0.0.1:8333"))))
    's3://b/run at http://127.0.0.1:8333'
    """
    if r.spec is None:
        return None
    endpoint = r.spec.get("endpoint")
    if r.spec.get("driver") == "s3" and endpoint is None:
        endpoint = "AWS S3"
    return r.url if endpoint is None else f"{r.url} at {endpoint}"


def describe(where: Where) -> str:
    """A location as people read it: the absolute path or the URL."""
    try:
        return resolve(where).url
    except CheckpointError:
        return repr(where)


# --------------------------------------------------------------------------- contexts

_SHARED: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared_parent() -> Any:
    """One parent context per process, so ``memory://`` data outlives the call that wrote it."""
    import tensorstore as ts

    with _SHARED_LOCK:
        if "parent" not in _SHARED:
            _SHARED["parent"] = ts.Context()
        return _SHARED["parent"]


def _credentials_file(key_id: str, secret: str) -> str:
    """A private AWS credentials file holding one profile, removed at exit.

    A process that never reaches its exit handlers (killed, or ended by ``os._exit`` as
    forked workers are) cannot remove its file; the files live in a private directory of
    this user, named after their process, and the next process that makes one removes
    those of processes that are gone.
    """
    with _SHARED_LOCK:
        files: dict[tuple[str, str], str] = _SHARED.setdefault("credentials", {})
        if (key_id, secret) not in files:
            where = _private_dir()
            if where is not None:
                _remove_orphans(where)
            fd, name = tempfile.mkstemp(prefix=f"aws-{os.getpid()}-", suffix=".ini", dir=where)
            with os.fdopen(fd, "w") as f:  # mkstemp makes it 0600
                f.write(f"[pytreeckpt]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
            atexit.register(_remove_quietly, name)
            files[(key_id, secret)] = name
        return files[(key_id, secret)]


def _private_dir() -> str | None:
    """``<tmp>/pytreeckpt-<uid>``, a directory only this user can enter, or None if it cannot be trusted."""
    path = os.path.join(tempfile.gettempdir(), f"pytreeckpt-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except OSError:
        return None
    # another user's directory, a link, or one others can enter: not a place for secrets
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


def _remove_orphans(where: str) -> None:
    """Remove the credentials files of processes that ended without removing theirs."""
    for name in os.listdir(where):
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != "aws" or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            _remove_quietly(os.path.join(where, name))
        except PermissionError:  # alive, another user's (cannot happen in a 0700 directory of ours)
            continue


def _remove_quietly(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)


def context_spec(r: Resolved, file_io_concurrency: int, data_copy_concurrency: int) -> dict[str, Any]:
    """TensorStore context resources for a location: concurrency, retries, credentials."""
    o = r.options
    spec: dict[str, Any] = {
        "file_io_concurrency": {"limit": file_io_concurrency},
        "data_copy_concurrency": {"limit": data_copy_concurrency},
        "cache_pool": {"total_bytes_limit": 0},
        OCDBT_CACHE: {"total_bytes_limit": 64 * MiB},
    }
    if r.is_local:
        # The Storage fsyncs every file it wrote and every directory holding one, in
        # parallel, once its writes are done and before the commit (tests check that it
        # missed none). TensorStore's own per-file fsync would repeat that for the files
        # and say nothing of the new directory entries.
        spec["file_io_sync"] = False
    retries = {
        "max_retries": o.max_retries,
        "initial_delay": f"{o.initial_retry_delay}s",
        "max_delay": f"{o.max_retry_delay}s",
    }
    driver = None if r.spec is None else r.spec.get("driver")
    if driver == "s3":
        spec["s3_request_concurrency"] = {"limit": o.request_concurrency}
        spec["s3_request_retries"] = retries
        if o.aws_credentials is not None:
            spec["aws_credentials"] = dict(o.aws_credentials)
        elif o.access_key_id is not None and o.secret_access_key is not None:
            spec["aws_credentials"] = {
                "type": "profile",
                "profile": "pytreeckpt",
                "credentials_file": _credentials_file(o.access_key_id, o.secret_access_key),
                "config_file": os.devnull,
            }
    elif driver == "gcs":
        spec["gcs_request_concurrency"] = {"limit": o.request_concurrency}
        spec["gcs_request_retries"] = retries
    return spec


def make_context(r: Resolved, file_io_concurrency: int = 16, data_copy_concurrency: int = 4) -> Any:
    import tensorstore as ts

    spec = context_spec(r, file_io_concurrency, data_copy_concurrency)
    if r.spec is not None and r.spec.get("driver") == "memory":
        return ts.Context(spec, parent=_shared_parent())
    return ts.Context(spec)


class ContextOnUse:
    """A location's one TensorStore context (:func:`make_context`), made when first asked for: reading a local
    checkpoint's chunk files and zip archives, which this library does itself, imports no TensorStore."""

    def __init__(self, r: Resolved, file_io_concurrency: int, data_copy_concurrency: int) -> None:
        self._args = (r, file_io_concurrency, data_copy_concurrency)
        self._context: Any = None
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The context (the same one every time: the arrays and databases of a location share it)."""
        context = self._context
        if context is None:
            with self._lock:
                if self._context is None:
                    self._context = make_context(*self._args)
                context = self._context
        return context


# --------------------------------------------------------------------------- whole objects


class KvPrefix:
    """Whole-object operations below a kvstore prefix; errors are CheckpointErrors naming the location.

    Each request is waited for within the call's timeout (:class:`StoreWaits`).
    """

    def __init__(self, r: Resolved, context: Any) -> None:
        assert r.spec is not None
        self.resolved = r
        self.url = r.url
        self.context = context
        self.waits = StoreWaits(store_name(r))
        self._store: Any = None

    @property
    def store(self) -> Any:
        import tensorstore as ts

        if self._store is None:
            self._store = self._run(lambda: ts.KvStore.open(self.resolved.spec, context=self.context), "open")
        return self._store

    def _run(self, start: Any, what: str, doing: str | None = None) -> Any:
        """Start a request (``start()`` gives its future) and wait for it within the call's timeout; ``what``
        names it in errors (``cannot <what>``), ``doing`` (default: the request to ``what``) if it times out."""
        try:
            return self.waits.wait(start(), doing or f"the request to {what}")
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.url}: cannot {what}: {_short(e)}") from e

    def read(self, key: str) -> bytes | None:
        """The object ``key``, or None if it does not exist."""
        result = self._run(lambda: self.store.read(key), f"read {key!r}")
        return None if result.state == "missing" else bytes(result.value)

    def read_range(self, key: str, start: int, stop: int) -> bytes | None:
        """Bytes ``start`` to ``stop`` of the object ``key`` (fewer where it ends), or None if it does not exist."""
        try:
            got = self.waits.wait(self.store.read(key, byte_range=slice(start, stop)), f"the request to read {key!r}")
        except CheckpointError:
            raise
        except Exception as e:
            if "OUT_OF_RANGE" in str(e):  # the object ends at or before byte start
                return b""
            raise CheckpointError(f"{self.url}: cannot read {key!r}: {_short(e)}") from e
        return None if got.state == "missing" else bytes(got.value)

    def longer_than(self, key: str, n: int) -> bool:
        """Whether the object ``key`` holds more than ``n`` bytes (one byte is read, not the object)."""
        return bool(self.read_range(key, n, n + 1))

    def write(self, key: str, data: bytes, doing: str | None = None) -> None:
        """Put the object ``key``; ``doing`` says what it is if it times out."""
        self._run(lambda: self.store.write(key, data), f"write {key!r}", doing)

    def list(self, prefix: str = "") -> list[str]:
        """Every key below ``prefix`` (relative to the location), sorted."""
        import tensorstore as ts

        rng = ts.KvStore.KeyRange(prefix, _after(prefix)) if prefix else None
        keys = self._run(lambda: self.store.list(rng), f"list {prefix or 'the location'}")
        return sorted(k.decode() for k in keys)

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key below ``prefix`` (all keys when empty)."""
        import tensorstore as ts

        rng = ts.KvStore.KeyRange(prefix, _after(prefix)) if prefix else ts.KvStore.KeyRange()
        self._run(lambda: self.store.delete_range(rng), f"delete {prefix or 'the location'}")

    def delete(self, key: str) -> None:
        import tensorstore as ts

        self._run(lambda: self.store.delete_range(ts.KvStore.KeyRange(key, key + "\0")), f"delete {key!r}")

    def check_reachable(self) -> None:
        """Raise now if the store cannot be listed (no such bucket, wrong credentials, no endpoint)."""
        import tensorstore as ts

        probe = ".pytreeckpt-probe/"  # a listing of a key range that holds nothing: one cheap request
        self._run(lambda: self.store.list(ts.KvStore.KeyRange(probe, _after(probe))), "reach the store")


def _after(prefix: str) -> str:
    """The smallest key greater than every key starting with ``prefix``."""
    b = prefix.encode()
    while b and b[-1] == 0xFF:
        b = b[:-1]
    return (b[:-1] + bytes([b[-1] + 1])).decode("utf-8", "surrogateescape") if b else ""


def _short(e: BaseException) -> str:
    """TensorStore's message without the echoed response body."""
    text = str(e)
    cut = text.find(" [http_response_body=")
    if cut < 0:
        return text
    code = text.find("[http_response_code", cut)
    return text[:cut] + ("" if code < 0 else " " + text[code:].split("]")[0] + "]")
