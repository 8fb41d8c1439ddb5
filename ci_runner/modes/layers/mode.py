"""Mode `layers`: the smallest submodules that fail alone on the target, each with a verified repro.

1. Capture, on the reference (CPU), with hooks on every submodule (`capture.ModuleCapture`), every call:
   a structural pass (`layer_search.scan_model`) records which modules run, how often and whether their
   args/kwargs can be stored and replayed; it keeps no tensor, so it costs about one plain forward. The
   values are captured where they are needed (`layer_search.capture_inputs`): one reference forward per
   search level keeps the args and kwargs of just the modules about to be probed (by reference, or copied
   when the forward later changes one of them in place: the tensors' version counters say so).
2. Search, isolated: a child process loads the model and the backend and walks the module tree top-down
   (`layer_search.search`): the whole model first; if it passes, the mode passes. Each failing module's
   children are compiled and run alone on their captured inputs (a copy of the module goes to the target,
   the CPU model stays the reference; on a CPU target it shares the weights); a passing module's subtree is never
   tried. The whole model's wrapper (`model` beside `lm_head`) is looked through, not compiled alone a second
   time, unless nothing below it fails (`search.wrapped`).
   Each module is journalled (`enter-module`/`leave-module` in the cell's journal) and each outcome appended
   to `layers/probes.jsonl`. When the child aborts, segfaults, overruns `probe_timeout` or is OOM-killed, the
   journal's open entry is the culprit: it is recorded as crashed/timeout and a fresh child goes on
   (`isolate.supervise`).
3. Findings: one `layer_failure` per smallest failing module (a failing module none of whose children fail
   alone), with its class, stage, error, the path from the root and how many times it is called.
4. Repro per finding in `layers/repro/<module>/`: `module.pt2` (torch.export of the submodule),
   `inputs.safetensors` and `repro.py`, which needs torch and the backend's plugin only; run in a subprocess
   and marked verified when it fails the same way. When export fails (or its repro does not reproduce), the
   fallback `repro.py` rebuilds the submodule from the model source (config + qualified name) and loads the
   submodule's own weights from `weights.safetensors`; the finding says so.

Options (`options: {layers: {...}}` in the matrix) are declared in `ci_runner/options.py` (`LayersOptions`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch

from ...backends import backend_ran, plugin_pythonpath
from ...config import spec_to_json
from ...engine.handoff import handoff_path, save_handoff
from .culprit import CulpritResult, CulpritTarget, find_culprits, hints_from_error, ops_cross_check, write_repro
from .groups import IN_PROCESS, cause_families, cause_groups, run_parallel
from .phases import run_phases
from .parallel import run_tp
from ...fsutil import atomic_write_text, read_records
from ...quoting import shell_quote
from ...engine.codec import TensorStore, Unstorable, save_tensors
from ...failures.failure import first_line, tail, unwrap
from ...procs.isolate import Attempt, IsolatedResult, Journal, file_tail, supervise
from ...failures.outcome import UNFINISHED, ProbeOutcome, append_outcome, read_outcomes
from ...procs.limits import HangLimits, dead_item
from ...procs.progress import ProgressWatch
from .search import BOILERPLATE, ROOT, ChildPlan, ModuleTree, SearchResult, StopSearch, capture_inputs, encode_call, label, own_name, scan_model, search, twin_plan, unlabel, write_root_call
from ...options import LayersOptions
from ...registry import FindingKind, parse_options
from ...engine.repro import key_text as _key_text, model_source, plugin_modules as _plugin_modules, render_template, run_command, safe_filename, template_backend, verify_script, write_script
from ...models.tree import module_tensors
from ...results.model import JOURNAL_NAME, Finding, ModeResult, Repro, fingerprint
from ...results.rootcause import annotate

if TYPE_CHECKING:
    from .. import ModeContext

KIND = FindingKind.LAYER_FAILURE
_MIN_CHILD_S = 20.0  # no new probing child is started with less time than this left


# --------------------------------------------------------------------------- isolated search

@dataclass
class SearchRun:
    result: SearchResult
    restarts: int
    children: int
    stop_reason: str | None


def _replay(tree: ModuleTree, known: Mapping[str, ProbeOutcome]) -> SearchResult:
    def probe(name: str) -> ProbeOutcome:
        if name in known:
            return known[name]
        raise StopSearch()

    return search(tree, probe)


def run_search(ctx: "ModeContext", opts: LayersOptions, tree: ModuleTree, layers_dir: Path, *,
               reserve_s: float = 0.0) -> SearchRun:
    """Probe the tree in isolated children (`isolate.supervise`) until the search is complete, the time is out or
    crashes pile up. The children journal each module into the cell's journal; a dead child's open module is
    recorded crashed/timeout and a fresh child replays the known outcomes and goes on."""
    outcomes_file = layers_dir / "probes.jsonl"
    outcomes_file.unlink(missing_ok=True)
    limits_file = layers_dir / "limits.jsonl"  # per probe: the limit its child put on it, and why (`probe_limit`)
    limits_file.unlink(missing_ok=True)
    timeout_file = layers_dir / "child-0.timeout.txt"
    fd2_file = layers_dir / "child-0.fd2.txt"
    journal = ctx.cell_dir / JOURNAL_NAME

    def next_attempt(children: int) -> Attempt | str | None:
        nonlocal timeout_file, fd2_file
        known = read_outcomes(outcomes_file)
        if _replay(tree, known).complete:
            return None
        budget = ctx.remaining() - reserve_s
        if budget < _MIN_CHILD_S:
            return f"the cell's time ran out after {len(known)} module(s) were probed"
        timeout_file = layers_dir / f"child-{children}.timeout.txt"
        timeout_file.unlink(missing_ok=True)
        fd2_file = layers_dir / f"child-{children}.fd2.txt"
        plan = ChildPlan(model=spec_to_json(ctx.cell.model), backend=spec_to_json(ctx.cell.backend),
                         seed=ctx.cell.inputs.seed, dtype=None, layers_dir=str(layers_dir),
                         outcomes_file=str(outcomes_file), timeout_file=str(timeout_file),
                         probe_timeout=opts.probe_timeout, deadline_wall=time.time() + budget - 5.0,
                         all_calls=opts.all_calls, fd2_file=str(fd2_file), limits_file=str(limits_file),
                         limits=_limits(opts).to_json())
        # past probe_timeout a probe is a hang only when it makes no progress (the watch); a busy one runs on to its
        # second limit (the child's own watchdog, `search.probe_limit`), or to the time left
        return Attempt(payload=plan.__dict__, timeout=budget, watch=_probe_watch(opts, journal, fd2_file))

    def drop_empty_timeout_file() -> bool:
        hit = _nonempty(timeout_file)
        if not hit:
            timeout_file.unlink(missing_ok=True)
        return hit

    def crashed_fd2() -> str:
        """What the dead child's last module wrote to fd 2 (a segfault's report lands there too)."""
        text = file_tail(fd2_file, 6000)
        fd2_file.unlink(missing_ok=True)
        return f"\n--- fd 2 while the module ran ---\n{text}" if text.strip() else ""

    def on_ok(res: IsolatedResult) -> str | None:
        drop_empty_timeout_file()
        fd2_file.unlink(missing_ok=True)
        if not (res.value or {}).get("complete", False):
            return "the cell's time ran out during the search"
        return None

    def on_crash(entry: str | None, res: IsolatedResult) -> str | None:
        timed_out = drop_empty_timeout_file() or res.status == "timeout"
        fd2 = crashed_fd2()
        if res.status == "error":  # probe errors are outcomes: this failed outside any module
            return (f"the probing child failed outside any module: {res.error_type}: {first_line(res.message)}"
                    + (f"\n{res.traceback[-2000:]}" if res.traceback else ""))
        if entry is None:
            stop = f"the probing child {res.message or res.status} before it entered a module"
            return stop + (f"; stderr: {res.stderr_tail[-1500:]}" if res.stderr_tail else "")
        stack = (file_tail(timeout_file, 6000) or res.stderr_tail) if timed_out else res.stderr_tail
        limit = read_records(limits_file, dict, lambda r: str(r.get("name"))).get(entry)
        append_outcome(outcomes_file, _dead_child_outcome(unlabel(entry), res, timed_out=timed_out, opts=opts,
                                                          limit=limit, traceback=stack + fd2))
        return None

    run = supervise("ci_runner.modes.layers.search:probe_child", journal=ctx.cell_dir / JOURNAL_NAME, kind="module",
                    next_attempt=next_attempt, on_ok=on_ok, on_crash=on_crash, max_restarts=opts.max_restarts,
                    env={str(k): str(v) for k, v in ctx.cell.backend.env.items()})
    replay = _replay(tree, read_outcomes(outcomes_file))
    if run.stop_reason is not None:
        replay.complete = False
    stop = run.stop_reason
    if stop is not None and stop.startswith("gave up after"):
        stop = f"gave up after {run.restarts} crashed probing children (max_restarts={opts.max_restarts})"
    return SearchRun(result=replay, restarts=run.restarts, children=run.children, stop_reason=stop)


def _limits(opts: LayersOptions) -> HangLimits:
    return HangLimits.of(opts.probe_timeout, opts.hang)


def _probe_watch(opts: LayersOptions, journal: Path, fd2_file: Path) -> ProgressWatch:
    """The parent's watch on a probing child (`procs/limits.py`): the module in flight is the journal's open
    `enter-module` entry written after now; fd 2 counts as its output."""
    return _limits(opts).watch(journal, "module", since=Journal(journal).size(), outputs=(fd2_file,))


def _dead_child_outcome(culprit: str, res: IsolatedResult, *, timed_out: bool, opts: LayersOptions,
                        limit: Mapping[str, Any] | None, traceback: str) -> ProbeOutcome:
    """The outcome of the module a probing child died in (`procs/limits.dead_item`): a hang (no progress past
    probe_timeout, or still busy past the second limit), unfinished (cut short by the cell's time while still making
    progress: not failing, so the search names its failing parent), or crashed."""
    dead = dead_item(res, timed_out=timed_out, limits=_limits(opts), record=limit)
    if dead is not None and dead.verdict == "hung":
        return ProbeOutcome(name=culprit, status="timeout", stage="run", error_type="Timeout", duration_s=dead.seconds,
                            message=f"{label(culprit)} {dead.words}; the probing child was killed",
                            traceback=traceback)
    if dead is not None:
        return ProbeOutcome(name=culprit, status=UNFINISHED, stage="run", duration_s=dead.seconds,
                            message=f"{label(culprit)} {dead.words}")
    sig = res.signal or (f"exit code {res.exit_code}" if res.exit_code is not None else "unknown")
    why = res.message or sig
    if res.signal == "SIGKILL":
        why += " (SIGKILL from outside: often the kernel's out-of-memory killer)"
    return ProbeOutcome(name=culprit, status="crashed", stage="run", error_type=res.signal or "Crash",
                        message=f"the process died while {label(culprit)} ran: {why}",
                        traceback=traceback, signal=res.signal)


def _slow_probes(opts: LayersOptions, probed: list[ProbeOutcome], search_data: dict[str, Any],
                 note: str | None) -> str | None:
    """Slow is a figure, never a finding: `slow` (the probes that ran past probe_timeout making progress, in
    seconds) and `unfinished` (those the cell's time cut short: not failing, the search named their failing parent
    instead) into the search's data; the mode's note, with the unfinished ones added."""
    search_data["slow"] = {label(o.name): round(o.duration_s, 1) for o in probed
                           if o.status in ("pass", "fail", "inconclusive") and o.duration_s > opts.probe_timeout}
    cut = [label(o.name) for o in probed if o.status == UNFINISHED]
    if not cut:
        return note
    search_data["unfinished"] = cut
    return "; ".join(filter(None, [note, f"{len(cut)} probe(s) still compiling when the cell's time ran out (slow, "
                                         f"not hangs; their failing parents are named): {', '.join(cut[:8])}"]))


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


# --------------------------------------------------------------------------- the mode

def run(ctx: "ModeContext") -> ModeResult:
    """The layers mode: the single forward's search, then each phase of `inputs.phases` (modes/layers/phases.py)."""
    opts: LayersOptions = parse_options("layers", ctx.options("layers"))
    layers_dir = ctx.artifact_dir("layers")
    result = _run_forward(ctx, opts, layers_dir)
    if ctx.cell.parallel and result.status != "error":  # tensor parallel: parallel.py
        _tp(ctx, opts, result)
    if not ctx.cell.inputs.phases:
        return result
    t0 = time.monotonic()
    ctx.checkpoint("layers", result.findings, result.data)  # a phase that kills the process keeps the forward's result
    findings, result.data["phases"] = run_phases(ctx, opts, layers_dir)
    result.duration_s += time.monotonic() - t0
    result.data.setdefault("seconds", {})["phases"] = round(time.monotonic() - t0, 2)
    if findings:
        annotate(findings, boilerplate=BOILERPLATE)
        result.findings += findings
        if result.status in ("pass", "inconclusive"):
            result.status = "fail"
    unran = [name for name, row in result.data["phases"].items() if row.get("status") == "inconclusive"]
    if unran and result.status == "pass":  # a phase the backend did not run (all of): the mode is no pass either
        result.status = "inconclusive"
        result.reason = f"the backend did not run (all of) phase(s) {', '.join(unran)}: " + \
            str(result.data["phases"][unran[0]].get("reason", ""))[:300]
    return result


