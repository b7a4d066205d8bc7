"""The installed wheel at work, away from the source tree: ``nox -s package`` runs this script with the Python of a
fresh environment holding only torch and the wheel, from a working directory outside the source tree.

``python wheel_smoke.py SOURCE_ROOT README``: checks that ``pytreeckpt`` is imported from that environment (not from
``SOURCE_ROOT/src``), that its version, ``py.typed`` and console script are installed, runs the README's first
Python block (its quickstart), saves, loads and verifies a small tree, then runs each command of the console script
on it (``--version``, ``ls``, ``inspect``, ``verify``, ``export`` to safetensors and to DCP, ``import`` of both), each
result checked. Exits non-zero, naming the step, on the first that fails.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any


def check(ok: object, what: str) -> None:
    if not ok:
        raise SystemExit(f"wheel smoke test failed: {what}")
    print(f"ok  {what}")


def run(*args: object) -> str:
    """Run a command here; its standard output (a non-zero exit fails the test, showing both streams)."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"wheel smoke test failed: {args} exited {done.returncode}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def installed(source: Path) -> None:
    """pytreeckpt comes from this environment, with its version, its py.typed and its console script."""
    from importlib import metadata, resources

    import pytreeckpt

    where = Path(pytreeckpt.__file__).resolve()
    check(not where.is_relative_to(source), f"pytreeckpt is imported from outside the source tree ({where.parent})")
    check(
        where.is_relative_to(Path(sys.prefix).resolve()), f"pytreeckpt is installed in this environment ({sys.prefix})"
    )
    check(
        metadata.version("pytreeckpt") == pytreeckpt.__version__,
        f"the distribution's version is pytreeckpt.__version__ ({pytreeckpt.__version__})",
    )
    check(resources.files("pytreeckpt").joinpath("py.typed").is_file(), "py.typed is installed")
    scripts = [e for e in metadata.entry_points(group="console_scripts") if e.name == "pytreeckpt"]
    check([e.value for e in scripts] == ["pytreeckpt._cli:_entry"], "the console script pytreeckpt is declared")


def quickstart(readme: Path) -> None:
    """The README's first Python block, as it stands."""
    block = re.search(r"```python\n(.*?)```", readme.read_text(encoding="utf-8"), re.DOTALL)
    check(block is not None, f"{readme} has a Python block")
    assert block is not None
    exec(compile(block.group(1), f"{readme} (quickstart)", "exec"), {"__name__": "__quickstart__"})
    check(True, "the README's quickstart runs")


def same(got: dict[str, Any], want: dict[str, Any]) -> bool:
    import torch

    return got.keys() == want.keys() and all(torch.equal(got[k], v) for k, v in want.items())


def api(here: Path) -> dict[str, Any]:
    """A small tree saved, loaded and verified; returns its tensors by key path."""
    import torch

    import pytreeckpt

    w = torch.arange(40.0).reshape(8, 5)
    state = {"model": {"w": w, "b": torch.ones(5, dtype=torch.bfloat16)}, "step": 7}
    pytreeckpt.save(here / "ckpt", state)
    back = pytreeckpt.load(here / "ckpt")
    check(same(back["model"], state["model"]) and back["step"] == 7, "save, then load, gives the tree back")
    check(pytreeckpt.verify(here / "ckpt").ok, "verify finds the checkpoint whole")
    return {"model.w": w, "model.b": state["model"]["b"]}


def cli(here: Path, tensors: dict[str, Any]) -> None:
    """Each command of the console script on the checkpoint ``api`` saved."""
    import pytreeckpt

    exe = Path(sys.executable).with_name("pytreeckpt")
    version = f"pytreeckpt {pytreeckpt.__version__}"
    check(run(exe, "--version").strip() == version, f"pytreeckpt --version prints {version!r}")
    check(run(sys.executable, "-m", "pytreeckpt", "--version").strip() == version, "python -m pytreeckpt --version")
    listed = json.loads(run(exe, "ls", here, "--json"))
    check([(e["name"], e["committed"]) for e in listed] == [("ckpt", True)], "pytreeckpt ls lists the checkpoint")
    check("ckpt" in run(exe, "ls", here), "pytreeckpt ls (table)")
    shown = json.loads(run(exe, "inspect", here / "ckpt", "--json"))
    check({a["key"] for a in shown["arrays"]} == set(tensors), "pytreeckpt inspect --json names its arrays")
    check("model.w" in run(exe, "inspect", here / "ckpt"), "pytreeckpt inspect (table)")
    check(json.loads(run(exe, "verify", here / "ckpt", "--json"))["ok"], "pytreeckpt verify --json")
    check(run(exe, "verify", here / "ckpt").startswith("ok:"), "pytreeckpt verify")
    for kind, extra in (("safetensors", ()), ("dcp", ("--format", "dcp"))):
        out, back = here / f"exported-{kind}", here / f"imported-{kind}"
        run(exe, "export", here / "ckpt", out, *extra)
        check(any(out.iterdir()), f"pytreeckpt export {' '.join(extra) or '(safetensors)'} writes {out.name}")
        run(exe, "import", out, back)
        check(json.loads(run(exe, "verify", back, "--json"))["ok"], f"pytreeckpt import of the {kind} export verifies")
        loaded = pytreeckpt.load(back)  # (a flat dict, by key path)
        got = {k: v for k, v in loaded.items() if k != "step"}
        check(same(got, tensors) and loaded["step"] == 7, f"the {kind} round trip gives the tree back")


def main(argv: list[str]) -> None:
    source, readme = Path(argv[1]).resolve(), Path(argv[2])
    here = Path.cwd()
    check(not here.resolve().is_relative_to(source), f"the working directory {here} is outside the source tree")
    installed(source)
    quickstart(readme)
    cli(here, api(here))
    print("wheel smoke test: all passed")


if __name__ == "__main__":
    main(sys.argv)
