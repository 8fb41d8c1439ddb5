"""Mode `memory`: per layer and per phase, the memory a model needs, predicted and measured, and where it runs out.

For each phase of the cell's workload (`inputs.phases`; none: the single forward):

- **predicted** on `meta` tensors (no weights, no device): a `DispatchMeter` counts every storage, module hooks
  read it per call (`runs.py`); parameters, buffers, the KV cache after each call, each module's peak and working
  bytes. `budget_gb` gives `first_over_budget`, a finding;
- **measured** where the device has allocator statistics (`meters.device_meter`: simdev, CUDA, XPU): the same run
  on the device; prediction and measurement side by side per module. An out-of-memory is localised to the layer,
  phase and step, with the bytes held by category, and a repro that re-runs that layer alone with the same budget;
- **compiled against eager** per layer on the same device (`compiled.py`) when the backend compiles: a layer whose
  compiled working bytes exceed eager's by more than `compiled_ratio` is a finding, with a repro printing both. The
  compiled runs are watched: the rows of a layer the backend did not run (it fell back to PyTorch, or was given
  nothing to compile) are `inconclusive` with `not_ran`, never a finding, and the mode's reason says so.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from typing import TYPE_CHECKING, Any

from ...options import MemoryOptions
from ...registry import parse_options
from ...results.model import Finding, ModeResult, fingerprint
from .compiled import capture_layer_args, compare_compiled, compiled_meter
from . import meters
from .meters import DispatchMeter, device_meter
from .repro import repro_folder, to_device, verify, write_repro
from .runs import MeteredRun, metered_run, module_bytes, phase_name
from .tables import compare_rows, first_over_budget, kv_growth, module_rows, phase_summary
from .tracker import tracked_modules

if TYPE_CHECKING:
    from .. import ModeContext

SHADOW_NUMEL = 1 << 22  # meta tensors up to this many elements computed from the inputs alone carry their values
GIB = 2**30


def _attention(device: str) -> Any:
    """The attention kernel the device runs: simdev has no fused attention (the math path), others their own."""
    if device.split(":")[0] == "simdev":
        from torch.nn.attention import SDPBackend, sdpa_kernel  # deferred: torch

        return sdpa_kernel(SDPBackend.MATH)
    return contextlib.nullcontext()


def meta_model(ctx: "ModeContext") -> Any:
    """The cell's model on `meta`, in the dtype the device runs it in (a meta build is float32)."""
    meta = ctx.model(meta=True)
    if any(p.dtype != meta.dtype for p in meta.module.parameters() if p.is_floating_point()):
        meta.module.to(meta.dtype)
    return meta


def predict(ctx: "ModeContext", opts: MemoryOptions, phase: Any) -> MeteredRun:
    """The phase run on the meta model."""
    meta = meta_model(ctx)
    with _attention(ctx.backend.device):
        return metered_run(meta.module, meta, ctx.cell.inputs, phase, "meta", DispatchMeter(shadow_numel=SHADOW_NUMEL),
                           max_depth=opts.max_depth)


def _finding(ctx: "ModeContext", kind: str, phase: str, step: int | None, module: str, module_class: str | None,
             message: str, **kw: Any) -> Finding:
    return Finding(kind=kind, stage="run", message=message, module=module or "(model)", module_class=module_class,
                   phase=None if phase == "forward" else phase, step=step,
                   fingerprint=fingerprint(kind, ctx.cell.backend.id, ctx.cell.model.id, phase, module), **kw)


def _where(phase: str, step: int | None) -> str:
    return f"{phase} step {step}" if step is not None else phase


def _mib(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} bytes"


