"""The compile mode's figures as a trend per backend over the nights (`modes/compile/report.compile_by_backend`, its
history hook, kept in `Trends.modes["compile"]`): the summary's line and report.html's charts of graphs, breaks,
recompiles and compile seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ci_runner.history.store import add_run, load_history
from ci_runner.history.trends import compute
from ci_runner.modes.compile.report import compile_by_backend
from ci_runner.report import write_reports
from tests.unit.test_history import meta_of, night_results


def _night(night: int, graphs: int, breaks: int, secs: float) -> Any:
    results = night_results(night)
    for cell in results.cells[:2]:  # the compile mode's figures, as `modes/compile/mode.figures_of` names them
        cell.modes["ops"].data["figures"] = {f"graphs.{p}": graphs for p in ("decode", "long")} | {
            "graph_breaks.decode": breaks, "compile_s.decode": secs}
    return results


def test_compile_figures_are_summed_per_backend_and_night_unknown_is_not_zero() -> None:
    figures = {"m0@b": {"compile.graphs.decode": [1.0, 2.0], "compile.graphs.long": [None, 3.0],
                        "compile.compile_s.decode": [None, None], "memory.peak_bytes.decode": [5.0, 5.0]},
               "m1@b": {"compile.graphs.decode": [4.0, None]}, "m0@c": {"compile.recompiles.forward": [0.0, 1.0]}}
    assert compile_by_backend(figures, 2) == {"b": {"graphs": [5.0, 5.0], "compile_s": [None, None]},
                                              "c": {"recompiles": [0.0, 1.0]}}


def test_the_summary_and_the_page_chart_them(tmp_path: Path) -> None:
    store = tmp_path / "h"
    for night, graphs, breaks, secs in ((1, 2, 1, 3.0), (2, 3, 0, 2.5)):
        results = _night(night, graphs, breaks, secs)
        for cell in results.cells:  # the mode's name in the history is the mode that wrote the figures
            if "ops" in cell.modes and "figures" in cell.modes["ops"].data:
                cell.modes["compile"] = cell.modes.pop("ops")
        add_run(store, results, meta_of(night))
    h = load_history(store)
    try:
        t = compute(h)
    finally:
        h.close()
    assert sorted(t.modes["compile"]) == ["inductor", "sim-subset"]  # the two cells with figures, one backend each
    assert t.modes["compile"]["inductor"] == {"graphs": [4.0, 6.0], "graph_breaks": [1.0, 0.0], "compile_s": [3.0, 2.5]}
    backend = "inductor"
    out = write_reports(results, tmp_path / "rep", env={}, trends=t)
    summary, page = out["summary"].read_text(), out["html"].read_text()
    assert "Compile figures per backend" in summary and f"`{backend}`: graphs" in summary
    assert "Compile figures per backend" in page and 'data-kind="compile"' in page and 'data-kind="compile-time"' in page
