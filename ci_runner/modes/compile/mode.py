"""Mode `compile`: what Dynamo and the backend did with each call, per phase (graphs, graph breaks, recompiles,
compile seconds, what ran outside the backend), and the checks users make of it (`checks.py`).

Each phase of `inputs.phases` (the single forward when there are none: one call per input sample, at most two) runs
through ONE compiled object (`workloads/calls.run_phase`), as users run it, after `torch._dynamo.reset()`. Read
around it: the compile's one watch (`Backend.compile_watched`: the backend's graphs and their executions, Dynamo's
counters, the backend's own fallbacks such as OpenVINO's partitioner leftovers) and Dynamo's structured trace
(`watch.dynamotrace.TraceWatch`: graph breaks with their source line, recompiles with the failed guard, compile
seconds, recompile-limit hits). `data.phases.<phase>` holds the figures (docs/compile.md).

That trace is kept per phase in the cell folder as tlparse reads it (`keep_trace`: `compile/torch_trace/
dedicated_log_torch_trace_<phase>.log`, at most `trace_mb` MiB; `data.trace_dir`, `data.phases.<phase>.trace` and
each finding's `details.trace` name it), so a bug report can attach what `TORCH_TRACE` would have written.
"""

from __future__ import annotations

import copy
import re
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from .. import FORWARD
from ...watch.dynamotrace import TRACE_FILE_PREFIX, write_trace
from ...failures.failure import stage_of, unwrap
from ...models.torchcompat import dynamo_config
from ...watch.watchedrun import PhaseWatch, WatchedRun
from ...workloads.calls import Call, CallRecord, run_phase
from ...options import CompileOptions
from ...workloads.phases import Phase
from ...registry import parse_options
from ...results.model import Finding, ModeResult
from .checks import PhaseSignals, findings_for
from .repro import attach_repros

if TYPE_CHECKING:
    from .. import ModeContext

MODE = "compile"
TRACE_DIR = "torch_trace"  # the cell's TORCH_TRACE folder, under the mode's own (`compile/torch_trace/`)


def run(ctx: "ModeContext") -> ModeResult:
    """The compile mode (see the module docstring)."""
    t0 = time.monotonic()
    opts: CompileOptions = parse_options(MODE, ctx.options(MODE))
    if ctx.backend.is_eager:
        return ModeResult(status="skipped", reason="the backend is eager: nothing is compiled")
    loaded = ctx.model()
    data: dict[str, Any] = {}
    signals: list[PhaseSignals] = []

    def one(phase: Phase | None) -> tuple[list[Finding], dict[str, Any]]:
        sig = measure(ctx, opts, loaded, phase)
        signals.append(sig)
        return [], sig.row()

    _, data["phases"] = ctx.each_phase(MODE, one, loaded=loaded, forward=True)
    findings = findings_for(ctx, opts, loaded, signals)
    if opts.repro:
        attach_repros(ctx, opts, loaded, signals, findings)
    for sig in signals:
        row = data["phases"][sig.name]
        row["findings"] = sorted({f.kind for f in findings if sig.name in _phases_of(f)})
        if row["findings"] and row["status"] == "pass":  # the phase's status agrees with the mode's: never a pass
            row["status"] = "fail"                        # where it ran in PyTorch or broke its graph
    traces = {s.name: s.trace["file"] for s in signals if s.trace and s.trace.get("file")}
    if traces:
        data["trace_dir"] = f"{MODE}/{TRACE_DIR}"
        for f in findings:
            where = next((traces[p] for p in _phases_of(f) if p in traces), None)
            if where is not None:
                f.details["trace"] = where
    data["figures"] = figures_of(data["phases"])
    return _result(findings, data, signals, time.monotonic() - t0)