def _tp(ctx: "ModeContext", opts: LayersOptions, result: ModeResult) -> None:
    """The cell's tensor-parallel search (modes/layers/parallel.py): its findings; its summary into `data.parallel`."""
    t0 = time.monotonic()
    found, result.data["parallel"] = run_tp(ctx, opts)
    result.duration_s += time.monotonic() - t0
    if found:
        annotate(found, boilerplate=BOILERPLATE)
        result.findings += found
        if result.status in ("pass", "inconclusive"):
            result.status = "fail"


def _run_forward(ctx: "ModeContext", opts: LayersOptions, layers_dir: Path) -> ModeResult:
    """The single unpadded forward: the smallest failing submodule(s), their repros and culprits."""
    t0 = time.monotonic()
    loaded = ctx.model()
    model = loaded.module
    kwargs = ctx.inputs(loaded, sample=opts.sample)
    try:
        t_cap = time.perf_counter()
        tree = scan_model(model, kwargs, all_calls=opts.all_calls)
        cap_s = time.perf_counter() - t_cap
    except Exception as exc:
        return ModeResult(status="error", reason=f"the model fails on the reference (cpu) before any backend runs: "
                                                  f"{type(exc).__name__}: {first_line(str(exc))}",
                          data={"traceback": traceback.format_exc(limit=8)[-4000:]})
    try:
        write_root_call(layers_dir, tree, kwargs)
    except Unstorable as exc:
        return ModeResult(status="error", reason=f"the model's own inputs cannot be stored for the probing child: "
                                                  f"they include {exc}")
    capture_info = {"modules": len(tree.nodes), "calls": sum(n.calls for n in tree.nodes.values()),
                    "seconds": round(cap_s, 4),
                    "shared": {label(n): node.calls for n, node in tree.nodes.items() if node.calls > 1},
                    "not_replayable": {label(n): node.why_not for n, node in tree.nodes.items() if not node.replayable}}
    reserve = _repro_reserve(opts, ctx.remaining())
    t_search = time.monotonic()
    srun = run_search(ctx, opts, tree, layers_dir, reserve_s=reserve)
    result = srun.result
    data: dict[str, Any] = {
        "seconds": {"model_and_scan": round(t_search - t0, 2), "search": round(time.monotonic() - t_search, 2)},
        "capture": capture_info,
        "search": {"complete": result.complete,
                   "probed": sum(1 for o in result.outcomes.values() if o.status != "skipped" and not o.inferred_from),
                   "inferred": sum(1 for o in result.outcomes.values() if o.inferred_from),
                   "children": srun.children, "restarts": srun.restarts, "stop_reason": srun.stop_reason},
        "candidates": [_candidate_row(tree, o) for o in result.outcomes.values()],
    }
    probed = [o for o in read_outcomes(layers_dir / "probes.jsonl").values() if o.status != "skipped"]
    data["backend_ran"] = backend_ran([{"status": o.status, "ran": o.ran} for o in probed],
                                      compiles=ctx.cell.backend.compile is not None)
    unran = [label(o.name) for o in probed if o.status == "inconclusive"]
    note = (f"{len(unran)} module probe(s) the backend never ran (inconclusive, not passed): "
            f"{', '.join(unran[:8])}{f' … and {len(unran) - 8} more' if len(unran) > 8 else ''}") if unran else None
    note = _slow_probes(opts, probed, data["search"], note)
    whole = result.whole_model
    if whole is not None and whole.status == UNFINISHED:
        return ModeResult(status="timeout", reason=f"{whole.message}; raise the cell's timeout", data=data,
                          duration_s=time.monotonic() - t0)
    if whole is None:
        status = "timeout" if srun.stop_reason and "time ran out" in srun.stop_reason else "error"
        return ModeResult(status=status, reason=srun.stop_reason or "the whole model was not probed", data=data,
                          duration_s=time.monotonic() - t0)
    data["whole_model"] = _candidate_row(tree, whole)
    if not whole.failed:  # ops the partitioner left to PyTorch: the modules calling them did not run on it
        partial = bool(unran or (whole.ran or {}).get("eager_ops"))
        return ModeResult(status="inconclusive" if partial else "pass", reason=_with_eager_ops(note, whole.ran),
                          data=data, duration_s=time.monotonic() - t0)

    known = read_outcomes(layers_dir / "probes.jsonl")  # with the own-code probes (`own_name`)
    _, twin_of = twin_plan(tree, result.minimal, result.outcomes)  # a twin's own code is its first's
    findings = [_finding(ctx, tree, result, name, all_calls=opts.all_calls,
                         own=known.get(own_name(twin_of.get(name, name)))) for name in result.minimal]
    if result.minimal and (opts.repro or opts.culprit):
        t_cap = time.perf_counter()
        captured = capture_inputs(model, (), kwargs, result.minimal)
        data["seconds"]["capture"] = round(time.perf_counter() - t_cap, 2)
        _explain(ctx, opts, loaded, tree, result, findings, captured, layers_dir, data)
    annotate(findings, boilerplate=BOILERPLATE)  # details.signature: the root-cause group (rootcause.py)
    data["minimal"] = [label(n) for n in result.minimal]
    reason = None
    if not result.complete:
        reason = f"search incomplete: {srun.stop_reason}; the modules named may not be the smallest failing ones"
    reason = "; ".join(filter(None, [reason, note])) or None
    return ModeResult(status="fail", findings=findings, reason=reason, data=data, duration_s=time.monotonic() - t0)


