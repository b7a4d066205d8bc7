"""The ``pytreeckpt`` command line: ls, inspect, verify, export, import (and ``--version``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytreeckpt import __version__
from pytreeckpt.core._errors import CheckpointError
from pytreeckpt.format._paths import LOCK_FILE, METADATA_FILE, STORED_DIRS

if TYPE_CHECKING:
    from pytreeckpt.format import ArrayMeta

# Each command imports what it needs when it runs: ls, inspect and verify import no torch (and ls of a
# local directory neither numpy nor TensorStore), so they answer at once.

__all__ = ["main"]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _dir_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _shown(text: str) -> str:
    """``text`` printable on any stream: a lone surrogate (a key a document may hold) as its escape, ``\\udc80``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _is_checkpoint_dir(p: Path) -> bool:
    """A committed checkpoint, or what a save left (its lock, or any directory a save writes: as on a
    key-value store, where these same names mark one)."""
    return p.is_dir() and (
        (p / METADATA_FILE).exists() or (p / LOCK_FILE).exists() or any((p / d).is_dir() for d in STORED_DIRS)
    )


def _kv_entries(where: str) -> list[dict[str, Any]]:
    """Checkpoints under a key-value store prefix (listings there carry no sizes or times)."""
    from pytreeckpt.storage import Storage
    from pytreeckpt.storage._location import resolve

    kv = Storage(where).kv
    assert kv is not None
    kv.check_reachable()
    keys = kv.list()
    parts = [k.split("/") for k in keys]
    marks = (METADATA_FILE, *STORED_DIRS)
    if any(p[0] in marks for p in parts):
        groups: dict[str, list[list[str]]] = {"": parts}
    else:
        groups = {}
        for p in parts:
            if len(p) > 1 and p[1] in marks:
                groups.setdefault(p[0], []).append(p[1:])
    entries = []
    base = resolve(where).url
    for name, members in sorted(groups.items()):
        entries.append(
            {
                "name": name or base.rsplit("/", 1)[-1],
                "path": f"{base}/{name}" if name else base,
                "committed": [METADATA_FILE] in members,
                "bytes": None,
                "time": None,
            }
        )
    return entries


def cmd_ls(args: argparse.Namespace) -> int:
    from pytreeckpt.storage._location import resolve

    if not resolve(args.dir).is_local:
        found = _kv_entries(args.dir)
        if args.json:
            print(json.dumps(found, indent=2))
        else:
            rows = [[e["name"], "committed" if e["committed"] else "UNCOMMITTED", "-", "-"] for e in found]
            print(_table(rows, ["checkpoint", "state", "size", "time"]) if rows else f"no checkpoints in {args.dir}")
        return 0
    root = Path(args.dir)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory")
    candidates = [root] if _is_checkpoint_dir(root) else sorted(p for p in root.iterdir() if _is_checkpoint_dir(p))
    entries: list[dict[str, Any]] = []
    for p in candidates:
        committed = (p / METADATA_FILE).is_file()
        when = (p / METADATA_FILE).stat().st_mtime if committed else p.stat().st_mtime
        entries.append(
            {
                "name": p.name,
                "path": str(p),
                "committed": committed,
                "bytes": _dir_bytes(p),
                "time": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when)),
            }
        )
    if args.json:
        print(json.dumps(entries, indent=2))
    else:
        rows = [
            [e["name"], "committed" if e["committed"] else "UNCOMMITTED", _size(e["bytes"]), e["time"]] for e in entries
        ]
        print(_table(rows, ["checkpoint", "state", "size", "time"]) if rows else f"no checkpoints in {root}")
    return 0


def _layout_text(a: ArrayMeta) -> str:
    if a.layout is None:
        return "-"
    j = a.layout.to_json()
    if j["kind"] == "mesh":
        places = ",".join(
            "R" if p[0] == "replicate" else f"S({p[1]})" if p[0] == "shard" else f"SS({p[1]},{p[2]})"
            for p in j["placements"]
        )
        return f"mesh{tuple(j['mesh']['shape'])} [{places}]"
    ranks = len(j["ranges"] if j["kind"] == "flat" else j["regions"])
    return f"{j['kind']} x{ranks} ranks"