def figures_of(phases: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """What the run history charts night after night (history/trends.py: figures that moved), per phase run."""
    out: dict[str, float] = {}
    for name, row in phases.items():
        if row.get("status") == "skipped" or "graphs" not in row:
            continue
        out[f"graphs.{name}"] = row["graphs"]
        for key in ("graph_breaks", "recompiles", "eager_fallbacks"):
            if row.get(key) is not None:  # None: unknown on this torch (`data.phases.<phase>.unknown`), never 0
                out[f"{key}.{name}"] = len(row[key])
        if row.get("compile_s") is not None:
            out[f"compile_s.{name}"] = row["compile_s"]
    return out


def _phases_of(f: Finding) -> list[str]:
    return list(f.details.get("phases") or ([f.phase] if f.phase else [FORWARD]))


def _result(findings: list[Finding], data: dict[str, Any], signals: list[PhaseSignals], seconds: float) -> ModeResult:
    failed = [s for s in signals if s.error]
    if findings:
        return ModeResult(status="fail", findings=findings, data=data, duration_s=seconds)
    if failed:
        s = failed[0]
        return ModeResult(status="inconclusive", data=data, duration_s=seconds,
                          reason=f"{s.name}: {s.failed_call} failed ({s.error[:300]}); the signals stop there "
                                 f"(the layers mode's phase finding names the failing module)")
    if not signals:
        return ModeResult(status="skipped", data=data, duration_s=seconds, reason="every phase was skipped")
    return ModeResult(status="pass", data=data, duration_s=seconds)


def _forward_calls(ctx: "ModeContext", loaded: Any, fn: Callable[..., Any], before: Callable[[Call], None],
                   after: Callable[[Call, CallRecord], None]) -> None:
    """The single forward: one call per input sample (at most two), through `fn`."""
    with torch.no_grad():
        for s in range(min(ctx.cell.inputs.samples, 2)):
            kwargs = ctx.inputs(loaded, sample=s, device=ctx.backend.device)
            call = Call(FORWARD, None, FORWARD if s == 0 else f"{FORWARD} sample {s}", kwargs)
            before(call)
            t = time.perf_counter()
            rec = CallRecord(FORWARD, None, call.label, 0.0)
            try:
                fn(**kwargs)
            except Exception as exc:  # the backend's failure ends the signals  # noqa: BLE001
                inner = unwrap(exc)
                rec.error, rec.error_type, rec.stage = f"{type(inner).__name__}: {inner}", type(inner).__name__, \
                    stage_of(exc)
            rec.seconds = time.perf_counter() - t
            after(call, rec)
            if rec.error:
                break


def kept_run(ctx: "ModeContext", opts: CompileOptions, phase: Phase | None) -> WatchedRun | None:
    """Another mode's watched compiled run of `phase` in this process (`watch.watchedrun`), when the mode may read
    it: `reuse` on, no `recompile_limit` of its own (the other mode ran under Dynamo's), a phase (the single forward's
    whole-model compiles run in other modes' child processes)."""
    if not opts.reuse or opts.recompile_limit or phase is None:
        return None
    return ctx.compiled_runs.get(phase.name)


def measure(ctx: "ModeContext", opts: CompileOptions, loaded: Any, phase: Phase | None) -> PhaseSignals:
    """One phase through one compiled object, with every watch on: another mode's run of it when one is kept
    (`kept_run`), else the mode's own."""
    import torch._dynamo  # deferred: Dynamo takes seconds to import

    sig = PhaseSignals(name=phase.name if phase is not None else FORWARD,
                       label=phase.label() if phase is not None else "single forward", phase=phase)
    run = kept_run(ctx, opts, phase)
    if run is None:
        torch._dynamo.reset()
        module = copy.deepcopy(loaded.module)
        if ctx.backend.device != "cpu":
            module = ctx.backend.to_device(module)
        fn, compile_watch = ctx.backend.compile_watched(module)
        patch = dynamo_config({"recompile_limit": opts.recompile_limit}) if opts.recompile_limit else {}
        with ExitStack() as stack:
            if patch:
                stack.enter_context(torch._dynamo.config.patch(**patch))
            watch = stack.enter_context(PhaseWatch(MODE, compile_watch, keep_bytes=_trace_bytes(opts)))
            if phase is None:
                _forward_calls(ctx, loaded, fn, watch.before, watch.after)
            else:
                run_phase(fn, loaded, ctx.cell.inputs, phase, device=ctx.backend.device, before_call=watch.before,
                          after_call=watch.after)
        run = watch.result()
        torch._dynamo.reset()
    sig.take(run)
    sig.trace = keep_trace(ctx, opts, sig.name, run)
    return sig


def _trace_bytes(opts: CompileOptions) -> int:
    return int(opts.trace_mb * 2**20)


def keep_trace(ctx: "ModeContext", opts: CompileOptions, phase: str, run: WatchedRun) -> dict[str, Any] | None:
    """The phase's structured trace written where tlparse reads it (`compile/torch_trace/
    dedicated_log_torch_trace_<phase>.log`, cut to `trace_mb`): {"file" (relative to the cell folder), "records",
    "bytes", and "left_out", "left_out_bytes", "note" when cut}; None when none is kept."""
    if run.trace is None or opts.trace_mb <= 0:
        return None
    folder = ctx.artifact_dir(MODE) / TRACE_DIR
    path = folder / f"{TRACE_FILE_PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', phase)}.log"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        out = write_trace(path, run.trace, cap=_trace_bytes(opts))
    except OSError as exc:
        return {"error": f"the trace could not be written: {exc}"[:300]}
    out["file"] = path.relative_to(ctx.cell_dir).as_posix()
    if out.get("left_out"):
        out["note"] = (f"cut at {opts.trace_mb:g} MiB (option trace_mb): {out['left_out']} record(s), "
                       f"{out['left_out_bytes'] / 2**20:.1f} MiB, left out")
    return out


__all__ = ["run", "measure", "kept_run", "keep_trace", "FORWARD"]
