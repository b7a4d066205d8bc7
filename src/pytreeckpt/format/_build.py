"""Building a metadata document's text: its tree and user metadata serialised once (:class:`DocumentHead`),
each array leaf's entry (:func:`array_leaf_texts`), and a template whose checksums a save fills in place
(:class:`SumsTemplate`). A save's commit builds the document with :meth:`DocumentHead.document` or
:meth:`SumsTemplate.filled`; ``storage`` seals it (:func:`~pytreeckpt.format.seal_document`) and writes it."""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from pytreeckpt.core._errors import MetadataError
from pytreeckpt.core._node import Node
from pytreeckpt.format._checksums import ChecksumFile
from pytreeckpt.format._model import ArrayMeta
from pytreeckpt.format._paths import ARCHIVE_DIR, FORMAT_NAME


def _dumps(x: Any) -> str:
    # (no cycles to look for: user metadata was checked by a round trip, the rest is made here)
    return json.dumps(x, allow_nan=False, separators=(",", ":"), check_circular=False)


def _not_json(e: Exception) -> MetadataError:
    return MetadataError(f"metadata is not JSON-serialisable (check user_metadata): {e}")


@dataclass(frozen=True, slots=True)
class DocumentHead:
    """A metadata document's tree and user metadata, serialised once: a save does it when it plans
    (what cannot be serialised is refused before any write) and joins them with the leaves'
    entries when it commits."""

    tree: str
    user: str

    @classmethod
    def of(cls, tree: Node, user_metadata: dict[str, Any] | None) -> DocumentHead:
        try:
            return cls(_dumps(tree.to_json()), _dumps(user_metadata or {}))
        except (TypeError, ValueError) as e:
            raise _not_json(e) from None

    @classmethod
    def of_tree_text(cls, tree: str, user_metadata: dict[str, Any] | None) -> DocumentHead:
        """The head of a tree serialised before (``DocumentHead.of(...).tree``)."""
        try:
            return cls(tree, _dumps(user_metadata or {}))
        except (TypeError, ValueError) as e:
            raise _not_json(e) from None

    def document(
        self,
        leaves: Sequence[str | dict[str, Any]],
        databases: Iterable[str | None],
        checksums: ChecksumFile | None = None,
    ) -> bytes:
        """The document of these leaves' entries (JSON texts, as :func:`array_leaf_texts` makes them joined, or
        dicts), stored in ``databases`` (its version says which kinds of database it needs), and
        ``checksums``: the file its leaves' ``chunk_crc32c_at`` name. Byte for byte ``json.dumps``'s
        text of the whole document (compact separators)."""
        try:
            texts = cast("list[str]", leaves)
            if not set(map(type, leaves)) <= {str}:  # (values' entries among them, as dicts)
                texts = [x if type(x) is str else _dumps(x) for x in leaves]
        except (TypeError, ValueError) as e:
            raise _not_json(e) from None
        before, after = self.frame(databases, checksums)
        return "".join([before, ",".join(texts), after]).encode()

    def frame(self, databases: Iterable[str | None], checksums: ChecksumFile | None = None) -> tuple[str, str]:
        """The document's text before its leaves' entries and after them."""
        stored = {d for d in set(databases) if d is not None}  # (the set first: a few among 10^5 leaves)
        version = 3 if any(d.startswith(ARCHIVE_DIR + "/") for d in stored) else 2 if stored else 1
        before = f'{{"format":{_dumps(FORMAT_NAME)},"version":{version},"tree":{self.tree},"leaves":['
        after = ['],"user_metadata":', self.user]
        if checksums is not None:
            after += [',"checksums":', _dumps(checksums.to_json())]
        after.append("}")
        return before, "".join(after)


def build_document(
    tree: Node,
    leaves: Sequence[dict[str, Any]],
    user_metadata: dict[str, Any] | None,
    checksums: ChecksumFile | None = None,
) -> bytes:
    """Serialise a metadata document of these leaves' entries (``checksums``: the file their ``chunk_crc32c_at``
    name), as ``DocumentHead.of(tree, user_metadata).document(...)``. Not the commit's route (a save's commit
    calls :meth:`DocumentHead.document` or fills a :class:`SumsTemplate`): tests and
    ``benchmarks/plan_scale.py`` build documents with it."""
    databases = (leaf.get("database") for leaf in leaves)
    return DocumentHead.of(tree, user_metadata).document(leaves, databases, checksums)


