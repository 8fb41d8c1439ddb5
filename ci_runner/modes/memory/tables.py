"""From metered runs to the mode's tables: per-phase peaks, per-module rows (predicted next to measured), the KV
cache per call, the first module over a budget. Plain dicts of numbers, ready for `results.json`."""

from __future__ import annotations

from typing import Any

from .runs import MeteredRun

__all__ = ["module_rows", "phase_summary", "first_over_budget", "kv_growth", "compare_rows"]


def _depth(name: str) -> int:
    return 0 if not name else name.count(".") + 1


def module_rows(run: MeteredRun) -> dict[str, dict[str, Any]]:
    """Per module: the highest peak over the phase's calls, the call and step where it occurs, and there its working
    bytes (the peak above the bytes live when the call began: what the call itself needs), split into activations
    (what the call leaves live: its outputs, a cache it grew) and temporaries (what it freed before returning)."""
    out: dict[str, dict[str, Any]] = {}
    for r in run.rows:
        cur = out.get(r["module"])
        if cur is None or r["peak_bytes"] > cur["peak_bytes"]:
            out[r["module"]] = {"module": r["module"], "module_class": r["module_class"], "peak_bytes": r["peak_bytes"],
                                "working_bytes": r["peak_bytes"] - r["entry_bytes"],
                                "activation_bytes": max(0, r["exit_bytes"] - r["entry_bytes"]),
                                "temporary_bytes": r["peak_bytes"] - max(r["exit_bytes"], r["entry_bytes"]),
                                "call": r["call"], "step": r["step"]}
    return out


def phase_summary(run: MeteredRun) -> dict[str, Any]:
    """The phase's peak, where it occurs (the deepest module at that peak) and its KV cache per call."""
    rows = module_rows(run)
    peak = max((r["peak_bytes"] for r in rows.values()), default=run.start_bytes)
    at = max((r for r in rows.values() if r["peak_bytes"] == peak), key=lambda r: _depth(r["module"]), default=None)
    return {"peak_bytes": peak, "peak_at": {"module": at["module"], "call": at["call"], "step": at["step"]} if at else None,
            "start_bytes": run.start_bytes, "kv_bytes": [c["kv_bytes"] for c in run.calls],
            "calls": [c["call"] for c in run.calls]}


def kv_growth(run: MeteredRun) -> list[int]:
    """The KV cache's growth at each decode step (bytes after the step minus before it)."""
    kv = [c["kv_bytes"] for c in run.calls]
    return [b - a for a, b in zip(kv, kv[1:])]


def first_over_budget(runs: list[MeteredRun], budget: int) -> dict[str, Any] | None:
    """The first call (phases in order) whose peak crosses `budget`, and in it the deepest module over it."""
    for run in runs:
        for call in run.calls:
            over = [r for r in run.rows if r["call"] == call["call"] and r["peak_bytes"] > budget]
            if over:
                r = max(over, key=lambda r: (_depth(r["module"]), -r["peak_bytes"]))
                return {"phase": run.phase, "step": r["step"], "call": r["call"], "module": r["module"] or "(model)",
                        "module_class": r["module_class"], "bytes": r["peak_bytes"]}
    return None


def compare_rows(predicted: MeteredRun, measured: MeteredRun) -> list[dict[str, Any]]:
    """Per module (its worst call): predicted against measured peak and working bytes, and their ratios."""
    pred = {(r["call"], r["module"]): r for r in predicted.rows}
    best: dict[str, dict[str, Any]] = {}
    for m in measured.rows:
        p = pred.get((m["call"], m["module"]))
        if p is None:
            continue
        row = {"module": m["module"], "call": m["call"], "step": m["step"],
               "predicted_peak": p["peak_bytes"], "measured_peak": m["peak_bytes"],
               "predicted_working": p["peak_bytes"] - p["entry_bytes"],
               "measured_working": m["peak_bytes"] - m["entry_bytes"]}
        row["peak_ratio"] = row["measured_peak"] / row["predicted_peak"] if row["predicted_peak"] else None
        row["working_ratio"] = (row["measured_working"] / row["predicted_working"]
                                if row["predicted_working"] else None)
        cur = best.get(m["module"])
        if cur is None or abs((row["peak_ratio"] or 1) - 1) > abs((cur["peak_ratio"] or 1) - 1):
            best[m["module"]] = row
    return list(best.values())
