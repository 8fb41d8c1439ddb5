"""`summary.md`: what GitHub shows on the run page, and what an engineer reads first.

Order: regressions (when a diff is given) and failing cells first, then the cells × modes table,
the operator ranking, failing submodules, divergent layers with their metrics, and per-cell details
folded in ``<details>``. Always under GitHub's 1 MiB step-summary limit: past it the text is cut at
a line, open code fences and ``<details>`` are closed, and a note points at the full report.

Everything that comes from results (messages, names, stderr) is escaped: it cannot open a table
cell, a raw HTML tag or a code fence of its own.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

import jinja2

from ..fsutil import utf8_text
from ..log import STEP_SUMMARY_LIMIT
from ..registry import mode_hooks
from ..results.model import Results
from .junit import junit_counts, xml_safe
from ..failures.failure import headline
from .trendcharts import burndown_line, history_sections
from ..zoo.report import zoo_view
from .view import ReportView, build_view, costliest_compiles, cos_distance, fmt_num, icon

# The file stays this far under GitHub's limit, so that appending it after a few lines another
# step wrote still fits.
SUMMARY_LIMIT = STEP_SUMMARY_LIMIT - 8 * 1024
MAX_ROWS = 200  # rows per table before "… N more"
MAX_DETAILS_FINDINGS = 40  # findings shown per cell inside <details>
DEFAULT_POINTER = "the full report is `report.html` (with `results.json` and `junit.xml`) in the same folder / artifact"

_MD_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


def md(text: Any, limit: int | None = 300) -> str:
    """Inline Markdown text: one line, no raw HTML, no table-breaking pipes."""
    s = " ".join(str("" if text is None else text).split())
    if limit and len(s) > limit:
        s = s[: limit - 1] + "…"
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(r"\\\1", s).replace("\\|", "&#124;")


def h(text: Any, limit: int | None = 300) -> str:
    """Text inside an HTML tag of the Markdown (``<summary>``): escaped HTML, one line."""
    s = " ".join(str("" if text is None else text).split())
    if limit and len(s) > limit:
        s = s[: limit - 1] + "…"
    return html.escape(s, quote=True)


def code(text: Any) -> str:
    """Inline code span that survives backticks and pipes in the text."""
    s = " ".join(str("" if text is None else text).split())
    s = s.replace("|", "¦")  # a pipe inside a table cell ends the cell even in code spans
    ticks = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (ticks + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s else ""
    return f"{fence}{pad}{s}{pad}{fence}"


def block(text: Any, lang: str = "", limit: int = 4000) -> str:
    """A fenced code block longer than any backtick run inside `text`."""
    s = str("" if text is None else text).replace("\r\n", "\n").replace("\r", "\n")
    if len(s) > limit:
        s = s[: limit] + f"\n… [{len(s) - limit} characters cut]"
    ticks = max((len(m) for m in re.findall(r"`{3,}", s)), default=2)
    fence = "`" * max(3, ticks + 1)
    return f"{fence}{lang}\n{s.rstrip()}\n{fence}"


_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def truncate_markdown(text: str, limit: int, *, pointer: str = DEFAULT_POINTER, cut_already: int | None = None) -> str:
    """Cut Markdown to `limit` UTF-8 bytes at a line, closing open fences and ``<details>``.

    `cut_already` (the full size in bytes) says the text is already a cut prefix: it then gets the
    closing tags and the note even when it fits."""
    text = utf8_text(text)
    data = text.encode("utf-8")
    if len(data) <= limit and cut_already is None:
        return text
    reserve = 1024
    cut = data[: max(0, min(limit - reserve, len(data)))]
    nl = cut.rfind(b"\n")
    kept = cut[: nl + 1] if nl >= 0 else b""
    lines = kept.decode("utf-8", errors="ignore").splitlines(keepends=True)
    fence: str | None = None
    depth = 0
    for line in lines:
        m = _FENCE.match(line.rstrip("\n"))
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
                fence = None
            continue
        depth += line.count("<details") - line.count("</details>")
    tail = ""
    if fence is not None:
        tail += fence + "\n"
    tail += "</details>\n" * max(depth, 0)
    shown = len(kept)
    total = f"{cut_already:,}+" if cut_already is not None else f"{len(data):,}"
    tail += (f"\n> [!WARNING]\n> This summary was cut at {shown:,} of {total} bytes to stay under "
             f"GitHub's 1 MiB step-summary limit; {pointer}.\n")
    return "".join(lines) + tail


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("ci_runner", "templates"),
        autoescape=False,  # Markdown: every value goes through md/code/block instead
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters.update(md=md, h=h, code=code, block=block, num=fmt_num, cosd=cos_distance, icon=icon, first_line=headline)
    env.globals["burndown_line"] = burndown_line
    return env


_ENV: jinja2.Environment | None = None


def mode_sections(cells: Any) -> list[str]:
    """Each mode's own section of the summary (`registry.ModeHooks.summary_section`), in mode order; none empty."""
    return [s for _, h in mode_hooks() if (s := h.summary_section(cells, max_rows=MAX_ROWS))]


