"""Synthetic audio inputs: the one builder of the zoo's and `config:` models' audio features.

A model whose `main_input_name` is audio gets `input_values` (raw waveforms: wav2vec2, HuBERT, codecs) or
`input_features` (log-mel frames in the layout the model's first convolution reads: Whisper, Speech2Text, AST).
`models.load.build_inputs` calls `audio_inputs` for every such model, and the zoo (`zoo/inputs.py`) does too,
so the two model paths feed the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import InputSpec

__all__ = ["AUDIO_INPUTS", "AUDIO_SAMPLES", "FEATURE_FRAMES", "audio_features", "audio_inputs", "is_audio", "waveform"]

AUDIO_INPUTS: tuple[str, ...] = ("input_values", "input_features", "audio_values")  # main input names that are audio
AUDIO_SAMPLES = 3200  # raw waveform length for `input_values` (0.2 s at 16 kHz)
FEATURE_FRAMES = 64  # log-mel frames for `input_features` when the config does not fix them


def _generator(inputs: InputSpec, sample: int) -> torch.Generator:
    return torch.Generator().manual_seed(inputs.seed * 7919 + sample)


def _first_conv_in(module: torch.nn.Module) -> int | None:
    for m in module.modules():
        if isinstance(m, torch.nn.Conv1d):
            return int(m.in_channels)
    return None


def audio_features(module: torch.nn.Module, config: Any, inputs: InputSpec, sample: int) -> torch.Tensor:
    """`input_features`: Whisper-style (batch, mel bins, 2 × max_source_positions frames) when the first Conv1d
    reads the mel bins as channels, else (batch, frames, features) as Speech2Text / Conformer read them."""
    gen = _generator(inputs, sample)
    bins = next((int(getattr(config, k)) for k in ("num_mel_bins", "feature_size", "input_feat_per_channel",
                                                   "n_mels", "mel_bins") if isinstance(getattr(config, k, None), int)), 80)
    channels = int(getattr(config, "input_channels", 1) or 1)
    if isinstance(getattr(config, "max_length", None), int) and _first_conv_in(module) is None:  # AST: (frames, bins)
        return torch.randn((inputs.batch, int(config.max_length), bins), generator=gen)
    if _first_conv_in(module) == bins:
        frames = 2 * int(getattr(config, "max_source_positions", FEATURE_FRAMES // 2) or FEATURE_FRAMES // 2)
        return torch.randn((inputs.batch, bins, frames), generator=gen)
    return torch.randn((inputs.batch, FEATURE_FRAMES, bins * channels), generator=gen)


def waveform(config: Any, inputs: InputSpec, sample: int) -> torch.Tensor:
    """`input_values`: (batch, samples), or (batch, audio_channels, samples) for a codec whose config counts its
    channels (EnCodec, Mimi)."""
    channels = getattr(config, "audio_channels", None)
    shape = (inputs.batch, channels, AUDIO_SAMPLES) if isinstance(channels, int) and channels > 0 \
        else (inputs.batch, AUDIO_SAMPLES)
    return torch.randn(shape, generator=_generator(inputs, sample))


def is_audio(module: torch.nn.Module) -> bool:
    """Whether the model's main input is audio (`AUDIO_INPUTS`)."""
    return str(getattr(module, "main_input_name", "") or "") in AUDIO_INPUTS


def audio_inputs(module: torch.nn.Module, config: Any, inputs: InputSpec, sample: int) -> dict[str, torch.Tensor]:
    """`{main input: tensor}` for a model whose main input is audio (`AUDIO_INPUTS`), else `{}`: a waveform for
    `input_values` (unless the config has mel bins: AST's frames), the features otherwise."""
    if not is_audio(module):
        return {}
    main = str(module.main_input_name)
    raw = main == "input_values" and not isinstance(getattr(config, "num_mel_bins", None), int)
    return {main: waveform(config, inputs, sample) if raw else audio_features(module, config, inputs, sample)}
