"""The README's demo and examples run as it says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import HANG

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_the_quickstart_saves_async_saves_reshards_and_resumes_bit_identically(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},  # a crash prints every thread's stack to stderr
    )
    said = f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
    assert done.returncode == 0, f"exit status {done.returncode}\n{said}"
    out = done.stdout
    assert "async-saved step 30" in out
    assert "into a 3-rank layout" in out
    assert "bit-identical to the uninterrupted run" in out
