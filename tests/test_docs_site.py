"""The documentation site's sources hold together: the API reference names every public name, and
docs/check_site.py (run by ``nox -s docs`` on the built site) finds a missing page, image or anchor.

The site itself is built by ``nox -s docs`` (mkdocs, not a test dependency); here its checker runs
on hand-made pages, and the doctest fences of the API reference (docs/griffe_doctests.py) on text.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

import pytreeckpt

DOCS = Path(__file__).parent.parent / "docs"


def docs_module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


check_site = docs_module("check_site")


def test_the_api_reference_has_an_entry_for_every_public_name() -> None:
    entries = re.findall(r"^::: pytreeckpt\.(\w+)$", (DOCS / "api.md").read_text(), re.MULTILINE)
    assert sorted(entries) == sorted(pytreeckpt.__all__)
    assert check_site.public_names() == list(pytreeckpt.__all__)


def make_site(root: Path, pages: dict[str, str], files: tuple[str, ...] = ()) -> Path:
    for name, body in pages.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"<html><body>{body}</body></html>")
    for name in files:
        (root / name).write_bytes(b"\x89PNG")
    return root


def test_a_whole_site_passes_the_check(tmp_path: Path) -> None:
    site = make_site(
        tmp_path,
        {
            "index.html": '<h1 id="top">x</h1><a href="guides/a.html#part">a</a><img src="fig.png"><a href="https://x.org/">out</a>',
            "guides/a.html": '<h2 id="part">p</h2><a href="../index.html#top">back</a><a href="#part">here</a>',
            "api.html": '<h2 id="pytreeckpt.save">save</h2>',
        },
        files=("fig.png",),
    )
    failures, checked = check_site.check_html(site, ["save"])
    assert failures == []
    assert checked == 4  # the link to another site is not followed


def test_a_missing_page_image_anchor_or_api_entry_is_named(tmp_path: Path) -> None:
    site = make_site(
        tmp_path,
        {
            "index.html": '<a href="gone.html">g</a><img src="figs/none.png"><a href="guides/a.html#nowhere">n</a>',
            "guides/a.html": '<h2 id="part">p</h2><a href="../../outside.html">o</a>',
            "api.html": '<h2 id="pytreeckpt.save">save</h2>',
        },
    )
    failures, _ = check_site.check_html(site, ["save", "load"])
    assert failures == [
        "guides/a.html: link '../../outside.html': no file ../outside.html in the site",
        "index.html: link 'gone.html': no file gone.html in the site",
        "index.html: link 'guides/a.html#nowhere': guides/a.html has no anchor #nowhere",
        "index.html: image 'figs/none.png': no file figs/none.png in the site",
        "api.html: no entry for pytreeckpt.load",
    ]


@pytest.mark.parametrize(
    ("text", "fenced"),
    [
        ("Adds.\n\n>>> 1 + 1\n2\n\nDone.", "Adds.\n\n```pycon\n>>> 1 + 1\n2\n```\n\nDone."),
        ("Args:\n  x: a list.\n\n  >>> x[1:3]\n  [2]", "Args:\n  x: a list.\n\n  ```pycon\n  >>> x[1:3]\n  [2]\n  ```"),
        ("Already:\n```python\n>>> d['a']\n```", "Already:\n```python\n>>> d['a']\n```"),
    ],
)
def test_the_api_reference_shows_doctests_as_code(text: str, fenced: str) -> None:
    assert docs_module("griffe_doctests").fence_doctests(text) == fenced
