"""Tensor-parallel plans: which module gets which PyTorch style, and the sharding itself.

The sharding is PyTorch's own: `torch.distributed.tensor.parallel.parallelize_module` with `ColwiseParallel` /
`RowwiseParallel` (DTensor parameters; plain local tensors between modules, `use_local_output`). A plan maps
module-name globs to the style names of `ci_runner/workloads/parallel.py`; without one the family's default plan applies:

* decoders with Llama-style names (Llama, Granite, Mistral, Qwen2, the attention layers of Bamba and Mixtral):
  attention `q_proj`/`k_proj`/`v_proj` colwise and `o_proj` rowwise (each rank keeps `heads / tp` heads: HF's
  attention reshapes with `-1` heads, so the local head count follows the local q width), MLP `gate_proj`/`up_proj`
  colwise and `down_proj` rowwise, `embed_tokens` rowwise over the vocabulary, `lm_head` colwise with its output
  gathered (left out when tied to the embedding: one parameter cannot be sharded twice). Mixtral's fused experts
  (3-D parameters) and Bamba's Mamba mixer stay replicated: the styles shard `nn.Linear` and `nn.Embedding` only.
  A block the names match only in part (a Llava vision tower's CLIP attention: q/k/v, then `out_proj`) stays
  replicated too: a multimodal model's language model is sharded, its vision tower is not.

`check_plan` refuses a plan that matches nothing or does not divide the heads, features or vocabulary by `tp`;
`layout_problem` runs it on the model built on meta, before any cell runs (`run`) and before a cell's modes (`cell`).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

from torch import nn

from ..config import InputSpec, ModelSpec, spec_from_json
from ..errors import InputError, ModelLoadError
from .parallel import layout_of
from ..models.load import build_inputs, load_model

DECODER_PLAN: Mapping[str, str] = {
    "*.q_proj": "colwise", "*.k_proj": "colwise", "*.v_proj": "colwise", "*.o_proj": "rowwise",
    "*.gate_proj": "colwise", "*.up_proj": "colwise", "*.down_proj": "rowwise",
    "*embed_tokens": "rowwise_embedding", "lm_head": "colwise_gather",
}
LOCAL_OUTPUT_STYLES = ("colwise",)  # their output is the rank's slice of the last dim: gathered to compare


def default_plan(module: nn.Module) -> dict[str, str]:
    """The family's default plan (the decoder plan; `lm_head` dropped when tied to the embedding)."""
    plan = dict(DECODER_PLAN)
    head = getattr(module, "lm_head", None)
    embed = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    if head is not None and embed is not None and getattr(head, "weight", None) is getattr(embed, "weight", None):
        del plan["lm_head"]
    return plan


def resolve_plan(module: nn.Module, plan: Mapping[str, str] | None) -> dict[str, str]:
    """Qualified module name → style, for every `nn.Linear` / `nn.Embedding` a glob of `plan` (or the default plan)
    matches (the first matching glob wins). The default plan shards whole blocks only (`whole_blocks`)."""
    globs = dict(plan) if plan else default_plan(module)
    out: dict[str, str] = {}
    for name, sub in module.named_modules():
        if not name or not isinstance(sub, (nn.Linear, nn.Embedding)):
            continue
        for glob, style in globs.items():
            if fnmatch.fnmatchcase(name, glob):
                out[name] = style
                break
    return out if plan else whole_blocks(out)


def whole_blocks(resolved: Mapping[str, str]) -> dict[str, str]:
    """The default plan less its colwise projections whose block has no rowwise one: a block the decoder names
    match only in part (CLIP's attention in a Llava vision tower: `q_proj`/`k_proj`/`v_proj`, then `out_proj`) is
    left replicated, since its unmatched output projection would get each rank's slice of the heads."""
    rowwise_parents = {name.rpartition(".")[0] for name, style in resolved.items() if style == "rowwise"}
    return {name: style for name, style in resolved.items()
            if style != "colwise" or name.rpartition(".")[0] in rowwise_parents}


