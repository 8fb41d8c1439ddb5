"""Batch invariance: the same input in every slot of a batch must give the same output in every slot.

"Single prompt OK, batch fails" has two very different causes: a bug in the multi-sequence path, or kernels whose
reduction order depends on the batch (split-K GEMMs, per-slot dispatch), which make slots disagree and flip
edge-confidence tokens. The experiment (the dump-bisect method, `docs/numerics.md`) tells them apart and names the first layer:

* **same input** (E1): the cell's input (sample 0, first row) copied into all `slots` slots of one batch, run on
  the target (compiled whole, with every submodule's output observed the way the numerics mode's cumulative view
  does); per module call, slot 0 against each slot N. Slots that agree bit for bit are invariant; the first
  layer where they disagree beyond the threshold is where a `batch_variance` finding points.
* **position** (E2–E5, optional): the input in slot j among different inputs, for every j; per layer, the
  input's output at slot j against slot 0. A result that moves with the slot is a non-commutative path.

What counts as "disagree": bit-identical slots are the property; a finding needs more than rounding noise. Per
layer the threshold is the numerics mode's data-derived threshold for that layer (cumulative view, when a
`ThresholdTable` is given; else the floors of the primary dtype), raised to `margin ×` the slot spread the
eager reference itself shows in the same experiment (a reference stack that is not bitwise batch-invariant is
not the target's fault). The report also names the first layer whose slots are not bit-identical, as data.

Only tensors whose first dimension is the batch are compared (a rotary table shared by all slots is not).

Each compiled run is watched (`watched.watched_outputs`: a fresh compile, Dynamo's and the backend's own
fallbacks): a run the backend did not run makes the experiment `inconclusive` (slots of a PyTorch run say nothing
of the backend), and one it ran only without hooks compares the model's output alone.
"""

from __future__ import annotations
from ...registry import FindingKind

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ...backends import resolve_backend
from ...config import BackendSpec, InputSpec, ModelSpec, spec_from_json, spec_to_json
from ...procs.isolate import run_isolated
from ...models.load import build_inputs, load_model
from ...options import ThresholdOptions
from ...models.tree import map_tensors
from ...results.model import Finding, clean, fingerprint, number
from .capture import run_eager_with_outputs
from .metrics import compare_tensors, cos_text, public, worst
from .settings import CellContext
from .thresholds import ThresholdTable, exceeded
from .watched import watched_outputs

if TYPE_CHECKING:
    from ...backends import Backend

_SAME_KEYS = ("attention_mask", "token_type_ids", "position_ids", "cache_position", "pixel_mask", "image_sizes")

Calls = list[tuple[str, dict[str, torch.Tensor]]]  # (call key, {sub: output tensor}) in completion order


# --------------------------------------------------------------------------------------------- inputs