def _per_rank_text(meta: Any, key: str) -> str:
    """ "per rank: r of w" for a leaf of a per-rank part, else ""."""
    got = meta.saved_by(key)
    return "" if got is None else f"per rank: {got[0]} of {got[1]}"


def _ratio(nbytes: int, stored: int | None) -> float | None:
    """Logical over stored bytes; None where the store cannot tell (packed arrays, object stores)."""
    return nbytes / stored if stored else None


def _compression_text(a: ArrayMeta) -> str:
    c = a.compression
    if c is None:
        return "-"
    return f"zstd-{c.level}" if c.codec == "zstd" else f"blosc-{c.cname}-{c.level}-{c.shuffle}"


def cmd_inspect(args: argparse.Namespace) -> int:
    from pytreeckpt.core._values import decode_value, encode_value
    from pytreeckpt.loading._inspect import inspect
    from pytreeckpt.storage import Storage

    meta = inspect(args.path, "", tree=False)  # (pytreeckpt.metadata without the tree of placeholders)
    storage = Storage(args.path)
    stored = {a.key: storage.stored_bytes(a) for a in meta.arrays.values()}
    doc = json.loads(storage.read_metadata())
    values = {leaf["key"]: decode_value(leaf["value"]) for leaf in doc["leaves"] if leaf["kind"] == "value"}
    if args.json:
        out = {
            "version": meta.version,
            "bytes": meta.nbytes,
            "arrays": [
                {
                    "key": a.key,
                    "dtype": a.dtype.name,
                    "shape": list(a.shape),
                    "bytes": a.nbytes,
                    "stored_bytes": stored[a.key],
                    "compression": None if a.compression is None else a.compression.to_json(),
                    "ratio": _ratio(a.nbytes, stored[a.key]),
                    "chunk_shape": list(a.chunk_shape),
                    "path": a.path,
                    "layout": None if a.layout is None else a.layout.to_json(),
                    "saved_by_rank": None if meta.saved_by(a.key) is None else meta.saved_by(a.key)[0],  # type: ignore[index]
                }
                for a in meta.arrays.values()
            ],
            "values": {k: encode_value(v) for k, v in values.items()},
            "per_rank": dict(meta.per_rank),
            "user_metadata": meta.user_metadata,
        }
        print(json.dumps(out, indent=2))
        return 0
    rows = [
        [
            _shown(a.key) or "(root)",
            a.dtype.name,
            str(tuple(a.shape)),
            _size(a.nbytes),
            _compression_text(a),
            "-" if _ratio(a.nbytes, stored[a.key]) is None else f"{_ratio(a.nbytes, stored[a.key]):.2f}",
            str(tuple(a.chunk_shape)),
            _per_rank_text(meta, a.key) or _layout_text(a),
        ]
        for a in meta.arrays.values()
    ]
    rows += [
        [_shown(k) or "(root)", type(v).__name__, repr(v)[:40], "", "", "", "", _per_rank_text(meta, k)]
        for k, v in values.items()
    ]
    headers = ["key", "dtype", "shape / value", "bytes", "compression", "ratio", "chunks", "saved layout"]
    print(_table(rows, headers))
    print(f"\n{len(meta.arrays)} arrays, {len(values)} values, {_size(meta.nbytes)}; format version {meta.version}")
    for part, world in meta.per_rank.items():
        print(f"per rank: {_shown(part) or '(root)'}, saved by {world} ranks (each rank's own copy)")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from pytreeckpt.loading._inspect import verify_checkpoint

    try:
        report = verify_checkpoint(args.path, None)  # (pytreeckpt.verify)
    except CheckpointError as e:  # nothing could be checked: say so where the status goes, then fail
        if args.json:
            print(json.dumps({"ok": False, "error": str(e), "problems": []}, indent=2))
        else:
            print(f"FAILED: {args.path} could not be verified")
        raise
    if args.json:
        out = {
            "ok": report.ok,
            "arrays": report.arrays,
            "chunks": report.chunks,
            "bytes": report.nbytes,
            "problems": [
                {"key": k, "chunk": None if c is None else list(c), "message": m} for k, c, m in report.problems
            ],
            "unrecorded": list(report.unrecorded),
            "unreadable": [
                {"key": k, "chunk": None if c is None else list(c), "message": m} for k, c, m in report.unreadable
            ],
        }
        print(json.dumps(out, indent=2))
    elif report.ok:
        print(f"ok: {report.arrays} arrays, {report.chunks} chunks, {_size(report.nbytes)} read and checked")
        if report.unrecorded:
            print(
                f"note: the metadata records no chunk checksums for {len(report.unrecorded)} arrays (an older "
                f"checkpoint): their chunks' own checksums were checked, not that each is the chunk it should be"
            )
    else:
        for key, chunk, message in report.problems:
            where = "whole array" if chunk is None else f"chunk {list(chunk)}"
            print(_shown(f"DAMAGED {key} ({where}): {message}"))
        for key, chunk, message in report.unreadable:
            where = "whole array" if chunk is None else f"chunk {list(chunk)}"
            print(_shown(f"UNREADABLE {key} ({where}): {message}"))
        if report.problems:
            print(f"{len(report.damaged_leaves)} of {report.arrays} arrays damaged")
        if report.unreadable:
            n = len(dict.fromkeys(key for key, _, _ in report.unreadable))
            print(f"{n} of {report.arrays} arrays could not be read (permission denied): not checked")
    if report.problems:
        return 1
    return 0 if report.ok else 2