def check_plan(module: nn.Module, resolved: Mapping[str, str], tp: int, model_id: str) -> None:
    """An `InputError` naming the model, the module and the fix when the plan cannot shard this model by `tp`."""
    if not resolved:
        raise InputError(f"model {model_id!r}: no nn.Linear or nn.Embedding matches the tensor-parallel plan",
                         hint="give `parallel.plan` with globs of its module names (docs/parallel.md)")
    config = getattr(module, "config", None)
    text = getattr(config, "get_text_config", lambda: config)() if config is not None else None
    for attr in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(text, attr, None)
        if isinstance(n, int) and n % tp:
            raise InputError(f"model {model_id!r}: {attr} = {n} is not divisible by tp = {tp}",
                             hint="choose a tp that divides the head counts, or override them in the model")
    mods = dict(module.named_modules())
    for name, style in resolved.items():
        weight = mods[name].weight
        dim = 0 if style != "rowwise" else 1
        if weight.shape[dim] % tp:
            raise InputError(f"model {model_id!r}: {name}.weight dim {dim} = {weight.shape[dim]} is not divisible by "
                             f"tp = {tp} ({style})", hint="choose a tp that divides it, or leave the module out of the plan")


def layout_problem(model: ModelSpec, seed: int, tp: int, plan: Mapping[str, str] | None) -> InputError | None:
    """What `check_plan` says of `model` under `tp` ranks and `plan`, on the model built on meta (no weights: a
    second or so), or None when it fits. A model that does not load is not this check's to report: its cell says so."""
    try:
        loaded = load_model(model, seed=seed, meta=True)
    except ModelLoadError:
        return None
    try:
        check_plan(loaded.module, resolve_plan(loaded.module, plan), tp, model.id)
    except InputError as exc:
        return exc
    return None


def styles(resolved: Mapping[str, str]) -> dict[str, Any]:
    """The PyTorch `ParallelStyle` of each module of a resolved plan."""
    from torch.distributed.tensor import Replicate  # deferred: torch.distributed is loaded only for TP runs
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # deferred: as above

    make = {
        "colwise": ColwiseParallel,
        "rowwise": RowwiseParallel,
        "colwise_gather": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_embedding": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    return {name: make[style]() for name, style in resolved.items()}


def shard(module: nn.Module, mesh: Any, resolved: Mapping[str, str]) -> nn.Module:
    """`parallelize_module(module, mesh, styles)`: the module sharded in place, returned; first moved to the
    mesh's device (a device's own process group: `procs/ranks.group_of`), as a user moves it."""
    from torch.distributed.tensor.parallel import parallelize_module  # deferred: torch.distributed for TP runs only

    if mesh.device_type != "cpu":
        module = module.to(mesh.device_type)
    return parallelize_module(module, mesh, styles(resolved))


def on_mesh_device(kwargs: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """A sample's inputs on the mesh's device (unchanged on CPU): what the sharded model is called with."""
    from ..models.tree import map_tensors  # deferred: imports torch

    if mesh.device_type == "cpu":
        return dict(kwargs)
    return {k: map_tensors(lambda t: t.to(mesh.device_type), v) for k, v in kwargs.items()}


def local_output_modules(resolved: Mapping[str, str]) -> set[str]:
    """The modules whose output each rank holds a slice of (last dim)."""
    return {name for name, style in resolved.items() if style in LOCAL_OUTPUT_STYLES}


def shard_dim(style: str) -> int:
    """The weight dim a style shards (0: output features or vocabulary; 1: input features)."""
    return 1 if style == "rowwise" else 0


def sharded_model(payload: Mapping[str, Any], mesh: Any) -> tuple[nn.Module, dict[str, str], dict[str, Any]]:
    """What a rank task builds first: the cell's model (same seed on every rank) sharded by its plan, the resolved
    plan, and the inputs of `payload["sample"]` (default 0). The payload is `procs/ranks.rank_tasks`'s."""
    model_spec = spec_from_json(ModelSpec, payload["model"])
    inputs = spec_from_json(InputSpec, payload["inputs"])
    loaded = load_model(model_spec, seed=inputs.seed, dtype="float32")
    resolved = resolve_plan(loaded.module, dict(layout_of(payload).plan))
    check_plan(loaded.module, resolved, int(payload["world"]), model_spec.id)
    kwargs = on_mesh_device(build_inputs(loaded, inputs, sample=int(payload.get("sample", 0))), mesh)
    return shard(loaded.module, mesh, resolved), resolved, kwargs