def _explain(ctx: "ModeContext", opts: LayersOptions, loaded: Any, tree: ModuleTree, result: SearchResult,
             findings: list[Finding], captured: Mapping[str, list[Any]], layers_dir: Path,
             data: dict[str, Any]) -> None:
    """Repros and culprits, once per cause group (`groups.py`); every finding names its group."""
    group_of = cause_groups(tree, result, captured)
    leaders = [n for n in result.minimal if group_of[n] == n]
    data["groups"] = {label(lead): [label(n) for n in result.minimal if group_of[n] == lead] for lead in leaders}
    by_name = dict(zip(result.minimal, findings))
    for name, finding in by_name.items():
        finding.details["cause_group"] = {"first": label(group_of[name]), "size": len(data["groups"][label(group_of[name])])}
    seconds = data.setdefault("seconds", {})

    def repros() -> None:
        def one(name: str) -> Repro:
            try:
                return _repro_for(ctx, opts, loaded, tree, name, result.outcomes[name], captured.get(name, []), layers_dir)
            except Exception as exc:  # a repro problem must not lose the finding
                return Repro(path=str((layers_dir / "repro").relative_to(ctx.cell_dir)), verified=False,
                             note=f"repro generation failed: {type(exc).__name__}: {first_line(str(exc))}")

        t0 = time.monotonic()
        made = dict(zip(leaders, run_parallel(one, leaders, opts.verify_workers)))
        for name, finding in by_name.items():
            finding.repro = made[group_of[name]] if group_of[name] == name else _shared_repro(
                made[group_of[name]], group_of[name])
        seconds["repros"] = round(time.monotonic() - t0, 2)

    def culprits() -> None:
        t0 = time.monotonic()
        try:
            _attach_culprits(ctx, opts, tree, result, by_name, group_of, layers_dir,
                             handoff=lambda name, out_dir: _handoff(loaded, name, captured, out_dir))
        except Exception as exc:  # a culprit problem must not lose the findings
            for finding in findings:
                finding.details.setdefault("culprit", {"found": False, "kind": "error",
                                                       "note": f"{type(exc).__name__}: {first_line(str(exc))}"})
        seconds["culprits"] = round(time.monotonic() - t0, 2)

    # the layer repros (export, verification) and the culprit search (its own child) at once: each mostly waits
    # on a process of its own
    run_parallel(lambda job: job(), [job for job, on in ((repros, opts.repro), (culprits, opts.culprit)) if on], 2)


