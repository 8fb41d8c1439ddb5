"""Inputs from a model's forward: the one input builder of `config:` models and the zoo's architectures.

`models.load.build_inputs` feeds every `config:` model through `forward_inputs`, and the zoo
(`zoo/inputs.zoo_inputs`) calls `build_inputs` on the model it built: the two model paths get the same tensors.
Text, vision and Llava-style image-text inputs come from the basic builder (`basic(task)`, which is
`models.load.basic_inputs`), audio from `models.audio`; this module picks that builder's task from the model's
`main_input_name` and adds what it does not make: the other towers of a multi-tower model, the decoder side of an
encoder-decoder (`decoder_input_ids`), packed-patch and sized images, video frames; then keeps only what the forward
takes. A forward argument that is required and not made here is a `MissingInputError` naming it (the zoo's scan
lists the architecture with that reason).

Packed-patch vision (Qwen-VL style: a forward that takes `image_grid_thw`, or an encoder that takes `grid_thw`):
one image of `GRID_MERGES` × `GRID_MERGES` merged patches, `pixel_values` flattened to (patches, C·T·P·P), as
many image tokens in `input_ids` as merged patches (`spatial_merge_size`), `mm_token_type_ids`, and what
transformers' own export preparer (`transformers.exporters.utils.precompute_export_inputs`) precomputes from the
grid: the 3-D RoPE `position_ids` and the encoder's `cu_seqlens` / `position_ids` / ... (prefixed `image_` for
the whole model), which the model would otherwise compute with data-dependent ops (`grid_thw.tolist()`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..config import InputSpec
from ..errors import DeepviewError
from .audio import audio_features

__all__ = ["DECODER_LEN", "DEFAULT_VOCAB", "GRID_MERGES", "MissingInputError", "PackedImage", "builder_task",
           "decoder_input_ids", "forward_inputs", "packed_image"]

DEFAULT_VOCAB = 256
GRID_MERGES = 2  # packed-patch images: merged patches per side
DECODER_LEN = 8  # decoder_input_ids of an encoder-decoder (`decoder_input_ids`): the zoo's and `config:`'s

Basic = Callable[[str], dict[str, Any]]  # the basic builder for a task: `models.load.basic_inputs`


class MissingInputError(DeepviewError):
    """No synthetic input for an argument the architecture's forward requires."""


def decoder_input_ids(config: Any, inputs: InputSpec, sample: int) -> torch.Tensor:
    """The decoder side of an encoder-decoder: `DECODER_LEN` seeded ids within the decoder's vocabulary (the one
    builder of `config:` models and the zoo's)."""
    dec = getattr(config, "decoder", None) or getattr(config, "text_config", None) or config
    vocab = int(getattr(dec, "vocab_size", None) or getattr(config, "vocab_size", None) or 2)
    gen = torch.Generator().manual_seed(inputs.seed * 104729 + sample)
    return torch.randint(0, max(2, vocab), (inputs.batch, DECODER_LEN), generator=gen)


def _params(module: torch.nn.Module) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return {}


def builder_task(task: str | None, main: str) -> str:
    """The basic builder's task for a head (`models.load.basic_inputs`): what feeds its main input."""
    if main == "pixel_values":
        return "image-text" if task == "image-text" else "image-classification"
    if task in ("image-text", "causal-lm", "seq2seq"):
        return task
    return "base"


def _default_vocab(config: Any) -> None:
    """Token ids for a config that names no vocabulary (CANINE reads code points, Bark's sub-models): the first
    `DEFAULT_VOCAB` ids."""
    text = getattr(config, "text_config", None) or config
    if not getattr(text, "vocab_size", None):
        try:
            text.vocab_size = DEFAULT_VOCAB
        except (AttributeError, TypeError, ValueError):
            pass


def _other_towers(kwargs: dict[str, Any], module: torch.nn.Module, config: Any, params: dict[str, inspect.Parameter],
                  *, basic: Basic, inputs: InputSpec, sample: int) -> None:
    """Dual-encoder models (CLIP, ALIGN, CLAP): the tower the main input does not feed, when the forward names
    its input and the config has that tower."""
    towers = (("input_ids", "text_config", "base"), ("pixel_values", "vision_config", "image-classification"))
    for name, sub, task in towers:
        if name in kwargs or name not in params or getattr(config, sub, None) is None:
            continue
        built = basic(task)
        kwargs.update({k: v for k, v in built.items() if k not in kwargs and k != "interpolate_pos_encoding"})
    if "input_features" in params and "input_features" not in kwargs and getattr(config, "audio_config", None):
        kwargs["input_features"] = audio_features(module, config.audio_config, inputs, sample)


