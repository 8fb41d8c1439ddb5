"""`report.html`: one self-contained page (inline CSS, JS and SVG; no network, no CDN).

The same content as the summary, plus, per cell with a numerics table, a chart of each layer's
deviation against its threshold in both views (cumulative: the target's own forward; isolated: the
layer fed the reference's inputs), on a log scale, with the flagged layers and the first divergent
layer marked. One chart per metric (rel, 1 − cos, mad); tabs switch between them.

A Content-Security-Policy meta tag forbids every fetch, so a page that would need the network
fails loudly in a browser instead of quietly phoning home.
"""

from __future__ import annotations

import hashlib
import html
import json
import math
import posixpath
from urllib.parse import quote
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from ..registry import SECTION_DIVERGENT, kinds_in, mode_hooks
from ..results.model import Results
from .junit import xml_safe
from ..failures.failure import headline
from .trendcharts import trends_html
from ..zoo.report import zoo_view
from .view import CellView, LayerPoint, NumericsView, ReportView, build_view, compile_costs, cos_distance, fmt_num

# Big runs stay light: past these budgets, findings and per-layer numbers go into one JSON block
# embedded once in the page, and a compact table is drawn from it when its <details> is opened.
MAX_FINDINGS_PER_CELL = 200  # findings shown in full per cell …
MAX_FULL_FINDINGS = 1000  # … while the page's budget of full findings lasts
MAX_CHART_CELLS = 16  # cells whose charts and per-layer table are drawn in the page
MAX_DIVERGENT_ROWS = 300  # rows of the "Divergent layers" table
SUMMARY_CHARS = 160  # a compact row's message headline
CHART_METRICS: tuple[tuple[str, str], ...] = (("rel", "relative error"), ("cos", "1 − cosine"), ("mad", "mean abs diff"))

CLIP_CHARS = 180  # a message longer than this shows its first words, the whole text on hover or unfold

# Status icons as inline SVG (no emoji font needed): a shape and a colour per status, a <title> for its name.
_ICON_SHAPES: dict[str, str] = {
    "pass": '<circle cx="8" cy="8" r="7" fill="#1a7f37"/><path d="M4.5 8.3l2.3 2.3 4.7-4.9" fill="none" stroke="#fff" stroke-width="1.8"/>',
    "fail": '<circle cx="8" cy="8" r="7" fill="#cf222e"/><path d="M5.2 5.2l5.6 5.6M10.8 5.2l-5.6 5.6" stroke="#fff" stroke-width="1.8"/>',
    "warn": '<path d="M8 1.2l7 13.3H1z" fill="#bf8700"/><path d="M8 5.6v4.4M8 11.4v1.6" stroke="#fff" stroke-width="1.8"/>',
    "skipped": '<circle cx="8" cy="8" r="7" fill="#8c959f"/><path d="M4.5 8h7" stroke="#fff" stroke-width="1.8"/>',
    "inconclusive": '<circle cx="8" cy="8" r="7" fill="none" stroke="#8250df" stroke-width="1.6"/>'
                    '<path d="M6 6.3a2 2 0 1 1 2.6 1.9c-.5.2-.6.5-.6 1v.6M8 11.3v1.5" fill="none" stroke="#8250df" stroke-width="1.6"/>',
    "none": '<circle cx="8" cy="8" r="2" fill="#8c959f"/>',
    "up": '<circle cx="8" cy="8" r="7" fill="#cf222e"/>',
    "ok": '<circle cx="8" cy="8" r="7" fill="#1a7f37"/>',
}
_ICON_OF = {"pass": "pass", "fail": "fail", "error": "warn", "timeout": "warn", "crashed": "warn",
            "skipped": "skipped", "inconclusive": "inconclusive"}
_ICON_WORDS = {"fail": "findings", "warn": "error, timeout or crash", "none": "not run"}


def icon(status: str | None) -> Markup:
    """A status as a 1-em inline SVG icon (`pass`, `fail`, `error`/`timeout`/`crashed`, `skipped`, `inconclusive`;
    anything else: not run), with its name for screen readers and on hover."""
    shape = _ICON_OF.get(status or "", status if status in _ICON_SHAPES else "none")
    name = status or _ICON_WORDS.get(shape, shape)
    return Markup(f'<svg class="ic ic-{shape}" viewBox="0 0 16 16" width="16" height="16" role="img" '
                  f'aria-label="{_e(name)}"><title>{_e(name)}</title>{_ICON_SHAPES[shape]}</svg>')