_encode_str = json.encoder.encode_basestring_ascii  # (what json.dumps uses for a str: the C encoder)


def array_leaf_heads(metas: Sequence[ArrayMeta]) -> list[str | None]:
    """Each array leaf's entry in the metadata document up to its checksums, as JSON text (see
    :func:`array_leaf_texts`); None for a leaf with compression or chunk hashes, whose entry
    ``to_json`` makes. A save of a tree like one before keeps them (api/_recall.py).

    What leaves of one kind share (container, dtypes and shapes; layout and database) is
    serialised once; each leaf adds its key and path.
    """
    enc = _encode_str
    kinds: dict[tuple[Any, ...], str] = {}
    places: dict[tuple[int, str | None], str] = {}
    out: list[str | None] = []
    for m in metas:
        if m.compression is not None or m.chunk_hashes is not None:
            out.append(None)
            continue
        kind = (m.container, m.dtype.name, m.dtype.storage, m.shape, m.chunk_shape)
        mid = kinds.get(kind)
        if mid is None:
            mid = kinds[kind] = (
                f',"container":{enc(m.container)},"dtype":{enc(m.dtype.name)},"storage_dtype":{enc(m.dtype.storage)}'
                f',"shape":{_dumps(list(m.shape))},"chunk_shape":{_dumps(list(m.chunk_shape))},"path":'
            )
        place = (id(m.layout), m.database)  # (the metas hold their layouts: an id is not reused meanwhile)
        tail = places.get(place)
        if tail is None:
            layout = "null" if m.layout is None else _dumps(m.layout.to_json())
            database = "" if m.database is None else f',"database":{enc(m.database)}'
            tail = places[place] = f',"layout":{layout}{database}'
        out.append('{"kind":"array","key":' + enc(m.key) + mid + enc(m.path) + tail)
    return out


def array_leaf_texts(
    metas: Sequence[ArrayMeta],
    crcs: Sequence[bytes | None],
    hashes: Sequence[Sequence[str] | None],
    refs: Sequence[tuple[int, int] | None],
    heads: Sequence[str | None] | None = None,
) -> list[str]:
    """Each array leaf's entry in the metadata document as JSON text: ``meta.to_json(crc, hashes, ref)``
    serialised as the document serialises it (tests check it byte for byte).

    ``heads``: :func:`array_leaf_heads` of ``metas``, if made before. A save of 100,000
    small leaves spent a quarter of its commit on a dict per leaf and its serialisation;
    each leaf's entry is now its head and its checksums, those of leaves of one chunk
    encoded together. Leaves with compression or chunk hashes, or without checksums, go
    through ``to_json``. (A save whose leaves all have 4-byte checksums in the document
    fills a :class:`SumsTemplate` instead.)
    """
    if heads is None:
        heads = array_leaf_heads(metas)
    single = _single_chunk_sums(crcs)
    out: list[str] = []
    for m, head, crc, hashed, at, sums in zip(metas, heads, crcs, hashes, refs, single, strict=True):
        if head is None or hashed or (at is None and crc is None):
            out.append(_dumps(m.to_json(crc, hashed, at)))
        elif at is not None:
            out.append(f'{head},"chunk_crc32c_at":[{int(at[0])},{int(at[1])}]}}')
        elif sums is not None:
            out.append(head + sums)
        else:
            out.append(f'{head},"chunk_crc32c":"{base64.b64encode(crc).decode()}"}}')  # type: ignore[arg-type]
    return out


