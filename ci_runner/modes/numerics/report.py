"""The numerics mode's decode phase in report.html (its `registry.ModeHooks`, `HOOKS`): per cell, the error of each
decode step as an inline SVG chart, and links to its Model Explorer overlay (`artifacts`); no torch.

Reads the numerics mode's `data.phases.decode.calls` (one row per call: prefill, then each decode step, with the
logits' `rel` error against the reference and the threshold derived for the phase). A drift that starts at step k
shows as the curve leaving the threshold line there; a call that failed on the backend has no point.
"""

from __future__ import annotations

import html
import math
from typing import Any, Mapping, Sequence

from ...registry import ModeHooks
from ...report.trendcharts import chart_number as _number, line_chart
from ...results.model import CellResult

MODE = "numerics"


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


def precision_of(cell: CellResult) -> Mapping[str, Any] | None:
    """The cell's `data.precision` (workloads/precision.py) when it says more than "float32": a policy below
    float32, declared or measured, or a note (a class measured outside the convention, a failed measurement)."""
    mode = cell.modes.get(MODE)
    record = (mode.data or {}).get("precision") if mode is not None else None
    if not isinstance(record, Mapping) or (record.get("policy") == "float32" and not record.get("note")):
        return None
    return record


class NumericsHooks(ModeHooks):
    """The decode chart in the cell's block of report.html (the per-layer charts are report/html.py's own), and
    the precision each cell was judged at (summary, HTML, JUnit), where it is not plain float32."""

    def html_charts(self, cell: CellResult) -> str:
        mode = cell.modes.get(MODE)
        chart = decode_chart(mode.data, cell_id=cell.id) if mode is not None and mode.data else None
        return f'<div class="chartbox decode">{chart}</div>' if chart else ""

    def html_tables(self, cell: CellResult) -> str:
        record = precision_of(cell)
        if record is None:
            return ""
        note = f" — {html.escape(str(record['note']))}" if record.get("note") else ""
        return (f'<p class="precision">Judged at precision <b>{html.escape(str(record.get("policy")))}</b> '
                f'(declared: {html.escape(str(record.get("declared")))}){note}</p>')

    def summary_section(self, cells: Sequence[CellResult], *, max_rows: int) -> str:
        rows = [(c, r) for c in cells if (r := precision_of(c)) is not None]
        if not rows:
            return ""
        lines = ["### Precision", "", "| cell | declared | judged at | note |", "|---|---|---|---|"]
        for cell, record in rows[:max_rows]:
            note = str(record.get("note") or "").replace("|", "\\|")
            lines.append(f"| `{cell.id}` | {record.get('declared')} | {record.get('policy')} | {note} |")
        if len(rows) > max_rows:
            lines.append(f"| … {len(rows) - max_rows} more in results.json | | | |")
        return "\n".join(lines) + "\n"

    def junit_properties(self, cell: CellResult) -> list[tuple[str, str]]:
        record = precision_of(cell)
        return [("precision", str(record.get("policy")))] if record is not None else []

    def artifacts(self, cell: CellResult) -> list[tuple[str, str]]:
        return model_explorer_files(cell)


def model_explorer_files(cell: CellResult) -> list[tuple[str, str]]:
    """The cell's Model Explorer overlay (`data.model_explorer`, modes/numerics/overlay.py): the exported program and each
    view's node data, as report.html links them."""
    mode = cell.modes.get(MODE)
    record = (mode.data or {}).get("model_explorer") if mode is not None else None
    if not isinstance(record, Mapping):
        return []
    out = [("Model Explorer: exported program", str(record["program"]))] if record.get("program") else []
    return out + [(f"node data ({view})", str(path)) for view, path in (record.get("node_data") or {}).items()]


HOOKS = NumericsHooks()
