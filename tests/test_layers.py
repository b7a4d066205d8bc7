"""The layers stay apart: the pure modules do no I/O and talk to no other rank."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PURE = [
    "pytreeckpt.core._region",
    "pytreeckpt.core._sharding",
    "pytreeckpt.core._grid",
    "pytreeckpt.core._rows",
    "pytreeckpt.core._slots",
    "pytreeckpt.core._tree",
    "pytreeckpt.core._keys",
    "pytreeckpt.core._node",
    "pytreeckpt.core._names",
    "pytreeckpt.core._values",
    "pytreeckpt.plan",
    "pytreeckpt.plan._memos",
]

# The layers of the design (shared/DESIGN.md), bottom first: a module imports only from its own layer and those below.
LAYERS = [
    "core",
    "plan",
    "format",
    "storage",
    "execute",
    "distributed",
    "leaves",
    "loading",
    "saving",
    "api",
    "manager",
    "interop",
    "integrations",
    "testing",
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


def test_only_storage_and_execute_import_tensorstore_and_only_distributed_torch_distributed() -> None:
    import pathlib

    import pytreeckpt

    src = pathlib.Path(pytreeckpt.__file__).parent
    for f in src.rglob("*.py"):
        text = f.read_text()
        layer = f.relative_to(src).parts[0]
        if layer not in ("storage", "execute"):
            assert "import tensorstore" not in text, f
        if layer != "distributed":
            assert "import torch.distributed" not in text, f
        if f.name != "_dcp.py":  # DCP's own format is pickled: read there by allowlist-only unpicklers
            assert "import pickle" not in text, f
            assert "torch.load" not in text, f


def _imports(path: Path, module: str, modules: set[str]) -> set[str]:
    """The pytreeckpt modules ``module`` imports at run time (anywhere in it, ``if TYPE_CHECKING:`` blocks aside)."""
    import ast

    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    skipped = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.update(t for t in [base, *(f"{base}.{a.name}" for a in node.names)] if t in modules)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found - {module, "pytreeckpt"}  # (the package root re-exports everything: it is the top)


def test_no_module_imports_itself_back_through_others() -> None:
    import pytreeckpt

    src = Path(pytreeckpt.__file__).parent
    paths = {}
    for f in src.rglob("*.py"):
        parts = f.relative_to(src.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {m: _imports(f, m, set(paths)) for m, f in paths.items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append([*stack[stack.index(n) :], n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _graph() -> dict[str, set[str]]:
    import pytreeckpt

    src = Path(pytreeckpt.__file__).parent
    paths = {}
    for f in src.rglob("*.py"):
        parts = f.relative_to(src.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return {m: _imports(f, m, set(paths)) for m, f in paths.items()}


def _layer(module: str) -> int | None:
    """The layer of a module (None: the package's top, ``pytreeckpt``, ``_cli``, ``__main__``)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_every_module_lives_in_a_layer_with_a_docstring_saying_what_it_owns() -> None:
    import ast

    import pytreeckpt

    src = Path(pytreeckpt.__file__).parent
    top = sorted(f.name for f in src.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_cli.py"], top  # everything else is in a layer
    for layer in LAYERS:
        init = src / layer / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc is not None, f"{layer}/__init__.py says what the layer owns"
        assert len(doc) > 60, f"{layer}/__init__.py says what the layer owns"


def test_imports_point_down_the_layers() -> None:
    wrong = [
        f"{m} ({LAYERS[lm]}) imports {n} ({LAYERS[ln]})"
        for m, targets in _graph().items()
        for n in targets
        if (lm := _layer(m)) is not None and (ln := _layer(n)) is not None and ln > lm
    ]
    assert not wrong, "\n".join(sorted(wrong))
