"""The workload phases on the two real compilers from PyPI (IREE `turbine_cpu`, OpenVINO with the recipe), tiny
random-weight decoders: what a user sees with plain `torch.compile` (docs/phases.md, "Checked on the real
compilers") is what the modes report."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from ci_runner.backends import boilerplate_lines
from ci_runner.results.rootcause import cause_line, without_type

from ci_runner.modes.layers.phases import run_phases as layers_phases
from ci_runner.modes.numerics.phases import run_phases as numerics_phases
from ci_runner.options import LayersOptions, NumericsOptions
from tests.fixtures.matrices import REFERENCES, matrix_text

pytestmark = pytest.mark.slow

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}
MODELS = [{"id": "mistral", "config": "mistral", "overrides": {**SMALL, "sliding_window": 4, "num_hidden_layers": 1}},
          {"id": "llama", "config": "llama", "overrides": SMALL}]
OV_RECIPE = {"options": {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}
BACKENDS = [{"id": "iree", "compile": "turbine_cpu"},
            {"id": "ov", "compile": "openvino", "compile_options": OV_RECIPE}]


def _ctx(mode_context: Callable[..., Any], model: str, backend: str, phases: list[Any]) -> Any:
    text = matrix_text(models=MODELS, backends=BACKENDS, references=REFERENCES,
                       inputs={"seq_len": 6, "samples": 1, "phases": phases})
    return mode_context(text, model, backend)


def test_a_sliding_window_decoder_fails_its_first_decode_step_only_under_dynamic_shapes(
        mode_context: Callable[..., Any], fresh_dynamo: Any) -> None:
    ctx = _ctx(mode_context, "mistral", "iree", ["prefill", {"decode": {"steps": 1}}])
    findings, data = layers_phases(ctx, LayersOptions(), ctx.artifact_dir("layers"))
    assert data["prefill"]["status"] == "pass"
    # replayed alone on its captured calls (cache state included), the attention fails the same way: the
    # sliding-window code in its own forward hands the backend `sym_max`; its four Linear children pass
    assert [(f.phase, f.step, f.module) for f in findings] == [("decode", 1, "model.layers.0.self_attn")]
    f = findings[0]
    assert f.details["culprit_ops"] == ["sym_max"] and f.details["dynamic_only"], f.message
    assert "own code" in f.message and len(f.details["children_passed"]) == 4
    assert "prefill passes" in f.message and "sym_max" in f.message
    assert f.repro is not None and f.repro.verified, f.repro
    # the cause is IREE's own words, kept after its boilerplate first line (issue 45: phase groups were keyed by
    # "JIT compilation failed. See diagnostics."), as the forward's probes keep them
    cause = cause_line(without_type(f.details["message_full"], f.error_type), boilerplate_lines())
    assert "JIT compilation failed" not in cause and "sym_max" in f.details["message_full"], f.details["message_full"]


def test_a_padded_batch_turns_nan_from_the_first_attention(mode_context: Callable[..., Any], fresh_dynamo: Any) -> None:
    ctx = _ctx(mode_context, "llama", "iree", [{"batch": {"lengths": [6, 2]}}])
    findings, data = numerics_phases(ctx, NumericsOptions())
    assert [(f.phase, f.module, f.details.get("row")) for f in findings] == [("batch", "model.layers.0.self_attn", 1)]
    assert data["batch"]["calls"][0]["nonfinite_rows"] == [1]


def test_openvino_overwrites_earlier_decode_outputs_and_turns_a_padded_batch_nan(
        mode_context: Callable[..., Any], fresh_dynamo: Any) -> None:
    ctx = _ctx(mode_context, "llama", "ov", [{"decode": {"steps": 2}}, {"batch": {"lengths": [6, 2]}}])
    findings, data = numerics_phases(ctx, NumericsOptions())
    assert [(f.phase, f.kind, f.step) for f in findings] == [("decode", "output_overwritten", 1),
                                                               ("batch", "divergence", None)]
    assert data["decode"]["agreement"]["greedy"] == 1.0
    # watched (issue 38): one of its two graphs failed OpenVINO's conversion (sdpa for CPU) and ran in PyTorch
    assert "OpenVINO" in data["decode"]["backend_ran"].get("not_ran", ""), data["decode"]["backend_ran"]
    # OpenVINO runs the model with hooks in PyTorch, so the layer is found by compiling modules alone
    nan = findings[1]
    assert nan.module == "model.layers.0.self_attn" and nan.details["localised"] == "isolated", nan.message
