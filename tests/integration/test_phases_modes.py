"""The workload phases in each mode (`modes/*/phases.py`), on a tiny Llama: every self-test backend of a workload
class is found in its own phase only, and aot_eager (eager's kernels: any finding is ours) finds nothing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from ci_runner.modes.layers.phases import run_phases as layers_phases
from ci_runner.modes.numerics.phases import run_phases as numerics_phases
from ci_runner.modes.numerics.phaserepro import attach_phase_repros
from ci_runner.options import LayersOptions, NumericsOptions
from ci_runner.results.rootcause import signature
from tests.fixtures.matrices import REFERENCES, matrix_text

pytestmark = pytest.mark.slow

LLAMA = {"id": "llama", "config": "llama", "overrides": {  # one layer: each phase is a compile (~30 % less per layer
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,  # left out)
    "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 128}}
LLAMA2 = {**LLAMA, "id": "llama2", "overrides": {**LLAMA["overrides"], "num_hidden_layers": 2}}  # a NaN's downstream
PHASES = ["prefill", {"decode": {"steps": 2}}, {"batch": {"lengths": [8, 3]}}, {"long": {"seq_len": [16, 80]}}]
BACKENDS = [
    {"id": "aot_eager", "compile": "aot_eager"},
    {"id": "decode", "compile": "sim-decode"},
    {"id": "kvdrift", "compile": "sim-kvdrift"},
    {"id": "masknan", "compile": "sim-masknan"},
    {"id": "long", "compile": "sim-long", "backend_options": {"max_tokens": 64}},
    {"id": "reuse", "compile": "sim-reuse"},
]


def _matrix(phases: list[Any]) -> str:
    return matrix_text(models=[LLAMA, LLAMA2], backends=BACKENDS, references=REFERENCES,
                       inputs={"seq_len": 8, "samples": 1, "phases": phases})


def _by_phase(findings: list[Any]) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    for f in findings:
        out.setdefault(f.phase, []).append(f)
    return out


@pytest.fixture
def context(mode_context: Callable[..., Any], fresh_dynamo: Any) -> Callable[..., Any]:
    """`context(backend, phases=PHASES, model="llama")`: the llama cell on `backend` with those phases (a test that
    shows a failure in one phase runs that phase and one it must pass, to keep the compiles few)."""
    return lambda backend, phases=PHASES, model="llama": mode_context(_matrix(phases), model, backend)


def test_aot_eager_finds_nothing_in_any_phase(context: Callable[[str], Any]) -> None:
    ctx = context("aot_eager")
    lf, ldata = layers_phases(ctx, LayersOptions(), ctx.artifact_dir("layers"))
    nf, ndata = numerics_phases(ctx, NumericsOptions())
    assert lf == [] and nf == []
    assert {k: v["status"] for k, v in ldata.items()} == {p: "pass" for p in ("prefill", "decode", "batch", "long")}
    assert {k: v["status"] for k, v in ndata.items()} == {p: "pass" for p in ("prefill", "decode", "batch", "long")}
    assert ndata["decode"]["agreement"]["greedy"] == 1.0


def test_one_token_steps_fail_in_decode_only(context: Callable[[str], Any]) -> None:
    ctx = context("decode", ["prefill", {"decode": {"steps": 2}}, {"batch": {"lengths": [8, 3]}}])
    findings, data = layers_phases(ctx, LayersOptions(), ctx.artifact_dir("layers"))
    assert [(f.phase, f.step) for f in findings] == [("decode", 1)]
    f = findings[0]
    assert f.kind == "layer_failure" and "self_attn" in f.module and "prefill passes" in f.message
    assert f.repro is not None and f.repro.verified, f.repro
    assert data["prefill"]["status"] == data["batch"]["status"] == "pass"
    # issue 45: the finding keeps the error itself, so its root cause is keyed on it (past any boilerplate line),
    # not on the phase's words: the same error in another phase or in the forward is the same cause
    assert f.details["message_full"].startswith(f"{f.error_type}: ") and "traceback_tail" in f.details
    sig = signature(f)
    assert sig.id == signature(dataclasses.replace(f, phase="long", message="long fails on the backend: ...")).id


def test_a_long_prompt_fails_past_the_limit_only(context: Callable[[str], Any]) -> None:
    ctx = context("long", [{"decode": {"steps": 1}}, {"long": {"seq_len": [16, 80]}}])
    findings, data = layers_phases(ctx, LayersOptions(verify=False), ctx.artifact_dir("layers"))
    assert [(f.phase, f.details["call"]) for f in findings] == [("long", "long 80")]
    assert data["decode"]["status"] == "pass"


def test_a_reduced_precision_cache_drifts_after_the_first_token(context: Callable[[str], Any]) -> None:
    findings, data = numerics_phases(context("kvdrift", [{"decode": {"steps": 2}}, {"batch": {"lengths": [8, 3]}}]),
                                     NumericsOptions())
    assert set(_by_phase(findings)) == {"decode"}
    f = findings[0]
    assert f.step is not None and f.step >= 1, f.message
    assert data["decode"]["calls"][0]["rel"] == 0.0 or data["decode"]["calls"][0]["rel"] < 1e-5


def test_nan_in_a_padded_batch_is_named_with_row_and_first_layer(context: Callable[[str], Any]) -> None:
    findings, data = numerics_phases(context("masknan", [{"decode": {"steps": 1}}, {"batch": {"lengths": [8, 3]}}],
                                             "llama2"), NumericsOptions())
    assert [f.phase for f in findings] == ["batch"]
    f = findings[0]
    assert f.details["row"] == 1 and f.module == "model.layers.0.self_attn", f.message
    assert "reaches the real tokens in model.layers.1" in f.message
    assert data["batch"]["calls"][0]["nonfinite_rows"] == [1]


def test_outputs_overwritten_by_later_calls_are_found_where_they_happen(context: Callable[[str], Any]) -> None:
    ctx = context("reuse", ["prefill", {"decode": {"steps": 3}}, {"batch": {"lengths": [8, 3]}}])
    findings, _ = numerics_phases(ctx, NumericsOptions())
    over = sorted((f for f in findings if f.kind == "output_overwritten"), key=lambda f: f.step or 0)
    assert {f.phase for f in over} == {"decode"} and [f.step for f in over] == [1, 2]
    assert "changed after decode step 2" in over[0].message and "changed after decode step 3" in over[1].message
    # its repro replays the calls compiled and shows the kept output changing (issue 45: a repro per numerics finding),
    # each finding its own script (they once shared one folder: the last written stood for both)
    attach_phase_repros(ctx, over, NumericsOptions())
    assert all(f.repro is not None and f.repro.verified for f in over), [(f.repro, f.details.get("repro_note")) for f in over]
    assert len({f.repro.path for f in over if f.repro}) == 2
    scripts = [(ctx.cell_dir / f.repro.path).read_text() for f in over if f.repro]
    assert "decode step 3" in scripts[1] and "decode step 3" not in scripts[0]
    repro = over[0].repro
    assert repro is not None
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}  # as printed, `python`
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # being this interpreter
    proc = subprocess.run(repro.command or "", shell=True, cwd=(ctx.cell_dir / repro.path).parent, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "REPRO FAILED: the output returned by decode step 1 changed after decode step 2" \
        in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_ops_probes_a_padded_batch_with_a_fully_masked_row(mode_context: Callable[..., Any], fresh_dynamo: Any) -> None:
    from ci_runner.modes.ops.mode import run as ops_run

    text = matrix_text(models=[LLAMA], backends=[{"id": "masknan", "compile": "sim-masknan"}],
                       references=REFERENCES, inputs={"seq_len": 8, "samples": 1, "phases": ["prefill", "batch"]},
                       options={"ops": {"only_ops": ["aten._scaled_dot_product*"], "workers": 1}})
    result = ops_run(mode_context(text, "llama", "masknan"))
    assert [(f.phase, f.kind, f.op) for f in result.findings] == [
        ("batch", "op_mismatch", "aten._scaled_dot_product_flash_attention_for_cpu.default")]
    f = result.findings[0]
    assert f.repro is not None and f.repro.verified and f.repro.path.startswith("ops/phases/batch/"), f.repro
    assert result.data["phases"]["prefill"]["status"] == "pass" and result.data["phases"]["batch"]["status"] == "fail"
    # measured on the batch phase's own calls: the padded row's pads are fully masked there, the plain softmax's
    # NaN reaches its logits (issue 45: an op finding says whether its mismatch reaches the model's output)
    assert f.details["reaches_output"] is True and "NaN" in f.details["reach"]["problem"], f.details
    assert "; its mismatch reaches the model's output" in f.message.splitlines()[0]
    assert result.data["reach"]["ops"] == {"batch:" + f.op: True}


def test_ops_probes_a_phase_signature_with_its_dynamic_dims(mode_context: Callable[..., Any], fresh_dynamo: Any) -> None:
    """The second long prompt recompiles with a dynamic length (automatic dynamic): its ops are probed with that dim
    marked dynamic, so a static-shape compiler fails them there, with a repro that marks it too; the forward's
    static calls of the same op pass."""
    from ci_runner.modes.ops.mode import run as ops_run

    text = matrix_text(models=[LLAMA], backends=[{"id": "static", "compile": "tests.fixtures.plugin_static_only:backend"}],
                       inputs={"seq_len": 8, "samples": 1, "phases": [{"long": {"seq_len": [16, 24]}}]},
                       options={"ops": {"only_ops": ["aten.cat*"], "workers": 1}})
    ctx = mode_context(text, "llama", "static")
    result = ops_run(ctx)
    assert result.findings and {(f.phase, f.kind, f.op) for f in result.findings} == {
        ("long", "unsupported_op", "aten.cat.default")}, [(f.phase, f.kind, f.op, f.message[:80]) for f in result.findings]
    f = result.findings[0]
    assert "dynamic size" in f.message and f.repro is not None and f.repro.verified, (f.message, f.repro)
    assert "torch._dynamo.maybe_mark_dynamic(tensors[" in (ctx.cell_dir / f.repro.path).read_text()
    assert result.data["phases"]["long"]["status"] == "fail"


def test_a_phase_the_backend_left_to_pytorch_is_no_pass(mode_context: Callable[..., Any], fresh_dynamo: Any) -> None:
    """Issue 45: a phase whose calls all passed but ran in PyTorch (here Dynamo suppressed the compiler's error and
    ran each frame eagerly, as OpenVINO's run-time fallback does in its own way) is `inconclusive` with the reason,
    never `pass`."""
    import torch._dynamo.config

    refusing = {"id": "refuse", "compile": "tests.unit.test_layers_ran:refusing_backend"}
    text = matrix_text(models=[LLAMA], backends=[refusing], references=REFERENCES,
                       inputs={"seq_len": 8, "samples": 1, "phases": ["prefill"]})
    ctx = mode_context(text, "llama", "refuse")
    with torch._dynamo.config.patch(suppress_errors=True):
        findings, data = layers_phases(ctx, LayersOptions(), ctx.artifact_dir("layers"))
    assert findings == [] and data["prefill"]["status"] == "inconclusive", data["prefill"]
    assert "the backend did not run (all of) this phase" in data["prefill"]["reason"], data["prefill"]