def _shared_repro(repro: Repro, first: str) -> Repro:
    return Repro(path=repro.path, verified=repro.verified, command=repro.command,
                 note=f"shared with {label(first)} (same module class, cause and input signature: one repro per group, "
                      f"verified once); {repro.note or ''}".rstrip("; "))


def _repro_reserve(opts: LayersOptions, remaining: float) -> float:
    if not opts.repro:
        return 0.0
    return min(remaining * 0.25, 120.0)


def _candidate_row(tree: ModuleTree, o: ProbeOutcome) -> dict[str, Any]:
    node = tree.nodes.get(o.name)
    row: dict[str, Any] = {"module": label(o.name), "module_class": node.module_class if node else None,
                           "status": o.status, "duration_s": round(o.duration_s, 3)}
    if o.failed:
        row.update(stage=o.stage, error_type=o.error_type, message=first_line(o.message))
        if o.executing:
            row["executing"] = label(o.executing)
    elif o.status in ("skipped", "inconclusive"):
        row["message"] = o.message
    if o.ran:
        row["ran"] = dict(o.ran)
    if o.inferred_from is not None:
        row["inferred_from"] = label(o.inferred_from)
    return row


def _children_words(n: int) -> str:
    return f"{n} child module" + ("" if n == 1 else "s")


