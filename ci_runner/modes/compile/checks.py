"""The figures of one phase (`PhaseSignals.row`: `data.phases.<phase>`) and the checks users make of them.

Finding kinds (`registry.py`), each with its repro (`repro.py`):
- `graph_break`: one per user source line Dynamo broke the graph at (its `module` field; the module whose forward
  holds it in `details.module`, its class in `module_class`): one issue per source line and backend;
- `eager_fallback`: an op the backend's partitioner left to PyTorch eager (OpenVINO), or a partition it ran in
  eager after it failed at run time;
- `compile_after_warmup`: a call after the phase's warm-up (`warmup_calls`) that compiled again, with the guard
  that failed and the input that changed (automatic dynamic shapes' one recompile per function is expected);
- `length_sweep_graphs`: a `long` phase whose later lengths compiled more than `sweep_graphs_per_frame` graph(s)
  per compiled frame (one graph per length under `dynamic: false`);
- `recompile_limit`: calls that ran in eager because Dynamo hit its recompile limit (never a pass);
- `graph_count`: a phase with more graphs than `max_graphs`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...backends.ran import CompileRecord
from ...watch.watchedrun import WatchedRun
from ...workloads.calls import Call
from ...options import CompileOptions
from ...workloads.phases import Phase
from ...results.model import Finding, fingerprint
from ...watch.dynamotrace import Event, changed_input, short_path

if TYPE_CHECKING:
    from .. import ModeContext

__all__ = ["PhaseSignals", "findings_for", "module_at", "warmup_of", "expected_recompiles", "warmup_findings"]


@dataclass
class PhaseSignals:
    """What one phase compiled and ran (`mode.measure`)."""

    name: str
    label: str
    phase: Phase | None
    calls: list[Call] = field(default_factory=list)
    per_call: list[dict[str, Any]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    record: CompileRecord | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    fallback_reason: str | None = None  # the backend's words for why work ran elsewhere (`WatchedRun`)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    error: str | None = None
    failed_call: str | None = None
    seconds: float = 0.0
    by: str = "compile"  # the mode whose compiled run the signals were read from
    seen: set[str] = field(default_factory=set)  # the kinds of structured-trace record this torch gave
    trace: dict[str, Any] | None = None  # the structured trace kept for tlparse (`mode.keep_trace`)

    def take(self, run: WatchedRun) -> None:
        """The figures of a watched run (the mode's own, or another mode's in this process)."""
        self.calls, self.per_call, self.events, self.record = run.calls, run.per_call, run.events, run.record
        self.facts, self.counters, self.error, self.failed_call = run.facts, run.counters, run.error, run.failed_call
        self.seconds, self.by, self.seen = run.seconds, run.by, run.seen
        self.fallback_reason = run.fallback_reason

    def unknown(self) -> dict[str, str]:
        """Figures this torch's structured trace did not give although Dynamo did the thing (its counters or its
        compiles say so): unknown (None in `data.phases`, with the reason), never 0."""
        out: dict[str, str] = {}
        compiled = (len(self.record.graphs) if self.record is not None else 0) > 0 or \
            self.counters.get("frames", {}).get("total", 0) > 0
        metrics = any(e.kind in ("compile", "limit") for e in self.events)
        if compiled and not metrics:
            out["compile_s"] = out["eager_after_limit"] = "this torch's structured trace gave no compilation_metrics"
        breaks = sum(self.counters.get("graph_break", {}).values())
        if breaks and not self.of("graph_break"):
            out["graph_breaks"] = f"Dynamo counted {breaks} graph break(s); this torch's structured trace gave no " \
                                  f"dynamo_graph_break_reason"
        recompiled = any(e.kind == "compile" and not e.frame.endswith("/0") for e in self.events)
        if not self.of("recompile") and "recompile_reasons" not in self.seen and (recompiled or (compiled and not metrics)):
            out["recompiles"] = "this torch's structured trace gave no recompile_reasons"
        return out

    def of(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]

    def breaks(self) -> list[Event]:
        """Distinct graph breaks, one per user source line (a recompile traces the same break again; Dynamo's
        second attempt at a frame reports it again as "Failed to handle graph break gracefully…")."""
        seen: dict[str, Event] = {}
        for e in self.of("graph_break"):
            seen.setdefault(e.source, e)
        return list(seen.values())

    def break_reasons(self, source: str) -> list[str]:
        return list(dict.fromkeys(e.reason for e in self.of("graph_break") if e.source == source))

    def eager_fallbacks(self) -> list[str]:
        out = [f"op {op}" for op in self.facts.get("eager_ops") or ()]
        if self.facts.get("perm_fallback"):
            out.append(f"{self.facts['perm_fallback']} partition(s) fell back to PyTorch eager at run time")
        return out

    def eager_calls(self) -> list[str]:
        """Calls from the recompile-limit hit on that executed fewer compiled graphs than the calls before it."""
        hit = {e.call for e in self.of("limit")}
        if not hit:
            return []
        first = next(i for i, c in enumerate(self.per_call) if c["call"] in hit)
        expected = max([c["ran"] for c in self.per_call[:first]] or [1])
        return [c["call"] for c in self.per_call[first:] if c["ran"] < expected or c["call"] in hit]

    def row(self) -> dict[str, Any]:
        """`data.phases.<phase>`."""
        graphs = len(self.record.graphs) if self.record is not None else 0
        unknown = self.unknown()
        row: dict[str, Any] = {
            "status": "error" if self.error else "pass", "phase": self.label, "calls": len(self.per_call),
            "graphs": graphs,
            "graph_breaks": [{"reason": e.reason, "source": e.source, "call": e.call,
                              **({"at": e.at} if e.at and e.at != e.source else {}),
                              **({"also": self.break_reasons(e.source)[1:4]} if len(self.break_reasons(e.source)) > 1
                                 else {})} for e in self.breaks()],
            "recompiles": [{"reason": e.reason, "source": e.source, "changed": changed_input(e.reason),
                            "dynamic": e.dynamic, "symbolic": e.symbolic[:8], "call": e.call}
                           for e in self.of("recompile")],
            "compile_s": round(sum(e.seconds for e in self.events), 3),
            "eager_fallbacks": self.eager_fallbacks(),
            "eager_after_limit": bool(self.of("limit")),
            "per_call": self.per_call, "seconds": round(self.seconds, 3), "run_by": self.by,
        }
        for key in unknown:
            row[key] = None
        if unknown:
            row["unknown"] = unknown
        if row["eager_after_limit"]:
            row["eager_calls"] = self.eager_calls()
            row["recompile_limit"] = self.of("limit")[0].detail
        if self.counters.get("frames"):
            frames = self.counters["frames"]
            row["frames"] = {"total": frames.get("total", 0), "ok": frames.get("ok", 0)}
        if self.error:
            row.update(error=self.error[:500], failed_call=self.failed_call)
        if self.trace:
            row["trace"] = self.trace
        return row


def module_at(root: Any, stack: list[tuple[str, int, str]]) -> tuple[str | None, str | None]:
    """(module name, class) of the innermost module whose `forward` holds a frame of the user `stack`."""
    spans: dict[type, tuple[str, str, int, int]] = {}
    for name, mod in root.named_modules():
        cls = type(mod)
        if cls in spans:
            continue
        try:
            lines, start = inspect.getsourcelines(cls.forward)
            spans[cls] = (name, inspect.getsourcefile(cls.forward) or "", start, start + len(lines))
        except (OSError, TypeError):
            continue
    for file, line, _fn in reversed(stack):
        for cls, (name, src, start, end) in spans.items():
            if src == file and start <= line < end:
                return name or "(model)", cls.__name__
    return None, None


def findings_for(ctx: "ModeContext", opts: CompileOptions, loaded: Any, signals: list[PhaseSignals]) -> list[Finding]:
    """Every check over every phase; a graph break or fallback seen in several phases is one finding."""
    backend = ctx.cell.backend.id
    out: dict[str, Finding] = {}
    for sig in signals:
        for f in (_graph_breaks(backend, loaded, sig) if opts.graph_breaks else []) + _fallbacks(backend, sig) + \
                warmup_findings(backend, opts, sig) + _sweep(backend, opts, sig) + _limit(backend, sig) + \
                _count(backend, opts, sig):
            if f.fingerprint in out:
                out[f.fingerprint].details.setdefault("phases", []).append(sig.name)
            else:
                f.details.setdefault("phases", [sig.name])
                out[f.fingerprint] = f
    return list(out.values())


def _phase(sig: PhaseSignals) -> str | None:
    return sig.phase.name if sig.phase is not None else None


def _graph_breaks(backend: str, loaded: Any, sig: PhaseSignals) -> list[Finding]:
    out = []
    for e in sig.breaks():
        name, cls = module_at(loaded.module, e.stack)
        out.append(Finding(kind="graph_break", stage="trace", module=e.source, module_class=cls,
                           message=f"graph break at {e.source} (in {cls or 'code outside any module forward'}): "
                                   f"{e.reason}"[:2000], phase=_phase(sig),
                           details={"source": e.source, "reason": e.reason, "call": e.call, "detail": e.detail,
                                    "module": name, "at": e.at, "reasons": sig.break_reasons(e.source)[:5],
                                    "stack": [f"{short_path(f)}:{n} in {fn}" for f, n, fn in e.stack][-6:]},
                           fingerprint=fingerprint("graph_break", backend, e.source)))
    return out


def _fallbacks(backend: str, sig: PhaseSignals) -> list[Finding]:
    out = []
    sites = sig.facts.get("eager_sites") or {}
    sizes = set(sig.facts.get("eager_size_ops") or ())
    for op in sig.facts.get("eager_ops") or ():
        where = list(sites.get(op) or [])
        what = (" (size arithmetic: it computes a dynamic shape's size on the host, not a tensor)"
                ) if op in sizes else " (that part of the model never ran on the backend)"
        out.append(Finding(kind="eager_fallback", stage="compile", op=str(op), phase=_phase(sig),
                           module=where[0] if where else None,
                           message=f"{op} ran in PyTorch eager: {backend}'s partitioner left it outside its "
                                   f"partitions{what}",
                           details={"partitions": sig.facts.get("openvino_partitions"), "modules": where[:10],
                                    **({"size_arithmetic": True} if op in sizes else {})},
                           fingerprint=fingerprint("eager_fallback", backend, str(op))))
    if sig.facts.get("perm_fallback"):
        out.append(Finding(kind="eager_fallback", stage="run", op="(partition)", phase=_phase(sig),
                           message=f"{sig.facts['perm_fallback']} partition(s) failed at run time and ran in PyTorch "
                                   f"eager from then on",
                           # `cause`: what tells two run-time fallbacks apart (root causes key on it)
                           details={**sig.facts, **({"cause": sig.fallback_reason} if sig.fallback_reason else {})},
                           fingerprint=fingerprint("eager_fallback", backend, "(partition)")))
    return out


def warmup_of(opts: CompileOptions, sig: PhaseSignals) -> int:
    """The phase's warm-up calls: `warmup_calls`, or auto: the first call, plus decode step 1 in a prefill/decode
    phase (Dynamo specialises a size of 1, so the prefill's graph never serves the one-token calls)."""
    if opts.warmup_calls is not None:
        return opts.warmup_calls
    return 2 if sig.phase is not None and sig.phase.name in ("prefill", "decode") else 1


def expected_recompiles(opts: CompileOptions, sig: PhaseSignals, late: set[str]) -> set[int]:
    """Indexes (in `sig.events`) of the recompiles after the warm-up that automatic dynamic shapes makes by design:
    per compiled function (Dynamo's frame id, and the cache entry whose size changed: a shared decorator's frame
    holds one entry per decorated forward), its first recompile that made the changed size symbolic, unless the
    backend then failed on that call."""
    if not opts.dynamic_recompile_expected:
        return set()
    out: set[int] = set()
    settled: set[tuple[str, ...]] = set()  # functions whose dynamic shapes settled (a dynamic recompile seen)
    for i, e in enumerate(sig.events):
        if e.kind != "recompile":
            continue
        key = _function_of(e)
        if e.dynamic and key not in settled and e.call in late and e.call != sig.failed_call:
            out.add(i)
        if e.dynamic:
            settled.add(key)
    return out


def _function_of(e: Event) -> tuple[str, ...]:
    """What a recompile re-specialised: its frame id and the cache entries that failed on a size."""
    return (e.frame.split("/", 1)[0], *sorted(e.resized))


def warmup_findings(backend: str, opts: CompileOptions, sig: PhaseSignals) -> list[Finding]:
    """Calls after the warm-up that compiled (not the long phase: its lengths are the sweep check), but for
    automatic dynamic shapes' expected recompile (`expected_recompiles`)."""
    if sig.phase is not None and sig.phase.name == "long":
        return []
    warm = warmup_of(opts, sig)
    after = {c["call"] for c in sig.per_call[warm:] if c["graphs"] > 0}
    late = after | ({sig.failed_call} if sig.failed_call else set())  # a recompile the backend failed on: always
    expected = expected_recompiles(opts, sig, late)
    out: dict[str, Finding] = {}
    for i, e in enumerate(sig.events):
        if e.kind != "recompile" or e.call not in late or i in expected:
            continue
        changed = changed_input(e.reason) or "?"
        fp = fingerprint("compile_after_warmup", backend, sig.name, e.source, changed)
        failed = e.call == sig.failed_call
        settled = any(x.kind == "recompile" and x.dynamic and _function_of(x) == _function_of(e) for x in sig.events[:i])
        again = " (its dynamic shapes had settled)" if settled else ""
        out.setdefault(fp, Finding(
            kind="compile_after_warmup", stage="compile", module=e.source or sig.name, phase=_phase(sig),
            message=f"{sig.name}: {e.call} compiled again"
                    f"{f' after the warm-up ({warm} call(s))' if e.call in after else ''}{again}"
                    f"{' into a dynamic graph (symbolic: ' + ', '.join(e.symbolic[:3]) + ')' if e.dynamic else ''}: "
                    f"{changed} changed: {e.source}: {e.reason}"
                    + (f"; the backend then failed on that call ({(sig.error or '')[:200]}): the layers mode's "
                       f"`{sig.name}` phase finding names the failing module" if failed else ""),
            details={"call": e.call, "reason": e.reason, "source": e.source, "changed": changed, "warmup": warm,
                     "dynamic": e.dynamic, "symbolic": e.symbolic[:8],
                     **({"failed": sig.error, "workload_finding": f"layers:{sig.name}"} if failed else {})},
            fingerprint=fp))
    said = {f.details["call"] for f in out.values()} | {sig.events[i].call for i in expected}
    for c in sig.per_call[warm:]:
        if c["graphs"] > 0 and c["call"] not in said:  # a frame compiled for the first time (a new code path)
            fp = fingerprint("compile_after_warmup", backend, sig.name, c["call"].split(" ")[0], "(new frame)")
            out.setdefault(fp, Finding(
                kind="compile_after_warmup", stage="compile", module=sig.name, phase=_phase(sig),
                message=f"{sig.name}: {c['call']} compiled {c['graphs']} new graph(s) after the warm-up "
                        f"({warm} call(s)) without a failed guard: code the warm-up did not run",
                details={"call": c["call"], "changed": None, "graphs": c["graphs"], "warmup": warm}, fingerprint=fp))
    return list(out.values())


def _sweep(backend: str, opts: CompileOptions, sig: PhaseSignals) -> list[Finding]:
    if sig.phase is None or sig.phase.name != "long" or len(sig.per_call) < 2:
        return []
    first = sig.per_call[0]["graphs"]
    added = sum(c["graphs"] for c in sig.per_call[1:])
    allowed = opts.sweep_graphs_per_frame * max(first, 1)
    if added <= allowed:
        return []
    per = [f"{c['call']}: {c['graphs']}" for c in sig.per_call]
    return [Finding(kind="length_sweep_graphs", stage="compile", module=sig.name, phase="long",
                    message=f"the length sweep compiled {added} graph(s) after its first length ({first} graph(s)); "
                            f"allowed {allowed} (sweep_graphs_per_frame {opts.sweep_graphs_per_frame}): "
                            f"{', '.join(per)}",
                    metrics={"graphs_first": first, "graphs_added": added, "allowed": allowed},
                    details={"per_call": per}, fingerprint=fingerprint("length_sweep_graphs", backend, sig.name))]


def _limit(backend: str, sig: PhaseSignals) -> list[Finding]:
    hits = sig.of("limit")
    if not hits:
        return []
    e = hits[0]
    calls = sig.eager_calls()
    return [Finding(kind="recompile_limit", stage="compile", module=e.source or sig.name, phase=_phase(sig),
                    message=f"{sig.name}: Dynamo hit its {e.detail} at {e.call} and ran {e.source or 'the function'} "
                            f"in eager from then on ({len(calls)} call(s): {', '.join(calls[:6])}); last guard that "
                            f"failed: {e.reason}; these calls did not test the backend"[:2000],
                    details={"call": e.call, "eager_calls": calls, "reason": e.reason, "source": e.source,
                             "limit": e.detail},
                    fingerprint=fingerprint("recompile_limit", backend, sig.name, e.source))]


def _count(backend: str, opts: CompileOptions, sig: PhaseSignals) -> list[Finding]:
    graphs = len(sig.record.graphs) if sig.record is not None else 0
    if opts.max_graphs is None or graphs <= opts.max_graphs:
        return []
    return [Finding(kind="graph_count", stage="compile", module=sig.name, phase=_phase(sig),
                    message=f"{sig.name}: {graphs} graphs compiled, more than max_graphs {opts.max_graphs}",
                    metrics={"graphs": graphs, "max_graphs": opts.max_graphs},
                    fingerprint=fingerprint("graph_count", backend, sig.name))]
