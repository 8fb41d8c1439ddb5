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


def test_packed_patch_images_match_the_config() -> None:
    """Qwen2-VL: flattened patches (patches, C·T·P·P) on a (1, h, w) grid, as many image tokens as merged patches
    (spatial_merge_size² patches each), mm_token_type_ids marking them, and the precomputed 3-D RoPE positions
    and vision helpers the model would otherwise compute with data-dependent ops."""
    qwen, cfg = _model("qwen2_vl", "Qwen2VLForConditionalGeneration")
    vis = cfg.vision_config
    kw = zoo_inputs(qwen, cfg, model_type="qwen2_vl", task="image-text", inputs=INPUTS)
    t, h, w = kw["image_grid_thw"][0].tolist()
    assert kw["pixel_values"].shape == (t * h * w, vis.in_channels * vis.temporal_patch_size * vis.patch_size ** 2)
    image = kw["input_ids"] == cfg.image_token_id
    assert int(image.sum()) == t * h * w // vis.spatial_merge_size ** 2 == 4
    assert torch.equal(kw["mm_token_type_ids"].bool(), image) and kw["input_ids"].shape[1] == 8 + 4
    assert kw["position_ids"].shape == (3, 1, 12)
    assert kw["image_cu_seqlens"].tolist() == [0, t * h * w] and kw["image_position_ids"].shape == (t * h * w, 2)


def test_packed_patch_vision_encoder_alone() -> None:
    """The Qwen2.5-VL vision tower alone: `hidden_states` patches, `grid_thw`, and its window-attention helpers."""
    tower, cfg = _model("qwen2_5_vl_vision", "Qwen2_5_VisionTransformerPretrainedModel")
    kw = zoo_inputs(tower, cfg, model_type="qwen2_5_vl_vision", task="base", inputs=INPUTS)
    assert kw["hidden_states"].shape[0] == int(kw["grid_thw"].prod()) == 16
    assert {"cu_seqlens", "position_ids", "window_index", "cu_window_seqlens"} <= set(kw)


def test_pixtral_style_image_sizes() -> None:
    """Mistral 3 merges spatial_merge_size² patches per token and reads each image's size: Python ints (a tensor's
    `.tolist()` is data-dependent under tracing), and one image token per merged patch."""
    mistral, cfg = _model("mistral3", "Mistral3ForConditionalGeneration")
    kw = zoo_inputs(mistral, cfg, model_type="mistral3", task="image-text", inputs=INPUTS)
    (h, w), = kw["image_sizes"]
    assert isinstance(h, int) and kw["pixel_values"].shape[-2:] == (h, w)
    merged = (h // cfg.vision_config.patch_size // cfg.spatial_merge_size) ** 2
    assert int((kw["input_ids"] == cfg.image_token_id).sum()) == merged == 4


def test_video_frames() -> None:
    """VideoMAE reads (batch, num_frames, C, H, W)."""
    mae, cfg = _model("videomae", "VideoMAEModel")
    kw = zoo_inputs(mae, cfg, model_type="videomae", task="base", inputs=INPUTS)
    assert kw["pixel_values"].shape == (1, cfg.num_frames, cfg.num_channels, cfg.image_size, cfg.image_size)


def test_required_pixels_and_codec_channels() -> None:
    """A vision tower whose main input name is not `pixel_values` but whose forward requires it (Idefics3's) gets
    the image classifier's pixels; a codec whose config counts `audio_channels` (EnCodec) gets (batch, channels,
    samples) waveforms."""
    tower, cfg = _model("idefics3_vision", "Idefics3VisionTransformer")
    kw = zoo_inputs(tower, cfg, model_type="idefics3_vision", task="base", inputs=INPUTS)
    assert kw["pixel_values"].shape == (1, 3, cfg.image_size, cfg.image_size)
    codec, cfg = _model("encodec", "EncodecModel")
    kw = zoo_inputs(codec, cfg, model_type="encodec", task="base", inputs=INPUTS)
    assert kw["input_values"].shape[:2] == (1, cfg.audio_channels) and kw["input_values"].dim() == 3
