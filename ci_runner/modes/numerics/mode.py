"""Mode `numerics`: per-layer divergence of the target against trusted references, with data-derived thresholds.

The failure this mode exists for is silent: the model compiles, runs and answers plausibly while one layer is
quietly wrong. Every module call is compared against the primary reference, in two views, and each comparison is
held to that layer's own threshold. The method (thresholds, reference pass, cumulative and isolated views,
verdict) is described in `docs/numerics.md`; the work is done by the `ci_runner/modes/numerics/` package, this module
only orchestrates it: options (`options.NumericsOptions`), thresholds for the cell, the reference pass, the
target in child processes (a fresh child after a crash, skipping the module that crashed), the result.

Status: `fail` with findings; `pass` when every layer was compared in every view that ran and none exceeds its
threshold; `inconclusive` when nothing exceeds its threshold but only part of the model was compared (a view did
not run, the backend failed in some layers, the paths were not comparable): the reason says "N of M layers
compared" and why, `data["coverage"]` holds the counts; `error` when nothing at all could be compared, or fewer
than two references are configured.
"""

from __future__ import annotations

import json
import shutil
import time
from functools import partial
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import torch

from ...registry import parse_options
from ...config import spec_to_json
from ...fsutil import append_line, atomic_write_json
from ...procs.isolate import Attempt, IsolatedResult, Journal, supervise
from ...models.load import load_model
from ...options import NumericsOptions
from ...results.model import Finding, ModeResult
from .capture import dump_meta, record_reference
from .settings import DTYPES, VIEWS, dynamo_settings
from .store import DumpReader, dump_matches
from .target import (
    TARGET_CHILD,
    WEIGHTS_ITEM,
    TargetPlan,
    compare_target,
    done_keys,
    json_safe,
    parse_journal_entry,
    read_records,
    target_dtype,
)
from .cache import cell_thresholds
from ...engine.handoff import handoff_path, save_handoff
from .thresholds import LayerStats, ThresholdTable, add_views, load_or_derive
from .overlay import (PROGRAM_FILE, export_program, module_ratios, place, shared_program,
                                 weights_mb, write_node_data)
from .toolbox import after_numerics, before_numerics, reference_dumps, weights_from_target, weights_in_target
from .verdict import (
    Layer,
    OTHER_VIEW,
    build_layers,
    coverage,
    coverage_text,
    findings_for,
    layer_table,
    verdict_of,
    view_status,
)
from .parallel import PendingParallel, start_parallel
from .phases import run_phases
from .phaserepro import attach_phase_repros, forward_repro
from .repro import attach_repros
from .views import cast_copy, derive_reference_stats, runnable_reference

if TYPE_CHECKING:
    from .. import ModeContext


def _run_target(ctx: "ModeContext", opts: NumericsOptions, dumps: list[Path], work: Path, table: ThresholdTable,
                weights: Path | None, timings: dict[str, float]) -> tuple[list[dict[str, Any]], list[str]]:
    """Compare the target against `dumps` (child processes unless `isolate: false`); (records, notes). With
    `weights`, the child runs the weights check first and writes its result there."""
    primary = ctx.cell.references[0]
    results = work / "target.jsonl"
    journal = work / "journal.log"
    for p in (results, journal, weights):
        if p is not None and p.exists():
            p.unlink()
    notes: list[str] = []
    base = dict(model=spec_to_json(ctx.cell.model), backend=spec_to_json(ctx.cell.backend), seed=ctx.cell.inputs.seed,
                dtype=target_dtype(ctx.cell.model.dtype, primary.dtype), dumps=tuple(str(d) for d in dumps),
                results=str(results), journal=str(journal),
                views=opts.views, isolated=opts.isolated, thresholds=str(table.path) if table.path else None,
                threshold_options=opts.thresholds.as_dict(),
                weights={"out": str(weights), "chunk_mb": 256.0} if weights is not None else None)
    if not opts.isolate:
        return _run_target_here(ctx, base, results, journal, table), notes
    t = time.monotonic()
    handed = _hand_over(ctx, work)
    timings["handoff_s"] = round(time.monotonic() - t, 3)
    try:
        return _supervise_target(ctx, opts, {**base, "model_file": handed}, results, weights, notes)
    finally:
        if handed is not None:
            Path(handed).unlink(missing_ok=True)


