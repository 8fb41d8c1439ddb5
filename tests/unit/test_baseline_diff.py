"""`deepview-ci diff`: every category, fingerprint stability, policies, diff.json, markdown, annotations."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ci_runner.results.baseline import (
    CATEGORIES,
    Baseline,
    Diff,
    annotate_regressions,
    diff,
    load_baseline,
    make_baseline,
    render_diff_markdown,
    update_baseline,
    write_diff,
)
from ci_runner.errors import EXIT_FINDINGS, UsageError
from ci_runner.github.actions import AnnotationCap
from ci_runner.results.model import Results, load_results, save_results, validate
from tests.fixtures import results_factory as rf


def base_of(results: Results) -> Baseline:
    return Baseline.from_dict(make_baseline(results))


def entries(d: Diff, category: str) -> list:
    return d.by_category(category)


def test_fingerprints_stable_across_runs_on_different_paths_and_machines(tmp_path: Path) -> None:
    """Run A on one machine, run B on another, in other folders: nothing but `persisting`."""
    a_dir = tmp_path / "home" / "runner" / "work" / "out-a"
    b_dir = tmp_path / "srv" / "ci" / "builds" / "9931"
    ra, rb = rf.example_results(run="a"), rf.example_results(run="b")
    assert ra.cells[0].env["hostname"] != rb.cells[0].env["hostname"]
    msgs_a = {f.message for c in ra.cells for f in c.findings}
    msgs_b = {f.message for c in rb.cells for f in c.findings}
    assert msgs_a.isdisjoint(msgs_b)  # addresses and absolute paths differ in every message
    pa = save_results(ra, a_dir / "report" / "results.json")
    pb = save_results(rb, b_dir / "report" / "results.json")
    baseline = update_baseline(pa, tmp_path / "repo" / "ci" / "baseline.json")
    d = diff(load_results(pb), load_baseline(baseline), results_path=pb, baseline_path=baseline, run_dir=b_dir)
    n = d.counts()
    assert n["persisting"] == sum(len(c.findings) for c in rb.cells) > 0
    assert {k: v for k, v in n.items() if k != "persisting"} == {k: 0 for k in CATEGORIES if k != "persisting"}
    assert d.exit_code("change") == 0
    # and the fingerprints are exactly those a fresh baseline of run B would hold
    assert make_baseline(rb) == load_baseline(baseline).to_dict()


def test_regressed_new_finding() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    ops = now.cell("tiny-llama@inductor").modes["ops"]
    ops.findings = [rf.unsupported_op("inductor", "aten.new_op.default", run="b")]
    ops.status = "fail"
    now.cell("tiny-llama@inductor").status = "fail"
    d = diff(now, base_of(base))
    [e] = entries(d, "regressed")
    assert e.cell == "tiny-llama@inductor" and e.fingerprint == ops.findings[0].fingerprint
    assert e.reason == "new finding" and e.finding["op"] == "aten.new_op.default"
    assert e.status == "fail" and e.baseline_status == "pass" and e.artifacts_dir == "cells/tiny-llama@inductor"
    assert e.env["hostname"] == "gpu-box-17" and e.mode == "ops" and e.kind == "unsupported_op"
    assert d.exit_code("regression") == EXIT_FINDINGS


def test_regressed_cell_without_new_fingerprints() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    now.cells[3] = rf.crashed_cell("tiny-llama", "inductor", run="b")
    d = diff(now, base_of(base))
    [e] = entries(d, "regressed")
    assert e.fingerprint is None and e.finding is None
    assert (e.baseline_status, e.status) == ("pass", "crashed") and "status pass → crashed" in e.reason
    # the numerics/layers findings it had (none) are not claimed fixed
    assert not entries(d, "fixed")


def test_regressed_mode_in_a_cell_whose_status_did_not_change() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    drift = now.cell("tiny-llama@sim-drift")
    drift.modes["layers"].status = "error"
    drift.modes["layers"].reason = "compile raised"
    assert drift.status == "fail"
    d = diff(now, base_of(base))
    [e] = entries(d, "regressed")
    assert e.fingerprint is None and e.reason == "mode layers: pass → error"


def test_new_findings_of_one_mode_do_not_hide_another_mode_getting_worse() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    cell = now.cell("tiny-llama@inductor")
    cell.modes["ops"].findings = [rf.unsupported_op("inductor", "aten.x.default", run="b")]
    cell.modes["ops"].status = "fail"
    cell.modes["numerics"].status = "timeout"
    cell.status = "timeout"
    d = diff(now, base_of(base))
    regs = entries(d, "regressed")
    assert [e.fingerprint is None for e in regs] == [True, False]  # cell-level first, then the finding
    assert "mode numerics: pass → timeout" in regs[0].reason


def test_fixed_finding_and_fixed_cell() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    ops = now.cell("tiny-bamba@sim-subset").modes["ops"]
    gone = ops.findings.pop(0)
    now.cells[2] = rf.passing_cell("tiny-llama", "sim-segv", run="b")  # was crashed
    d = diff(now, base_of(base))
    fixed = entries(d, "fixed")
    assert [(e.cell, e.fingerprint) for e in fixed] == [("tiny-bamba@sim-subset", gone.fingerprint),
                                                          ("tiny-llama@sim-segv", None)]
    assert fixed[0].finding is None and fixed[0].kind == "unsupported_op" and fixed[0].key == gone.op
    assert fixed[1].reason.startswith("status crashed → pass")
    assert d.exit_code("regression") == 0 and d.exit_code("change") == EXIT_FINDINGS and d.exit_code("never") == 0


def test_findings_of_a_mode_that_did_not_reach_a_verdict_are_not_fixed() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    cell = now.cell("tiny-llama@sim-subset")
    cell.modes["layers"].status = "skipped"
    cell.modes["layers"].findings = []
    cell.modes["layers"].reason = "disabled"
    d = diff(now, base_of(base))
    assert not entries(d, "fixed")
    [e] = [e for e in entries(d, "persisting") if e.kind == "layer_failure"]
    assert e.reason == "not re-checked: mode layers skipped in this run" and e.finding is None


def test_persisting() -> None:
    d = diff(rf.sample_results(run="b"), base_of(rf.sample_results()))
    assert d.counts() == {"regressed": 0, "fixed": 0, "persisting": 10, "flaky": 0, "new_cell": 0, "missing_cell": 0}
    assert all(e.finding is not None and e.reason == "in the baseline" for e in d.entries)
    assert d.exit_code("regression") == d.exit_code("change") == 0


def test_flaky_from_the_baseline_mark() -> None:
    base_res = rf.sample_results()
    data = make_baseline(base_res)
    target = next(f for f in data["findings"] if f["cell"] == "tiny-bamba@sim-subset")
    target["flaky"] = True
    now = rf.sample_results(run="b")
    # present → flaky (not persisting); then absent → flaky (not fixed)
    d1 = diff(now, Baseline.from_dict(data))
    assert [e.fingerprint for e in entries(d1, "flaky")] == [target["fingerprint"]]
    ops = now.cell("tiny-bamba@sim-subset").modes["ops"]
    ops.findings = [f for f in ops.findings if f.fingerprint != target["fingerprint"]]
    d2 = diff(now, Baseline.from_dict(data))
    assert [e.reason for e in entries(d2, "flaky")] == ["gone this run; marked flaky"]
    assert not entries(d2, "fixed") and d2.exit_code("change") == 0


def test_flaky_from_reruns_that_disagree() -> None:
    base = base_of(rf.sample_results())
    now = rf.sample_results(run="b")
    cell = now.cell("tiny-llama@inductor")
    cell.modes["ops"].findings = [rf.unsupported_op("inductor", "aten.sometimes.default", run="b")]
    cell.modes["ops"].status = cell.status = "fail"
    cell.env["attempts"] = ["pass", "fail"]
    d = diff(now, base)
    flaky = entries(d, "flaky")
    assert {e.fingerprint is None for e in flaky} == {True, False}  # the finding and the status change
    assert not entries(d, "regressed") and d.exit_code("regression") == 0 and d.exit_code("change") == 0


def test_flaky_finding_from_attempt_fingerprints() -> None:
    base = base_of(rf.sample_results())
    now = rf.sample_results(run="b")
    cell = now.cell("tiny-llama@inductor")
    new = rf.unsupported_op("inductor", "aten.racy.default", run="b")
    cell.modes["ops"].findings = [new]
    cell.modes["ops"].status = cell.status = "fail"
    cell.env["attempts"] = [{"status": "fail", "fingerprints": [new.fingerprint]}, {"status": "fail", "fingerprints": []}]
    # statuses agree, so the cell is not flaky; the finding is, since one attempt lacked it
    d = diff(now, base)
    [e] = entries(d, "flaky")
    assert e.fingerprint == new.fingerprint and "not every rerun" in e.reason
    # the same finding without the attempts record is a regression
    del cell.env["attempts"]
    assert [e.fingerprint for e in entries(diff(now, base), "regressed")] == [new.fingerprint]


def test_new_cell_and_missing_cell() -> None:
    base_res = rf.sample_results()
    now = rf.sample_results(run="b")
    dropped = now.cells.pop(0)  # tiny-llama@sim-subset
    added = rf.cell("tiny-vit", "sim-subset", {"ops": rf.ops_mode("sim-subset", run="b")}, run="b")
    now.cells.append(added)
    d = diff(now, base_of(base_res))
    new = entries(d, "new_cell")
    assert new[0].fingerprint is None and new[0].baseline_status is None and new[0].status == "fail"
    assert [e.fingerprint for e in new[1:]] == sorted(f.fingerprint for f in added.findings)
    assert all(e.finding is not None for e in new[1:])
    [miss] = entries(d, "missing_cell")
    assert miss.cell == dropped.id and miss.status is None and miss.env == {} and "4 finding(s)" in miss.reason
    assert not entries(d, "fixed")  # a cell that did not run fixed nothing
    assert d.exit_code("regression") == 0 and d.exit_code("change") == EXIT_FINDINGS


def test_entries_sorted_by_category_cell_fingerprint() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    now.cells.pop(0)
    now.cells[2] = rf.crashed_cell("tiny-llama", "inductor", run="b")
    now.cells.append(rf.cell("z", "b", {"ops": rf.ops_mode("b")}))
    ops = now.cell("tiny-bamba@sim-subset").modes["ops"]
    ops.findings.append(rf.unsupported_op("sim-subset", "aten.zz.default", run="b"))
    d = diff(now, base_of(base))
    keys = [(CATEGORIES.index(e.category), e.cell, e.fingerprint or "") for e in d.entries]
    assert keys == sorted(keys)
    assert {e.category for e in d.entries} == {"regressed", "persisting", "new_cell", "missing_cell"}


def test_policy_is_checked() -> None:
    d = diff(rf.sample_results(), base_of(rf.sample_results()))
    with pytest.raises(UsageError, match="--fail-on 'sometimes'"):
        d.exit_code("sometimes")
    with pytest.raises(UsageError):
        diff(rf.sample_results(), base_of(rf.sample_results()), policy="bogus")


def test_diff_json_matches_the_contract_and_schema(tmp_path: Path) -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    now.cells[3] = rf.crashed_cell("tiny-llama", "inductor", run="b")
    now.cells.append(rf.cell("new", "b", {"ops": rf.ops_mode("b")}))
    now.cells.pop(0)
    d = diff(now, base_of(base), results_path=tmp_path / "results.json", baseline_path="ci/baseline.json",
             run_dir=tmp_path, policy="change")
    j, m = write_diff(d, tmp_path / "out", env={})
    data = json.loads(j.read_text())
    validate(data, "diff.schema.json", source=str(j))
    assert data["policy"] == "change" and data["baseline"] == "ci/baseline.json" and data["run_dir"] == str(tmp_path)
    assert data["counts"] == d.counts() and len(data["entries"]) == len(d.entries)
    for e in data["entries"]:
        assert set(e) >= {"category", "cell", "model", "backend", "fingerprint", "finding", "status",
                          "baseline_status", "artifacts_dir", "env", "reason"}
    reg = next(e for e in data["entries"] if e["category"] == "regressed")
    assert reg["fingerprint"] is None and reg["baseline_status"] == "pass" and reg["status"] == "crashed"
    assert m.read_text().startswith("### 🔴 Baseline diff: 1 regressed")


def test_schema_rejects_a_broken_diff() -> None:
    from ci_runner.errors import InputError

    bad = {"schema_version": 1, "policy": "regression", "results": None, "baseline": None, "run_dir": None,
           "counts": {c: 0 for c in CATEGORIES}, "entries": [{"category": "worse"}]}
    with pytest.raises(InputError, match="diff.schema.json"):
        validate(bad, "diff.schema.json", source="diff.json")


def test_markdown_section_lists_regressions_first_and_folds_persisting() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    now.cells[3] = rf.crashed_cell("tiny-llama", "inductor", run="b")
    md = render_diff_markdown(diff(now, base_of(base)))
    assert md.index("#### 🔴 Regressed (1)") < md.index("<details><summary>Persisting (10)</summary>")
    assert md.count("<details>") == md.count("</details>") == 1
    assert "policy `--fail-on regression`: **fails**" in md


def test_write_diff_appends_to_the_step_summary(tmp_path: Path) -> None:
    step = tmp_path / "step"
    d = diff(rf.sample_results(run="b"), base_of(rf.sample_results()))
    _, m = write_diff(d, tmp_path, env={"GITHUB_STEP_SUMMARY": str(step)})
    assert step.read_text() == m.read_text()


def _many_regressions(n: int) -> Diff:
    base = Results(cells=[rf.passing_cell("m", "b")])
    now = Results(cells=[rf.passing_cell("m", "b", run="b")])
    ops = now.cells[0].modes["ops"]
    ops.findings = [rf.unsupported_op("b", f"aten.op{i:02d}.default", run="b", idx=i) for i in range(n)]
    ops.status = now.cells[0].status = "fail"
    return diff(now, base_of(base))


def test_annotations_under_actions_are_capped_at_ten_with_an_overflow_note() -> None:
    d = _many_regressions(25)
    buf = io.StringIO()
    n = annotate_regressions(d, env={"GITHUB_ACTIONS": "true"}, stream=buf)
    lines = buf.getvalue().splitlines()
    assert n == 10 == len(lines)
    assert all(ln.startswith("::error title=deepview-ci regression in m@b::") for ln in lines[:9])
    assert lines[9] == ("::error title=deepview-ci%3A more regressions::16 more regressions against the baseline "
                        "(of 25): see the step summary and diff.json")
    assert "%0A" in lines[0] and "\n" not in lines[0]  # message lines escaped
    import re

    for ln in lines[:9]:
        op = re.search(r"aten\.op(\d\d)\.default — new finding", ln).group(1)
        assert f"%0Arepro: cells/m@b/repro/op_0{op}_aten_op{op}_default.py" in ln


def test_annotations_fit_exactly_when_there_are_ten_or_fewer() -> None:
    buf = io.StringIO()
    assert annotate_regressions(_many_regressions(10), env={"GITHUB_ACTIONS": "true"}, stream=buf) == 10
    assert "more regressions" not in buf.getvalue()


def test_annotations_respect_an_already_used_cap_and_stay_off_outside_actions() -> None:
    d = _many_regressions(3)
    buf = io.StringIO()
    assert annotate_regressions(d, env={}, stream=buf) == 0 and buf.getvalue() == ""
    cap = AnnotationCap()
    for _ in range(9):
        cap.allow("error")
    assert annotate_regressions(d, env={"GITHUB_ACTIONS": "true"}, stream=buf, cap=cap) == 1
    assert "3 more regressions" in buf.getvalue()


def test_fast_finding_to_dict_equals_the_deep_copy() -> None:
    from dataclasses import asdict

    from ci_runner.results.model import clean

    for results in (rf.sample_results(), rf.nasty_results(), rf.example_results()):
        for c in results.cells:
            for f in c.findings:
                deep = clean(asdict(f))
                for unset in ("phase", "step", "parallel"):  # the single forward (one rank) leaves them out, as before
                    if deep.get(unset) is None:
                        deep.pop(unset)
                assert f.to_dict() == deep


def test_a_crash_is_reported_even_when_new_findings_came_with_it() -> None:
    base = rf.sample_results()
    now = rf.sample_results(run="b")
    cell = now.cell("tiny-llama@inductor")
    cell.modes = {"ops": rf.ops_mode("inductor", ("aten.x.default",), run="b")}  # ops found one, then the process died
    cell.status = "crashed"
    d = diff(now, base_of(base))
    regs = entries(d, "regressed")
    assert [e.fingerprint is None for e in regs] == [True, False]
    assert regs[0].reason == "status pass → crashed"
    # while a move to plain "fail" is explained by its new findings alone
    cell.status = "fail"
    assert [e.fingerprint is None for e in entries(diff(now, base_of(base)), "regressed")] == [False]
