"""Issue 45: encoder-decoders whose decoder takes tokens (Whisper, T5, BART) generate in the prefill and decode
phases as `generate()` runs them (`workloads.calls.encoder_decoder_calls`): the encoder once, then the decoder's
calls with `decoder_input_ids`, `encoder_outputs` and one `EncoderDecoderCache`. Tiny random-weight configs (2
layers, hidden 64), eager only: the calls, their logits against the full decoder, and what generate() picks."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest
import torch
import transformers

from ci_runner.config import InputSpec, ModelSpec
from ci_runner.models.load import load_model
from ci_runner.workloads.calls import (_start_ids, cache_recipe, encoder_run, phase_calls, plain_tensors,
                                       run_phase, skip_reason)
from ci_runner.modes.memory.runs import cache_tensors
from ci_runner.workloads.phases import parse_phases

WHISPER = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
           "decoder_attention_heads": 2, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "num_mel_bins": 8,
           "max_source_positions": 16, "max_target_positions": 32, "vocab_size": 64, "pad_token_id": 0,
           "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 3}
T5 = {"d_model": 64, "d_ff": 128, "d_kv": 32, "num_heads": 2, "num_layers": 2, "num_decoder_layers": 2,
      "vocab_size": 64}
BART = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 64,
        "max_position_embeddings": 64}
MODELS = {"whisper": WHISPER, "t5": T5, "bart": BART}
INPUTS = InputSpec(seq_len=8, samples=1, seed=0)


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {name: load_model(ModelSpec(id=name, config=name, overrides=MappingProxyType(ov)), seed=0)
            for name, ov in MODELS.items()}


def _decode(steps: int = 3, cache: str = "static") -> Any:
    return parse_phases([{"decode": {"steps": steps, "cache": cache}}], seq_len=INPUTS.seq_len)[0]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("cache", ["static", "dynamic"])
def test_decode_through_the_encoder_decoder_cache_matches_the_full_decoder(models: dict[str, Any], name: str,
                                                                           cache: str) -> None:
    loaded = models[name]
    run = run_phase(loaded.module, loaded, INPUTS, _decode(cache=cache))
    assert [r.label for r in run.records] == ["prefill", "decode step 1", "decode step 2", "decode step 3"]
    assert all(r.error is None for r in run.records) and run.overwritten == []
    assert isinstance(run.cache, transformers.EncoderDecoderCache)
    ids = torch.cat([run.records[0].prompt_ids] + [r.token for r in run.records[1:]], dim=1)
    encoded, mask = encoder_run(loaded, INPUTS, "cpu")
    with torch.no_grad():  # no cache: the decoder over every token at once, on the same encoder output
        full = loaded.module(decoder_input_ids=ids, encoder_outputs=encoded, **mask, use_cache=False).logits
    first = run.records[0].prompt_ids.shape[1] - 1  # the prompt's last position (Whisper's prompt has 4 tokens)
    for k, rec in enumerate(run.records):
        torch.testing.assert_close(rec.logits[:, -1], full[:, first + k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(MODELS))
def test_every_call_is_the_decoders_with_what_generate_passes(models: dict[str, Any], name: str) -> None:
    loaded = models[name]
    tokens = [torch.tensor([[5]]), torch.tensor([[6]])]
    calls = list(phase_calls(loaded, INPUTS, _decode(steps=2), "cpu", lambda step: tokens[step - 1]))
    # decoder_start_token_id (T5 has none: its pad id, as generate()); a config-only Whisper's prompt: the start
    # token and three stand-ins for its language, task and no-timestamps tokens (test_whispers_prompt_is_generates)
    start = {"whisper": [3, 4, 5, 6], "t5": [0], "bart": [2]}[name]
    assert calls[0].ids.tolist() == [start] and [c.ids.tolist() for c in calls[1:]] == [[[5]], [[6]]]
    mask = set() if name == "whisper" else {"attention_mask"}  # the encoder's mask where its inputs have one
    for call in calls:
        assert set(call.kwargs) == {"decoder_input_ids", "encoder_outputs", "cache", "use_cache"} | mask
        assert call.kwargs["encoder_outputs"] is calls[0].kwargs["encoder_outputs"]  # the encoder ran once
        assert call.kwargs["cache"] is calls[0].kwargs["cache"] and call.kwargs["use_cache"] is True
    cross = int(calls[0].kwargs["encoder_outputs"][0].shape[1])
    assert cross == (16 if name == "whisper" else INPUTS.seq_len)  # Whisper: 2 × 16 frames, conv stride 2
    assert cache_recipe(loaded, _decode(steps=2), calls[0]) == {"kind": "static", "max_len": len(start) + 2,
                                                                "kwarg": "cache", "cross_len": cross}
    plain = plain_tensors(calls[0].kwargs)  # what a repro writes: the encoder's output as its hidden state
    assert torch.equal(plain["encoder_outputs"], calls[0].kwargs["encoder_outputs"].last_hidden_state)


def test_greedy_tokens_are_the_ones_generate_picks(models: dict[str, Any]) -> None:
    """T5's `generate()` (greedy, its default cache) starts with the phase's start token and picks the tokens the
    phase's eager run picks."""
    loaded = models["t5"]
    run = run_phase(loaded.module, loaded, INPUTS, _decode(steps=4, cache="dynamic"))
    ours = torch.cat(run.tokens, dim=1)
    encoded, mask = encoder_run(loaded, INPUTS, "cpu")
    ids = torch.ones((1, INPUTS.seq_len), dtype=torch.long)  # only its shape: the encoder output is given
    with torch.no_grad():
        # a default T5 config names no start token (generate() refuses it): its checkpoints' is the pad id, 0,
        # which the phase falls back to
        made = loaded.module.generate(input_ids=ids, encoder_outputs=encoded, **mask, max_new_tokens=5,
                                      do_sample=False, num_beams=1, decoder_start_token_id=0)
    n = made.shape[1] - 1  # generate stops at an end-of-sequence token
    assert torch.equal(made[:, :1], run.records[0].prompt_ids)
    assert n >= 1 and torch.equal(made[:, 1:], ours[:, :n])


