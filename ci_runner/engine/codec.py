"""One codec for captured call inputs and outputs: a JSON spec of the structure, the tensors stored apart.

`encode_value(obj, put)` returns a JSON-able spec in which every tensor is replaced by the key `put(tensor)`
returned; `decode_value(spec, get)` rebuilds the value (`get` is a mapping of key -> tensor, or a function).
The spec format (also read by the layer repro scripts, `templates/_repro_layer_common.py.j2`):

    {"tensor": key, "stride": [...], "requires_grad": false}    a tensor (stride only with keep_strides)
    {"value": x}                                                 None, bool, int, str, a finite float
    {"float": "inf"}                                             a non-finite float
    {"dtype": "float16"} / {"device": "cpu"} / {"size": [2, 3]}
    {"namedtuple": "Name", "fields": [...], "tuple": [...]}     a namedtuple (rebuilt by name and fields)
    {"tuple": [...]} / {"list": [...]} / {"dict": [[key, spec], ...]}
    {"mo": "module:Class", "items": [[key, spec], ...]}         a Hugging Face ModelOutput
    {"value": null, "cache": "DynamicCache"}                     a cache object, replaced by None
    {"slice": [start, stop, step]}
    {"opaque": "TypeName"}                                       anything else, when `opaque=True`

Policies:
- `strict=True` (what the layers mode can replay exactly): only strided tensors, plain data, dtypes, devices,
  sizes, tuples, lists and plain dicts with string keys; a namedtuple, ModelOutput, cache, slice, a dict with
  other keys or any other object raises `Unstorable`.
- `strict=False` (numerics): namedtuples are stored with their name and fields, ModelOutputs by class, caches as None, slices,
  dicts with str/int keys; any other object raises `Unstorable`, or becomes `{"opaque": type}` with `opaque=True`
  (outputs, compared only through their tensors).

Tensor stores dedupe: a tensor stored once is not stored again while it is alive and unmodified
(`TensorDedupe`; `TensorStore` is the in-memory store with that dedupe).
"""

from __future__ import annotations

import collections
import importlib
import math
import os
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .tree import is_model_output

__all__ = [
    "Unstorable", "TensorDedupe", "TensorStore", "encode_value", "decode_value", "check_value", "encode_call",
    "decode_call", "tensor_keys", "call_tensor_keys", "CACHE_TYPES",
]

CACHE_TYPES = ("Cache", "DynamicCache", "StaticCache", "HybridCache", "HybridMambaAttentionDynamicCache")

Getter = Callable[[str], torch.Tensor]


class Unstorable(Exception):
    """A call value that cannot be stored so that it is rebuilt exactly (an arbitrary object, e.g. a cache)."""


# --------------------------------------------------------------------------- tensor stores

class TensorDedupe:
    """Remembers under which key a tensor was stored, as long as it is alive and not modified in place.

    A tensor is found again when it is a view of the same memory with the same shape, strides and dtype, the
    view first stored is still alive (so the memory was not reused) and the version counter (shared by all views
    of a storage) did not move. Only weak references are held.
    """

    def __init__(self) -> None:
        self._seen: dict[tuple[Any, ...], tuple[Any, int, str]] = {}

    @staticmethod
    def _ident(t: torch.Tensor) -> tuple[Any, ...]:
        if t.device.type == "meta" or t.layout != torch.strided:
            return ("id", id(t))
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # tensor subclasses / functional tensors without storage
            return ("id", id(t))
        return (t.device.type, t.device.index, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)

    def get(self, t: torch.Tensor) -> str | None:
        entry = self._seen.get(self._ident(t))
        if entry is None:
            return None
        ref, version, key = entry
        alive = ref()
        if alive is None or alive._version != version or t._version != version:
            return None
        return key

    def remember(self, t: torch.Tensor, key: str) -> None:
        try:
            self._seen[self._ident(t)] = (weakref.ref(t), t._version, key)
        except TypeError:
            pass  # not weak-referenceable: never deduped

    def clear(self) -> None:
        self._seen.clear()