def own_code_words(name: str, o: ProbeOutcome, children: list[str], tried: Mapping[str, str],
                   own: ProbeOutcome | None) -> tuple[str, str | None]:
    """What is shown about a smallest failing module that has child modules: (words to append, verdict).

    verdict: "own_code" (shown: it fails with its child modules run eagerly, or an eager device was running the
    module itself, outside any child, when it raised), "needs_children" (shown: its own code passes with the
    child modules run eagerly, and each child module passes alone), "open" (not shown either way) or None."""
    if not children or o.status != "fail":
        return "", None
    all_pass = len(tried) == len(children) and all(st == "pass" for st in tried.values())
    if o.executing == name or (own is not None and own.failed):
        how = ("it was running its own code, outside its child modules, when it failed" if o.executing == name
               else f"with its {_children_words(len(children))} run eagerly it still fails")
        return f" (it fails in its own code: {how})", "own_code"
    if not all_pass:
        return "", None
    if own is not None and own.status == "pass":
        return (f" (each of its {_children_words(len(children))} passes alone and its own code passes with them "
                f"run eagerly: the failure needs them together)"), "needs_children"
    return (f" (each of its {_children_words(len(children))} passes alone; not shown whether it fails in its own "
            f"code or needs them together)"), "open"


def _with_eager_ops(note: str | None, ran: Mapping[str, Any]) -> str | None:
    """Where the backend ran only part of the model: what ran in PyTorch eager instead, and in which modules (the
    vendor watch's `eager_sites`): those modules are not shown to run on the backend (inconclusive, not a pass)."""
    eager = [str(op) for op in ran.get("eager_ops") or ()]
    if not eager:
        return note
    sites = ran.get("eager_sites") or {}
    ops = [f"{op} (in {', '.join(str(m) for m in sites[op][:3])})" if sites.get(op) else op for op in eager[:12]]
    words = (f"the backend ran only part of the model: {len(eager)} op(s) ran in PyTorch eager "
             f"(its partitioner left them out), so the modules calling them are not shown to run on it: "
             f"{', '.join(ops)}{' …' if len(eager) > 12 else ''}")
    return f"{note}; {words}" if note else words


