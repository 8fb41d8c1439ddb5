"""The one wire format for values: captured calls (numerics dumps, layer inputs, layer repros) and op signatures.

A value is written as plain JSON where JSON can hold it, and as a dict with one `__tag__` key otherwise:

    None, bool, int, str, a finite float                     as themselves
    [spec, ...]                                              a list
    {"__tuple__": [spec, ...]}                               a tuple
    {"__float__": "inf" | "-inf" | "nan"}                    a non-finite float
    {"__tensor__": {"key": k, "stride": [...]}}              a stored tensor: its values are the store's entry `k`
                                                             (stride only with keep_strides: rebuilt with it)
    {"__tensor__": {"shape": [...], "stride": [...], "dtype": "float32"}}
                                                             a described tensor (op signatures: values synthetic;
                                                             a probe adds `low`/`high`, its value range; `dynamic`:
                                                             dims symbolic in a dynamic-shape graph)
    {"__dtype__": "float16"} / {"__device__": "cpu"} / {"__layout__": "strided"} / {"__memory_format__": …}
    {"__size__": [2, 3]}                                     a torch.Size
    {"__slice__": [start, stop, step]} / {"__ellipsis__": true}
    {"__dict__": [[key, spec], ...]}                         a dict (str keys; int keys too when not strict)
    {"__namedtuple__": {"name": N, "fields": [...], "items": [spec, ...]}}   rebuilt by name and fields
    {"__model_output__": {"class": "module:Class", "items": [[key, spec], ...]}}   a Hugging Face ModelOutput
    {"__cache__": "DynamicCache"}                            a cache object, rebuilt as None
    {"__kv_cache__": {"class": "transformers.cache_utils:StaticCache", "state": [[attr, spec], ...]}}
                                                             a transformers cache (or one of its layers) with its
                                                             tensors (`kv=True`): rebuilt as that class, its
                                                             attributes set (classes of transformers only)
    {"__class__": "transformers.cache_utils:DynamicLayer"}   a transformers class a cache refers to
    {"__opaque__": text}                                     anything else (not rebuilt: None, or refused)

Two encoders write it, one decoder reads it:
- `encode_value(obj, put, strict=, opaque=, keep_strides=)` stores call values: tensors go to `put`, which returns
  their key. `strict=True` (what the layers mode replays exactly): strided tensors, plain data, dtypes, devices,
  layouts, sizes, tuples, lists and dicts with str keys; anything else raises `Unstorable`. `strict=False`
  (numerics) adds namedtuples, ModelOutputs, caches, slices and int dict keys; any other object raises
  `Unstorable`, or is `{"__opaque__": type}` with `opaque=True` (outputs, compared only through their tensors).
  `kv=True` (the memory repros: a decode step's cache holds memory) stores a transformers cache's state too: its
  attributes' values (tensors, plain data, devices, its layer objects), never code.
- `encode_arg(value, tensor_of)` describes an op argument (`modes/ops/signature.py`): tensors by shape, stride and
  dtype, devices by type, namedtuples and Sizes as tuples, SymInts by their hint, any other value
  `{"__opaque__": repr}`. Its JSON is an op signature's identity (`signature_key`, the probe's seed), so its
  output must not change.
- `decode_value(spec, tensors, device=)` rebuilds either: stored tensors by key (a mapping or a function),
  described ones from an iterator, in order (`tensor_specs` lists them); `device` replaces every recorded device.
`source_of` writes a spec as Python source (the op repro scripts); the layer repro scripts carry their own copy of
the decoder (`templates/_repro_layer_common.py.j2`, strict specs only). Specs written before this format (dump
schemas 1 and 2: `{"tensor": k}`, `{"value": x}`, …) are read through `upgrade_v2`.

Tensor stores dedupe: a tensor stored once is not stored again while it is alive and unmodified
(`TensorDedupe`; `TensorStore` is the in-memory store with that dedupe).
"""

from __future__ import annotations

import collections
import importlib
import math
import os
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..models.tree import is_model_output
from ..quoting import dotted, pyrepr

__all__ = [
    "Unstorable", "TensorDedupe", "TensorStore", "encode_value", "encode_arg", "decode_value", "check_value",
    "encode_call", "decode_call", "tensor_keys", "call_tensor_keys", "tensor_specs", "is_opaque", "describe_value",
    "source_of", "upgrade_v2", "upgrade_call_v2", "dtype_name", "described_tensor", "CACHE_TYPES", "save_tensors",
]

