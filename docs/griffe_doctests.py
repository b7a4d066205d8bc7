"""A griffe extension for the API reference: a docstring's doctest examples shown as code.

The docstrings of ``src/`` give their examples as doctests (``>>>`` lines, run by pytest),
not inside Markdown fences. Read as Markdown, such a line is a paragraph, and its brackets
(``x[1:3]``, ``d["write"]``) look like links that the strict build cannot resolve. Every run
of lines that starts with ``>>>`` and ends at a blank line (doctest's own rule) is put in a
``pycon`` fence, at its indentation; the source files are unchanged.
"""

from __future__ import annotations

from typing import Any


def fence_doctests(text: str) -> str:
    """``text`` with every doctest example in a fence of its own."""
    out: list[str] = []
    lines = text.split("\n")
    i, fenced = 0, False  # fenced: inside a fence the docstring has itself
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            fenced = not fenced
        if fenced or not stripped.startswith(">>>"):
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(stripped)]
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(lines[i])
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


try:
    import griffe
except ImportError:  # fence_doctests alone, as tests/test_docs_site.py uses it without the docs session's tools
    pass
else:

    class DoctestFences(griffe.Extension):
        """Fences the doctests of every object's docstring as it is loaded."""

        def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
            if obj.docstring is not None and ">>>" in obj.docstring.value:
                obj.docstring.value = fence_doctests(obj.docstring.value)