def cut_words(text: str, limit: int) -> str:
    """`text` cut at the last word boundary before `limit` characters, with "…"; unchanged when it fits."""
    if len(text) <= limit:
        return text
    head = text[: limit - 1]
    space = head.rfind(" ")
    if space >= limit // 2:
        head = head[:space]
    return head.rstrip(" ,;:") + "…"


def clip(text: Any, limit: int = CLIP_CHARS) -> Markup:
    """A message for a table cell: whole when short, else its first words with the whole text on hover (`title`)
    and on unfold (a <details> whose summary is the cut text)."""
    full = "" if text is None else str(text)
    if len(full) <= limit:
        return Markup(_e(full))
    return Markup(f'<details class="clip" title="{_e(full)}"><summary>{_e(cut_words(full, limit))}</summary>'
                  f'<span class="full">{_e(full)}</span></details>')


def repro_link(path: str | None, links: bool) -> Markup:
    """A repro path as a relative link when the page can reach it (`ReportView.links`), else as code."""
    if not path:
        return Markup("")
    code = f"<code>{_e(path)}</code>"
    return Markup(f'<a class="repro" href="{_e(quote(path))}">{code}</a>' if links else code)


W, H = 760, 260
ML, MR, MT, MB = 64, 16, 18, 42


def _metric(p: LayerPoint, view: str, metric: str) -> float | None:
    d = p.cumulative if view == "cumulative" else p.isolated
    v = d.get(metric)
    if v is None:
        return None
    return 1.0 - v if metric == "cos" else v


def _threshold(threshold: dict[str, float | None], metric: str) -> float | None:
    t = threshold.get(metric)
    if t is None or not math.isfinite(t):
        return None
    return 1.0 - t if metric == "cos" else t


def _e(text: Any) -> str:
    """Escaped text for HTML (illegal XML characters are replaced on the whole page at the end)."""
    return html.escape("" if text is None else str(text), quote=True)


@dataclass(frozen=True)
class _Scale:
    """A chart's plot area: `n` layers along x, decades `lo`..`hi` of a log scale along y."""

    n: int
    lo: int
    hi: int

    @property
    def pw(self) -> float:
        return W - ML - MR

    @property
    def ph(self) -> float:
        return H - MT - MB

    @property
    def step(self) -> float:
        return self.pw / max(self.n, 1)

    def x(self, i: int) -> float:
        return ML + (i + 0.5) * self.step

    def y(self, v: float | None) -> tuple[float, str]:
        """Plot position and the kind of point: value, zero (at the floor) or nonfinite (at the top)."""
        if v is None:
            return (MT + self.ph, "none")
        if math.isnan(v) or math.isinf(v):
            return (MT, "nonfinite")
        if v <= 0:
            return (MT + self.ph, "zero")
        t = (math.log10(v) - self.lo) / (self.hi - self.lo)
        return (MT + self.ph - max(0.0, min(1.0, t)) * self.ph, "value")


def artifact_links(cv: Any, hooks: Sequence[tuple[str, Any]], *, base: str, links: bool) -> str:
    """The files each mode left in the cell folder for another tool (`ModeHooks.artifacts`), as links from the
    report folder when it can reach them (`links`), else as paths."""
    items = [item for _, h in hooks if hasattr(h, "artifacts") for item in h.artifacts(cv.cell)]
    if not items:
        return ""
    parts = [f"{_e(label)} {repro_link(posixpath.normpath(posixpath.join(base, path)), links)}" for label, path in items]
    return '<p class="files">Files: ' + " · ".join(parts) + "</p>"


def mode_blocks(cv: Any, hooks: Sequence[tuple[str, Any]]) -> dict[str, Markup]:
    """What each mode adds to a cell's block (`registry.ModeHooks`), in mode order: its charts, then its tables."""
    return {"charts": Markup("".join(h.html_charts(cv.cell) for _, h in hooks)),
            "tables": Markup("".join(h.html_tables(cv.cell) for _, h in hooks))}


