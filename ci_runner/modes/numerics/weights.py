"""Weights check: every parameter and buffer after the round trip to the target, byte for byte.

Weights that load or transfer wrong masquerade as forward bugs: every layer after the bad tensor diverges, and a
day of forward bisect later the cause turns out to be the loader. So this runs before the numerics comparison
(the dump-bisect method, `docs/numerics.md`: "rule out weight loading first; byte-equality before any forward
bisect").

What "the round trip" is depends on the backend:

* **device** (`device` is not `cpu`): each tensor goes to the device the way `module.to(device)` moves it
  (`backend.to_device`) and comes back with `.to("cpu")`; a device plugin whose copy or layout conversion is
  wrong shows here.
* **compiled** (a `compile` backend): a graph that reads every parameter and buffer through the model's own
  attributes (so the backend sees them exactly as in the model's forward: lifted graph inputs, or constants when
  it freezes them) and returns a copy of each (`aten.clone`), compiled by the backend and run on its device. A
  backend that pre-packs, re-lays out or transfers weights wrongly returns them changed.
* both, when the backend compiles for a non-CPU device; **none** for eager CPU (nothing is transferred).

Per tensor: byte-equal or not, the share of elements that are bit-identical, and for changed tensors the max
absolute error (and rel/cos, `metrics.compare_tensors`). Each changed tensor is one `weights_mismatch` finding
(fingerprint key: model, tensor name). Tensors are read in groups of at most `chunk_mb`, so memory stays bounded
by one group's copies.
"""

from __future__ import annotations
from ...registry import FindingKind

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ...backends import resolve_backend
from ...config import BackendSpec, ModelSpec, spec_from_json, spec_to_json
from ...procs.isolate import run_isolated
from ...models.load import load_model
from ...results.model import Finding, clean, fingerprint, number
from .metrics import compare_tensors, public
from .settings import CellContext, dynamo_settings

if TYPE_CHECKING:
    from ...backends import Backend

MAX_FINDINGS = 50
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, kw_only=True)
class TensorCheck:
    """One parameter or buffer after the round trip."""

    name: str
    kind: str  # parameter | buffer
    shape: tuple[int, ...]
    dtype: str
    byte_equal: bool
    equal_share: float  # share of elements that are bit-identical (1.0 when byte-equal)
    max_abs: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # came back with another shape/dtype, or could not be read back

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


