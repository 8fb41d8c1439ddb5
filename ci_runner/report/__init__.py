"""The reports of a run: ``junit.xml``, ``summary.md`` and ``report.html``, from one `Results`.

`write_reports` is what ``deepview-ci run`` and ``deepview-ci aggregate`` call after writing
``results.json``. All three files are written atomically and say the same thing, because they are
rendered from one view (`view.build_view`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..fsutil import atomic_write_chunks, atomic_write_text
from ..log import append_step_summary
from ..results.model import Results
from .html import render_html
from .junit import junit_chunks, render_junit, xml_safe
from .summary import SUMMARY_LIMIT, render_summary, truncate_markdown
from .view import build_view

__all__ = ["write_reports", "render_junit", "render_summary", "render_html", "truncate_markdown", "xml_safe",
           "SUMMARY_LIMIT"]


def write_reports(
    results: Results,
    out_dir: Path,
    *,
    run_dir: Path | None = None,
    diff: Any = None,
    env: Mapping[str, str] | None = None,
    trends: Any = None,
    write_dir: Path | None = None,
) -> dict[str, Path]:
    """Write junit.xml, summary.md and report.html into `out_dir`; return their paths.

    Repro paths are shown relative to `out_dir` when `run_dir` (the folder holding ``cells/``) is
    given. With `diff` (a `baseline.Diff`), regressions lead the summary and the page. When
    ``GITHUB_STEP_SUMMARY`` is set (in `env`, default ``os.environ``), the summary is appended to
    it within GitHub's 1 MiB cap. With `trends` (``history.trends.Trends``), the summary and the page carry
    the history: since when each finding fails, flaky and drifting findings, burn-downs and charts. With
    `write_dir`, the files are written there instead (a staging folder, `run.aggregate.write_report_dir`), their
    links still made for `out_dir`.
    """
    out = Path(out_dir)
    dest = Path(write_dir) if write_dir is not None else out
    dest.mkdir(parents=True, exist_ok=True)
    view = build_view(results, out_dir=out if run_dir is not None else None, run_dir=run_dir, diff=diff)
    paths = {
        "junit": atomic_write_chunks(dest / "junit.xml", junit_chunks(view)),
        "summary": atomic_write_text(dest / "summary.md", summary := render_summary(results, view=view, trends=trends)),
        "html": atomic_write_text(dest / "report.html", render_html(results, view=view, trends=trends)),
    }
    append_step_summary(summary, env=env, pointer="the full report is `report.html` in the run's report artifact")
    return paths
