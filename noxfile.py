"""Sessions: check (tests, property tests, mypy), lint, package, bench, docs; tests, property, typecheck alone.

``nox`` runs check and lint, the README's test command. check sets up one environment
and runs everything that needs torch in it: torch 2.13.0 is installed first (a CPU wheel;
an unpinned torch would pull a multi-GB CUDA build), then the project once, so the
project's own range ``torch>=2.6`` is satisfied without another download. lint needs only
ruff. tests, property and typecheck run one part each, in an environment of their own. package
builds the sdist and the wheel and tries the wheel in a fresh environment outside the source tree.
docs builds the site (mkdocs.yml) with warnings as errors and checks every page of it.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import zipfile
from pathlib import Path

import nox

nox.options.sessions = ["check", "lint"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = os.environ.get("CI") != "true"

TORCH = os.environ.get("PYTREECKPT_TORCH", "torch==2.13.0")


def _install(session: nox.Session, extra: str) -> None:
    session.install(TORCH)
    session.install("-e", f".[{extra}]")


# Test files run side by side in one process per core (pytest-xdist; at most 4): a test
# that waits on fsync or on its ranks leaves a core idle, which another file's tests use.
# A file's tests stay in one process (its module fixtures, a SeaweedFS server, start once);
# tests that launch ranks take ports from their process's own range (benchmarks/_common.py).
_PARALLEL = ("-n", "auto", "--maxprocesses=4", "--dist", "loadfile")


def _tests(session: nox.Session, *args: str) -> None:
    session.run("pytest", "-q", *_PARALLEL, *args)  # tests/ and the doctests of src/ (pyproject's testpaths)


def _property(session: nox.Session, *args: str) -> None:
    env = {"HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "ci")}
    session.run("pytest", "-q", *_PARALLEL, "property_tests", *args, env=env)


@nox.session
def check(session: nox.Session) -> None:
    """Example tests and doctests, property tests and mypy, in one environment."""
    _install(session, "dev")
    session.run("mypy")
    _tests(session, "--durations=10")
    _property(session)


@nox.session
def tests(session: nox.Session) -> None:
    """Example tests and doctests."""
    _install(session, "test")
    _tests(session, *session.posargs)


@nox.session
def property(session: nox.Session) -> None:
    """Hypothesis property tests; HYPOTHESIS_PROFILE=dev for the broad local profile."""
    _install(session, "test")
    _property(session, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff: lint and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy, strict, on src/."""
    _install(session, "dev")
    session.run("mypy")


ROOT = Path(__file__).resolve().parent


def _shipped(session: nox.Session, dist: Path) -> Path:
    """The wheel built, after checking that it and the sdist hold every file of src/pytreeckpt (py.typed among them)
    and that the wheel declares the console script."""
    package = ROOT / "src" / "pytreeckpt"
    files = sorted(
        p.relative_to(package.parent).as_posix()
        for p in package.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )
    (wheel,) = dist.glob("pytreeckpt-*.whl")
    (sdist,) = dist.glob("pytreeckpt-*.tar.gz")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = z.read(entry_points).decode()
    with tarfile.open(sdist) as t:
        top = sdist.name.removesuffix(".tar.gz")
        in_sdist = {n.removeprefix(f"{top}/src/") for n in t.getnames()}
    for where, held in ((wheel.name, names), (sdist.name, in_sdist)):
        missing = [f for f in files if f not in held]
        if missing:
            session.error(f"{where} lacks {missing}")
    if "pytreeckpt = pytreeckpt._cli:_entry" not in scripts:
        session.error(f"{wheel.name} declares no console script pytreeckpt: {scripts!r}")
    session.log(f"{wheel.name} and {sdist.name} hold the {len(files)} files of src/pytreeckpt")
    return wheel


@nox.session
def package(session: nox.Session) -> None:
    """The sdist and the wheel, built; the wheel installed in a fresh environment outside the source tree (torch first,
    as in check), where the README's quickstart and each command of the console script run (tests/wheel_smoke.py)."""
    session.install("build")
    work = Path(tempfile.mkdtemp(prefix="pytreeckpt-package-")).resolve()
    if work.is_relative_to(ROOT):
        session.error(f"the temporary directory {work} is inside the source tree")
    try:
        dist, env, here = work / "dist", work / "env", work / "run"
        # the sdist, then the wheel from it (its log shown only if it fails)
        session.run("python", "-m", "build", "--outdir", str(dist), str(ROOT), silent=True)
        wheel = _shipped(session, dist)
        session.run("python", "-m", "venv", str(env))
        python = str(env / "bin" / "python")
        session.run(python, "-m", "pip", "install", "-q", TORCH, external=True)
        session.run(python, "-m", "pip", "install", "-q", str(wheel), external=True)
        here.mkdir()
        # (the script runs from beside the environment: no tests/ on sys.path)
        shutil.copy(ROOT / "tests" / "wheel_smoke.py", work / "wheel_smoke.py")
        with session.chdir(here):
            session.run(python, str(work / "wheel_smoke.py"), str(ROOT), str(ROOT / "README.md"), external=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@nox.session
def bench(session: nox.Session) -> None:
    """pytreeckpt beside torch.save, DCP, memcpy and raw I/O, then planning at scale; writes benchmarks/results/.

    ``nox -s bench -- --sizes-gib 1 --only single`` passes options on (``python -m benchmarks -h``).
    """
    _install(session, "bench")
    session.run("python", "-m", "benchmarks", *session.posargs)
    session.run("python", "benchmarks/plan_scale.py")


# The site's tools, pinned: a new release of any of them may warn where this one did not,
# and the build treats warnings as errors. ruff formats the API reference's signatures;
# Playwright drives the machine's Chromium for docs/check_site.py (it downloads no browser).
_DOCS = (
    "mkdocs==1.6.1",
    "mkdocs-material==9.8.2",
    "mkdocstrings[python]==1.0.8",
    "mkdocstrings-python==2.0.11",
    "ruff==0.17.6",
    "playwright==1.65.3",
)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation site: ``mkdocs build --strict`` into site/, then every page opened and checked.

    The check (docs/check_site.py) opens each page in headless Chromium where the machine has it
    (Debian's ``chromium``: ``apt-get install chromium``) and fails on a missing page, image or
    anchor; it checks the built HTML's links, images and anchors too, and that alone where there
    is no browser. ``nox -s docs -- --no-browser`` skips the browser.
    """
    session.install(TORCH)
    session.install("-e", ".", *_DOCS)
    session.run("mkdocs", "build", "--strict", "--site-dir", "site")
    session.run("python", "docs/check_site.py", "site", *session.posargs)
