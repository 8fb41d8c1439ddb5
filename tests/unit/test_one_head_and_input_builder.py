"""Issue 38: `config:` and the zoo build the same head and the same inputs for every family of the zoo: one choice
of head (`zoo.catalog.head_of`, the zoo's `HEADS` order) and one input builder (`models.synth.forward_inputs`
behind `models.load.build_inputs`). One small architecture per family, built on `meta` (no weights)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ci_runner.config import InputSpec, ModelSpec  # noqa: E402
from ci_runner.models.load import build_inputs, load_model  # noqa: E402
from ci_runner.zoo.catalog import FAMILIES, catalog, head_config  # noqa: E402
from ci_runner.zoo.inputs import zoo_inputs  # noqa: E402

SPEC = InputSpec(batch=1, seq_len=8, samples=1, seed=2)
TEXT = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 64}
# model_type -> tiny overrides; one per family at least, and gemma3, whose head the old `config:` order chose
# differently (image-text before causal-lm; the zoo's order has causal-lm first)
TINY: dict[str, dict[str, Any]] = {
    "llama": TEXT,
    "mixtral": {**TEXT, "num_local_experts": 4, "num_experts_per_tok": 2},
    "mamba": {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "state_size": 4},
    "bert": {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 32},
    "vit": {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32,
            "image_size": 32, "patch_size": 8},
    "whisper": {"d_model": 16, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
                "decoder_attention_heads": 2, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "num_mel_bins": 8,
                "max_source_positions": 16, "vocab_size": 64, "pad_token_id": 0, "bos_token_id": 1,
                "eos_token_id": 2, "decoder_start_token_id": 1},
    "llava": {"vision_config": {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
              "text_config": {"model_type": "llama", **TEXT}, "image_token_index": 63},
    "gemma3": {"text_config": {"model_type": "gemma3_text", **TEXT, "head_dim": 8},
               "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                                 "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32,
                                 "patch_size": 8}, "mm_tokens_per_image": 4},
    "t5": {"d_model": 16, "d_ff": 32, "d_kv": 8, "num_heads": 2, "num_layers": 1, "num_decoder_layers": 1,
           "vocab_size": 64},
}


def _shapes(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


def test_config_and_the_zoo_build_the_same_head_and_inputs_for_every_family() -> None:
    entries = catalog(TINY)
    assert {e.family for e in entries} == set(FAMILIES), "one architecture of every family of the zoo"
    for entry in entries:
        loaded = load_model(ModelSpec(id=entry.model_type, config=entry.model_type, overrides=TINY[entry.model_type]),
                            meta=True)
        assert (loaded.task, type(loaded.module).__name__) == (entry.task, entry.class_name), entry.model_type
        # the zoo's own build (zoo/scan.py): its head class from the same config, its inputs
        cls = getattr(transformers, entry.class_name)
        config = head_config(cls, transformers.AutoConfig.for_model(entry.model_type, **TINY[entry.model_type]))
        with torch.device("meta"):
            module = cls._from_config(config).eval()
        zoo = zoo_inputs(module, config, model_type=entry.model_type, task=entry.task, inputs=SPEC)
        ours = build_inputs(loaded, SPEC)
        assert _shapes(ours) == _shapes(zoo), entry.model_type
        assert all(torch.equal(ours[k], zoo[k]) for k, v in zoo.items() if isinstance(v, torch.Tensor)), entry.model_type
