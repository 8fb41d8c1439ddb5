"""Numerics per phase (`inputs.phases`): per layer and per step against references fed the same tokens.

For each phase (`ci_runner/workloads/phases.py`), run as users run it (`workloads/calls.py`):
1. the primary reference (eager, the primary dtype) picks the greedy tokens; the second reference (e.g. float64)
   is fed the same tokens. Per layer and per call, their disagreement times the margin (with the dtype's floor) is
   the threshold, derived per phase as the single forward's are;
2. the target runs clean, as a user runs it: one compiled object, teacher-forced with the reference's tokens. Its
   logits are compared per call on real tokens only (row by row for a padded batch); NaN/Inf on a real token is
   named with its row; an output a later call changed is an `output_overwritten` finding;
3. when a call diverges or is not finite, the target runs again with output hooks on every module, to name the
   first (step, layer) where the divergence starts, or the first layer where NaN/Inf appears in that row.
The KV cache each layer wrote is compared per step against the reference's, and greedy-token and top-5 agreement
over the steps are reported. Each compiled run is a fresh compile, watched (`watch.watchedrun.PhaseWatch`): a target
run the backend did not run (in whole or in part) makes the phase `inconclusive` when it found nothing (never a
pass; findings stand: a call that ran in PyTorch cannot diverge from the reference), ops its partitioner left to
PyTorch are listed with the modules that call them (`backend_ran.partial_sites`, the phase `partial`), and a
finding localised from a hooked re-run the backend did not run says so.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ...workloads.emulate import emulate
from ...watch.capture import OutputHooks, primary_tensor
from ...watch.hooks import ModuleHooks
from ...watch.watchedrun import PhaseWatch
from ...workloads.calls import (Call, CallRecord, PhaseRun, capture_calls, replay_calls, run_phase,
                                 smallest_module)
from .metrics import compare_tensors
from .target import target_dtype
from ...options import NumericsOptions
from ...workloads.phases import Phase
from ...results.model import Finding, fingerprint

if TYPE_CHECKING:
    from .. import ModeContext

OVERWRITTEN = "output_overwritten"
Layers = dict[str, torch.Tensor]  # module name -> primary output of one call


def _rel(metrics: Mapping[str, Any]) -> float:
    value = metrics.get("rel", 0.0)
    return float(value) if value is not None else 0.0


def _real_rows(t: torch.Tensor, real: torch.Tensor | None) -> list[torch.Tensor]:
    """`t` row by row on real tokens only (one entry when nothing is padded or the shape does not match)."""
    if real is None or t.dim() < 2 or tuple(t.shape[:2]) != tuple(real.shape):
        return [t]
    return [t[r][real[r].to(t.device)] for r in range(real.shape[0])]


def _compare(ref: torch.Tensor, tgt: torch.Tensor, real: torch.Tensor | None) -> tuple[dict[str, Any], list[int]]:
    """Worst metrics over the real rows, and the rows whose real tokens are not finite on the target only."""
    worst: dict[str, Any] = {"rel": 0.0}
    bad_rows = []
    pairs = zip(_real_rows(ref.detach().cpu(), real), _real_rows(tgt.detach().cpu(), real))
    for row, (a, b) in enumerate(pairs):
        if a.shape != b.shape:
            return {"rel": math.inf, "note": f"shape {list(b.shape)} vs reference {list(a.shape)}"}, bad_rows
        m = compare_tensors(a, b)
        if m.get("nonfinite_tgt", 0) > m.get("nonfinite_ref", 0):
            bad_rows.append(row)
        if _rel(m) >= _rel(worst):
            worst = m
    return worst, bad_rows


def _cache_tensors(cache: Any) -> dict[str, torch.Tensor]:
    """`layers.<i>.keys/values` of a transformers cache (what each layer wrote so far), copied."""
    out = {}
    for i, layer in enumerate(getattr(cache, "layers", None) or []):
        for kind in ("keys", "values"):
            t = getattr(layer, kind, None)
            if isinstance(t, torch.Tensor) and t.numel():
                out[f"layers.{i}.{kind}"] = t.detach().cpu().clone()
    return out


# What each module was fed (its first tensor input), per call of a hooked target run: the module where NaN/Inf
# starts is the first whose input is finite and whose output is not. One list, appended to by traced hooks.
_INPUT_SINK: list[tuple[str, torch.Tensor]] = []


def _input_hook(name: str) -> Any:
    """The hook that records module `name`'s first floating tensor input. A plain loop, no generator: the root
    module's hooks run outside its compiled forward, each hook a frame of its own that Dynamo compiles, and a
    generator expression in it would be a frame Dynamo cannot compile (`Attempt to trace generator`), counted as
    a fallback to eager of the hooked run (`DynamoCounters.fallback`) although only this hook ran in eager."""
    def hook(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.is_floating_point():
                _INPUT_SINK.append((name, a.clone()))
                return
    return hook


class _Recorder:
    """Per call: the primary output of every module (with hooks), its first floating input (`inputs=True`) and
    the KV cache after the call."""

    def __init__(self, module: torch.nn.Module | None, *, clone: bool, inputs: bool = False) -> None:
        self.hooks = OutputHooks(module, clone=clone) if module is not None else None
        _INPUT_SINK.clear()
        self.input_hooks = ModuleHooks(module.named_modules(), post=_input_hook, post_kwargs=True) \
            if inputs and module is not None else None
        self.layers: list[Layers] = []
        self.inputs: list[Layers] = []
        self.caches: list[dict[str, torch.Tensor]] = []

    def before(self, call: Call) -> None:
        if self.hooks is not None:
            self.hooks.take()
        _INPUT_SINK.clear()

    def after(self, call: Call, rec: CallRecord) -> None:
        if self.hooks is not None:
            out: Layers = {}
            for key, flat in self.hooks.take():
                t = primary_tensor(dict(flat)) if flat else None
                if isinstance(t, torch.Tensor) and key not in out:
                    out[key] = t.detach().cpu()
            self.layers.append(out)
        if self.input_hooks is not None:
            fed: Layers = {}
            for name, t in _INPUT_SINK:
                fed.setdefault(name, t.detach().cpu())
            self.inputs.append(fed)
            _INPUT_SINK.clear()
        cache = next((v for k, v in call.kwargs.items() if k in ("cache", "past_key_values")), None)
        self.caches.append(_cache_tensors(cache) if cache is not None else {})

    def close(self) -> None:
        if self.hooks is not None:
            self.hooks.remove()
        if self.input_hooks is not None:
            self.input_hooks.remove()
        _INPUT_SINK.clear()


def _run(fn: Any, module: torch.nn.Module | None, loaded: Any, ctx: "ModeContext", phase: Phase, *,
         forced: list[torch.Tensor] | None, device: str, clone: bool = True,
         inputs: bool = False) -> tuple[PhaseRun, _Recorder]:
    rec = _Recorder(module, clone=clone, inputs=inputs)
    try:
        run = run_phase(fn, loaded, ctx.cell.inputs, phase, forced=forced, device=device,
                        before_call=rec.before, after_call=rec.after)
    finally:
        rec.close()
    return run, rec


def _thresholds(a: _Recorder, b: _Recorder, ra: PhaseRun, rb: PhaseRun, margin: float, floor: float) -> dict[str, float]:
    """Per layer ("" = the logits, `kv:<name>` = a cache tensor): margin × the references' worst disagreement."""
    worst: dict[str, float] = {}

    def see(key: str, x: torch.Tensor, y: torch.Tensor, real: torch.Tensor | None) -> None:
        if x.shape != y.shape:
            return
        m, _ = _compare(x, y.to(x.dtype), real)
        worst[key] = max(worst.get(key, 0.0), _rel(m))

    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        for key in la.keys() & lb.keys():
            see(key, la[key], lb[key], ra.records[i].real)
    for i, (x, y) in enumerate(zip(ra.records, rb.records)):
        if x.logits is not None and y.logits is not None:
            see("", x.logits, y.logits, x.real)
    for ca, cb in zip(a.caches, b.caches):
        for key in ca.keys() & cb.keys():
            see(f"kv:{key}", ca[key], cb[key], None)
    return {k: max(floor, margin * v) for k, v in worst.items()}