def _finding(ctx: "ModeContext", tree: ModuleTree, result: SearchResult, name: str, *, all_calls: bool,
             own: ProbeOutcome | None = None) -> Finding:
    o = result.outcomes[name]
    node = tree.nodes[name]
    children = tree.children(name)
    tried_children = {c: result.outcomes[c].status for c in children if c in result.outcomes}
    where = "the whole model" if name == ROOT else label(name)
    if o.status == "crashed":
        what = f"the process died ({o.error_type}) while {where} ran alone"
    elif o.status == "timeout":
        what = f"{where} hung: no result within the probe timeout"
    else:
        what = f"{where} fails alone at {o.stage}: {o.error_type}: {first_line(o.message, 240)}"
    words, verdict = own_code_words(name, o, children, tried_children, own)
    what += words
    if o.diagnostics:  # the compiler's own words (IREE's "failed to legalize …" from fd 2)
        what += "\ncompiler: " + "\ncompiler: ".join(o.diagnostics)
    details: dict[str, Any] = {
        "status": o.status,
        "path": [label(p) for p in tree.path(name)],
        "calls": node.calls,
        "call_index": max(0, o.calls_tried - 1) if o.status == "fail" else 0,
        "children": {label(c): s for c, s in tried_children.items()},
        "message_full": o.message[:4000],
        "traceback_tail": tail(o.traceback, 3000, keep_head=o.status == "timeout"),
        "compiler_diagnostics": list(o.diagnostics),
        "backend_ran": dict(o.ran),
    }
    if verdict is not None:
        details["own_code"] = verdict
    if own is not None and own.failed:
        details["own_code_error"] = f"{own.error_type}: {first_line(own.message, 240)}"
    if o.signal:
        details["signal"] = o.signal
    if o.executing:
        details["executing"] = label(o.executing)
    if node.calls > 1:
        details["note"] = (f"called {node.calls} times per forward; probed on "
                           + ("every call's inputs" if all_calls else "its first call's inputs"))
    return Finding(kind=KIND, stage=o.stage or "run", message=what,
                   fingerprint=fingerprint(KIND, ctx.cell.backend.id, ctx.cell.model.id, label(name)),
                   module=label(name), module_class=node.module_class, error_type=o.error_type, details=details)


# --------------------------------------------------------------------------- repros

def _repro_context(ctx: "ModeContext", name: str, node_class: str, o: ProbeOutcome, call: dict[str, Any]) -> dict[str, Any]:
    spec = ctx.cell.backend
    versions = {str(k): str(v) for k, v in (ctx.env.get("backend") or {}).items() if k != "torch"}
    return {
        "module": label(name), "qualified_name": name, "module_class": node_class,
        "model_id": ctx.cell.model.id, "model_source": ctx.cell.model.source, "backend_id": spec.id,
        "stage": o.stage or "run", "error_type": o.error_type or "", "message": first_line(o.message, 200),
        "status": o.status, "torch_version": torch.__version__, "versions": versions,
        "backend": template_backend(spec), "call": call,
        "pythonpath": tuple(plugin_pythonpath(_plugin_modules(spec))),  # what the printed command puts on PYTHONPATH
    }


