"""Issue 48: a `factory:` model that returns positional inputs, `(model, (tensor,))`, runs through a real cell (the
reference, then the backend) instead of failing "on the reference (cpu) before any backend runs: TypeError: keywords
must be strings"; a factory whose inputs its forward cannot take stops at load, as one error naming the factory."""

from __future__ import annotations

import time
from pathlib import Path

from ci_runner.config import load_matrix_text
from ci_runner.matrix import expand
from ci_runner.run.cellrun import run_cell_inprocess
from tests.fixtures.matrices import matrix_text

MATRIX = matrix_text(modes=["layers"], timeout=300, inputs={"samples": 1},
                     models=[{"id": "tuple-in", "factory": "tests.fixtures.models_factory:positional_tuple"},
                             {"id": "two-in", "factory": "tests.fixtures.models_factory:positional_list"},
                             {"id": "too-many", "factory": "tests.fixtures.models_factory:too_many_positional"}],
                     backends=[{"id": "aot", "compile": "aot_eager"}])


def run(tmp_path: Path, model: str):
    matrix = load_matrix_text(MATRIX, path=str(tmp_path / "matrix.yaml"))
    cell = next(c for c in expand(matrix) if c.model.id == model)
    return run_cell_inprocess(cell, tmp_path / "cells" / cell.id, modes=("layers",), deadline=time.monotonic() + 300)


def test_positional_inputs_run_on_the_reference_and_the_backend(tmp_path):
    for model in ("tuple-in", "two-in"):
        result = run(tmp_path, model)
        layers = result.modes["layers"]
        assert (result.status, layers.status) == ("pass", "pass"), (layers.reason, result.error)


def test_inputs_the_forward_cannot_take_fail_the_cell_at_load_naming_the_factory(tmp_path):
    result = run(tmp_path, "too-many")
    text = " ".join(str(x) for x in (result.error.message if result.error else "", result.modes.get("layers") and
                                     result.modes["layers"].reason))
    assert result.status == "error", result.status
    assert "factory 'tests.fixtures.models_factory:too_many_positional' returned 2 positional input(s)" in text, text
    assert "keywords must be strings" not in text
