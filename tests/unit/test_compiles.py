"""The cost in compiles (issue 44): every backend compile counted with its seconds (`watch/compiles.py`), per mode and
phase in `data.compiles` (the one phase loop, `ModeContext.each_phase`, and the cell's mode loop), shown generically
in summary.md and report.html."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ci_runner.watch import compiles
from ci_runner.report.html import compile_table
from ci_runner.report.summary import compile_section
from ci_runner.report.view import build_view, compile_costs
from ci_runner.results.model import CellResult, ModeResult, Results
from tests.fixtures.matrices import matrix_text

MATRIX = matrix_text(models=[{"id": "m", "config": "llama"}],
                     backends=[{"id": "slow", "compile": "sim-slow", "backend_options": {"seconds": 0.3}}],
                     inputs={"phases": ["prefill", {"decode": {"steps": 1}}]})


def _fn(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ x) + 1


def test_each_phase_and_the_mode_loop_count_every_compile(mode_context: Callable[..., Any],
                                                           fresh_dynamo: Callable[[], None]) -> None:
    ctx = mode_context(MATRIX, "m", "slow")
    x = torch.randn(4, 4)
    before = compiles.tally()
    ctx.backend.compile(_fn)(x)  # outside the phase loop: the mode's `forward`

    def body(phase: Any) -> tuple[list[Any], dict[str, Any]]:
        if phase.name == "decode":  # two graphs in this phase, none in the prefill
            for _ in range(2):
                fresh_dynamo()
                ctx.backend.compile(_fn)(x)
        return [], {"status": "pass"}

    _, rows = ctx.each_phase("toy", body)
    data = ctx.compiles_data("toy", compiles.since(before))
    assert list(data) == ["prefill", "decode", "forward", "total"]
    assert data["prefill"] == {"graphs": 0, "compile_s": 0.0}
    assert data["decode"]["graphs"] == 2 and data["decode"]["compile_s"] >= 0.6  # sim-slow's busy seconds
    assert data["forward"]["graphs"] == 1 and data["forward"]["compile_s"] >= 0.3
    assert data["total"]["graphs"] == 3 and data["total"]["compile_s"] >= 0.9


def test_reports_show_where_the_compile_time_went() -> None:
    def mode(table: dict[str, Any]) -> ModeResult:
        return ModeResult(status="pass", data={"compiles": table})

    cell = CellResult(id="m@slow", model="m", backend="slow", status="pass", env={}, modes={
        "alpha": mode({"forward": {"graphs": 1, "compile_s": 20.5}, "total": {"graphs": 1, "compile_s": 20.5}}),
        "beta": mode({"prefill": {"graphs": 2, "compile_s": 41.0}, "decode": {"graphs": 0, "compile_s": 0.0},
                      "total": {"graphs": 2, "compile_s": 41.0}}),
        "gamma": ModeResult(status="pass", data={"compiles": "not a table"})})
    assert [(r.mode, r.phase, r.graphs) for r in compile_costs(cell)] == [
        ("alpha", "forward", 1), ("alpha", "total", 1), ("beta", "prefill", 2), ("beta", "decode", 0),
        ("beta", "total", 2)]
    text = compile_section([cell])
    assert "3 graph(s) compiled by the backends in 61.5 s in all" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| `m@slow`")]
    assert lines == ["| `m@slow` | beta | prefill | 2 | 41.0 |", "| `m@slow` | alpha | forward | 1 | 20.5 |"]
    results = Results(cells=[cell])
    page = compile_table(build_view(results).cells[0])
    assert "<td>beta</td><td>prefill</td><td>2</td><td>41.00</td>" in page and "decode" not in page
    assert compile_section([CellResult(id="e@x", model="e", backend="x", status="pass", env={})]) == ""
