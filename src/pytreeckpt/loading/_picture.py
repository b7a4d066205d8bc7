"""A text picture of how one stored array is cut into chunks and which saving ranks held each
(``pytreeckpt inspect --layout KEY``).

The metadata records each array's chunk grid and the layout it was saved from (for
information: the ranks, as the layout numbers them, and the box each held). A chunk's
cell lists the ranks whose saved pieces cover part of it: one rank for a chunk within a
shard, several for replicated data (one of them wrote it, the bytes balanced between
them) or a chunk straddling shards (merged by one of them). A packed array names the
one rank that wrote it (its database's). Arrays of more than two dims show the grid of
their first two dims, each cell standing for the chunks along the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from pytreeckpt.core._grid import ChunkGrid
from pytreeckpt.format import ArrayMeta

__all__ = ["MAX_COLS", "MAX_ROWS", "holders", "layout_picture", "packed_writer", "ranks_text"]

MAX_ROWS = 32
"""Rows of chunks drawn at most (the rest counted in a note)."""

MAX_COLS = 16
"""Columns of chunks drawn at most."""

_CELL = 11  # the widest label drawn whole


def ranks_text(ranks: Sequence[int], world: int) -> str:
    """``ranks`` (sorted) as runs, ``"0-3,8"``; ``"all"`` when every one of ``world`` (more than 4) ranks."""
    if world > 4 and len(ranks) == world:
        return "all"
    runs: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        runs.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    text = ",".join(runs)
    return text if len(text) <= _CELL else text[: _CELL - 2] + ".."


def _plane(meta: ArrayMeta) -> tuple[tuple[int, int], tuple[int, int]]:
    """The drawn grid as a 2-D one: (chunk extent, chunks) along rows and columns."""
    shape, chunk = tuple(meta.shape), tuple(meta.chunk_shape)
    if len(shape) == 0:
        shape, chunk = (1,), (1,)
    if len(shape) == 1:
        shape, chunk = (1, *shape), (1, *chunk)
    grid = ChunkGrid(shape[:2], chunk[:2]).grid
    return (chunk[0], chunk[1]), (grid[0], grid[1])


def holders(meta: ArrayMeta, fixed: int | None = None) -> dict[tuple[int, int], list[int]]:
    """The ranks holding part of each drawn cell (row, column of chunks); every cell ``fixed`` when given (a
    packed array's writer, a per-rank leaf's rank); empty without a recorded layout."""
    (cr, cc), (gr, gc) = _plane(meta)
    cells: dict[tuple[int, int], set[int]] = {}
    if fixed is not None:
        return {(r, c): [fixed] for r in range(min(gr, MAX_ROWS)) for c in range(min(gc, MAX_COLS))}
    if meta.layout is None:
        return {}
    for rank, pieces in enumerate(meta.layout.rank_pieces(meta.shape)):
        for piece in pieces:
            off, ext = piece.region.offset, piece.region.shape
            if len(off) == 0:
                off, ext = (0, 0), (1, 1)
            elif len(off) == 1:
                off, ext = (0, *off), (1, *ext)
            if 0 in ext[:2]:
                continue
            r0, r1 = off[0] // cr, min((off[0] + ext[0] - 1) // cr, MAX_ROWS - 1)
            c0, c1 = off[1] // cc, min((off[1] + ext[1] - 1) // cc, MAX_COLS - 1)
            for r in range(r0, r1 + 1):
                for c in range(c0, c1 + 1):
                    cells.setdefault((r, c), set()).add(rank)
    return {k: sorted(v) for k, v in cells.items()}


def _grid_lines(meta: ArrayMeta, labels: dict[tuple[int, int], str]) -> list[str]:
    (cr, cc), (gr, gc) = _plane(meta)
    nr, nc = min(gr, MAX_ROWS), min(gc, MAX_COLS)
    width = max([3, *(len(t) for t in labels.values())])
    ndim = len(meta.shape)
    row_names = [str(r * cr) if ndim >= 2 else "" for r in range(nr)]
    margin = max([0, *(len(n) for n in row_names)])
    rule = " " * margin + " +" + "+".join("-" * (width + 2) for _ in range(nc)) + "+"
    head = " " * margin + "  " + " ".join(str(c * cc).ljust(width + 2) for c in range(nc))
    lines = [head.rstrip(), rule]
    for r in range(nr):
        cells = "|".join(f" {labels.get((r, c), '?').ljust(width)} " for c in range(nc))
        lines += [f"{row_names[r].rjust(margin)} |{cells}|", rule]
    return lines


def layout_picture(meta: ArrayMeta, saved_by: tuple[int, int] | None = None) -> str:
    """The picture: a header line, the grid of chunks (a bar for 1-D), each cell labelled with its ranks, notes."""
    _, (gr, gc) = _plane(meta)
    chunks = ChunkGrid(meta.shape, meta.chunk_shape).count
    across = " x ".join(map(str, ChunkGrid(meta.shape, meta.chunk_shape).grid)) or "1"
    lines = [
        f"{meta.key or '(root)'}: {meta.dtype.name} {tuple(meta.shape)}, chunks of {tuple(meta.chunk_shape)}: "
        f"{across} ({chunks} chunk{'s' * (chunks != 1)})"
    ]
    fixed = None
    if saved_by is not None:
        fixed = saved_by[0]
        lines.append(f"saved per rank: rank {saved_by[0]} of {saved_by[1]} saved this leaf (its own copy)")
    elif meta.database is not None:
        writer = packed_writer(meta.database)
        fixed = writer if meta.layout is None else None
        lines.append(f"packed in {meta.database}: written whole by rank {writer}")
    if meta.layout is None and fixed is None:
        lines.append("no saved layout recorded (a tensor saved whole): which rank held it is not known")
    elif meta.layout is not None:
        world = meta.layout.world_size
        lines.append(f"saved layout: {_layout_line(meta)} over {world} ranks")
    if chunks == 0:
        return "\n".join([*lines, "no elements: no chunks"])
    cells = holders(meta, fixed)
    world = 1 if meta.layout is None else meta.layout.world_size
    labels = {k: ranks_text(v, world) for k, v in cells.items()}
    lines += _grid_lines(meta, labels)
    lines.append("each cell is a chunk (its offset above, beside), labelled with the saving ranks that held part of it")
    if any(len(v) > 1 for v in cells.values()):
        lines.append("a cell of several ranks: replicated (one of them wrote it) or straddling shards (merged by one)")
    if len(meta.shape) > 2:
        lines.append(f"dims 2.. not drawn: each cell stands for the {chunks // (gr * gc)} chunks along them")
    if gr > MAX_ROWS or gc > MAX_COLS:
        lines.append(f"{gr} x {gc} chunks: only the first {min(gr, MAX_ROWS)} x {min(gc, MAX_COLS)} drawn")
    return "\n".join(lines)


def packed_writer(database: str) -> int:
    """The rank that wrote the arrays of a packed database (``packed/<rank>``, ``ocdbt/<rank>~g<n>``)."""
    return int(database.split("/", 1)[1].split("~", 1)[0])


def _layout_line(meta: ArrayMeta) -> str:
    assert meta.layout is not None
    j = meta.layout.to_json()
    if j["kind"] == "mesh":
        places = ",".join(
            "R" if p[0] == "replicate" else f"S({p[1]})" if p[0] == "shard" else f"SS({p[1]},{p[2]})"
            for p in j["placements"]
        )
        return f"mesh{tuple(j['mesh']['shape'])} [{places}]"
    return str(j["kind"])
