"""Zoo small configs: every layer kind of a hybrid / alternating / MoE config survives the shrinking."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ci_runner.zoo.shrink import LEVELS, layer_kinds, shrink, shrink_dict  # noqa: E402


def _layer_classes(model: torch.nn.Module) -> set[str]:
    """The class names under each decoder layer (its kind), over all layers."""
    layers = next(m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList))
    return {type(sub).__name__ for layer in layers for sub in layer.modules()}


def _build(cls_name: str, config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return getattr(transformers, cls_name)._from_config(config)


SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128}
# (model_type, head class, a full-depth config with several layer kinds, narrow so the test stays fast)
CASES = [
    ("jamba", "JambaForCausalLM", {**SMALL, "num_hidden_layers": 16, "num_experts": 4, "mamba_d_state": 4,
                                   "mamba_expand": 2, "mamba_dt_rank": 8}),
    ("bamba", "BambaForCausalLM", {**SMALL, "num_hidden_layers": 12, "attn_layer_indices": [3, 9],
                                   "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8,
                                   "mamba_n_groups": 1, "mamba_expand": 2}),
    ("zamba2", "Zamba2ForCausalLM", {**SMALL, "num_hidden_layers": 12, "mamba_d_state": 8, "n_mamba_heads": 8,
                                     "layers_block_type": ["hybrid" if i in (3, 9) else "mamba" for i in range(12)], "mamba_headdim": 16,
                                     "attention_hidden_size": 128}),
    ("qwen2_moe", "Qwen2MoeForCausalLM", {**SMALL, "num_hidden_layers": 8, "num_experts": 4,
                                          "mlp_only_layers": [0, 5], "moe_intermediate_size": 32,
                                          "shared_expert_intermediate_size": 32}),
    ("deepseek_v3", "DeepseekV3ForCausalLM", {**SMALL, "num_hidden_layers": 10, "first_k_dense_replace": 3,
                                              "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
                                              "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                              "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                                              "qk_nope_head_dim": 8, "v_head_dim": 8}),
]


@pytest.mark.parametrize(("model_type", "cls_name", "kw"), CASES, ids=[c[0] for c in CASES])
def test_every_layer_kind_survives(model_type: str, cls_name: str, kw: dict[str, Any]) -> None:
    full = transformers.AutoConfig.for_model(model_type, **kw)
    small = shrink(full, "narrow")
    assert small.num_hidden_layers < full.num_hidden_layers
    assert _layer_classes(_build(cls_name, small)) == _layer_classes(_build(cls_name, full))


def test_gemma3_keeps_sliding_and_full_attention() -> None:
    full = transformers.AutoConfig.for_model("gemma3_text")  # 26 layers: 5 sliding, 1 full, repeated
    small = shrink(full, "narrow")
    assert set(small.layer_types) == set(full.layer_types) == {"sliding_attention", "full_attention"}
    assert small.num_hidden_layers == len(small.layer_types) == 2
    assert small.vocab_size < full.vocab_size and small.hidden_size < full.hidden_size
    assert small.head_dim == full.head_dim  # head dims (RoPE) kept; fewer heads instead
    assert small.num_attention_heads // small.num_key_value_heads == full.num_attention_heads // full.num_key_value_heads


def test_first_k_dense_and_rules() -> None:
    d = {"num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "num_experts_per_tok": 8,
         "n_group": 8, "topk_group": 4, "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1}
    s = shrink_dict(d, "shallow")
    assert (s["num_hidden_layers"], s["first_k_dense_replace"]) == (2, 1)  # one dense, one MoE layer
    assert (s["n_routed_experts"], s["num_experts_per_tok"], s["n_group"], s["topk_group"]) == (4, 2, 1, 1)
    assert s["vocab_size"] == 512
    # a period rule cannot be cut layer by layer: the shortest prefix with every kind is kept (Jamba: layer 0
    # plain, 1 with experts, 4 with attention)
    j = shrink_dict({"num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4,
                     "expert_layer_period": 2, "expert_layer_offset": 1}, "narrow")
    assert j["num_hidden_layers"] == 5
    kinds, ruled = layer_kinds(j, 5)
    assert ruled and len(set(kinds)) == 3


def test_vocab_keeps_special_ids_and_levels_differ() -> None:
    d = {"num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096,
         "vocab_size": 200000, "image_token_id": 151655, "text_config": {"model_type": "x", "vocab_size": 200000}}
    narrow, shallow, twice = (shrink_dict(d, lvl) for lvl in ("narrow", "shallow", "twice"))
    assert narrow["vocab_size"] == 151656 and narrow["text_config"]["vocab_size"] == 151656  # the image token fits
    assert (narrow["num_attention_heads"], narrow["hidden_size"], narrow["intermediate_size"]) == (4, 256, 1024)
    assert shallow["hidden_size"] == 1024 and shallow["num_hidden_layers"] == 2
    assert twice["num_hidden_layers"] == 2 and LEVELS == ("narrow", "twice", "shallow", "default")


def test_part_layer_counts_and_loops_shrink() -> None:
    """HRM (stacks × cycles) and Dory (input / recurrent / output layers) were traced unrolled at full count and
    ran past the per-model limit: their part counts and loops shrink like the encoder / decoder layer counts."""
    hrm = shrink_dict({"num_hidden_layers": 128, "num_layers_per_stack": 16, "H_cycles": 2, "L_cycles": 3,
                       "hidden_size": 1536, "num_attention_heads": 12, "head_dim": 128})
    assert (hrm["num_layers_per_stack"], hrm["H_cycles"], hrm["L_cycles"]) == (2, 2, 2)
    dory = shrink_dict({"num_hidden_layers": 72, "n_input_layers": 16, "n_recurrent_layers": 40,
                        "n_output_layers": 16, "n_recurrent_loops": 2})
    assert (dory["n_input_layers"], dory["n_recurrent_layers"], dory["n_output_layers"]) == (2, 2, 2)
    assert dory["n_recurrent_loops"] == 2


def test_tied_names_of_hidden_size_and_layer_count_follow_them() -> None:
    """xLSTM names its width twice (`hidden_size`, `embedding_dim`) and its depth twice (`num_hidden_layers`,
    `num_blocks`): a narrowed `hidden_size` alone did not broadcast against the full `embedding_dim`."""
    x = shrink_dict({"hidden_size": 4096, "embedding_dim": 4096, "num_heads": 8, "num_hidden_layers": 32,
                     "num_blocks": 32, "vocab_size": 50304})
    assert x["embedding_dim"] == x["hidden_size"] < 4096 and x["num_blocks"] == x["num_hidden_layers"] < 32