def _with_policy(ctx: "ModeContext", opts: NumericsOptions, phase: Phase, primary: Any, ref_run: PhaseRun,
                 ref_rec: _Recorder, forced: list[torch.Tensor] | None,
                 thresholds: dict[str, float]) -> tuple[dict[str, float], dict[str, Any] | None]:
    """`thresholds` widened by the cell's precision policy (`workloads/precision.py`): the policy's emulation fed
    the same tokens, `policy_margin` × its worst disagreement per layer, logits and KV-cache tensor; and the
    emulation's own greedy/top-5 agreement with the reference (what the policy's rounding alone flips), or None
    under a float32 policy."""
    policy = ctx.precision()[0]
    if policy.is_float32:
        return thresholds, None
    with emulate(policy):
        emu_run, emu_rec = _run(primary.module, primary.module, primary, ctx, phase, forced=forced, device="cpu")
    widened = _thresholds(ref_rec, emu_rec, ref_run, emu_run, opts.thresholds.policy_margin, 0.0)
    merged = {k: max(thresholds.get(k, 0.0), widened.get(k, 0.0)) for k in thresholds.keys() | widened.keys()}
    return merged, _agreement(ref_run, emu_run)


def _judged_agreement(agreement: dict[str, Any], expected: dict[str, Any] | None) -> dict[str, Any]:
    """The target's agreement beside the policy's own (`expected`): `within_policy` is False when the target
    agrees with the reference on fewer greedy tokens or top-5 sets than the policy's emulation does, by more than
    one position's worth (a token flip the policy's rounding explains is not held against the backend)."""
    if not expected:
        return agreement
    slack = 1.0 / max(1, int(agreement["positions"]))
    within = all(agreement[k] >= expected[k] - slack - 1e-9 for k in ("greedy", "top5"))
    return {**agreement, "policy": {"greedy": expected["greedy"], "top5": expected["top5"]}, "within_policy": within}


