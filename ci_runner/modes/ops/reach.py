"""Whether an op's mismatch reaches the model's output: measured on the cell's own inputs, not guessed.

A probe judges an op alone, on synthetic inputs. Whether its wrong values matter for *this* model is another
question: a wrong bool `cumsum` whose result only feeds a comparison, or a product with zero, may leave the
model's output unchanged. For the `op_mismatch` findings of a cell, one isolated child
(`procs.isolate.run_isolated`; the backend may crash or hang) runs the model eagerly on the CPU, on the cell's
inputs, for each job: the single forward (its findings), and each phase that has op findings of its own (its
calls as `workloads.calls.run_phase` makes them, a padded batch's pads included):

1. once plain (the reference; a phase's injected runs follow its greedy tokens);
2. once per mismatched op, under a `TorchDispatchMode` (`Inject`) that computes every call of that op overload
   (every signature, the ones that passed their probe too: each is computed the way the backend computes it)
   through the backend by the probe's own path (`probe.run_call`: a one-op function through
   `Backend.compile_watched`, or the op on an eager device), and every other op with the plain eager kernels.

The two runs' outputs are compared tensor by tensor (the single forward: every tensor of the model's output,
`models.tree.tensors_in`; a phase: each call's logits) with the ops mode's tolerance for the output's dtype
(`OpsOptions.tolerance`; integers and bools exactly), by the probes' own rule (`compare.compare_leaf`). The
finding gets `details.reaches_output` (true / false / null when it could not be measured, with
`details.reaches_output_note` saying why), `details.output_effect` ({max_abs, rel}: the largest finite absolute
difference over the output tensors, and that over the largest finite |plain| value of its tensor), `details.reach`
(the op's calls in the run, how many the backend computed differently from eager) and a clause on its message's
first line. Fingerprint, root cause (keyed on `details.message_full`, the message before the clause) and the
cell's status stay: a wrong op is a bug even where these inputs hide it.

The child journals each (phase, op) (`enter-reach`/`leave-reach`) and appends each one's row to a file when done,
so a crash or a hang costs the op in flight and those after it, each said in its note. The child's limit is half
the cell's remaining time (at least 30 s; under 30 s left it is not started). Only cells with `op_mismatch`
findings pay for it; `options.ops.reach_output: false` turns it off. A sharded graph's (tensor-parallel) op
findings are not measured: their note says so.
"""

from __future__ import annotations

import contextlib
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
from ...fsutil import append_line, read_records
from ...models.load import build_inputs, load_model
from ...models.tree import tensors_in
from ...options import OpsOptions
from ...workloads.calls import run_phase
from ...workloads.phases import Phase
from ...procs.isolate import IsolatedResult, child_journal, open_entry, run_isolated
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
    eager value's dtype when they differ (the rest of the forward runs as the model wrote it). An in-place or `out=`
    form is computed on the backend from its inputs as they were before the call, and the tensor it writes (which
    it returns) takes the backend's value: the model reads that tensor, not the return value."""

    def __init__(self, op: Any, backend: Any) -> None:
        super().__init__()
        self.op = op
        self.backend = backend
        self.calls = 0
        self.differing = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not self.op:
            return func(*args, **kwargs)
        self.calls += 1
        mutates = _mutates(func)
        # an in-place or out= form writes into its inputs: the backend computes from them as they were before
        before = pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), (args, kwargs)) if mutates else (args, kwargs)
        out = func(*args, **kwargs)
        value = run_call(self.backend, func, *before)
        fitted = _fit(value, out, str(func))
        pairs = list(zip(pytree.tree_leaves(out), pytree.tree_leaves(fitted)))
        if any(isinstance(e, torch.Tensor) and not _same(e, a) for e, a in pairs):
            self.differing += 1
        if not mutates:
            return fitted
        for e, a in pairs:  # the tensor it wrote (the model's own, which it returns) takes the backend's value
            if isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
                e.copy_(a)
        return out


def _mutates(op: Any) -> bool:
    """Whether `op` writes into an argument (`add_`, an `out=` overload): its schema marks the argument written."""
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _same(e: torch.Tensor, a: torch.Tensor) -> bool:
    """Bit for bit the same values, NaN where eager has NaN."""
    if torch.equal(e, a):
        return True
    return e.is_floating_point() and bool(torch.allclose(e, a, rtol=0.0, atol=0.0, equal_nan=True))


