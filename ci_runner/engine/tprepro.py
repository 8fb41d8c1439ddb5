"""What the tensor-parallel repros share: the files each rank stores of a sharded module, and how a script that
starts its own ranks rebuilds it.

Inside the ranks (`procs/ranks.rank_tasks`): a mode's task saves, per module, each rank's `rank<r>.pt` with
`torch.save` (`save_rank_file`): that rank's local state of the module (`local_state`: the local shards of its
DTensor parameters, its other parameters and buffers), the call it replays (the codec's wire format,
`engine/codec.py`, its tensors beside) and whatever else the mode's script reads; rank 0 writes `config.json` beside
it for a transformers model. `agree_errors` tells every rank which modules any rank could not store. The script
rebuilds the model's structure from `rank_model_source` and shards the submodule by `relative_plan`
(`templates/_repro_tp_module.py.j2`: `build_module(state, mesh)`), so its files hold no pickle (they are read with
`torch.load(weights_only=True)`).

In the parent: `script_pythonpath`, what the script needs on PYTHONPATH (the backend's plugin, the model's factory).

Used by the layers mode's repro of a failing sharded module (`modes/layers/tprepro.py`) and the numerics mode's repro
of a sharded layer's divergence (`modes/numerics/tprepro.py`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..backends import plugin_pythonpath
from ..config import InputSpec, ModelSpec, spec_from_json
from ..fsutil import atomic_write_text
from .repro import plugin_modules

ROOT = ""  # the model itself, as a qualified module name


def relative_plan(resolved: Mapping[str, str], name: str) -> dict[str, str]:
    """The plan's entries inside module `name`, named relative to it ("" when `name` itself is planned)."""
    if name == ROOT:
        return dict(resolved)
    out = {}
    for qual, style in resolved.items():
        if qual == name:
            out[""] = style
        elif qual.startswith(name + "."):
            out[qual[len(name) + 1:]] = style
    return out


def local_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` as this rank holds it (a DTensor's local shard), detached copies."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, t in [*module.named_parameters(), *module.named_buffers()]:
            local = t.to_local() if hasattr(t, "to_local") else t
            out[key] = local.detach().to("cpu").contiguous().clone()
    return out


def rank_model_source(payload: Mapping[str, Any], model: torch.nn.Module) -> dict[str, Any] | None:
    """How a script rebuilds the ranks' model structure (`_repro_layer_common.build_model`): the factory with the
    run's seed, overrides and float32, or the transformers class from its config (`config` holds the JSON, which
    `save_rank_file` writes as `config.json`); None when neither applies (a path to a model folder of custom
    code)."""
    spec = spec_from_json(ModelSpec, payload["model"])
    if spec.factory:
        return {"kind": "factory", "factory": spec.factory, "seed": spec_from_json(InputSpec, payload["inputs"]).seed,
                "overrides": dict(spec.overrides), "dtype": "float32"}
    transformers = sys.modules.get("transformers")
    cls = type(model)
    config = getattr(model, "config", None)
    if transformers is None or getattr(transformers, cls.__name__, None) is not cls or config is None:
        return None
    return {"kind": "transformers", "model_class": cls.__name__, "config_class": type(config).__name__,
            "attn_implementation": getattr(config, "_attn_implementation", None),
            "config": config.to_json_string(use_diff=False)}


def brief_source(source: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`rank_model_source` as the parent gets it (the template's `source`): without the config's JSON."""
    return None if source is None else {k: v for k, v in source.items() if k != "config"}


def save_rank_file(rdir: Path, rank: int, blob: Mapping[str, Any], source: Mapping[str, Any] | None) -> None:
    """`rdir/rank<rank>.pt` (written whole, then renamed); rank 0 writes the model's `config.json` beside it when
    the script rebuilds a transformers class."""
    rdir.mkdir(parents=True, exist_ok=True)
    tmp = rdir / f".rank{rank}.pt.tmp"
    torch.save(dict(blob), str(tmp))
    os.replace(tmp, rdir / f"rank{rank}.pt")
    if rank == 0 and source is not None and source["kind"] == "transformers":
        atomic_write_text(rdir / "config.json", source["config"])


def agree_errors(mine: Mapping[str, str]) -> list[dict[str, str]]:
    """Every rank's {item: why it could not be stored}, in rank order (an all-gather: every rank calls it)."""
    import torch.distributed as dist  # deferred: rank children only

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dict(mine))
    return every


def errors_of(every: Sequence[Mapping[str, str]], item: str) -> dict[str, str]:
    """{rank: why} for `item`, from `agree_errors`."""
    return {str(r): e[item] for r, e in enumerate(every) if item in e}


def script_pythonpath(spec: Any, source: Mapping[str, Any]) -> tuple[str, list[str]]:
    """(the factory's module, or "" for a transformers class; the folders a TP repro of backend `spec` needs on
    PYTHONPATH: the backend's plugin and the model's factory where they are not installed)."""
    factory_module = str(source["factory"]).split(":", 1)[0] if source["kind"] == "factory" else ""
    modules = plugin_modules(spec) + ([factory_module] if factory_module else [])
    return factory_module, plugin_pythonpath(modules)