def _agreement(ref: PhaseRun, tgt: PhaseRun) -> dict[str, Any] | None:
    """Greedy-token and top-5 agreement of the target's next-token logits with the reference's, per call."""
    greedy = top5 = n = 0
    for r, t in zip(ref.records, tgt.records):
        if r.logits is None or t.logits is None or r.logits.shape != t.logits.shape:
            continue
        a, b = r.logits[:, -1].float(), t.logits[:, -1].detach().cpu().float()
        n += a.shape[0]
        greedy += int((a.argmax(-1) == b.argmax(-1)).sum())
        k = min(5, a.shape[-1])
        ta, tb = a.topk(k).indices, b.topk(k).indices
        top5 += sum(len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(ta, tb))
    return {"greedy": round(greedy / n, 4), "top5": round(top5 / n, 4), "positions": n} if n else None


def run_phases(ctx: "ModeContext", opts: NumericsOptions) -> tuple[list[Finding], dict[str, Any]]:
    """Findings and `data.phases` for every phase of the cell's workload."""
    return ctx.each_phase("numerics", lambda phase: _one_phase(ctx, opts, phase),  # type: ignore[arg-type]
                          loaded=ctx.model(dtype=ctx.cell.references[0].dtype))


def _one_phase(ctx: "ModeContext", opts: NumericsOptions, phase: Phase) -> tuple[list[Finding], dict[str, Any]]:
    import torch._dynamo  # deferred: Dynamo takes seconds to import

    refs = ctx.cell.references
    primary = ctx.model(dtype=refs[0].dtype)
    ref_run, ref_rec = _run(primary.module, primary.module, primary, ctx, phase, forced=None, device="cpu")
    if ref_run.failed is not None:
        return [], {"status": "error", "reason": f"the reference failed at {ref_run.failed.label}: {ref_run.failed.error}"}
    forced = list(ref_run.tokens[:-1]) if ref_run.tokens else None
    thresholds: dict[str, float] = {}
    if len(refs) > 1:
        second = ctx.model(dtype=refs[1].dtype)
        sec_run, sec_rec = _run(second.module, second.module, second, ctx, phase, forced=forced, device="cpu")
        floor = opts.thresholds.floors(primary.dtype)[0]
        thresholds = _thresholds(ref_rec, sec_rec, ref_run, sec_run, opts.thresholds.margin, floor)
    thresholds, expected_agreement = _with_policy(ctx, opts, phase, primary, ref_run, ref_rec, forced, thresholds)
    backend = ctx.backend
    device = backend.device
    target = ctx.model(dtype=target_dtype(ctx.cell.model.dtype, refs[0].dtype))  # the model's own bf16/fp16, if so

    def fresh() -> torch.nn.Module:
        return backend.to_device(copy.deepcopy(target.module))

    torch._dynamo.reset()
    tgt_run, tgt_rec, ran = _watched_run(backend, fresh(), None, target, ctx, phase, forced=forced, device=device)
    calls: list[dict[str, Any]] = []
    flagged: list[tuple[int, list[int], dict[str, Any]]] = []
    for i, (r, t) in enumerate(zip(ref_run.records, tgt_run.records)):
        row: dict[str, Any] = {"call": t.label, "step": t.step}
        if t.error is not None:
            row["error"] = t.error[:300]
        elif r.logits is not None and t.logits is not None:
            m, bad = _compare(r.logits, t.logits, r.real)
            thr = thresholds.get("", opts.thresholds.floors(primary.dtype)[0])
            row.update(rel=m.get("rel"), cos=m.get("cos"), threshold=thr, nonfinite_rows=bad)
            if bad or _rel(m) > thr:
                flagged.append((i, bad, m))
        calls.append(row)
    phase_data: dict[str, Any] = {"status": "pass", "phase": phase.label(), "calls": calls, "backend_ran": ran}
    agreement = _agreement(ref_run, tgt_run)
    if agreement:
        phase_data["agreement"] = _judged_agreement(agreement, expected_agreement)
    kv = _kv_rows(ref_rec, tgt_rec, thresholds, ref_run, tgt_run)
    if kv:
        phase_data["kv_cache"] = kv
    out: list[Finding] = []
    if tgt_run.failed is not None:
        phase_data.update(status="error", reason=f"{tgt_run.failed.label} failed on the target (the layers mode "
                                                   f"localises it): {tgt_run.failed.error[:300]}")
    for ow in tgt_run.overwritten:
        out.append(_overwritten(ctx, phase, ow))
    kv_first = _kv_cause(ctx, phase, kv or [], flagged, [r.label for r in tgt_run.records])
    if kv_first is not None:
        out.append(kv_first)
    elif flagged:
        torch._dynamo.reset()
        module = fresh()
        _hooked, hooked_rec, hooked_ran = _watched_run(backend, module, module, target, ctx, phase, forced=forced,
                                                       device=device, inputs=True)
        found = _localise(ctx, phase, flagged, ref_run, ref_rec, hooked_rec, thresholds, opts, primary.dtype)
        if hooked_ran.get("not_ran"):  # the layers it names come from a run in PyTorch, not the backend's
            for f in (f for f in found if f.details.get("localised") != "isolated"):  # (modules compiled alone)
                f.details["hooked_not_ran"] = hooked_ran["not_ran"][:300]
                f.message += f" (the re-run with hooks did not run on the backend: {hooked_ran['not_ran'][:200]})"
        out += found
    if out:
        phase_data["status"] = "fail"
    elif ran.get("not_ran") and tgt_run.failed is None:  # (some of) its calls ran in PyTorch: never a pass
        phase_data.update(status="inconclusive", reason=f"the backend did not run (all of) this phase: "
                                                        f"{ran['not_ran'][:400]}")
    elif ran.get("partial_sites"):
        phase_data.update(status="partial", reason=_partial_text(ran["partial_sites"]))
    return out, phase_data