def test_whispers_prompt_is_generates(models: dict[str, Any]) -> None:
    """Whisper's prefill feeds the prompt its generate() builds (transformers' `_retrieve_init_tokens`): from the
    generation config's `forced_decoder_ids` and no-timestamps token when it names them (the language English where
    it is left open: generate() detects it); a config-only model names none (generate() would start from the one
    start token, unlike every real checkpoint): the start token and three stand-ins, so the prefill has 4 tokens."""
    loaded = models["whisper"]
    gen = loaded.module.generation_config
    assert _start_ids(loaded) == [3, 4, 5, 6]
    saved = dict(gen.__dict__)
    try:
        gen.forced_decoder_ids, gen.no_timestamps_token_id, gen.return_timestamps = [[1, 7], [2, 9]], 11, False
        theirs = loaded.module._retrieve_init_tokens(torch.zeros(1, 8, 32), batch_size=1, generation_config=gen,
                                                     config=loaded.config, num_segment_frames=32, kwargs={})
        assert _start_ids(loaded) == theirs.tolist()[0] == [3, 7, 9, 11]
        gen.forced_decoder_ids, gen.lang_to_id = [[1, None], [2, 9]], {"<|fr|>": 21, "<|en|>": 20}
        assert _start_ids(loaded) == [3, 20, 9, 11]
        calls = list(phase_calls(loaded, INPUTS, _decode(steps=1), "cpu", lambda step: torch.tensor([[5]])))
        assert calls[0].ids.tolist() == [[3, 20, 9, 11]] and calls[1].ids.tolist() == [[5]]
    finally:
        gen.__dict__.clear()
        gen.__dict__.update(saved)


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_t5_and_bart_start_from_generates_one_start_token(models: dict[str, Any], name: str) -> None:
    """Their generate() starts the decoder from its one start token, as the prefill does."""
    loaded = models[name]
    start = _start_ids(loaded)
    encoded, mask = encoder_run(loaded, INPUTS, "cpu")
    ids = torch.ones((1, INPUTS.seq_len), dtype=torch.long)
    with torch.no_grad():
        made = loaded.module.generate(input_ids=ids, encoder_outputs=encoded, **mask, max_new_tokens=1,
                                      do_sample=False, num_beams=1, decoder_start_token_id=start[0])
    assert len(start) == 1 and made[:, :1].tolist() == [start]


def test_teacher_forcing_feeds_the_given_tokens(models: dict[str, Any]) -> None:
    loaded = models["bart"]
    forced = [torch.tensor([[7]]), torch.tensor([[8]]), torch.tensor([[9]])]
    run = run_phase(loaded.module, loaded, INPUTS, _decode(), forced=forced)
    assert [int(r.token) for r in run.records[1:]] == [7, 8, 9]


def test_what_does_not_apply_is_skipped_with_its_reason(models: dict[str, Any]) -> None:
    whisper = models["whisper"]
    assert skip_reason(whisper, _decode(steps=28), INPUTS) is None  # a 4-token prompt + 28 = 32 positions
    assert "decoder prompt (4 tokens) + 29 steps = 33 tokens > the decoder's 32 positions" in skip_reason(
        whisper, _decode(steps=29), INPUTS)
    for phase in parse_phases(["batch", {"long": {"seq_len": [16]}}], seq_len=8):
        assert "built for decoder-only prompts" in (skip_reason(models["t5"], phase, INPUTS) or "")
    too_long = InputSpec(seq_len=80, samples=1)
    assert "prompt 80 tokens > max_position_embeddings 64" in skip_reason(models["bart"], _decode(), too_long)


def test_the_memory_mode_counts_both_caches_of_an_encoder_decoder(models: dict[str, Any]) -> None:
    loaded = models["bart"]
    run = run_phase(loaded.module, loaded, INPUTS, _decode(steps=1))
    cache = run.cache
    both = cache_tensors(cache.self_attention_cache) + cache_tensors(cache.cross_attention_cache)
    assert both and [id(t) for t in cache_tensors(cache)] == [id(t) for t in both]
