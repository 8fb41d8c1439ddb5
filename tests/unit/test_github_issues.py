"""Issue grouping, rendering and text neutralising, without a server."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from ci_runner.matrix import artifact_name
from ci_runner.errors import ConfigError, InputError
from ci_runner.github.issues import file_issues, load_diff
from ci_runner.github.options import FilingOptions
from ci_runner.github.render import (
    Group,
    RenderContext,
    code_span,
    fenced,
    group_entries,
    group_fingerprint,
    plain,
    render_comment,
    render_issue,
    safe_title,
)
from tests.fixtures.fake_github import entry, op_finding, write_diff

ZWJ = "\u200d"


def ctx(tmp_path: Path | None = None, **kw) -> RenderContext:
    return RenderContext(options=FilingOptions(**kw), run_key="gh-42", run_url="https://github.com/acme/models/actions/runs/42",
                         artifacts_url=None, run_dir=tmp_path)


def layer_finding(module: str, backend: str) -> dict:
    from ci_runner.results.model import fingerprint

    return {"kind": "layer_failure", "stage": "compile", "message": "InternalTorchDynamoError: boom",
            "fingerprint": fingerprint("layer_failure", backend, module), "op": None, "module": module,
            "module_class": "LlamaAttention", "error_type": "RuntimeError", "metrics": {}, "threshold": {},
            "repro": None, "details": {}}


def divergence_finding(module: str, cls: str, backend: str, pattern: str | None = None) -> dict:
    from ci_runner.results.model import fingerprint

    return {"kind": "divergence", "stage": "compare", "message": f"first divergent layer {module}",
            "fingerprint": fingerprint("divergence", backend, module), "op": None, "module": module,
            "module_class": cls, "error_type": None, "metrics": {"rel": 0.2, "cos": 0.97},
            "threshold": {"rel": 0.01}, "repro": None, "details": {"pattern": pattern} if pattern else {}}


# --------------------------------------------------------------------------- neutralising


def test_code_span_survives_backticks():
    assert code_span("aten.add") == "`aten.add`"
    assert code_span("a ` b") == "``a ` b``"
    assert code_span("x ``` y") == "````x ``` y````"
    assert code_span("`edge`") == "`` `edge` ``"
    assert code_span("two\nlines") == "`two lines`"


def test_fence_is_longer_than_any_backtick_run():
    text = "before\n```\n</details>\n@octocat\n````` end"
    block = fenced(text, "python")
    fence = block.split("\n", 1)[0]
    assert fence == "``````python"
    assert block.endswith("\n``````")
    inner = block[len(fence) + 1: -len("``````")]
    assert inner == text + "\n"  # content untouched: code is not rendered, so nothing to escape


def test_plain_makes_markdown_html_and_mentions_inert():
    out = plain("see @octocat and @org/team, <script>alert(1)</script> **bold** [x](http://e) #12 GH-7")
    assert "@" + ZWJ + "octocat" in out and "@" + ZWJ + "org/team" in out
    assert "<script>" not in out and "&lt;script&gt;" in out
    assert "**" not in out.replace("\\*", "")
    assert "#" + ZWJ + "12" in out and "GH-" + ZWJ + "7" in out
    assert "\\[x\\]" in out
    assert "\n" not in plain("a\nb")


def test_mentions_after_a_backtick_or_a_dot_are_inert_too():
    """Issue 34: an unpaired backtick is no code span, and `x.@user` pings; both were left live."""
    from ci_runner.github.render import html_text, safe_title

    for text in ("a `@octocat here", "end.@octocat", "(`@org/team)", "x.@octocat/y"):
        for render in (plain, html_text, safe_title):
            out = render(text)
            assert "@" + ZWJ in out and "@o" not in out, (render.__name__, text, out)
    assert plain("john.doe@example.com") == "john.doe@example.com"  # an e-mail address is no mention


def test_email_like_and_cell_ids_are_not_mangled():
    assert plain("tiny-llama@sim-subset") == "tiny-llama@sim-subset"
    assert ZWJ not in code_span("@octocat")  # GitHub links no mention inside code


def test_safe_title():
    assert safe_title("[x] @admin fails\non\tcpu") == f"[x] @{ZWJ}admin fails on cpu"
    long = safe_title("x" * 400)
    assert len(long) == 256 and long.endswith("…")


# --------------------------------------------------------------------------- grouping


def test_ops_group_per_backend_and_op_across_models():
    f = op_finding("aten.softplus.default", "sim-subset")
    g2 = op_finding("aten.softplus.default", "inductor", kind="op_error")
    other = op_finding("aten.erf.default", "sim-subset", kind="op_mismatch")
    diff = {"entries": [
        entry("regressed", "tiny-bamba", "sim-subset", f),
        entry("persisting", "tiny-llama", "sim-subset", f),
        entry("regressed", "tiny-bamba", "inductor", g2),
        entry("regressed", "tiny-vit", "sim-subset", other),
        entry("regressed", "tiny-vit", "sim-crash", None),  # a cell that got worse: no issue of its own
    ]}
    groups = group_entries(diff, layers=False)
    assert [g.key for g in groups] == [("op", "inductor", "aten.softplus.default"),
                                       ("op", "sim-subset", "aten.erf.default"),
                                       ("op", "sim-subset", "aten.softplus.default")]
    softplus = groups[2]
    assert [e["model"] for e in softplus.entries] == ["tiny-bamba", "tiny-llama"]
    assert softplus.regressed and softplus.title == "[deepview-ci] aten.softplus.default fails on sim-subset"
    # deterministic: the same key gives the same fingerprint and title, whatever the entries
    again = group_entries({"entries": [entry("regressed", "other-model", "sim-subset", f)]}, layers=False)[0]
    assert again.fingerprint == softplus.fingerprint == group_fingerprint(softplus.key)
    assert again.title == softplus.title


def test_layers_and_divergence_only_with_layers_flag():
    diff = {"entries": [
        entry("regressed", "tiny-llama", "sim-crash", layer_finding("model.layers.0.self_attn", "sim-crash")),
        entry("regressed", "tiny-llama", "sim-drift", divergence_finding("model.layers.0.input_layernorm", "LlamaRMSNorm", "sim-drift")),
        entry("regressed", "tiny-granite", "sim-drift", divergence_finding("model.layers.1.input_layernorm", "GraniteRMSNorm", "sim-drift",
                                                                           pattern="*.input_layernorm")),
        entry("regressed", "tiny-bamba", "sim-drift", divergence_finding("model.layers.1.input_layernorm", "BambaRMSNorm", "sim-drift",
                                                                         pattern="*.input_layernorm")),
    ]}
    assert group_entries(diff, layers=False) == []
    keys = [g.key for g in group_entries(diff, layers=True)]
    assert keys == [("layer", "sim-crash", "tiny-llama", "model.layers.0.self_attn"),
                    ("divergence", "sim-drift", "*.input_layernorm"),
                    ("divergence", "sim-drift", "LlamaRMSNorm")]


# --------------------------------------------------------------------------- rendering


def test_issue_body_has_markers_models_signatures_error_repro_and_env(tmp_path):
    cell = tmp_path / "cells" / "tiny-bamba@sim-subset" / "repro"
    cell.mkdir(parents=True)
    (cell / "softplus.py").write_text("import torch\nprint('repro')\n")
    f = op_finding("aten.softplus.default", "sim-subset", repro="repro/softplus.py",
                   message="SimCompilerError: unsupported @octocat <img src=x onerror=alert(1)> ``` end",
                   signatures=["(f32[1, 16, 64])", "(bf16[2, 8])"])
    [g] = group_entries({"entries": [entry("regressed", "tiny-bamba", "sim-subset", f)]}, layers=False)
    body = render_issue(g, ctx(tmp_path))
    assert body.startswith(f"<!-- deepview-ci:fingerprint={g.fingerprint} -->\n")
    meta = json.loads(re.search(r"<!-- deepview-ci:meta (\{.*?\}) -->", body).group(1))
    assert meta["key"] == ["op", "sim-subset", "aten.softplus.default"] and meta["cells"] == ["tiny-bamba@sim-subset"]
    assert "`tiny-bamba`" in body and "`(f32[1, 16, 64])`" in body and "`(bf16[2, 8])`" in body
    assert "<details>" in body and "print('repro')" in body and "(verified" in body
    assert "torch: 2.13.0" in body
    # the hostile message is inside a fence longer than its backtick run, so it renders as text
    m = re.search(r"\n(`{4,})text\n(.*?)\n\1\n", body, re.S)
    assert m and "<img src=x" in m.group(2)
    outside = body.replace(m.group(0), "")
    assert "<img" not in outside and "@octocat" not in outside


def test_oversized_repro_is_truncated_with_a_link(tmp_path):
    cell = tmp_path / "cells" / "tiny-bamba@sim-subset" / "repro"
    cell.mkdir(parents=True)
    big = "".join(f"x_{i} = torch.zeros(4)  # padding line {i}\n" for i in range(6000))  # ~250 kB
    (cell / "op.py").write_text(big)
    f = op_finding("aten.softplus.default", "sim-subset", repro="repro/op.py")
    [g] = group_entries({"entries": [entry("regressed", "tiny-bamba", "sim-subset", f)]}, layers=False)
    body = render_issue(g, ctx(tmp_path))
    assert 60000 < len(body) <= 65536
    assert "Truncated to fit GitHub's issue size limit" in body
    assert "https://github.com/acme/models/actions/runs/42" in body
    assert artifact_name("tiny-bamba@sim-subset") in body  # the cell's escaped artifact name
    assert body.count("<details>") == body.count("</details>") == 1
    m = re.search(r"\n(`{3,})python\n", body)
    close = body.index("\n" + m.group(1) + "\n", m.end())
    assert close < body.index("Truncated to fit") < body.index("</details>")  # the fence closes after the cut


def test_huge_lists_and_messages_still_fit():
    entries = []
    for i in range(400):
        f = op_finding("aten.softplus.default", "sim-subset", message=f"error {i} " + "y" * 5000)
        entries.append(entry("regressed", f"model-{i:03d}", "sim-subset", f))
    [g] = group_entries({"entries": entries}, layers=False)
    body = render_issue(g, ctx(None))
    assert len(body) <= 65536
    assert "more cell(s)" in body and "more distinct message(s)" in body
    comment = render_comment(g, ctx(None), "recurrence")
    assert len(comment) <= 65536 and "<!-- deepview-ci:event=recurrence run=gh-42 -->" in comment


def test_repro_outside_the_run_folder_is_never_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    run = tmp_path / "run"
    run.mkdir()
    f = op_finding("aten.add.Tensor", "sim-subset", repro="../../../secret.txt")
    [g] = group_entries({"entries": [entry("regressed", "m", "sim-subset", f)]}, layers=False)
    assert "TOP SECRET" not in render_issue(g, ctx(run))


def test_divergence_and_layer_bodies_render():
    d = divergence_finding("model.layers.0.post_feedforward_layernorm", "Gemma2RMSNorm", "sim-drift",
                           pattern="*.post_feedforward_layernorm")
    lf = layer_finding("model.layers.0.self_attn", "sim-crash")
    groups = group_entries({"entries": [entry("regressed", "tiny-gemma", "sim-drift", d),
                                        entry("regressed", "tiny-llama", "sim-crash", lf)]}, layers=True)
    bodies = {g.kind: render_issue(g, ctx(None)) for g in groups}
    assert "`*.post_feedforward_layernorm` layers diverge" in bodies["divergence"]
    assert "rel `0.2`" in bodies["divergence"] and "threshold rel `0.01`" in bodies["divergence"]
    assert "Submodule `model.layers.0.self_attn` of `tiny-llama`" in bodies["layer"]
    assert "`LlamaAttention`" in bodies["layer"]


def test_fixed_comment():
    g = Group(kind="op", key=("op", "b", "aten.x"), fingerprint="ab" * 10, title="t",
              fixed=[{"cell": "m@b", "category": "fixed", "backend": "b"}])
    text = render_comment(g, ctx(None), "fixed", closing=True)
    assert text.startswith("<!-- deepview-ci:event=fixed run=gh-42 -->")
    assert "`m@b`" in text and "Closing" in text


# --------------------------------------------------------------------------- inputs and options


def test_load_diff_rejects_corrupt_and_foreign_files(tmp_path):
    p = tmp_path / "diff.json"
    p.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_diff(p)
    p.write_text(json.dumps({"entries": [{"category": "regressed"}]}))
    with pytest.raises(InputError):
        load_diff(p)
    p.write_text(json.dumps({"schema_version": 1, "entries": [{"category": "bogus", "cell": "a@b", "backend": "b"}]}))
    with pytest.raises(InputError):
        load_diff(p)
    with pytest.raises(InputError, match="not found"):
        load_diff(tmp_path / "missing.json")


def test_options_validation_and_from_args():
    with pytest.raises(ConfigError):
        FilingOptions(label="same", opt_out_label="SAME")
    with pytest.raises(ConfigError):
        FilingOptions(label="a,b")
    with pytest.raises(ConfigError):
        FilingOptions(min_interval=-1)
    ns = argparse.Namespace(label="dv", opt_out_label="dv:off", close_fixed=False, layers=True, min_interval=0.0,
                            max_wait=5.0)
    o = FilingOptions.from_args(ns)
    assert (o.label, o.opt_out_label, o.close_fixed, o.layers, o.min_interval, o.max_wait) == ("dv", "dv:off", False, True, 0.0, 5.0)


def test_config_errors_before_any_network(tmp_path):
    d = write_diff(tmp_path / "diff.json", [])
    common = dict(dry_run=None, run_dir=None, artifacts_url=None, options=FilingOptions())
    with pytest.raises(ConfigError, match="OWNER/NAME"):
        file_issues(d, repo="not a repo", env={"GITHUB_TOKEN": "x"}, **common)
    with pytest.raises(ConfigError, match="GITHUB_TOKEN") as info:
        file_issues(d, repo="acme/models", env={}, **common)
    assert info.value.exit_code == 2 and "--dry-run" in info.value.hint


def test_dry_run_writes_drafts_and_calls_nothing(tmp_path):
    f = op_finding("aten.softplus.default", "sim-subset")
    fixed = op_finding("aten.erf.default", "sim-subset")
    d = write_diff(tmp_path / "diff.json", [entry("regressed", "m1", "sim-subset", f),
                                            entry("fixed", "m1", "sim-subset", fixed)])
    out = tmp_path / "drafts"
    env = {"GITHUB_API_URL": "http://127.0.0.1:9"}  # nothing listens there; no token either
    r = file_issues(d, repo="acme/models", dry_run=out, run_dir=None, artifacts_url=None,
                    options=FilingOptions(), env=env)
    assert r.exit_code == 0 and r.dry_run and r.drafts == 2 and r.created == 0
    index = json.loads((out / "drafts.json").read_text())
    by_action = {x["action"]: x for x in index["drafts"]}
    assert sorted(by_action) == ["close", "create"]
    first = (out / by_action["create"]["file"]).read_text()
    assert "aten.softplus.default" in first and "<!-- deepview-ci:fingerprint=" in first


def test_ops_mode_signature_dicts_render_as_call_site_lines():
    f = op_finding("aten.convolution.default", "sim-subset")
    f["details"] = {"signatures": [{"signature": "aten.convolution.default(f32[1, 3, 16, 16])", "count": 2,
                                    "sites": [{"module": "vit.embeddings.proj", "module_class": "Conv2d",
                                               "source": "modeling_vit.py:69 in forward"}]}]}
    [g] = group_entries({"entries": [entry("regressed", "tiny-vit", "sim-subset", f)]}, layers=False)
    body = render_issue(g, ctx(None))
    assert ("  - `aten.convolution.default(f32[1, 3, 16, 16])`, 2 calls in `vit.embeddings.proj` (`Conv2d`) "
            "at `modeling_vit.py:69 in forward`") in body


def test_an_op_mismatch_entry_says_whether_it_reaches_the_models_output():
    """Issue 45: each cell's line says what the ops mode measured (`details.reaches_output`), or why it could not."""
    hidden = op_finding("aten.cumsum.default", "ov", kind="op_mismatch")
    hidden["details"] = {"reaches_output": False, "output_effect": {"max_abs": 0.0, "rel": 0.0}}
    shown = op_finding("aten.cumsum.default", "ov", kind="op_mismatch")
    shown["details"] = {"reaches_output": True, "output_effect": {"max_abs": 0.25, "rel": 0.01}}
    unknown = op_finding("aten.cumsum.default", "ov", kind="op_mismatch")
    unknown["details"] = {"reaches_output": None, "reaches_output_note": "not measured: the child crashed (SIGSEGV)"}
    [g] = group_entries({"entries": [entry("regressed", "whisper", "ov", hidden), entry("regressed", "bert", "ov", shown),
                                     entry("regressed", "vit", "ov", unknown)]}, layers=False)
    body = render_issue(g, ctx(None))
    # prose goes through the `plain` filter, which escapes markdown's parentheses
    assert "in cell `whisper@ov`; its mismatch does not reach the model's output for these inputs \\(max abs 0\\)" in body
    assert "in cell `bert@ov`; its mismatch reaches the model's output \\(max abs 0.25\\)" in body
    assert ("in cell `vit@ov`; whether it reaches the model's output is unknown: not measured: the child crashed "
            "\\(SIGSEGV\\)") in body


