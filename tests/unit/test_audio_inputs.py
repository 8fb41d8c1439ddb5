"""Issue 38: audio models from `config:` get the zoo's audio features (one builder, `models.audio`): Whisper its
speech seq2seq head, `input_features` of (batch, mel bins, 2 × max_source_positions) and decoder inputs; HuBERT
(wav2vec2-like) raw `input_values`, the token workload phases skipped with the reason (Whisper's decoder takes
tokens: it decodes)."""

from __future__ import annotations

import pytest
import torch

from ci_runner.config import InputSpec, ModelSpec
from ci_runner.models.load import build_inputs, load_model
from ci_runner.workloads.calls import skip_reason
from ci_runner.workloads.phases import parse_phases
from ci_runner.zoo.inputs import zoo_inputs

SPEC = InputSpec(batch=1, seq_len=8, samples=2, seed=3)
WHISPER = {"d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
           "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "num_mel_bins": 8,
           "max_source_positions": 16, "max_target_positions": 32, "vocab_size": 64, "pad_token_id": 0,
           "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
HUBERT = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
          "conv_dim": [8, 8], "conv_kernel": [10, 3], "conv_stride": [5, 2], "num_conv_pos_embeddings": 16,
          "num_conv_pos_embedding_groups": 2}


def _same_as_zoo(loaded, kwargs: dict, model_type: str) -> None:
    zoo = zoo_inputs(loaded.module, loaded.config, model_type=model_type, task=loaded.task, inputs=SPEC, sample=1)
    tensors = {k for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    assert tensors == {k for k, v in zoo.items() if isinstance(v, torch.Tensor)}
    for key in tensors:  # one builder for both model paths
        assert torch.equal(kwargs[key], zoo[key]), key


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_whisper_from_config_gets_its_features_head_and_decoder_inputs(dtype: str) -> None:
    loaded = load_model(ModelSpec(id="w", config="whisper", overrides=WHISPER), seed=0, dtype=dtype)
    assert loaded.task == "speech-seq2seq" and type(loaded.module).__name__ == "WhisperForConditionalGeneration"
    kwargs = build_inputs(loaded, SPEC, sample=1)
    assert kwargs["input_features"].shape == (1, 8, 32)  # mel bins as the conv's channels, 2 × 16 frames
    assert kwargs["input_features"].dtype == loaded.dtype and kwargs["decoder_input_ids"].shape == (1, 8)
    if dtype == "float32":
        _same_as_zoo(loaded, kwargs, "whisper")
    with torch.no_grad():
        logits = loaded.module(**kwargs).logits
    assert logits.shape == (1, 8, 64) and bool(torch.isfinite(logits).all())
    # its decoder takes tokens: prefill and decode run (tests/unit/test_encoder_decoder_phases.py); batch and long
    # prompts are decoder-only prompts, skipped with the reason
    assert skip_reason(loaded, parse_phases(["decode"], seq_len=8)[0], SPEC) is None
    for phase in parse_phases(["batch", "long"], seq_len=8):
        assert "encoder-decoder" in (skip_reason(loaded, phase, SPEC) or ""), phase


def test_hubert_from_config_gets_the_zoos_waveform() -> None:
    loaded = load_model(ModelSpec(id="h", config="hubert", overrides=HUBERT), seed=0)
    kwargs = build_inputs(loaded, SPEC, sample=1)
    assert kwargs["input_values"].shape == (1, 3200) and "input_ids" not in kwargs
    _same_as_zoo(loaded, kwargs, "hubert")
    with torch.no_grad():
        hidden = loaded.module(**kwargs).last_hidden_state
    assert hidden.shape[0] == 1 and hidden.shape[-1] == 16
    for phase in parse_phases(["decode", "batch", "long"], seq_len=8):
        assert "reads audio" in (skip_reason(loaded, phase, SPEC) or ""), phase