def _kv_cause(ctx: "ModeContext", phase: Phase, kv: list[dict[str, Any]],
              flagged: list[tuple[int, list[int], dict[str, Any]]], labels: list[str]) -> Finding | None:
    """The finding of the first KV-cache tensor over its threshold when it is off at or before the first call whose
    logits are (the cache is then the cause: a cache kept in another precision, and what reads it later only
    carries it); None otherwise."""
    over = next((k for k in kv if k["over"]), None)
    if over is None or (flagged and (over["call"] not in labels or labels.index(over["call"]) > flagged[0][0])):
        return None
    after = f"; the logits of {labels[flagged[0][0]]} then diverge too (rel {_rel(flagged[0][2]):.3g})" if flagged else ""
    return _finding(ctx, phase, over["step"], f"kv:{over['tensor']}", "KVCache",
                    f"{phase.name}, {over['call']}: the KV cache {over['tensor']} the target wrote differs from the "
                    f"reference's (rel {over['rel']:.3g} > {over['threshold']:.3g})" + after,
                    {"rel": over["rel"]}, {"rel": over["threshold"]}, details={"call": over["call"]})


def _partial_text(sites: Mapping[str, list[str]]) -> str:
    """`the backend left aten.x (in model.layers.0.mlp) to PyTorch: …`."""
    ops = "; ".join(f"{op} (in {', '.join(where[:3]) or 'an unknown module'})" for op, where in list(sites.items())[:4])
    return f"the backend's partitioner left {ops} to PyTorch: those modules are not tested on the backend here"


