"""Fixtures shared by the test files: matrices, mode contexts, a fresh Dynamo, the fake GitHub server.

Real parts only: matrices go through the real loader, contexts get a really resolved backend, the GitHub server
is a local HTTP server speaking the REST API (`tests/fixtures/fake_github.py`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ci_runner.config import Matrix, load_matrix, load_matrix_text
from ci_runner.procs.isolate import WARM_ENV
from ci_runner.matrix import expand
from tests.fixtures.cli import run_cli
from tests.fixtures.fake_github import FakeGitHub
from tests.fixtures.matrices import matrix_text
from tests.fixtures.schedule import heaviest_first

# The suite starts hundreds of children on 2 cores (isolated children, cell workers), each importing torch, Dynamo and
# transformers (~5.5 CPU s) before its work: here they are forked from a warm server instead (`ci_runner/engine/
# warm.py`), the same children and entries. tests/integration/test_isolate.py checks both starts; a run that sets
# the variable keeps its value.
os.environ.setdefault(WARM_ENV, "1")
# Inductor compiles in the process that asks (no pool of compile workers, each importing torch): xdist's workers and
# their children already share the cores. The ops mode's probe children get a share of their own (`probe_child_env`)
# unless this is set; with it set they inherit it, so they and the repro checks fork from one warm server per process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The heaviest test files first (`tests/fixtures/schedule.py`): with `--dist loadfile` and
    `--no-loadscope-reorder` (pyproject's addopts) files start in this order, so the run ends on short files."""
    items[:] = heaviest_first(items)


@pytest.fixture(scope="session")
def example_matrix() -> Matrix:
    """The bundled example matrix (`ci_runner/data/example.yaml`)."""
    return load_matrix(None)


@pytest.fixture
def write_matrix(tmp_path: Path) -> Callable[..., Path]:
    """`write_matrix(text=None, name="matrix.yaml", **parts) -> Path`: a matrix file in this test's folder, from its
    text or built from `parts` (`tests/fixtures/matrices.py`: `matrix_text(models=…, backends=…, modes=…, …)`)."""

    def write(text: str | None = None, name: str = "matrix.yaml", **parts: Any) -> Path:
        path = tmp_path / name
        path.write_text(text if text is not None else matrix_text(**parts), encoding="utf-8")
        return path

    return write


@pytest.fixture
def cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """`cli(*args, env=None, timeout=300) -> CompletedProcess`: `deepview-ci ARGS…` in a child process
    (`tests/fixtures/cli.py`)."""
    return run_cli


@pytest.fixture
def mode_context(tmp_path: Path) -> Callable[..., Any]:
    """`mode_context(matrix, model, backend, *, options=None, seconds=300, cell_dir=None) -> ModeContext`.

    `matrix` is matrix text, a path to a matrix file or a loaded `Matrix`; `options` replace the cell's
    `options` (a mapping of mode -> options); the backend is resolved for real."""
    from ci_runner.backends import resolve_backend  # deferred: resolving a backend imports torch
    from ci_runner.modes import ModeContext  # deferred: as above

    def make(matrix: str | Path | Matrix, model: str, backend: str, *,
             options: Mapping[str, Mapping[str, Any]] | None = None, seconds: float = 300.0,
             cell_dir: Path | None = None) -> ModeContext:
        if isinstance(matrix, Matrix):
            m = matrix
        elif isinstance(matrix, Path) or str(matrix).endswith((".yaml", ".yml")):
            m = load_matrix(matrix)
        else:
            m = load_matrix_text(str(matrix))
        cell = next(c for c in expand(m) if c.model.id == model and c.backend.id == backend)
        if options is not None:
            cell = replace(cell, options={k: dict(v) for k, v in options.items()})
        cdir = cell_dir or tmp_path / "run" / "cells" / cell.id
        cdir.mkdir(parents=True, exist_ok=True)
        return ModeContext(cell=cell, cell_dir=cdir, backend=resolve_backend(cell.backend),
                           deadline=time.monotonic() + seconds)

    return make


@pytest.fixture
def fresh_dynamo() -> Iterator[Callable[[], None]]:
    """Dynamo's caches reset before and after the test (compiled graphs of one test never serve another); the
    fixture's value resets them again mid-test (`fresh_dynamo()` between two compiles of the same code)."""
    import torch  # deferred: only the tests that compile need torch here

    torch._dynamo.reset()
    yield torch._dynamo.reset
    torch._dynamo.reset()


@pytest.fixture
def gh() -> Iterator[FakeGitHub]:
    """A local GitHub REST API server (issues, labels, comments, rate limits) for one test."""
    with FakeGitHub() as server:
        yield server
