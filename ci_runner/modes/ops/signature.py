"""The op inventory's record model: an op call's arguments as specs, a signature, a call site, an inventory.

An op call's arguments are written in the one wire format (`engine/codec.py`, `encode_arg`): tensors by shape,
dtype and stride (values are synthetic when probed), scalars as values, devices and dtypes by name. An
`OpSignature` is one distinct (op, arguments); an `Inventory` holds one trace's signatures in first-call order and
round-trips through JSON. The tracers that build it are in `inventory`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ...engine.codec import describe_value, is_opaque


# --------------------------------------------------------------------------------------------- identity

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



__all__ = ["CallSite", "OpSignature", "Inventory", "resolve_callable", "load_inventory", "ops_in", "signature_key"]