COMPILE_ROWS = 20  # the costliest phases shown in "Where the compile time went"


def compile_section(cells: Any, max_rows: int = COMPILE_ROWS) -> str:
    """Where the compile time went: the phases (every mode's, `data.compiles`) that compiled longest; "" when no
    cell compiled anything."""
    top, total = costliest_compiles(cells, max_rows)
    if not top:
        return ""
    lines = ["### Where the compile time went", "",
             f"{total.graphs} graph(s) compiled by the backends in {total.compile_s:.1f} s in all; the costliest phases:",
             "", "| cell | mode | phase | graphs | compile s |", "|---|---|---|---:|---:|"]
    lines += [f"| {code(r.cell)} | {md(r.mode)} | {md(r.phase)} | {r.graphs} | {r.compile_s:.1f} |" for r in top]
    return "\n".join(lines) + "\n"


def render_summary(
    results: Results,
    *,
    out_dir: Path | None = None,
    run_dir: Path | None = None,
    view: ReportView | None = None,
    diff: Any = None,
    limit: int = SUMMARY_LIMIT,
    pointer: str = DEFAULT_POINTER,
    trends: Any = None,
) -> str:
    """The summary Markdown, at most `limit` UTF-8 bytes. `trends` (history.trends.Trends) adds the history."""
    global _ENV
    if _ENV is None:
        _ENV = _environment()
    v = view or build_view(results, out_dir=out_dir, run_dir=run_dir, diff=diff)
    # Stream the template and stop once well past the limit: a huge run need not render details
    # that will be cut anyway. Characters ≤ bytes, so a prefix longer than limit + margin in
    # characters is surely over the limit after blank lines are collapsed.
    chunks: list[str] = []
    size = 0
    stopped = False
    budget = limit + 256 * 1024
    for chunk in _ENV.get_template("summary.md.j2").generate(
        v=v, max_rows=MAX_ROWS, max_details=MAX_DETAILS_FINDINGS, diff=v.diff, junit=junit_counts(v), trends=trends,
        zoo=zoo_view(results.zoo) if results.zoo else None,
        mode_sections=[s for s in (compile_section(results.cells), *mode_sections(results.cells)) if s],
        history_sections=history_sections(trends, "summary"),
    ):
        chunks.append(chunk)
        size += len(chunk)
        if size > budget:
            stopped = True
            break
    # Illegal characters (NUL, C0 controls, lone surrogates) become visible escapes in one pass;
    # the escapes are ASCII, so this after rendering equals escaping every value before.
    text = re.sub(r"\n{3,}", "\n\n", xml_safe("".join(chunks)))
    return truncate_markdown(text, limit, pointer=pointer, cut_already=len(utf8_text(text).encode("utf-8")) if stopped else None)