def _watched_run(backend: Any, compiled_from: torch.nn.Module, hooked: torch.nn.Module | None, primary: Any,
                 ctx: "ModeContext", phase: Phase, **kw: Any) -> tuple[PhaseRun, _Recorder, dict[str, Any]]:
    """`_run` of a fresh compile of `compiled_from`, watched (`watch.watchedrun.PhaseWatch`, its `not_ran`: graphs
    given and run, Dynamo's eager fallbacks, the backend's own): (run, recorder, `ran` facts with `not_ran` when the
    backend did not run it and `partial_sites` when its partitioner left ops to PyTorch: op -> the modules that call
    it)."""
    compiled, compile_watch = backend.compile_watched(compiled_from)
    with PhaseWatch("numerics", compile_watch, trace=False) as watch:
        run, rec = _run(compiled, hooked, primary, ctx, phase, **kw)
    facts = watch.run.facts
    ran: dict[str, Any] = {**compile_watch.summary(),
                           **{k: v for k, v in facts.items() if not isinstance(v, (list, dict))}}
    why = watch.run.not_ran
    if why:
        ran["not_ran"] = why
    elif facts.get("eager_ops"):
        ran["partial_sites"] = facts.get("eager_sites") or {op: [] for op in facts["eager_ops"]}
    return run, rec, ran


def _kv_rows(ref: _Recorder, tgt: _Recorder, thresholds: Mapping[str, float], run: PhaseRun,
             target: PhaseRun) -> list[dict[str, Any]]:
    """Per call and cache tensor: the target's cache against the reference's after that call."""
    rows = []
    for i, (ca, cb) in enumerate(zip(ref.caches, tgt.caches)):
        if i < len(target.records) and target.records[i].error is not None:
            continue  # a call that failed wrote nothing: its cache is the previous call's
        for key in sorted(ca.keys() & cb.keys()):
            if ca[key].shape != cb[key].shape:
                continue
            rel = _rel(compare_tensors(ca[key], cb[key].to(ca[key].dtype)))
            thr = thresholds.get(f"kv:{key}", 0.0)
            rows.append({"call": run.records[i].label, "step": run.records[i].step, "tensor": key, "rel": rel, "threshold": thr, "over": bool(thr and rel > thr)})
    return rows


def _where(phase: Phase, step: int | None) -> str:
    return f"{phase.name} step {step}" if step is not None else phase.name


def _finding(ctx: "ModeContext", phase: Phase, step: int | None, module: str, module_class: str, message: str,
             metrics: Mapping[str, Any], threshold: Mapping[str, Any], *, kind: str = "divergence",
             details: Mapping[str, Any] | None = None) -> Finding:
    return Finding(kind=kind, stage="compare", message=message, module=module or "(model)", module_class=module_class,
                   metrics=dict(metrics), threshold=dict(threshold), phase=phase.name, step=step,
                   details=dict(details or {}),
                   fingerprint=fingerprint(kind, ctx.cell.backend.id, ctx.cell.model.id, phase.name, module))