def _oom_finding(ctx: "ModeContext", opts: MemoryOptions, run: MeteredRun) -> Finding:
    """The out-of-memory, localised: its layer, phase, step and bytes by category; a repro when it can be re-run."""
    oom = run.oom or {}
    layer = oom.get("layer") or oom.get("module") or ""
    cat = oom.get("by_category", {})
    held = ", ".join(f"{k} {_mib(v)}" for k, v in cat.items())
    msg = (f"{_where(run.phase, oom.get('step'))}: out of memory in {layer or '(model)'}"
           f"{' (innermost ' + oom['module'] + ')' if oom.get('module') and oom.get('module') != layer else ''}: "
           f"{oom.get('message')}; held then: {held}")
    f = _finding(ctx, "memory_oom", run.phase, oom.get("step"), layer, oom.get("module_class"), msg,
                 error_type="OutOfMemoryError", metrics={k: v for k, v in cat.items()},
                 details={k: oom.get(k) for k in ("call", "module", "stack", "layer_entry_bytes")})
    frame = next((fr for fr in reversed(run.oom_frames) if fr.module == layer and fr.args is not None), None)
    capacity = _capacity(ctx.backend.device)
    if opts.repro and frame is not None and capacity is not None:
        folder = repro_folder(ctx.cell_dir, "memory_oom", run.phase, layer)
        written = write_repro(folder, kind="memory_oom", title=msg, cell=ctx.cell, loaded=ctx.model(),
                              call_args=to_device(frame.args, "cpu"), phase=run.phase, step=oom.get("step"),
                              module=layer, capacity=capacity, live_at_entry=frame.entry)
        if isinstance(written, str):
            f.details["repro_note"] = written
        else:
            f.repro = verify(*written, expect=["out of memory", layer], timeout=opts.verify_timeout,
                             enabled=opts.verify, cell_dir=ctx.cell_dir)
    return f


def _capacity(device: str) -> int | None:
    if device.split(":")[0] == "simdev":
        from ...sim import simalloc  # deferred: the sim device

        return simalloc.capacity()
    return None


def measure(ctx: "ModeContext", opts: MemoryOptions, phase: Any) -> MeteredRun | None:
    """The phase run eagerly on the device, or None when the device has no allocator statistics."""
    meter = device_meter(ctx.backend.device) if opts.measure else None
    if meter is None:
        return None
    import torch  # deferred: the mode's module imports no torch itself

    cpu = ctx.model()
    try:
        module = ctx.backend.to_device(copy.deepcopy(cpu.module))
    except torch.OutOfMemoryError as exc:
        gc.collect()
        run = MeteredRun(phase=phase_name(phase), meter=meter.name)
        run.oom = {"call": "(moving the model to the device)", "step": None, "module": "", "module_class": None,
                   "layer": None, "message": str(exc).splitlines()[0], "stack": [],
                   "by_category": {"parameters": sum(module_bytes(cpu.module)), "total": meter.current()}}
        return run
    try:
        return metered_run(module, cpu, ctx.cell.inputs, phase, ctx.backend.device, meter, max_depth=opts.max_depth,
                           journal=ctx.journal)
    finally:
        del module
        gc.collect()


def host_need(ctx: "ModeContext", peak: int) -> int:
    """The host memory a measured (or compiled-against-eager) run needs, predicted: the CPU reference model, the copy
    that goes to the device, and, where the device's memory is the host's (cpu, simdev), the run's predicted peak
    (its parameters included) up to the device's capacity, past which it raises a catchable out-of-memory."""
    params = sum(module_bytes(ctx.model(meta=True).module))
    if not meters.host_memory_device(ctx.backend.device):
        return 2 * params
    capacity = _capacity(ctx.backend.device)
    return 2 * params + (min(peak, capacity) if capacity is not None else peak)


def cannot_fit(ctx: "ModeContext", peak: int) -> str | None:
    """Why a measurement the prediction says cannot fit this machine's memory is not tried (None: it fits or the
    free memory cannot be read): the process would be killed by the host's OOM killer, losing the cell."""
    free = meters.available_bytes()
    need = host_need(ctx, peak)
    if free is None or need <= 0.9 * free:
        return None
    return (f"not measured: the prediction needs about {_mib(need)} of host memory (the CPU reference model, its copy "
            f"for the device{' and the run on it' if meters.host_memory_device(ctx.backend.device) else ''}), more "
            f"than this machine has available ({_mib(free)} MemAvailable); the prediction is kept")


