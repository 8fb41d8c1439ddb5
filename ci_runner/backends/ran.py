"""Did the backend run the code? A `pass` means something only when the backend compiled and executed it.

Three generic sources of evidence, and one per backend that falls back silently:

* `CompileRecord`: a wrapper around the torch.compile backend; the graphs it was given (node counts) and how
  often each compiled callable ran;
* `DynamoCounters`: `torch._dynamo.utils.counters` diffed around a call: frames total vs ok (an error Dynamo
  suppressed, a skipped frame), graph breaks (code between graphs runs in eager), aot_autograd not_ok;
* `FallbackWatch`: the backend's own fallbacks, from its vendor module (`vendor.watch_for`; OpenVINO today).

They are read together, once: `CompileWatch` holds the records of one compile (`Backend.compile_watched`, the only
way the modes compile watched) with the other two, `with watch:` around the calls, and `watch.not_ran(...)` is
`not_ran_reason`, the one reading of them. Nothing else builds `DynamoCounters` or `FallbackWatch`
(`tests/unit/test_architecture_watch.py`).
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

from ..watch import compiles
from .vendor import VendorWatch, vendor_fact_keys, watch_for

__all__ = ["CompileRecord", "DynamoCounters", "FallbackWatch", "CompileWatch", "ran_facts", "not_ran_reason",
           "backend_ran"]


class CompileRecord:
    """A torch.compile backend that forwards to `inner` and records each graph it is given and its executions; each
    graph the backend compiles is counted, with the seconds of its compile, in the process's tally
    (`watch/compiles.py`: the modes' `data.compiles`)."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.__name__ = name  # torch.compile's errors say backend='<name>'
        self.graphs: list[dict[str, Any]] = []  # {"nodes": call nodes, "calls": executions}
        self.keep_modules = False  # keep each GraphModule given (the phases' culprit reads the failing one)
        self.modules: list[Any] = []

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._dynamo.backends.registry import lookup_backend  # deferred: imports torch
        from torch._dynamo.exc import RestartAnalysis

        rec = {"nodes": sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")),
               "calls": 0}
        self.graphs.append(rec)
        if self.keep_modules:
            self.modules.append(gm)
        t0 = time.perf_counter()
        try:
            compiled = lookup_backend(self.inner)(gm, example_inputs, **kwargs)
        except RestartAnalysis:  # Dynamo drops this graph and traces the frame again (e.g. a 0-dim float64
            self.graphs.remove(rec)  # tensor's scalar tensorified): the graph it compiles next is the one that runs
            compiles.add(0, time.perf_counter() - t0)
            raise
        except BaseException:
            compiles.add(1, time.perf_counter() - t0)  # a compile that failed still cost its time
            raise
        rec["compile_s"] = round(time.perf_counter() - t0, 3)
        compiles.add(1, time.perf_counter() - t0)
        if not callable(compiled):
            return compiled

        def run(*args: Any) -> Any:
            out = compiled(*args)
            rec["calls"] += 1
            return out

        if getattr(compiled, "_boxed_call", False):  # aot_autograd's calling convention: Dynamo passes a list
            run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def summary(self) -> dict[str, int]:
        return {"graphs": len(self.graphs), "nodes": sum(g["nodes"] for g in self.graphs),
                "graphs_executed": sum(1 for g in self.graphs if g["calls"] > 0)}

    def not_ran(self) -> str | None:
        """Why the backend did not run the code (None when every graph it was given executed)."""
        if not self.graphs:
            return "the backend was given no graph (Dynamo ran everything in eager)"
        idle = sum(1 for g in self.graphs if g["calls"] == 0)
        if idle:
            return f"{idle} of {len(self.graphs)} compiled graph(s) never executed"
        return None


class DynamoCounters:
    """`with DynamoCounters() as c:` … `c.fallback()`: what Dynamo ran in eager instead of the backend."""

    def __enter__(self) -> "DynamoCounters":
        self.before = self._snapshot()
        self.after = self.before
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = self._snapshot()

    @staticmethod
    def _snapshot() -> dict[str, dict[str, int]]:
        from torch._dynamo.utils import counters  # deferred: imports torch

        return {k: {kk: int(vv) for kk, vv in v.items()} for k, v in counters.items()}

    def delta(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for cat, now in self.after.items():
            old = self.before.get(cat, {})
            d = {k: v - old.get(k, 0) for k, v in now.items() if v - old.get(k, 0)}
            if d:
                out[cat] = d
        return out

    def fallback(self, expected_break: str = "", *, breaks: bool = True) -> str | None:
        """Why code ran in eager instead of the backend (None: it did not), with what Dynamo said it could not
        trace (the first line of each `unimplemented` reason, e.g. "Attempt to trace generator"); graph breaks
        whose reason contains `expected_break` (when given) are intended and not counted, and none is with
        `breaks=False` (the graphs on each side of a break still ran on the backend: a whole model's capture is
        judged per graph)."""
        d = self.delta()
        frames = d.get("frames", {})
        eager = frames.get("total", 0) - frames.get("ok", 0)
        said = {k: v for k, v in d.get("unimplemented", {}).items() if not (expected_break and expected_break in k)}
        if expected_break:  # a frame that holds nothing but the intended break runs eagerly by design
            eager -= sum(d.get("unimplemented", {}).values()) - sum(said.values())
        if eager > 0:
            why = "; ".join(dict.fromkeys(k.strip().splitlines()[0] for k in said if k.strip()))[:200]
            return (f"Dynamo fell back to eager for {eager} frame(s) (an error it suppressed, or a skipped frame"
                    + (f"; what it could not trace: {why}" if why else "") + ")")
        broken = {k: v for k, v in d.get("graph_break", {}).items()
                  if breaks and not (expected_break and expected_break in k)}
        if broken:
            return f"{sum(broken.values())} graph break(s): {', '.join(list(broken)[:2])}"[:300]
        if d.get("aot_autograd", {}).get("not_ok"):
            return "aot_autograd failed on a graph (it ran in eager)"
        return None


class FallbackWatch:
    """Backend-specific evidence that a compile ran elsewhere than on the backend; `with FallbackWatch(name):`,
    then `reason()` (None: no fallback seen) and `facts()`. Backends without a vendor module have none."""

    def __init__(self, compile_name: str | None) -> None:
        self.name = compile_name
        self._vendor: VendorWatch | None = watch_for(compile_name)

    def __enter__(self) -> "FallbackWatch":
        if self._vendor is not None:
            self._vendor.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._vendor is not None:
            self._vendor.stop()

    @property
    def active(self) -> bool:
        """Whether this backend has a vendor watch (its evidence needs a fresh compile: it counts one compile's
        partitions)."""
        return self._vendor is not None

    def facts(self) -> dict[str, Any]:
        return self._vendor.facts() if self._vendor is not None else {}

    def reason(self) -> str | None:
        return self._vendor.reason() if self._vendor is not None else None


def ran_facts(record: CompileRecord | None, counters: DynamoCounters, watch: FallbackWatch) -> dict[str, Any]:
    """What the backend compiled and executed for one probe (the row's `ran`; `backend_ran` sums these)."""
    out: dict[str, Any] = dict(record.summary()) if record is not None else {}
    d = counters.delta()
    if d.get("graph_break"):
        out["graph_breaks"] = sum(d["graph_break"].values())
    frames = d.get("frames", {})
    if frames.get("total", 0) > frames.get("ok", 0):
        out["frames_in_eager"] = frames["total"] - frames.get("ok", 0)
    out.update(watch.facts())
    return out


def not_ran_reason(record: CompileRecord | None, counters: DynamoCounters, watch: FallbackWatch, *,
                   expected_break: str = "", breaks: bool = True) -> str | None:
    """Why a compile that raised nothing did not run on the backend (None: it did): no graph given or executed,
    Dynamo fell back to eager or broke the graph (except the breaks `expected_break` names; none with
    `breaks=False`, a whole model's run judged per graph), the backend's own silent fallback."""
    return ((record.not_ran() if record is not None else None) or counters.fallback(expected_break, breaks=breaks)
            or watch.reason())


class CompileWatch:
    """Did the backend run the calls of what it compiled: the compile's `CompileRecord` (none when eager; several
    when compiles join one watch, `Backend.compile_watched(join=…)`), `DynamoCounters` and the backend's
    `FallbackWatch`, as one. `with watch:` around the calls (each `with` a fresh window for the counters and the
    vendor watch; the records count from the compile on), then `not_ran(...)`, `ran()`, `summary()`,
    `vendor_facts()`. An eager backend's watch has no record: it says nothing was given to compile."""

    def __init__(self, compile_name: str | None, records: Sequence[CompileRecord] = ()) -> None:
        self.compile_name = compile_name
        self.records: list[CompileRecord] = list(records)
        self.counters = DynamoCounters()
        self.vendor = FallbackWatch(compile_name)
        self.counters.before = self.counters.after = {}

    @property
    def record(self) -> CompileRecord | None:
        """The first compile's record (the only one unless compiles joined); None when eager."""
        return self.records[0] if self.records else None

    @property
    def active(self) -> bool:
        """Whether the backend has a vendor watch (`FallbackWatch.active`: its evidence needs a fresh compile)."""
        return self.vendor.active

    def __enter__(self) -> "CompileWatch":
        self.vendor.__enter__()
        self.counters.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.counters.__exit__(*exc)
        self.vendor.__exit__(*exc)

    def not_ran(self, expected_break: str = "", *, breaks: bool = True, of: int | None = None) -> str | None:
        """Why the calls did not run on the backend (None: they did), by `not_ran_reason` over each record (`of`:
        the record of that compile alone, in compile order)."""
        records: list[CompileRecord | None] = list(self.records) if of is None else [self.records[of]]
        for record in records or [None]:
            why = not_ran_reason(record, self.counters, self.vendor, expected_break=expected_break, breaks=breaks)
            if why:
                return why
        return None

    def summary(self) -> dict[str, int]:
        """`CompileRecord.summary` summed over the records ({} when eager)."""
        out: dict[str, int] = {}
        for record in self.records:
            for k, v in record.summary().items():
                out[k] = out.get(k, 0) + v
        return out

    def vendor_facts(self) -> dict[str, Any]:
        """The backend's own facts (`FallbackWatch.facts`: partitions, the ops it left to PyTorch)."""
        return self.vendor.facts()

    def fallback_reason(self) -> str | None:
        """Why the backend's work ran elsewhere, in its own words (`FallbackWatch.reason`)."""
        return self.vendor.reason()

    def ran(self) -> dict[str, Any]:
        """What the backend compiled and executed (`ran_facts`: the row's `ran`)."""
        return {**self.summary(), **ran_facts(None, self.counters, self.vendor)}


def backend_ran(rows: list[Mapping[str, Any]], *, compiles: bool) -> dict[str, Any]:
    """What the backend compiled and executed over all probes of a mode (`ModeResult.data["backend_ran"]`): rows
    with `status` and `ran` (`CompileRecord.summary` plus `DynamoCounters` / `FallbackWatch` facts); ops probes or
    layers module probes."""
    if not compiles:
        return {"eager": True, "probes": len(rows)}
    total: dict[str, Any] = {"probes_compiled": 0, "probes_executed": 0, "graphs": 0, "nodes": 0,
                             "graphs_executed": 0, "inconclusive": 0}
    for r in rows:
        ran = r.get("ran") or {}
        total["probes_compiled"] += 1 if ran.get("graphs") else 0
        total["probes_executed"] += 1 if ran.get("graphs_executed") else 0
        for key in ("graphs", "nodes", "graphs_executed", "graph_breaks", "frames_in_eager", *vendor_fact_keys()):
            if ran.get(key):
                total[key] = total.get(key, 0) + int(ran[key])
        total["inconclusive"] += 1 if r["status"] == "inconclusive" else 0
        if ran.get("eager_ops"):  # ops the backend's partitioner left to PyTorch eager (a vendor watch's fact)
            total["eager_ops"] = sorted(set(total.get("eager_ops") or ()) | set(ran["eager_ops"]))
    return total
