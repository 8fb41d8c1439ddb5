"""The compile mode reads a phase's signals from the layers mode's compiled run of it in the same process (issue 33:
"it costs what the compiles cost"), and they are the same signals it gets from its own run: a token model with a
graph break in its own code (`tests/fixtures/compile_models.py`), a `long` sweep of two lengths, aot_eager."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ci_runner.backends import resolve_backend
from ci_runner.config import load_matrix_text
from ci_runner.matrix import expand
from tests.fixtures.compile_models import BREAK_LINE
from tests.fixtures.matrices import matrix_text

FACTORY = "tests.fixtures.compile_models:tokens_with_break"
TIMING = ("compile_s", "seconds", "run_by")


def _ctx(tmp: Path, name: str, modes: list[str], options: dict[str, Any], models: dict[Any, Any] | None = None) -> Any:
    from ci_runner.modes import ModeContext  # deferred: imports torch

    text = matrix_text(models=[{"id": "tb", "factory": FACTORY}], backends=[{"id": "ae", "compile": "aot_eager"}],
                       modes=modes, inputs={"phases": [{"long": {"seq_len": [4, 6]}}]}, options={"compile": options})
    cell = next(iter(expand(load_matrix_text(text))))
    cdir = tmp / name / cell.id
    cdir.mkdir(parents=True)
    return ModeContext(cell=cell, cell_dir=cdir, backend=resolve_backend(cell.backend),
                       deadline=time.monotonic() + 600, _models=models if models is not None else {})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from ci_runner.modes.compile.mode import run
    from ci_runner.modes.layers.phases import run_phases
    from ci_runner.registry import parse_options

    tmp = tmp_path_factory.mktemp("compile-reuse")
    shared = _ctx(tmp, "shared", ["layers", "compile"], {"verify": False})
    layers, _ = run_phases(shared, parse_options("layers", {}), shared.artifact_dir("layers"))
    kept = dict(shared.compiled_runs)
    reused = run(shared)
    own = run(_ctx(tmp, "own", ["layers", "compile"], {"verify": False, "reuse": False}, shared._models))
    alone = _ctx(tmp, "alone", ["layers"], {}, shared._models)
    run_phases(alone, parse_options("layers", {}), alone.artifact_dir("layers"))
    return {"kept": kept, "reused": reused, "own": own, "layers": layers, "alone": alone}


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in TIMING and k != "trace"}  # each run's own trace: records differ
    out["per_call"] = [{k: v for k, v in c.items() if k != "compile_s"} for c in row.get("per_call", [])]
    return out


def test_the_signals_come_from_the_layers_run_and_equal_the_modes_own(runs: dict[str, Any]) -> None:
    reused, own = runs["reused"], runs["own"]
    assert list(runs["kept"]) == ["long"] and runs["kept"]["long"].by == "layers" and not runs["layers"]
    a, b = reused.data["phases"]["long"], own.data["phases"]["long"]
    assert a["run_by"] == "layers" and b["run_by"] == "compile"
    # the prompt's length compiles, the first long length recompiles with a dynamic length, the second reuses it
    assert a["graphs"] >= 2 and a["compile_s"] > 0 and [c["graphs"] > 0 for c in a["per_call"]] == [True, True, False]
    assert [g["source"] for g in a["graph_breaks"]] == [f"tests/fixtures/compile_models.py:{BREAK_LINE}"]
    assert a["recompiles"] and all(r["dynamic"] for r in a["recompiles"])
    assert _plain(a) == _plain(b)
    assert a["trace"]["file"] == b["trace"]["file"] == "compile/torch_trace/dedicated_log_torch_trace_long.log"
    assert sorted(f.fingerprint for f in reused.findings) == sorted(f.fingerprint for f in own.findings)
    assert {f.kind for f in reused.findings} == {"graph_break"}


def test_a_cell_without_the_compile_mode_keeps_no_watched_run(runs: dict[str, Any]) -> None:
    assert runs["alone"].compiled_runs == {}
