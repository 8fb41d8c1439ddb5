"""A mode added through the registry alone (`ci_runner/registry.py`): a toy mode in a temporary package, registered
with one `register_mode` call, is accepted by the matrix schema and its options check, runs in a cell, lands in
`results.json` (schema-validated), the reports and the diff, and its findings are grouped into issues."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ci_runner.config import load_matrix_text
from ci_runner.errors import ConfigError
from ci_runner.github.render import group_entries
from ci_runner.matrix import expand
from ci_runner.registry import SECTION_OTHER, KindSpec, ModeSpec, mode_names, mode_of_group, register_mode, unregister_mode
from ci_runner.results.baseline import Baseline, diff
from ci_runner.run.aggregate import aggregate, write_report_dir
from ci_runner.run.cellrun import run_cell_inprocess, write_final
from tests.fixtures.matrices import matrix_text

TOY_MODULE = '''
from dataclasses import dataclass

from ci_runner.options import integer, option
from ci_runner.registry import parse_options
from ci_runner.results.model import Finding, ModeResult, fingerprint


@dataclass(frozen=True, kw_only=True)
class ToyOptions:
    count: int = option(1, check=integer(ge=1, hint="give an integer >= 1"), help="findings the toy mode makes")


def run(ctx):
    opts = parse_options("toy", ctx.options("toy"))
    findings = [Finding(kind="toy_failure", stage="run", message=f"toy part {i} failed", module=f"toy.part{i}",
                        fingerprint=fingerprint("toy_failure", ctx.cell.backend.id, ctx.model_id, f"toy.part{i}"))
                for i in range(opts.count)]
    return ModeResult(status="fail", findings=findings, data={"parts": opts.count})
'''

def toy_matrix(**toy: Any) -> str:
    """One cell running the toy mode alone, with `toy` as its options."""
    return matrix_text(modes=["toy"], options={"toy": toy}, models=[{"id": "tiny", "config": "llama"}],
                       backends=[{"id": "eager", "device": "cpu"}])


@pytest.fixture
def toy_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModeSpec]:
    pkg = tmp_path / "toy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("", encoding="utf-8")
    (pkg / "toy_mode.py").write_text(TOY_MODULE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    from toy_pkg.toy_mode import ToyOptions  # type: ignore[import-not-found]  # the package just written

    spec = register_mode(ModeSpec(
        name="toy", run="toy_pkg.toy_mode:run", options=ToyOptions, order=40, issue_groups=("toy",),
        kinds=(KindSpec(kind="toy_failure", key="module", section=SECTION_OTHER, issue_group="toy"),),
    ))
    try:
        yield spec
    finally:
        unregister_mode("toy")


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
    assert result.status == "fail" and result.modes["toy"].data == {"parts": 2}

    results = aggregate([tmp_path / "run"])  # schema-validated on load: mode "toy", kind "toy_failure"
    written = write_report_dir(results, tmp_path / "report", run_dir=tmp_path / "run")
    saved = json.loads(written["results"].read_text(encoding="utf-8"))
    assert [f["kind"] for f in saved["cells"][0]["modes"]["toy"]["findings"]] == ["toy_failure"] * 2
    summary = (tmp_path / "report" / "summary.md").read_text(encoding="utf-8")
    assert "toy" in summary and "toy.part1" in summary
    assert "toy_failure" in (tmp_path / "report" / "junit.xml").read_text(encoding="utf-8")

    d = diff(results, Baseline()).to_dict()
    assert sorted((e["category"], e.get("mode") or "", e.get("kind") or "", e.get("key") or "") for e in d["entries"]) == [
        ("new_cell", "", "", ""), ("new_cell", "toy", "toy_failure", "toy.part0"),
        ("new_cell", "toy", "toy_failure", "toy.part1")]
    groups = group_entries(d, layers=True)
    assert [g.key for g in groups] == [("toy", "eager", "toy.part0"), ("toy", "eager", "toy.part1")]
    assert mode_of_group()["toy"] == "toy"
