"""summary.md: order, content, escaping, and the 1 MiB cap."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ci_runner.results.baseline import Baseline, diff, make_baseline
from ci_runner.report import write_reports
from ci_runner.report.summary import SUMMARY_LIMIT, block, code, md, render_summary, truncate_markdown
from ci_runner.results.model import CellResult, Finding, ModeResult, Results
from tests.fixtures import results_factory as rf


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the Markdown table whose header line starts with `header_start`."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    ncols = len(split_row(lines[i]))
    rows = []
    for ln in lines[i + 2 :]:
        if not ln.startswith("|"):
            break
        cells = split_row(ln)
        assert len(cells) == ncols, f"row has {len(cells)} cells, header {ncols}: {ln}"
        rows.append(cells)
    return rows


def split_row(line: str) -> list[str]:
    """Split a GFM table row on pipes that are not escaped and not inside code spans."""
    cells, cur, i, in_code = [], "", 0, ""
    body = line.strip()[1:-1]
    while i < len(body):
        ch = body[i]
        if ch == "\\" and i + 1 < len(body):
            cur += body[i : i + 2]
            i += 2
            continue
        if ch == "`":
            run = re.match(r"`+", body[i:]).group()
            if not in_code:
                in_code = run
            elif run == in_code:
                in_code = ""
            cur += run
            i += len(run)
            continue
        if ch == "|" and not in_code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
        i += 1
    cells.append(cur.strip())
    return cells


def test_sections_in_order_failures_first() -> None:
    text = render_summary(rf.sample_results())
    order = ["## deepview-ci", "### Failing cells", "### Cells × modes", "### Operators blocking models",
             "### Failing submodules", "### Divergent layers", "### Details"]
    pos = [text.index(h) for h in order]
    assert pos == sorted(pos)
    assert "❌ 4 of 5 cells failing" in text


def test_regressions_lead_when_a_diff_is_given() -> None:
    base = Baseline.from_dict(make_baseline(rf.sample_results()))
    now = rf.sample_results(run="b")
    now.cells[3] = rf.crashed_cell("tiny-llama", "inductor", run="b")
    text = render_summary(now, diff=diff(now, base))
    assert text.index("Regressions against the baseline: 1") < text.index("### Failing cells")
    rows = table_rows(text, "| cell | what | reason |")
    assert rows == [["`tiny-llama@inductor`", "cell pass → crashed", "status pass → crashed"]]


def test_cells_by_modes_table_icons() -> None:
    rows = {r[0]: r for r in table_rows(render_summary(rf.sample_results()), "| cell | status |")}
    assert rows["`tiny-llama@sim-subset`"][1:5] == ["❌ fail", "❌", "❌", "➖ skipped"]
    assert rows["`tiny-llama@inductor`"][1:5] == ["✅ pass", "✅", "✅", "✅"]
    assert rows["`tiny-llama@sim-segv`"][1:5] == ["⚠️ crashed", "✅", "·", "·"]
    assert rows["`tiny-llama@sim-drift`"][5] == "4"
    assert list(rows)[0] == "`tiny-llama@sim-segv`"  # worst first


def test_ranking_submodules_and_divergent_layers() -> None:
    text = render_summary(rf.sample_results())
    ranking = table_rows(text, "| # | operator |")
    assert ranking[0][1:3] == ["`aten.constant_pad_nd.default`", "2"]
    subs = table_rows(text, "| cell | submodule |")
    assert subs[0][1] == "`model.layers.0.self_attn`" and "repro.py`" in subs[0][4]
    div = table_rows(text, "| cell | layer |")
    assert "Metrics are the isolated view's" in text
    first = div[0]
    assert first[1] == "`model.layers.1.post_attention_layernorm`" and first[3] == "both"  # isolated metrics shown
    assert first[4:6] == ["0.04", "0.002"]
    assert any(r[1] == "`lm_head`" and r[4] == "NaN" for r in div)
    assert "first divergent `model.layers.1.post_attention_layernorm` · **algorithmic**" in text


def test_details_are_folded_and_balanced() -> None:
    text = render_summary(rf.sample_results())
    assert text.count("<details>") == text.count("</details>") == 4  # the failing cells
    assert "Segmentation fault" in text.split("<details>", 2)[1]


def test_absent_tables_do_not_crash_and_are_not_rendered() -> None:
    cell = rf.cell("m", "b", {"numerics": ModeResult(status="fail", data={"layers": "oops", "verdict": None})})
    cell2 = rf.cell("m", "c", {"numerics": ModeResult(status="pass", data={"layers": [1, None, {"name": "x"}]})})
    text = render_summary(Results(cells=[cell, cell2], ranking=[]))
    assert "Operators blocking models" not in text and "Divergent layers" not in text
    assert render_summary(rf.empty_results()).startswith("## deepview-ci: no cells ran")


def test_nasty_text_cannot_break_the_markdown() -> None:
    text = render_summary(rf.nasty_results())
    # outside fenced blocks and code spans, raw tags from the results never appear
    outside = re.sub(r"(`{3,})text\n.*?\n\1", "", text, flags=re.S)
    outside = re.sub(r"(`+)[^`].*?\1", "", outside)
    assert "<b>" not in outside and "</details>\n" * 3 not in outside
    assert "\x00" not in text and "\ud800" not in text
    table_rows(text, "| cell | status |")  # column counts hold
    # the fence around a message containing ``` is longer than it
    assert "````text\nboom:" in text


def test_md_code_block_helpers() -> None:
    assert md("a|b <c> *d* _e_ [f](g)") == "a&#124;b &lt;c&gt; \\*d\\* \\_e\\_ \\[f\\](g)"
    assert md("x" * 400, 10) == "x" * 9 + "…"
    assert code("a`b") == "``a`b``" and code("`x`") == "`` `x` ``"
    assert block("```inner```").startswith("````\n")


def test_truncate_closes_fences_and_details() -> None:
    text = "# t\n\n<details><summary>s</summary>\n\n```text\n" + "line\n" * 5000 + "```\n\n</details>\n"
    out = truncate_markdown(text, 4000, pointer="see report.html")
    assert len(out.encode()) <= 4000
    assert out.count("```") % 2 == 0 and out.count("<details>") == out.count("</details>")
    assert out.rstrip().endswith("see report.html.")
    assert truncate_markdown("short", 4000) == "short"


def test_big_run_stays_under_the_cap_with_a_pointer() -> None:
    results = rf.big_results(200, 100)
    for c in results.cells:  # fatten the messages so the details overflow 1 MiB
        for f in c.findings:
            f.message += "\n" + "stack frame text " * 60
    text = render_summary(results)
    size = len(text.encode("utf-8"))
    assert size <= SUMMARY_LIMIT < 1024 * 1024
    assert "cut at" in text and "report.html" in text
    assert text.count("<details>") == text.count("</details>")
    assert re.findall(r"^`{3,}", text, flags=re.M).__len__() % 2 == 0
    assert text.index("### Cells × modes") < text.index("### Details")  # the tables survive the cut


def test_write_reports_appends_to_the_step_summary(tmp_path: Path) -> None:
    step = tmp_path / "step.md"
    step.write_text("earlier step output\n")
    paths = write_reports(rf.sample_results(), tmp_path / "r", env={"GITHUB_STEP_SUMMARY": str(step)})
    assert step.read_text() == "earlier step output\n" + paths["summary"].read_text()
    paths = write_reports(rf.sample_results(), tmp_path / "r2", env={})
    assert step.read_text().count("## deepview-ci") == 1


def test_markdown_renders_as_tables_and_details() -> None:
    """Rendered by a CommonMark+tables parser, the tables keep their shape."""
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(render_summary(rf.nasty_results()))
    assert html.count("<table>") == 2  # root causes, then cells × modes
    assert html.index("Root causes") < html.index("Cells × modes")
    assert "<b>&amp;</b>" not in html.replace("<code>", "").split("<pre>")[0]
    one_cell = CellResult(id="a@b", model="a", backend="b", status="fail", modes={"ops": ModeResult(
        status="fail", findings=[Finding(kind="op_error", stage="run", op="x|y", message="m|n", fingerprint="ab" * 10)])})
    html = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(render_summary(Results(cells=[one_cell])))
    assert "<th>cell</th>" in html


def test_every_finding_shows_the_fingerprint_bisect_commits_takes() -> None:
    results = rf.sample_results()
    text = render_summary(results)
    fingerprints = [f.fingerprint for c in results.cells for m in c.modes.values() for f in m.findings]
    assert fingerprints
    for fp in fingerprints:
        assert f"fingerprint `{fp}`" in text, fp


def test_the_header_says_all_pass_only_when_every_cell_passed() -> None:
    def one(status: str) -> Results:
        return Results(cells=[CellResult(id="m@b", model="m", backend="b", status=status,
                                         modes={"ops": ModeResult(status=status)})])

    assert "## deepview-ci: ✅ all 1 cells pass" in render_summary(one("pass"))
    assert "## deepview-ci: ⚠️ none failing, 0 of 1 cells pass" in render_summary(one("inconclusive"))