def _progress_bar(done: int, total: int) -> None:
    """An export's progress on stderr, redrawn in place."""
    width = 30
    filled = width * done // max(total, 1)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {_size(done)} / {_size(total)}", end="", file=sys.stderr)


def cmd_export_dcp(args: argparse.Namespace) -> int:
    """``export --format dcp``: a torch.distributed.checkpoint directory."""
    from pytreeckpt.interop._dcp_export import export_dcp

    names = export_dcp(
        args.path,
        args.out,
        max_file_size=args.max_file_size,
        overwrite=args.overwrite,
        progress=_progress_bar if args.progress else None,
    )
    if args.progress:
        print(file=sys.stderr)
    files = sorted(Path(args.out).glob("*.distcp"))
    if args.json:
        print(json.dumps({"out": str(args.out), "names": names, "files": [str(f) for f in files]}))
    else:
        print(f"exported {len(names)} items to {args.out} (.metadata and {len(files)} .distcp files)")
    return 0


def _pairs(texts: Sequence[str] | None, option: str) -> list[tuple[str, str]]:
    out = []
    for t in texts or ():
        old, sep, new = t.partition("=")
        if not sep:
            raise CheckpointError(f"{option} {t!r}: expected OLD=NEW")
        out.append((old, new))
    return out


def _export_rename(exact: Sequence[str] | None, prefixes: Sequence[str] | None) -> Any:
    """``--rename OLD=NEW`` (a whole key) and ``--rename-prefix OLD=NEW`` (its start; the first that matches) as one
    function, or None."""
    table = dict(_pairs(exact, "--rename"))
    starts = _pairs(prefixes, "--rename-prefix")
    if not table and not starts:
        return None

    def rename(key: str) -> str:
        if key in table:
            return table[key]
        for old, new in starts:
            if key.startswith(old):
                return new + key[len(old) :]
        return key

    return rename


