"""The compile mode's figures in the reports and the history (its `registry.ModeHooks`, `HOOKS`): a per-cell table
(phase, graphs, breaks, recompiles, compile s, eager fallbacks), the summary's section with the worst offenders,
JUnit properties, and its figures per backend over the nights (summed over cells and phases: a line in the summary,
charts in report.html). Reads `data.phases` of each cell's `compile` mode result (`checks.py`, `PhaseSignals.row`)
and the history's named figures (`compile.<figure>.<phase>`, `mode.figures_of`); no torch."""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, Mapping, Sequence

from ...registry import ModeHooks
from ...report.summary import code
from ...report.trendcharts import line_chart
from ...results.model import CellResult

__all__ = ["compile_rows", "markdown_table", "html_table", "junit_properties", "worst_offenders", "summary_section",
           "compile_by_backend", "compile_line", "compile_html", "HOOKS"]

MODE = "compile"
UNKNOWN = "unknown"  # a figure this torch's structured trace did not give
COLUMNS = ("phase", "graphs", "breaks", "recompiles", "compile s", "eager fallbacks")


def compile_rows(cell: CellResult) -> list[dict[str, Any]]:
    """One row per measured phase of the cell's compile mode (none when it did not run)."""
    mode = cell.modes.get(MODE)
    phases = (mode.data.get("phases") if mode is not None and isinstance(mode.data, Mapping) else None) or {}
    out = []
    for name, row in phases.items():
        if not isinstance(row, Mapping) or row.get("status") == "skipped":
            continue
        eager = list(row.get("eager_fallbacks") or [])
        if row.get("eager_after_limit"):
            eager.append(f"recompile limit: {len(row.get('eager_calls') or [])} call(s) in eager")
        out.append({"cell": cell.id, "phase": name, "graphs": int(row.get("graphs") or 0),
                    "breaks": _count(row, "graph_breaks"), "recompiles": _count(row, "recompiles"),
                    "compile_s": float(row["compile_s"]) if row.get("compile_s") is not None else None, "eager": eager,
                    "error": row.get("error")})
    return out


def _count(row: Mapping[str, Any], key: str) -> int | str:
    """How many `key` the phase had: "unknown" where this torch's trace did not say (`data.phases.<phase>.unknown`)."""
    return UNKNOWN if key in (row.get("unknown") or {}) else len(row.get(key) or [])


def _num(value: int | str) -> int:
    return value if isinstance(value, int) else 0


def _secs(value: float | None, digits: int = 2) -> str:
    return UNKNOWN if value is None else f"{value:.{digits}f}"


def _eager_text(eager: list[str], limit: int = 4) -> str:
    return ", ".join(eager[:limit]) + (f" … (+{len(eager) - limit})" if len(eager) > limit else "") if eager else "—"


def markdown_table(cells: Iterable[CellResult], *, max_rows: int = 50) -> str:
    """The summary's table over every cell that ran the compile mode ("" when none did)."""
    rows = [r for c in cells for r in compile_rows(c)]
    if not rows:
        return ""
    lines = ["| cell | " + " | ".join(COLUMNS) + " |", "|---|---|--:|--:|--:|--:|---|"]
    for r in rows[:max_rows]:
        eager = _eager_text(r["eager"]).replace("|", "\\|")
        lines.append(f"| `{r['cell']}` | {r['phase']} | {r['graphs']} | {r['breaks']} | {r['recompiles']} | "
                     f"{_secs(r['compile_s'])} | {eager} |")
    if len(rows) > max_rows:
        lines.append(f"\n… and {len(rows) - max_rows} more rows (results.json: `modes.compile.data.phases`).")
    return "\n".join(lines)


def worst_offenders(cells: Iterable[CellResult], n: int = 5) -> list[dict[str, Any]]:
    """The phases with the most graph breaks, recompiles and eager fallbacks (then compile seconds)."""
    rows = [r for c in cells for r in compile_rows(c) if r["breaks"] or r["recompiles"] or r["eager"]]
    return sorted(rows, key=lambda r: (-(_num(r["breaks"]) + _num(r["recompiles"]) + len(r["eager"])),
                                       -(r["compile_s"] or 0.0)))[:n]


def html_table(cell: CellResult) -> str:
    """The cell's table in report.html ("" when the cell did not run the compile mode)."""
    rows = compile_rows(cell)
    if not rows:
        return ""
    head = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
    body = "".join(
        f"<tr><td>{escape(r['phase'])}</td><td class=\"num\">{r['graphs']}</td><td class=\"num\">{r['breaks']}</td>"
        f"<td class=\"num\">{r['recompiles']}</td><td class=\"num\">{_secs(r['compile_s'])}</td>"
        f"<td>{escape(_eager_text(r['eager'], 8))}</td></tr>" for r in rows)
    return f'<table class="compile"><caption>compile, per phase</caption><tr>{head}</tr>{body}</table>'


def junit_properties(cell: CellResult) -> list[tuple[str, str]]:
    """`compile.<phase>.<figure>` properties of the cell's testsuite."""
    out: list[tuple[str, str]] = []
    for r in compile_rows(cell):
        p = f"compile.{r['phase']}"
        out += [(f"{p}.graphs", str(r["graphs"])), (f"{p}.graph_breaks", str(r["breaks"])),
                (f"{p}.recompiles", str(r["recompiles"])), (f"{p}.compile_s", _secs(r["compile_s"], 3)),
                (f"{p}.eager_fallbacks", str(len(r["eager"])))]
    return out