def first_row(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The inputs of slot 0 only (row 0 of every tensor batched like the first input tensor)."""
    tensors = [v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    if not tensors:
        raise ValueError("the model's inputs hold no batched tensor")
    b0 = tensors[0].shape[0]
    return {k: (v[:1] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b0 else v)
            for k, v in kwargs.items()}


def batched(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One batch from single-row inputs (every batched tensor concatenated along dim 0)."""
    first = rows[0]
    out: dict[str, Any] = {}
    for k, v in first.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == 1:
            out[k] = torch.cat([r[k] for r in rows], dim=0)
        else:
            out[k] = v
    return out


def other_input(row: Mapping[str, Any]) -> dict[str, Any]:
    """A different input of the same shape: token ids rolled, floating inputs flipped; masks kept."""
    out: dict[str, Any] = {}
    for k, v in row.items():
        if not isinstance(v, torch.Tensor) or k in _SAME_KEYS or v.dtype == torch.bool or v.dim() == 0:
            out[k] = v
        elif v.is_floating_point():
            out[k] = torch.flip(v, dims=[-1])
        else:
            out[k] = torch.roll(v, shifts=1, dims=-1)
    return out


# --------------------------------------------------------------------------------------------- running

def run_with_outputs(module: nn.Module, backend: "Backend | None", kwargs: Mapping[str, Any],
                     ran: list[dict[str, Any]] | None = None) -> Calls:
    """Every submodule's output of one forward: compiled by `backend` (whole model, watched: `watched_outputs`;
    how it ran is appended to `ran`), or eager when it is None or eager (on its device). Output tensors come back
    on CPU; a compiled run the backend ran only without hooks gives the model's output alone."""
    device = getattr(backend, "device", "cpu") if backend is not None else "cpu"
    args = map_tensors(lambda t: t.to(device), dict(kwargs))
    if backend is not None and not backend.is_eager:
        run = watched_outputs(module, backend, (), args)
        calls = run.compared()
        if ran is not None:
            ran.append(run.status())
    else:
        calls = run_eager_with_outputs(module, args)
    return [(k, {s: t.detach().to("cpu") for s, t in ts.items()}) for k, ts in calls]


@dataclass
class SlotLayer:
    """One module call: slot 0 against the other slots (worst of them)."""

    key: str
    module_class: str
    order: int
    bitwise: bool
    metrics: dict[str, Any]
    worst_slot: int
    compared: int  # tensors compared (first dimension = batch)


def slot_spread(calls: Calls, slots: int, classes: Mapping[str, str], *, pairs: Sequence[tuple[int, int]] | None = None,
                per_run: Sequence[Calls] | None = None) -> list[SlotLayer]:
    """Per call, slot `a` against slot `b` for each pair `(a, b)` (default: 0 against every other slot).

    With `per_run` (the position experiment, one run per position) a pair `(a, b)` compares run `a`'s slot `a`
    against run `b`'s slot `b` (default: run 0's slot 0 against run j's slot j, for every other run). A layer's
    `worst_slot` is the `b` of its worst pair.
    """
    out = []
    runs = list(per_run) if per_run is not None else None
    n_sides = len(runs) if runs is not None else slots
    todo = list(pairs) if pairs is not None else [(0, j) for j in range(1, n_sides)]
    for a, b in todo:
        if not (0 <= a < slots and 0 <= b < slots) or (runs is not None and not (a < len(runs) and b < len(runs))):
            raise ValueError(f"slot pair {(a, b)} is outside 0..{slots - 1}")
    base = runs[0] if runs is not None else calls
    lookup = [dict(r) for r in runs] if runs is not None else None
    for order, (key, tensors) in enumerate(base):
        ms, bitwise, n = [], True, 0
        for sub, t in tensors.items():
            if t.dim() == 0 or t.shape[0] != slots:
                continue
            n += 1
            for a, b in todo:
                if lookup is None:
                    x, y = t[a], t[b]
                    what = f"slot {b}" if a == 0 else f"slot {a} vs {b}"
                else:
                    ta, tb = lookup[a].get(key, {}).get(sub), lookup[b].get(key, {}).get(sub)
                    if ta is None or tb is None or tuple(ta.shape) != tuple(t.shape) or tuple(tb.shape) != tuple(t.shape):
                        continue
                    x, y = ta[a], tb[b]
                    what = f"position {b}" if a == 0 else f"position {a} vs {b}"
                if bitwise and not torch.equal(x, y):
                    bitwise = False
                m = compare_tensors(x, y, where=f"{key}[{sub}] {what}")
                m["slot"] = b
                ms.append(m)
        if not n or not ms:
            continue
        w = worst(ms)
        worst_slot = max(ms, key=lambda m: float(m["rel"]) if not math.isnan(float(m["rel"])) else math.inf)["slot"]
        out.append(SlotLayer(key=key, module_class=classes.get(key.split("#")[0], "?"), order=order, bitwise=bitwise,
                             metrics=w, worst_slot=worst_slot, compared=n))
    return out


def batch_experiment(module: nn.Module, backend: "Backend | None", kwargs: Mapping[str, Any], *, slots: int = 4,
                     position: bool = False, reference: nn.Module | None = None) -> dict[str, Any]:
    """Run the experiments; strict-JSON per-layer results (no thresholds applied yet, see `evaluate`).

    `module` runs on `backend` (None: eager CPU); `reference` (default `module` itself, eagerly on CPU) gives the
    slot spread of the reference stack in the same-input experiment.
    """
    classes = {n: type(m).__name__ for n, m in module.named_modules()}
    row = first_row(kwargs)
    same = batched([row] * slots)
    out: dict[str, Any] = {"slots": slots}
    ref_calls = run_with_outputs(reference if reference is not None else module, None, same)
    out["reference"] = [_layer_json(x) for x in slot_spread(ref_calls, slots, classes)]
    del ref_calls
    ran: list[dict[str, Any]] = []
    calls = run_with_outputs(module, backend, same, ran)
    out["same_input"] = [_layer_json(x) for x in slot_spread(calls, slots, classes)]
    del calls
    if position:
        other = other_input(row)
        runs = []
        for j in range(slots):
            rows = [other] * slots
            rows = list(rows)
            rows[j] = row
            runs.append(run_with_outputs(module, backend, batched(rows), ran))
        out["position"] = [_layer_json(x) for x in slot_spread(runs[0], slots, classes, per_run=runs)]
    if ran:  # how the backend ran each compiled run (`watched.CaptureRun.status`)
        out["backend_ran"] = ran
        not_ran = next((r["not_ran"] for r in ran if r.get("not_ran")), None)
        if not_ran:
            out["not_ran"] = not_ran
    return out


def _layer_json(x: SlotLayer) -> dict[str, Any]:

    return {"key": x.key, "module_class": x.module_class, "order": x.order, "bitwise": x.bitwise,
            "metrics": clean(public(x.metrics)), "worst_slot": x.worst_slot, "compared": x.compared}


# --------------------------------------------------------------------------------------------- verdict

ThresholdFn = Callable[[str], Mapping[str, float]]


def default_threshold(dtype: str = "float32") -> ThresholdFn:
    """The floors of `dtype` when no thresholds table is at hand."""

    rel, _mad, cos = ThresholdOptions().floors(dtype)
    return lambda _key: {"rel": rel, "cos": 1.0 - cos}


def evaluate(result: Mapping[str, Any], threshold: ThresholdFn, *, margin: float = 8.0) -> dict[str, Any]:
    """Apply thresholds: per experiment the flagged layers, the first flagged and the first non-bitwise layer."""

    ref = {x["key"]: x for x in result.get("reference", [])}
    verdict: dict[str, Any] = {"slots": result.get("slots")}
    for exp in ("same_input", "position"):
        if exp not in result:
            continue
        rows = []
        for x in result[exp]:
            m = {k: number(v) for k, v in x["metrics"].items()}
            thr = dict(threshold(x["key"]))
            r = ref.get(x["key"])
            if r is not None:
                rm = {k: number(v) for k, v in r["metrics"].items()}
                thr["rel"] = max(float(thr.get("rel", 0.0)), margin * float(rm["rel"]))
                thr["cos"] = min(float(thr.get("cos", 1.0)), 1.0 - margin * margin * max(0.0, 1.0 - float(rm["cos"])))
            thr.pop("mad", None)  # slot-vs-slot mad has no scale reference here
            over = exceeded(m, thr)
            rows.append({**x, "metrics": m, "threshold": thr, "exceeded": over, "flagged": bool(over),
                         "reference_bitwise": r["bitwise"] if r is not None else None})
        flagged = [r for r in rows if r["flagged"]]
        nonbit = [r for r in rows if not r["bitwise"]]
        verdict[exp] = {
            "layers": rows,
            "bitwise": not nonbit,
            "first_nonbitwise": nonbit[0]["key"] if nonbit else None,
            "first_flagged": flagged[0]["key"] if flagged else None,
            "flagged": len(flagged),
        }
    return verdict


def findings_for(verdict: Mapping[str, Any], *, backend_id: str, model_id: str) -> list[Finding]:
    """One `batch_variance` finding per experiment's first flagged layer (one per module)."""

    out: list[Finding] = []
    slots = verdict.get("slots")
    for exp in ("same_input", "position"):
        v = verdict.get(exp)
        if not v or not v["first_flagged"]:
            continue
        row = next(r for r in v["layers"] if r["key"] == v["first_flagged"])
        module = row["key"].split("#")[0]
        if any(f.module == module for f in out):
            continue
        m, thr = row["metrics"], row["threshold"]
        if exp == "same_input":
            what = (f"with the same input in all {slots} slots of a batch, slot {row['worst_slot']} differs from "
                    f"slot 0")
        else:
            what = (f"the same input among {slots - 1} other inputs gives another output in slot "
                    f"{row['worst_slot']} than in slot 0")
        msg = (f"batch variance: {what} from {module or '(root)'} ({row['module_class']}) on: rel "
               f"{float(m['rel']):.2e}, {cos_text(m['cos'])} (threshold rel {float(thr['rel']):.2e}); "
               f"{v['flagged']} layer(s) over threshold; first layer whose slots are not bit-identical: "
               f"{v['first_nonbitwise'] or '(root)'}")
        out.append(Finding(
            kind=FindingKind.BATCH_VARIANCE, stage="compare", message=msg,
            fingerprint=fingerprint(FindingKind.BATCH_VARIANCE, backend_id, model_id, module),
            module=module, module_class=row["module_class"], metrics=dict(m), threshold=dict(thr),
            details={"experiment": exp, "slots": slots, "worst_slot": row["worst_slot"], "call": row["key"],
                     "flagged_layers": v["flagged"], "first_nonbitwise": v["first_nonbitwise"],
                     "reference_bitwise": row.get("reference_bitwise"), "exceeded": row["exceeded"]},
        ))
    return out


# --------------------------------------------------------------------------------------------- in a cell

def batch_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Entry point of the isolated child (`run_isolated("ci_runner.modes.numerics.batch_invariance:batch_child", …)`)."""

    backend = resolve_backend(spec_from_json(BackendSpec, payload["backend"]))
    spec = spec_from_json(ModelSpec, payload["model"])
    inputs = spec_from_json(InputSpec, payload["inputs"])
    reference = load_model(spec, seed=int(payload["seed"]), dtype=payload["dtype"], device="cpu")
    kwargs = build_inputs(reference, inputs, sample=int(payload.get("sample", 0)), device="cpu")
    target = load_model(spec, seed=int(payload["seed"]), dtype=payload["dtype"], device="cpu").module
    if backend.device != "cpu":
        target = backend.to_device(target)

    return clean(batch_experiment(target, backend, kwargs, slots=int(payload["slots"]),
                                   position=bool(payload["position"]), reference=reference.module))


def check_cell(ctx: CellContext, *, table: ThresholdTable | None, slots: int = 4, position: bool = False,
               isolate: bool = True, sample: int = 0) -> tuple[list[Finding], dict[str, Any]]:
    """The experiment on a cell's backend: (findings, data for the mode's result)."""

    primary = ctx.cell.references[0]
    payload = {"model": spec_to_json(ctx.cell.model), "backend": spec_to_json(ctx.cell.backend),
               "inputs": spec_to_json(ctx.cell.inputs), "seed": ctx.cell.inputs.seed, "dtype": primary.dtype,
               "slots": slots, "position": position, "sample": sample}
    if isolate:
        timeout = max(5.0, min(900.0, ctx.remaining() * 0.5))
        res = run_isolated("ci_runner.modes.numerics.batch_invariance:batch_child", payload, timeout=timeout,
                           env=dict(ctx.cell.backend.env))
        if res.status != "ok":
            return [], {"status": "error", **res.failure("batch invariance")}
        result = res.value
    else:
        try:
            result = batch_child(payload)
        except Exception as exc:
            return [], {"status": "error", "reason": f"batch invariance could not run: {type(exc).__name__}: "
                                                     f"{str(exc).splitlines()[0] if str(exc) else ''}"}
    if table is not None:
        margin = float(table.options.margin)

        def thr(key: str) -> Mapping[str, float]:
            return table.get(key, "cumulative")[0]
    else:
        margin = 8.0
        thr = default_threshold(primary.dtype)
    if result.get("not_ran"):  # slots of a run in PyTorch agree or not: nothing of the backend's
        return [], {"status": "inconclusive", "slots": slots, "backend_ran": result.get("backend_ran"),
                    "reason": f"the backend did not run the model: {result['not_ran'][:400]}"}
    verdict = evaluate(result, thr, margin=margin)
    findings = findings_for(verdict, backend_id=ctx.cell.backend.id, model_id=ctx.cell.model.id)
    data: dict[str, Any] = {"status": "variant" if findings else "invariant", "slots": slots}
    if result.get("backend_ran"):
        data["backend_ran"] = result["backend_ran"]
        if any(r.get("capture") == "no-hooks" for r in result["backend_ran"]):
            data["note"] = "the backend ran the model only without hooks: the model's output alone is compared"
    for exp in ("same_input", "position"):
        if exp in verdict:
            v = verdict[exp]
            data[exp] = {"bitwise": v["bitwise"], "first_nonbitwise": v["first_nonbitwise"],
                         "first_flagged": v["first_flagged"], "flagged": v["flagged"],
                         "layers": [{"key": r["key"], "bitwise": r["bitwise"], "rel": r["metrics"]["rel"],
                                     "cos": r["metrics"]["cos"], "threshold_rel": r["threshold"]["rel"],
                                     "flagged": r["flagged"]} for r in v["layers"][:2000]]}
    return findings, data


__all__ = ["SlotLayer", "batch_child", "batch_experiment", "batched", "check_cell", "default_threshold", "evaluate",
           "findings_for", "first_row", "other_input", "run_with_outputs", "slot_spread"]