def _overwritten(ctx: "ModeContext", phase: Phase, ow: Mapping[str, Any]) -> Finding:
    shared = " (it shares storage with that call's output)" if ow.get("shares_storage") else ""
    msg = (f"{phase.name}: the output returned by {ow['call']} changed after {ow['changed_after']}{shared}: "
           f"the backend reuses output buffers across calls, so a loop that keeps earlier outputs reads later values")
    return _finding(ctx, phase, ow.get("step"), "", "output", msg, {"max_abs_change": ow.get("max_abs_change")}, {},
                    kind=OVERWRITTEN, details={"call": ow["call"], "changed_after": ow["changed_after"]})


def _nonfinite_start(tgt: _Recorder, call: int, row: int) -> str | None:
    """The first module (in completion order) whose input is finite in `row` and whose output is not."""
    fed = tgt.inputs[call] if call < len(tgt.inputs) else {}
    for key, t in tgt.layers[call].items():
        name = key.split("#")[0]
        x = fed.get(name)
        if not name or x is None or t.dim() == 0 or x.dim() == 0 or row >= t.shape[0] or row >= x.shape[0]:
            continue
        if bool(torch.isfinite(x[row]).all()) and not bool(torch.isfinite(t[row]).all()):
            return name
    return None


def _row_finite(out: Any, row: int) -> bool | None:
    t = primary_tensor(out) if not isinstance(out, torch.Tensor) else out
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or row >= t.shape[0]:
        return None
    return bool(torch.isfinite(t[row].detach().cpu()).all())


def _isolated_nonfinite(ctx: "ModeContext", phase: Phase, ref_run: PhaseRun, call: int, row: int,
                        unran: list[str] | None = None) -> tuple[str, list[str]]:
    """The smallest module that, compiled alone and fed the reference's inputs of `call` (and of the calls before
    it, in order, through one compiled object), makes `row` non-finite where eager keeps it finite. Each compile is
    watched: a module not blamed that the backend did not run alone (in whole or part) goes to `unran` (it is not
    shown innocent)."""
    loaded = ctx.model(dtype=ctx.cell.references[0].dtype)
    forced = [r.token for r in ref_run.records if r.token is not None] or None
    captured = capture_calls(loaded, ctx.cell.inputs, phase, forced=forced, upto=call)
    backend = ctx.backend

    def fails(name: str) -> bool:
        import torch._dynamo  # deferred: Dynamo takes seconds to import

        torch._dynamo.reset()
        eager = loaded.module.get_submodule(name)
        fn, compile_watch = backend.compile_watched(backend.to_device(copy.deepcopy(eager)))
        with PhaseWatch("numerics", compile_watch, trace=False) as watch:
            index, got, exc = replay_calls(fn, captured.get(name, []), call, backend.to_device)
        if exc is not None or index != call:  # a module that cannot run alone is not the one
            return False
        _, args, kwargs = [c for c in captured[name] if c[0] == call][-1]
        with torch.no_grad():
            want = eager(*copy.deepcopy(args), **copy.deepcopy(kwargs))
        blamed = _row_finite(want, row) is True and _row_finite(got, row) is False
        if not blamed and unran is not None and watch.run.not_ran:  # (in part) PyTorch's: not shown
            unran.append(name)
        return blamed

    return smallest_module(loaded.module, captured, call, fails)


def _module_classes(module: torch.nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in module.named_modules()}