def cmd_export(args: argparse.Namespace) -> int:
    if args.format == "dcp":
        given = [
            o
            for o, v in (
                ("--include", args.include),
                ("--rename", args.rename),
                ("--rename-prefix", args.rename_prefix),
                ("--dtype", args.dtype),
            )
            if v
        ]
        if given:
            raise CheckpointError(
                f"export --format dcp: {', '.join(given)} apply to safetensors only; DCP gets the checkpoint whole"
            )
        return cmd_export_dcp(args)
    from pytreeckpt.interop._safetensors import export_safetensors

    files = export_safetensors(
        args.path,
        args.out,
        include=args.include,
        rename=_export_rename(args.rename, args.rename_prefix),
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        progress=_progress_bar if args.progress else None,
    )
    if args.progress:
        print(file=sys.stderr)
    if args.json:
        print(json.dumps([str(f) for f in files]))
    else:
        for f in files:
            print(f)
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from pytreeckpt.interop._dcp import import_dcp
    from pytreeckpt.interop._safetensors import import_safetensors

    src = Path(args.src)
    if (src / ".metadata").is_file():  # a torch.distributed.checkpoint directory
        names = import_dcp(src, args.out, overwrite=args.overwrite)
    else:
        names = import_safetensors(src, args.out, overwrite=args.overwrite)
    if args.json:
        print(json.dumps({"out": str(args.out), "tensors": names}))
    else:
        print(f"imported {len(names)} tensors into {args.out}")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pytreeckpt", description="Look inside and convert pytreeckpt checkpoints.")
    p.add_argument("--version", action="version", version=f"pytreeckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "ls", help="list the checkpoints in a directory or object store prefix (s3://bucket/run), committed or not"
    )
    ls.add_argument("dir")
    ls.set_defaults(run=cmd_ls)
    ins = sub.add_parser("inspect", help="the tree: key paths, dtypes, shapes, bytes, saved layouts, values")
    ins.add_argument("path")
    ins.set_defaults(run=cmd_inspect)
    ver = sub.add_parser(
        "verify", help="read every chunk and check it; exit status 1 on damage, 2 if some could not be read"
    )
    ver.add_argument("path")
    ver.set_defaults(run=cmd_verify)
    exp = sub.add_parser(
        "export", help="write safetensors files (a part, renamed, in a dtype), or a DCP directory (--format dcp)"
    )
    exp.add_argument("path")
    exp.add_argument("out")
    exp.add_argument("--format", choices=["safetensors", "dcp"], default="safetensors")
    exp.add_argument("--max-file-size", default="256MB", help="--format dcp: the most tensor bytes in one .distcp file")
    exp.add_argument("--overwrite", action="store_true", help="--format dcp: replace a DCP checkpoint in OUT")
    exp.add_argument("--max-shard-size", default="5GB", help="split into files of at most this size (default 5GB)")
    exp.add_argument("--include", action="append", help="export only the leaves whose key path matches this glob")
    exp.add_argument("--rename", action="append", metavar="OLD=NEW", help="name the leaf OLD as NEW")
    exp.add_argument(
        "--rename-prefix", action="append", metavar="OLD=NEW", help="replace the start OLD of key paths by NEW"
    )
    exp.add_argument("--dtype", help="convert floating-point tensors to this dtype (e.g. bfloat16)")
    exp.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    exp.set_defaults(run=cmd_export)
    imp = sub.add_parser(
        "import", help="make a checkpoint from safetensors files (a file or a directory) or a DCP directory"
    )
    imp.add_argument("src")
    imp.add_argument("out")
    imp.add_argument("--overwrite", action="store_true")
    imp.set_defaults(run=cmd_import)
    for s in (ls, ins, ver, exp, imp):
        s.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for a checkpoint error)."""
    args = _parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except CheckpointError as e:
        print(f"pytreeckpt {args.command}: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the command itself could not reach (permission, a vanished path)
        print(f"pytreeckpt {args.command}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # an option's value the command refuses (--max-shard-size 1e400GB), named in the error
        print(f"pytreeckpt {args.command}: {e}", file=sys.stderr)
        return 2
    return status


def _entry() -> Any:
    sys.exit(main())