class TensorStore:
    """Distinct tensors of a capture, each kept once in memory as a contiguous CPU copy; `save` writes them."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._dedupe = TensorDedupe()

    def add(self, t: torch.Tensor) -> str:
        key = self._dedupe.get(t)
        if key is not None:
            return key
        key = f"t{len(self.tensors)}"
        # safetensors wants contiguous tensors that share no memory with another entry
        self.tensors[key] = t.detach().to("cpu").contiguous().clone()
        self._dedupe.remember(t, key)
        return key

    __call__ = add

    def save(self, path: Path) -> Path:
        from safetensors.torch import save_file  # deferred: safetensors imports torch machinery only when saving

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(self.tensors, str(tmp))
        os.replace(tmp, path)
        return path


# --------------------------------------------------------------------------- values

def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _is_cache(obj: Any) -> bool:
    name = type(obj).__name__
    return name in CACHE_TYPES or "Cache" in name


def encode_value(obj: Any, put: Callable[[torch.Tensor], str], *, strict: bool = False, opaque: bool = False,
                 keep_strides: bool = False) -> Any:
    """The JSON spec of `obj` (see the module docstring); tensors go to `put`, which returns their key."""
    def enc(v: Any) -> Any:
        return encode_value(v, put, strict=strict, opaque=opaque, keep_strides=keep_strides)

    if isinstance(obj, torch.Tensor):
        if strict and obj.layout != torch.strided:
            raise Unstorable(f"a {obj.layout} tensor")
        if keep_strides:
            return {"tensor": put(obj), "stride": list(obj.stride()), "requires_grad": False}
        return {"tensor": put(obj)}
    if obj is None or isinstance(obj, (bool, int, str)):
        return {"value": obj}
    if isinstance(obj, float):
        return {"value": obj} if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, torch.dtype):
        return {"dtype": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        if strict:
            raise Unstorable(f"a namedtuple {type(obj).__name__}")
        return {"namedtuple": type(obj).__name__, "fields": list(type(obj)._fields), "tuple": [enc(v) for v in obj]}
    if isinstance(obj, tuple):
        return {"tuple": [enc(v) for v in obj]}
    if isinstance(obj, list):
        return {"list": [enc(v) for v in obj]}
    if type(obj) is dict:
        keys_ok = all(isinstance(k, str) if strict else isinstance(k, (str, int)) and not isinstance(k, bool)
                      for k in obj)
        if keys_ok:
            return {"dict": [[k, enc(v)] for k, v in obj.items()]}
        if strict:
            raise Unstorable("a dict with non-string keys")
        if not opaque:
            bad = next(k for k in obj if not isinstance(k, (str, int)) or isinstance(k, bool))
            raise Unstorable(f"a dict with {type(bad).__name__} keys")
        return {"opaque": "dict"}
    if not strict:
        if _is_cache(obj):
            return {"value": None, "cache": type(obj).__name__}
        if is_model_output(obj):
            cls = type(obj)
            return {"mo": f"{cls.__module__}:{cls.__qualname__}", "items": [[str(k), enc(obj[k])] for k in obj.keys()]}
        if isinstance(obj, dict):  # a dict subclass (OrderedDict, BatchEncoding): stored as a plain dict
            return enc(dict(obj))
        if isinstance(obj, slice):
            return {"slice": [obj.start, obj.stop, obj.step]}
        if opaque:
            return {"opaque": type(obj).__qualname__}
    raise Unstorable(f"an object of type {_type_name(obj)}")


def check_value(obj: Any, *, strict: bool = False) -> None:
    """Raise `Unstorable` if `encode_value` would; stores nothing."""
    encode_value(obj, lambda _t: "", strict=strict)


def _getter(tensors: Mapping[str, torch.Tensor] | Getter) -> Getter:
    return tensors.__getitem__ if isinstance(tensors, Mapping) else tensors


def _restride(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    if stride and stride != t.stride() and t.numel() > 0 and 0 not in stride:
        try:
            out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
            out.copy_(t)
            return out
        except RuntimeError:
            pass  # overlapping layout: keep the contiguous copy
    return t


def decode_value(spec: Any, tensors: Mapping[str, torch.Tensor] | Getter) -> Any:
    """Rebuild what `encode_value` stored (ModelOutput classes are re-imported from transformers only; a
    ModelOutput whose class cannot be imported comes back as a dict; an opaque value as None)."""
    get = _getter(tensors)
    if "tensor" in spec:
        return _restride(get(spec["tensor"]), tuple(spec.get("stride") or ()))
    if "value" in spec:
        return spec["value"]
    if "float" in spec:
        return float(spec["float"])
    if "dtype" in spec:
        return getattr(torch, spec["dtype"])
    if "device" in spec:
        return torch.device(spec["device"])
    if "size" in spec:
        return torch.Size(spec["size"])
    if "namedtuple" in spec:  # rebuilt as a namedtuple of the same name and fields (nothing is imported)
        cls = collections.namedtuple(spec["namedtuple"], spec["fields"], rename=True)  # type: ignore[misc]
        return cls(*(decode_value(v, get) for v in spec["tuple"]))
    if "tuple" in spec:
        return tuple(decode_value(v, get) for v in spec["tuple"])
    if "list" in spec:
        return [decode_value(v, get) for v in spec["list"]]
    if "dict" in spec:
        return {k: decode_value(v, get) for k, v in spec["dict"]}
    if "mo" in spec:
        items = {k: decode_value(s, get) for k, s in spec["items"]}
        cls = _model_output_class(spec["mo"])
        return cls(**items) if cls is not None else items
    if "slice" in spec:
        return slice(*spec["slice"])
    if "opaque" in spec:
        return None
    raise ValueError(f"unknown call-value spec {spec!r}")


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


# --------------------------------------------------------------------------- calls

def encode_call(args: tuple[Any, ...] | list[Any], kwargs: Mapping[str, Any], put: Callable[[torch.Tensor], str], *,
                strict: bool = False, keep_strides: bool = False) -> dict[str, Any]:
    """`{"args": <tuple spec>, "kwargs": <dict spec>}` of one call; raises `Unstorable` (never opaque)."""
    return {"args": encode_value(tuple(args), put, strict=strict, keep_strides=keep_strides),
            "kwargs": encode_value(dict(kwargs), put, strict=strict, keep_strides=keep_strides)}


def decode_call(spec: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | Getter) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return decode_value(spec["args"], tensors), decode_value(spec["kwargs"], tensors)


def tensor_keys(spec: Any) -> list[str]:
    """The tensor keys a value spec refers to, in order, each once."""
    out: list[str] = []

    def walk(s: Any) -> None:
        if "tensor" in s:
            out.append(s["tensor"])
        for k in ("tuple", "list"):
            for v in s.get(k, ()):
                walk(v)
        for k in ("dict", "items"):
            for _, v in s.get(k, ()):
                walk(v)

    walk(spec)
    return list(dict.fromkeys(out))


def call_tensor_keys(spec: Mapping[str, Any]) -> list[str]:
    """The tensor keys a call spec refers to (to write a repro's own inputs file)."""
    return list(dict.fromkeys(tensor_keys(spec["args"]) + tensor_keys(spec["kwargs"])))
