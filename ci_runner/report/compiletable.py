"""The compile mode's figures in the reports: a per-cell table (phase, graphs, breaks, recompiles, compile s,
eager fallbacks), the worst offenders for the summary, and JUnit properties. Reads `data.phases` of each cell's
`compile` mode result (`modes/compile/checks.py`, `PhaseSignals.row`); no torch."""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, Mapping

from ..results.model import CellResult

__all__ = ["compile_rows", "markdown_table", "html_table", "junit_properties", "worst_offenders"]

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
