"""junit.xml: valid against the JUnit XSD in every shape, readable by junitparser, faithful to the results."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci_runner.report import write_reports
from ci_runner.report.junit import render_junit, xml_safe
from ci_runner.results.model import CellError, CellResult, Finding, ModeResult, Repro, Results, fingerprint
from tests.fixtures import results_factory as rf
from tests.fixtures.junit import check_junit

SHAPES = {
    "sample": rf.sample_results,
    "sample-run-b": lambda: rf.sample_results(run="b"),
    "nasty": rf.nasty_results,
    "empty": rf.empty_results,
    "example": rf.example_results,
    "crashed-only": lambda: Results(cells=[rf.crashed_cell("tiny", "sim-segv")]),
    "big": lambda: rf.big_results(6, 30),
    "no-modes": lambda: Results(cells=[
        CellResult(id="a@b", model="a", backend="b", status="skipped"),
        CellResult(id="c@d", model="c", backend="d", status="timeout"),
        CellResult(id="e@f", model="e", backend="f", status="pass"),
    ]),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("with_run_dir", [False, True])
def test_every_shape_validates_against_the_xsd(shape: str, with_run_dir: bool, tmp_path: Path) -> None:
    run = tmp_path / "run"
    paths = write_reports(SHAPES[shape](), run / "report", run_dir=run if with_run_dir else None, env={})
    check_junit(paths["junit"])


def test_empty_run_is_a_valid_empty_testsuites() -> None:
    root = check_junit(render_junit(rf.empty_results()))
    assert root.tag == "testsuites" and root.get("tests") == "0" and len(root) == 0


def test_the_xsd_rejects_what_readers_choke_on() -> None:
    """The schema is not a rubber stamp: it refuses missing counts, two outcomes, bad times."""
    bad = [
        b'<testsuites><testsuite name="s" tests="1" failures="0"><testcase name="t" classname="c" time="0"/></testsuite></testsuites>',
        b'<testsuites><testsuite name="s" tests="1" failures="1" errors="1"><testcase name="t" classname="c" time="0">'
        b"<failure/><error/></testcase></testsuite></testsuites>",
        b'<testsuites><testsuite name="s" tests="1" failures="0" errors="0"><testcase name="t" classname="c" time="1,5"/></testsuite></testsuites>',
        b'<testsuites><testsuite name="s" tests="1" failures="0" errors="0"><testcase name="t" time="0"/></testsuite></testsuites>',
        b'<testsuite name="s" tests="0" failures="0" errors="0"/>',
    ]
    for doc in bad:
        with pytest.raises(AssertionError):
            check_junit(doc)


def test_counts_that_lie_are_caught() -> None:
    doc = (b'<testsuites tests="1" failures="0" errors="0"><testsuite name="s" tests="1" failures="0" errors="0">'
           b'<testcase name="t" classname="c" time="0"><failure message="x"/></testcase></testsuite></testsuites>')
    with pytest.raises(AssertionError, match="failures"):
        check_junit(doc)


def test_suite_per_cell_with_properties(tmp_path: Path) -> None:
    results = rf.sample_results()
    root = check_junit(render_junit(results))
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {c.id for c in results.cells}
    props = {p.get("name"): p.get("value") for p in suites["tiny-llama@sim-subset"].find("properties")}
    assert props["model"] == "tiny-llama" and props["backend"] == "sim-subset"
    assert props["env.torch"] == "2.13.0+cpu" and props["env.transformers"] == "5.24.0"
    assert props["device"] == "cpu" and props["env.backend_version"] == "0.4.1"
    assert suites["tiny-llama@sim-subset"].get("timestamp") == "2031-03-04T02:00:00+00:00"


def test_one_case_per_finding_and_per_mode_without_findings() -> None:
    results = rf.sample_results()
    root = check_junit(render_junit(results))
    suite = next(s for s in root.findall("testsuite") if s.get("name") == "tiny-llama@sim-subset")
    cases = {(c.get("classname"), c.get("name")): c for c in suite.findall("testcase")}
    cls = "tiny-llama@sim-subset"
    assert [n for _, n in cases] == [
        "ops: unsupported_op aten.constant_pad_nd.default",
        "ops: unsupported_op aten._scaled_dot_product_flash_attention.default",
        "ops: unsupported_op aten.cumsum.default",
        "layers: layer_failure model.layers.0.self_attn",
        "numerics",
    ]  # execution order; the failing modes have no case of their own: each finding counts once
    skipped = cases[(cls, "numerics")].find("skipped")
    assert skipped is not None and "layers failed" in skipped.get("message")
    op = cases[(cls, "ops: unsupported_op aten.cumsum.default")]
    fail = op.find("failure")
    assert fail.get("message").startswith("backend='sim-subset' raised: NotImplementedError: sim-subset: operator aten.cumsum.default")
    assert fail.get("type") == "BackendCompilerFailed"
    assert "repro: cells/tiny-llama@sim-subset/repro/op_002_aten_cumsum_default.py (verified)" in fail.text
    assert "from the cell folder cells/tiny-llama@sim-subset: python repro/op_002_aten_cumsum_default.py" in fail.text
    assert all(c.get("file") is None for c in root.iter("testcase"))
    drift = next(s for s in root.findall("testsuite") if s.get("name") == "tiny-llama@sim-drift")
    layer = next(c for c in drift.findall("testcase") if c.get("name") == "numerics: divergence model.layers.1.post_attention_layernorm")
    assert "isolated: rel 0.04 (threshold 0.002) · 1 − cos 0.0008 (threshold 0.0005)" in layer.find("failure").text
    assert "first divergent layer" in layer.find("system-out").text  # the verdict, on the mode's first case
    passing = next(s for s in root.findall("testsuite") if s.get("name") == "tiny-llama@inductor")
    assert passing.get("failures") == "0" and passing.get("errors") == "0" and int(passing.get("tests")) == 3
    assert root.get("failures") == str(sum(len(c.findings) for c in results.cells))


def test_dotted_ids_never_make_packages() -> None:
    """Jenkins splits a classname at its last dot: a dot from a model or backend id must not reach it."""
    f = rf.unsupported_op("sim.v2", "aten.cumsum.default")
    cell = CellResult(id="qwen2.5-0.5b@sim.v2", model="qwen2.5-0.5b", backend="sim.v2", status="fail",
                      modes={"ops": ModeResult(status="fail", findings=[f])})
    root = check_junit(render_junit(Results(cells=[cell])))
    assert {c.get("classname") for c in root.iter("testcase")} == {"qwen2·5-0·5b@sim·v2"}
    assert root.find("testsuite").get("name") == "qwen2.5-0.5b@sim.v2"


def test_repro_paths_are_in_the_body_never_a_file_attribute(tmp_path: Path) -> None:
    run = tmp_path / "run"
    results = rf.sample_results()
    for c in results.cells:
        for f in c.findings:
            if f.repro:
                p = run / (c.artifacts_dir or "") / f.repro.path
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text("# repro\n")
    paths = write_reports(results, run / "report", run_dir=run, env={})
    root = check_junit(paths["junit"])
    assert not [c for c in root.iter("testcase") if c.get("file") is not None]
    import re

    repros = [m for e in root.iter("failure") for m in re.findall(r"^repro: (\S+)", e.text or "", re.M)]
    assert len(repros) == sum(1 for c in results.cells for f in c.findings if f.repro)
    for r in repros:
        assert r.startswith("../cells/") and (paths["junit"].parent / r).is_file(), r


def test_crashed_cell_is_an_error_with_the_stderr_tail() -> None:
    root = check_junit(render_junit(Results(cells=[rf.crashed_cell("tiny", "sim-segv")])))
    case = next(c for c in root.iter("testcase") if c.get("name") == "cell")  # no mode carries the crash
    err = case.find("error")
    assert err.get("type") == "Crashed" and "SIGSEGV" in err.get("message")
    assert "last module entered: model.layers.1.mlp" in err.text and "Segmentation fault" in err.text
    assert root.get("errors") == "1"


def test_characters_illegal_in_xml_survive_as_visible_escapes() -> None:
    root = check_junit(render_junit(rf.nasty_results()))
    fail = next(c for c in root.iter("testcase") if c.get("name", "").startswith("ops: op_error")).find("failure")
    assert "\\x00\\x01\\x08\\x0b\\x0c\\x1b[31m" in fail.text
    assert "\\ud800" in fail.text and "\\ufffe" in fail.text
    assert '<b>&amp;</b> "q"' in fail.text and "]]>" in fail.text  # markup-like text kept literally
    assert fail.get("type") == "RuntimeError\\x1b"
    suite = next(s for s in root.findall("testsuite") if s.get("name") == "m&<x>@sim-crash")
    weird = next(p for p in suite.find("properties") if p.get("name") == "env.weird").get("value")
    assert "a:b\r\nnext" in weird  # attribute newlines are escaped, so they round-trip


def test_xml_safe_leaves_legal_text_alone() -> None:
    text = "tab\tnl\ncr\r ünïcødé 😀 \x7f \ue000 \U0010fff0"
    assert xml_safe(text) == text
    assert xml_safe("\x00\x1f\ud83d\uffff") == "\\x00\\x1f\\ud83d\\uffff"


def test_same_named_findings_get_distinct_cases() -> None:
    f = [Finding(kind="op_error", stage="run", op="aten.add.Tensor", message=f"sig {i}",
                 fingerprint=fingerprint("op_error", "b", "aten.add.Tensor", str(i))) for i in range(3)]
    cell = CellResult(id="m@b", model="m", backend="b", status="fail", modes={"ops": ModeResult(status="fail", findings=f)})
    root = check_junit(render_junit(Results(cells=[cell])))
    names = [c.get("name") for c in root.iter("testcase")]
    assert names == ["ops: op_error aten.add.Tensor", "ops: op_error aten.add.Tensor #2", "ops: op_error aten.add.Tensor #3"]


def test_huge_messages_are_clipped_in_the_attribute_but_kept_in_the_body() -> None:
    msg = "x" * 5000
    f = Finding(kind="op_error", stage="run", op="aten.x", message=msg, fingerprint="ab" * 10,
                repro=Repro(path="r.py", verified=True))
    cell = CellResult(id="m@b", model="m", backend="b", status="fail", modes={"ops": ModeResult(status="fail", findings=[f])})
    root = check_junit(render_junit(Results(cells=[cell])))
    fail = next(c for c in root.iter("testcase") if c.get("name") == "ops: op_error aten.x").find("failure")
    assert len(fail.get("message")) <= 1000
    assert msg in fail.text


def test_junitparser_reads_it_like_the_github_reporters(tmp_path: Path) -> None:
    """EnricoMi/publish-unit-test-result-action parses with junitparser; check what it sees."""
    junitparser = pytest.importorskip("junitparser")
    results = rf.sample_results()
    path = write_reports(results, tmp_path, env={})["junit"]
    xml = junitparser.JUnitXml.fromfile(str(path))
    suites = {s.name: s for s in xml}
    assert set(suites) == {c.id for c in results.cells}
    total_fail = sum(1 for s in xml for case in s for r in case.result if isinstance(r, junitparser.Failure))
    total_err = sum(1 for s in xml for case in s for r in case.result if isinstance(r, junitparser.Error))
    root = check_junit(path)
    assert total_fail == int(root.get("failures")) and total_err == int(root.get("errors"))
    case = next(c for c in suites["tiny-llama@sim-subset"] if c.name == "ops: unsupported_op aten.cumsum.default")
    assert not case.is_passed and "not supported" in case.result[0].message
    assert case.classname == "tiny-llama@sim-subset"
    assert suites["tiny-llama@inductor"].failures == 0


def test_any_text_at_all_gives_valid_junit_and_safe_reports() -> None:
    """Property: whatever characters a backend puts in messages, names and env, the reports stay valid."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from ci_runner.report.html import render_html
    from ci_runner.report.summary import render_summary

    anything = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=60)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(message=anything, op=anything, module=anything, reason=anything, env=anything, stderr=anything)
    def check(message: str, op: str, module: str, reason: str, env: str, stderr: str) -> None:
        f = Finding(kind="op_error", stage="run", op=op or None, module=module or None, message=message,
                    error_type=env, fingerprint="ab" * 10, repro=Repro(path=op or "r.py", verified=False),
                    metrics={"rel": 0.5, env: message})
        cell = CellResult(id="m@b", model="m", backend="b", status="crashed", env={"device": env, env: reason},
                          modes={"ops": ModeResult(status="fail", findings=[f, f]),
                                 "layers": ModeResult(status="skipped", reason=reason)},
                          error=CellError(type=env or "X", message=message, stderr_tail=stderr, last_module=module))
        results = Results(cells=[cell])
        check_junit(render_junit(results))
        for text in (render_summary(results), render_html(results)):
            text.encode("utf-8")  # no lone surrogates
            assert xml_safe(text) == text  # no character XML (or a browser) would choke on

    check()
