"""report.html without a browser: content, charts as SVG, escaping, self-containment."""

from __future__ import annotations

import math
import re

from lxml import etree

from ci_runner.report.html import layer_chart, render_html
from ci_runner.report.view import LayerPoint, NumericsView, build_view
from ci_runner.results.model import ModeResult, Results
from tests.fixtures import results_factory as rf

SVG = "{http://www.w3.org/2000/svg}"


def charts(page: str) -> list[etree._Element]:
    return [etree.fromstring(m.encode()) for m in re.findall(r"<svg class=\"chart.*?</svg>", page, flags=re.S)]


def test_same_sections_as_the_summary() -> None:
    page = render_html(rf.sample_results())
    for section in ('id="failing"', 'id="matrix"', 'id="ranking"', 'id="submodules"', 'id="divergent"', 'id="cells-detail"'):
        assert section in page
    assert page.index('id="failing"') < page.index('id="matrix"')
    assert page.count('<article class="cell') == 5


def test_one_chart_per_metric_for_each_numerics_cell() -> None:
    results = rf.sample_results()
    svgs = charts(render_html(results))
    with_numerics = [c for c in results.cells if "numerics" in c.modes and c.modes["numerics"].data.get("layers")]
    assert len(svgs) == 3 * len(with_numerics)
    drift = [s for s in svgs if s.get("data-cell") == "tiny-llama@sim-drift"]
    assert [s.get("data-metric") for s in drift] == ["rel", "cos", "mad"]
    assert "hidden" not in drift[0].get("class") and all("hidden" in s.get("class") for s in drift[1:])
    rel = drift[0]
    layers = results.cell("tiny-llama@sim-drift").modes["numerics"].data["layers"]
    lines = {p.get("data-view"): p.get("points").split() for p in rel.iter(f"{SVG}polyline")}
    assert set(lines) == {"cumulative", "isolated"} and all(len(v) == len(layers) for v in lines.values())
    flags = [e for e in rel.iter() if "flag" in (e.get("class") or "").split()]
    assert len(flags) == sum(r["flagged_cumulative"] + r["flagged_isolated"] for r in layers)
    assert len([e for e in rel.iter(f"{SVG}line") if e.get("class") == "first"]) == 1
    assert len([e for e in rel.iter(f"{SVG}path") if e.get("class") == "nonfinite"]) == 1  # the NaN layer
    tips = [t.text for t in rel.iter(f"{SVG}title")]
    assert any("model.layers.1.post_attention_layernorm" in t and "flagged: cumulative, isolated" in t for t in tips)


def test_chart_positions_follow_the_values_on_a_log_scale() -> None:
    pts = [LayerPoint(name=f"l{i}", module_class="", index=i, cumulative={"rel": 10.0 ** -(6 - i)},
                      isolated={"rel": 1e-6}, threshold={"rel": 1e-3}, flagged_cumulative=i >= 4,
                      flagged_isolated=False) for i in range(6)]
    svg = etree.fromstring(layer_chart(NumericsView(layers=pts, verdict={}), "rel", cell_id="a@b", label="rel").encode())
    cum = next(p for p in svg.iter(f"{SVG}polyline") if p.get("data-view") == "cumulative")
    ys = [float(xy.split(",")[1]) for xy in cum.get("points").split()]
    steps = [ys[i] - ys[i + 1] for i in range(5)]
    assert all(s > 0 for s in steps) and max(steps) - min(steps) < 0.2  # equal decades, equal steps
    thr_y = float(re.search(r"M[\d.]+ ([\d.]+)H", svg.find(f"{SVG}path[@class='thr']").get("d")).group(1))
    assert ys[3] == thr_y  # 1e-3 sits on the threshold line
    assert len([e for e in svg.iter() if e.get("class") == "flag flag-cum"]) == 2


def test_chart_survives_zeros_nans_and_one_layer() -> None:
    for values in ([0.0], [float("nan")], [float("inf"), 0.0, 1e-9], []):
        pts = [LayerPoint(name=f"l{i}", module_class="", index=i, cumulative={"rel": v}, isolated={},
                          threshold={"rel": float("nan")}, flagged_cumulative=math.isnan(v), flagged_isolated=False)
               for i, v in enumerate(values)]
        svg = etree.fromstring(layer_chart(NumericsView(layers=pts, verdict={"first_divergent": "nope"}), "cos",
                                           cell_id="a@b", label="1 − cos").encode())
        assert svg.get("data-layers") == str(len(values))


def test_nasty_text_is_escaped_and_the_page_parses() -> None:
    page = render_html(rf.nasty_results())
    assert "<b>&amp;</b>" not in page and "&lt;b&gt;&amp;amp;&lt;/b&gt;" in page
    assert "\x00" not in page and "\x1b" not in page and "\\x1b" in page
    parser = etree.HTMLParser(recover=False)
    etree.fromstring(page.encode("utf-8", "surrogatepass"), parser)  # no surrogates, parses
    assert 'id="cell-m__x__sim-crash-' in page