def layer_chart(nv: NumericsView, metric: str, *, cell_id: str, label: str, hidden: bool = False) -> str:
    """An SVG chart of every layer's `metric` (cumulative and isolated) against its threshold."""
    pts = nv.layers
    n = len(pts)
    series = {v: [_metric(p, v, metric) for p in pts] for v in ("cumulative", "isolated")}
    thr = [_threshold(p.threshold, metric) for p in pts]
    thr_iso = [_threshold(p.threshold_isolated, metric) if p.threshold_isolated else t for p, t in zip(pts, thr)]
    if thr_iso == thr:
        thr_iso = []
    finite = [x for xs in (*series.values(), thr, thr_iso) for x in xs if x is not None and math.isfinite(x) and x > 0]
    lo = math.floor(math.log10(min(finite))) if finite else -8
    hi = math.ceil(math.log10(max(finite))) if finite else 0
    if hi - lo < 2:
        lo, hi = lo - 1, hi + 1
    sc = _Scale(n=n, lo=lo, hi=hi)
    first = nv.verdict.get("first_divergent")
    flagged = sum(1 for p in pts if p.flagged_cumulative or p.flagged_isolated)
    out: list[str] = [
        f'<svg class="chart{" hidden" if hidden else ""}" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
        f'role="img" data-cell="{_e(cell_id)}" data-metric="{metric}" data-layers="{n}" data-flagged="{flagged}">',
        f"<title>{_e(cell_id)}: per-layer {_e(label)} against threshold ({n} layers, {flagged} flagged)</title>",
        f'<rect class="plot" x="{ML}" y="{MT}" width="{sc.pw:.1f}" height="{sc.ph}"/>',
    ]
    out += _chart_axes(sc, pts, label)
    out += _chart_first(sc, pts, first)
    out += _chart_lines(sc, series, thr, thr_iso)
    out += _chart_points(sc, pts, series, thr, thr_iso)
    out.append("</svg>")
    return "".join(out)


def _chart_axes(sc: _Scale, pts: Sequence[LayerPoint], label: str) -> list[str]:
    """Grid lines and decade ticks, layer-index ticks and the two axis titles."""
    out: list[str] = []
    lo, hi, ph, pw, n = sc.lo, sc.hi, sc.ph, sc.pw, sc.n
    every = max(1, math.ceil((hi - lo) / 8))
    for dec in range(lo, hi + 1, every):
        yy = MT + ph - (dec - lo) / (hi - lo) * ph
        out.append(f'<line class="grid" x1="{ML}" x2="{ML + pw:.1f}" y1="{yy:.1f}" y2="{yy:.1f}"/>')
        out.append(f'<text class="tick" x="{ML - 6}" y="{yy + 4:.1f}" text-anchor="end">1e{dec}</text>')
    xticks = max(1, math.ceil(n / 12))
    for i in range(0, n, xticks):
        out.append(f'<text class="tick" x="{sc.x(i):.1f}" y="{MT + ph + 14}" text-anchor="middle">{pts[i].index}</text>')
    out.append(f'<text class="axis" x="{ML + pw / 2:.1f}" y="{H - 6}" text-anchor="middle">layer (execution order)</text>')
    out.append(f'<text class="axis" transform="translate(14 {MT + ph / 2:.1f}) rotate(-90)" text-anchor="middle">{_e(label)}</text>')
    return out


def _chart_first(sc: _Scale, pts: Sequence[LayerPoint], first: Any) -> list[str]:
    """The vertical marker of the first divergent layer, if any."""
    if not first:
        return []
    for i, p in enumerate(pts):
        if p.name == first:
            anchor = "end" if i > sc.n / 2 else "start"
            dx = -4 if anchor == "end" else 4
            return [f'<line class="first" x1="{sc.x(i):.1f}" x2="{sc.x(i):.1f}" y1="{MT}" y2="{MT + sc.ph}"/>',
                    f'<text class="firstlabel" x="{sc.x(i) + dx:.1f}" y="{MT + 12}" text-anchor="{anchor}">'
                    f"first divergent: {_e(first)}</text>"]
    return []


