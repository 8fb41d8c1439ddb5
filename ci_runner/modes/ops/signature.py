"""The op inventory's record model: an op call's arguments encoded as JSON, a signature, a call site, an inventory.

Tensors are recorded as shape / dtype / stride (values are synthetic when probed), scalars as values, devices and
dtypes by name (`encode_value`). An `OpSignature` is one distinct (op, arguments); an `Inventory` holds one trace's
signatures in first-call order and round-trips through JSON. The tracers that build it are in `inventory`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

_DTYPE_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b8", "complex64": "c64", "complex128": "c128",
}


# --------------------------------------------------------------------------------------------- encoding

def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


def tensor_spec(t: torch.Tensor) -> dict[str, Any]:
    """What a probe needs to rebuild a tensor argument: shape, stride, dtype (values are synthetic)."""
    shape = [int(s) for s in t.shape]
    try:
        stride = [int(s) for s in t.stride()]
    except (RuntimeError, NotImplementedError):  # sparse or nested: take the contiguous layout
        stride = _contiguous_stride(shape)
    return {"shape": shape, "stride": stride, "dtype": dtype_name(t.dtype)}


def _contiguous_stride(shape: Sequence[int]) -> list[int]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return list(reversed(stride))


def encode_value(value: Any, tensor_of: Callable[[Any], torch.Tensor | None] = lambda v: None) -> Any:
    """A JSON-able description of an op argument. `tensor_of` maps graph nodes to their (fake) tensor value.

    Tagged forms: ``{"__tensor__": spec}``, ``{"__dtype__": name}``, ``{"__device__": type}``, ``{"__layout__": …}``,
    ``{"__memory_format__": …}``, ``{"__float__": "inf"|"-inf"|"nan"}``, ``{"__slice__": [start, stop, step]}``,
    ``{"__ellipsis__": true}``, ``{"__tuple__": [...]}``; anything else unrepresentable is ``{"__opaque__": repr}``.
    """
    t = tensor_of(value)
    if t is not None:
        value = t
    if isinstance(value, torch.Tensor):
        return {"__tensor__": tensor_spec(value)}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isnan(value):
            return {"__float__": "nan"}
        if math.isinf(value):
            return {"__float__": "inf" if value > 0 else "-inf"}
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hint = value.node.hint if hasattr(value, "node") else None
        return encode_value(hint) if hint is not None else {"__opaque__": str(value)}
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"__device__": value.type}
    if isinstance(value, torch.layout):
        return {"__layout__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"__memory_format__": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"__slice__": [encode_value(value.start), encode_value(value.stop), encode_value(value.step)]}
    if value is Ellipsis:
        return {"__ellipsis__": True}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, tensor_of) for v in value]}
    if isinstance(value, list):
        return [encode_value(v, tensor_of) for v in value]
    return {"__opaque__": repr(value)[:200]}


def iter_tensor_specs(enc: Any) -> Iterator[dict[str, Any]]:
    """Every tensor spec inside an encoded argument tree, in order."""
    if isinstance(enc, dict):
        if "__tensor__" in enc:
            yield enc["__tensor__"]
            return
        for v in enc.values():
            yield from iter_tensor_specs(v)
    elif isinstance(enc, list):
        for v in enc:
            yield from iter_tensor_specs(v)


def is_opaque(enc: Any) -> bool:
    """True when an encoded tree holds a value a probe cannot rebuild."""
    if isinstance(enc, dict):
        return "__opaque__" in enc or any(is_opaque(v) for v in enc.values())
    if isinstance(enc, list):
        return any(is_opaque(v) for v in enc)
    return False


def describe_value(enc: Any) -> str:
    """Short human text for an encoded argument: `f32[1, 12, 4]`, `bf16[4, 6]{stride=(1, 4)}`, `2`, `float32`."""
    if isinstance(enc, dict):
        if "__tensor__" in enc:
            spec = enc["__tensor__"]
            text = f"{_DTYPE_SHORT.get(spec['dtype'], spec['dtype'])}{list(spec['shape'])}"
            if list(spec["stride"]) != _contiguous_stride(spec["shape"]) and math.prod(spec["shape"]) > 1:
                text += f"{{stride={tuple(spec['stride'])}}}"
            return text
        for tag in ("__dtype__", "__device__", "__layout__", "__memory_format__", "__float__", "__opaque__"):
            if tag in enc:
                return str(enc[tag])
        if "__slice__" in enc:
            return ":".join("" if v is None else describe_value(v) for v in enc["__slice__"])
        if "__ellipsis__" in enc:
            return "..."
        if "__tuple__" in enc:
            return "(" + ", ".join(describe_value(v) for v in enc["__tuple__"]) + ")"
        return "{" + ", ".join(f"{k}: {describe_value(v)}" for k, v in enc.items()) + "}"
    if isinstance(enc, list):
        return "[" + ", ".join(describe_value(v) for v in enc) + "]"
    return repr(enc)


def signature_key(op: str, args: Any, kwargs: Any, outputs: Sequence[int] | None = None) -> str:
    """The identity of a signature: op, encoded arguments and, when the graph uses only some outputs, which."""
    parts: list[Any] = [op, args, kwargs]
    if outputs is not None:
        parts.append({"outputs": list(outputs)})
    return json.dumps(parts, sort_keys=True, separators=(",", ":"))


# --------------------------------------------------------------------------------------------- model

@dataclass(frozen=True)
class CallSite:
    module: str  # qualified module name; "" is the model itself
    module_class: str
    source: str | None = None  # "path/to/file.py:123 in fn"

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "module_class": self.module_class, "source": self.source}


@dataclass
class OpSignature:
    """One distinct (op, arguments) of the inventory, with how often and where it is called."""

    op: str
    args: list[Any]
    kwargs: dict[str, Any]
    key: str
    count: int = 0
    order: int = 0  # position of its first call in the trace
    sites: list[CallSite] = field(default_factory=list)
    site_count: int = 0  # distinct sites seen (sites keeps the first `inventory.MAX_SITES`)
    outputs: list[int] | None = None  # output indices the graph uses (multi-output ops); None: all of them
    imports: tuple[str, ...] = ()  # modules to import before the op resolves (what registered a custom op)

    def describe(self) -> str:
        parts = [describe_value(a) for a in self.args]
        parts += [f"{k}={describe_value(v)}" for k, v in self.kwargs.items()]
        used = "" if self.outputs is None else f"[{', '.join(str(i) for i in self.outputs)}]"
        return f"{self.op}({', '.join(parts)}){used}"

    @property
    def probeable(self) -> bool:
        return not is_opaque(self.args) and not is_opaque(self.kwargs)

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "args": self.args, "kwargs": self.kwargs, "count": self.count, "order": self.order,
                "site_count": self.site_count, "sites": [s.to_dict() for s in self.sites], "text": self.describe(),
                "outputs": self.outputs, "imports": list(self.imports)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "OpSignature":
        args, kwargs = list(d["args"]), dict(d["kwargs"])
        outputs = d.get("outputs")
        outputs = None if outputs is None else [int(i) for i in outputs]
        return cls(op=d["op"], args=args, kwargs=kwargs, key=signature_key(d["op"], args, kwargs, outputs),
                   count=int(d.get("count", 0)), order=int(d.get("order", 0)),
                   site_count=int(d.get("site_count", 0)), sites=[CallSite(**s) for s in d.get("sites", [])],
                   outputs=outputs, imports=tuple(d.get("imports", ())))


@dataclass
class Inventory:
    """All (op, signature) pairs of one trace, in first-call order."""

    level: str
    method: str  # export | aot | dynamo | dispatch
    device: str  # the device the trace modelled (cpu, cuda, meta)
    signatures: list[OpSignature] = field(default_factory=list)
    total_calls: int = 0
    graphs: int = 1
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def op_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.signatures:
            seen.setdefault(s.op, None)
        return list(seen)

    def by_op(self) -> dict[str, list[OpSignature]]:
        out: dict[str, list[OpSignature]] = {}
        for s in self.signatures:
            out.setdefault(s.op, []).append(s)
        return out

    def summary(self, *, max_ops: int = 400, max_modules: int = 5) -> dict[str, Any]:
        """A bounded digest for `ModeResult.data["inventory"]`: counts, per-op calls and owning modules."""
        ops = []
        for op, sigs in sorted(self.by_op().items()):
            modules: dict[str, None] = {}
            for s in sigs:
                for site in s.sites:
                    modules.setdefault(site.module, None)
            ops.append({"op": op, "calls": sum(s.count for s in sigs), "signatures": len(sigs),
                        "modules": list(modules)[:max_modules], "module_count": len(modules)})
        return {
            "level": self.level, "method": self.method, "device": self.device, "graphs": self.graphs,
            "total_calls": self.total_calls, "distinct_ops": len(ops), "distinct_signatures": len(self.signatures),
            "ops": ops[:max_ops], "ops_truncated": len(ops) > max_ops, "notes": self.notes[:20],
            "duration_s": round(self.duration_s, 3),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "method": self.method, "device": self.device, "graphs": self.graphs,
                "total_calls": self.total_calls, "notes": self.notes, "duration_s": round(self.duration_s, 3),
                "signatures": [s.to_dict() for s in self.signatures]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Inventory":
        return cls(level=d["level"], method=d["method"], device=d.get("device", "cpu"),
                   signatures=[OpSignature.from_dict(s) for s in d.get("signatures", [])],
                   total_calls=int(d.get("total_calls", 0)), graphs=int(d.get("graphs", 1)),
                   notes=list(d.get("notes", [])), duration_s=float(d.get("duration_s", 0.0)))


# --------------------------------------------------------------------------------------------- op names

def resolve_callable(name: str) -> Callable[..., Any]:
    """The callable behind an inventory op name (`aten.softplus.default`, `torch.nn.functional.silu`, …)."""
    parts = name.split(".")
    if len(parts) == 3 and not name.startswith("torch."):
        ns, op, overload = parts
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    import importlib

    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"cannot resolve {name!r} to a callable")


def load_inventory(path: str | Path) -> Inventory:
    return Inventory.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))


def ops_in(signatures: Iterable[OpSignature]) -> set[str]:
    return {s.op for s in signatures}



__all__ = [
    "CallSite", "OpSignature", "Inventory", "encode_value", "describe_value", "iter_tensor_specs", "is_opaque",
    "tensor_spec", "dtype_from_name", "dtype_name", "resolve_callable", "load_inventory", "ops_in", "signature_key",
]
