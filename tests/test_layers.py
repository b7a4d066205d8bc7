"""The layers stay apart: the pure modules do no I/O and talk to no other rank."""

from __future__ import annotations

import subprocess
import sys

PURE = [
    "pytreeckpt._region",
    "pytreeckpt._sharding",
    "pytreeckpt.core._grid",
    "pytreeckpt.plan",
    "pytreeckpt._tree",
]


def test_pure_modules_import_neither_torch_nor_tensorstore() -> None:
    import pytreeckpt

    src = str(__import__("pathlib").Path(pytreeckpt.__file__).parent)
    code = (
        "import sys, types\n"
        # the package without its __init__, which re-exports the I/O layers too
        f"pkg = types.ModuleType('pytreeckpt'); pkg.__path__ = [{src!r}]; sys.modules['pytreeckpt'] = pkg\n"
        f"for m in {PURE!r}: __import__(m)\n"
        "bad = [m for m in ('tensorstore', 'torch', 'torch.distributed') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_pytreeckpt_does_not_import_hypothesis() -> None:
    code = "import sys, pytreeckpt; print('hypothesis' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_only_the_executor_imports_tensorstore_and_only_the_adapter_torch_distributed() -> None:
    import pathlib

    import pytreeckpt

    src = pathlib.Path(pytreeckpt.__file__).parent
    for f in src.rglob("*.py"):
        text = f.read_text()
        if f.name not in ("_executor.py", "_location.py"):  # storage: the executor and its locations
            assert "import tensorstore" not in text, f.name
        if f.name != "_distributed.py":
            assert "import torch.distributed" not in text, f.name
        if f.name != "_dcp.py":  # DCP's own format is pickled: read there by allowlist-only unpicklers
            assert "import pickle" not in text, f.name
            assert "torch.load" not in text, f.name