def _first_int(cfg: Any, keys: tuple[str, ...], default: int) -> int:
    for k in keys:
        v = getattr(cfg, k, None)
        if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) for x in v):
            return int(max(v))
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return int(v)
    return default


def _image_token(config: Any) -> int | None:
    for cfg in (config, getattr(config, "text_config", None)):
        for k in ("image_token_id", "image_token_index", "image_pad_token_id"):
            v = getattr(cfg, k, None) if cfg is not None else None
            if isinstance(v, int) and v >= 0:
                return v
    return None


def _per_patch(encoder: torch.nn.Module) -> bool:
    """Whether the encoder's patch embedding is a Conv2d applied to the patches as they come (Kimi-K2.5,
    PaddleOCR-VL: (patches, C, P, P)) rather than a Conv3d / Linear on flattened ones (Qwen-VL)."""
    first = next((m for m in encoder.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Linear))),
                 None)
    return isinstance(first, torch.nn.Conv2d)


@dataclass(frozen=True, kw_only=True)
class PackedImage:
    """One packed-patch image per batch row."""

    grid_thw: torch.Tensor  # (batch, 3): (1, h, w) patches
    pixel_values: torch.Tensor  # (batch·h·w, C·T·P·P), or (batch·h·w, C, P, P) per patch
    merge: int  # the spatial merge size: merge² patches make one token
    tokens: int  # merged patches per image: the image tokens its text holds


def packed_image(config: Any, batch: int, gen: torch.Generator, *, per_patch: bool = False) -> PackedImage:
    """`GRID_MERGES` × `GRID_MERGES` merged patches per image, from the (vision) config's patch, temporal patch and
    merge sizes and channels."""
    vis = getattr(config, "vision_config", None) or config
    patch = _first_int(vis, ("patch_size",), 14)
    temporal = _first_int(vis, ("temporal_patch_size",), 1)
    channels = _first_int(vis, ("in_channels", "num_channels", "in_chans"), 3)
    merge = _first_int(vis, ("spatial_merge_size", "merge_size", "merge_kernel_size"), 1)
    side = GRID_MERGES * merge
    grid = torch.tensor([[1, side, side]] * batch)
    shape = (channels, patch, patch) if per_patch else (channels * temporal * patch * patch,)
    pixels = torch.randn((batch * side * side, *shape), generator=gen)
    return PackedImage(grid_thw=grid, pixel_values=pixels, merge=merge, tokens=GRID_MERGES * GRID_MERGES)


def _precompute(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """transformers' export preparer on `kwargs` (in place), when this transformers has it. Best effort: where it
    fails (Qwen2.5-Omni's rope index reads a token id its config lacks) the model computes the same itself, and
    its trace says what that costs."""
    try:
        from transformers.exporters.utils import precompute_export_inputs  # deferred: transformers is heavy
    except ImportError:
        return
    tried = dict(kwargs)
    try:
        precompute_export_inputs(module, tried)
    except Exception:  # noqa: BLE001 - any error of the model's own helper: leave the inputs as they were
        return
    kwargs.update(tried)


def _grid_inputs(kwargs: dict[str, Any], module: torch.nn.Module, config: Any, params: dict[str, inspect.Parameter],
                 *, inputs: InputSpec, sample: int) -> None:
    """Packed-patch vision inputs (see the module docstring), in place of the Llava-style ones."""
    gen = torch.Generator().manual_seed(inputs.seed * 15485863 + sample)
    encoder = module.get_encoder(modality="image") if hasattr(module, "get_encoder") else None
    encoder = encoder if encoder is not None else module
    image = packed_image(config, inputs.batch, gen, per_patch=_per_patch(encoder))
    if "image_grid_thw" not in params:  # the vision encoder alone: forward(hidden_states | pixel_values, grid_thw)
        name = next((n for n in ("hidden_states", "pixel_values") if n in params), "pixel_values")
        enc = {name: image.pixel_values, "grid_thw": image.grid_thw}
        if "merge_sizes" in params:  # Video-LLaMA 3
            enc["merge_sizes"] = torch.full((inputs.batch,), image.merge)
        _precompute(module, enc)
        kwargs.clear()
        kwargs.update({k: v for k, v in enc.items() if v is not None})
        return
    token = _image_token(config)
    ids = kwargs.get("input_ids")
    if token is None or ids is None:
        return
    text = ids[:, (ids[0] != token)]
    ids = torch.cat([torch.full((inputs.batch, image.tokens), token, dtype=ids.dtype), text], dim=1)
    kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=image.pixel_values,
                  image_grid_thw=image.grid_thw)
    if "mm_token_type_ids" in params:
        kwargs["mm_token_type_ids"] = (ids == token).to(torch.int32)
    merges = torch.full((inputs.batch,), image.merge)
    if "image_merge_sizes" in params:  # Video-LLaMA 3: the merge size per image, an input
        kwargs["image_merge_sizes"] = merges
    rope = next((m for m in (module, getattr(module, "model", None)) if hasattr(m, "get_rope_index")), None)
    if rope is not None:
        _precompute(rope, kwargs)
    if encoder is not module:
        pre = {"grid_thw": image.grid_thw, **({"merge_sizes": merges} if "image_merge_sizes" in params else {})}
        _precompute(encoder, pre)
        kwargs.update({f"image_{k}": v for k, v in pre.items()
                       if k not in ("grid_thw", "merge_sizes") and v is not None})


