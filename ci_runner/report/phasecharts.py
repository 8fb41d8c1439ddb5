"""The workload phases in `report.html`: per cell, the decode phase's error per step as an inline SVG chart, and
the memory mode's peak per layer and phase beside it (`memory_chart`, from `data.modules`).

Reads the numerics mode's `data.phases.decode.calls` (one row per call: prefill, then each decode step, with the
logits' `rel` error against the reference and the threshold derived for the phase). A drift that starts at step k
shows as the curve leaving the threshold line there; a call that failed on the backend has no point.
"""

from __future__ import annotations

import math
import re
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


def _layer_level(name: str) -> bool:
    """A repeated layer (`model.layers.3`): the element of a module list."""
    return bool(re.search(r"\.\d+$", name or ""))


def memory_chart(memory_data: Mapping[str, Any], *, cell_id: str) -> str | None:
    """The memory mode's per-layer chart of one cell: each repeated layer's peak (MiB) in each phase, predicted and,
    where the device was measured, measured (None when the cell has no such rows)."""
    rows = [r for r in (memory_data or {}).get("modules") or [] if _layer_level(str(r.get("module")))]
    layers = list(dict.fromkeys(str(r["module"]) for r in rows))
    if not layers:
        return None
    series: list[tuple[str, list[float | None]]] = []
    for phase in dict.fromkeys(str(r.get("phase")) for r in rows):
        by = {str(r["module"]): r for r in rows if str(r.get("phase")) == phase}
        for key, label in (("peak_bytes", "predicted"), ("measured_peak_bytes", "measured")):
            values = [_number((by.get(m) or {}).get(key)) for m in layers]
            if any(v is not None for v in values):
                series.append((f"{phase} {label}", [v / 2**20 if v is not None else None for v in values]))
    return line_chart(f"{cell_id}: memory per layer, peak of its call (MiB)", layers, series, kind="memory-layers",
                      ylabel="MiB")