_SUMS_OPEN = ',"chunk_crc32c":"'
_B64 = np.frombuffer(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/", dtype=np.uint8)


def _single_chunk_sums(crcs: Sequence[bytes | None]) -> list[str | None]:
    """``',"chunk_crc32c":"<base64>"}'`` for each array of one chunk (a 4-byte checksum), None for the
    others: the base64 of all of them made at once (numpy), not a call per leaf."""
    sizes = [0 if c is None else len(c) for c in crcs]
    every = sizes.count(4) == len(crcs)
    where = range(len(crcs)) if every else [i for i, n in enumerate(sizes) if n == 4]
    out: list[str | None] = [None] * len(crcs)
    if not where:
        return out
    joined_crcs = b"".join(crcs) if every else b"".join([crcs[i] for i in where])  # type: ignore[misc, arg-type]
    width = len(_SUMS_FILLER)  # (the opening, 8 base64 characters, the last two "==", and '"}')
    text = np.empty((len(where), width), dtype=np.uint8)
    text[:] = np.frombuffer(_SUMS_FILLER.encode(), dtype=np.uint8)
    text[:, len(_SUMS_OPEN) : len(_SUMS_OPEN) + 6] = _base64_of_sums(joined_crcs)
    joined = text.tobytes().decode("ascii")
    texts = [joined[at : at + width] for at in range(0, len(joined), width)]
    if every:
        return texts  # type: ignore[return-value]
    for i, t in zip(where, texts, strict=True):
        out[i] = t
    return out


_SUMS_FILLER = _SUMS_OPEN + "AAAAAA==" + '"}'  # (a 4-byte checksum's base64 ends "==")


def _base64_of_sums(joined: bytes) -> np.ndarray:
    """The base64 of each 4-byte checksum in ``joined`` up to its closing "==": a row of 6 ASCII bytes each."""
    b = np.frombuffer(joined, dtype=np.uint8).reshape(-1, 4)
    out = np.empty((len(b), 6), dtype=np.uint8)
    out[:, 0] = _B64[b[:, 0] >> 2]
    out[:, 1] = _B64[((b[:, 0] & 3) << 4) | (b[:, 1] >> 4)]
    out[:, 2] = _B64[((b[:, 1] & 15) << 2) | (b[:, 2] >> 6)]
    out[:, 3] = _B64[b[:, 2] & 63]
    out[:, 4] = _B64[b[:, 3] >> 2]
    out[:, 5] = _B64[(b[:, 3] & 3) << 4]
    return out


class SumsTemplate:
    """The text of a document of array leaves whose checksums (4 bytes each) are in it, made with every
    checksum a placeholder: :meth:`filled` writes a save's checksums into it (6 bytes a leaf).

    The rest of such a document is the same from one save of a tree to the next (api/_recall.py
    keeps the template): a save of 100,000 small leaves spent 70 ms of its commit splitting and
    joining each leaf's text again, and 17 ms more on each copy of the 24 MB document (a fresh
    allocation's page faults): the template is filled where it is.
    """

    __slots__ = ("_at", "_lock", "_text", "frame")

    def __init__(self, heads: Sequence[str], before: str, after: str) -> None:
        """``heads``: :func:`array_leaf_heads` (none None); ``before``, ``after``: the document's
        frame (:meth:`DocumentHead.frame`), ASCII as json.dumps makes them (a placeholder's place
        is counted in characters)."""
        n = len(heads)
        body = [","] * (3 * n + 1)  # the frame's start; then per leaf its head, its checksums and a comma
        body[0] = before
        body[1::3] = heads
        body[2::3] = [_SUMS_FILLER] * n
        body[-1] = after  # (in place of the last leaf's comma)
        text = "".join(body) if n else before + after
        if not text.isascii():
            raise ValueError(f"a metadata document's text is not ASCII: {text[:200]!r}...")
        lengths = np.fromiter(map(len, heads), dtype=np.intp, count=n)
        ends = np.cumsum(lengths + (len(_SUMS_FILLER) + 1))  # (each leaf's text and its comma)
        at = len(before) + ends - (len(_SUMS_FILLER) + 1) + len(_SUMS_OPEN)  # where each leaf's base64 begins
        self.frame = (before, after)
        self._text = bytearray(text.encode())
        self._at = (at[:, None] + np.arange(6)).reshape(-1)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def filled(self, crcs: bytes) -> Iterator[bytearray]:
        """The document with these checksums (each leaf's 4 bytes, joined in order): the template's own
        text, to use only within the block (saves filling one template wait for each other)."""
        if len(crcs) * 6 != len(self._at) * 4:
            raise ValueError(f"{len(crcs) // 4} checksums for a document of {len(self._at) // 6} leaves")
        with self._lock:
            np.frombuffer(self._text, dtype=np.uint8)[self._at] = _base64_of_sums(crcs).reshape(-1)
            yield self._text
