"""A failing submodule handed to the culprit child without rebuilding the model: its weights and its call.

The culprit child needs one submodule per target and that submodule's first call. Rebuilding the whole model (its
random weights drawn again) and running a reference forward to capture the call costs seconds at real size, in
every child. Instead the cell writes, next to each target, the submodule's parameters and buffers (every name,
persistent or not) and its call (`handoff.json` + `handoff.safetensors`, the call codec: strict, strides kept); the
child builds the model on the meta device (no weights, no init), materialises just that submodule and fills it
from the file (`load_targets`). A target whose submodule does not come back whole (a name missing, a tensor left on
meta) is left out, and the child builds the model as before for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ...config import ModelSpec, spec_from_json
from ...engine.codec import TensorStore, decode_call
from ...engine.models import load_model
from ...engine.tree import module_tensors, tensors_in
from ...fsutil import atomic_write_json
from .search import encode_call

SPEC = "handoff.json"
TENSORS = "handoff.safetensors"

Call = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]


def save_target(out_dir: Path, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    """The submodule's weights and its call, for `load_targets` in the culprit child."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store = TensorStore()
    spec = {"call": encode_call(tuple(args), kwargs, store),
            "weights": encode_call((), {k: t.detach() for k, t in module_tensors(module).items()}, store)}
    store.save(out_dir / TENSORS)
    atomic_write_json(out_dir / SPEC, spec)


def drop_handoff(out_dir: Path) -> None:
    """The handoff is the culprit child's input only, not an artifact: removed once the search is done."""
    for name in (SPEC, TENSORS):
        (out_dir / name).unlink(missing_ok=True)


def _on_meta(module: torch.nn.Module) -> bool:
    """A tensor of `module` (a parameter, a buffer or a plain tensor attribute) still on the meta device."""
    for m in module.modules():
        for key, value in vars(m).items():
            if key != "_modules" and any(t.is_meta for t in tensors_in(value)):
                return True
    return False


def _load_one(model: torch.nn.Module, name: str, out_dir: Path) -> Call | None:
    from safetensors.torch import load_file  # deferred: heavy

    spec = json.loads((out_dir / SPEC).read_text(encoding="utf-8"))
    tensors = load_file(str(out_dir / TENSORS))
    args, kwargs = decode_call(spec["call"], tensors)
    _, weights = decode_call(spec["weights"], tensors)
    sub = model.get_submodule(name)
    sub.to_empty(device="cpu")
    own = module_tensors(sub)
    if set(own) != set(weights):
        return None
    with torch.no_grad():
        for key, t in own.items():
            t.data = weights[key]
    return None if _on_meta(sub) else (sub.eval(), tuple(args), dict(kwargs))


def load_targets(model: Mapping[str, Any], seed: int, targets: Sequence[tuple[str, Path]]) -> dict[str, Call]:
    """Each (module, folder) with a handoff: its submodule, filled from the file, and its call. The model is built
    once, on the meta device; what does not come back whole is left out."""
    todo = [(name, d) for name, d in targets if name and (d / SPEC).is_file() and (d / TENSORS).is_file()]
    if not todo:
        return {}
    try:
        shell = load_model(spec_from_json(ModelSpec, dict(model)), seed=seed, meta=True).module
    except Exception:
        return {}
    out: dict[str, Call] = {}
    for name, d in todo:
        try:
            got = _load_one(shell, name, d)
        except Exception:  # the child builds the model for it instead
            got = None
        if got is not None:
            out[name] = got
    return out