class _Unfit(Exception):
    """The backend's value cannot stand in for eager's (another structure or shape)."""


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


class _Outputs:
    """The outputs of one run of the cell's workload on the CPU model: the single forward's every output tensor,
    or a phase's calls' logits (`workloads.calls.run_phase`); a phase's greedy tokens, which an injected run is
    forced to follow (its decode steps then see the same prompts)."""

    def __init__(self, loaded: Any, kwargs: Mapping[str, Any], inputs: InputSpec, phase: Phase | None) -> None:
        self.loaded, self.kwargs, self.inputs, self.phase = loaded, kwargs, inputs, phase
        self.tokens: list[torch.Tensor] | None = None

    def run(self, mode: TorchDispatchMode | None = None) -> list[torch.Tensor]:
        """The run's output tensors, each op of the model under `mode` when given; raises what a call raised."""
        model = self.loaded.module
        if self.phase is None:
            with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()):
                out = model(**copy.deepcopy(dict(self.kwargs)))
            return [t.detach().clone() for t in tensors_in(out)]

        def call(**kw: Any) -> Any:
            with mode if mode is not None else contextlib.nullcontext():
                return model(**kw)

        run = run_phase(call, self.loaded, self.inputs, self.phase, forced=self.tokens)
        failed = next((r for r in run.records if r.error), None)
        if failed is not None:
            if failed.exc is not None:
                raise failed.exc
            raise RuntimeError(f"{failed.label}: {failed.error}")
        if self.tokens is None:
            self.tokens = list(run.tokens)
        return [r.logits for r in run.records if r.logits is not None]


def _one_op(outputs: _Outputs, backend: Any, op_name: str, plain: Sequence[torch.Tensor],
            tolerance: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    t0 = time.monotonic()
    row: dict[str, Any] = {"op": op_name, "phase": outputs.phase.name if outputs.phase else None,
                           "reaches_output": None}
    try:
        op = resolve_callable(op_name)
    except Exception as exc:
        return {**row, "note": f"not measured: the op cannot be resolved here: {type(exc).__name__}: {exc}"[:500]}
    if not isinstance(op, torch._ops.OpOverload):
        return {**row, "note": "not measured: the op is not an ATen overload (the dispatcher never sees it)"}
    mode = Inject(op, backend)
    try:
        injected = outputs.run(mode)
    except Exception as exc:
        words = str(exc).strip().splitlines()
        what = "" if isinstance(exc, _Unfit) else f"{type(exc).__name__}: "
        return {**row, "calls": mode.calls, "note": f"not measured: the backend could not run the op on the "
                f"model's tensors: {what}{words[0] if words else ''}"[:600]}
    row.update(calls=mode.calls, differing_calls=mode.differing, seconds=round(time.monotonic() - t0, 3))
    if mode.calls == 0:
        return {**row, "note": "not measured: the model's eager forward never calls the op (the backend's graph has "
                               "it after aot_autograd; eager calls another form of it)"}
    effect = output_effect(plain, injected, tolerance)
    row.update(reaches_output=effect["reaches"], output_effect={"max_abs": effect["max_abs"], "rel": effect["rel"]},
               problem=effect["problem"])
    return row


def reach_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Isolated-child entry (`run_isolated(CHILD, …)`): for each job (the single forward, or a phase) its plain
    run, then one injected run per op of the job, each op's row appended to `payload["results"]` when done."""
    backend = resolve_backend(spec_from_json(BackendSpec, payload["backend"]))
    backend.prepare()
    inputs = spec_from_json(InputSpec, payload["inputs"])
    phases = {p.name: p for p in inputs.workload()}
    loaded = load_model(spec_from_json(ModelSpec, payload["model"]), seed=inputs.seed, device="cpu")
    kwargs = build_inputs(loaded, inputs, sample=0, device="cpu")
    for job in payload["jobs"]:
        outputs = _Outputs(loaded, kwargs, inputs, phases[job["phase"]] if job["phase"] else None)
        try:
            plain = outputs.run()
        except Exception as exc:  # the model itself fails here on CPU: nothing to compare with
            for op_name in job["ops"]:
                append_line(payload["results"], json.dumps({
                    "op": op_name, "phase": job["phase"], "reaches_output": None,
                    "note": f"not measured: the plain run fails on CPU: {type(exc).__name__}: {exc}"[:600]}))
            continue
        for op_name in job["ops"]:
            tag = _key(job["phase"], op_name)
            child_journal("enter-reach", tag)
            row = _one_op(outputs, backend, op_name, plain, payload["tolerance"])
            append_line(payload["results"], json.dumps(row, default=str))
            child_journal("leave-reach", tag)
    return {"jobs": len(payload["jobs"])}


def _key(phase: str | None, op: str) -> str:
    """A (phase, op) pair's name in the journal and the rows: `op` for the single forward, `phase:op`."""
    return f"{phase}:{op}" if phase else op


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
    which root causes key on: one cause whether or not its mismatch reaches the output in a cell). `rows` are keyed
    by `_key(phase, op)`."""
    for f in findings:
        row = rows.get(_key(f.phase, str(f.op))) or {"reaches_output": None, "note": "not measured"}
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
    """The child's rows by `_key(phase, op)` (a torn last line from a crash skipped)."""
    return read_records(path, dict, lambda row: _key(row.get("phase"), str(row["op"])))


