"""Synthetic inputs for a zoo architecture, from the names its forward takes.

Text, vision and Llava-style image-text inputs come from `engine.models.build_inputs` (the one input builder);
this module picks the task it is called with from the model's `main_input_name` and adds what that builder does
not make: audio (`input_values` raw waveforms, `input_features` log-mel frames in the layout the model's first
convolution reads) and the decoder side of encoder-decoder models (`decoder_input_ids`). A forward argument that
is required and not made here is a `ZooInputError` naming it: the scan lists the architecture with that reason.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any

import torch

from ..config import InputSpec, ModelSpec
from ..engine.models import LoadedModel, build_inputs
from ..errors import DeepviewError

AUDIO_SAMPLES = 3200  # raw waveform length for `input_values` (0.2 s at 16 kHz)
FEATURE_FRAMES = 64  # log-mel frames for `input_features` when the config does not fix them
DECODER_LEN = 8
DEFAULT_VOCAB = 256


class ZooInputError(DeepviewError):
    """No synthetic input for an argument the architecture's forward requires."""


def _params(module: torch.nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return {}


def _builder_task(task: str | None, main: str) -> str:
    """The `build_inputs` task for a zoo head: what feeds its main input."""
    if main == "pixel_values":
        return "image-text" if task == "image-text" else "image-classification"
    if task == "image-text":
        return "image-text"
    return "causal-lm" if task == "causal-lm" else "base"


def _first_conv_in(module: torch.nn.Module) -> int | None:
    for m in module.modules():
        if isinstance(m, torch.nn.Conv1d):
            return int(m.in_channels)
    return None


def audio_features(module: torch.nn.Module, config: Any, inputs: InputSpec, sample: int) -> torch.Tensor:
    """`input_features`: Whisper-style (batch, mel bins, 2 × max_source_positions frames) when the first Conv1d
    reads the mel bins as channels, else (batch, frames, features) as Speech2Text / Conformer read them."""
    gen = torch.Generator().manual_seed(inputs.seed * 7919 + sample)
    bins = next((int(getattr(config, k)) for k in ("num_mel_bins", "feature_size", "input_feat_per_channel",
                                                   "n_mels", "mel_bins") if isinstance(getattr(config, k, None), int)), 80)
    channels = int(getattr(config, "input_channels", 1) or 1)
    if isinstance(getattr(config, "max_length", None), int) and _first_conv_in(module) is None:  # AST: (frames, bins)
        return torch.randn((inputs.batch, int(config.max_length), bins), generator=gen)
    if _first_conv_in(module) == bins:
        frames = 2 * int(getattr(config, "max_source_positions", FEATURE_FRAMES // 2) or FEATURE_FRAMES // 2)
        return torch.randn((inputs.batch, bins, frames), generator=gen)
    return torch.randn((inputs.batch, FEATURE_FRAMES, bins * channels), generator=gen)


def _default_vocab(config: Any) -> None:
    """Token ids for a config that names no vocabulary (CANINE reads code points, Bark's sub-models): the first
    `DEFAULT_VOCAB` ids."""
    text = getattr(config, "text_config", None) or config
    if not getattr(text, "vocab_size", None):
        try:
            text.vocab_size = DEFAULT_VOCAB
        except (AttributeError, TypeError, ValueError):
            pass


def _decoder_ids(config: Any, inputs: InputSpec, sample: int) -> torch.Tensor:
    dec = getattr(config, "decoder", None) or getattr(config, "text_config", None) or config
    vocab = int(getattr(dec, "vocab_size", None) or getattr(config, "vocab_size", None) or 2)
    gen = torch.Generator().manual_seed(inputs.seed * 104729 + sample)
    return torch.randint(0, max(2, vocab), (inputs.batch, DECODER_LEN), generator=gen)


def _loaded(module: torch.nn.Module, config: Any, model_type: str, task: str) -> LoadedModel:
    """The zoo model as `build_inputs` takes it (no tokenizer: seeded ids within the vocabulary)."""
    spec = ModelSpec(id=model_type, config=model_type, task=task)
    return LoadedModel(spec=spec, module=module, task=task, config=config, tokenizer=None, revision=None,
                       dtype=torch.float32, device="cpu")


def _other_towers(kwargs: dict[str, Any], module: torch.nn.Module, config: Any, params: dict[str, inspect.Parameter],
                  *, model_type: str, inputs: InputSpec, sample: int) -> None:
    """Dual-encoder models (CLIP, ALIGN, CLAP): the tower the main input does not feed, when the forward names
    its input and the config has that tower."""
    towers = (("input_ids", "text_config", "base"), ("pixel_values", "vision_config", "image-classification"))
    for name, sub, task in towers:
        if name in kwargs or name not in params or getattr(config, sub, None) is None:
            continue
        built = build_inputs(_loaded(module, config, model_type, task), inputs, sample=sample)
        kwargs.update({k: v for k, v in built.items() if k not in kwargs and k != "interpolate_pos_encoding"})
    if "input_features" in params and "input_features" not in kwargs and getattr(config, "audio_config", None):
        kwargs["input_features"] = audio_features(module, config.audio_config, inputs, sample)


def zoo_inputs(module: torch.nn.Module, config: Any, *, model_type: str, task: str | None, inputs: InputSpec,
               sample: int = 0) -> dict[str, Any]:
    """Keyword arguments for `module(**kwargs)` (CPU tensors; the inventory fakes them on its device)."""
    params = _params(module)
    main = str(getattr(module, "main_input_name", "input_ids") or "input_ids")
    kwargs: dict[str, Any] = {}
    if main in ("input_values", "input_features", "audio_values"):
        gen = torch.Generator().manual_seed(inputs.seed * 7919 + sample)
        waveform = main == "input_values" and not isinstance(getattr(config, "num_mel_bins", None), int)
        kwargs[main] = (torch.randn((inputs.batch, AUDIO_SAMPLES), generator=gen) if waveform  # else: AST's frames
                        else audio_features(module, config, inputs, sample))
    else:
        _default_vocab(config)
        kwargs.update(build_inputs(_loaded(module, config, model_type, _builder_task(task, main)), inputs,
                                   sample=sample))
    _other_towers(kwargs, module, config, params, model_type=model_type, inputs=inputs, sample=sample)
    if "decoder_input_ids" in params and (getattr(config, "is_encoder_decoder", False) or task in ("seq2seq", "speech-seq2seq")):
        kwargs["decoder_input_ids"] = _decoder_ids(config, inputs, sample)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in kwargs.items() if k in params or takes_any}
    missing = [n for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs]
    if missing:
        raise ZooInputError(f"{model_type}: the forward requires {', '.join(repr(m) for m in missing)}, which the "
                            f"zoo does not synthesise")
    if main not in kwargs and main in params:
        raise ZooInputError(f"{model_type}: no synthetic {main!r} (its main input)")
    return kwargs


def scan_inputs(inputs: InputSpec | None = None) -> InputSpec:
    """The input spec of the scan: one short sample (shapes only matter on `meta`)."""
    return replace(inputs or InputSpec(), samples=1, seq_len=min((inputs or InputSpec()).seq_len, 16))
