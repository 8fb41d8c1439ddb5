"""The call codec of the numerics dumps: a module call's arguments and output <-> JSON specs plus stored tensors.

Also the tensor-tree helpers the numerics modules share (`cast_tree`, `compared_tensors`).
"""

from __future__ import annotations

import collections
import importlib
from typing import Any, Callable

import torch

from ..capture import iter_tensors
from ..tree import is_model_output, map_tensors


class Unserializable(Exception):
    """A call argument or output that cannot be stored (an object that is neither tensor nor plain data)."""


_CACHE_TYPES = ("Cache", "DynamicCache", "StaticCache", "HybridCache", "HybridMambaAttentionDynamicCache")


def encode_value(obj: Any, put: Callable[[torch.Tensor], str], *, strict: bool) -> Any:
    """A JSON spec of `obj` with tensors replaced by `{"t": key}` (`put` stores them).

    Plain data, tuples/lists/dicts, namedtuples, ModelOutput, dtypes and devices are kept; a cache object becomes
    None; anything else raises `Unserializable` when `strict` (inputs must be rebuilt exactly) or becomes
    `{"opaque": type}` (outputs are only compared through their tensors).
    """
    if isinstance(obj, torch.Tensor):
        return {"t": put(obj)}
    if obj is None or isinstance(obj, (bool, int, str)):
        return {"v": obj}
    if isinstance(obj, float):
        return {"f": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: rebuilt with its field names
        return {"namedtuple": type(obj).__name__, "fields": [str(f) for f in obj._fields],
                "tuple": [encode_value(v, put, strict=strict) for v in obj]}
    if isinstance(obj, tuple):
        return {"tuple": [encode_value(v, put, strict=strict) for v in obj]}
    if isinstance(obj, list):
        return {"list": [encode_value(v, put, strict=strict) for v in obj]}
    if type(obj).__name__ in _CACHE_TYPES or "Cache" in type(obj).__name__:
        return {"v": None, "cache": type(obj).__name__}
    if is_model_output(obj):
        cls = type(obj)
        return {"mo": f"{cls.__module__}:{cls.__qualname__}",
                "items": [[str(k), encode_value(obj[k], put, strict=strict)] for k in obj.keys()]}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            if strict:
                raise Unserializable(f"dict with {type(next(iter(obj))).__name__} keys")
            return {"opaque": "dict"}
        return {"dict": [[k, encode_value(v, put, strict=strict)] for k, v in obj.items()]}
    if isinstance(obj, slice):
        return {"slice": [obj.start, obj.stop, obj.step]}
    if strict:
        raise Unserializable(f"{type(obj).__module__}.{type(obj).__qualname__}")
    return {"opaque": type(obj).__qualname__}


def decode_value(spec: Any, get: Callable[[str], torch.Tensor]) -> Any:
    """Rebuild what `encode_value` stored (ModelOutput classes are re-imported from transformers only)."""
    if "t" in spec:
        return get(spec["t"])
    if "v" in spec:
        return spec["v"]
    if "f" in spec:
        return float(spec["f"])
    if "dtype" in spec:
        return getattr(torch, spec["dtype"])
    if "device" in spec:
        return torch.device(spec["device"])
    if "namedtuple" in spec:
        cls = _namedtuple_class(str(spec["namedtuple"]), tuple(spec["fields"]))
        return cls(*(decode_value(s, get) for s in spec["tuple"]))
    if "tuple" in spec:
        return tuple(decode_value(s, get) for s in spec["tuple"])
    if "list" in spec:
        return [decode_value(s, get) for s in spec["list"]]
    if "dict" in spec:
        return {k: decode_value(s, get) for k, s in spec["dict"]}
    if "mo" in spec:
        items = {k: decode_value(s, get) for k, s in spec["items"]}
        cls = _model_output_class(spec["mo"])
        return cls(**items) if cls is not None else items
    if "slice" in spec:
        return slice(*spec["slice"])
    return None  # opaque


_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], Any] = {}


def _namedtuple_class(name: str, fields: tuple[str, ...]) -> Any:
    """A namedtuple class with the stored name and fields (built here: nothing is imported from a dump)."""
    key = (name, fields)
    if key not in _NAMEDTUPLES:
        try:
            _NAMEDTUPLES[key] = collections.namedtuple(name, fields)  # type: ignore[misc]
        except ValueError:  # a name or field that is not an identifier
            _NAMEDTUPLES[key] = collections.namedtuple("Stored", fields, rename=True)  # type: ignore[misc]
    return _NAMEDTUPLES[key]


def _model_output_class(path: str) -> Any:
    module, _, qual = path.partition(":")
    if not module.startswith("transformers."):
        return None
    try:
        obj: Any = importlib.import_module(module)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        return None


def cast_tree(obj: Any, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Any:
    """Floating tensors to `dtype`, every tensor to `device`, through tuples/lists/dicts/ModelOutput."""
    dev = torch.device(device) if device is not None else None

    def cast(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        if dev is not None and t.device != dev:
            t = t.to(dev)
        return t

    return map_tensors(cast, obj)


def compared_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The tensors of a module output that are compared: the floating ones (all of them if none is floating)."""
    ts = dict(iter_tensors(output))
    fl = {k: t for k, t in ts.items() if t.is_floating_point() or t.is_complex()}
    return fl or ts
