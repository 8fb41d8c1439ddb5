"""A mode added through the registry alone (`ci_runner/registry.py`): the toy mode, one package
(`tests/fixtures/toymode/`) registered with one `register_mode` call, is accepted by the matrix schema and its options
check, runs in a cell, lands in `results.json` (schema-validated), the diff, and through its own hooks in summary.md,
report.html, junit.xml and the history's sections; its findings are grouped into issues and filed with its own issue
template; its phase body runs in the one phase loop (`ModeContext.each_phase`); under tensor parallelism its rank
task runs in the cell's one launch of ranks, with the built-in modes' tasks. No file outside the toy package names
it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ci_runner.config import load_matrix_text, spec_to_json
from ci_runner.errors import ConfigError
from ci_runner.github.options import FilingOptions
from ci_runner.github.render import RenderContext, group_entries, render_issue
from ci_runner.history.store import add_run, load_history
from ci_runner.history.trends import compute
from ci_runner.matrix import expand
from ci_runner.modes import ModeContext
from ci_runner.procs.ranks import read_progress
from ci_runner.registry import ModeSpec, mode_names, mode_of_group, mode_spec, register_mode, unregister_mode
from ci_runner.report import write_reports
from ci_runner.results.baseline import Baseline, diff
from ci_runner.results.model import JOURNAL_NAME
from ci_runner.run.aggregate import aggregate, write_report_dir
from ci_runner.run.cellrun import run_cell_inprocess, write_final
from tests.fixtures import toymode
from tests.fixtures.history_sim import meta_of
from tests.fixtures.matrices import REFERENCES, matrix_text
from tests.fixtures.paths import ROOT


def toy_matrix(inputs: dict[str, Any] | None = None, **toy: Any) -> str:
    """One cell running the toy mode alone, with `toy` as its options."""
    return matrix_text(modes=["toy"], options={"toy": toy}, models=[{"id": "tiny", "config": "llama"}],
                       backends=[{"id": "eager", "device": "cpu"}], inputs=inputs)


@pytest.fixture
def toy_mode() -> Iterator[ModeSpec]:
    spec = register_mode(toymode.SPEC)
    try:
        yield spec
    finally:
        unregister_mode(spec.name)


def test_an_unregistered_mode_is_refused_by_the_schema() -> None:
    assert "toy" not in mode_names()
    with pytest.raises(ConfigError, match="toy"):
        load_matrix_text(toy_matrix(count=2))


def test_a_toy_mode_registered_alone_is_accepted_run_reported_and_grouped(toy_mode: ModeSpec, tmp_path: Path) -> None:
    assert mode_names() == ("ops", "layers", "numerics", "compile", "memory", "toy")
    with pytest.raises(ConfigError, match="did you mean 'count'"):  # its options are checked at load, like any mode's
        load_matrix_text(toy_matrix(cont=2))
    (cell,) = expand(load_matrix_text(toy_matrix(count=2)))
    assert cell.modes == ("toy",)

    cell_dir = tmp_path / "run" / "cells" / cell.id
    result = run_cell_inprocess(cell, cell_dir, modes=cell.modes, deadline=time.monotonic() + 120)
    write_final(result, cell_dir)
    zero = {"compile_s": 0.0, "graphs": 0}
    assert result.status == "fail" and result.modes["toy"].data == {  # `compiles`: filled for every mode, not by it
        "parts": 2, "figures": {"parts": 2}, "phases": {"forward": {"status": "pass", "parts": 2, "phase": None}},
        "compiles": {"forward": zero, "total": zero}}

    results = aggregate([tmp_path / "run"])  # schema-validated on load: mode "toy", kind "toy_failure"
    written = write_report_dir(results, tmp_path / "report", run_dir=tmp_path / "run")
    saved = json.loads(written["results"].read_text(encoding="utf-8"))
    assert [f["kind"] for f in saved["cells"][0]["modes"]["toy"]["findings"]] == ["toy_failure"] * 2
    summary = (tmp_path / "report" / "summary.md").read_text(encoding="utf-8")
    assert "toy" in summary and "toy.part1" in summary
    assert "### Toy parts\n\n| cell | toy parts |" in summary and f"| `{cell.id}` | 2 |" in summary  # its section
    page = (tmp_path / "report" / "report.html").read_text(encoding="utf-8")
    assert '<table class="toy"><caption>toy parts</caption><tr><td>2</td></tr></table>' in page
    junit = (tmp_path / "report" / "junit.xml").read_text(encoding="utf-8")
    assert "toy_failure" in junit and '<property name="toy.parts" value="2"' in junit

    d = diff(results, Baseline()).to_dict()
    assert sorted((e["category"], e.get("mode") or "", e.get("kind") or "", e.get("key") or "") for e in d["entries"]) == [
        ("new_cell", "", "", ""), ("new_cell", "toy", "toy_failure", "toy.part0"),
        ("new_cell", "toy", "toy_failure", "toy.part1")]
    groups = group_entries(d, layers=True)
    assert [g.key for g in groups] == [("toy", "eager", "toy.part0"), ("toy", "eager", "toy.part1")]
    assert mode_of_group()["toy"] == "toy"

    ctx = RenderContext(options=FilingOptions(), run_key="gh-1", run_url=None, artifacts_url=None, run_dir=tmp_path / "run")
    body = render_issue(groups[0], ctx)  # its own template and title, found through its registration
    assert groups[0].title == "[deepview-ci] toy part toy.part0 breaks on eager"
    assert f"<!-- deepview-ci:fingerprint={groups[0].fingerprint} -->" in body
    assert "### Toy part `toy.part0` breaks on backend `eager`" in body and "The toy mode's own issue template." in body
    assert "toy wobble: wobble `0.5`" in body and "One issue per toy part and backend" in body

    store = tmp_path / "history"  # its history figure: parts per night, in both reports' history sections
    for night in (1, 2):
        add_run(store, results, meta_of(night))
    h = load_history(store)
    try:
        t = compute(h)
    finally:
        h.close()
    assert t.modes["toy"] == [2.0, 2.0]
    out = write_reports(results, tmp_path / "with-history", env={}, trends=t)
    assert "#### Toy parts per night\n\n2 · 2\n" in out["summary"].read_text(encoding="utf-8")
    page = out["html"].read_text(encoding="utf-8")
    assert "<h3>Toy parts per night</h3>" in page and 'data-kind="toy"' in page


def test_the_toy_modes_phase_body_runs_in_the_one_phase_loop(toy_mode: ModeSpec, tmp_path: Path) -> None:
    """Each phase of the cell's workload is a row of its `data.phases`, journaled as it runs (`each_phase`)."""
    (cell,) = expand(load_matrix_text(toy_matrix(inputs={"phases": ["prefill", {"decode": {"steps": 2}}]}, count=1)))
    result = run_cell_inprocess(cell, tmp_path / cell.id, modes=cell.modes, deadline=time.monotonic() + 120)
    data = result.modes["toy"].data
    assert data["phases"] == {"prefill": {"status": "pass", "parts": 1, "phase": "prefill"},
                              "decode": {"status": "pass", "parts": 1, "phase": "decode"}}
    assert set(data["compiles"]) == {"prefill", "decode", "total"}
    journal = (tmp_path / cell.id / JOURNAL_NAME).read_text(encoding="utf-8")
    assert "enter-workload\ttoy.prefill\n" in journal and "leave-workload\ttoy.decode\n" in journal


