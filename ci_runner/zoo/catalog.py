"""The transformers zoo: one model per architecture (model_type) of the INSTALLED transformers.

`catalog()` lists every config type transformers registers with the head the scan builds for it and its family.
The head is the first of `HEADS` whose auto mapping knows the type (seq2seq, speech seq2seq, causal LM,
image-text-to-text, image classification, then the base model); a type with none of them is listed with
`head=None` and a reason, so the scan can say why it left it out. The family (`FAMILIES`) groups the report.
"""

from __future__ import annotations

import difflib
import functools
import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..errors import ConfigError

# Every head a model can be asked for (`task:` of a `config:`, `path:` or `hub:` model): task name -> (transformers'
# auto class, its auto mapping in transformers.models.auto.modeling_auto). The one table of heads: `models.load`
# builds and checks `task:` with it, the zoo picks its head from it (`HEADS`) and labels families with it (`LABELS`).
# Inputs follow the model's main input (`main_input_name`), not the task: token ids, `pixel_values` or audio
# (`models/audio.py`). Left out: heads whose main input none of those builders makes (multiple choice's
# (batch, choices, length) ids, text-to-waveform, multimodal LM: image-text covers it).
TASK_HEADS: dict[str, tuple[str, str]] = {
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "speech-seq2seq": ("AutoModelForSpeechSeq2Seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES"),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "image-text": ("AutoModelForImageTextToText", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    "base": ("AutoModel", "MODEL_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "ctc": ("AutoModelForCTC", "MODEL_FOR_CTC_MAPPING_NAMES"),
    "audio-classification": ("AutoModelForAudioClassification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
    "audio-frame-classification": ("AutoModelForAudioFrameClassification",
                                   "MODEL_FOR_AUDIO_FRAME_CLASSIFICATION_MAPPING_NAMES"),
    "audio-xvector": ("AutoModelForAudioXVector", "MODEL_FOR_AUDIO_XVECTOR_MAPPING_NAMES"),
    "sequence-classification": ("AutoModelForSequenceClassification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    "token-classification": ("AutoModelForTokenClassification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    "question-answering": ("AutoModelForQuestionAnswering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES"),
    "pretraining": ("AutoModelForPreTraining", "MODEL_FOR_PRETRAINING_MAPPING_NAMES"),
    "semantic-segmentation": ("AutoModelForSemanticSegmentation", "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES"),
    "depth-estimation": ("AutoModelForDepthEstimation", "MODEL_FOR_DEPTH_ESTIMATION_MAPPING_NAMES"),
    "object-detection": ("AutoModelForObjectDetection", "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES"),
    "masked-image-modeling": ("AutoModelForMaskedImageModeling", "MODEL_FOR_MASKED_IMAGE_MODELING_MAPPING_NAMES"),
}
# the zoo's head, in order of preference (an encoder-decoder's seq2seq head covers its encoder too, where its
# causal-LM head is the decoder alone)
HEADS: tuple[tuple[str, str], ...] = tuple((t, TASK_HEADS[t][1]) for t in (
    "seq2seq", "speech-seq2seq", "causal-lm", "image-text", "image-classification", "base"))
FAMILIES: tuple[str, ...] = ("decoder", "MoE", "SSM/hybrid", "encoder", "vision", "audio", "multimodal",
                             "encoder-decoder")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_experts_per_tok")
_SSM_KEYS = ("ssm_state_size", "mamba_d_state", "state_size", "mamba_expand", "linear_num_value_heads",
             "time_step_rank", "attention_hidden_size", "rwkv", "ssm_cfg", "mamba_d_conv")
_SSM_KINDS = ("mamba", "ssm", "linear_attention", "recurrent", "conv", "mamba2", "hybrid")


@dataclass(frozen=True, kw_only=True)
class ZooModel:
    """One architecture of the zoo: its model_type, the head class built for it, and its family."""

    model_type: str
    task: str | None  # a HEADS task name; None: no head the scan can build
    class_name: str | None
    family: str
    reason: str | None = None  # why it cannot be scanned (no head)


# mappings that only label the family (an architecture with a masked-LM head is an encoder even when it also has a
# causal-LM head, as BERT does; CTC and audio classification heads mark audio encoders)
LABELS: tuple[tuple[str, str], ...] = tuple((t, TASK_HEADS[t][1]) for t in ("masked-lm", "ctc", "audio-classification"))


@functools.lru_cache(maxsize=1)
def _mappings() -> dict[str, dict[str, Any]]:
    from transformers.models.auto import modeling_auto  # deferred: transformers is heavy (seconds)

    return {task: dict(getattr(modeling_auto, name, {}) or {}) for task, (_, name) in TASK_HEADS.items()}


def task_of_class(model_type: str, class_name: str) -> str | None:
    """The task (`TASK_HEADS`) whose auto mapping has `class_name` for `model_type` (a checkpoint's
    `architectures`), or None."""
    maps = _mappings()
    return next((t for t in TASK_HEADS if class_name in _names(maps[t].get(model_type))), None)


def _names(value: Any) -> tuple[str, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    return (str(value),) if value else ()


def model_types() -> list[str]:
    """Every model_type the installed transformers registers a config for, sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # deferred: heavy

    return sorted(CONFIG_MAPPING_NAMES)


def _first(value: Any) -> str | None:
    if isinstance(value, (list, tuple)):
        return str(value[0]) if value else None
    return str(value) if value else None


def _positive(cfg: Any, keys: Sequence[str]) -> bool:
    for k in keys:
        v = getattr(cfg, k, None) if not isinstance(cfg, dict) else cfg.get(k)
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)) and v > 0:
            return True
        if isinstance(v, (dict, list)) and v:
            return True
    return False


def _layer_kinds(cfg: Any) -> set[str]:
    kinds: set[str] = set()
    for key in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern", "layers_block_types"):
        v = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
        if isinstance(v, (list, tuple)):
            kinds |= {str(x).lower() for x in v}
        elif isinstance(v, str):
            kinds.add(v.lower())
    return kinds


def family_of(model_type: str, task: str | None, config: Any | None, labels: frozenset[str] = frozenset()) -> str:
    """decoder | MoE | SSM/hybrid | encoder | vision | audio | multimodal | encoder-decoder, from the head, the
    other heads the type has (`labels`: masked-lm, ctc, audio-classification) and the default config (a dict or a
    PretrainedConfig)."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    has_vision = isinstance(cfg.get("vision_config"), dict)
    has_audio = isinstance(cfg.get("audio_config"), dict)
    if task == "image-text" or (has_vision and isinstance(cfg.get("text_config"), dict)) or (has_audio and has_vision):
        return "multimodal"
    if task == "speech-seq2seq" or has_audio or labels & {"ctc", "audio-classification"} \
            or any(k in cfg for k in ("num_mel_bins", "feat_extract_norm")):
        return "audio"
    if task in ("seq2seq",) or (cfg.get("is_encoder_decoder") and not ("image_size" in cfg or "num_channels" in cfg)):
        return "encoder-decoder"
    if any(k in text for k in _SSM_KEYS) or any(any(s in k for s in _SSM_KINDS) for k in _layer_kinds(text)) \
            or model_type.startswith(("mamba", "rwkv", "xlstm")):
        return "SSM/hybrid"
    if _positive(text, _MOE_KEYS) or "moe" in model_type:
        return "MoE"
    if task == "image-classification" or "image_size" in cfg or "num_channels" in cfg:
        return "vision"
    if task == "causal-lm" and "masked-lm" not in labels:
        return "decoder"
    return "encoder"


def head_of(model_type: str, maps: dict[str, dict[str, Any]] | None = None,
            configs: Any = None) -> tuple[str | None, str | None]:
    """(task, class name) of the head built for `model_type`: the first of `HEADS` whose auto mapping knows it;
    else, for a component config (`clip_text_model`), the model class named after its config class or the first
    class another auto mapping has, as task "base"; (None, None) when there is none. The one choice of head of the
    zoo and of `config:` models (`models.load.detect_task`)."""
    if maps is None:
        maps = _mappings()
    if configs is None:
        from transformers import CONFIG_MAPPING as configs  # deferred: transformers is heavy (seconds)
    for t, _ in HEADS:
        name = _first(maps[t].get(model_type))
        if name:
            return t, name
    cls = _class_for_config(configs, model_type) or _any_head(model_type)
    return ("base", cls) if cls else (None, None)


def head_config(cls: Any, config: Any) -> Any:
    """The config to build the head class `cls` with: `config`, or its text config when `cls` is built from that
    (a multimodal type whose causal-LM head is the text model, as transformers' auto classes build it)."""
    sub = (getattr(config, "sub_configs", None) or {}).get("text_config")
    if sub is not None and getattr(cls, "config_class", None) is sub and hasattr(config, "get_text_config"):
        return config.get_text_config()
    return config


def _entry(model_type: str, maps: dict[str, dict[str, Any]], configs: Any) -> ZooModel:
    task, cls = head_of(model_type, maps, configs)
    try:
        config = configs[model_type]()
    except Exception:  # family from the head alone; the scan reports the build error itself
        config = None
    labels = frozenset(t for t, _ in LABELS if model_type in maps[t])
    family = family_of(model_type, task, config, labels)
    if cls is None:
        return ZooModel(model_type=model_type, task=None, class_name=None, family=family,
                        reason="no model class: not in any auto mapping (causal-LM, seq2seq, image-text, "
                               "image classification or base model) and no <Name>Model for its config class")
    return ZooModel(model_type=model_type, task=task, class_name=cls, family=family)


def _any_head(model_type: str) -> str | None:
    """The first class any other auto mapping (retrieval, backbone, …) has for the type."""
    from transformers.models.auto import modeling_auto  # deferred: transformers is heavy (seconds)

    for name in sorted(n for n in dir(modeling_auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES")):
        found = _first((getattr(modeling_auto, name, None) or {}).get(model_type))
        if found:
            return found
    return None


def _class_for_config(configs: Any, model_type: str) -> str | None:
    import transformers  # deferred: transformers is heavy (seconds)

    try:
        name = configs[model_type].__name__
    except Exception:
        return None
    for guess in (name.removesuffix("Config") + "Model", name.removesuffix("Config")):
        if guess != name and isinstance(getattr(transformers, guess, None), type):
            return guess
    return None


def catalog(types: Iterable[str] | None = None) -> list[ZooModel]:
    """The zoo entries for `types` (default: every registered model_type), sorted by model_type."""
    from transformers import CONFIG_MAPPING  # deferred: transformers is heavy (seconds)

    from transformers.utils import logging as hf_logging

    maps = _mappings()
    wanted = sorted(set(types)) if types is not None else model_types()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs warn about their own token ids (23 lines for the whole zoo)
    try:
        return [_entry(t, maps, CONFIG_MAPPING) for t in wanted]
    finally:
        hf_logging.set_verbosity(verbosity)


def expand_selection(select: Sequence[str], exclude: Sequence[str], *, place: Callable[[str, int], str],
                     known: Sequence[str] | None = None) -> list[str]:
    """The model_types that `select` (names or globs; empty: all) and not `exclude` pick. A name or glob that
    matches no installed architecture is a `ConfigError` at `place(key, index)` ("file:line:col: models[0].select[2]")
    with the closest names."""
    types = list(known) if known is not None else model_types()

    def match(pattern: str, key: str, i: int) -> list[str]:
        hits = [t for t in types if fnmatch.fnmatchcase(t, pattern)]
        if not hits:
            close = difflib.get_close_matches(pattern, types, n=3)
            hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
                    else "use a transformers model_type (e.g. 'llama', 'vit') or a glob such as 'qwen*'")
            raise ConfigError(f"{place(key, i)}: {pattern!r} matches no architecture of the installed transformers",
                              hint=hint)
        return hits

    chosen = set(types) if not select else {t for i, p in enumerate(select) for t in match(p, "select", i)}
    dropped = {t for i, p in enumerate(exclude) for t in match(p, "exclude", i)}
    return sorted(chosen - dropped)