CACHE_TYPES = ("Cache", "DynamicCache", "StaticCache", "HybridCache", "HybridMambaAttentionDynamicCache")

Getter = Callable[[str], torch.Tensor]
Tensors = Mapping[str, torch.Tensor] | Getter | Iterable[torch.Tensor]
_NO = object()  # "not a value of this kind"

_DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b8", "complex64": "c64", "complex128": "c128",
}


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
        return save_tensors(self.tensors, path)


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path, *, copy: bool = False,
                 metadata: Mapping[str, str] | None = None) -> Path:
    """`tensors` as a safetensors file, written atomically: what the repros, probes and handoffs load their tensors
    from (never a pickle). They must be contiguous CPU tensors sharing no memory; `copy=True` makes each its own CPU
    copy first (a module's parameters by name, `tree.module_tensors`: tied weights share storage, which safetensors
    refuses). `metadata` goes in the file's header (text only)."""
    from safetensors.torch import save_file  # deferred: safetensors imports torch machinery only when saving

    if copy:
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(dict(tensors), str(tmp), metadata=dict(metadata) if metadata else None)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------- encoding

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _type_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _is_cache(obj: Any) -> bool:
    name = type(obj).__name__
    return name in CACHE_TYPES or "Cache" in name


def _encode_plain(obj: Any) -> Any:
    """The spec of a value both encoders write the same way (scalars, dtypes, layouts, …); `_NO` for others."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return {"__float__": "nan"}
        if math.isinf(obj):
            return {"__float__": "inf" if obj > 0 else "-inf"}
        return obj
    if isinstance(obj, torch.dtype):
        return {"__dtype__": dtype_name(obj)}
    if isinstance(obj, torch.layout):
        return {"__layout__": str(obj).removeprefix("torch.")}
    if isinstance(obj, torch.memory_format):
        return {"__memory_format__": str(obj).removeprefix("torch.")}
    if obj is Ellipsis:
        return {"__ellipsis__": True}
    return _NO


def _contiguous_stride(shape: Sequence[int]) -> list[int]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return list(reversed(stride))


def _hinted(size: Any) -> int:
    """A size as an int: a symbolic one by its hint, read without a guard (`int()` on a SymInt specializes the symbol
    in its graph's shape environment, and every later shape of that graph reads as a constant)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.maybe_as_int()
        hint = size.node.hint if hint is None else hint
        if hint is not None:
            return int(hint)
    return int(size)


def described_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A tensor by what a probe needs to rebuild one like it: shape, stride, dtype (its values are synthetic), and
    `dynamic`: the dims that were symbolic where it was recorded (a graph traced with dynamic shapes), only when
    there are some, so a static tensor's description (an op signature's identity) is as it always was."""
    dynamic = [i for i, s in enumerate(t.shape) if isinstance(s, torch.SymInt) and s.node.maybe_as_int() is None]
    shape = [_hinted(s) for s in t.shape]
    try:
        stride = [_hinted(s) for s in t.stride()]
    except (RuntimeError, NotImplementedError):  # sparse or nested: take the contiguous layout
        stride = _contiguous_stride(shape)
    body: dict[str, Any] = {"shape": shape, "stride": stride, "dtype": dtype_name(t.dtype)}
    if dynamic:
        body["dynamic"] = dynamic
    return body


def encode_arg(value: Any, tensor_of: Callable[[Any], torch.Tensor | None] = lambda v: None) -> Any:
    """The spec of an op argument (an op signature's; see the module docstring). `tensor_of` maps graph nodes to
    their (fake) tensor value."""
    t = tensor_of(value)
    if t is not None:
        value = t
    if isinstance(value, torch.Tensor):
        return {"__tensor__": described_tensor(value)}
    plain = _encode_plain(value)
    if plain is not _NO:
        return plain
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = value.node.hint if hasattr(value, "node") else None
        return encode_arg(hint) if hint is not None else {"__opaque__": str(value)}
    if isinstance(value, torch.device):
        return {"__device__": value.type}
    if isinstance(value, slice):
        return {"__slice__": [encode_arg(value.start), encode_arg(value.stop), encode_arg(value.step)]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_arg(v, tensor_of) for v in value]}
    if isinstance(value, list):
        return [encode_arg(v, tensor_of) for v in value]
    return {"__opaque__": repr(value)[:200]}


def encode_value(obj: Any, put: Callable[[torch.Tensor], str], *, strict: bool = False, opaque: bool = False,
                 keep_strides: bool = False, kv: bool = False) -> Any:
    """The spec of a call value (see the module docstring); tensors go to `put`, which returns their key."""
    def enc(v: Any) -> Any:
        return encode_value(v, put, strict=strict, opaque=opaque, keep_strides=keep_strides, kv=kv)

    if isinstance(obj, torch.Tensor):
        if strict and obj.layout != torch.strided:
            raise Unstorable(f"a {obj.layout} tensor")
        return {"__tensor__": {"key": put(obj), "stride": list(obj.stride())} if keep_strides else {"key": put(obj)}}
    plain = _encode_plain(obj)
    if plain is not _NO:
        return plain
    if isinstance(obj, torch.device):
        return {"__device__": str(obj)}
    if isinstance(obj, torch.Size):
        return {"__size__": list(obj)}
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):
        if strict:
            raise Unstorable(f"a namedtuple {type(obj).__name__}")
        return {"__namedtuple__": {"name": type(obj).__name__, "fields": list(type(obj)._fields),
                                   "items": [enc(v) for v in obj]}}
    if isinstance(obj, tuple):
        return {"__tuple__": [enc(v) for v in obj]}
    if isinstance(obj, list):
        return [enc(v) for v in obj]
    if type(obj) is dict:
        return _encode_dict(obj, enc, strict=strict, opaque=opaque)
    if not strict:
        return _encode_object(obj, enc, opaque=opaque, kv=kv)
    raise Unstorable(f"an object of type {_type_name(obj)}")


def _encode_dict(obj: dict[Any, Any], enc: Callable[[Any], Any], *, strict: bool, opaque: bool) -> Any:
    keys_ok = all(isinstance(k, str) if strict else isinstance(k, (str, int)) and not isinstance(k, bool) for k in obj)
    if keys_ok:
        return {"__dict__": [[k, enc(v)] for k, v in obj.items()]}
    if strict:
        raise Unstorable("a dict with non-string keys")
    if not opaque:
        bad = next(k for k in obj if not isinstance(k, (str, int)) or isinstance(k, bool))
        raise Unstorable(f"a dict with {type(bad).__name__} keys")
    return {"__opaque__": "dict"}


def _encode_object(obj: Any, enc: Callable[[Any], Any], *, opaque: bool, kv: bool = False) -> Any:
    """The non-strict policy's other objects: caches, ModelOutputs, dict subclasses, slices, opaque values."""
    if _is_cache(obj):
        if kv:
            try:
                return _cache_state(obj, enc)
            except Unstorable:
                pass  # kept by name: the call runs without it
        return {"__cache__": type(obj).__name__}
    if is_model_output(obj):
        cls = type(obj)
        return {"__model_output__": {"class": f"{cls.__module__}:{cls.__qualname__}",
                                     "items": [[str(k), enc(obj[k])] for k in obj.keys()]}}
    if isinstance(obj, dict):  # a dict subclass (OrderedDict, BatchEncoding): stored as a plain dict
        return enc(dict(obj))
    if isinstance(obj, slice):
        return {"__slice__": [enc(obj.start), enc(obj.stop), enc(obj.step)]}
    if opaque:
        return {"__opaque__": type(obj).__qualname__}
    raise Unstorable(f"an object of type {_type_name(obj)}")


def _transformers_path(cls: type) -> str:
    """`module:qualname` of a class of transformers; `Unstorable` for any other (a spec never names other code)."""
    if not cls.__module__.startswith("transformers."):
        raise Unstorable(f"a cache part of type {_type_name(cls)}")
    return f"{cls.__module__}:{cls.__qualname__}"


def _cache_state(obj: Any, enc: Callable[[Any], Any], depth: int = 0) -> dict[str, Any]:
    """`{"__kv_cache__": …}` of a transformers cache object or one of its layers: each attribute's value (its
    layers' too, two levels down); `Unstorable` when one is neither data nor a part of transformers' caches."""
    if depth > 2:
        raise Unstorable("a cache nested too deep")
    state = [[str(k), _cache_value(v, enc, depth)] for k, v in vars(obj).items()]
    return {"__kv_cache__": {"class": _transformers_path(type(obj)), "state": state}}


def _cache_value(value: Any, enc: Callable[[Any], Any], depth: int) -> Any:
    if isinstance(value, type):
        return {"__class__": _transformers_path(value)}
    if isinstance(value, list):
        return [_cache_value(v, enc, depth) for v in value]
    if not isinstance(value, (torch.Tensor, torch.nn.Module, tuple, dict)) and hasattr(value, "__dict__") \
            and type(value).__module__.startswith("transformers."):
        return _cache_state(value, enc, depth + 1)
    return enc(value)


def _transformers_class(path: str) -> Any:
    """The class `module:qualname`, imported only from transformers (None for any other, or one it lacks)."""
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


def _cache_object(body: Mapping[str, Any], decode: Callable[[Any], Any]) -> Any:
    """A `__kv_cache__` rebuilt: an instance of its transformers class (not initialised: its attributes are set
    from the state, as unpickling would, but only from data), or None when the class cannot be imported."""
    cls = _transformers_class(body["class"])
    if not isinstance(cls, type):
        return None
    obj = cls.__new__(cls)
    for key, spec in body["state"]:
        obj.__dict__[key] = decode(spec)
    return obj


def check_value(obj: Any, *, strict: bool = False) -> None:
    """Raise `Unstorable` if `encode_value` would; stores nothing."""
    encode_value(obj, lambda _t: "", strict=strict)


# --------------------------------------------------------------------------- decoding

def _restride(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    if stride and stride != t.stride() and t.numel() > 0 and 0 not in stride:
        try:
            out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
            out.copy_(t)
            return out
        except RuntimeError:
            pass  # overlapping layout: keep the contiguous copy
    return t


def _tensor_getter(tensors: Tensors) -> Callable[[Mapping[str, Any]], torch.Tensor]:
    """Body of a `__tensor__` -> the tensor: a stored one by its key (restrided when the spec keeps strides), a
    described one (no key) as the next of `tensors` in order."""
    if isinstance(tensors, Mapping):
        by_key: Getter = tensors.__getitem__
    elif callable(tensors):
        by_key = tensors
    else:
        it = iter(tensors)
        return lambda body: next(it)

    def get(body: Mapping[str, Any]) -> torch.Tensor:
        if "key" not in body:
            raise ValueError(f"a described tensor {dict(body)!r} needs its tensors in order (an iterator)")
        return _restride(by_key(body["key"]), tuple(body.get("stride") or ()))
    return get


def _tag(spec: Mapping[str, Any]) -> str:
    for k in spec:
        if k.startswith("__") and k.endswith("__"):
            return k
    raise ValueError(f"not a value spec: {dict(spec)!r} (no __tag__ key)")


def decode_value(spec: Any, tensors: Tensors, *, device: str | None = None) -> Any:
    """Rebuild a value from its spec (see the module docstring). ModelOutput classes are re-imported from
    transformers only (one that cannot be imported comes back as a dict); a cache and an opaque value as None.
    `device`, when given, replaces every recorded device (a probe rebuilds its call on the target's)."""
    return _decode(spec, _tensor_getter(tensors), device)


def _decode(spec: Any, tensor: Callable[[Mapping[str, Any]], torch.Tensor], device: str | None) -> Any:
    if isinstance(spec, list):
        return [_decode(v, tensor, device) for v in spec]
    if not isinstance(spec, dict):
        return spec
    tag = next(iter(spec), "")
    body = spec[tag] if tag else None
    if tag == "__tensor__":
        return tensor(body)
    if tag == "__tuple__":
        return tuple(_decode(v, tensor, device) for v in body)
    if tag == "__dict__":
        return {k: _decode(v, tensor, device) for k, v in body}
    if tag == "__device__":
        return torch.device(device or body)
    if tag in _LEAVES:
        return _LEAVES[tag](body)
    if tag == "__slice__":
        return slice(*(_decode(v, tensor, device) for v in body))
    if tag == "__namedtuple__":  # rebuilt as a namedtuple of the same name and fields (nothing is imported)
        cls = collections.namedtuple(body["name"], body["fields"], rename=True)  # type: ignore[misc]
        return cls(*(_decode(v, tensor, device) for v in body["items"]))
    if tag == "__kv_cache__":
        return _cache_object(body, lambda v: _decode(v, tensor, device))
    if tag == "__class__":
        return _transformers_class(body)
    if tag == "__model_output__":
        items = {k: _decode(s, tensor, device) for k, s in body["items"]}
        mo = _transformers_class(body["class"])
        return mo(**items) if mo is not None else items
    raise ValueError(f"unknown value spec {spec!r}")


_LEAVES: dict[str, Callable[[Any], Any]] = {
    "__float__": float, "__dtype__": lambda n: getattr(torch, n), "__layout__": lambda n: getattr(torch, n),
    "__memory_format__": lambda n: getattr(torch, n), "__size__": torch.Size, "__ellipsis__": lambda _: Ellipsis,
    "__cache__": lambda _: None, "__opaque__": lambda _: None,
}


# --------------------------------------------------------------------------- calls

def encode_call(args: tuple[Any, ...] | list[Any], kwargs: Mapping[str, Any], put: Callable[[torch.Tensor], str], *,
                strict: bool = False, keep_strides: bool = False, kv: bool = False) -> dict[str, Any]:
    """`{"args": <tuple spec>, "kwargs": <dict spec>}` of one call; raises `Unstorable` (never opaque)."""
    return {"args": encode_value(tuple(args), put, strict=strict, keep_strides=keep_strides, kv=kv),
            "kwargs": encode_value(dict(kwargs), put, strict=strict, keep_strides=keep_strides, kv=kv)}


def decode_call(spec: Mapping[str, Any], tensors: Tensors) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return decode_value(spec["args"], tensors), decode_value(spec["kwargs"], tensors)


# --------------------------------------------------------------------------- reading specs

def tensor_specs(spec: Any) -> Iterator[dict[str, Any]]:
    """The body of every `__tensor__` inside a spec (any JSON tree of specs), in order."""
    if isinstance(spec, dict):
        if "__tensor__" in spec:
            yield spec["__tensor__"]
            return
        for v in spec.values():
            yield from tensor_specs(v)
    elif isinstance(spec, list):
        for v in spec:
            yield from tensor_specs(v)


def tensor_keys(spec: Any) -> list[str]:
    """The stored tensors' keys a spec refers to, in order, each once."""
    return list(dict.fromkeys(s["key"] for s in tensor_specs(spec) if "key" in s))


def call_tensor_keys(spec: Mapping[str, Any]) -> list[str]:
    """The tensor keys a call spec refers to (to write a repro's own inputs file)."""
    return tensor_keys([spec["args"], spec["kwargs"]])


def is_opaque(spec: Any) -> bool:
    """True when a spec holds a value that cannot be rebuilt (an op signature a probe cannot run)."""
    if isinstance(spec, dict):
        return "__opaque__" in spec or any(is_opaque(v) for v in spec.values())
    if isinstance(spec, list):
        return any(is_opaque(v) for v in spec)
    return False


def _describe_tensor(spec: Mapping[str, Any]) -> str:
    if "shape" not in spec:
        return f"tensor {spec.get('key')}"
    text = f"{_DTYPE_SHORT.get(spec['dtype'], spec['dtype'])}{list(spec['shape'])}"
    if list(spec["stride"]) != _contiguous_stride(spec["shape"]) and math.prod(spec["shape"]) > 1:
        text += f"{{stride={tuple(spec['stride'])}}}"
    return text


def describe_value(spec: Any) -> str:
    """Short human text for a spec: `f32[1, 12, 4]`, `bf16[4, 6]{stride=(1, 4)}`, `2`, `float32`, `(1, 2)`."""
    if isinstance(spec, list):
        return "[" + ", ".join(describe_value(v) for v in spec) + "]"
    if not isinstance(spec, dict):
        return repr(spec)
    for tag in ("__dtype__", "__device__", "__layout__", "__memory_format__", "__float__", "__opaque__", "__cache__"):
        if tag in spec:
            return str(spec[tag])
    if "__kv_cache__" in spec:
        return spec["__kv_cache__"]["class"].rpartition(":")[2]
    if "__class__" in spec:
        return str(spec["__class__"])
    if "__tensor__" in spec:
        return _describe_tensor(spec["__tensor__"])
    if "__slice__" in spec:
        return ":".join("" if v is None else describe_value(v) for v in spec["__slice__"])
    if "__ellipsis__" in spec:
        return "..."
    if "__tuple__" in spec:
        return "(" + ", ".join(describe_value(v) for v in spec["__tuple__"]) + ")"
    if "__size__" in spec:
        return f"Size({spec['__size__']})"
    if "__namedtuple__" in spec:
        body = spec["__namedtuple__"]
        return f"{body['name']}(" + ", ".join(describe_value(v) for v in body["items"]) + ")"
    pairs = spec.get("__dict__") or (spec.get("__model_output__") or {}).get("items")
    if pairs is not None:
        return "{" + ", ".join(f"{k}: {describe_value(v)}" for k, v in pairs) + "}"
    return "{" + ", ".join(f"{k}: {describe_value(v)}" for k, v in spec.items()) + "}"


def source_of(spec: Any, tensor: Callable[[Mapping[str, Any]], str], *, device: str = "torch.device(device)") -> str:
    """Python source that evaluates to the spec's value: `tensor(body)` writes each tensor (in order), `device` each
    device. Specs of plain data, dtypes, devices, layouts, slices, tuples, lists, sizes and dicts."""
    def src(v: Any) -> str:
        return source_of(v, tensor, device=device)

    if isinstance(spec, list):
        return "[" + ", ".join(src(v) for v in spec) + "]"
    if not isinstance(spec, dict):
        return pyrepr(spec)
    tag = _tag(spec)
    body = spec[tag]
    if tag == "__tensor__":
        return tensor(body)
    if tag in ("__dtype__", "__layout__", "__memory_format__"):
        return f"torch.{dotted(body)}"
    if tag == "__device__":
        return device
    if tag == "__float__":
        return f"float({pyrepr(body)})"
    if tag == "__slice__":
        return f"slice({', '.join(src(v) for v in body)})"
    if tag == "__ellipsis__":
        return "..."
    if tag == "__tuple__":
        items = [src(v) for v in body]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if tag == "__size__":
        return f"torch.Size({pyrepr(body)})"
    if tag == "__dict__":
        return "{" + ", ".join(f"{pyrepr(k)}: {src(v)}" for k, v in body) + "}"
    raise ValueError(f"cannot write value spec {spec!r} as source")


# --------------------------------------------------------------------------- specs of earlier versions

_V2_RENAMED = {"float": "__float__", "dtype": "__dtype__", "device": "__device__", "size": "__size__",
               "opaque": "__opaque__"}


def upgrade_v2(spec: Any) -> Any:
    """A spec of the codec's earlier dialect (numerics dump schema 2: `{"tensor": k}`, `{"value": x}`,
    `{"tuple": […]}`, `{"list": […]}`, `{"dict": […]}`, `{"mo": …}`, …) in this format."""
    if not isinstance(spec, dict):
        return spec
    if "tensor" in spec:
        body = {"key": spec["tensor"]}
        if spec.get("stride"):
            body["stride"] = list(spec["stride"])
        return {"__tensor__": body}
    if "cache" in spec:
        return {"__cache__": spec["cache"]}
    if "value" in spec:
        return spec["value"]
    if "namedtuple" in spec:
        return {"__namedtuple__": {"name": spec["namedtuple"], "fields": list(spec["fields"]),
                                   "items": [upgrade_v2(v) for v in spec["tuple"]]}}
    if "tuple" in spec:
        return {"__tuple__": [upgrade_v2(v) for v in spec["tuple"]]}
    if "list" in spec:
        return [upgrade_v2(v) for v in spec["list"]]
    if "dict" in spec:
        return {"__dict__": [[k, upgrade_v2(v)] for k, v in spec["dict"]]}
    if "mo" in spec:
        return {"__model_output__": {"class": spec["mo"], "items": [[k, upgrade_v2(v)] for k, v in spec["items"]]}}
    if "slice" in spec:
        return {"__slice__": list(spec["slice"])}
    for old, new in _V2_RENAMED.items():
        if old in spec:
            return {new: spec[old]}
    raise ValueError(f"unknown value spec {spec!r}")


def upgrade_call_v2(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A call spec (`{"args": …, "kwargs": …}`) of the earlier dialect in this format."""
    return {"args": upgrade_v2(spec["args"]), "kwargs": upgrade_v2(spec["kwargs"])}