def _regressions(ctx: "ModeContext", opts: MemoryOptions, phase: Any, rows: list[dict[str, Any]]) -> list[Finding]:
    """A finding per layer whose compiled working bytes exceed eager's by more than the ratio (its worst call)."""
    worst: dict[str, dict[str, Any]] = {}
    for r in rows:
        over = r["ratio"] is not None and r["ratio"] > opts.compiled_ratio and \
            r["compiled_bytes"] - r["eager_bytes"] > opts.min_bytes
        if over and (r["module"] not in worst or r["ratio"] > worst[r["module"]]["ratio"]):
            worst[r["module"]] = r
    out = []
    pname = phase_name(phase)
    for name, r in sorted(worst.items()):
        msg = (f"{_where(pname, r['step'])}: {name} needs {r['ratio']:.2f}x eager's memory compiled "
               f"({r['compiled_bytes']} bytes above its entry against eager's {r['eager_bytes']}; allowed "
               f"{opts.compiled_ratio}x)")
        f = _finding(ctx, "memory_regression", pname, r["step"], name, r["module_class"], msg,
                     metrics={"eager_bytes": r["eager_bytes"], "compiled_bytes": r["compiled_bytes"],
                              "ratio": r["ratio"]}, threshold={"ratio": opts.compiled_ratio},
                     details={"call": r["call"]})
        if opts.repro:
            cpu = ctx.model()
            args = capture_layer_args(cpu, ctx.cell.inputs, phase, name, r["call"])
            if args is not None:
                written = write_repro(repro_folder(ctx.cell_dir, "memory_regression", pname, name),
                                      kind="memory_regression", title=msg, cell=ctx.cell, loaded=cpu, call_args=args,
                                      phase=pname, step=r["step"], module=name, ratio=opts.compiled_ratio)
                if isinstance(written, str):
                    f.details["repro_note"] = written
                else:
                    f.repro = verify(*written, expect=["memory regression"], timeout=opts.verify_timeout,
                                     enabled=opts.verify, cell_dir=ctx.cell_dir)
        out.append(f)
    return out


def _module_table(ctx: "ModeContext", phase: str, pred: MeteredRun, meas: MeteredRun | None,
                  depth: int) -> list[dict[str, Any]]:
    """Per module: its parameters and buffers, predicted (and measured) peak and working bytes, and where."""
    meta = ctx.model(meta=True).module
    own = {n: module_bytes(m) for n, m in tracked_modules(meta, depth)}
    measured = module_rows(meas) if meas is not None and not meas.error and not meas.oom else {}
    rows = []
    for name, r in module_rows(pred).items():
        m = measured.get(name)
        rows.append({"phase": phase, "module": name or "(model)", "module_class": r["module_class"],
                     "params_bytes": own.get(name, (0, 0))[0], "buffers_bytes": own.get(name, (0, 0))[1],
                     "peak_bytes": r["peak_bytes"], "working_bytes": r["working_bytes"],
                     "activation_bytes": r["activation_bytes"], "temporary_bytes": r["temporary_bytes"],
                     "step": r["step"],
                     "measured_peak_bytes": m["peak_bytes"] if m else None,
                     "measured_working_bytes": m["working_bytes"] if m else None})
    return rows


def _phase(ctx: "ModeContext", opts: MemoryOptions, phase: Any, findings: list[Finding],
           modules: list[dict[str, Any]]) -> tuple[dict[str, Any], MeteredRun]:
    pname = phase_name(phase)
    pred = predict(ctx, opts, phase)
    pdata: dict[str, Any] = {"status": "pass", "phase": phase.label() if phase is not None else "forward"}
    if pred.error:
        pdata.update(status="error", reason=f"prediction on meta failed at {pred.error}")
        return pdata, pred
    pdata["predicted"] = {**phase_summary(pred), "kv_growth": kv_growth(pred)}
    too_big = cannot_fit(ctx, pdata["predicted"]["peak_bytes"]) if opts.measure else None
    if too_big is not None:  # told, not killed: the prediction stands, the measurement is not tried
        pdata["measured"] = {"skipped": too_big}
        pdata["note"] = too_big
    meas = measure(ctx, opts, phase) if too_big is None else None
    if meas is not None:
        pdata["meter"] = meas.meter
        if meas.oom:
            pdata["oom"] = meas.oom
            findings.append(_oom_finding(ctx, opts, meas))
        elif meas.error:
            pdata["measured"] = {"error": meas.error}
        else:
            pdata["measured"] = {**phase_summary(meas), "kv_growth": kv_growth(meas)}
            pdata["comparison"] = compare_rows(pred, meas)
    modules += _module_table(ctx, pname, pred, meas, opts.max_depth)
    return pdata, pred