def test_the_cells_launch_payload_holds_each_declaring_modes_task_and_part(toy_mode: ModeSpec, tmp_path: Path) -> None:
    """The one launch's payload: the cell's model, inputs and layout once, the tasks of the cell's modes that declare
    one (mode order; compile declares none), each with its own part, from the registry alone."""
    text = matrix_text(models=[{"id": "tiny", "config": "llama", "parallel": {"tp": 2}}],
                       backends=[{"id": "aot_eager", "compile": "aot_eager"}], modes=["toy", "ops", "compile"],
                       options={"toy": {"count": 3}})
    (cell,) = expand(load_matrix_text(text))
    ctx = ModeContext(cell=cell, cell_dir=tmp_path, backend=None, deadline=time.monotonic() + 60,  # type: ignore[arg-type]
                      modes=cell.modes)
    specs = ctx.ranks().selected("toy")
    assert [s.name for s in specs] == ["ops", "toy"]
    payload = ctx.ranks().payload(specs)
    assert payload["tasks"] == [mode_spec("ops").rank_task, toy_mode.rank_task]  # type: ignore[union-attr]
    assert payload["parallel"] == {"tp": 2, "plan": {}} and payload["model"]["id"] == "tiny"
    assert payload["parts"] == {payload["tasks"][0]: {"ops_backend": spec_to_json(cell.backend)},
                                payload["tasks"][1]: {"toy_parts": 3}}


@pytest.mark.slow
def test_a_tp_cell_launches_its_ranks_once_for_every_mode_the_toy_included(toy_mode: ModeSpec, tmp_path: Path) -> None:
    """A tp2 cell running ops, layers, numerics and the toy: ONE launch of ranks (one `init` per rank's progress, no
    other progress files in the cell) ran the four modes' rank tasks in mode order, each recorded by both ranks; each
    mode took its own (`data.parallel`), the toy's rank 0 value among them."""
    text = matrix_text(models=[{"id": "tiny-decoder", "factory": "tests.fixtures.plugin_tp_models:decoder",
                                "parallel": {"tp": 2}}], backends=[{"id": "aot_eager", "compile": "aot_eager"}],
                       modes=["ops", "layers", "numerics", "toy"], inputs={"samples": 1}, references=REFERENCES,
                       options={"numerics": {"isolate": False}, "toy": {"count": 1}})
    (cell,) = expand(load_matrix_text(text))
    cell_dir = tmp_path / cell.id
    result = run_cell_inprocess(cell, cell_dir, modes=cell.modes, deadline=time.monotonic() + 1200)
    for mode in ("ops", "layers", "numerics", "toy"):
        assert result.modes[mode].data["parallel"]["ranks"] == "all ranks finished", (mode, result.modes[mode].reason)
    assert result.modes["toy"].data["parallel"]["value"] == {
        "rank": 0, "world": 2, "sum": 3.0, "layout": "tp2", "parts": 1, "mesh": "cpu"}
    launch = cell_dir / "parallel"
    assert sorted(p.relative_to(cell_dir).as_posix() for p in cell_dir.rglob("rank*.progress")) == [
        "parallel/rank0.progress", "parallel/rank1.progress"]
    assert [read_progress(launch, r).count("init") for r in (0, 1)] == [1, 1]
    tasks = [json.loads((launch / f"task{i}.rank0.json").read_text(encoding="utf-8"))["task"] for i in range(4)]
    assert tasks == [spec.rank_task for spec in (mode_spec("ops"), mode_spec("layers"), mode_spec("numerics"), toy_mode)]
    assert all((launch / f"task{i}.rank1.json").is_file() for i in range(4))


def test_no_file_outside_the_toy_package_names_it() -> None:
    """The toy mode (rank task, phase body and all) lives in its package alone: nothing in ci_runner names it."""
    named = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "ci_runner").rglob("*")) if p.is_file()
             and p.suffix in (".py", ".j2", ".json", ".yaml", ".md", ".toml")
             and re.search(r"\btoy(mode)?\b", p.read_text(encoding="utf-8", errors="replace"), re.IGNORECASE)]
    assert named == []