def _chart_lines(sc: _Scale, series: Mapping[str, list[float | None]], thr: list[float | None],
                 thr_iso: list[float | None]) -> list[str]:
    """Thresholds as step lines, broken where a layer has none (the isolated one only when it differs), then one
    polyline per view."""
    out: list[str] = []
    for values, cls in ((thr, "thr"), (thr_iso, "thr thr-iso")):
        d: list[str] = []
        pen = False
        for i, t in enumerate(values):
            if t is None or t <= 0:
                pen = False
                continue
            yy, _ = sc.y(t)
            x0, x1 = ML + i * sc.step, ML + (i + 1) * sc.step
            d.append(f"{'L' if pen else 'M'}{x0:.1f} {yy:.1f}H{x1:.1f}")
            pen = True
        if d:
            out.append(f'<path class="{cls}" d="{"".join(d)}"/>')
    for view, cls in (("cumulative", "cum"), ("isolated", "iso")):
        coords = [f"{sc.x(i):.1f},{sc.y(v)[0]:.1f}" for i, v in enumerate(series[view]) if v is not None]
        if coords:
            out.append(f'<polyline class="line {cls}" data-view="{view}" points="{" ".join(coords)}"/>')
    return out


def _chart_points(sc: _Scale, pts: Sequence[LayerPoint], series: Mapping[str, list[float | None]],
                  thr: list[float | None], thr_iso: list[float | None]) -> list[str]:
    """Per layer: nonfinite and flag marks, and a hover area whose title lists the values."""
    out: list[str] = []
    for i, p in enumerate(pts):
        for view, flag, shape in (("cumulative", p.flagged_cumulative, "circle"), ("isolated", p.flagged_isolated, "diamond")):
            yy, kind = sc.y(series[view][i])
            if kind == "nonfinite":
                out.append(f'<path class="nonfinite" d="M{sc.x(i):.1f} {MT - 1}l-5 9h10z"/>')
            if not flag:
                continue
            if shape == "circle":
                out.append(f'<circle class="flag flag-cum" cx="{sc.x(i):.1f}" cy="{yy:.1f}" r="4.5"/>')
            else:
                out.append(f'<path class="flag flag-iso" d="M{sc.x(i):.1f} {yy - 5:.1f}l5 5l-5 5l-5 -5z"/>')
        tip = [f"#{p.index} {p.label} ({p.module_class})" if p.module_class else f"#{p.index} {p.label}"]
        for view in ("cumulative", "isolated"):
            tip.append(f"{view}: {fmt_num(series[view][i])}")
        tip.append(f"threshold: {fmt_num(thr[i])}" + (f" (isolated {fmt_num(thr_iso[i])})" if thr_iso and thr_iso[i] != thr[i] else ""))
        if p.flagged_cumulative or p.flagged_isolated:
            tip.append("flagged: " + ", ".join(v for v, f in (("cumulative", p.flagged_cumulative), ("isolated", p.flagged_isolated)) if f))
        out.append(f'<rect class="hit" x="{ML + i * sc.step:.1f}" y="{MT}" width="{sc.step:.2f}" height="{sc.ph}">'
                   f"<title>{_e(chr(10).join(tip))}</title></rect>")
    return out