def test_local_drafts_find_the_run_folder_and_quote_the_repro(tmp_path):
    """`file-issues --dry-run` of a local run, without --run-dir: the run folder is the one above the diff's
    report folder; the draft quotes the script, says how to run it from the cell folder, in local words."""
    f = op_finding("aten.softplus.default", "sim-subset", repro="ops/repro_aten.softplus.default.py")
    f["repro"]["command"] = "PYTHONPATH=../../../.. python repro_aten.softplus.default.py"
    run = tmp_path / "out"
    script = run / "cells" / "m1@sim-subset" / "ops" / "repro_aten.softplus.default.py"
    script.parent.mkdir(parents=True)
    script.write_text("print('the softplus repro')\n")
    d = write_diff(run / "report" / "diff.json", [entry("regressed", "m1", "sim-subset", f)],
                   results=str(run / "report" / "results.json"))
    r = file_issues(d, repo="acme/models", dry_run=tmp_path / "drafts", run_dir=None, artifacts_url=None,
                    options=FilingOptions(), env={})
    assert r.drafts == 1
    [draft] = (tmp_path / "drafts").glob("*.md")
    text = draft.read_text()
    assert "print('the softplus repro')" in text
    assert ("Run it from the cell folder `cells/m1@sim-subset` (in the run folder, or the cell's artifact): "
            "`PYTHONPATH=../../.. python ops/repro_aten.softplus.default.py`") in text
    assert "from a local run" in text and "artifact `" not in text
    import shutil

    shutil.rmtree(run / "cells")  # no run folder: local words, not an artifact of a GitHub run
    file_issues(d, repo="acme/models", dry_run=tmp_path / "drafts2", run_dir=None, artifacts_url=None,
                options=FilingOptions(), env={})
    [draft] = (tmp_path / "drafts2").glob("*.md")
    text = draft.read_text()
    assert "which was not found: give it to `file-issues --run-dir DIR`" in text and "in the artifact" not in text
