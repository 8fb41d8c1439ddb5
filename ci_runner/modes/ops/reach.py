"""Whether an op's mismatch reaches the model's output: measured on the cell's own inputs, not guessed.

A probe judges an op alone, on synthetic inputs. Whether its wrong values matter for *this* model is another
question: a wrong bool `cumsum` whose result only feeds a comparison, or a product with zero, may leave the
model's output unchanged. For each `op_mismatch` finding of the single forward, one isolated child
(`procs.isolate.run_isolated`; the backend may crash or hang) runs the model eagerly on the cell's inputs:

1. once plain (the reference);
2. once per mismatched op, under a `TorchDispatchMode` (`Inject`) that computes every call of that op overload
   (every signature, the ones that passed their probe too: each is computed the way the backend computes it)
   through the backend by the probe's own path (`probe.run_call`: a one-op function through
   `Backend.compile_watched`, or the op on an eager device), and every other op with the plain eager kernels.

The two outputs are compared tensor by tensor (every tensor of the model's output, `models.tree.tensors_in`) with
the ops mode's tolerance for the output's dtype (`OpsOptions.tolerance`; integers and bools exactly), by the
probes' own rule (`compare.compare_leaf`). The finding gets `details.reaches_output` (true / false / null when it
could not be measured, with `details.reaches_output_note` saying why), `details.output_effect` ({max_abs, rel}:
the largest absolute difference over the output tensors, and that divided by the largest |plain| value of its
tensor) and a clause in its message. Finding, fingerprint and the cell's status stay: a wrong op is a bug even
where these inputs hide it.

The child journals each op (`enter-reach`/`leave-reach`) and appends each op's result to a file as it goes, so a
crash or a hang costs the op in flight and those after it, each said in its note. Only cells with `op_mismatch`
findings pay for it; `options.ops.reach_output: false` turns it off. A phase's op findings are not measured
(their note says so): that needs the phase's calls (`workloads.calls.run_phase`) run twice the same way.
"""

from __future__ import annotations

import copy
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ...backends import resolve_backend
from ...config import BackendSpec, InputSpec, ModelSpec, spec_from_json, spec_to_json
from ...engine.codec import dtype_name
from ...fsutil import append_line
from ...models.load import build_inputs, load_model
from ...models.tree import tensors_in
from ...options import OpsOptions
from ...procs.isolate import child_journal, open_entry, run_isolated
from ...registry import FindingKind
from ...results.model import Finding
from .compare import compare_leaf
from .probe import run_call
from .signature import resolve_callable

if TYPE_CHECKING:
    from .. import ModeContext

CHILD = "ci_runner.modes.ops.reach:reach_child"
MIN_SECONDS = 30.0  # under this much of the cell's time left, the child is not started (a note says so)
_MARGIN_S = 10.0  # left to the cell after the child's limit


# --------------------------------------------------------------------------------------------- the child

class Inject(TorchDispatchMode):
    """Every call of `op` (an OpOverload) computed on `backend` by the probe's path; other ops run as they are.

    Counts the calls and those whose backend value differs from the eager kernel's; the backend's value takes the
    eager value's dtype when they differ (the rest of the forward runs as the model wrote it)."""

    def __init__(self, op: Any, backend: Any) -> None:
        super().__init__()
        self.op = op
        self.backend = backend
        self.calls = 0
        self.differing = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is not self.op:
            return out
        self.calls += 1
        value = run_call(self.backend, func, args, kwargs)
        fitted = _fit(value, out, str(func))
        if any(isinstance(e, torch.Tensor) and not torch.equal(e, a)
               for e, a in zip(pytree.tree_leaves(out), pytree.tree_leaves(fitted))):
            self.differing += 1
        return fitted


class _Unfit(Exception):
    pass


def _fit(value: Any, like: Any, op: str) -> Any:
    """The backend's value in the structure, device and dtype of the eager value `like`."""
    got, want = pytree.tree_leaves(value), pytree.tree_leaves(like)
    if len(got) != len(want):
        raise _Unfit(f"{op} returned {len(got)} value(s) instead of {len(want)}")
    fitted = []
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(w.shape):
                shape = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                raise _Unfit(f"{op} returned {shape} where eager returns shape {tuple(w.shape)}")
            g = g.to(device=w.device, dtype=w.dtype)
        fitted.append(g)
    return pytree.tree_unflatten(fitted, pytree.tree_structure(like))


