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


def test_vocab_shrinks_with_special_ids_moved_into_it_and_levels_differ() -> None:
    d = {"num_hidden_layers": 4, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096,
         "vocab_size": 200000, "image_token_id": 151655, "pad_token_id": 151643, "bos_token_id": 1,
         "text_config": {"model_type": "x", "vocab_size": 200000, "pad_token_id": 151643}}
    narrow, shallow, twice = (shrink_dict(d, lvl) for lvl in ("narrow", "shallow", "twice"))
    assert narrow["vocab_size"] == 512 and narrow["text_config"]["vocab_size"] == 512
    # moved to the top of the small vocabulary, in the same order; equal ids stay equal, small ones stay
    assert (narrow["pad_token_id"], narrow["image_token_id"], narrow["bos_token_id"]) == (510, 511, 1)
    assert narrow["text_config"]["pad_token_id"] == 510
    assert (narrow["num_attention_heads"], narrow["hidden_size"], narrow["intermediate_size"]) == (4, 256, 1024)
    assert shallow["hidden_size"] == 1024 and shallow["num_hidden_layers"] == 2 and shallow["vocab_size"] == 512
    assert twice["num_hidden_layers"] == 2 and LEVELS == ("narrow", "twice", "shallow", "default")


def test_a_parts_token_ids_stay_after_its_vocab_offset() -> None:
    """Gemma 3n: the vision tower's tokens start at `vocab_offset` (the text vocabulary's size); per-layer input
    embeddings have their own `vocab_size_per_layer_input`. Both shrink, the order of ids and offsets is kept."""
    d = {"model_type": "g", "image_token_id": 262145, "boi_token_id": 255999, "eoi_token_id": 262144,
         "text_config": {"model_type": "t", "vocab_size": 262400, "vocab_size_per_layer_input": 262144,
                         "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 2},
         "vision_config": {"model_type": "v", "vocab_size": 128, "vocab_offset": 262144}}
    s = shrink_dict(d, "narrow")
    text, vision = s["text_config"], s["vision_config"]
    assert text["vocab_size"] == 512 and text["vocab_size_per_layer_input"] == 512 and vision["vocab_size"] == 128
    assert s["boi_token_id"] < vision["vocab_offset"] == s["eoi_token_id"] < s["image_token_id"] < 512
    assert s["image_token_id"] - vision["vocab_offset"] < vision["vocab_size"]


def test_a_small_vocabulary_keeps_its_ids() -> None:
    d = {"num_hidden_layers": 2, "vocab_size": 300, "pad_token_id": 299}
    assert shrink_dict(d, "shallow")["pad_token_id"] == 299


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


def test_backbone_outputs_keep_their_count() -> None:
    """Depth Anything's neck reads 4 backbone outputs (`out_indices` [9, 10, 11, 12]): the backbone keeps 4 layers
    and outputs the last 4 stages (the derived default, one stage, failed 'number of hidden states should be equal
    to the number of neck hidden sizes'); a single output stays the last stage (DINOv2 as before)."""
    da = shrink_dict(transformers.AutoConfig.for_model("depth_anything").to_dict())
    assert da["backbone_config"]["num_hidden_layers"] == 4 and da["backbone_config"]["out_indices"] == [1, 2, 3, 4]
    assert len(da["neck_hidden_sizes"]) == 4 and "stage_names" not in da["backbone_config"]
    assert da["reassemble_hidden_size"] == da["backbone_config"]["hidden_size"] < 384  # the neck reads its width
    dino = shrink(transformers.AutoConfig.for_model("dinov2"))
    assert dino.num_hidden_layers == 2 and dino.out_indices == [2] and dino.out_features == ["stage2"]
    kept = shrink_dict({"num_hidden_layers": 12, "window_block_indexes": [0, 1, 3], "out_indices": [1, 3]})
    assert kept["num_hidden_layers"] == 2 and kept["window_block_indexes"] == [0] and kept["out_indices"] == [1, 2]
    last = shrink_dict({"num_hidden_layers": 12, "window_block_indexes": [0, 1, 3], "out_indices": [0, 2, 4]})
    assert last["out_indices"] == [0, 1, 2]  # stages 2 and 4 were cut: the stem and the last two


def test_feature_layer_indices_clamped_to_the_shrunk_tower() -> None:
    """VipLlava reads hidden states [-2, -5, -8, -11, 6] of its vision tower: clamped to the 2-layer tower's 3
    hidden states, five of them still (the projector's width is 5 × the tower's)."""
    vip = shrink_dict(transformers.AutoConfig.for_model("vipllava").to_dict())
    assert vip["vision_config"]["num_hidden_layers"] == 2 and vip["vision_feature_layer"] == [-2, -3, -3, -3, 2]
    assert shrink_dict(transformers.AutoConfig.for_model("llava").to_dict())["vision_feature_layer"] == -2


def test_stage_blocks_keep_their_stage_and_place() -> None:
    """SAM2 Hiera: blocks per stage [1, 2, 7, 2] become [1, 2, 2, 2]; global attention blocks [5, 7, 9] (inside
    stage 3) become [4], not block 5, the pooling first block of stage 4 (its window size 0 divided by zero)."""
    hiera = shrink_dict(transformers.AutoConfig.for_model("sam2_hiera_det_model").to_dict())
    assert hiera["blocks_per_stage"] == [1, 2, 2, 2] and hiera["global_attention_blocks"] == [4]


def test_vision_depth_and_merger_width_follow_the_text_model() -> None:
    """Qwen-VL vision towers count layers as `depth` (32 full-size towers were traced) with index lists named
    `*_indexes`; the merger's output width is the text model's hidden size."""
    q3 = shrink_dict(transformers.AutoConfig.for_model("qwen3_vl").to_dict())
    assert q3["vision_config"]["depth"] == 2 and q3["vision_config"]["deepstack_visual_indexes"] == [1]
    assert q3["vision_config"]["out_hidden_size"] == q3["text_config"]["hidden_size"]
    q25 = shrink_dict(transformers.AutoConfig.for_model("qwen2_5_vl").to_dict())
    assert q25["vision_config"]["depth"] == 2 and q25["vision_config"]["fullatt_block_indexes"] == [1]
    q2 = shrink_dict(transformers.AutoConfig.for_model("qwen2_vl").to_dict())  # merger out: hidden_size
    assert q2["vision_config"]["hidden_size"] == q2["text_config"]["hidden_size"] != q2["vision_config"]["embed_dim"]


def test_layers_that_reuse_an_earlier_layers_cache_keep_a_producer_of_each_type() -> None:
    """Gemma 3n: the last `num_kv_shared_layers` layers reuse the KV cache of the last earlier layer of their type;
    the config refuses a cut where a type is used and never produced."""
    types = ["sliding_attention"] * 4 + ["full_attention"]
    d = {"num_hidden_layers": 35, "layer_types": types * 7, "num_kv_shared_layers": 15}
    s = shrink_dict(d, "narrow")
    n, k = s["num_hidden_layers"], s["num_kv_shared_layers"]
    assert (n, k) == (4, 2)
    producers, users = s["layer_types"][:n - k], s["layer_types"][n - k:]
    assert set(producers) == set(users) == {"sliding_attention", "full_attention"}
