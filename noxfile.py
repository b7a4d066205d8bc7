"""Sessions: check (tests, property tests, mypy), lint, bench; tests, property, typecheck alone.

``nox`` runs check and lint, the README's test command. check sets up one environment
and runs everything that needs torch in it: torch 2.13.0 is installed first (a CPU wheel;
an unpinned torch would pull a multi-GB CUDA build), then the project once, so the
project's own range ``torch>=2.6`` is satisfied without another download. lint needs only
ruff. tests, property and typecheck run one part each, in an environment of their own.
"""

from __future__ import annotations

import os

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


@nox.session
def bench(session: nox.Session) -> None:
    """pytreeckpt beside torch.save, DCP, memcpy and raw I/O, then planning at scale; writes benchmarks/results/.

    ``nox -s bench -- --sizes-gib 1 --only single`` passes options on (``python -m benchmarks -h``).
    """
    _install(session, "bench")
    session.run("python", "-m", "benchmarks", *session.posargs)
    session.run("python", "benchmarks/plan_scale.py")