def _repro_for(ctx: "ModeContext", opts: LayersOptions, loaded: Any, tree: ModuleTree, name: str, o: ProbeOutcome,
               calls: list[tuple[tuple[Any, ...], dict[str, Any]]], layers_dir: Path) -> Repro:
    rdir = layers_dir / "repro" / safe_filename(label(name))
    rdir.mkdir(parents=True, exist_ok=True)
    rel = rdir.relative_to(ctx.cell_dir)
    node = tree.nodes[name]
    if not calls:
        raise RuntimeError(f"{label(name)} did not run in the reference forward")
    args, kwargs = calls[0]
    store = TensorStore()
    call = encode_call(args, kwargs, store)
    store.save(rdir / "inputs.safetensors")
    sub = loaded.module if name == ROOT else loaded.module.get_submodule(name)
    rctx = _repro_context(ctx, name, node.module_class, o, call)
    rctx["run_it"] = run_command("repro.py", rdir, rctx["pythonpath"])
    notes: list[str] = []

    pt2_ok = False
    ver = None
    if opts.export:
        try:
            with IN_PROCESS, torch.no_grad(), _quiet_torch_logs():
                ep = torch.export.export(sub, args, kwargs, strict=False)
            tmp = rdir / ".module.tmp.pt2"
            torch.export.save(ep, str(tmp))
            os.replace(tmp, rdir / "module.pt2")
            pt2_ok = True
        except Exception as exc:
            inner = unwrap(exc)
            notes.append(f"torch.export failed ({type(inner).__name__}: {first_line(str(inner), 200)})")
    else:
        notes.append("export disabled (options.layers.export: false)")

    script = rdir / "repro.py"
    if pt2_ok:
        write_script(script, render_template("repro_layer.py.j2", **rctx))
        ver = _verify(ctx, opts, script, o)
        if ver is None or ver.verified:
            return _repro(rel, rctx, ver, notes + ["exported submodule (module.pt2): needs no model source"])
        notes.append(f"the exported-module repro did not reproduce it ({ver.note})")
        os.replace(script, rdir / "repro_pt2.py")

    with IN_PROCESS:
        source = _write_source_repro(ctx, loaded, sub, name, rdir, rctx)
    if source is None:
        if pt2_ok:
            os.replace(rdir / "repro_pt2.py", script)
            return _repro(rel, rctx, ver, notes + ["no model-source fallback for this model source"])
        atomic_write_text(rdir / "README.txt", "No repro: " + "; ".join(notes) + "\n")
        return Repro(path=str(rel / "README.txt"), verified=False, note="; ".join(notes + ["no model-source fallback"]))
    ver2 = _verify(ctx, opts, script, o)
    notes.append(f"fallback: repro.py rebuilds the submodule from the model source ({ctx.cell.model.source}) "
                 f"by its qualified name and loads its weights from weights.safetensors")
    return _repro(rel, rctx, ver2, notes)


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs whole graphs as warnings when it fails; the finding's note says what matters."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _repro(rel: Path, rctx: Mapping[str, Any], ver: Any, notes: list[str]) -> Repro:
    note = "; ".join(notes + ([ver.note] if ver is not None else ["not verified (options.layers.verify: false)"]))
    return Repro(path=str(rel / "repro.py"), verified=bool(ver and ver.verified),
                 command=f"cd {shell_quote(rel)} && {rctx['run_it']}", note=note)


def _verify(ctx: "ModeContext", opts: LayersOptions, script: Path, o: ProbeOutcome) -> Any:
    if not opts.verify:
        return None
    spec = ctx.cell.backend
    env = {str(k): str(v) for k, v in spec.env.items()}
    paths = plugin_pythonpath(_plugin_modules(spec))
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    hard = o.status in ("crashed", "timeout")
    timeout = opts.verify_timeout
    if o.status == "timeout":  # startup plus the probe's own limit: longer than that counts as the hang
        timeout = min(timeout, opts.probe_timeout + 30.0)
    timeout = max(5.0, min(timeout, ctx.remaining() - 5.0))
    if hard:  # a hang reproduces only as a hang (stuck past the limit), a hard fault only as death by signal
        return verify_script(script, expect_text=[], timeout=timeout, env=env,
                             expect_signal=o.status == "crashed", expect_hang=o.status == "timeout")
    return verify_script(script, expect_text=_key_text(o.message), expect_error_type=o.error_type,
                         expect_message=o.message, timeout=timeout, env=env)


def _write_source_repro(ctx: "ModeContext", loaded: Any, sub: torch.nn.Module, name: str, rdir: Path,
                        rctx: dict[str, Any]) -> Path | None:
    """The fallback: rebuild the submodule from the model's source, load its own weights, replay the call."""
    source = model_source(ctx.cell.model, ctx.cell.inputs.seed, loaded, rdir)
    if source is None:
        return None
    save_tensors(module_tensors(sub), rdir / "weights.safetensors", copy=True)
    script = rdir / "repro.py"
    write_script(script, render_template("repro_layer_source.py.j2", **rctx, source=source))
    return script


# --------------------------------------------------------------------------- the culprit inside a finding

def _handoff(loaded: Any, name: str, captured: Mapping[str, list[Any]], out_dir: Path) -> str | None:
    """The culprit child gets the submodule and its call from a file (`engine.handoff`), not by rebuilding the
    model: the file written, or None (the child builds the model for it)."""
    if name == ROOT or not captured.get(name):
        return None
    sub = loaded.module.get_submodule(name)
    path = handoff_path(sub, out_dir)
    try:
        with IN_PROCESS:
            return save_handoff(sub, path, captured[name][0])["file"]
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _find_culprits(ctx: "ModeContext", opts: LayersOptions, layers_dir: Path, targets: list[CulpritTarget],
                   budget: float, handoff: Callable[[str, Path], str | None] | None) -> list[CulpritResult]:
    """`culprit.find_culprits` for one wave of targets, each handed over first when it can be; the handoff files
    are the child's input only, not artifacts: removed once it is done."""
    for i, t in enumerate(targets if handoff is not None else ()):
        try:
            targets[i] = replace(t, handoff=handoff(t.module, Path(t.out_dir)))
        except Exception:  # unstorable inputs, no room: the child builds the model instead
            pass
    try:
        return find_culprits(model=spec_to_json(ctx.cell.model), backend=spec_to_json(ctx.cell.backend),
                             seed=ctx.cell.inputs.seed, layers_dir=layers_dir, targets=targets,
                             journal=ctx.cell_dir / JOURNAL_NAME, limits=_limits(opts),
                             startup_timeout=opts.startup_timeout, budget_s=budget, max_restarts=opts.max_restarts,
                             env={str(k): str(v) for k, v in ctx.cell.backend.env.items()})
    finally:
        for t in targets:
            if t.handoff:
                Path(t.handoff).unlink(missing_ok=True)