def _sized_images(kwargs: dict[str, Any], config: Any, params: dict[str, inspect.Parameter], *, inputs: InputSpec,
                  sample: int) -> None:
    """Pixtral-style image-text models (Mistral 3, LightOnOCR: a forward that takes `image_sizes`, a config with a
    top-level `spatial_merge_size`): images of `GRID_MERGES` × `GRID_MERGES` merged patches, their sizes as Python
    ints (what transformers' export preparer turns the processor's tensor into), as many image tokens as merged
    patches."""
    vis = getattr(config, "vision_config", None)
    merge, token, ids = getattr(config, "spatial_merge_size", None), _image_token(config), kwargs.get("input_ids")
    if vis is None or not isinstance(merge, int) or token is None or ids is None or "pixel_values" not in kwargs:
        return
    side = _first_int(vis, ("patch_size",), 14) * merge * GRID_MERGES
    gen = torch.Generator().manual_seed(inputs.seed * 15485863 + sample)
    channels = int(kwargs["pixel_values"].shape[1])
    text = ids[:, (ids[0] != token)]
    ids = torch.cat([torch.full((inputs.batch, GRID_MERGES * GRID_MERGES), token, dtype=ids.dtype), text], dim=1)
    kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids), image_sizes=[(side, side)] * inputs.batch,
                  pixel_values=torch.randn((inputs.batch, channels, side, side), generator=gen))


def _video_frames(kwargs: dict[str, Any], config: Any) -> None:
    """Video models (VideoMAE, ViViT, TimeSformer, X-CLIP: a config with `num_frames`, at the top or in its vision
    config): `pixel_values` of (batch, frames, C, H, W), each frame the built image."""
    pixels = kwargs.get("pixel_values")
    frames = next((getattr(c, "num_frames", None) for c in (config, getattr(config, "vision_config", None))
                   if isinstance(getattr(c, "num_frames", None), int)), None)
    if isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and frames and frames > 0:
        kwargs["pixel_values"] = pixels.unsqueeze(1).expand(-1, frames, -1, -1, -1).contiguous()


def forward_inputs(module: torch.nn.Module, config: Any, *, model_type: str, task: str | None, inputs: InputSpec,
                   sample: int, basic: Basic) -> dict[str, Any]:
    """Keyword arguments for `module(**kwargs)` (CPU tensors) from the names its forward takes; `basic(task)` is
    the basic builder for a task (text, vision, Llava-style image-text, audio)."""
    params = _params(module)
    main = str(getattr(module, "main_input_name", "input_ids") or "input_ids")
    _default_vocab(config)
    kwargs: dict[str, Any] = dict(basic(builder_task(task, main)))  # audio first, when the main input is audio
    _other_towers(kwargs, module, config, params, basic=basic, inputs=inputs, sample=sample)
    pixels = params.get("pixel_values")
    if pixels is not None and pixels.default is inspect.Parameter.empty and "pixel_values" not in kwargs:
        # a vision tower whose main input is not named (Idefics3's, Step3.5's): the image classifier's pixels
        kwargs["pixel_values"] = basic("image-classification")["pixel_values"]
    if "image_grid_thw" in params or "grid_thw" in params:
        _grid_inputs(kwargs, module, config, params, inputs=inputs, sample=sample)
    elif "image_sizes" in params and task == "image-text":
        _sized_images(kwargs, config, params, inputs=inputs, sample=sample)
    else:
        _video_frames(kwargs, config)
    if "decoder_input_ids" in params and (getattr(config, "is_encoder_decoder", False) or task in ("seq2seq", "speech-seq2seq")):
        kwargs.setdefault("decoder_input_ids", decoder_input_ids(config, inputs, sample))
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in kwargs.items() if k in params or takes_any}
    missing = [n for n, p in params.items() if n != "self" and p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in kwargs]
    if missing:
        raise MissingInputError(f"{model_type}: the forward requires {', '.join(repr(m) for m in missing)}, which "
                                f"no input builder synthesises")
    if main not in kwargs and main in params:
        raise MissingInputError(f"{model_type}: no synthetic {main!r} (its main input)")
    return kwargs
