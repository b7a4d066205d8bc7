"""The README's demo and examples run as it says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from multiproc import free_port

EXAMPLES = Path(__file__).parent.parent / "examples"

# A Python warning ("...: UserWarning: ...") or a line of torch's C++ warning log ("[W1123 ...").
WARNING = re.compile(r"\w*Warning\b|^\[W\d", re.MULTILINE)


def test_the_quickstart_saves_async_saves_reshards_and_resumes_bit_identically(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "async-saved step 30" in out
    assert "into a 3-rank layout" in out
    assert "bit-identical to the uninterrupted run" in out


def _torchrun(ranks: int, script: Path, args: list[str], logs: Path) -> tuple[str, dict[int, str]]:
    """Run ``script`` on ``ranks`` local ranks; its stdout, and each rank's own stderr by rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1", f"--master-port={free_port()}"]
    cmd += [f"--nproc-per-node={ranks}", "--log-dir", str(logs), "--redirects", "2", str(script), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    stderr = {int(f.parent.name): f.read_text(errors="replace") for f in logs.rglob("stderr.log")}
    report = "\n".join(f"--- rank {r} stderr ---\n{text}" for r, text in sorted(stderr.items()))
    assert done.returncode == 0, f"torchrun exited {done.returncode}:\n{done.stderr[-2000:]}\n{report}"
    assert sorted(stderr) == list(range(ranks)), report
    return done.stdout, stderr


def test_the_fsdp2_example_trains_and_resumes_without_a_warning_on_any_rank(tmp_path: Path) -> None:
    script, ckpt = EXAMPLES / "fsdp2_resume.py", tmp_path / "ckpt"
    first, first_err = _torchrun(2, script, ["--dir", str(ckpt), "--steps", "2", "--save-every", "2"], tmp_path / "l1")
    again, again_err = _torchrun(2, script, ["--dir", str(ckpt), "--steps", "1"], tmp_path / "l2")
    assert "done at step 2" in first
    assert "resumed step_2 (saved by 2 ranks) on 2 ranks" in again
    assert "done at step 3" in again
    for run, stderr in (("first run", first_err), ("resumed run", again_err)):
        for rank, text in stderr.items():
            assert not WARNING.search(text), f"{run}, rank {rank} warned:\n{text}"