def _attach_culprits(ctx: "ModeContext", opts: LayersOptions, tree: ModuleTree, result: SearchResult,
                     by_name: Mapping[str, Finding], group_of: Mapping[str, str], layers_dir: Path,
                     handoff: Callable[[str, Path], str | None] | None = None) -> None:
    """Search one failing submodule's graph per cause group for the op(s) that fail (`culprit.find_culprits`: one
    child for all of them; groups that differ from an earlier one in their inputs only probe its culprit op first),
    write and verify their repros (at once, up to `verify_workers`), and put each answer in
    `finding.details["culprit"]`; the other members of a group carry their first's answer (`shared_with`)."""
    leaders = [n for n in by_name if group_of[n] == n]
    budget = min(opts.culprit_budget, (ctx.remaining() - 10.0) / len(leaders))
    if budget < 30.0:
        for finding in by_name.values():
            finding.details["culprit"] = {"found": False, "kind": "skipped",
                                          "note": "no time left for the culprit search"}
        return
    family = cause_families(tree, result, leaders)
    answers: dict[str, CulpritResult] = {}
    for wave in ([n for n in leaders if family[n] == n], [n for n in leaders if family[n] != n]):
        if not wave:
            continue
        targets = [CulpritTarget(module=name, out_dir=str(layers_dir / "repro" / safe_filename(label(name)) / "culprit"),
                                 hints=_culprit_hints(result, name, answers.get(family[name])))
                   for name in wave]
        answers.update(zip(wave, _find_culprits(ctx, opts, layers_dir, targets, budget, handoff)))

    def attach(name: str) -> None:
        try:
            _attach_culprit(ctx, opts, tree, name, result.outcomes[name], by_name[name], answers[name])
        except Exception as exc:  # a culprit problem must not lose the finding
            by_name[name].details["culprit"] = {"found": False, "kind": "error",
                                                "note": f"{type(exc).__name__}: {first_line(str(exc))}"}

    run_parallel(attach, leaders, opts.verify_workers)
    for name, finding in by_name.items():
        if group_of[name] != name:
            shared = dict(by_name[group_of[name]].details.get("culprit") or {})
            shared["shared_with"] = label(group_of[name])
            finding.details["culprit"] = shared


def _culprit_hints(result: SearchResult, name: str, earlier: CulpritResult | None) -> list[str]:
    o = result.outcomes[name]
    hints = hints_from_error(o.message, o.traceback)
    if earlier is not None and earlier.found:
        hints = list(dict.fromkeys(list(earlier.ops) + hints))
    return hints


def _attach_culprit(ctx: "ModeContext", opts: LayersOptions, tree: ModuleTree, name: str, o: ProbeOutcome,
                    finding: Finding, result: CulpritResult) -> None:
    """Write and verify the culprit's repro and put the answer in `finding.details["culprit"]`."""
    details = result.to_details()
    if result.found:
        def verify(script: Path, r: CulpritResult) -> Any:
            probe = ProbeOutcome(name=name, status=r.status or "fail", stage=r.stage, error_type=r.error_type,
                                 message=r.message)
            return _verify(ctx, opts, script, probe)

        rctx = _repro_context(ctx, name, tree.nodes[name].module_class, o, {})
        t_repro = time.monotonic()
        repro = write_repro(result, context=rctx, verify=verify)
        details["repro_seconds"] = round(time.monotonic() - t_repro, 3)
        repro["path"] = str(Path(repro["path"]).relative_to(ctx.cell_dir))
        repro["command"] = f"cd {shell_quote(Path(repro['path']).parent)} && {repro['command']}"
        details["repro"] = repro
        previous_ops = ctx.previous.get("ops")
        if previous_ops is not None:
            seen = ops_cross_check(previous_ops.data.get("probes") or [], result.ops)
            if seen:
                details["ops_mode"] = seen
                if any(v == "pass" for v in seen.values()):
                    details["ops_mode_note"] = ("the ops mode passed this op with synthetic inputs: the failure "
                                                "depends on the real shapes or values")
    finding.details["culprit"] = details
