"""Small configs from an architecture's default config, with every distinct layer kind kept.

`shrink(config, level)` works on the config's dict and rebuilds the config from it (so `__init__` re-derives what
it derives). Four levels, tried in this order by the scan:

* ``narrow``: few layers, fewer heads (head dim kept: RoPE sections, partial rotary and GQA ratios stay valid),
  the hidden size following the heads, feed-forward sizes scaled by the same factor, few experts, small vocab.
* ``twice``: as ``narrow`` with two layers of each kind (Zamba ties weights across its hybrid layers).
* ``shallow``: only layers, experts and vocab; every width as in the default config.
* ``default``: the default config itself, unchanged (when no shrunk config builds).

Layers: each layer index gets a *kind*, the tuple of everything per-layer in the config (`layer_types`-style
lists, index lists such as `attn_layer_indices` / `hybrid_layer_ids` / `mlp_only_layers`, `first_k_dense_replace`,
period/offset and step rules as in Jamba, Zamba, Qwen2-MoE, Llama 4). When every per-layer item is a list, the
first layer of each kind is kept and the lists are cut to those layers; a rule (period, step) cannot be cut that
way, so the shortest prefix that holds every kind is kept instead. `first_k_dense_replace` becomes 1 first.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

# level → (narrow widths, layers kept per kind)
LEVEL_RULES: dict[str, tuple[bool, int]] = {"narrow": (True, 1), "twice": (True, 2), "shallow": (False, 1)}
LEVELS: tuple[str, ...] = (*LEVEL_RULES, "default")
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "depth")  # depth: Qwen-VL vision towers
SIDE_LAYER_KEYS = ("encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers", "text_layers",
                   "vision_layers", "num_decoder_layer",
                   # layer counts of a model's parts and loops over the same layers (HRM's stacks and cycles,
                   # Dory's input / recurrent / output layers): traced unrolled, so a full count ran past the limit
                   "num_layers_per_stack", "n_input_layers", "n_recurrent_layers", "n_output_layers",
                   "H_cycles", "L_cycles", "n_recurrent_loops")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
             "n_heads", "attention_heads")
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "num_key_value_groups_heads")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "model_dim", "dim")
# other names of the hidden size, narrowed with it where they equal it (xLSTM's `embedding_dim`)
TIED_HIDDEN_KEYS = ("embedding_dim",)
# other names of the layer count, cut with it where they equal it (xLSTM's `num_blocks`)
TIED_LAYER_KEYS = ("num_blocks",)
FFN_KEYS = ("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
            "moe_intermediate_size", "shared_expert_intermediate_size", "ffn_hidden_size", "expert_intermediate_size",
            "decoder_intermediate_size", "mlp_dim", "moe_ffn_hidden_size")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k", "top_k", "num_selected_experts")
VOCAB_KEYS = ("vocab_size", "decoder_vocab_size", "target_vocab_size")
SMALL_VOCAB = 512
# special token ids (pad, image, boi ...) and where a part's token ids start (Gemma 3n's vision / audio embedders)
SPECIAL_SUFFIXES = ("_token_id", "_token_index", "_token_ids", "_id")
OFFSET_KEYS = ("vocab_offset",)
# per-layer rules: (period key, offset key) → layer i matches when i % period == offset
PERIOD_RULES = (("attn_layer_period", "attn_layer_offset"), ("expert_layer_period", "expert_layer_offset"))
# step rules: key → layer i matches when (i + 1) % step == 0 (and i % step == 0, both kept in the kind)
STEP_RULES = ("decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_freq", "sliding_window_pattern",
              "_sliding_window_pattern", "global_attn_every_n_layers", "no_rope_layer_interval", "sparse_step",
              "moe_every_k_layers", "cross_attention_every_n_layers", "global_layer_every")
# tail rules: key → the last `d[key]` layers are of their own kind (Gemma 3n / 4: layers reusing an earlier
# layer's KV cache, which must keep a producer of every layer type before them)
TAIL_RULES = ("num_kv_shared_layers",)
# rules a config turns into its `layer_types` list in `__init__`: redundant once that list is there
PATTERN_RULES = ("sliding_window_pattern", "_sliding_window_pattern", "global_attn_every_n_layers",
                 "no_rope_layer_interval")
DERIVED_LISTS = ("layer_types", "layers_block_type")
INDEX_HINTS = ("layer", "idx", "indices", "indexes", "ids")
# a backbone's outputs, by stage (0: the stem; i: layer i - 1), not a list of layers of one kind
BACKBONE_KEYS = ("out_features", "out_indices", "_out_features", "_out_indices", "stage_names")


def _is_config_dict(key: str, value: Any) -> bool:
    return isinstance(value, dict) and (("model_type" in value) or key.endswith("_config") or key in ("encoder", "decoder"))


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_count(d: Mapping[str, Any]) -> tuple[str, int] | None:
    for k in LAYER_KEYS:
        if _int(d.get(k)) and d[k] > 0:
            return k, int(d[k])
    return None


def _is_index_list(key: str, v: Any, n: int) -> bool:
    """A list of layer indices (`attn_layer_indices`, `moe_layers`, `full_attn_idxs`, `hybrid_layer_ids`)."""
    return (isinstance(v, list) and bool(v) and any(h in key for h in INDEX_HINTS) and key not in BACKBONE_KEYS
            and all(_int(x) and 0 <= x < n for x in v) and len(set(v)) == len(v)
            and not (set(v) <= {0, 1} and len(v) == n))


def _per_layer_lists(d: Mapping[str, Any], n: int) -> list[str]:
    """Lists with one entry per layer (`layer_types`, `layers_block_type`, `no_rope_layers`) and pattern strings
    (`hybrid_override_pattern`)."""
    if n <= 1:
        return []
    return [k for k, v in d.items() if k != "architectures" and not _is_index_list(k, v, n)
            and ((isinstance(v, list) and len(v) == n)
                 or (isinstance(v, str) and len(v) == n and ("pattern" in k or "layer" in k)))]


def _index_lists(d: Mapping[str, Any], n: int, lists: list[str]) -> list[str]:
    return [k for k, v in d.items() if k not in lists and _is_index_list(k, v, n)]


def layer_kinds(d: Mapping[str, Any], n: int) -> tuple[list[tuple[Any, ...]], bool]:
    """The kind of each of the `n` layers, and whether a rule (not a list) decides some of it."""
    lists = _per_layer_lists(d, n)
    index = _index_lists(d, n, lists)
    derived = any(k in lists for k in DERIVED_LISTS)  # the list the rules below were turned into
    rules = [(p, o) for p, o in PERIOD_RULES if _int(d.get(p)) and d[p] > 0 and not derived]
    steps = [k for k in STEP_RULES if _int(d.get(k)) and d[k] > 1 and not (derived and k in PATTERN_RULES)]
    dense = int(d["first_k_dense_replace"]) if _int(d.get("first_k_dense_replace")) else None
    tails = [k for k in TAIL_RULES if _int(d.get(k)) and d[k] > 0]
    kinds = []
    for i in range(n):
        kind: list[Any] = [str(d[k][i]) for k in lists]
        kind += [i in d[k] for k in index]
        kind += [i % d[p] == int(d.get(o) or 0) for p, o in rules]
        kind += [((i + 1) % d[k] == 0, i % d[k] == 0) for k in steps]
        if dense is not None:
            kind.append(i < dense)
        kind += [i >= n - d[k] for k in tails]
        kinds.append(tuple(kind))
    return kinds, bool(rules or steps)


def _keep_layers(d: dict[str, Any], key: str, n: int, per_kind: int, at_least: int = 2) -> list[int]:
    """Cut the layers of one config dict to `per_kind` of each kind (at least `at_least`, 2 by default, when there
    were that many); the old indices of the layers kept."""
    if _int(d.get("first_k_dense_replace")) and d["first_k_dense_replace"] > 1:
        d["first_k_dense_replace"] = 1
    kinds, ruled = layer_kinds(d, n)
    first: dict[tuple[Any, ...], list[int]] = {}
    for i, k in enumerate(kinds):
        if len(first.setdefault(k, [])) < per_kind:
            first[k].append(i)
    chosen = [i for found in first.values() for i in found]
    keep = list(range(max(chosen) + 1)) if ruled else sorted(chosen)
    if len(keep) < min(at_least, n):
        keep = _pad_keep(keep, min(at_least, n))
    lists = _per_layer_lists(d, n)
    index = _index_lists(d, n, lists)
    for k in lists:
        v = d[k]
        d[k] = "".join(v[i] for i in keep) if isinstance(v, str) else [v[i] for i in keep]
    for k in TAIL_RULES:
        if _int(d.get(k)) and d[k] > 0:
            d[k] = sum(1 for i in keep if i >= n - d[k])
    remap = {old: new for new, old in enumerate(keep)}
    for k in index:
        d[k] = [remap[x] for x in d[k] if x in remap]
    for k, v in list(d.items()):  # per-layer dicts keyed by index (`per_layer_config: {"02": {...}}`)
        if isinstance(v, dict) and v and k not in ("id2label", "label2id") \
                and all(str(x).isdigit() and int(x) < n for x in v):
            d[k] = {(str(remap[int(x)]).zfill(len(str(x))) if isinstance(x, str) else remap[int(x)]): y
                    for x, y in v.items() if int(x) in remap}
    d[key] = len(keep)
    return keep


def _pad_keep(keep: list[int], count: int) -> list[int]:
    """`keep` and the first layers not in it, up to `count` layers."""
    extra = [i for i in range(count + len(keep)) if i not in keep]
    return sorted(keep + extra[:count - len(keep)])


def _stage_outputs(d: Mapping[str, Any]) -> list[int] | None:
    """A backbone's output stages (`out_indices`: 0 the stem, i the output of layer i - 1), when all are given as
    non-negative numbers."""
    for k in ("out_indices", "_out_indices"):
        v = d.get(k)
        if isinstance(v, (list, tuple)) and v and all(_int(x) and x >= 0 for x in v):
            return [int(x) for x in v]
    return None


def _remap_stages(d: dict[str, Any], stages: list[int] | None, keep: list[int]) -> None:
    """Backbone outputs named by layer: the same stages where their layers were kept, else the last ones (as many
    as before: a neck reads one feature map per output). The config derives the names again."""
    for k in BACKBONE_KEYS:
        d.pop(k, None)
    if not stages:
        return  # the config's default (the last stage)
    remap = {old + 1: new + 1 for new, old in enumerate(keep)} | {0: 0}
    moved = [remap.get(s) for s in stages]
    if None in moved or len(set(moved)) != len(moved):
        n, count = len(keep), len([s for s in stages if s > 0])
        moved = ([0] if 0 in stages else []) + list(range(n - count + 1, n + 1))
    d["out_indices"] = moved


# hidden-state indices of a vision tower read by the model around it (Llava's -2, VipLlava's [-2, -5, -8, -11, 6])
FEATURE_LAYER_KEYS = ("vision_feature_layer", "vision_feature_layers", "feature_layer", "feature_layers")


def _clamp_feature_layers(d: dict[str, Any]) -> None:
    """Hidden-state indices into the (shrunk) vision tower, clamped to its `layers + 1` hidden states (the count
    of indices kept: a projector reads one feature map per index)."""
    vision = d.get("vision_config")
    counted = _layer_count(vision) if isinstance(vision, dict) else _layer_count(d)
    if counted is None:
        return
    top = counted[1]
    clamp = lambda i: max(-(top + 1), min(top, i))  # noqa: E731
    for k in FEATURE_LAYER_KEYS:
        v = d.get(k)
        if _int(v):
            d[k] = clamp(v)
        elif isinstance(v, list) and v and all(_int(x) for x in v):
            d[k] = [clamp(x) for x in v]


STAGE_KEYS = ("depths", "encoder_layers_per_stage", "num_layers_per_stage", "num_block_repeats", "blocks_per_stage",
              "stage_depths", "num_blocks", "block_repeats")


def _remap_stage_blocks(d: dict[str, Any], old: list[int], new: list[int]) -> None:
    """Block index lists counted over all stages (SAM2 Hiera's `global_attention_blocks`) after the blocks per
    stage were cut from `old` to `new`: each index keeps its stage and, clamped, its place in it (a stage's first
    block, which pools, stays the only first one: a global block there divided by a window size of 0)."""
    total = sum(old)
    starts_old = [sum(old[:i]) for i in range(len(old))]
    starts_new = [sum(new[:i]) for i in range(len(new))]
    for k, v in list(d.items()):
        if not k.endswith("_blocks") or "num" in k or "stage" in k or not isinstance(v, list) or not v \
                or len(v) == len(old) or not all(_int(x) and 0 <= x < total for x in v):
            continue
        moved = []
        for x in v:
            stage = max(i for i, start in enumerate(starts_old) if start <= x)
            place = min(x - starts_old[stage], new[stage] - 1)
            moved.append(starts_new[stage] + place)
        d[k] = sorted(set(moved))


def _is_special_key(k: str) -> bool:
    return k.endswith(SPECIAL_SUFFIXES) or k in OFFSET_KEYS


def _special_max(d: Mapping[str, Any]) -> int:
    top = -1
    for k, v in d.items():
        if _is_special_key(k):
            for x in (v if isinstance(v, (list, tuple)) else [v]):
                if _int(x):
                    top = max(top, x)
    return top


def _walk_specials(d: dict[str, Any], mapping: Mapping[int, int] | None, found: set[int]) -> None:
    """Collect the special token ids of `d` and its parts into `found`, or replace them by `mapping`."""
    for k, v in d.items():
        if _is_config_dict(k, v):
            _walk_specials(v, mapping, found)
        elif _is_special_key(k) and (_int(v) or isinstance(v, (list, tuple))):
            xs = v if isinstance(v, (list, tuple)) else [v]
            found.update(x for x in xs if _int(x))
            if mapping is not None:
                new = [mapping.get(x, x) if _int(x) else x for x in xs]
                d[k] = new if isinstance(v, (list, tuple)) else new[0]


def _big_vocab(d: Mapping[str, Any]) -> bool:
    return any((_is_vocab_key(k) and _int(v) and v > SMALL_VOCAB) or (_is_config_dict(k, v) and _big_vocab(v))
               for k, v in d.items())


def _remap_specials(d: dict[str, Any]) -> None:
    """Special token ids past the small vocabulary moved to its top, in the same order: a default config's ids
    (151655 for Qwen's image token, Gemma 3n's `vocab_offset` 262144 where its vision tokens start) would keep the
    embedding and the LM head at full vocabulary size (a 262144 x 8960 embedding is 9.4 GB to probe). Ids below it
    stay; ids that were equal stay equal, and a part's ids stay after its `vocab_offset`."""
    found: set[int] = set()
    _walk_specials(d, None, found)
    big = sorted(x for x in found if x >= SMALL_VOCAB)
    if not big or not _big_vocab(d):
        return
    free = [i for i in range(SMALL_VOCAB - 1, SMALL_VOCAB // 2, -1) if i not in found][:len(big)]
    if len(free) < len(big):
        return  # too many to move (never seen): the vocabulary stays big enough for them
    _walk_specials(d, dict(zip(reversed(big), free)), set())


def _is_vocab_key(k: str) -> bool:
    return k in VOCAB_KEYS or k.endswith("_vocab_size") or k.startswith("vocab_size_")


def _shrink_vocab(d: dict[str, Any], specials: int) -> None:
    for k, v in d.items():
        if _is_vocab_key(k) and _int(v) and v > SMALL_VOCAB:
            d[k] = max(SMALL_VOCAB, specials + 1)


def _shrink_experts(d: dict[str, Any]) -> None:
    experts = [d[k] for k in EXPERT_KEYS if _int(d.get(k)) and d[k] > 0]
    for k in EXPERT_KEYS:
        if _int(d.get(k)) and d[k] > 4:
            d[k] = 4
    for k in TOPK_KEYS:
        if experts and k in d and (d[k] is None or (_int(d[k]) and d[k] > 2)):
            d[k] = 2  # (a default config may leave it unset: DeepSeek-V2)
    for k in ("n_group", "topk_group", "num_expert_group", "topk_groups"):
        if _int(d.get(k)) and d[k] > 1:
            d[k] = 1
    for k in ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"):
        if _int(d.get(k)) and d[k] > 1:
            d[k] = 1


def _shrink_widths(d: dict[str, Any]) -> None:
    """Fewer heads (head dim kept), hidden size following them, feed-forward sizes by the same factor."""
    hidden_key = next((k for k in HIDDEN_KEYS if _int(d.get(k)) and d[k] > 0), None)
    head_keys = [k for k in HEAD_KEYS if _int(d.get(k)) and d[k] > 0]
    if hidden_key is None or not head_keys:
        return
    hidden, n = int(d[hidden_key]), max(int(d[k]) for k in head_keys)
    hd = next((int(d[k]) for k in ("head_dim", "attention_head_dim", "kv_channels") if _int(d.get(k)) and d[k] > 0),
              hidden // n if hidden % n == 0 else 0)
    if hd <= 0:
        return
    kv = next((int(d[k]) for k in KV_KEYS if _int(d.get(k)) and d[k] > 0), n)
    if kv <= 0 or n % kv:
        return
    new_kv = min(kv, 2)
    new_n = new_kv * min(n // kv, 2) if kv != n else min(n, 4)
    if new_n >= n:
        return
    new_hidden = new_n * hd
    if new_hidden >= hidden:
        return
    for k in head_keys:
        d[k] = new_n
    for k in KV_KEYS:
        if _int(d.get(k)) and d[k] > 0:
            d[k] = new_kv if kv != n else new_n
    factor = new_hidden / hidden
    for k in (*HIDDEN_KEYS, *TIED_HIDDEN_KEYS):
        if _int(d.get(k)) and d[k] == hidden:
            d[k] = new_hidden
    for k in FFN_KEYS:
        if _int(d.get(k)) and d[k] > 0:
            d[k] = max(16, int(d[k] * factor) // 16 * 16)
    _fix_ssm_heads(d, hidden_key)


# Mamba-2 style blocks: heads × head dim must equal expand × hidden
SSM_HEADS = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("num_heads", "head_dim", "expand"),
             ("linear_num_value_heads", "linear_value_head_dim", None))


def _fix_ssm_heads(d: dict[str, Any], hidden_key: str) -> None:
    for heads, dim, expand in SSM_HEADS:
        if expand is None or not all(_int(d.get(k)) and d[k] > 0 for k in (heads, dim)):
            continue
        ex = d.get(expand)
        if isinstance(ex, (int, float)) and ex > 0 and (ex * d[hidden_key]) % d[dim] == 0:
            d[heads] = int(ex * d[hidden_key]) // d[dim]


# a part's width that must be the language model's (a vision merger's output): set to the text config's
TEXT_WIDTH_KEYS = ("out_hidden_size", "text_hidden_size")


def _follow_text_width(d: dict[str, Any]) -> None:
    """The other parts' output widths set to the text config's hidden size (Qwen3-VL's vision `out_hidden_size`;
    Qwen2-VL's vision `hidden_size`, its merger's output next to the tower's own `embed_dim`). The default configs
    of some do not match (Qwen3-VL: 3584 into a 4096-wide text model), and the narrowed text width never would."""
    text = d.get("text_config")
    width = text.get("hidden_size") if isinstance(text, dict) else None
    if not _int(width):
        return
    for k, part in d.items():
        if k == "text_config" or not _is_config_dict(k, part):
            continue
        keys = TEXT_WIDTH_KEYS + (("hidden_size",) if _int(part.get("embed_dim")) else ())
        for w in keys:
            if _int(part.get(w)):
                part[w] = width


def _follow_backbone_width(d: dict[str, Any], old: Any) -> None:
    """A neck's input width named after the backbone (Depth Anything's `reassemble_hidden_size`, the DINOv2
    backbone's hidden size) follows the narrowed backbone."""
    new = (d.get("backbone_config") or {}).get("hidden_size")
    if not _int(old) or not _int(new) or new == old:
        return
    for k, v in d.items():
        if k.endswith("hidden_size") and ("reassemble" in k or "backbone" in k) and v == old:
            d[k] = new


def _shrink_dict(d: dict[str, Any], level: str, specials: int) -> None:
    backbone = d.get("backbone_config")
    backbone_width = backbone.get("hidden_size") if isinstance(backbone, dict) else None
    for k, v in list(d.items()):
        if _is_config_dict(k, v):
            _shrink_dict(v, level, max(specials, _special_max(v)))
    _follow_text_width(d)
    _follow_backbone_width(d, backbone_width)
    counted = _layer_count(d)
    if counted is not None and counted[1] > 1:
        stages = _stage_outputs(d)
        outputs = len([s for s in stages or () if s > 0])
        keep = _keep_layers(d, *counted, per_kind=LEVEL_RULES[level][1], at_least=max(2, outputs))
        for k in TIED_LAYER_KEYS:
            if _int(d.get(k)) and d[k] == counted[1]:
                d[k] = d[counted[0]]
        _remap_stages(d, stages, keep)
    for k in SIDE_LAYER_KEYS:
        if _int(d.get(k)) and d[k] > 2:
            d[k] = 2
    _clamp_feature_layers(d)
    if isinstance(d.get("depth_coefficient"), float) and d["depth_coefficient"] > 0.1:  # EfficientNet: 1 block per stage
        d["depth_coefficient"] = 0.1
    for k in STAGE_KEYS:
        if isinstance(d.get(k), list) and all(_int(x) for x in d[k]):
            old = d[k]
            d[k] = [min(x, 2) for x in old]
            _remap_stage_blocks(d, old, d[k])
    _shrink_experts(d)
    _shrink_vocab(d, specials)
    if LEVEL_RULES[level][0]:
        _shrink_widths(d)


def shrink_dict(config: Mapping[str, Any], level: str = "narrow") -> dict[str, Any]:
    """The shrunk copy of a config dict (`PretrainedConfig.to_dict()`)."""
    if level not in LEVEL_RULES:
        raise ValueError(f"unknown shrink level {level!r}; use one of {tuple(LEVEL_RULES)}")
    d = copy.deepcopy(dict(config))
    _remap_specials(d)
    _shrink_dict(d, level, _special_max(d))
    return d


def shrink(config: Any, level: str = "narrow") -> Any:
    """A new config of the same class from `shrink_dict(config.to_dict(), level)`; `config` itself at "default"."""
    if level == "default":
        return config
    small = shrink_dict(config.to_dict(), level)
    small.pop("transformers_version", None)
    return type(config).from_dict(small)


def layer_count(config: Any) -> int | None:
    """The main layer count of a config (or its text config), for the scan's record."""
    for cfg in (config, getattr(config, "text_config", None)):
        if cfg is None:
            continue
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else {}
        found = _layer_count(d)
        if found:
            return found[1]
        side = [int(d[k]) for k in SIDE_LAYER_KEYS if _int(d.get(k))]
        if side:
            return sum(side)
    return None

