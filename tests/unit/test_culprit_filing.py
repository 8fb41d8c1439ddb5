"""Issue 16: layer findings whose culprit search found one failing op are filed per (backend, op), listing every
layer and model; ranges and unknown culprits stay per submodule; summary/HTML name the culprit first."""

from __future__ import annotations

from typing import Any

from ci_runner.github.options import FilingOptions
from ci_runner.github.render import RenderContext, group_entries, render_issue
from ci_runner.results.model import fingerprint
from tests.fixtures.fake_github import entry

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def _culprit(kind: str = "single", ops: tuple[str, ...] = (SDPA,)) -> dict[str, Any]:
    nodes = [f"n{i}" for i in range(len(ops))]
    return {"found": True, "kind": kind, "ops": list(ops), "nodes": nodes, "node_ops": list(ops),
            "node_range": [3, 3 + len(ops)], "inputs": [["float32[1, 2, 8, 8]", "0.0"] for _ in ops],
            "sources": ['File "transformers/integrations/sdpa_attention.py", line 182'] + [None] * (len(ops) - 1),
            "status": "fail", "stage": "run", "error_type": "RuntimeError", "message": "[sim-crash] Assertion",
            "note": "", "level": "aot", "probes": 1, "restarts": 0, "seconds": 3.0,
            "repro": {"path": "layers/repro/x/culprit/repro.py", "verified": True, "note": "ok", "command": "python repro.py"}}


def _layer(module: str, backend: str, culprit: dict[str, Any] | None) -> dict[str, Any]:
    return {"kind": "layer_failure", "stage": "run", "message": "model.layers.0.self_attn fails alone at run",
            "fingerprint": fingerprint("layer_failure", backend, module), "op": None, "module": module,
            "module_class": "LlamaAttention", "error_type": "RuntimeError", "metrics": {}, "threshold": {},
            "repro": None, "details": {"culprit": culprit} if culprit else {}}


def _ctx() -> RenderContext:
    return RenderContext(options=FilingOptions(), run_key="gh-1", run_url=None, artifacts_url=None, run_dir=None)


def test_layer_failures_group_by_culprit_op_per_backend_across_layers_and_models() -> None:
    diff = {"entries": [
        entry("regressed", "tiny-llama", "sim-crash", _layer("model.layers.0.self_attn", "sim-crash", _culprit())),
        entry("regressed", "tiny-llama", "sim-crash", _layer("model.layers.1.self_attn", "sim-crash", _culprit())),
        entry("persisting", "tiny-granite", "sim-crash", _layer("model.layers.0.self_attn", "sim-crash", _culprit())),
        entry("regressed", "tiny-llama", "pair", _layer("model.layers.0.self_attn", "pair",
                                                        _culprit("range", ("aten.mm.default", "aten.neg.default")))),
        entry("regressed", "tiny-llama", "other", _layer("model.layers.0.mlp", "other", None)),
    ]}
    groups = group_entries(diff, layers=True)
    keys = [g.key for g in groups]
    assert keys == [("culprit", "sim-crash", SDPA),
                    ("layer", "other", "tiny-llama", "model.layers.0.mlp"),
                    ("layer", "pair", "tiny-llama", "model.layers.0.self_attn")]
    assert len(groups[0].entries) == 3
    assert "fails on sim-crash inside model layers" in groups[0].title
    body = render_issue(groups[0], _ctx())
    assert f"`{SDPA}` fails alone" in body
    for line in ("`tiny-llama`: `model.layers.0.self_attn`", "`tiny-llama`: `model.layers.1.self_attn`",
                 "`tiny-granite`: `model.layers.0.self_attn`"):
        assert line in body
    assert "sdpa_attention.py" in body and "float32[1, 2, 8, 8]" in body
    # a range culprit: its own layer issue, culprit first
    pair = render_issue(groups[2], _ctx())
    assert "no single op fails alone" in pair and "`aten.neg.default`" in pair
    assert pair.index("**Culprit**") < pair.index("**Error**")


def test_summary_and_html_name_the_culprit_first(tmp_path) -> None:
    from ci_runner.report import write_reports
    from ci_runner.report.summary import render_summary
    from tests.fixtures import results_factory as rf

    results = rf.sample_results()
    layer = next(f for c in results.cells for m in c.modes.values() for f in m.findings if f.kind == "layer_failure")
    layer.details["culprit"] = _culprit()
    text = render_summary(results)
    row = next(line for line in text.splitlines() if line.startswith("| ") and "culprit:" in line)
    assert row.index(SDPA) < row.index("layer:") and "layers/repro/x/culprit/repro.py" in row and "✔" in row
    write_reports(results, tmp_path)
    html = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert f"culprit: <b>{SDPA} fails alone</b>" in html


def test_every_op_failing_alone_is_named_in_the_issue_and_the_report(tmp_path) -> None:
    """Issue 38: the culprit names each op that fails alone in the module; the issue is filed under the first."""
    from ci_runner.report.view import culprit_text
    from ci_runner.results.model import Finding

    histc, gmm = "aten.histc.default", "transformers.grouped_mm_fallback.default"
    c = _culprit(ops=(histc,))
    c["failing_ops"] = [{"op": histc, "node": "histc"}, {"op": gmm, "node": "grouped_mm_fallback"}]
    layer = _layer("model.layers.0.mlp.experts", "iree", c)
    groups = group_entries({"entries": [entry("regressed", "tiny-mixtral", "iree", layer)]}, layers=True)
    assert [g.key for g in groups] == [("culprit", "iree", histc)]
    body = render_issue(groups[0], _ctx())
    assert f"`{histc}` fails alone" in body and f"also failing alone in this module: `{gmm}`" in body
    f = Finding(kind="layer_failure", stage="compile", message="x", fingerprint="ab" * 10, details={"culprit": c})
    assert culprit_text(f) == f"{histc}, {gmm} each fail alone"
    c.pop("failing_ops")
    assert culprit_text(f) == f"{histc} fails alone"  # results written before issue 38