def summary_section(cells: Iterable[CellResult], *, max_rows: int = 50) -> str:
    """summary.md's section: the worst offenders, then the table ("" when no cell ran the compile mode)."""
    cells = list(cells)
    table = markdown_table(cells, max_rows=max_rows)
    if not table:
        return ""
    worst = worst_offenders(cells)
    out = "### Compile: graphs, breaks, recompiles per phase\n\n"
    if worst:
        out += "Worst offenders: " + " · ".join(
            f"{code(r['cell'])} {r['phase']} ({r['breaks']} break(s), {r['recompiles']} recompile(s)"
            + (f", {len(r['eager'])} eager fallback(s)" if r["eager"] else "") + ")" for r in worst) + "\n"
    return out + table + "\n"


# --------------------------------------------------------------------------- the history

FIGURES = ("graphs", "graph_breaks", "recompiles", "compile_s")  # charted per backend


def compile_by_backend(figures: Mapping[str, Mapping[str, Sequence[float | None]]],
                       nights: int) -> dict[str, dict[str, list[float | None]]]:
    """The compile mode's figures (`compile.<figure>.<phase>`) per backend (a cell id's part after `@`) and night:
    summed over the backend's cells and phases that night (None: none of them had it, e.g. unknown on its torch)."""
    out: dict[str, dict[str, list[float | None]]] = {}
    for cell, named in sorted(figures.items()):
        backend = cell.rsplit("@", 1)[-1]
        for name, vals in sorted(named.items()):
            mode, _, rest = name.partition(".")
            figure = rest.split(".", 1)[0]
            if mode != MODE or figure not in FIGURES:
                continue
            series = out.setdefault(backend, {}).setdefault(figure, [None] * nights)
            for i, v in enumerate(list(vals)[-nights:] if nights else []):
                if v is not None:
                    series[i] = (series[i] or 0.0) + v
    return out


def _fmt(v: float | None) -> str:
    return "—" if v is None else (str(int(v)) if float(v).is_integer() else f"{v:.1f}")


def compile_line(figures: Mapping[str, Sequence[float | None]]) -> str:
    """One backend's compile figures (`compile_by_backend`): today, 7 and 30 nights ago."""
    def one(name: str, label: str) -> str:
        v = list(figures.get(name) or [])
        ago = [_fmt(v[-1 - n]) if len(v) > n else "—" for n in (0, 7, 30)]
        return f"{label} {ago[0]} today, {ago[1]} 7 nights ago, {ago[2]} 30 nights ago"

    return " · ".join(one(n, label) for n, label in (("graphs", "graphs"), ("graph_breaks", "graph breaks"),
                                                     ("recompiles", "recompiles"), ("compile_s", "compile s")))


def history_summary(by_backend: Mapping[str, Mapping[str, Sequence[float | None]]]) -> str:
    """The summary's history lines: one per backend."""
    lines = [f"- {code(b)}: {compile_line(f)}" for b, f in sorted(by_backend.items())]
    return "#### ⚙️ Compile figures per backend (all its cells and phases)\n\n" + "\n".join(lines) + "\n"


def compile_html(by_backend: Mapping[str, Mapping[str, Sequence[float | None]]], dates: Sequence[str]) -> str:
    """The compile mode's figures per backend over the nights: its counts, and compile seconds per backend."""
    if not by_backend:
        return ""
    out = ["<h3>Compile figures per backend</h3>"]
    for backend, figures in sorted(by_backend.items()):
        out.append(f"<p><code>{escape(backend)}</code>: {escape(compile_line(figures))}</p>")
        out.append(line_chart(f"{backend}: graphs, graph breaks and recompiles per night (all its cells and phases)",
                              dates, [(n.replace("_", " "), figures.get(n) or [None] * len(dates))
                                      for n in ("graphs", "graph_breaks", "recompiles")],
                              kind="compile", ylabel="count"))
    secs = [(b, f["compile_s"]) for b, f in sorted(by_backend.items()) if f.get("compile_s")]
    if secs:
        out.append(line_chart("compile seconds per night and backend (all its cells and phases)", dates, secs,
                              kind="compile-time", ylabel="seconds"))
    return "".join(out)


class CompileHooks(ModeHooks):
    """The compile mode in summary.md, report.html, junit.xml and the history."""

    def summary_section(self, cells: Sequence[CellResult], *, max_rows: int) -> str:
        return summary_section(cells, max_rows=max_rows)

    def html_tables(self, cell: CellResult) -> str:
        return html_table(cell)

    def junit_properties(self, cell: CellResult) -> list[tuple[str, str]]:
        return junit_properties(cell)

    def history_figures(self, figures: Mapping[str, Mapping[str, Sequence[float | None]]], nights: int) -> Any:
        return compile_by_backend(figures, nights)

    def history_summary(self, data: Any) -> str:
        return history_summary(data)

    def history_html(self, data: Any, dates: Sequence[str]) -> str:
        return compile_html(data, dates)

    def artifacts(self, cell: CellResult) -> list[tuple[str, str]]:
        return trace_files(cell)


def trace_files(cell: CellResult) -> list[tuple[str, str]]:
    """Each phase's structured trace kept for tlparse (`data.phases.<phase>.trace.file`), as report.html links it."""
    mode = cell.modes.get(MODE)
    phases = ((mode.data or {}).get("phases") or {}) if mode is not None else {}
    return [(f"TORCH_TRACE for tlparse ({name})", str(row["trace"]["file"])) for name, row in phases.items()
            if isinstance(row, Mapping) and isinstance(row.get("trace"), Mapping) and row["trace"].get("file")]


HOOKS = CompileHooks()