def output_effect(plain: Sequence[torch.Tensor], injected: Sequence[torch.Tensor],
                  tolerance: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """{reaches, max_abs, rel, problem}: whether any output tensor differs beyond its dtype's tolerance (the probes'
    rule, `compare_leaf`), the largest finite |difference|, and that over the largest finite |plain| of its tensor."""
    if len(plain) != len(injected):
        return {"reaches": True, "max_abs": None, "rel": None,
                "problem": f"{len(injected)} output tensors instead of {len(plain)}"}
    worst, rel, problem = 0.0, 0.0, None
    for i, (e, a) in enumerate(zip(plain, injected)):
        rtol, atol = (tuple(tolerance.get(dtype_name(e.dtype), (0.0, 0.0))) + (0.0, 0.0))[:2]
        why = compare_leaf(i, e, a, float(rtol), float(atol))
        problem = problem or why
        if tuple(e.shape) != tuple(a.shape) or e.numel() == 0:
            continue
        ed, ad = e.detach().double(), a.detach().to(e.dtype).double()
        finite = torch.isfinite(ed) & torch.isfinite(ad)
        if not bool(finite.any()):
            continue
        diff = float((ed - ad).abs()[finite].max())
        scale = float(ed.abs()[finite].max())
        if diff >= worst:
            worst = diff
            rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
    return {"reaches": problem is not None, "max_abs": worst, "rel": rel if math.isfinite(rel) else None,
            "problem": problem}


def _forward(model: torch.nn.Module, kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(**copy.deepcopy(dict(kwargs)))
    return [t.detach().clone() for t in tensors_in(out)]


def _one_op(model: torch.nn.Module, kwargs: Mapping[str, Any], backend: Any, op_name: str,
            plain: Sequence[torch.Tensor], tolerance: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {"op": op_name, "reaches_output": None}
    try:
        op = resolve_callable(op_name)
    except Exception as exc:
        return {**row, "note": f"the op cannot be resolved here: {type(exc).__name__}: {exc}"[:500]}
    if not isinstance(op, torch._ops.OpOverload):
        return {**row, "note": "not measured: the op is not an ATen overload (the dispatcher never sees it)"}
    mode = Inject(op, backend)
    try:
        with mode:
            injected = _forward(model, kwargs)
    except Exception as exc:
        words = str(exc).strip().splitlines()
        return {**row, "calls": mode.calls, "note": f"not measured: the backend could not run the op on the "
                f"model's tensors: {type(exc).__name__}: {words[0] if words else ''}"[:600]}
    row.update(calls=mode.calls, differing_calls=mode.differing, seconds=round(time.monotonic() - t0, 3))
    if mode.calls == 0:
        return {**row, "note": "not measured: the model's eager forward never calls the op (the backend's graph has "
                               "it after aot_autograd; eager calls another form of it)"}
    effect = output_effect(plain, injected, tolerance)
    row.update(reaches_output=effect["reaches"], output_effect={"max_abs": effect["max_abs"], "rel": effect["rel"]},
               problem=effect["problem"])
    return row


def reach_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Isolated-child entry (`run_isolated(CHILD, …)`): the plain forward, then one injected forward per op of
    `payload["ops"]`, each op's row appended to `payload["results"]` as it is done."""
    backend = resolve_backend(spec_from_json(BackendSpec, payload["backend"]))
    backend.prepare()
    inputs = spec_from_json(InputSpec, payload["inputs"])
    loaded = load_model(spec_from_json(ModelSpec, payload["model"]), seed=inputs.seed, device="cpu")
    kwargs = build_inputs(loaded, inputs, sample=0, device="cpu")
    plain = _forward(loaded.module, kwargs)
    for op_name in payload["ops"]:
        child_journal("enter-reach", op_name)
        row = _one_op(loaded.module, kwargs, backend, op_name, plain, payload["tolerance"])
        append_line(payload["results"], json.dumps(row, default=str))
        child_journal("leave-reach", op_name)
    return {"ops": len(payload["ops"])}


# --------------------------------------------------------------------------------------------- the parent

def clause(row: Mapping[str, Any]) -> str:
    """The finding message's clause for a measured row; empty when it was not measured."""
    effect = row.get("output_effect") or {}
    max_abs = effect.get("max_abs")
    size = f" (max abs {max_abs:.3g})" if isinstance(max_abs, (int, float)) else ""
    if row.get("reaches_output") is True:
        return f"; its mismatch reaches the model's output{size}"
    if row.get("reaches_output") is False:
        return f"; its mismatch does not reach the model's output for these inputs{size}"
    return ""


def apply(findings: Sequence[Finding], rows: Mapping[str, Mapping[str, Any]]) -> None:
    """Each finding's `details.reaches_output`, `reaches_output_note`, `output_effect`, `reach` and, when measured,
    the clause at the end of its message's first line (the message before it is kept as `details.message_full`,
    which root causes key on: one cause whether or not its mismatch reaches the output in a cell)."""
    for f in findings:
        row = rows.get(str(f.op)) or {"reaches_output": None, "note": "not measured"}
        f.details["reaches_output"] = row.get("reaches_output")
        if row.get("note"):
            f.details["reaches_output_note"] = row["note"]
        if row.get("output_effect") is not None:
            f.details["output_effect"] = dict(row["output_effect"])
        f.details["reach"] = {k: row[k] for k in ("calls", "differing_calls", "problem", "seconds") if k in row}
        words = clause(row)
        if words:
            f.details.setdefault("message_full", f.message)  # root causes key on the error, not on this clause
            head, sep, rest = f.message.partition("\n")
            f.message = head + words + sep + rest  # on the first line, which summaries show


def _read_rows(path: Path) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        rows[str(row["op"])] = row
    return rows


def mark_unmeasured(findings: Sequence[Finding], opts: OpsOptions) -> None:
    """A phase's or a sharded graph's `op_mismatch` findings: `reaches_output` null, with why (not measured yet)."""
    if not opts.reach_output:
        return
    for f in findings:
        if f.kind == FindingKind.OP_MISMATCH and (f.phase or f.parallel) and "reaches_output" not in f.details:
            apply([f], {str(f.op): {"reaches_output": None, "note": "not measured: only the single forward's op "
                                    "findings are measured, not a phase's or a sharded graph's"}})


def measure(ctx: "ModeContext", opts: OpsOptions, findings: Sequence[Finding], work: Path) -> dict[str, Any] | None:
    """Measure and record, on the single forward's `op_mismatch` findings, whether each reaches the model's output
    (see the module docstring); `data.reach` for the mode's result, None when there is nothing to measure."""
    targets = [f for f in findings if f.kind == FindingKind.OP_MISMATCH and not f.phase and not f.parallel]
    if not targets or not opts.reach_output:
        return None
    ops = list(dict.fromkeys(str(f.op) for f in targets))
    left = ctx.remaining()
    if left < MIN_SECONDS + _MARGIN_S:
        note = f"not measured: {left:.0f} s of the cell's time left (under {MIN_SECONDS:.0f} s)"
        apply(targets, {op: {"reaches_output": None, "note": note} for op in ops})
        return {"status": "skipped", "reason": note}
    work.mkdir(parents=True, exist_ok=True)
    results, journal = work / "reach.jsonl", work / "reach-journal.log"
    results.unlink(missing_ok=True)
    journal.unlink(missing_ok=True)
    timeout = max(MIN_SECONDS, min(left - _MARGIN_S, max(MIN_SECONDS, left / 2)))
    payload = {"backend": spec_to_json(ctx.cell.backend), "model": spec_to_json(ctx.cell.model),
               "inputs": spec_to_json(ctx.cell.inputs), "ops": ops, "results": str(results),
               "tolerance": {k: list(v) for k, v in opts.tolerance.items()}}
    t0 = time.monotonic()
    ctx.journal("enter-phase", "ops.reach")
    res = run_isolated(CHILD, payload, timeout=timeout, journal=journal, env=dict(ctx.cell.backend.env))
    ctx.journal("leave-phase", "ops.reach")
    rows = _read_rows(results)
    if not res.ok:
        in_flight = open_entry(journal, "reach")
        for op in ops:
            if op not in rows:
                where = "while measuring this op" if op == in_flight else (
                    "before this op was measured" if rows or in_flight else "before its plain forward finished")
                rows[op] = {"op": op, "reaches_output": None, "note": f"not measured: the child {res.describe()} "
                                                                      f"{where}"}
    apply(targets, rows)
    out: dict[str, Any] = {"status": "ran" if res.ok else "error", "seconds": round(time.monotonic() - t0, 3),
                           "ops": {op: rows[op].get("reaches_output") for op in ops}}
    if not res.ok:
        out.update(res.failure("the reach measurement"))
    return out
