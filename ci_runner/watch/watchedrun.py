"""One phase's compiled run, watched for the compile mode's signals, and kept per cell so that one compiled pass
serves every mode that needs it (issue 33: the signals are read from the runs the other modes make where they share
a process).

`PhaseWatch(by, watch)`: `with PhaseWatch(...) as w:` around one phase's calls through one compiled object (`watch`:
its `backends.ran.CompileWatch`, from `Backend.compile_watched`; pass `w.before`/`w.after` to
`workloads.calls.run_phase`), then `w.result()` is a `WatchedRun`: the calls, per call the graphs compiled and
executed and the compile seconds, Dynamo's structured-trace events (`watch.dynamotrace.TraceWatch`; its records kept
as TORCH_TRACE lines, `keep_bytes` at most; `trace=False`: none), the backend's own fallbacks, Dynamo's counters,
why the backend did not run (some of) it (`CompileWatch.not_ran`, graph breaks not counted) and the first failing
call. A mode that compiles the whole model
per phase in the cell's process (the layers mode's target run) keeps it in `ModeContext.compiled_runs[<phase>]`
when the cell also runs the compile mode (`wanted`); the compile mode reads it there and compiles a phase itself
only when no run of it is there.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..backends.ran import CompileRecord, CompileWatch
from .dynamotrace import KEEP_BYTES, Event, KeptTrace, TraceWatch
from ..workloads.calls import Call, CallRecord

__all__ = ["WatchedRun", "PhaseWatch", "wanted", "WATCHING_MODE"]

WATCHING_MODE = "compile"  # the mode that reads the watched runs


def wanted(modes: Iterable[str]) -> bool:
    """Whether a cell running `modes` wants its modes' compiled phase runs watched and kept."""
    return WATCHING_MODE in tuple(modes)


@dataclass
class WatchedRun:
    """What one phase's calls through one compiled object showed; `by`: the mode that ran it."""

    by: str
    calls: list[Call] = field(default_factory=list)
    per_call: list[dict[str, Any]] = field(default_factory=list)  # {call, graphs, ran, compile_s} per call
    events: list[Event] = field(default_factory=list)
    record: CompileRecord | None = None
    facts: dict[str, Any] = field(default_factory=dict)  # the backend's own fallbacks (`FallbackWatch.facts`)
    fallback_reason: str | None = None  # why its work ran elsewhere, in the backend's words (`FallbackWatch.reason`)
    counters: dict[str, dict[str, int]] = field(default_factory=dict)
    seen: set[str] = field(default_factory=set)  # the kinds of structured-trace record this torch gave
    error: str | None = None
    failed_call: str | None = None
    seconds: float = 0.0
    # why (some of) its calls ran in PyTorch and not on the backend, in words (None: the backend ran them all):
    # no graph given or executed, Dynamo's eager fallback, the backend's own fallback
    not_ran: str | None = None
    trace: KeptTrace | None = None  # Dynamo's structured trace records, as TORCH_TRACE lines (`dynamotrace.KeptTrace`)


def _runs(record: CompileRecord | None) -> int:
    return sum(g["calls"] for g in record.graphs) if record is not None else 0


class PhaseWatch:
    """The compile mode's watches around one phase run: the compile's `CompileWatch` and Dynamo's structured trace
    (see the module docstring)."""

    def __init__(self, by: str, watch: CompileWatch, *, trace: bool = True, keep_bytes: int = KEEP_BYTES) -> None:
        self.run = WatchedRun(by=by, record=watch.record)
        self.watch = watch
        self.trace = TraceWatch(keep_bytes=keep_bytes)
        self._trace = trace  # False: only whether the backend ran it (no structured trace: the compile mode's)
        self._state = {"graphs": 0, "runs": 0, "events": 0}
        self._stack = ExitStack()
        self._t0 = 0.0

    def __enter__(self) -> "PhaseWatch":
        if self._trace:
            self._stack.enter_context(self.trace)
        self._stack.enter_context(self.watch)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.run.seconds = time.perf_counter() - self._t0
        self._stack.close()
        self.run.events = list(self.trace.events)
        self.run.seen = set(self.trace.seen)
        self.run.trace = self.trace.kept
        self.run.facts = self.watch.vendor_facts()
        self.run.fallback_reason = self.watch.fallback_reason()
        self.run.counters = self.watch.counters.delta()
        self.run.not_ran = self.watch.not_ran(breaks=False)

    def before(self, call: Call) -> None:
        record = self.run.record
        self.trace.mark(call.label)
        self._state.update(graphs=len(record.graphs) if record else 0, runs=_runs(record),
                           events=len(self.trace.events))
        self.run.calls.append(call)

    def after(self, call: Call, rec: CallRecord) -> None:
        record = self.run.record
        self.run.per_call.append({
            "call": call.label, "graphs": (len(record.graphs) if record else 0) - self._state["graphs"],
            "ran": _runs(record) - self._state["runs"],
            "compile_s": round(sum(e.seconds for e in self.trace.events[self._state["events"]:]), 3)})
        if rec.error and self.run.error is None:
            self.run.error, self.run.failed_call = rec.error, call.label

    def result(self) -> WatchedRun:
        return self.run
