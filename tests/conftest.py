"""Fixtures shared by the test files: matrices, mode contexts, a fresh Dynamo, the fake GitHub server.

Real parts only: matrices go through the real loader, contexts get a really resolved backend, the GitHub server
is a local HTTP server speaking the REST API (`tests/fixtures/fake_github.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ci_runner.config import Matrix, load_matrix, load_matrix_text
from ci_runner.matrix import expand
from tests.fixtures.fake_github import FakeGitHub

# The `oldtorch` subset (`pytest -m oldtorch`, README "Supported torch"; not in `.ci/run`): the fast tests of these
# files (config, matrix, backends, the sims, capture, ops inventory and probing, layer search, numerics, bisect), the
# feature-detection tests and one CLI cell per mode of the bundled example (those two files mark themselves).
OLDTORCH_FILES = frozenset({
    "tests/unit/test_config.py", "tests/unit/test_matrix.py", "tests/unit/test_options.py",
    "tests/unit/test_backends.py", "tests/unit/test_sim.py", "tests/unit/test_capture.py", "tests/unit/test_tree.py",
    "tests/unit/test_inventory.py", "tests/unit/test_ops_probe.py", "tests/unit/test_layers_search.py",
    "tests/unit/test_numerics.py", "tests/unit/test_bisect.py",
})
# Tests of those files that fail on torch 2.7.1 for reasons in torch, not yet handled (README "Supported torch").
OLDTORCH_DIFFERS = frozenset({
    # 2.7's aot_autograd capture of a meta model fails; the inventory falls back to torch.export
    "tests/unit/test_inventory.py::test_aten_inventory_from_a_meta_model_matches_what_aot_autograd_hands_a_backend",
    # 2.7's export with the CIA-only decompositions keeps select/unbind that aot_autograd decomposes
    "tests/unit/test_inventory.py::test_export_fallback_gives_the_same_ops_here",
    # 2.7's Dynamo wraps the fixture backend's IndexError in BackendCompilerFailed
    "tests/unit/test_layers_search.py::test_stage_of_backend_errors",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        if (path in OLDTORCH_FILES and item.get_closest_marker("slow") is None
                and item.nodeid.split("[", 1)[0] not in OLDTORCH_DIFFERS):
            item.add_marker(pytest.mark.oldtorch)


def tiny_matrix_text(models: int = 2, backends: int = 2, extra: str = "") -> str:
    """A matrix of `models` tiny Llamas (m0, m1, …) × `backends` inductor backends (b0, b1, …)."""
    ms = "\n".join(f"  - {{id: m{i}, config: llama}}" for i in range(models))
    bs = "\n".join(f"  - {{id: b{i}, compile: inductor}}" for i in range(backends))
    return f"version: 1\nmodels:\n{ms}\nbackends:\n{bs}\n{extra}"


@pytest.fixture(scope="session")
def example_matrix() -> Matrix:
    """The bundled example matrix (`ci_runner/data/example.yaml`)."""
    return load_matrix(None)


@pytest.fixture
def write_matrix(tmp_path: Path) -> Callable[..., Path]:
    """`write_matrix(text, name="matrix.yaml") -> Path`: the matrix text as a file in this test's folder."""

    def write(text: str, name: str = "matrix.yaml") -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return write


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
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches reset before and after the test (compiled graphs of one test never serve another)."""
    import torch  # deferred: only the tests that compile need torch here

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def gh() -> Iterator[FakeGitHub]:
    """A local GitHub REST API server (issues, labels, comments, rate limits) for one test."""
    with FakeGitHub() as server:
        yield server