def _unmeasured(keys: Sequence[str], rows: dict[str, dict[str, Any]], res: IsolatedResult, in_flight: str | None) -> None:
    """Rows for the (phase, op) keys a child that did not finish left without one, each saying why."""
    started = bool(rows) or in_flight is not None
    for key in keys:
        if key not in rows:
            where = ("while measuring this op" if key == in_flight else
                     "before this op was measured" if started else "before its plain run finished")
            rows[key] = {"reaches_output": None, "note": f"not measured: the child {res.describe()} {where}"}


def measure(ctx: "ModeContext", opts: OpsOptions, findings: Sequence[Finding], work: Path) -> dict[str, Any] | None:
    """Measure and record, on the `op_mismatch` findings of the single forward and of each phase (a sharded graph's
    are noted, not measured), whether each reaches the model's output (see the module docstring); `data.reach` for
    the mode's result, None when there is nothing to measure."""
    mismatches = [f for f in findings if f.kind == FindingKind.OP_MISMATCH and opts.reach_output]
    apply([f for f in mismatches if f.parallel], {_key(f.phase, str(f.op)): {
        "reaches_output": None, "note": "not measured: a sharded graph's op findings are not measured"}
        for f in mismatches if f.parallel})
    targets = [f for f in mismatches if not f.parallel]
    if not targets:
        return None
    jobs: dict[str | None, list[str]] = {}
    for f in targets:
        ops = jobs.setdefault(f.phase, [])
        if str(f.op) not in ops:
            ops.append(str(f.op))
    keys = [_key(phase, op) for phase, ops in jobs.items() for op in ops]
    left = ctx.remaining()
    if left < MIN_SECONDS + _MARGIN_S:
        note = f"not measured: {left:.0f} s of the cell's time left (under {MIN_SECONDS:.0f} s)"
        apply(targets, {key: {"reaches_output": None, "note": note} for key in keys})
        return {"status": "skipped", "reason": note}
    work.mkdir(parents=True, exist_ok=True)
    results, journal = work / "reach.jsonl", work / "reach-journal.log"
    results.unlink(missing_ok=True)
    journal.unlink(missing_ok=True)
    payload = {"backend": spec_to_json(ctx.cell.backend), "model": spec_to_json(ctx.cell.model),
               "inputs": spec_to_json(ctx.cell.inputs), "results": str(results),
               "jobs": [{"phase": phase, "ops": ops} for phase, ops in jobs.items()],
               "tolerance": {k: list(v) for k, v in opts.tolerance.items()}}
    t0 = time.monotonic()
    ctx.journal("enter-phase", "ops.reach")
    res = run_isolated(CHILD, payload, timeout=max(MIN_SECONDS, min(left - _MARGIN_S, left / 2)), journal=journal,
                       env=dict(ctx.cell.backend.env))
    ctx.journal("leave-phase", "ops.reach")
    rows = _read_rows(results)
    if not res.ok:
        _unmeasured(keys, rows, res, open_entry(journal, "reach"))
    apply(targets, rows)
    out: dict[str, Any] = {"status": "ran" if res.ok else "error", "seconds": round(time.monotonic() - t0, 3),
                           "ops": {key: rows[key].get("reaches_output") for key in keys}}
    if not res.ok:
        out.update(res.failure("the reach measurement"))
    return out
