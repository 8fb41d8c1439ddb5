"""The memory mode in report.html (its `registry.ModeHooks`, `HOOKS`): per cell, each repeated layer's peak in each
phase, predicted and, where the device was measured, measured, as an inline SVG chart (from `data.modules`,
`tables.py`); no torch."""

from __future__ import annotations

import re
from typing import Any, Mapping

from ...registry import ModeHooks
from ...report.trendcharts import chart_number as _number, line_chart
from ...results.model import CellResult

MODE = "memory"


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


class MemoryHooks(ModeHooks):
    """The memory mode's chart in the cell's block of report.html."""

    def html_charts(self, cell: CellResult) -> str:
        mode = cell.modes.get(MODE)
        chart = memory_chart(mode.data, cell_id=cell.id) if mode is not None and mode.data else None
        return f'<div class="chartbox memory">{chart}</div>' if chart else ""


HOOKS = MemoryHooks()