def test_repro_paths_are_relative_to_the_report_folder(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    view = build_view(rf.sample_results(), out_dir=run / "report", run_dir=run)
    paths = [f.repro for cv in view.cells for f in cv.findings if f.repro]
    assert paths and all(p.startswith("../cells/") for p in paths)
    view = build_view(rf.sample_results())
    assert all(f.repro.startswith("cells/") for cv in view.cells for f in cv.findings if f.repro)


def test_no_numerics_no_charts_no_crash() -> None:
    results = Results(cells=[rf.cell("m", "b", {"numerics": ModeResult(status="error", reason="boom", data={})})])
    page = render_html(results)
    assert "<svg class=\"chart" not in page and "numerics error: boom" in page
    assert "No cells ran." in render_html(rf.empty_results())


def test_metric_views_flat_and_nested() -> None:
    from ci_runner.report.view import format_metrics, metric_views, primary_metrics
    from ci_runner.results.model import Finding

    flat = Finding(kind="divergence", stage="compare", message="m", fingerprint="ab" * 10,
                   metrics={"rel": 0.5, "cos": 0.9}, threshold={"rel": 0.1}, details={"view": "cumulative"})
    assert metric_views(flat) == [("cumulative", {"rel": 0.5, "cos": 0.9}, {"rel": 0.1})]
    assert format_metrics(flat) == "rel 0.5 (threshold 0.1) · 1 − cos 0.1"
    nested = Finding(kind="divergence", stage="compare", message="m", fingerprint="ab" * 10,
                     metrics={"cumulative": {"rel": 0.5}, "isolated": {"rel": "nan"}},
                     threshold={"cumulative": {"rel": 0.1}, "isolated": {"rel": 0.2}}, details={"view": "both"})
    assert primary_metrics(nested, "both") == ("isolated", {"rel": "nan"}, {"rel": 0.2})
    assert primary_metrics(nested, "cumulative")[0] == "cumulative"
    assert format_metrics(nested) == "cumulative: rel 0.5 (threshold 0.1); isolated: rel NaN (threshold 0.2)"
    odd = Finding(kind="op_mismatch", stage="compare", message="m", fingerprint="ab" * 10,
                  metrics={"max_abs": 0.01, "shape": [2, 3], "numel": 16})
    assert format_metrics(odd) == "max_abs 0.01 · numel 16"


def test_an_inconclusive_numerics_cell_says_how_many_layers_were_compared() -> None:
    """Issue 25: an IREE cell that compared 20 of 42 layers must not read "42 layers, 0 flagged"."""
    results = rf.sample_results()
    cell = results.cell("tiny-llama@sim-drift")
    mode = cell.modes["numerics"]
    n = len(mode.data["layers"])
    mode.data["coverage"] = {"compared": n - 3, "total": n, "views": {"cumulative": 0, "isolated": n - 3}}
    assert f"{n} layers, only {n - 3} compared, " in render_html(results)
    mode.data["coverage"]["compared"] = n
    assert " compared, " not in render_html(results).split('id="cells-detail"')[1]


def test_status_icons_need_no_emoji_font() -> None:
    """Issue 35: every status icon is inline SVG with its name; no emoji (or variation selector) on the page."""
    page = render_html(rf.example_results())
    emoji = [ch for ch in page if ord(ch) >= 0x1F000 or 0x2600 <= ord(ch) <= 0x27BF or ch == "\ufe0f"]
    assert not emoji, sorted(set(emoji))
    for status in ("pass", "fail", "crashed", "skipped"):
        assert f'aria-label="{status}"><title>{status}</title>' in page, status


def test_an_op_finding_shows_its_call_and_a_divergence_its_layer(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run = tmp_path / "run"
    results = rf.sample_results()
    view = build_view(results, out_dir=run / "report", run_dir=run)
    page = render_html(results, view=view)
    assert '<code class="call">aten.cumsum.default(f32[1, 4, 1, 16], -1)</code>' in page
    places = {r["error_type"]: r["place"] for r in view.root_causes}
    assert places["divergence"].startswith("layer model.") and "(" in places["divergence"], places
    assert places["BackendCompilerFailed"].startswith("op aten.") and " in layer model." in places["BackendCompilerFailed"]
    assert "unknown (no traceback)" not in page.split('id="root-causes"')[1].split("</section>")[0]
    links = re.findall(r'<a class="repro" href="([^"]+)">', page)
    assert links and all(h.startswith("../cells/") for h in links)
    assert 'class="repro"' not in render_html(results)  # no run folder known: paths shown, not linked


def test_long_messages_are_cut_at_a_word_with_the_whole_text_kept() -> None:
    from ci_runner.report.html import clip, cut_words

    text = "the backend could not lower " + "averyveryverylongidentifier " * 12 + "end"
    cut = cut_words(text, 100)
    assert cut.endswith("…") and len(cut) <= 100 and text.startswith(cut[:-1]) and text[len(cut) - 1] == " "
    shown = str(clip(text, 100))
    assert f'title="{text}"' in shown and f'<span class="full">{text}</span>' in shown
    assert str(clip("short", 100)) == "short"


def test_an_op_mismatch_says_whether_it_reaches_the_models_output() -> None:
    results = rf.sample_results()
    f = next(f for c in results.cells for m in c.modes.values() for f in m.findings if f.op)
    f.details = {**f.details, "reaches_output": False, "output_effect": {"max_abs": 0.0, "rel": 0.0}}
    page = render_html(results, view=build_view(results))
    assert "<br>model output: its mismatch does not reach the model&#x27;s output for these inputs (max abs 0)" in page
