"""Mode `compile` on aot_eager: a graph break in our own model (reason, line, module, verified repro, `fixed` once
removed), a decode step recompiling with a dynamic length (the changed input named), a `dynamic: false` length
sweep past a small recompile limit (eager fallback named, never a pass). One compile run per cell, module-scoped."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ci_runner.backends import resolve_backend
from ci_runner.config import load_matrix_text
from ci_runner.engine.repro import verify_script
from ci_runner.matrix import expand
from ci_runner.results.baseline import Baseline, diff, make_baseline
from ci_runner.results.model import CellResult, ModeResult, Results
from tests.fixtures.compile_models import ARMED_BREAK_LINE, BREAK_LINE
from tests.fixtures.matrices import matrix_text
from tests.fixtures.torchtrace import records, tlparse

LLAMA = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64}
FACTORY = "tests.fixtures.compile_models:with_break"


def _run(tmp: Path, model: dict[str, Any], backend: dict[str, Any], *, inputs: dict[str, Any] | None = None,
         options: dict[str, Any] | None = None) -> ModeResult:
    from ci_runner.modes import ModeContext  # deferred: imports torch
    from ci_runner.modes.compile.mode import run

    text = matrix_text(models=[model], backends=[backend], modes=["compile"], inputs=inputs,
                       options={"compile": options} if options else None)
    cell = next(iter(expand(load_matrix_text(text))))
    cdir = tmp / "cells" / cell.id
    cdir.mkdir(parents=True)
    ctx = ModeContext(cell=cell, cell_dir=cdir, backend=resolve_backend(cell.backend), deadline=time.monotonic() + 600)
    return run(ctx)


def _cell(result: ModeResult) -> Results:
    return Results(cells=[CellResult(id="gb@ae", model="gb", backend="ae", status=result.status,
                                     modes={"compile": result})])


@pytest.fixture(scope="module")
def breaks(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModeResult, ModeResult, Path]:
    tmp = tmp_path_factory.mktemp("compile-break")
    ae = {"id": "ae", "compile": "aot_eager"}
    broken = _run(tmp / "a", {"id": "gb", "factory": FACTORY}, ae, inputs={"samples": 1})
    fixed = _run(tmp / "b", {"id": "gb", "factory": FACTORY, "overrides": {"fixed": True}}, ae,
                 inputs={"samples": 1})
    return broken, fixed, tmp / "a" / "cells" / "gb@ae"


def test_a_graph_break_in_our_model_names_reason_line_and_module(breaks: Any) -> None:
    broken, _, cell_dir = breaks
    row = broken.data["phases"]["forward"]
    assert row["graphs"] >= 2 and row["compile_s"] > 0 and not row["eager_after_limit"]
    assert row["status"] == "fail" and row["findings"] == ["graph_break"]  # the phase agrees with the mode
    src = f"tests/fixtures/compile_models.py:{BREAK_LINE}"
    assert [b["source"] for b in row["graph_breaks"]] == [src]
    assert "Tensor.item()" in row["graph_breaks"][0]["reason"]
    figures = broken.data["figures"]  # what the run history keeps per night
    assert figures["graphs.forward"] == row["graphs"] and figures["graph_breaks.forward"] == 1
    (f,) = [f for f in broken.findings if f.kind == "graph_break"]
    assert broken.status == "fail" and f.module == src and f.details["module"] == "gate" and f.module_class == "Gate"
    assert f.details["source"] == src
    assert f.repro is not None and f.repro.verified, f.repro
    script = (cell_dir / f.repro.path).read_text()
    assert "watch_graph_breaks()" in script
    assert f.details["repro_module"] == "gate" and "get_submodule(MODULE)" in script  # the module alone, its inputs


def test_the_phase_trace_is_kept_where_tlparse_reads_it(breaks: Any, tmp_path: Path) -> None:
    broken, _, cell_dir = breaks
    kept = broken.data["phases"]["forward"]["trace"]
    assert broken.data["trace_dir"] == "compile/torch_trace"
    assert kept["file"] == "compile/torch_trace/dedicated_log_torch_trace_forward.log" and "left_out" not in kept
    (f,) = [f for f in broken.findings if f.kind == "graph_break"]
    assert f.details["trace"] == kept["file"]
    text = (cell_dir / kept["file"]).read_text(encoding="utf-8")
    recs = records(text)
    assert len(recs) == kept["records"] and len(text.encode()) == kept["bytes"]
    assert any(m.get("artifact", {}).get("name") == "dynamo_graph_break_reason" for m, _ in recs)
    exe = tlparse()
    if exe is None:
        pytest.skip("tlparse is not installed (the test extra installs it: pip install tlparse); the file's records "
                    "were checked above")
    out = tmp_path / "tl_out"
    proc = subprocess.run([exe, str(cell_dir / kept["file"]), "-o", str(out), "--no-browser", "--strict"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    index = (out / "index.html").read_text(encoding="utf-8")
    assert "0/0" in index and any(p.name.startswith("dynamo_graph_break_reason") for p in out.rglob("*.txt"))


def test_removing_the_break_is_fixed_in_the_diff(breaks: Any) -> None:
    broken, fixed, _ = breaks
    assert fixed.status == "pass" and fixed.data["phases"]["forward"]["graph_breaks"] == []
    base = Baseline.from_dict(make_baseline(_cell(broken)))
    d = diff(_cell(fixed), base)
    assert [(e.category, e.kind) for e in d.entries if e.fingerprint] == [("fixed", "graph_break")]
    again = diff(_cell(broken), Baseline.from_dict(make_baseline(_cell(fixed))))
    assert [(e.category, e.kind) for e in again.entries if e.fingerprint] == [("regressed", "graph_break")]


@pytest.fixture(scope="module")
def armed(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModeResult, Path]:
    """A token model whose gate breaks only once its parent armed it; two samples of different lengths and every
    recompile after the warm-up a finding: a recompile in the gate's own frame and one in the model's."""
    tmp = tmp_path_factory.mktemp("compile-armed")
    res = _run(tmp, {"id": "ab", "factory": "tests.fixtures.compile_models:tokens_with_armed_break"},
               {"id": "ae", "compile": "aot_eager"}, inputs={"samples": 2},
               options={"dynamic_recompile_expected": False})
    return res, tmp / "cells" / "ab@ae"


def test_a_recompile_in_a_submodules_frame_is_replayed_on_that_module_alone(armed: Any) -> None:
    res, cell_dir = armed
    recompiles = [f for f in res.findings if f.kind == "compile_after_warmup"]
    gate = [f for f in recompiles if f.details["changed"] == "x"]  # the gate's own frame: its input x
    assert len(gate) == 1 and gate[0].details["repro_module"] == "gate", gate
    assert gate[0].repro is not None and gate[0].repro.verified and "RecompileError" in gate[0].repro.note
    script = (cell_dir / gate[0].repro.path).read_text()
    assert "get_submodule(MODULE)" in script and script.count("'label': 'forward") == 2  # its two calls, in order
    model = [f for f in recompiles if f.details["changed"] == "input_ids"]  # the model's own forward: whole model
    assert model and "the model's own forward" in model[0].details["repro_note"] and model[0].repro.verified


def test_a_break_the_module_alone_hides_falls_back_to_the_whole_models_repro(armed: Any) -> None:
    res, _ = armed
    (f,) = [f for f in res.findings if f.kind == "graph_break"]
    assert f.details["source"] == f"tests/fixtures/compile_models.py:{ARMED_BREAK_LINE}" and f.details["module"] == "gate"
    assert "repro_module" not in f.details and f.details["repro_note"].startswith("gate alone did not show it")
    assert f.repro is not None and f.repro.verified and f.repro.path.endswith("_model.py"), f.repro


def test_a_decode_step_recompiles_with_a_dynamic_length(tmp_path: Path) -> None:
    """A sliding-window decoder (tiny Mistral, window 4): decode step 1 recompiles (input_ids 6 -> 1 tokens) into a
    graph whose KV-cache length is symbolic (the one IREE and OpenVINO then fail on: sym_max of it). By default that
    recompile is the warm-up's (tests/unit/test_compile_warmup.py); with a one-call warm-up and no dynamic recompile
    expected it is a finding."""
    res = _run(tmp_path, {"id": "sw", "config": "mistral", "overrides": {**LLAMA, "sliding_window": 4}},
               {"id": "ae", "compile": "aot_eager"},
               inputs={"seq_len": 6, "phases": [{"decode": {"steps": 2}}]},
               options={"verify": False, "warmup_calls": 1, "dynamic_recompile_expected": False})
    row = res.data["phases"]["decode"]
    (rc,) = row["recompiles"]
    assert rc["call"] == "decode step 1" and rc["changed"] == "input_ids" and rc["dynamic"] is True
    assert [x.split(".", 1)[1] for x in rc["symbolic"]] == ["layers[0].cumulative_length_int"]  # cache.… (the kwarg)
    assert "size mismatch at index 1. expected 6, actual 1" in rc["reason"]
    assert [c["graphs"] for c in row["per_call"]] == [1, 1, 0]  # prefill, step 1 (dynamic), step 2 reuses it
    (f,) = res.findings
    assert f.kind == "compile_after_warmup" and f.details["changed"] == "input_ids" and f.phase == "decode"
    assert f.repro is not None and "error_on_recompile = True" in (tmp_path / "cells" / "sw@ae" / f.repro.path).read_text()


def test_a_static_length_sweep_past_the_limit_is_an_eager_fallback(tmp_path: Path) -> None:
    res = _run(tmp_path, {"id": "ll", "config": "llama", "overrides": LLAMA},
               {"id": "ae", "compile": "aot_eager", "compile_options": {"dynamic": False}},
               inputs={"seq_len": 6, "phases": [{"long": {"seq_len": [4, 5, 6, 7]}}]},
               options={"recompile_limit": 3, "verify": False})
    row = res.data["phases"]["long"]
    assert [c["graphs"] for c in row["per_call"]] == [1, 1, 1, 0]  # one graph per length, then the limit
    assert row["eager_after_limit"] is True and row["eager_calls"] == ["long 7"]
    assert res.status == "fail"
    kinds = {f.kind: f for f in res.findings}
    assert set(kinds) == {"length_sweep_graphs", "recompile_limit"}
    assert "did not test the backend" in kinds["recompile_limit"].message
    assert kinds["length_sweep_graphs"].metrics == {"graphs_first": 1, "graphs_added": 2, "allowed": 1}


@pytest.mark.slow
def test_openvino_lists_what_its_partitioner_left_in_eager_on_a_sliding_window_decode(tmp_path: Path) -> None:
    """The recipe backend on a tiny Mistral with a 4-token window: decode step 1 recompiles with a dynamic length;
    OpenVINO's partitioner leaves the mask's `sym_max` to PyTorch eager (as its DEBUG log says), then the call fails."""
    pytest.importorskip("openvino")
    ov = {"id": "ov", "compile": "openvino", "compile_options": {"options": {
        "aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}}
    res = _run(tmp_path, {"id": "sw", "config": "mistral", "overrides": {**LLAMA, "sliding_window": 4}}, ov,
               inputs={"seq_len": 6, "phases": [{"decode": {"steps": 1}}]}, options={"verify": False})
    row = res.data["phases"]["decode"]
    assert row["recompiles"][0]["changed"] == "input_ids" and row["recompiles"][0]["dynamic"] is True
    assert "op sym_max" in row["eager_fallbacks"]
    assert row["failed_call"] == "decode step 1" and row["per_call"][1]["ran"] == 0  # then OpenVINO fails on it
    kinds = {f.kind: f for f in res.findings}
    assert set(kinds) == {"eager_fallback", "compile_after_warmup"}
    f = kinds["eager_fallback"]
    assert f.op == "sym_max" and f.repro is not None and f.details["size_arithmetic"] is True  # said so, still a finding
    # the eager-fallback repro verified here (one OpenVINO child, as before the recompile finding came with it)
    ver = verify_script(tmp_path / "cells" / "sw@ov" / f.repro.path, expect_text=["REPRO FAILED: sym_max ran in PyTorch eager"],
                        timeout=300)
    assert ver.verified, ver.output_tail[-2000:]
    assert f.module == "model"  # the decoder stack's mask code (nn_module_stack of the node left outside)
    rc = kinds["compile_after_warmup"]  # in the warm-up, but the backend failed on it: the workload finding's cause
    assert rc.details["call"] == "decode step 1" and rc.details["workload_finding"] == "layers:decode"
    assert rc.details["dynamic"] and rc.details["changed"] == "input_ids"


def test_the_reports_carry_the_per_phase_table_and_junit_properties(breaks: Any) -> None:
    from ci_runner.report.html import render_html
    from ci_runner.report.junit import render_junit
    from ci_runner.report.summary import render_summary

    results = _cell(breaks[0])
    row = breaks[0].data["phases"]["forward"]
    summary = render_summary(results)
    assert "### Compile: graphs, breaks, recompiles per phase" in summary
    assert f"| `gb@ae` | forward | {row['graphs']} | 1 | 0 |" in summary
    assert "Worst offenders: `gb@ae` forward (1 break(s), 0 recompile(s))" in summary
    junit = render_junit(results).decode()
    assert f'name="compile.forward.graphs" value="{row["graphs"]}"' in junit
    assert 'name="compile.forward.graph_breaks" value="1"' in junit
    assert '<table class="compile"><caption>compile, per phase</caption>' in render_html(results)


def test_a_new_graph_break_is_filed_as_one_issue_per_source_line(breaks: Any) -> None:
    from ci_runner.github.options import FilingOptions
    from ci_runner.github.render import RenderContext, group_entries, render_issue

    broken = breaks[0]
    d = diff(_cell(broken), Baseline.from_dict(make_baseline(_cell(breaks[1])))).to_dict()
    (g,) = group_entries(d, layers=True)
    src = f"tests/fixtures/compile_models.py:{BREAK_LINE}"
    assert g.key == ("graph_break", "ae", src) and g.regressed
    body = render_issue(g, RenderContext(options=FilingOptions(), run_key="k", run_url=None, artifacts_url=None,
                                         run_dir=None))
    assert f"### Graph break at `{src}` on backend `ae`" in body and "`Gate`" in body
    assert "Tensor.item()" in body
