"""One mapper over nested structures of tensors (model inputs, call arguments, module outputs).

`map_tensors(fn, obj)` rebuilds `obj` with `fn` applied to every tensor inside it, keeping the structure:

- tuples and lists keep their type; namedtuples and torch's structseq return types (`torch.return_types.max`)
  are rebuilt as the same type;
- a Hugging Face ``ModelOutput`` (an ordered mapping with ``to_tuple``) is rebuilt as the same class, never
  modified in place;
- any other mapping becomes a plain ``dict`` (keys kept, in order);
- with ``modules=True`` an ``nn.Module`` is handed to ``fn`` too (to move a model and its inputs in one call);
- everything else (numbers, strings, None, dtypes, cache objects) is returned as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

__all__ = ["is_model_output", "map_tensors", "module_tensors", "tensors_in"]


def is_model_output(obj: Any) -> bool:
    """A Hugging Face ``ModelOutput`` (or anything shaped like one: keys, item access and ``to_tuple``)."""
    return hasattr(obj, "to_tuple") and hasattr(obj, "keys") and hasattr(obj, "__getitem__")


def _is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_fields")


def _is_structseq(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "n_fields")


def _rebuild_model_output(obj: Any, items: dict[str, Any]) -> Any:
    try:
        return type(obj)(**items)
    except TypeError:  # not a dataclass-style constructor: fill a fresh instance key by key
        out = type(obj)()
        for k, v in items.items():
            out[k] = v
        return out


def map_tensors(fn: Callable[[Any], Any], obj: Any, *, modules: bool = False) -> Any:
    """`obj` rebuilt with `fn(t)` for every tensor `t` (and every module, when `modules`)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if modules and isinstance(obj, torch.nn.Module):
        return fn(obj)
    if isinstance(obj, tuple):
        vals = [map_tensors(fn, v, modules=modules) for v in obj]
        if _is_namedtuple(obj):
            return type(obj)(*vals)
        if type(obj) is tuple:
            return tuple(vals)
        return type(obj)(vals)  # structseq, torch.Size and other tuple subclasses take one iterable
    if isinstance(obj, list):
        vals = [map_tensors(fn, v, modules=modules) for v in obj]
        return vals if type(obj) is list else type(obj)(vals)
    if is_model_output(obj):
        return _rebuild_model_output(obj, {k: map_tensors(fn, obj[k], modules=modules) for k in list(obj.keys())})
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v, modules=modules) for k, v in obj.items()}
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors inside `obj`, in the order `map_tensors` visits them."""
    out: list[torch.Tensor] = []

    def visit(t: Any) -> Any:
        out.append(t)
        return t

    map_tensors(visit, obj)
    return out


def module_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `module` (persistent or not) by every name it has: a tied tensor appears under
    each of its names. The tensors themselves, not detached: callers that set `.data` reach the module's own."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **{k: b for k, b in module.named_buffers(remove_duplicate=False) if b is not None}}