def _hand_over(ctx: "ModeContext", work: Path) -> str | None:
    """The primary reference's model, written for the target child (`engine.handoff.save_handoff`) when it lives on CPU;
    None (the child builds it) otherwise or when it cannot be written."""
    primary = ctx.cell.references[0]
    if primary.device != "cpu":
        return None
    module = ctx.model(dtype=target_dtype(ctx.cell.model.dtype, ctx.cell.references[0].dtype), device="cpu").module
    path = None
    try:
        path = handoff_path(module, work)
        return save_handoff(module, path)["file"]
    except (OSError, RuntimeError):
        if path is not None:
            path.unlink(missing_ok=True)
        return None


def _supervise_target(ctx: "ModeContext", opts: NumericsOptions, base: dict[str, Any], results: Path,
                      weights: Path | None, notes: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The target in child processes, a fresh one after each crash (see `_run_target`)."""
    journal = Path(base["journal"])

    crashed: list[dict[str, Any]] = []
    finished = False
    tail: list[str] = []  # the failed child's traceback, after the stop reason

    def next_attempt(n: int) -> Attempt | str | None:
        if finished:
            return None
        budget = ctx.remaining() - 5.0
        if opts.timeout is not None:
            budget = min(budget, opts.timeout)
        if budget <= 5.0:
            return "the target was not (fully) compared: the cell ran out of time"
        payload = {**base, "skip": done_keys(read_records(results), crashed), "deadline_wall": time.time() + budget * 0.9}
        if crashed:  # a child died in a view: the cumulative view is incomplete or the isolated view had started
            payload["isolated"] = "all"
        return Attempt(payload=payload, timeout=budget)

    def on_ok(res: IsolatedResult) -> None:
        nonlocal finished
        finished = True
        if base.get("model_file") and (res.value or {}).get("model") == "built":
            notes.append("the target child could not take the model from the parent's file: it built the model")

    def on_crash(item: str | None, res: IsolatedResult) -> str | None:
        entry = parse_journal_entry(item)
        what = res.describe()
        if weights is not None and item == WEIGHTS_ITEM:  # the next child goes on without the weights check
            atomic_write_json(weights, {"status": "error", **res.failure("weights check")})
            return None
        if res.status == "error" and entry is None:
            if res.traceback:
                tail.append(res.traceback[-1500:])
            return f"the target child {what}"
        if entry is None:
            return f"the target child {what} before any module was entered"
        view, s, key = entry
        crashed.append({"view": view, "sample": s, "key": key, "status": res.status, "message": what,
                        "stderr": (res.stderr_tail or "")[-1500:]})
        notes.append(f"the target child {what} in {view} view, sample {s}"
                     + (f", module {key or '(root)'}" if view == "isolated" or key else ""))
        return None

    run = supervise(TARGET_CHILD, journal=journal, kind="module", next_attempt=next_attempt, on_crash=on_crash,
                    on_ok=on_ok, max_restarts=opts.max_restarts, env=dict(ctx.cell.backend.env))
    if run.stop_reason is not None:
        notes.append(run.stop_reason)
        notes.extend(tail)
    return read_records(results) + [_crash_record(c) for c in crashed], notes


def _run_target_here(ctx: "ModeContext", base: dict[str, Any], results: Path, journal: Path,
                     table: ThresholdTable) -> list[dict[str, Any]]:
    """`isolate: false`: compare the target in this process (faster, not crash-safe)."""
    dtype = target_dtype(ctx.cell.model.dtype, ctx.cell.references[0].dtype)
    module = ctx.model(dtype=dtype, device="cpu").module
    if ctx.backend.device != "cpu":  # moving would move the reference model too: use a copy
        module = load_model(ctx.cell.model, seed=ctx.cell.inputs.seed, dtype=dtype, device="cpu").module
    plan = TargetPlan(**base, deadline_wall=time.time() + ctx.remaining() * 0.9)

    def emit(rec: dict[str, Any]) -> None:
        append_line(results, json.dumps(json_safe(rec), allow_nan=False))

    compare_target(module, ctx.backend, plan, emit, journal=Journal(journal).write, table=table)
    return read_records(results)


def _crash_record(c: dict[str, Any]) -> dict[str, Any]:
    """The record of a view/sample/module whose target child died (`c`: what `on_crash` noted)."""
    if c["view"] == "cumulative" and not c["key"]:
        return {"view": "cumulative", "sample": c["sample"], "status": "error", "stage": "run",
                "error": f"the whole-model run {c['message']}"}
    if c["view"] == "cumulative":
        return {"view": "cumulative", "sample": c["sample"], "status": "error", "stage": "run",
                "error": f"the whole-model run {c['message']} in module {c['key'] or '(root)'}"}
    return {"view": "isolated", "sample": c["sample"], "key": c["key"], "stage": "run",
            "error": f"{c['message']}", "crash": c["status"]}



def deferred_views(opts: NumericsOptions) -> tuple[str, ...]:
    """The views whose thresholds are derived only when the target runs them: the isolated view under
    `isolated: auto` (it runs only when the cumulative view flags or fails something)."""
    if opts.isolated == "auto" and "cumulative" in opts.views and "isolated" in opts.views:
        return ("isolated",)
    return ()


def derive_for_cell(ctx: "ModeContext", opts: NumericsOptions, dump_root: Path, keep: Iterable[int],
                    timings: dict[str, float] | None = None) -> tuple[ThresholdTable, str, str]:
    """Load the model's thresholds, or derive them (once per key, under a file lock): (table, how, key hash).

    The file and its key are `cache.cell_thresholds`'s (the CI cache key follows the same key). Derived
    now, the reference dumps of the samples in `keep` stay in `dump_root`, marked with the key hash; so do every
    sample's when a view is left for later (`deferred_views`, added by `complete_thresholds`)."""
    policy = ctx.precision()[0]
    where = cell_thresholds(ctx.cell, ctx.cell_dir.parent.parent, opts, policy)  # the run folder: <run>/cells/<id>
    later = deferred_views(opts)
    views = tuple(v for v in opts.views if v not in later)
    keep = range(int(where.key["samples"])) if later else keep
    derive = _deriver(ctx, opts, dump_root, samples=int(where.key["samples"]), dump_key=where.key_hash, keep=keep,
                      views=views, timings=timings)
    table, how = load_or_derive(where.path, where.key, opts.thresholds, ctx.cell.references[0].dtype, derive,
                                views=views)
    return table, how, where.key_hash


def complete_thresholds(ctx: "ModeContext", opts: NumericsOptions, table: ThresholdTable, records: list[dict[str, Any]],
                        dump_root: Path, dump_key: str, keep: Iterable[int], timings: dict[str, float],
                        notes: list[str]) -> None:
    """Add the statistics of a deferred view to `table` once the target has run it (`records` hold that view's
    comparisons): from the file when another cell added them, else derived now (`thresholds.add_views`) on the
    dumps kept for it; `notes` says which."""
    ran = {r.get("view") for r in records if r.get("status") != "skipped"}
    views = [v for v in deferred_views(opts) if v in ran and v not in table.views]
    if not views:
        return
    t = time.monotonic()
    derive = _deriver(ctx, opts, dump_root, samples=int(table.key["samples"]), dump_key=dump_key, keep=keep,
                      views=tuple(views), timings=timings)
    notes.append(f"thresholds: {add_views(table, views, derive)}")
    timings["thresholds_later_s"] = round(time.monotonic() - t, 3)


def _deriver(ctx: "ModeContext", opts: NumericsOptions, dump_root: Path, *, samples: int, dump_key: str,
             keep: Iterable[int], views: tuple[str, ...],
             timings: dict[str, float] | None) -> Callable[[], dict[str, LayerStats]]:
    """The derivation of the statistics of `views` (`views.derive_reference_stats` over the cell's references)."""
    refs = ctx.cell.references
    primary = refs[0]

    def derive() -> dict[str, LayerStats]:
        loaded = ctx.model(dtype=primary.dtype, device=primary.device)
        # secondary references are loaded here, not through ctx's cache: their memory (a float64 copy is twice the
        # weights) is freed as soon as the thresholds are derived
        secondaries = [(r, _secondary_module(ctx, loaded.module, r)) for r in refs[1:]]
        for r, module in secondaries:
            runnable_reference(module, r.dtype)

        def sample_inputs(s: int) -> Mapping[str, Any]:
            return ctx.inputs(loaded, sample=s, device=primary.device)

        with torch._dynamo.config.patch(**dynamo_settings()):
            return derive_reference_stats(loaded.module, primary, secondaries, sample_inputs, samples, dump_root,
                                          keep=keep, chunk_mb=opts.chunk_mb, views=views, dump_key=dump_key,
                                          timings=timings, policy=ctx.precision()[0])

    return derive


def _secondary_module(ctx: "ModeContext", primary: torch.nn.Module, ref: Any) -> torch.nn.Module:
    """A secondary reference's model. A config model's float32 primary on the same device is cast (`cast_copy`:
    the weights `load_model` would build, without building the model again); any other is loaded."""
    if ctx.cell.model.config and ctx.cell.references[0].dtype == "float32" and ref.dtype in DTYPES \
            and ref.device == ctx.cell.references[0].device:
        return cast_copy(primary, DTYPES[ref.dtype])
    return load_model(ctx.cell.model, seed=ctx.cell.inputs.seed, dtype=ref.dtype, device=ref.device).module


def run(ctx: "ModeContext") -> ModeResult:
    """The numerics mode (see the module docstring)."""
    t0 = time.monotonic()
    opts: NumericsOptions = parse_options("numerics", ctx.options("numerics"))
    if not ctx.precision()[0].is_float32 and opts.isolated == "auto":
        # below float32 the cumulative view carries the policy's drift into every later layer: a class that breaks
        # the policy (a norm in bf16) shows at its own size only when the layer is fed the reference's inputs
        opts = replace(opts, isolated="all")
    bad_refs = _references_problem(ctx.cell.references)
    if bad_refs is not None:
        return ModeResult(status="error", reason=bad_refs)
    pending = start_parallel(ctx, opts) if ctx.cell.parallel else None  # the TP ranks run beside the single rank
    try:
        return _single_rank(ctx, opts, t0, pending)  # collects the ranks' result at its end
    except Exception:  # the ranks never outlive the mode (an interrupt ends them with this process)
        if pending is not None:
            pending.wait()
        raise


def _single_rank(ctx: "ModeContext", opts: NumericsOptions, t0: float, pending: PendingParallel | None) -> ModeResult:
    """The single-rank comparison, then the phases and the TP run's result (`pending`, started by `run`)."""
    toolbox = opts.toolbox  # weights/batch/bisect/reference dumps
    refs = ctx.cell.references
    work = ctx.artifact_dir("numerics")
    dump_root = work / "ref"
    compare = list(range(opts.compare_samples))
    timings: dict[str, float] = {}
    pre = before_numerics(ctx, toolbox, isolate=opts.isolate)  # the weights check, before any forward
    weights = work / "weights.json" if weights_in_target(ctx, toolbox, isolate=opts.isolate) else None
    notes: list[str] = list(pre.notes)

    t = time.monotonic()
    table, how, dump_key = derive_for_cell(ctx, opts, dump_root, keep=compare, timings=timings)
    timings["thresholds_s"] = time.monotonic() - t
    notes.append(f"thresholds {how}")

    t = time.monotonic()
    dumps, compare = _reference_pass(ctx, opts, table, dump_root, dump_key, compare, notes)
    timings["reference_s"] = round(time.monotonic() - t, 3)
    t = time.monotonic()
    records, target_notes = _run_target(ctx, opts, dumps, work, table, weights, timings)
    if weights is not None:  # the target child ran the weights check before its forward
        pre = weights_from_target(ctx, weights)
        notes[:0] = pre.notes
    notes.extend(target_notes)
    timings["target_s"] = round(time.monotonic() - t, 3)
    complete_thresholds(ctx, opts, table, records, dump_root, dump_key, compare, timings, notes)

    iso_skipped, cum_errors = _view_runs(records, timings)
    timings = {k: round(v, 3) for k, v in timings.items()}
    reader = DumpReader(dumps[0])
    layers = build_layers(reader, records, table)
    reader.close()
    iso_ran, cum_ran = (any(l.metrics.get(view) for l in layers) for view in ("isolated", "cumulative"))
    policy = ctx.precision()[0]
    verdict = verdict_of(layers, isolated_ran=iso_ran, policy=None if policy.is_float32 else policy.label())
    if verdict.get("kind") == "policy_drift":
        notes.append(verdict["text"])
    findings, total_findings = findings_for(layers, verdict, backend_id=ctx.cell.backend.id,
                                           model_id=ctx.cell.model.id, max_findings=opts.max_findings)
    post = after_numerics(ctx, toolbox, table=table, layers=layers, verdict=verdict, findings=findings,
                          isolate=opts.isolate)  # batch invariance, bisect of the divergent layer
    timings.update(_repros(ctx, opts, findings, layers, dumps[0]))  # while the reference dump is on disk
    errors = [{"key": l.key, "module_class": l.module_class, **{f"{v}": e for v, e in l.errors.items()}}
              for l in layers if l.errors]
    data: dict[str, Any] = {
        "layers": layer_table(layers, opts.max_layers),
        "layers_total": len(layers),
        "verdict": verdict,
        "thresholds": _thresholds_data(table, refs, opts),
        "views": {view: view_status(layers, view, errors=bool(cum_errors) if view == "cumulative" else False,
                                     wanted=view in opts.views) for view in VIEWS},
        "isolated": opts.isolated,
        "precision": ctx.precision()[1],
        "compare_samples": compare,
        "timings": timings,
        "notes": notes,
    }
    _note_views(records, data, notes, iso_skipped)
    _note_truncations(data, layers=len(layers), max_layers=opts.max_layers, cum_errors=cum_errors, errors=errors,
                      findings=(total_findings, len(findings)))
    findings = pre.findings + findings + post.findings
    data.update({**pre.data, **post.data})
    notes.extend(post.notes)
    if not opts.keep_dumps:
        shutil.rmtree(dump_root, ignore_errors=True)
    else:
        data["dumps"] = [str(d.relative_to(ctx.cell_dir)) if d.is_relative_to(ctx.cell_dir) else str(d) for d in dumps]
    findings += _phases(ctx, opts, data, findings) if ctx.cell.inputs.phases else []  # per phase and step: phases.py
    findings += _parallel(ctx, pending, data, findings) if pending is not None else []  # tensor parallel: parallel.py
    if opts.model_explorer:
        data["model_explorer"] = _overlay(ctx, opts, data["layers"], compare[0] if compare else 0, dump_key)
    duration = time.monotonic() - t0
    if not cum_ran and not iso_ran:
        why = cum_errors[0]["error"] if cum_errors else (notes[-1] if notes else "no comparison could run")
        return ModeResult(status="error", reason=f"the target could not be compared: {why}", findings=findings,
                          data=data, duration_s=duration)
    return _with_parallel(_result(findings, data, duration, cum_errors=cum_errors, layers=layers,
                                  expected=[v for v in opts.views if not (v == "isolated" and iso_skipped)]))


def _repros(ctx: "ModeContext", opts: NumericsOptions, findings: list[Finding], layers: list[Layer],
            dump: Path) -> dict[str, float]:
    """A repro on each divergence of the single forward: a layer's (`repro.py`), or accumulated drift's whole-model
    one (`phaserepro.forward_repro`)."""
    drift = partial(forward_repro, ctx, verify=opts.verify, verify_timeout=opts.verify_timeout)
    return attach_repros(ctx, findings, layers, dump, opts, drift=drift)


def _overlay(ctx: "ModeContext", opts: NumericsOptions, rows: list[dict[str, Any]], sample: int,
             model_key: str) -> dict[str, Any]:
    """The layer table on the model's graph for Model Explorer (`modes/numerics/overlay.py`): the primary reference's
    model exported on the compared sample's inputs (once per model key in `<run>/model_explorer/`, linked here),
    each view's node data and (under `model_explorer_mb`) the program, in `numerics/model_explorer/`; paths relative
    to the cell folder. A failure is said here, never the mode's."""
    if not any(module_ratios(rows, view) for view in VIEWS):
        return {"note": "no layer was compared: no node data"}
    if ctx.remaining() < 60.0:  # an export of a big model takes its time: the cell's result comes first
        return {"note": "not written: the cell had under a minute left"}
    t = time.monotonic()
    primary = ctx.cell.references[0]
    folder = ctx.artifact_dir("numerics") / "model_explorer"
    shared = ctx.cell_dir.parent.parent / "model_explorer" / f"{ctx.cell.model.id}-{model_key}-sample{sample}"
    try:
        loaded = ctx.model(dtype=primary.dtype, device=primary.device)
        mb = weights_mb(loaded.module)
        stacks, program = shared_program(
            shared, lambda: export_program(loaded.module, ctx.inputs(loaded, sample=sample, device=primary.device)),
            save=mb <= opts.model_explorer_mb)
        folder.mkdir(parents=True, exist_ok=True)
        out = write_node_data(folder, stacks, rows, VIEWS)
        if program is not None:
            place(program, folder / PROGRAM_FILE)
    except Exception as exc:  # an export torch refuses, a full disk: the comparison stands  # noqa: BLE001
        return {"error": f"not written: {type(exc).__name__}: {exc}"[:500]}
    rel = folder.relative_to(ctx.cell_dir).as_posix()
    files = [f"{rel}/{name}" for name in out["node_data"].values()]
    out.update(folder=rel, sample=sample, seconds=round(time.monotonic() - t, 3), program=None,
               node_data={view: f"{rel}/{name}" for view, name in out["node_data"].items()})
    if program is not None:
        out["program"] = f"{rel}/{PROGRAM_FILE}"
        out["command"] = f"model-explorer {out['program']} --node_data_paths={','.join(files)}"
    else:
        out["note"] = (f"the exported program is not kept: its weights take {mb:.0f} MiB, over model_explorer_mb="
                       f"{opts.model_explorer_mb:g}; export the model as docs/numerics.md says to open the node data")
    return out


def _phases(ctx: "ModeContext", opts: NumericsOptions, data: dict[str, Any], findings: list[Any]) -> list[Any]:
    """Each phase of `inputs.phases` (modes/numerics/phases.py): its findings; its table into `data.phases`."""
    t = time.monotonic()
    ctx.checkpoint("numerics", findings, data)  # kept if a phase kills the process
    found, data["phases"] = run_phases(ctx, opts)
    data.setdefault("timings", {})["phases_s"] = round(time.monotonic() - t, 3)
    data["timings"].update(attach_phase_repros(ctx, found, opts))  # a repro per divergence of a phase
    return found


def _parallel(ctx: "ModeContext", pending: PendingParallel, data: dict[str, Any], findings: list[Any]) -> list[Any]:
    """The cell's tensor-parallel layout (modes/numerics/parallel.py; its ranks started with the mode): its findings;
    its table into `data.parallel`."""
    ctx.checkpoint("numerics", findings, data)  # kept if the ranks kill the process
    found, data["parallel"] = pending.finish()
    return found


def _with_parallel(result: ModeResult) -> ModeResult:
    """A pass whose TP run the backend left (in part) to PyTorch is inconclusive, never a pass."""
    tp = result.data.get("parallel") or {}
    if tp.get("status") == "inconclusive" and result.status == "pass":
        result.status, result.reason = "inconclusive", tp.get("reason")
    return result


def _references_problem(refs: Any) -> str | None:
    """Why the matrix's references cannot drive the mode, or None."""
    if len(refs) < 2:
        return ("numerics needs at least two references to derive thresholds from "
                "(the matrix lists one); add e.g. {id: cpu-fp64, device: cpu, dtype: float64}")
    if refs[0].dtype not in DTYPES:
        return f"primary reference dtype {refs[0].dtype!r} is not one of {list(DTYPES)}"
    return None


def _thresholds_data(table: ThresholdTable, refs: Any, opts: NumericsOptions) -> dict[str, Any]:
    return {"file": str(table.path) if table.path else None, "reused": table.reused,
            "key_hash": table.path.stem.rsplit("-", 1)[-1] if table.path else None,
            "references": [r.id for r in refs], "options": opts.thresholds.as_dict(),
            "derive_seconds": table.derive_seconds}


def _view_runs(records: list[dict[str, Any]], timings: dict[str, float]) -> tuple[str | None, list[dict[str, Any]]]:
    """From the target's records: the views' seconds (into `timings`), why the isolated view was skipped (None: it
    was not) and the whole-model runs that failed."""
    iso_status = [r for r in records if r.get("view") == "isolated" and "status" in r]
    cumulative_status = [r for r in records if r.get("view") == "cumulative" and "status" in r]
    timings["target_cumulative_s"] = round(sum(float(r.get("seconds", 0.0)) for r in cumulative_status), 3)
    timings["target_isolated_s"] = round(sum(float(r.get("seconds", 0.0)) for r in iso_status), 3)
    iso_skipped = next((r.get("reason") for r in iso_status if r["status"] == "skipped"), None)
    return iso_skipped, [r for r in cumulative_status if r["status"] == "error"]


def _note_views(records: list[dict[str, Any]], data: dict[str, Any], notes: list[str], iso_skipped: str | None) -> None:
    """Why the isolated view was skipped; how the compiled cumulative view captured each sample (`data.capture`:
    `watched.CAPTURE_WAYS`, the ways tried first and why the backend did not run them), and a note when it was not
    the first way or ran nowhere."""
    if iso_skipped:
        data["views"]["isolated"] = "skipped"
        notes.append(f"isolated view skipped: {iso_skipped}")
    ways = [{"sample": r.get("sample"), **{k: r[k] for k in ("capture", "fallbacks", "not_ran", "partial") if k in r}}
            for r in records if r.get("view") == "cumulative" and r.get("status") == "ok" and "capture" in r]
    if not ways:
        return
    data["capture"] = ways
    for w in ways:
        if w.get("not_ran"):
            notes.append(f"sample {w['sample']}: the backend did not run the model in any capture way "
                         f"(last {w['capture']}: {w['not_ran'][:300]}): no layer of it is compared in that view")
        elif w.get("fallbacks"):
            notes.append(f"sample {w['sample']}: captured {w['capture']}; the backend did not run "
                         + "; ".join(f"{f['capture']} ({f['not_ran'][:200]})" for f in w["fallbacks"]))
        if w.get("partial"):  # the partitioner's leftovers: their modules are not_ran, their ancestors partial
            notes.append(f"sample {w['sample']}: the backend's partitioner left to PyTorch "
                         + "; ".join(f"{op} (in {', '.join(m or '(root)' for m in where[:3])})"
                                     for op, where in list(w["partial"].items())[:4])
                         + ": those modules are not compared on the backend, the layers around them only in part")


def _reference_pass(ctx: "ModeContext", opts: NumericsOptions, table: ThresholdTable, dump_root: Path, dump_key: Any,
                    compare: list[int], notes: list[str]) -> tuple[list[Path], list[int]]:
    """The primary reference's dumps of the compared samples (recorded now unless derive() left them on disk, or
    given as `toolbox.reference_dump`); (dump folders, samples compared)."""
    primary = ctx.cell.references[0]
    if opts.toolbox.reference_dump:  # dumped elsewhere (`deepview-ci dump --reference`): replaces the reference pass
        dumps, compare = reference_dumps(ctx, opts.toolbox)
        notes.append(f"reference pass replaced by dump(s) {', '.join(str(d) for d in dumps)}")
        return dumps, compare
    loaded = ctx.model(dtype=primary.dtype, device=primary.device)
    dumps = []
    for s in compare:
        folder = dump_root / f"sample-{s}"
        if table.reused or not dump_matches(folder, dump_key):  # derived now: derive() left it on disk
            record_reference(loaded.module, ctx.inputs(loaded, sample=s, device=primary.device), folder,
                             chunk_mb=opts.chunk_mb, meta=dump_meta(primary, s, key=dump_key))
        dumps.append(folder)
    return dumps, compare


def _note_truncations(data: dict[str, Any], *, layers: int, max_layers: int, cum_errors: list[dict[str, Any]],
                      errors: list[dict[str, Any]], findings: tuple[int, int]) -> None:
    """What `data` leaves out or could not compare: truncated layer and finding lists, whole-model errors."""
    if layers > max_layers:
        data["layers_truncated"] = f"{layers - max_layers} more layers not listed (max_layers={max_layers})"
    if cum_errors:
        data["cumulative_errors"] = [{"sample": r["sample"], "stage": r.get("stage"), "error": r["error"]} for r in cum_errors]
    if errors:
        data["errors"] = errors[:200]
        data["errors_total"] = len(errors)
    if findings[0] > findings[1]:
        data["findings_truncated"] = findings[0] - findings[1]


def _not_ran_parts(data: Mapping[str, Any]) -> list[str]:
    """The runs besides the layer views the backend did not run (a phase, batch invariance, the weights check:
    `inconclusive`) or ran in part (a phase whose ops its partitioner left to PyTorch: `partial`): each is held
    against a pass."""
    out = [f"phase {name}: {p.get('reason', '')[:300]}" for name, p in (data.get("phases") or {}).items()
           if p.get("status") in ("inconclusive", "partial")]
    for key, what in (("batch_invariance", "batch invariance"), ("weights", "weights check")):
        part = data.get(key) or {}
        if part.get("status") == "inconclusive":
            out.append(f"{what}: {str(part.get('reason', ''))[:300]}")
    return out


def _result(findings: list[Any], data: dict[str, Any], duration: float, *, cum_errors: list[dict[str, Any]],
            layers: list[Any], expected: list[str]) -> ModeResult:
    """A pass means compared: with no finding, a mode that compared only part of the model (a view did not run,
    the backend failed in layers, layers compared in no view) is `inconclusive`, saying "N of M layers compared"
    and why. A layer whose paths differ in one view (stage `paths`) but compared in the other is said, not held
    against the pass."""
    cov = coverage(layers, expected)
    data["coverage"] = cov
    why = []
    if "cumulative" in expected and not cov["views"].get("cumulative"):
        why.append("the cumulative view did not run" + (f" ({cum_errors[0]['error'][:300]})" if cum_errors else ""))
    if "isolated" in expected and not cov["views"].get("isolated"):
        why.append("the isolated view did not run")
    by_key = {l.key: l for l in layers}

    def first_error(keys: list[str], paths: bool) -> str:
        layer = by_key[keys[0]]
        view, err = next((v, e) for v, e in layer.errors.items() if e.startswith(OTHER_VIEW) == paths)
        return f"first {layer.key or '(root)'} ({view} view: {err[:240]})"

    why += _not_ran_parts(data)
    if cov["failed_count"]:
        why.append(f"{cov['failed_count']} layer(s) could not be compared in a view, {first_error(cov['failed'], False)}")
    if cov["missing"] and not why:
        missing = [k for k in cov["missing"] if k in by_key]
        paths = [k for k in missing if any(e.startswith(OTHER_VIEW) for e in by_key[k].errors.values())]
        unran = paths and all(e.startswith("not_ran:") for e in by_key[paths[0]].errors.values())
        why.append(f"{'not run on the backend' if unran else 'not comparable'}, {first_error(paths, True)}" if paths
                   else f"not observed: {', '.join(k or '(root)' for k in missing[:5])}")
    said = []
    if cov["not_comparable_count"] and not why:
        said.append(f"{cov['not_comparable_count']} layer(s) compared in one view only, the other's paths differ "
                    f"or its capture could not hold them: {first_error(cov['not_comparable'], True)}")
    if not why:
        return ModeResult(status="fail" if findings else "pass", findings=findings, data=data, duration_s=duration,
                          reason="; ".join(said) or None)
    reason = f"{coverage_text(cov)}: " + "; ".join(why)  # with findings too: what the findings stand on
    return ModeResult(status="fail" if findings else "inconclusive", findings=findings, reason=reason, data=data,
                      duration_s=duration)