def _compiled(ctx: "ModeContext", opts: MemoryOptions, phases: list[Any], data: dict[str, Any],
              findings: list[Finding]) -> None:
    """Compiled against eager for the phases that ran, when the backend compiles and something can measure."""
    factory = compiled_meter(ctx.backend.device)
    if not opts.compiled or ctx.backend.compiler_backend() is None or factory is None or not phases:
        return
    peak = max((p.get("predicted") or {}).get("peak_bytes") or 0 for p in data["phases"].values())
    if (too_big := cannot_fit(ctx, int(peak))) is not None:
        data["compiled_note"] = too_big.replace("not measured", "compiled against eager not run")
        return
    by_phase = compare_compiled(ctx.model(), ctx.cell.inputs, phases, ctx.backend, factory)
    for phase in phases:
        rows, err, not_ran = by_phase[phase_name(phase)]
        data["phases"][phase_name(phase)]["compiled"] = {"rows": rows, "error": err,
                                                         **({"not_ran": not_ran} if not_ran else {})}
        # a layer the backend did not run measured PyTorch's memory: its rows are inconclusive, never a regression
        findings += _regressions(ctx, opts, phase, [r for r in rows if r.get("status") != "inconclusive"])
        if not_ran and not data.get("compiled_note"):
            data["compiled_note"] = f"compiled against eager inconclusive where the backend did not run: {not_ran}"[:500]


def run(ctx: "ModeContext") -> ModeResult:
    """The mode (see the module text)."""
    t0 = time.monotonic()
    opts: MemoryOptions = parse_options("memory", ctx.options("memory"))
    meta = meta_model(ctx)
    params, buffers = module_bytes(meta.module)
    budget = int(opts.budget_gb * GIB) if opts.budget_gb is not None else None
    data: dict[str, Any] = {"device": ctx.backend.device, "params_bytes": params + buffers, "buffers_bytes": buffers,
                            "budget_bytes": budget, "peak_bytes": {}, "phases": {}, "modules": [],
                            "first_over_budget": None}
    findings: list[Finding] = []
    runs: list[MeteredRun] = []
    ran: list[Any] = []

    def one(phase: Any) -> tuple[list[Finding], dict[str, Any]]:
        found: list[Finding] = []
        row, pred = _phase(ctx, opts, phase, found, data["modules"])
        if not pred.error:
            runs.append(pred)
            ran.append(phase)
            data["peak_bytes"][phase_name(phase)] = row["predicted"]["peak_bytes"]
        return found, row

    phase_findings, data["phases"] = ctx.each_phase("memory", one, loaded=meta, forward=True, min_seconds=10.0)
    findings += phase_findings
    _compiled(ctx, opts, ran, data, findings)
    if budget is not None:
        data["first_over_budget"] = over = first_over_budget(runs, budget)
        if over is not None:
            findings.append(_finding(ctx, "memory_over_budget", over["phase"], over["step"], over["module"],
                                     over["module_class"],
                                     f"{_where(over['phase'], over['step'])}: {over['module']} peaks at "
                                     f"{_mib(over['bytes'])}, over the budget of {opts.budget_gb:g} GiB (predicted)",
                                     metrics={"bytes": over["bytes"]}, threshold={"bytes": budget}))
    return _result(findings, data, time.monotonic() - t0)


def _result(findings: list[Finding], data: dict[str, Any], duration: float) -> ModeResult:
    # what the run history charts night after night (history/trends.py: figures that moved)
    data["figures"] = {"params_bytes": data["params_bytes"],
                       **{f"peak_bytes.{p}": b for p, b in data["peak_bytes"].items() if isinstance(b, (int, float))}}
    statuses = [p.get("status") for p in data["phases"].values()]
    # a measurement the machine cannot hold is told, once (the same words for each phase)
    told = "; ".join(dict.fromkeys([p["note"] for p in data["phases"].values() if p.get("note")]
                                   + ([data["compiled_note"]] if data.get("compiled_note") else []))) or None
    if findings:
        return ModeResult(status="fail", findings=findings, duration_s=duration, data=data, reason=told)
    if statuses and all(s == "skipped" for s in statuses):
        return ModeResult(status="skipped", duration_s=duration, data=data,
                          reason="; ".join(p["reason"] for p in data["phases"].values()))
    errors = [f"{n}: {p['reason']}" for n, p in data["phases"].items() if p.get("status") == "error"]
    if errors and len(errors) == len([s for s in statuses if s != "skipped"]):
        return ModeResult(status="error", duration_s=duration, data=data, reason="; ".join(errors)[:500])
    return ModeResult(status="pass", duration_s=duration, data=data,
                      reason="; ".join(filter(None, ["; ".join(errors)[:500], told])) or None)
