"""The workload phases in `report.html`: per cell, the decode phase's error per step as an inline SVG chart.

Reads the numerics mode's `data.phases.decode.calls` (one row per call: prefill, then each decode step, with the
logits' `rel` error against the reference and the threshold derived for the phase). A drift that starts at step k
shows as the curve leaving the threshold line there; a call that failed on the backend has no point.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .trendcharts import line_chart


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value in ("inf", "nan"):
        return math.inf
    return None


def decode_chart(numerics_data: Mapping[str, Any], *, cell_id: str) -> str | None:
    """The decode phase's per-step error chart of one cell (None when the cell has no compared decode phase)."""
    phase = ((numerics_data or {}).get("phases") or {}).get("decode")
    calls = (phase or {}).get("calls") or []
    rels = [_number(c.get("rel")) for c in calls]
    if len(calls) < 2 or not any(r is not None for r in rels):
        return None
    labels = ["prefill" if c.get("step") is None else f"step {c['step']}" for c in calls]
    finite = [r if r is not None and math.isfinite(r) else None for r in rels]
    thresholds = [_number(c.get("threshold")) for c in calls]
    threshold = next((t for t in thresholds if t is not None and t > 0), None)
    return line_chart(f"{cell_id}: decode, logits error per step (rel, log scale)", labels,
                      [("logits rel", finite)], kind="decode-steps", log=True, threshold=threshold, ylabel="rel")
