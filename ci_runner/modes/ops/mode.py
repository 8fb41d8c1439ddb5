"""Mode `ops`: every operator the backend cannot handle, in one run, each with a verified repro script.

1. **Inventory** (`ci_runner.modes.ops.inventory`): the model's ops per overload and input signature, traced at the IR level
   the backend's compiler sees (`BackendSpec.ir`, default `aten`; eager devices always use the dispatcher level),
   from a meta-device model when the model source allows it (no weights, no device).
2. **Probing**: each distinct (op, signature) runs alone on the target, on synthetic inputs with the recorded
   shapes, dtypes and strides: a one-op function through `backend.compile` (compile backends) or the op called
   on device tensors (eager backends), and, when it runs, compared with CPU eager within the dtype's tolerance.
   Probes run in isolated child processes, many per child (`ci_runner/modes/ops/probe.py` on `isolate.supervise`);
   each is journalled (`enter-probe`/`leave-probe`) and has its own timeout (`faulthandler`), so an abort, a
   segfault or a hang costs that probe only: the parent records it and starts a new child for the rest.
3. **Classification**: a compile-time failure (`BackendCompilerFailed`) or PyTorch's dispatcher error
   ("Could not run 'aten::X' with arguments from the 'Y' backend") → `unsupported_op`; any other failure, a
   hard fault or a hang → `op_error`; a result beyond tolerance → `op_mismatch`. The backend's own error text
   is kept. Failures that Dynamo raises before the backend is reached, or that CPU eager raises on the same
   synthetic inputs, say nothing about the backend: they are listed as probe errors, not findings.
4. **Findings and repros**: one finding per failing op overload (fingerprint `(kind, backend, op)`), listing
   every failing signature. Each gets a standalone script rendered from `templates/repro_op.py.j2` (torch and
   the backend's plugin only), run in a subprocess and marked `verified` only when it fails the same way.
5. **Reach** (`ci_runner/modes/ops/reach.py`, only when there are `op_mismatch` findings; `ops.reach_output`): one
   isolated child runs the model's forward on the cell's inputs plainly and with each mismatched op computed by
   the backend; each such finding says whether its mismatch reaches the model's output (`details.reaches_output`,
   `details.output_effect`, a clause in its message). The finding and the cell's status stay as they are.

Options (`options: {ops: {...}}` in the matrix) are declared in `ci_runner/options.py` (`OpsOptions`).

Tolerances (relative, absolute): float64 (1e-7, 1e-7), float32 (1e-4, 1e-5), float16 (1e-2, 1e-3),
bfloat16 (5e-2, 1e-2); integers and bools exactly. `atol` scales with the largest reference magnitude (at least
1). Ops with random or uninitialised outputs (`rand*`, `*dropout*`, `bernoulli`, `empty*` …) are not compared.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ...backends import backend_ran, backend_recipe, boilerplate_lines
from ...config import BackendSpec
from ...errors import DeepviewError
from ...fsutil import atomic_write_json
from .inventory import InventoryError, take_inventory
from .compare import SCRIPT_FUNCTIONS, matches_any
from .outcome import OpOutcome, OpStatus
from .inputs import SCRIPT_FUNCTIONS as INPUT_FUNCTIONS, call_source, dynamic_marks
from .phases import ProbeFn, run_phases
from .parallel import run_tp
from .probe import not_run_outcome, op_expression
from .reach import measure as measure_reach
from .signature import Inventory, OpSignature
from .store import probe_signatures, probe_spec
from .storepath import store_root
from ...options import OpsOptions
from ...registry import FindingKind, parse_options
from ...engine.repro import (plain_source, render_template, run_command, safe_filename, template_backend, verify_script,
                            write_script)
from ...results.model import Finding, ModeResult, Repro, fingerprint
from ...results.rootcause import cause_line

if TYPE_CHECKING:
    from .. import ModeContext

MODE = "ops"
_CPU_FALLBACK_MAX_BYTES = 4 * 2**30  # a model whose meta trace fails is retried on CPU (real weights) up to this size
_MAX_PROBE_ROWS = 1000  # outcomes kept in ModeResult.data["probes"] (all of them are in ops/probes.json)


# --------------------------------------------------------------------------------------------- repro scripts

def _tolerance(outcome: OpOutcome, probe: Mapping[str, Any]) -> tuple[float, float]:
    """(rtol, atol) the probe was judged with: the dtype's, or the one a precision policy widened it to
    (`probe.policy_tolerance`, kept in the outcome's metrics), which the repro then judges with too."""
    tol = (outcome.metrics or {}).get("tolerance") or probe["tolerance"]
    return float(tol[0]), float(tol[1])


def render_repro(*, op: str, kind: str, stage: str, error_type: str | None, message: str,
                 signature: OpSignature, probe: Mapping[str, Any], backend: Mapping[str, Any], backend_id: str,
                 model_id: str, ir: str, env_stamp: Mapping[str, Any], tolerance: tuple[float, float],
                 compare_results: bool, command: str, crash: bool) -> str:
    """The repro script's text (see `templates/repro_op.py.j2`); `backend`: `engine.repro.template_backend`."""

    tensor_lines, tensor_names, call_args = call_source(probe["args"], probe["kwargs"])
    positional_args = call_source(probe["args"], {})[2]
    site = signature.sites[0] if signature.sites else None
    backend_versions = env_stamp.get("backend") or {}
    return render_template(
        "repro_op.py.j2",
        op=signature.op, kind=kind, stage=stage, error_type=error_type or "", message=message.splitlines()[0][:300] if message else "",
        model_id=model_id, calls=signature.count, module=(site.module or "(the model itself)") if site else "?",
        module_class=site.module_class if site else "?", source=(site.source if site else None) or "unknown",
        signature=signature.describe()[:400], backend_id=backend_id, ir=ir,
        torch_version=env_stamp.get("torch") or torch.__version__, transformers_version=env_stamp.get("transformers") or "?",
        python_version=env_stamp.get("python") or sys.version.split()[0],
        backend_versions=", ".join(f"{k} {v}" for k, v in sorted(dict(backend_versions).items())) or "-",
        backend=backend, op_imports=[m for m in dict.fromkeys(signature.imports) if m not in backend["imports"]],
        outputs=signature.outputs, positional_args=positional_args,
        op_expr=op_expression(signature.op), seed=int(probe["seed"]), compare=compare_results and kind == FindingKind.OP_MISMATCH,
        rtol=tolerance[0], atol=tolerance[1], make_tensor_source="\n\n".join(plain_source(f) for f in INPUT_FUNCTIONS),
        compare_source="\n\n".join(plain_source(f) for f in SCRIPT_FUNCTIONS), tensor_lines=tensor_lines, tensor_names=tensor_names,
        call_args=call_args, command=command, crash=crash,
        dynamic_marks=dynamic_marks(probe["args"], probe["kwargs"]),
    )


# --------------------------------------------------------------------------------------------- the mode

for _fn in (*INPUT_FUNCTIONS, *SCRIPT_FUNCTIONS):  # read at import (see `plain_source`)
    plain_source(_fn)


def choose_level(spec: "BackendSpec", is_eager: bool, override: str | None) -> str:
    """The IR level to inventory: the mode option, else `dispatch` for eager devices, else the spec's `ir`."""
    if override:
        return override
    if is_eager:
        return "dispatch"
    return spec.ir or "aten"


def build_probes(inventory: Inventory, opts: OpsOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Probe specs for the inventory's signatures (in first-call order), and the signatures left out, with why."""
    probes: list[dict[str, Any]] = []
    left_out: list[dict[str, Any]] = []
    per_op: dict[str, int] = {}
    for sig in inventory.signatures:
        reason = None
        if opts.skip_ops and matches_any(sig.op, opts.skip_ops):
            reason = "skipped by options.ops.skip_ops"
        elif opts.only_ops and not matches_any(sig.op, opts.only_ops):
            reason = "not in options.ops.only_ops"
        elif not sig.probeable:
            reason = "an argument cannot be rebuilt synthetically"
        elif per_op.get(sig.op, 0) >= opts.max_signatures_per_op:
            reason = f"more than max_signatures_per_op={opts.max_signatures_per_op} signatures"
        if reason:
            left_out.append({"op": sig.op, "signature": sig.describe()[:300], "reason": reason})
            continue
        per_op[sig.op] = per_op.get(sig.op, 0) + 1
        probes.append(probe_spec(sig, opts, f"p{len(probes):04d}"))
    return probes, left_out


@dataclass
class _Failure:
    op: str  # the op the finding is about
    signature: OpSignature
    probe: dict[str, Any]
    outcome: OpOutcome


def attributed_op(probe_op: str, outcome: OpOutcome) -> str:
    """The op a failure is about: always the op the model calls (the probed one), which is what blocks the model.

    The backend may name another operator (simdev's `_safe_softmax` fails in its fallback to `aten::_softmax.out`,
    a structured op in its `.out` overload); that name stays in the finding's `details["named_op"]` and in the
    text a verified repro must reproduce.
    """
    return probe_op


_VOLATILE_RE = re.compile(r"0x[0-9a-fA-F]+|\bs\d+\b|\bu\d+\b|/tmp\S*|\bpid \d+|\d{4,}")


def _stable_prefix(line: str) -> str:
    """The part of an error line before its first volatile token (symbol ids `s96`, addresses, temp paths, PIDs,
    long counters), which changes from run to run: a repro must print that part to count as the same failure."""
    m = _VOLATILE_RE.search(line)
    return line[: m.start()] if m else line


def _expectation(outcome: OpOutcome, op: str) -> dict[str, Any]:
    """What a verified repro must print: the backend's phrase naming the op, and the error type."""
    if outcome.status.is_crash:
        return {"expect_text": [], "expect_error_type": None, "expect_signal": True}
    if outcome.status is OpStatus.MISMATCH:
        return {"expect_text": ["OpMismatch", op], "expect_error_type": None, "expect_signal": False}
    if outcome.named_text:
        text = [outcome.named_text]
    else:
        line = cause_line(outcome.message, boilerplate_lines())  # past a backend's boilerplate, as causes are keyed
        text = [t for t in [_stable_prefix(line)[:80].strip()] if t]
    return {"expect_text": text, "expect_error_type": outcome.error_type, "expect_signal": False}


def run(ctx: "ModeContext") -> ModeResult:
    """Mode `ops` (see the module docstring)."""
    t_start = time.monotonic()
    opts: OpsOptions = parse_options(MODE, ctx.options(MODE), where=f"cell {ctx.cell.id}: options.ops")
    spec = ctx.cell.backend
    backend = ctx.backend
    level = choose_level(spec, backend.is_eager, opts.ir)
    ops_dir = ctx.artifact_dir(MODE)
    ctx.journal("enter-phase", "ops.inventory")
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        inventory = take_model_inventory(ctx, level)
    except InventoryError as exc:
        ctx.journal("leave-phase", "ops.inventory")
        return ModeResult(status="error", reason=str(exc), duration_s=time.monotonic() - t_start,
                          data={"ir": level})
    ctx.journal("leave-phase", "ops.inventory")
    atomic_write_json(ops_dir / "inventory.json", inventory.to_dict())
    timings["inventory_s"] = round(time.monotonic() - t0, 3)
    data: dict[str, Any] = {"ir": level, "inventory": inventory.summary(), "timings": timings}
    if not opts.probe:
        return ModeResult(status="pass", duration_s=time.monotonic() - t_start, data=data,
                          reason="inventory only (options.ops.probe is false)")

    probes, _ = build_probes(inventory, opts)
    by_key = {s.key: s for s in inventory.signatures}
    stats: dict[str, Any] = {}
    t_probe = time.monotonic()
    outcomes = probe_signatures(spec, [by_key[p["key"]] for p in probes], store_dir=store_dir(ctx), opts=opts,
                                remaining=ctx.remaining, journal=ctx.journal, work_dir=ops_dir / "work",
                                versions=ctx.env.get("backend"), stats=stats, precision=ctx.precision()[0].key())
    timings["probe_s"] = round(time.monotonic() - t_probe, 3)
    _cleanup(ops_dir / "work")
    data["probe_store"] = {k: stats[k] for k in ("reused", "probed", "waited") if k in stats}
    data["precision"] = ctx.precision()[1]  # what each probe was judged under (declared, or measured for auto)
    result = model_result(inventory, outcomes, spec=spec, model_id=ctx.cell.model.id, level=level, opts=opts,
                          ops_dir=ops_dir, env_stamp=ctx.env, remaining=ctx.remaining, eager=backend.is_eager,
                          setup_error=stats.get("setup_error"), data=data, started=t_start)
    if ctx.cell.inputs.phases:
        _add_phases(ctx, opts, inventory, ops_dir, result, level)
    if ctx.cell.parallel:  # tensor parallel: the collectives and the sharded graphs' new ops (parallel.py)
        _add_parallel(ctx, opts, result, inventory)
    t_reach = time.monotonic()
    reach = measure_reach(ctx, opts, result.findings, ops_dir / "reach")  # only with op_mismatch findings
    if reach is not None:
        result.data["reach"] = reach
        timings["reach_s"] = round(time.monotonic() - t_reach, 3)
        result.duration_s += time.monotonic() - t_reach
    return result


def _add_parallel(ctx: "ModeContext", opts: OpsOptions, result: ModeResult, inventory: Inventory) -> None:
    t0 = time.monotonic()
    found, result.data["parallel"] = run_tp(ctx, opts, inventory, _prober(ctx, opts),
                                            {f.fingerprint for f in result.findings})
    result.duration_s += time.monotonic() - t0
    result.findings += found
    if found and result.status in ("pass", "inconclusive"):
        result.status = "fail"
    label = ctx.cell.parallel.label() if ctx.cell.parallel else ""
    tp = result.data["parallel"]
    if tp["status"] == "error":
        why = f"the {label} ranks failed: {tp['ranks']}"
        result.reason = "; ".join(filter(None, [result.reason, why]))
        if result.status == "pass":
            result.status = "error"
    elif (tp.get("ops") or {}).get("reason"):  # a sharded op's probe the backend never ran: not a pass
        result.reason = "; ".join(filter(None, [result.reason, f"{label}: {tp['ops']['reason']}"]))
        if result.status == "pass" and tp["ops"]["status"] in ("inconclusive", "error"):
            result.status = "inconclusive"


def _prober(ctx: "ModeContext", opts: OpsOptions) -> ProbeFn:
    """Probes new signatures like the forward's (the backend's probe store, isolated children), writing their table
    and repros under the folder, the repro paths relative to the cell: the phases' and the sharded graphs' ones."""
    spec, backend = ctx.cell.backend, ctx.backend

    def probe(new: Sequence[OpSignature], method: str, folder: Path) -> ModeResult:
        folder.mkdir(parents=True, exist_ok=True)
        more = Inventory(signatures=list(new), total_calls=sum(s.count for s in new), level="aten", method=method,
                         device="cpu")
        keys = {s.key: s for s in more.signatures}
        stats: dict[str, Any] = {}
        found = probe_signatures(spec, list(keys.values()), store_dir=store_dir(ctx), opts=opts,
                                 remaining=ctx.remaining, journal=ctx.journal, work_dir=folder / "work",
                                 versions=ctx.env.get("backend"), stats=stats, precision=ctx.precision()[0].key())
        _cleanup(folder / "work")
        result = model_result(more, found, spec=spec, model_id=ctx.cell.model.id, level="aten", opts=opts,
                              ops_dir=folder, env_stamp=ctx.env, remaining=ctx.remaining, eager=backend.is_eager,
                              setup_error=stats.get("setup_error"))
        rel = folder.relative_to(ctx.cell_dir).as_posix()
        for f in result.findings:
            if f.repro is not None:
                f.repro = replace(f.repro, path=f"{rel}/{Path(f.repro.path).name}")
        return result

    return probe


def _add_phases(ctx: "ModeContext", opts: OpsOptions, inventory: Inventory, ops_dir: Path, result: ModeResult,
                level: str) -> None:
    """Each phase's graphs (modes/ops/phases.py), their new signatures probed like the forward's."""
    t0 = time.monotonic()
    ctx.checkpoint(MODE, result.findings, result.data)  # a phase that kills the process keeps the forward's result
    findings, result.data["phases"] = run_phases(ctx, opts, inventory, ops_dir, _prober(ctx, opts),
                                                 {f.fingerprint for f in result.findings})
    result.data.setdefault("timings", {})["phases_s"] = round(time.monotonic() - t0, 3)
    result.duration_s += time.monotonic() - t0
    if findings:
        result.findings += findings
        if result.status in ("pass", "inconclusive"):
            result.status = "fail"


def store_dir(ctx: "ModeContext") -> Path:
    """The backend's probe store: `<out>/probes/<backend-id>`, shared by the run's cells of that backend (a cell
    folder outside a run's `cells/` keeps its own)."""
    cells = ctx.cell_dir.parent
    if cells.name == "cells":
        return store_root(cells.parent, ctx.cell.backend.id)
    return ctx.artifact_dir(MODE) / "probes-store"


def model_result(inventory: Inventory, outcomes: Mapping[str, OpOutcome], *, spec: BackendSpec,
                 model_id: str, level: str, opts: OpsOptions, ops_dir: Path, env_stamp: Mapping[str, Any],
                 remaining: Callable[[], float], eager: bool, setup_error: str | None = None,
                 data: dict[str, Any] | None = None, started: float | None = None,
                 verified_ops: Mapping[str, str] | None = None) -> ModeResult:
    """One model's ops `ModeResult` from its inventory and the probe outcomes by signature key (`probe_signatures`):
    the probe table (`ops_dir/probes.json`), one finding per failing op with its repro (verified), the status.
    `verified_ops` (op -> the model whose repro of it verified; the zoo's cells) skips verifying those ops again."""
    t_start = started if started is not None else time.monotonic()
    data = data if data is not None else {"ir": level, "inventory": inventory.summary(), "timings": {}}
    timings = data.setdefault("timings", {})
    probes, left_out = build_probes(inventory, opts)
    by_key = {s.key: s for s in inventory.signatures}
    by_id = {p["id"]: replace(outcomes.get(p["key"]) or not_run_outcome(p, "no outcome recorded"), id=p["id"])
             for p in probes}
    rows, failures = _probe_rows(probes, by_id, by_key)
    atomic_write_json(ops_dir / "probes.json", {"probes": rows, "left_out": left_out})

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    # bounded: passing probes as one line each (op, signature, seconds); the full table is in ops/probes.json
    data["probes"] = [r if r["status"] != "pass" else {k: r[k] for k in ("id", "op", "signature", "status", "seconds")}
                      for r in rows[:_MAX_PROBE_ROWS]]
    data["probe_counts"] = {**counts, "total": len(rows), "left_out": len(left_out),
                            "in_groups": sum(1 for r in rows if r.get("group")), "seconds": timings.get("probe_s", 0.0)}
    data["backend_ran"] = backend_ran(rows, compiles=not eager)
    if len(rows) > _MAX_PROBE_ROWS:
        data["probes_truncated"] = True
    if left_out:
        data["left_out"] = left_out[:200]
    if setup_error:
        data["probe_setup_error"] = setup_error
    together = _fails_together(rows)
    if together:
        data["fails_together"] = together

    t0 = time.monotonic()
    findings = _findings(spec, model_id, env_stamp, failures, level, opts, ops_dir)
    timings["render_s"] = round(time.monotonic() - t0, 3)
    t0 = time.monotonic()
    _verify_all(remaining, findings, opts, verified_ops or {})
    timings["verify_s"] = round(time.monotonic() - t0, 3)
    data["repros"] = {"total": sum(1 for f, _ in findings if f.repro),
                      "verified": sum(1 for f, _ in findings if f.repro and f.repro.verified)}
    result_findings = [f for f, _ in findings]
    status, reason = _status(rows, counts, has_findings=bool(result_findings), setup_error=setup_error)
    return ModeResult(status=status, findings=result_findings, reason=reason, data=data,
                      duration_s=time.monotonic() - t_start)


def _probe_rows(probes: list[dict[str, Any]], outcomes: Mapping[str, OpOutcome], by_key: Mapping[str, Any]
                ) -> tuple[list[dict[str, Any]], dict[str, list[_Failure]]]:
    """One table row per probe, and the failing probes by the op they are attributed to."""
    rows = []
    failures: dict[str, list[_Failure]] = {}
    for p in probes:
        o = outcomes.get(p["id"]) or not_run_outcome(p, "no outcome recorded")
        sig = by_key[p["key"]]
        rows.append({"id": p["id"], "op": p["op"], "signature": sig.describe()[:300], "status": o.status.value,
                     "stage": o.stage, "error_type": o.error_type, "seconds": o.seconds,
                     "message": o.message[:500], "compare": o.compare, "ran": o.ran})
        if o.group:  # passed inside a group of this many probes compiled as one graph (`grouptest`)
            rows[-1]["group"] = o.group
        if o.fails_together:
            rows[-1]["fails_together"] = o.fails_together
        if o.is_finding:
            op = attributed_op(p["op"], o)
            failures.setdefault(op, []).append(_Failure(op=op, signature=sig, probe=p, outcome=o))
    return rows, failures


def _fails_together(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Sets of probes that failed as one group while each passes alone (`grouptest`): noted, not findings."""
    seen: dict[str, dict[str, Any]] = {}
    for r in rows:
        t = r.get("fails_together")
        if t:
            seen.setdefault(str(t.get("message")), {"ops": t.get("ops"), "message": t.get("message")})
    return list(seen.values())[:20]


def _status(rows: list[dict[str, Any]], counts: Mapping[str, int], *, has_findings: bool,
            setup_error: str | None) -> tuple[str, str | None]:
    """The mode's status and reason: fail with findings; inconclusive when nothing failed but some probe never ran
    on the backend or was not run (`not_run`: time ran out, inputs over `ops.max_probe_input_mb`); error when the
    probe process could not set up the backend."""
    status = "fail" if has_findings else "pass"
    reason = None
    if counts.get("inconclusive"):
        unran = sorted({r["op"] for r in rows if r["status"] == "inconclusive"})
        n = counts["inconclusive"]
        ops_words = f" of {len(unran)} op(s)" if len(unran) != n else ""  # the count and the list count the same
        note = (f"{n} probe(s){ops_words} the backend never ran (inconclusive, not passed): "
                f"{', '.join(unran[:8])}{f' … and {len(unran) - 8} more' if len(unran) > 8 else ''}")
        reason = note
        if not has_findings:
            status = "inconclusive"
    if setup_error and not has_findings:
        status, reason = "error", f"the probe process could not set up the backend: {setup_error}"
    elif counts.get("not_run"):
        reason = "; ".join(filter(None, [reason, f"{counts['not_run']} probe(s) not run (time ran out, inputs over "
                                                  "ops.max_probe_input_mb, or the probe process failed)"]))
        status = "inconclusive" if status == "pass" else status
    return status, reason


def take_model_inventory(ctx: "ModeContext", level: str) -> Inventory:
    """From a meta-device model (no weights) when the model source can build one, else from the CPU model."""
    device = ctx.backend.device
    errors: list[str] = []
    _model_bytes = 0
    for meta in (True, False):
        if not meta and _model_bytes > _CPU_FALLBACK_MAX_BYTES:
            errors.append(f"not retried with real weights on CPU: the model needs {_model_bytes / 2**30:.1f} GiB")
            break
        try:
            loaded = ctx.model(meta=meta)
            kwargs = ctx.inputs(loaded, sample=0, device="cpu")
        except DeepviewError:
            raise
        except Exception as exc:
            errors.append(f"building the {'meta' if meta else 'CPU'} model failed: {type(exc).__name__}: {exc}")
            continue
        if meta:
            _model_bytes = sum(t.numel() * t.element_size() for t in loaded.module.parameters())
        try:
            inv = take_inventory(loaded.module, (), kwargs, level=level, device=device)
        except InventoryError as exc:
            errors.append(exc.message)
            continue
        if errors:
            inv.notes[:0] = errors
        if not meta:
            inv.notes.append("traced from the CPU model (the meta-device trace failed)")
        return inv
    raise InventoryError("; ".join(errors), hint="fix the trace error at that source line, or choose another `ir` "
                         "level for this backend (options.ops.ir)")


def _cleanup(work: Path) -> None:
    import shutil

    shutil.rmtree(work, ignore_errors=True)


def _findings(spec: BackendSpec, model_id: str, env_stamp: Mapping[str, Any], failures: Mapping[str, list[_Failure]],
              level: str, opts: OpsOptions, ops_dir: Path) -> list[tuple[Finding, dict[str, Any]]]:
    """One finding per failing op (its most severe failure), each with a rendered repro, not yet verified."""

    recipe = backend_recipe(spec)
    out: list[tuple[Finding, dict[str, Any]]] = []
    for op in sorted(failures, key=lambda o: min(f.probe["id"] for f in failures[o])):
        items = failures[op]
        lead = max(items, key=lambda f: (f.outcome.severity, -int(f.probe["id"][1:])))
        o = lead.outcome
        status, kind = o.status, o.kind
        assert kind is not None  # a failure: `OpOutcome.is_finding`
        site = next((s for f in items for s in f.signature.sites), None)
        modules: dict[str, None] = {}
        for f in items:
            for s in f.signature.sites:
                modules.setdefault(s.module, None)
        signatures = [{
            "signature": f.signature.describe()[:400], "probed_op": f.probe["op"], "count": f.signature.count,
            "status": f.outcome.status.value, "stage": f.outcome.stage, "error_type": f.outcome.error_type,
            "message": f.outcome.message[:600], "metrics": f.outcome.metrics or {},
            "sites": [s.to_dict() for s in f.signature.sites[:4]],
        } for f in items]
        message, error_type, diagnostics = o.message, o.error_type, o.diagnostics or {}
        details = {"signatures": signatures, "signature_count": len(items),
                   "calls": sum(f.signature.count for f in items), "modules": list(modules)[:20],
                   "module_count": len(modules), "source": site.source if site else None, "ir": level,
                   "named_op": o.named_op, "probed_op": lead.probe["op"],
                   "compiler_diagnostics": list(diagnostics.get("compiler") or []),
                   "exception_chain": list(diagnostics.get("exception_chain") or []),
                   "outputs": lead.signature.outputs, "imports": list(lead.signature.imports),
                   "backend_ran": o.ran or {}}
        if o.traceback:  # where the error was raised (`rootcause.raised_in` reads it)
            details["traceback_tail"] = str(o.traceback)[-3000:]
        if kind == FindingKind.PROBE_ERROR:  # the probe itself could not be built: nothing a repro could show
            out.append((Finding(kind=kind, stage=o.stage or "trace",
                                message=f"the probe of {op} could not be built: {error_type}: {message}"[:2000],
                                fingerprint=fingerprint(kind, spec.id, op), op=op,
                                module=site.module if site else None, module_class=site.module_class if site else None,
                                error_type=error_type, details=details), {}))
            continue
        file_name = f"repro_{safe_filename(op)}.py"
        script = ops_dir / file_name
        command = run_command(file_name, ops_dir, recipe.pythonpath)
        text = render_repro(op=op, kind=kind, stage=o.stage or "run", error_type=error_type,
                            message=message, signature=lead.signature, probe=lead.probe,
                            backend=template_backend(spec),
                            backend_id=spec.id, model_id=model_id, ir=level, env_stamp=env_stamp,
                            tolerance=_tolerance(o, lead.probe), compare_results=opts.compare,
                            command=command, crash=status.is_crash)
        write_script(script, text)
        metrics = dict(o.metrics or {})
        tol = _tolerance(o, lead.probe)
        threshold = {"rtol": tol[0], "atol": tol[1]} if kind == FindingKind.OP_MISMATCH else {}
        finding = Finding(
            kind=kind, stage=o.stage or "run",
            message=(f"{error_type}: {message}" if error_type and not message.startswith(str(error_type)) else message)[:2000],
            fingerprint=fingerprint(kind, spec.id, op), op=op,
            module=site.module if site else None, module_class=site.module_class if site else None,
            error_type=error_type, metrics=metrics, threshold=threshold,
            repro=Repro(path=f"{MODE}/{file_name}", verified=False, command=command, note="not verified"),
            details=details,
        )
        out.append((finding, {"script": script, "recipe": recipe, **_expectation(o, op),
                              "status": status, "error_type": error_type, "named_text": o.named_text,
                              "limit_s": o.seconds}))
    return out


def _same_fault(how: Mapping[str, Any], exit_code: int | None, output: str, note: str) -> tuple[bool, str]:
    """A hard fault reproduces only as the same fault: the same signal (or a hang), naming the same op if it did."""
    import signal

    error_type = str(how.get("error_type") or "")
    if how["status"] is OpStatus.TIMEOUT:
        if exit_code is not None:
            return False, f"expected a hang, but the repro exited with {exit_code}"
    elif error_type.startswith("SIG"):
        want = getattr(signal, error_type, None)
        if want is None or exit_code != -int(want):
            return False, f"expected death by {error_type}, got exit code {exit_code}"
    phrase = how.get("named_text")
    if phrase and phrase not in output:
        return False, f"failed differently: output lacks {phrase!r}"
    return True, note


def _verify_all(remaining: Callable[[], float], findings: list[tuple[Finding, dict[str, Any]]], opts: OpsOptions,
                verified_ops: Mapping[str, str]) -> None:
    """Run each repro in a fresh process; `verified` when it fails with the same error type and op text. An op in
    `verified_ops` is not run again (its note names the model whose repro of the op verified)."""

    with_repro = [item for item in findings if item[0].repro is not None]
    findings = []
    for item in with_repro:
        f = item[0]
        if opts.verify and f.op in verified_ops:
            assert f.repro is not None
            f.repro.note = f"not run again: the repro of {f.op} verified in {verified_ops[f.op]}'s cell"
        else:
            findings.append(item)
    if not findings:
        return
    if not opts.verify:
        for f, _ in findings:
            assert f.repro is not None
            f.repro.note = "not verified (options.ops.verify is false)"
        return

    def one(item: tuple[Finding, dict[str, Any]]) -> None:
        finding, how = item
        assert finding.repro is not None
        timeout = opts.verify_timeout
        if how["status"] is OpStatus.TIMEOUT:  # a hang reproduces only by staying stuck past the probe's own limit
            timeout = max(opts.probe_timeout, float(how.get("limit_s") or 0.0)) + opts.hang.progress_window
        if remaining() < timeout + 5:
            finding.repro.note = "not verified: the cell's time ran out"
            return
        env = {str(k): str(v) for k, v in how["recipe"].env.items()}
        if how["recipe"].pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(how["recipe"].pythonpath)
        v = verify_script(how["script"], expect_text=how["expect_text"], expect_error_type=how["expect_error_type"],
                          timeout=timeout, env=env, expect_signal=how["expect_signal"])
        verified, note = v.verified, v.note
        if verified and how["expect_signal"]:
            verified, note = _same_fault(how, v.exit_code, v.output_tail, note)
        finding.repro.verified = verified
        finding.repro.note = note
        finding.details["repro_output_tail"] = v.output_tail[-1500:]

    workers = max(1, min(opts.workers, len(findings)))
    if workers == 1:
        for item in findings:
            one(item)
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, findings))
