"""The history's trends in `report.html`: inline SVG line charts over nights, and the first/last-seen table.

Takes the `Trends` of ``ci_runner.history.trends`` (read by attribute: the report does not import the
history). Charts: op-support burn-down per backend (unsupported ops and models blocked, one point per
night), per-layer error over time for each model × backend (its worst layers, with the threshold as a
dashed line), cell time over time, and each mode's own history figures (`Trends.modes`, drawn by the mode's
`registry.ModeHooks`: `history_sections`). Every chart is an ``svg.trend`` with ``data-points`` = nights, followed by
its legend in HTML (a colour swatch and the series' whole name, wrapping where it must).
"""

from __future__ import annotations

import html
import math
from typing import Any, Sequence

from ..registry import mode_hooks

W, H = 760, 220
ML, MR, MT, MB = 56, 16, 14, 34
COLORS = ("#0969da", "#bc4c00", "#1a7f37", "#8250df", "#cf222e", "#6e7781")
MAX_TIME_CELLS = 8
MAX_SEEN_ROWS = 300



def chart_number(value: Any) -> float | None:
    """A figure read back from a result for a chart: a number, inf for a non-finite one stored as text, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if value in ("inf", "nan"):
        return math.inf
    return None

def _e(text: Any) -> str:
    return html.escape("" if text is None else str(text), quote=True)


def line_chart(title: str, dates: Sequence[str], series: Sequence[tuple[str, Sequence[float | None]]], *,
               kind: str, log: bool = False, threshold: float | None = None, ylabel: str = "") -> str:
    """One SVG chart: a polyline per series over the nights (None breaks nothing: that night is skipped)."""
    n = len(dates)
    vals = [v for _, s in series for v in s if v is not None and math.isfinite(v) and (v > 0 or not log)]
    if threshold is not None and math.isfinite(threshold) and threshold > 0:
        vals.append(threshold)
    f = (lambda v: math.log10(v)) if log else (lambda v: v)
    lo = min((f(v) for v in vals), default=0.0)
    hi = max((f(v) for v in vals), default=1.0)
    if log:
        lo, hi = math.floor(lo), math.ceil(hi)
    else:
        lo = min(lo, 0.0)
    if hi - lo <= 0:
        hi = lo + 1
    pw, ph = W - ML - MR, H - MT - MB

    def x(i: int) -> float:
        return ML + (pw * i / (n - 1) if n > 1 else pw / 2)

    def y(v: float) -> float:
        return MT + ph - (f(v) - lo) / (hi - lo) * ph

    out = [f'<svg class="trend" data-kind="{_e(kind)}" data-points="{n}" xmlns="http://www.w3.org/2000/svg" '
           f'viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img"><title>{_e(title)}</title>',
           f'<rect class="plot" x="{ML}" y="{MT}" width="{pw}" height="{ph}"/>']
    ticks = [lo + k for k in range(int(hi - lo) + 1)][:: max(1, math.ceil((hi - lo) / 6))] if log else \
        [lo + (hi - lo) * k / 4 for k in range(5)]
    for val in ticks:
        yy = MT + ph - (val - lo) / (hi - lo) * ph
        label = f"1e{val:.0f}" if log else f"{val:.3g}"
        out.append(f'<line class="grid" x1="{ML}" x2="{ML + pw}" y1="{yy:.1f}" y2="{yy:.1f}"/>'
                   f'<text class="tick" x="{ML - 6}" y="{yy + 4:.1f}" text-anchor="end">{label}</text>')
    for i in sorted({0, n - 1, *range(0, n, max(1, math.ceil(n / 6)))}):
        if 0 <= i < n:
            out.append(f'<text class="tick" x="{x(i):.1f}" y="{MT + ph + 14}" text-anchor="middle">{_e(dates[i][5:])}</text>')
    if ylabel:
        out.append(f'<text class="axis" transform="translate(12 {MT + ph / 2:.1f}) rotate(-90)" text-anchor="middle">{_e(ylabel)}</text>')
    if threshold is not None and math.isfinite(threshold) and threshold > 0:
        out.append(f'<line class="thr" x1="{ML}" x2="{ML + pw}" y1="{y(threshold):.1f}" y2="{y(threshold):.1f}"/>')
    for k, (name, s) in enumerate(series):
        color = COLORS[k % len(COLORS)]
        pts = [f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(s)
               if v is not None and math.isfinite(v) and (v > 0 or not log)]
        if pts:
            out.append(f'<polyline class="tline" data-series="{_e(name)}" fill="none" stroke="{color}" stroke-width="1.8" '
                       f'points="{" ".join(pts)}"><title>{_e(name)}</title></polyline>')
    out.append("</svg>")
    out.append(legend(series, threshold=threshold is not None and math.isfinite(threshold) and threshold > 0))
    return "".join(out)


def legend(series: Sequence[tuple[str, Any]], *, threshold: bool = False) -> str:
    """A chart's legend: per series a swatch of its colour and its whole name (the threshold's dashed line too)."""
    items = [f'<span class="lg" data-series="{_e(name)}"><i class="sw" style="background: {COLORS[k % len(COLORS)]}"></i>'
             f"{_e(name)}</span>" for k, (name, _) in enumerate(series)]
    if threshold:
        items.append('<span class="lg"><i class="sw sw-thr"></i>threshold</span>')
    return f'<p class="legend trend-legend">{"".join(items)}</p>'


_WARN = ('<svg class="ic" viewBox="0 0 16 16" width="16" height="16" role="img" aria-label="warning"><title>warning</title>'
         '<path d="M8 1.2l7 13.3H1z" fill="#bf8700"/><path d="M8 5.6v4.4M8 11.4v1.6" stroke="#fff" stroke-width="1.8"/></svg>')


def _ago(series: Sequence[int], nights: int) -> str:
    return str(series[-1 - nights]) if len(series) > nights else "—"


def burndown_line(b: Any) -> str:
    """One line per backend: unsupported ops and models blocked, today vs 7 and 30 nights ago."""
    def one(series: Sequence[int]) -> str:
        return f"{series[-1] if series else 0} today, {_ago(series, 7)} 7 nights ago, {_ago(series, 30)} 30 nights ago"

    return f"unsupported ops: {one(b.unsupported)} · models blocked: {one(b.blocked)}"


def history_sections(t: Any, where: str) -> list[str]:
    """Each mode's history figures (`Trends.modes`, `registry.ModeHooks`) as summary.md (`where="summary"`) or
    report.html ("html") text, in mode order; none empty."""
    if t is None:
        return []
    hooks = dict(mode_hooks())
    out = []
    for mode, data in (getattr(t, "modes", None) or {}).items():
        h = hooks.get(mode)
        if h is not None and data:
            text = h.history_summary(data) if where == "summary" else h.history_html(data, t.dates)
            if text:
                out.append(text)
    return out


def trends_html(t: Any) -> str:
    """The page's history section body (escaped HTML)."""
    out = [f'<p class="muted">{t.nights} night(s) in the history; charts show the newest {len(t.dates)}.</p>',
           "<h3>Op-support burn-down</h3>"]
    for b in t.burndown:
        out.append(f"<p><code>{_e(b.backend)}</code>: {_e(burndown_line(b))}</p>")
        out.append(line_chart(f"{b.backend}: unsupported ops and models blocked per night", t.dates,
                              [("unsupported ops", b.unsupported), ("models blocked", b.blocked)],
                              kind="burndown", ylabel="count"))
    if t.drifting:
        out.append("<h3>Drifting layers</h3><table><thead><tr><th>cell</th><th>layer</th><th>trend</th></tr></thead><tbody>")
        out += [f"<tr><td><code>{_e(d.cell)}</code></td><td><code>{_e(d.layer)}</code></td><td>{_WARN} {_e(d.words())}</td></tr>"
                for d in t.drifting]
        out.append("</tbody></table>")
    if t.layer_trends:
        out.append("<h3>Per-layer error over time</h3>")
    for lt in t.layer_trends:
        thr = next((th for _, _, th in lt.layers if th), None)
        out.append(f"<p><code>{_e(lt.cell)}</code>: its worst layers' {_e(lt.figure)} per night, threshold dashed</p>")
        out.append(line_chart(f"{lt.cell}: worst layers' {lt.figure} per night (threshold dashed)", t.dates,
                              [(name, vals) for name, vals, _ in lt.layers], kind="layers", log=True, threshold=thr,
                              ylabel=lt.figure))
    if t.moved:
        out.append("<h3>Figures that moved since the night before</h3><table><thead><tr><th>cell</th>"
                   "<th>figure: before → now</th></tr></thead><tbody>")
        out += [f"<tr><td><code>{_e(m.cell)}</code></td><td>{_e(m.words())}</td></tr>" for m in t.moved[:MAX_SEEN_ROWS]]
        out.append("</tbody></table>")
    out += history_sections(t, "html")
    slow = sorted(t.cell_times.items(), key=lambda kv: -(kv[1][-1] or 0.0))[:MAX_TIME_CELLS]
    if slow:
        out.append("<h3>Cell time over time</h3>")
        out.append(line_chart("cell time per night (slowest cells)", t.dates, slow, kind="time", ylabel="seconds"))
    out.append(_seen_table(t))
    return "".join(out)


def _seen_table(t: Any) -> str:
    rows = sorted(t.since.values(), key=lambda s: (s.date, s.cell, s.key))[:MAX_SEEN_ROWS]
    gone = list(t.gone)[:MAX_SEEN_ROWS]
    out = ["<h3>First seen / last seen</h3><table><thead><tr><th>cell</th><th>finding</th><th>first seen</th>"
           "<th>last seen</th><th>now</th></tr></thead><tbody>"]
    for s in rows:
        out.append(f"<tr><td><code>{_e(s.cell)}</code></td><td>{_e(s.kind)} <code>{_e(s.key)}</code></td><td>{_e(s.first_seen)}</td>"
                   f"<td>{_e(s.last_seen)}</td><td>{_e(s.words())}</td></tr>")
    for s in gone:
        out.append(f"<tr><td><code>{_e(s.cell)}</code></td><td>{_e(s.kind)} <code>{_e(s.key)}</code></td><td>{_e(s.first_seen)}</td>"
                   f"<td>{_e(s.last_seen)}</td><td class=\"s-pass\">gone after {_e(s.last_seen)}</td></tr>")
    out.append("</tbody></table>")
    return "".join(out)
