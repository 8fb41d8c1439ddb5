"""The reports as the tools users already have read them: Jenkins' schema, junitparser (EnricoMi's
publisher), annotation-placing reporters; and summary.md agreeing with junit.xml's counts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ci_runner.report import write_reports
from ci_runner.report.junit import junit_counts
from ci_runner.report.view import build_view, cos_distance, repro_command
from ci_runner.results.model import CellError, CellResult, Finding, ModeResult, Repro, Results, fingerprint
from tests.fixtures import results_factory as rf
from tests.fixtures.junit import JENKINS_XSD_PATH, check_junit, schema


def mixed_results() -> Results:
    """pass, fail (ops, layers, numerics findings), error, crashed, timeout and skipped cells; a dotted model id."""
    dotted = "qwen2.5-0.5b"
    crashed = CellResult(
        id=f"{dotted}@sim-segv", model=dotted, backend="sim-segv", status="crashed", duration_s=12.0,
        artifacts_dir=f"cells/{dotted}@sim-segv",
        modes={"ops": ModeResult(status="pass", duration_s=3.0),
               "layers": ModeResult(status="crashed", reason="worker process killed by SIGSEGV during mode 'layers'"),
               "numerics": ModeResult(status="pass", duration_s=5.0)},
        error=CellError(type="crashed", message="worker process killed by SIGSEGV during mode 'layers'",
                        exit_code=-11, signal="SIGSEGV", stderr_tail="Fatal Python error: Segmentation fault"))
    timeout = CellResult(
        id="tiny-llama@sim-hang", model="tiny-llama", backend="sim-hang", status="timeout", duration_s=60.0,
        modes={"ops": ModeResult(status="timeout", reason="cell timed out after 60s during mode 'ops'"),
               "layers": ModeResult(status="timeout", reason="not run: the cell's time ran out")},
        error=CellError(type="timeout", message="cell timed out after 60s during mode 'ops'"))
    error = CellResult(id="tiny-llama@broken", model="tiny-llama", backend="broken", status="error", duration_s=0.5,
                       error=CellError(type="ImportError", message="backend setup failed: no module named 'broken'"))
    skipped = CellResult(id="tiny-vit@simdev", model="tiny-vit", backend="simdev", status="skipped")
    cells = [
        rf.passing_cell(dotted, "inductor"),
        rf.cell(dotted, "sim-subset", {"ops": rf.ops_mode("sim-subset"), "layers": rf.layers_mode(dotted, "sim-subset"),
                                       "numerics": rf.skipped_mode()}),
        rf.cell("tiny-llama", "sim-drift", {"ops": rf.ops_mode("sim-drift", ()),
                                            "layers": rf.layers_mode("tiny-llama", "sim-drift", failing=()),
                                            "numerics": rf.numerics_mode("tiny-llama", "sim-drift", diverge_at=7)}),
        crashed, timeout, error, skipped,
    ]
    return Results(cells=cells, tool_version="0.1.0")


def documented_counts(results: Results) -> dict[str, int]:
    """The documented mapping (docs/reports.md, junit.xml), computed straight from the results."""
    tests = failures = errors = skipped = 0
    for c in results.cells:
        modes = c.modes
        carried = c.error is not None and any(m.status in ("error", "timeout", "crashed") for m in modes.values())
        if c.error is not None and not carried:
            tests += 1
            errors += 1
        elif not modes:
            tests += 1
            skipped += c.status == "skipped"
            errors += c.status not in ("skipped", "pass")
        for m in modes.values():
            failures += len(m.findings)
            tests += len(m.findings)
            if m.status in ("error", "timeout", "crashed"):
                tests += 1
                errors += 1
            elif m.status == "skipped":
                tests += 1
                skipped += 1
            elif not m.findings:
                tests += 1
                failures += m.status == "fail"
    return {"tests": tests, "failures": failures, "errors": errors, "skipped": skipped}


def test_counts_agree_between_the_mapping_junitparser_and_the_summary(tmp_path: Path) -> None:
    junitparser = pytest.importorskip("junitparser")
    results = mixed_results()
    paths = write_reports(results, tmp_path, env={})
    root = check_junit(paths["junit"])
    want = documented_counts(results)
    assert want == {"tests": 21, "failures": 8, "errors": 4, "skipped": 2}
    xml = junitparser.JUnitXml.fromfile(str(paths["junit"]))
    seen = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in xml:
        for case in suite:
            seen["tests"] += 1
            for r in case.result:
                key = {junitparser.Failure: "failures", junitparser.Error: "errors", junitparser.Skipped: "skipped"}[type(r)]
                seen[key] += 1
    assert seen == want
    xml.update_statistics()  # what EnricoMi's publisher and junit2html recompute
    assert (xml.tests, xml.failures, xml.errors, xml.skipped) == (want["tests"], want["failures"], want["errors"], want["skipped"])
    for suite in xml:
        written = float(root.xpath("testsuite[@name=$n]", n=suite.name)[0].get("time"))
        suite.update_statistics()
        assert abs(suite.time - written) < 1e-6, suite.name
    assert junit_counts(build_view(results)) == want
    assert results.counts()["findings"] == want["failures"]  # each finding counted exactly once
    summary = paths["summary"].read_text()
    assert (f"junit.xml: {want['tests']} tests · {want['failures']} failures (one per finding) · {want['errors']} errors"
            in summary and f"· {want['skipped']} skipped" in summary)
    assert f"· {want['failures']} findings" in summary


def test_no_file_attribute_and_no_dot_from_an_id_in_a_classname(tmp_path: Path) -> None:
    results = mixed_results()
    root = check_junit(write_reports(results, tmp_path / "r", run_dir=tmp_path, env={})["junit"])
    for case in root.iter("testcase"):
        assert case.get("file") is None
        assert "." not in case.get("classname"), case.get("classname")
    crashed = root.xpath("testsuite[@name='qwen2.5-0.5b@sim-segv']")[0]
    # the crash is told once, on the mode it hit, not on an extra overlapping `cell` case
    assert [c.get("name") for c in crashed.findall("testcase")] == ["ops", "layers", "numerics"]
    err = crashed.find("testcase[@name='layers']/error")
    assert err.get("type") == "crashed" and "SIGSEGV" in err.get("message") and "Segmentation fault" in err.text
    timeout = root.xpath("testsuite[@name='tiny-llama@sim-hang']/testcase[@name='ops']/error")[0]
    assert timeout.get("message") == "cell timed out after 60s during mode 'ops'"  # no "ops timeout: " stutter


def test_every_shape_validates_against_jenkins_own_schema(tmp_path: Path) -> None:
    if not JENKINS_XSD_PATH.is_file():
        pytest.skip(f"{JENKINS_XSD_PATH.name} is not vendored in this checkout")
    from lxml import etree

    jenkins = schema(JENKINS_XSD_PATH)
    for i, results in enumerate([mixed_results(), rf.nasty_results(), rf.sample_results(), rf.empty_results()]):
        doc = etree.parse(str(write_reports(results, tmp_path / str(i), env={})["junit"]))
        assert jenkins.validate(doc), jenkins.error_log
    # and it is strict where our old output was wrong
    bad = etree.fromstring(b'<testsuites skipped="0"><testsuite name="s" tests="1" failures="0" errors="0">'
                           b'<testcase name="t" classname="c" file="x.py"/></testsuite></testsuites>')
    assert not jenkins.validate(bad)


def test_first_divergent_is_the_execution_order_everywhere(tmp_path: Path) -> None:
    results = Results(cells=[rf.cell("tiny-llama", "sim-drift", {
        "numerics": rf.numerics_mode("tiny-llama", "sim-drift", diverge_at=3)})])
    mode = results.cells[0].modes["numerics"]
    mode.findings.sort(key=lambda f: -f.metrics["cumulative"]["rel"])  # as the numerics mode lists them: worst first
    first = mode.data["verdict"]["first_divergent"]
    assert mode.findings[0].module != first
    paths = write_reports(results, tmp_path, env={})
    summary = paths["summary"].read_text()
    assert f"finding(s), first `{first}`" in summary and f"first divergent `{first}`" in summary
    page = paths["html"].read_text()
    assert f"first <code>{first}</code>" in page
    root = check_junit(paths["junit"])
    names = [c.get("name") for c in root.iter("testcase")]
    assert names[0] == f"numerics: divergence {first}"


def test_cos_thresholds_read_as_one_minus_cos(tmp_path: Path) -> None:
    assert cos_distance(0.9999999999418) == "5.82e-11"
    results = Results(cells=[rf.cell("tiny-llama", "sim-drift", {
        "numerics": rf.numerics_mode("tiny-llama", "sim-drift", diverge_at=3)})])
    for f in results.cells[0].findings:
        f.threshold["isolated"]["cos"] = 0.9999999999418
    paths = write_reports(results, tmp_path, env={})
    for text in (paths["summary"].read_text(), paths["html"].read_text(), paths["junit"].read_text()):
        assert "0.9999999999418" not in text and "5.82e-11" in text
    assert "1 − cos" in paths["summary"].read_text()


def test_repro_commands_run_from_the_cell_folder(tmp_path: Path) -> None:
    f = Finding(kind="op_error", stage="run", op="aten.add.Tensor", message="x", fingerprint=fingerprint("op_error", "b", "x"),
                repro=Repro(path="ops/repro_aten_add_Tensor.py", verified=True,
                            command="PYTHONPATH=/home/runner/work/proj/proj python repro_aten_add_Tensor.py"))
    assert repro_command(f) == "python ops/repro_aten_add_Tensor.py"  # an older run's machine path is left out
    rel = Finding(kind="op_error", stage="run", op="aten.add.Tensor", message="x", fingerprint=f.fingerprint,
                  repro=Repro(path="ops/repro_aten_add_Tensor.py", verified=True,
                              command="PYTHONPATH=../../../..:../plugins python repro_aten_add_Tensor.py"))
    assert repro_command(rel) == "PYTHONPATH=../../..:plugins python ops/repro_aten_add_Tensor.py"  # rebased on the cell
    cell = CellResult(id="m@b", model="m", backend="b", status="fail", artifacts_dir="cells/m@b",
                      modes={"ops": ModeResult(status="fail", findings=[f])})
    paths = write_reports(Results(cells=[cell]), tmp_path / "report", run_dir=tmp_path, env={})
    for p in paths.values():
        text = p.read_text()
        assert "/home/runner" not in text
        assert "python ops/repro_aten_add_Tensor.py" in text
    body = check_junit(paths["junit"]).find("testsuite/testcase/failure").text
    assert re.search(r"from the cell folder cells/m@b: python ops/", body) and "<your checkout>" not in body


def test_a_tensor_parallel_cell_says_so_in_every_report(tmp_path: Path) -> None:
    """A TP cell that passes (issue 45: nothing said TP in report.html, summary.md or junit.xml): its layout and what
    each mode's ranks concluded, in all three, and through results.json (written and read back)."""
    from ci_runner.results.model import load_results, save_results

    tp = rf.passing_cell("tiny-llama", "aot_eager")
    tp.parallel = "tp2"
    tp.modes["layers"].data["parallel"] = {"status": "pass", "tp": 2}
    one = rf.passing_cell("tiny-bert", "aot_eager")
    path = tmp_path / "results.json"
    save_results(Results(cells=[tp, one]), path)
    loaded = load_results(path)
    assert {c.model: c.parallel for c in loaded.cells} == {"tiny-llama": "tp2", "tiny-bert": None}
    written = write_reports(loaded, tmp_path / "report", env={})
    summary = written["summary"].read_text(encoding="utf-8")
    assert "tp2 (layers pass)" in summary and summary.count("tp2") == summary.count("tp2 (layers pass)")
    html = written["html"].read_text(encoding="utf-8")
    assert 'title="tensor parallel: the layout and each mode' in html and "tp2 (layers pass)" in html
    junit = written["junit"].read_text(encoding="utf-8")
    assert '<property name="parallel" value="tp2 (layers pass)"' in junit and junit.count('name="parallel"') == 1
    check_junit(written["junit"])
