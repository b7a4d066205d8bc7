"""Every ```python block of README.md and of the site's pages (docs/**/*.md) runs as written, each in a fresh process.

A block is self-contained: its imports, its own temporary directory (it writes nothing
in the directory it runs in), nothing left from another block. Warnings are errors, as
in the tests. Blocks that name an ``s3://`` location run against a SeaweedFS server
started here; they read its endpoint and keys from the usual environment variables.
A page that includes README.md's text (``--8<--``) does not repeat its blocks, so each
block runs once, under the file and line it is written at.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import seaweed
from helpers import HANG

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown text: (line of the opening fence, code)."""
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL):
        blocks.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return blocks


BLOCKS = [(f"{p.relative_to(ROOT)}:{line}", code) for p in PAGES for line, code in python_blocks(p.read_text())]


def test_the_extractor_finds_blocks_and_their_lines() -> None:
    text = "intro\n```python\nx = 1\n```\n\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [(2, "x = 1\n"), (9, "y = 2\nz = 3\n")]
    assert python_blocks(README.read_text()), "README.md should keep its example"
    assert len(BLOCKS) >= 16, "README.md and the guides should have their python blocks"


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[seaweed.Server]:
    server = seaweed.start(tmp_path_factory.mktemp("seaweed"))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(("where", "code"), BLOCKS, ids=[where for where, _ in BLOCKS])
def test_a_readme_block_runs_as_written(where: str, code: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}  # the block's temporary directories, removed with tmp_path
    if "s3://" in code:
        server: seaweed.Server = request.getfixturevalue("s3")
        assert f"s3://{seaweed.BUCKET}/" in code, f"{where}: the test server has the bucket {seaweed.BUCKET!r}"
        env.update(server.env())
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=HANG
    )
    assert done.returncode == 0, f"{where} failed:\n{code}\n--- stderr ---\n{done.stderr[-4000:]}"
    assert not list(cwd.iterdir()), f"{where} wrote into the working directory: {sorted(cwd.iterdir())}"