def _localise(ctx: "ModeContext", phase: Phase, flagged: list[tuple[int, list[int], dict[str, Any]]],
              ref_run: PhaseRun, ref: _Recorder, tgt: _Recorder, thresholds: Mapping[str, float],
              opts: NumericsOptions, dtype: torch.dtype) -> list[Finding]:
    """The first (call, layer) that diverges, or the first layer with NaN/Inf in a flagged row."""
    classes = _module_classes(ctx.model(dtype=ctx.cell.references[0].dtype).module)
    floor = opts.thresholds.floors(dtype)[0]
    first_bad = flagged[0]
    i, bad_rows, logit_metrics = first_bad
    step = ref_run.records[i].step
    label = ref_run.records[i].label  # the call a finding names (`details.call`): its repro runs the phase up to it
    real = ref_run.records[i].real
    if bad_rows:
        row = bad_rows[0]
        start = _nonfinite_start(tgt, i, row) if i < len(tgt.layers) else None
        reach = None
        for key, t in tgt.layers[i].items() if i < len(tgt.layers) else ():
            rows = _real_rows(t, real)
            if key and row < len(rows) and not bool(torch.isfinite(rows[row]).all()):
                reach = key.split("#")[0]
                break
        name = start or reach
        if name is not None:
            via = f", and reaches the real tokens in {reach}" if reach and reach != name else ""
            msg = (f"{_where(phase, step)}: NaN/Inf on the real tokens of row {row}; it starts in {name} "
                   f"({classes.get(name, '?')}: finite input, non-finite output){via}; the reference is finite")
            return [_finding(ctx, phase, step, name, classes.get(name, "?"), msg,
                             {"rows": bad_rows, "nonfinite_tgt": logit_metrics.get("nonfinite_tgt")}, {},
                             details={"call": label, "row": row, "rows": bad_rows, "reaches_real_tokens_in": reach})]
        root = tgt.layers[i].get("") if i < len(tgt.layers) else None
        unran: list[str] = []  # modules the backend did not run alone: not shown innocent
        if root is None or bool(torch.isfinite(root).all()):  # the hooked run did not reproduce it (OpenVINO
            # hands a graph with hooks it cannot convert to PyTorch): replay the modules alone instead
            name, passed = _isolated_nonfinite(ctx, phase, ref_run, i, row, unran)
            if name:
                msg = (f"{_where(phase, step)}: NaN/Inf on the real tokens of row {row}; compiled alone on the "
                       f"reference's inputs of that call, {name} ({classes.get(name, '?')}) turns row {row} non-finite "
                       f"where eager stays finite ({len(passed)} of its called children pass alone)")
                return [_finding(ctx, phase, step, name, classes.get(name, "?"), msg,
                                 {"rows": bad_rows, "nonfinite_tgt": logit_metrics.get("nonfinite_tgt")}, {},
                                 details={"call": label, "row": row, "rows": bad_rows, "localised": "isolated",
                                          **({"not_ran_alone": unran[:20]} if unran else {})})]
        alone = f"; {len(unran)} did not run on the backend alone: {', '.join(unran[:3])}" if unran else ""
        return [_finding(ctx, phase, step, "", "output",
                         f"{_where(phase, step)}: NaN/Inf on the real tokens of rows {bad_rows}; the reference is "
                         f"finite (no single module shows it alone{alone})",
                         {"rows": bad_rows, "nonfinite_tgt": logit_metrics.get("nonfinite_tgt")}, {},
                         details={"call": label, "rows": bad_rows, "row": row,
                                  **({"not_ran_alone": unran[:20]} if unran else {})})]
    for j in range(min(len(ref.layers), len(tgt.layers))):
        for key, t in tgt.layers[j].items():
            r = ref.layers[j].get(key)
            if r is None or r.shape != t.shape or not key:
                continue
            m, _ = _compare(r, t.to(r.dtype), ref_run.records[j].real)
            thr = thresholds.get(key, floor)
            if _rel(m) > thr:
                name, _, k = key.partition("#")
                cstep = ref_run.records[j].step
                passes = "; the earlier calls pass" if j else ""
                msg = (f"{_where(phase, cstep)}: {name} ({classes.get(name, '?')}) diverges first: rel {_rel(m):.3g} > "
                       f"{thr:.3g}{passes}")
                return [_finding(ctx, phase, cstep, name, classes.get(name, "?"), msg,
                                 {"rel": _rel(m), "cos": m.get("cos")}, {"rel": thr},
                                 details={"call": ref_run.records[j].label, "module_call": int(k or 0)})]
    return [_finding(ctx, phase, step, "", "output",
                     f"{_where(phase, step)}: the logits diverge (rel {_rel(logit_metrics):.3g}) but no layer output did "
                     f"first", {"rel": _rel(logit_metrics)}, {"rel": thresholds.get('', floor)},
                     details={"call": label})]
