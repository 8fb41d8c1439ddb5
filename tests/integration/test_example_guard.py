"""The guard on behaviour: the bundled example gives the cells, statuses and finding fingerprints of
`baselines/example.json`, judged by `deepview-ci diff --fail-on change` (any regressed, fixed, new or missing
cell or finding fails it; flaky ones do not).

The whole example takes about 4 minutes on 2 cores, too long for the suite, so it is checked in two parts here:
- the comparison itself, fast: results rebuilt from the committed baseline diff clean, and each kind of change
  (a finding gone, a finding new, a status changed, a cell missing, a cell new) fails it;
- one real cell of the example (`tiny-vit@sim-subset`, ops mode, with a finding), run through the command line and
  diffed against that cell's slice of the baseline.
The whole example is `benchmarks/bench_example.py` (it runs it and diffs it the same way).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from ci_runner.registry import kind_spec
from ci_runner.results.baseline import diff, load_baseline
from ci_runner.results.model import CellResult, Finding, ModeResult, Results
from tests.fixtures.cli import run_cli
from tests.fixtures.paths import BASELINE_EXAMPLE, EXAMPLE

CELL = "tiny-vit@sim-subset"  # ops mode, one unsupported op: about 30 s on 2 cores


def _baseline() -> dict[str, Any]:
    return json.loads(BASELINE_EXAMPLE.read_text(encoding="utf-8"))


def _slice(baseline: dict[str, Any], cells: set[str]) -> dict[str, Any]:
    return {**baseline, "cells": [c for c in baseline["cells"] if c["id"] in cells],
            "findings": [f for f in baseline["findings"] if f["cell"] in cells]}


def results_from(baseline: dict[str, Any]) -> Results:
    """The results a run that matches `baseline` exactly would give (only what the diff reads)."""
    cells = []
    for c in baseline["cells"]:
        modes = {m: ModeResult(status=s) for m, s in c["modes"].items()}
        for f in baseline["findings"]:
            if f["cell"] == c["id"]:
                field = kind_spec(f["kind"]).key  # type: ignore[union-attr]  # every baseline kind is registered
                modes[f["mode"]].findings.append(Finding(kind=f["kind"], stage="run", message="as in the baseline",
                                                         fingerprint=f["fingerprint"], **{field: f["key"]}))
        cells.append(CellResult(id=c["id"], model=c["model"], backend=c["backend"], status=c["status"], modes=modes))
    return Results(cells=cells)


def diff_exit(results: Results, baseline: dict[str, Any], tmp_path: Path) -> tuple[int, list[str]]:
    """What `deepview-ci diff RESULTS --baseline BASELINE --fail-on change` does, in this process: its exit code and
    the changed entries."""
    bpath = tmp_path / "baseline.json"
    bpath.write_text(json.dumps(baseline), encoding="utf-8")
    d = diff(results, load_baseline(bpath), policy="change")
    return d.exit_code("change"), _changed([e.to_dict() for e in d.entries])


def _changed(entries: list[dict[str, Any]]) -> list[str]:
    return [f"{e['category']}: {e['cell']} {e.get('kind') or ''} {e.get('key') or ''} ({e['reason']})"
            for e in entries if e["category"] not in ("persisting", "flaky")]


def _diff_cli(rpath: Path, bpath: Path, out: Path) -> tuple[int, list[str]]:
    proc = run_cli("diff", str(rpath), "--baseline", str(bpath), "--fail-on", "change", "--out", str(out), timeout=120)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    return proc.returncode, _changed(json.loads((out / "diff.json").read_text(encoding="utf-8"))["entries"])


def _drop_finding(r: Results) -> None:
    r.cells[0].modes[next(iter(r.cells[0].modes))].findings.pop()


def _add_finding(r: Results) -> None:
    c = next(c for c in r.cells if c.id == "tiny-llama@sim-subset")
    c.modes["ops"].findings.append(Finding(kind="unsupported_op", stage="compile", message="new", op="aten.new.default",
                                           fingerprint="0123456789abcdef0123"))


def _change_status(r: Results) -> None:
    c = next(c for c in r.cells if c.id == "tiny-llama@inductor")
    c.status = c.modes["numerics"].status = "error"


def _add_cell(r: Results) -> None:
    r.cells.append(CellResult(id="tiny-llama@eager", model="tiny-llama", backend="eager", status="pass",
                              modes={"ops": ModeResult(status="pass")}))


CHANGES: dict[str, Callable[[Results], None]] = {
    "fixed": _drop_finding, "regressed": _add_finding, "status": _change_status,
    "missing_cell": lambda r: r.cells.pop(), "new_cell": _add_cell,
}


def test_results_matching_the_baseline_diff_clean(tmp_path: Path) -> None:
    baseline = _baseline()
    assert len(baseline["cells"]) == 15 and baseline["findings"]
    assert diff_exit(results_from(baseline), baseline, tmp_path) == (0, [])


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_each_kind_of_change_fails_the_guard(change: str, tmp_path: Path) -> None:
    baseline = _baseline()
    results = results_from(baseline)
    CHANGES[change](results)
    code, changed = diff_exit(results, baseline, tmp_path)
    assert code == 1 and changed, change


@pytest.mark.slow
def test_a_real_cell_of_the_bundled_example_matches_the_baseline(tmp_path: Path, cli: Callable[..., Any]) -> None:
    out = tmp_path / "run"
    proc = cli("run", "--out", str(out), "--select", CELL, timeout=600)  # no MATRIX: the bundled example
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # a finding: exit 1
    assert EXAMPLE.is_file()
    sliced = tmp_path / "baseline.json"
    sliced.write_text(json.dumps(_slice(_baseline(), {CELL})), encoding="utf-8")
    code, changed = _diff_cli(out / "report" / "results.json", sliced, tmp_path / "diff")
    assert (code, changed) == (0, []), changed