@dataclass
class WeightsReport:
    """Every tensor's check, and how the round trip was made (`device`, `compiled`, `device+compiled`, `none`)."""

    method: str
    tensors: list[TensorCheck] = field(default_factory=list)
    not_ran: str | None = None  # why the backend did not run a round trip (`CompileWatch.not_ran`): nothing is shown

    @property
    def mismatched(self) -> list[TensorCheck]:
        return [t for t in self.tensors if not t.byte_equal]

    def summary(self) -> dict[str, Any]:
        n = len(self.tensors)
        numel = {t.name: math.prod(t.shape) for t in self.tensors}
        total = sum(numel.values()) or 1
        return {
            "method": self.method,
            "tensors": n,
            "byte_equal": n - len(self.mismatched),
            "share_tensors_byte_equal": (n - len(self.mismatched)) / n if n else 1.0,
            "share_elements_equal": sum(t.equal_share * numel[t.name] for t in self.tensors) / total if n else 1.0,
            "max_abs": max((t.max_abs for t in self.tensors), default=0.0),
            "mismatched": [t.name for t in self.mismatched][:200],
        }

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "tensors": [t.to_json() for t in self.tensors],
                **({"not_ran": self.not_ran} if self.not_ran else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "WeightsReport":

        tensors = []
        for t in data.get("tensors", []):
            kw = dict(t)
            kw["shape"] = tuple(kw["shape"])
            kw["max_abs"] = number(kw.get("max_abs")) or 0.0
            kw["equal_share"] = number(kw.get("equal_share")) or 0.0
            kw["metrics"] = {k: number(v) if k in ("rel", "cos", "mad", "max_abs", "sqnr_db") else v
                             for k, v in (kw.get("metrics") or {}).items()}
            tensors.append(TensorCheck(**kw))
        return cls(method=data.get("method", "?"), tensors=tensors, not_ran=data.get("not_ran"))


def named_tensors(module: nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(name, parameter|buffer, tensor) of every parameter and buffer; tied tensors once (their first name)."""
    out: list[tuple[str, str, torch.Tensor]] = [(n, "parameter", p) for n, p in module.named_parameters()]
    out += [(n, "buffer", b) for n, b in module.named_buffers() if b is not None]
    return out


def check_tensor(name: str, kind: str, original: torch.Tensor, back: torch.Tensor) -> TensorCheck:
    """Bitwise comparison of one tensor with what came back."""
    shape = tuple(original.shape)
    dtype = str(original.dtype).removeprefix("torch.")
    if back.device.type != "cpu":
        back = back.to("cpu")
    if tuple(back.shape) != shape or back.dtype != original.dtype:
        return TensorCheck(name=name, kind=kind, shape=shape, dtype=dtype, byte_equal=False, equal_share=0.0,
                           max_abs=math.inf, error=f"came back as {str(back.dtype).removeprefix('torch.')} "
                                                   f"{list(back.shape)}")
    a = original.detach().to("cpu").contiguous()
    b = back.detach().contiguous()
    if a.numel() == 0:
        return TensorCheck(name=name, kind=kind, shape=shape, dtype=dtype, byte_equal=True, equal_share=1.0)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    iv = _INT_VIEW.get(a.element_size())
    if iv is not None and torch.equal(a.view(iv), b.view(iv)):  # the common case, without a mask per element
        return TensorCheck(name=name, kind=kind, shape=shape, dtype=dtype, byte_equal=True, equal_share=1.0)
    if a.dtype == torch.bool:
        eq = a == b
    elif iv is not None:
        eq = a.view(iv) == b.view(iv)
        if eq.dim() > len(shape):  # complex viewed as (…, 2): an element is equal when both halves are
            eq = eq.all(dim=-1)
    else:
        eq = (a.reshape(-1).view(torch.uint8).reshape(a.numel(), -1) == b.reshape(-1).view(torch.uint8).reshape(a.numel(), -1)).all(dim=-1)
    share = float(eq.float().mean())
    if bool(eq.all()):
        return TensorCheck(name=name, kind=kind, shape=shape, dtype=dtype, byte_equal=True, equal_share=1.0)
    m = compare_tensors(original.detach().to("cpu"), back)
    return TensorCheck(name=name, kind=kind, shape=shape, dtype=dtype, byte_equal=False, equal_share=share,
                       max_abs=float(m["max_abs"]), metrics=public(m))


def _groups(items: Sequence[tuple[str, str, torch.Tensor]], chunk_bytes: int) -> Iterator[list[tuple[str, str, torch.Tensor]]]:
    group: list[tuple[str, str, torch.Tensor]] = []
    size = 0
    for it in items:
        n = it[2].numel() * it[2].element_size()
        if group and size + n > chunk_bytes:
            yield group
            group, size = [], 0
        group.append(it)
        size += n
    if group:
        yield group


class _Reader(nn.Module):
    """Reads the named tensors through the model's attributes and returns a copy of each (compiled whole)."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        super().__init__()
        self.model = model
        self.names = tuple(names)

    def forward(self) -> tuple[torch.Tensor, ...]:
        out = []
        for name in self.names:
            obj: Any = self.model
            for part in name.split("."):
                obj = getattr(obj, part)
            out.append(torch.clone(obj))
        return tuple(out)


def check_weights(module: nn.Module, backend: "Backend", *, chunk_mb: float = 256.0) -> WeightsReport:
    """Round-trip every parameter and buffer of `module` (on CPU) through `backend` and compare bit for bit.

    `module` is not modified; with a compiling backend on another device a copy of it is moved there.
    """
    device = getattr(backend, "device", "cpu")
    compiled = not getattr(backend, "is_eager", True)
    method = "+".join(m for m, on in (("device", device != "cpu"), ("compiled", compiled)) if on) or "none"
    report = WeightsReport(method=method)
    items = named_tensors(module)
    if method == "none":
        return report
    chunk_bytes = max(1, int(chunk_mb * (1 << 20)))
    if not compiled:
        for name, kind, t in items:
            back = backend.to_device(t.detach()).to("cpu")
            report.tensors.append(check_tensor(name, kind, t, back))
        return report
    target = module
    originals: dict[str, torch.Tensor] | None = None
    if device != "cpu":
        originals = {name: t.detach().clone() for name, _k, t in items}
        target = backend.to_device(copy.deepcopy(module))
    with torch._dynamo.config.patch(**dynamo_settings()), torch.no_grad():
        for group in _groups(items, chunk_bytes):
            names = [name for name, _k, _t in group]
            fn, watch = backend.compile_watched(_Reader(target, names))
            with watch:
                backs = fn()
            report.not_ran = report.not_ran or watch.not_ran(breaks=False)
            for (name, kind, t), back in zip(group, backs):
                orig = originals[name] if originals is not None else t
                report.tensors.append(check_tensor(name, kind, orig, back))
            del backs
    return report


def _owner(module_names: Mapping[str, str], tensor: str) -> tuple[str, str | None]:
    owner = tensor.rpartition(".")[0]
    return owner, module_names.get(owner)


def findings_for(report: WeightsReport, *, backend_id: str, model_id: str,
                 module_classes: Mapping[str, str] | None = None, limit: int = MAX_FINDINGS) -> list[Finding]:
    """One `weights_mismatch` finding per changed tensor (the first `limit`, largest error first)."""

    classes = dict(module_classes or {})
    out = []
    bad = sorted(report.mismatched, key=lambda t: (-(t.max_abs if math.isfinite(t.max_abs) else 1e308), t.name))
    for t in bad[:limit]:
        owner, cls = _owner(classes, t.name)
        if t.error:
            what = f"it {t.error}"
        else:
            what = (f"{t.equal_share:.1%} of its {math.prod(t.shape)} elements are byte-equal, max abs error "
                    f"{t.max_abs:.3g}" + (f" (rel {float(t.metrics['rel']):.2e})" if "rel" in t.metrics else ""))
        out.append(Finding(
            kind=FindingKind.WEIGHTS_MISMATCH, stage="compare",
            message=f"weights: {t.kind} {t.name} {list(t.shape)} {t.dtype} changed on the round trip to the "
                    f"target ({report.method}): {what}",
            fingerprint=fingerprint(FindingKind.WEIGHTS_MISMATCH, backend_id, model_id, t.name),
            module=owner, module_class=cls, metrics=dict(t.metrics),
            details={"tensor": t.name, "kind": t.kind, "shape": list(t.shape), "dtype": t.dtype,
                     "byte_equal": False, "equal_share": t.equal_share, "method": report.method,
                     **({"error": t.error} if t.error else {})},
        ))
    return out


# --------------------------------------------------------------------------------------------- in a cell

def needs_round_trip(backend: Any) -> bool:
    """Whether the backend transfers or compiles the weights (an eager CPU backend does neither)."""
    return not (getattr(backend, "is_eager", True) and getattr(backend, "device", "cpu") == "cpu")


def check_value(module: nn.Module, backend: "Backend", *, chunk_mb: float = 256.0) -> dict[str, Any]:
    """`check_weights` as JSON data, with the module classes its findings name: what a child process returns (this
    check's own child, or the numerics target child, which runs it before its forward: `target.TargetPlan.weights`)."""
    report = check_weights(module, backend, chunk_mb=chunk_mb)
    return {"report": clean(report.to_json()), "classes": {n: type(m).__name__ for n, m in module.named_modules()}}


def weights_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Entry point of the isolated child (`run_isolated("ci_runner.modes.numerics.weights:weights_child", …)`)."""

    backend = resolve_backend(spec_from_json(BackendSpec, payload["backend"]))
    loaded = load_model(spec_from_json(ModelSpec, payload["model"]), seed=int(payload["seed"]),
                        dtype=payload["dtype"], device="cpu")
    return check_value(loaded.module, backend, chunk_mb=float(payload.get("chunk_mb", 256.0)))


def cell_outcome(ctx: CellContext, value: Mapping[str, Any]) -> tuple[list[Finding], dict[str, Any]]:
    """(findings, data for the mode's result) from a `check_value` result."""
    report = WeightsReport.from_json(value["report"])
    classes = value.get("classes") or {}
    findings = findings_for(report, backend_id=ctx.cell.backend.id, model_id=ctx.cell.model.id, module_classes=classes)
    data = {"status": "mismatch" if report.mismatched else "ok", **report.summary()}
    if report.not_ran and not report.mismatched:  # tensors that PyTorch copied: nothing of the backend's shown
        data.update(status="inconclusive", reason=f"the backend did not run the round trip: {report.not_ran[:300]}")
    if len(report.mismatched) > len(findings):
        data["findings_truncated"] = len(report.mismatched) - len(findings)
    return findings, data


def check_cell(ctx: CellContext, *, isolate: bool = True, chunk_mb: float = 256.0) -> tuple[list[Finding], dict[str, Any]]:
    """The weights check of a cell's model on its backend: (findings, data for the mode's result).

    The model is built in the primary reference's dtype, like the numerics target. With `isolate` the round trip
    runs in a child process (a backend that crashes costs this check, not the mode).
    """
    backend = ctx.backend
    primary = ctx.cell.references[0]
    if not needs_round_trip(backend):
        return [], {"status": "skipped", "reason": "eager CPU backend: the weights are not transferred"}
    if isolate:
        payload = {"model": spec_to_json(ctx.cell.model), "backend": spec_to_json(ctx.cell.backend),
                   "seed": ctx.cell.inputs.seed, "dtype": primary.dtype, "chunk_mb": chunk_mb}
        timeout = max(5.0, min(600.0, ctx.remaining() * 0.5))
        res = run_isolated("ci_runner.modes.numerics.weights:weights_child", payload, timeout=timeout,
                           env=dict(ctx.cell.backend.env))
        if res.status != "ok":
            return [], {"status": "error", **res.failure("weights check")}
        return cell_outcome(ctx, res.value)
    loaded = load_model(ctx.cell.model, seed=ctx.cell.inputs.seed, dtype=primary.dtype, device="cpu")
    try:
        value = check_value(loaded.module, backend, chunk_mb=chunk_mb)
    except Exception as exc:
        return [], {"status": "error", "reason": f"weights check could not run: {type(exc).__name__}: "
                                                 f"{str(exc).splitlines()[0] if str(exc) else ''}"}
    return cell_outcome(ctx, value)


__all__ = ["TensorCheck", "WeightsReport", "cell_outcome", "check_cell", "check_tensor", "check_value", "check_weights",
           "findings_for", "named_tensors", "needs_round_trip", "weights_child"]