def layer_table(nv: NumericsView) -> str:
    """The per-layer table under a cell's charts (built in code: big runs have thousands of rows)."""
    out = ['<table><thead><tr><th>#</th><th>layer</th><th>class</th><th>cum rel</th><th>iso rel</th><th>≤ rel</th>'
           '<th>cum 1 − cos</th><th>iso 1 − cos</th><th>≤ 1 − cos</th><th>flagged</th></tr></thead><tbody>']
    for p in nv.layers:
        row_cls = ' class="s-fail"' if p.flagged_cumulative or p.flagged_isolated else ""
        c, i, t = p.cumulative, p.isolated, p.threshold
        out.append(
            f'<tr{row_cls}><td class="num">{p.index}</td><td><code>{_e(p.label)}</code></td>'
            f"<td>{_e(p.module_class)}</td>"
            f'<td class="num">{_e(fmt_num(c.get("rel")))}</td><td class="num">{_e(fmt_num(i.get("rel")))}</td>'
            f'<td class="num muted">{_e(fmt_num(t.get("rel")))}</td>'
            f'<td class="num">{_e(cos_distance(c.get("cos")))}</td><td class="num">{_e(cos_distance(i.get("cos")))}</td>'
            f'<td class="num muted">{_e(cos_distance(t.get("cos")))}</td>'
            f"<td>{'cumulative ' if p.flagged_cumulative else ''}{'isolated' if p.flagged_isolated else ''}</td></tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def findings_html(cv: CellView, limit: int = MAX_FINDINGS_PER_CELL, *, links: bool = False) -> str:
    """A cell's first `limit` findings, each with its message, the op's call, metrics against thresholds and
    repro (a link when `links`)."""
    out: list[str] = []
    for fv in cv.findings[:limit]:
        f = fv.finding
        head = (f'<div class="finding" data-fingerprint="{_e(f.fingerprint)}">\n<b>{_e(f.kind)}</b> <code>{_e(fv.title)}</code> '
                f'<span class="muted">({_e(fv.mode)}, {_e(f.stage)}{", " + _e(f.error_type) if f.error_type else ""})</span>')
        out.append(head)
        if fv.call:
            more = f' <span class="muted">(and {fv.more_calls} more signatures)</span>' if fv.more_calls else ""
            out.append(f'<br>call: <code class="call">{_e(fv.call)}</code>{more}')
        if f.module and f.kind in kinds_in(SECTION_DIVERGENT):
            out.append(f"<br>layer: <code>{_e(f.module)}</code>" + (f" ({_e(f.module_class)})" if f.module_class else ""))
        if fv.repro:
            where = f" <code>{_e(fv.cell_dir)}</code>" if fv.cell_dir else ""
            cmd = f" · run it from the cell folder{where}: <code>{_e(fv.command)}</code>" if fv.command else ""
            out.append(f"<br>repro: {repro_link(fv.repro, links)} {'(verified)' if fv.verified else '(not verified)'}{cmd}")
        if fv.metrics_text:
            out.append(f"<br>{_e(fv.metrics_text)}")
        if fv.reach:
            out.append(f"<br>model output: {_e(fv.reach)}")
        if fv.same_cause:
            out.append(f"<br>cause: {_e(fv.same_cause)}")
        out.append(f"<pre>{_e(f.message)}</pre>\n</div>")
    return "\n".join(out)


class _Strings:
    """A string table: each distinct string is stored once in the embedded data."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}
        self.items: list[str] = []

    def __call__(self, text: str | None) -> int:
        key = text or ""
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.items)
            self.items.append(key)
        return i


def compact_findings(cv: CellView, start: int, strings: _Strings) -> list[list[int]]:
    """Findings from `start` on as rows of string-table indexes: kind, title (with the op's call), mode, headline
    (cut at a word), repro (as the report folder reaches it, with "(verified)"), metrics."""
    rows = []
    for fv in cv.findings[start:]:
        summary = cut_words(fv.summary, SUMMARY_CHARS)
        repro = (fv.repro + (" (verified)" if fv.verified else "")) if fv.repro else ""
        title = f"{fv.title}: {fv.call}" if fv.call else fv.title
        rows.append([strings(fv.finding.kind), strings(title), strings(fv.mode), strings(summary),
                     strings(repro), strings(fv.metrics_text)])
    return rows


def compact_layers(nv: NumericsView, strings: _Strings) -> list[list[Any]]:
    """Per-layer rows: index, then string-table indexes of name, class, cum rel, iso rel, ≤ rel,
    cum/iso/≤ 1 − cos and flagged."""
    def n(x: Any) -> int:
        return strings(fmt_num(x))

    def cd(x: Any) -> int:
        return strings(cos_distance(x))

    rows = []
    for p in nv.layers:
        c, i, t = p.cumulative, p.isolated, p.threshold
        flagged = ("cumulative " if p.flagged_cumulative else "") + ("isolated" if p.flagged_isolated else "")
        rows.append([p.index, strings(p.label), strings(p.module_class), n(c.get("rel")), n(i.get("rel")), n(t.get("rel")),
                     cd(c.get("cos")), cd(i.get("cos")), cd(t.get("cos")), strings(flagged.strip())])
    return rows


def embedded_data(data: dict[str, Any]) -> Markup:
    """JSON for a ``<script type="application/json">``: no ``<`` at all, so no ``</script>``."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":")).replace("<", "\\u003c")
    return Markup(text)


def _anchor(cell_id: str) -> str:
    """A unique, URL-safe element id for a cell."""
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in cell_id)
    return f"cell-{safe}-{hashlib.sha1(cell_id.encode('utf-8', 'surrogatepass')).hexdigest()[:6]}"


_ENV: jinja2.Environment | None = None


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ci_runner", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(num=fmt_num, cosd=cos_distance, icon=icon, first_line=headline, clip=clip)
    env.globals.update(repro_link=repro_link)
    return env


def compile_table(cv: CellView) -> str:
    """The cell's compile time per mode and phase (`data.compiles`), "" when nothing compiled."""
    rows = [r for r in compile_costs(cv.cell) if r.graphs or r.compile_s]
    if not rows:
        return ""
    total = ' class="total"'
    body = "".join(f"<tr{total if r.phase == 'total' else ''}><td>{_e(r.mode)}</td><td>{_e(r.phase)}</td>"
                   f"<td>{r.graphs}</td><td>{r.compile_s:.2f}</td></tr>" for r in rows)
    return ("<details class=\"compiles\"><summary>compile time: where it went</summary><table><thead><tr><th>mode</th>"
            f"<th>phase</th><th>graphs</th><th>compile s</th></tr></thead><tbody>{body}</tbody></table></details>")


def render_html(
    results: Results,
    *,
    out_dir: Path | None = None,
    run_dir: Path | None = None,
    view: ReportView | None = None,
    diff: Any = None,
    trends: Any = None,
) -> str:
    """The page; `trends` (history.trends.Trends) adds the history section."""
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    v = view or build_view(results, out_dir=out_dir, run_dir=run_dir, diff=diff)
    charts: dict[str, list[tuple[str, str, Markup]]] = {}
    blocks: dict[str, dict[str, Markup]] = {}
    lazy: dict[str, dict[str, Any]] = {}  # anchor → compact rows drawn on demand
    strings = _Strings()
    full_left, chart_cells = MAX_FULL_FINDINGS, 0
    hooks = mode_hooks()
    for cv in v.cells:
        shown = max(0, min(len(cv.findings), MAX_FINDINGS_PER_CELL, full_left))
        full_left -= shown
        blocks[cv.id] = {"findings": Markup(findings_html(cv, shown, links=v.links)), "layers": Markup(""),
                         "compiles": Markup(compile_table(cv)), **mode_blocks(cv, hooks)}
        blocks[cv.id]["files"] = Markup(artifact_links(cv, hooks, base=cv.base, links=v.links))
        entry: dict[str, Any] = {}
        if shown < len(cv.findings):
            entry["findings"] = compact_findings(cv, shown, strings)
        if cv.numerics and cv.numerics.layers:
            if chart_cells < MAX_CHART_CELLS:
                chart_cells += 1
                charts[cv.id] = [(m, label, Markup(layer_chart(cv.numerics, m, cell_id=cv.id, label=label, hidden=i > 0)))
                                 for i, (m, label) in enumerate(CHART_METRICS)]
                blocks[cv.id]["layers"] = Markup(layer_table(cv.numerics))
            else:
                entry["layers"] = compact_layers(cv.numerics, strings)
        if entry:
            lazy[_anchor(cv.id)] = entry
    data = embedded_data({"strings": strings.items, "cells": lazy}) if lazy else None
    # Illegal characters become visible escapes in one pass over the page (ASCII escapes: the same
    # as escaping every value, far faster than a filter on each).
    return xml_safe(_ENV.get_template("report.html.j2").render(
        v=v, diff=v.diff, charts=charts, blocks=blocks, lazy=lazy, data=data, max_chart_cells=MAX_CHART_CELLS,
        max_divergent=MAX_DIVERGENT_ROWS, anchor=_anchor, zoo=zoo_view(results.zoo) if results.zoo else None,
        trends_html=Markup(trends_html(trends)) if trends is not None and trends.dates else None,
    ))
