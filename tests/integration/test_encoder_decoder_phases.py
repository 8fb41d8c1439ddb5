"""Issue 45: an encoder-decoder's prefill and decode through the modes (`modes/*/phases.py`) on aot_eager (eager's
kernels: any finding is ours): Whisper (audio into its encoder) and T5 (tokens) decode through their
`EncoderDecoderCache`, every call passes, the numerics agree token for token; batch is skipped with its reason.
A wav2vec2 asked for its CTC head (`task: ctc`) runs the ops and numerics modes on its audio. Then Whisper decoding
through a `DynamicCache` on the two real compilers from PyPI, as checked by hand (docs/phases.md). Tiny configs
(one layer each side): seconds each, the IREE one about a minute (its repro is verified)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ci_runner.config import load_matrix_text
from ci_runner.matrix import expand
from ci_runner.modes.layers.phases import run_phases as layers_phases
from ci_runner.modes.numerics.phases import run_phases as numerics_phases
from ci_runner.options import LayersOptions, NumericsOptions
from ci_runner.run.cellrun import run_cell_inprocess
from tests.fixtures.matrices import REFERENCES, matrix_text

pytestmark = pytest.mark.slow

WHISPER = {"id": "whisper", "config": "whisper", "overrides": {
    "d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "num_mel_bins": 8,
    "max_source_positions": 16, "max_target_positions": 32, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1,
    "eos_token_id": 2, "decoder_start_token_id": 3}}
T5 = {"id": "t5", "config": "t5", "overrides": {"d_model": 16, "d_ff": 32, "d_kv": 8, "num_heads": 2, "num_layers": 1,
                                                "num_decoder_layers": 1, "vocab_size": 64}}
CTC = {"id": "ctc", "config": "wav2vec2", "task": "ctc", "overrides": {
    "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
    "conv_dim": [8, 8], "conv_kernel": [10, 3], "conv_stride": [5, 2], "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 2, "vocab_size": 32}}
PHASES = ["prefill", {"decode": {"steps": 2}}, "batch"]


@pytest.mark.parametrize("model", ["whisper", "t5"])
def test_prefill_and_decode_pass_on_aot_eager(mode_context: Callable[..., Any], fresh_dynamo: Any,
                                              model: str) -> None:
    text = matrix_text(models=[WHISPER, T5], backends=[{"id": "aot_eager", "compile": "aot_eager"}],
                       references=REFERENCES, inputs={"seq_len": 8, "samples": 1, "phases": PHASES})
    ctx = mode_context(text, model, "aot_eager")
    lf, ldata = layers_phases(ctx, LayersOptions(), ctx.artifact_dir("layers"))
    nf, ndata = numerics_phases(ctx, NumericsOptions())
    assert lf == [] and nf == [], [f.message for f in lf + nf]
    for data in (ldata, ndata):
        assert {k: v["status"] for k, v in data.items()} == {"prefill": "pass", "decode": "pass", "batch": "skipped"}
        assert "encoder-decoder" in data["batch"]["reason"]
    assert [c["call"] for c in ldata["decode"]["calls"]] == ["prefill", "decode step 1", "decode step 2"]
    assert all(c["ok"] for c in ldata["decode"]["calls"])
    assert ndata["decode"]["agreement"]["greedy"] == 1.0


def test_a_ctc_head_runs_ops_and_numerics_on_its_audio(tmp_path: Path) -> None:
    text = matrix_text(models=[CTC], backends=[{"id": "aot_eager", "compile": "aot_eager"}], references=REFERENCES,
                       modes=["ops", "numerics"], timeout=600, inputs={"seq_len": 8, "samples": 1, "seed": 0})
    cell = next(iter(expand(load_matrix_text(text, path=str(tmp_path / "matrix.yaml")))))
    result = run_cell_inprocess(cell, tmp_path / "cells" / cell.id, modes=("ops", "numerics"),
                                deadline=time.monotonic() + cell.timeout)
    for mode in ("ops", "numerics"):
        assert result.modes[mode].status == "pass", (mode, result.modes[mode].reason)
        assert result.modes[mode].findings == []


def _real(mode_context: Callable[..., Any], backend: str) -> Any:
    """Whisper decoding through a `DynamicCache` (generate()'s default) on a real compiler from PyPI."""
    backends = [{"id": "iree", "compile": "turbine_cpu"},
                {"id": "ov", "compile": "openvino", "compile_options": {"options": {"aot_autograd": True}}}]
    text = matrix_text(models=[WHISPER], backends=backends, references=REFERENCES,
                       inputs={"seq_len": 8, "samples": 1, "phases": [{"decode": {"steps": 2, "cache": "dynamic"}}]})
    return mode_context(text, "whisper", backend)


def test_iree_fails_whisper_decode_once_its_length_is_dynamic(mode_context: Callable[..., Any],
                                                                fresh_dynamo: Any) -> None:
    """By hand (docs/phases.md): plain torch.compile on turbine_cpu passes the prefill (the start token) and decode
    step 1, and fails decode step 2, where Dynamo recompiles with the cache's length dynamic; dynamic=False passes."""
    pytest.importorskip("iree.turbine")
    ctx = _real(mode_context, "iree")
    findings, data = layers_phases(ctx, LayersOptions(), ctx.artifact_dir("layers"))
    assert [(f.phase, f.step, f.module) for f in findings] == [("decode", 2, "model.decoder.layers.0.self_attn")]
    f = findings[0]
    assert f.details["dynamic_only"] and f.details["passed_calls"] == ["prefill", "decode step 1"], f.message
    assert f.repro is not None and f.repro.verified, f.repro  # the repro rebuilds the EncoderDecoderCache


def test_openvino_runs_whisper_prefill_into_a_dynamic_cache_in_pytorch(mode_context: Callable[..., Any],
                                                                       fresh_dynamo: Any) -> None:
    """By hand: OpenVINO cannot convert the empty `DynamicCache`'s first concatenation (`aten.cat` of a 0-element
    tensor), logs it at DEBUG and runs that call in PyTorch; every call returns. The layers mode says the backend
    did not run the phase, never a pass."""
    pytest.importorskip("openvino")
    ctx = _real(mode_context, "ov")
    findings, data = layers_phases(ctx, LayersOptions(), ctx.artifact_dir("layers"))
    assert findings == [] and data["decode"]["status"] == "inconclusive"
    assert "ran in PyTorch eager" in data["decode"]["reason"], data["decode"]["reason"]
