"""Zoo synthetic inputs from each architecture's forward: text, vision, audio, encoder-decoder, multimodal."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ci_runner.config import InputSpec  # noqa: E402
from ci_runner.zoo.inputs import ZooInputError, zoo_inputs  # noqa: E402
from ci_runner.zoo.shrink import shrink  # noqa: E402

INPUTS = InputSpec(batch=1, seq_len=8, samples=1)


def _model(model_type: str, cls_name: str) -> tuple[torch.nn.Module, Any]:
    config = shrink(transformers.AutoConfig.for_model(model_type), "narrow")
    with torch.device("meta"):
        module = getattr(transformers, cls_name)._from_config(config)
    return module.eval(), config


def _shapes(kwargs: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def test_text_and_vision() -> None:
    llama, cfg = _model("llama", "LlamaForCausalLM")
    kw = zoo_inputs(llama, cfg, model_type="llama", task="causal-lm", inputs=INPUTS)
    assert _shapes(kw) == {"input_ids": (1, 8), "attention_mask": (1, 8)} and kw["use_cache"] is False
    assert int(kw["input_ids"].max()) < cfg.vocab_size
    vit, cfg = _model("vit", "ViTForImageClassification")
    kw = zoo_inputs(vit, cfg, model_type="vit", task="image-classification", inputs=INPUTS)
    assert _shapes(kw) == {"pixel_values": (1, 3, cfg.image_size, cfg.image_size)}


def test_audio_layouts() -> None:
    whisper, cfg = _model("whisper", "WhisperForConditionalGeneration")  # mel bins as conv channels
    kw = zoo_inputs(whisper, cfg, model_type="whisper", task="speech-seq2seq", inputs=INPUTS)
    assert _shapes(kw)["input_features"] == (1, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    assert _shapes(kw)["decoder_input_ids"] == (1, 8)
    w2v, cfg = _model("wav2vec2", "Wav2Vec2Model")  # raw waveform
    kw = zoo_inputs(w2v, cfg, model_type="wav2vec2", task="base", inputs=INPUTS)
    assert list(_shapes(kw)) == ["input_values"] and kw["input_values"].dim() == 2


def test_encoder_decoder_and_multimodal() -> None:
    bart, cfg = _model("bart", "BartForConditionalGeneration")
    kw = zoo_inputs(bart, cfg, model_type="bart", task="seq2seq", inputs=INPUTS)
    assert {"input_ids", "attention_mask", "decoder_input_ids"} <= set(kw)
    llava, cfg = _model("llava", "LlavaForConditionalGeneration")
    kw = zoo_inputs(llava, cfg, model_type="llava", task="image-text", inputs=INPUTS)
    image_tokens = int((kw["input_ids"] == cfg.image_token_id).sum())
    assert image_tokens > 0 and "pixel_values" in kw and kw["input_ids"].shape[1] == 8 + image_tokens
    clip, cfg = _model("clip", "CLIPModel")  # dual encoder: both towers fed
    kw = zoo_inputs(clip, cfg, model_type="clip", task="base", inputs=INPUTS)
    assert {"input_ids", "pixel_values"} <= set(kw)


def test_a_required_argument_without_a_synthetic_input_is_the_reason() -> None:
    class NeedsBoxes(torch.nn.Module):
        main_input_name = "input_ids"

        def forward(self, input_ids: torch.Tensor, bbox: torch.Tensor) -> torch.Tensor:
            return input_ids

    cfg = transformers.AutoConfig.for_model("bert", vocab_size=64)
    with pytest.raises(ZooInputError, match="requires 'bbox'"):
        zoo_inputs(NeedsBoxes(), cfg, model_type="layoutlm", task="base", inputs=INPUTS)


def test_image_tokens_with_a_two_number_patch_size() -> None:
    """InternVL's vision config gives `patch_size: [14, 14]`: the image token count reads both numbers (it was
    left out with `int() argument must be ... not 'list'`)."""
    internvl, cfg = _model("internvl", "InternVLForConditionalGeneration")
    assert isinstance(cfg.vision_config.patch_size, (list, tuple))
    kw = zoo_inputs(internvl, cfg, model_type="internvl", task="image-text", inputs=INPUTS)
    assert int((kw["input_ids"] == cfg.image_token_id).sum()) > 0 and "pixel_values" in kw
