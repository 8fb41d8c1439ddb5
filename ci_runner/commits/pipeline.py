"""`deepview-ci bisect-regressions`: the nightly's bisection of regressed findings, for `file-issues` to quote.

For each ``regressed`` finding of a diff that has a repro, in a backend whose matrix entry has a `source`
(``{repo, setup, python?, max_steps?, step_timeout?, total_timeout?}``): when the last good run's backend commit
(`last_good_commit`) and this run's (the cell's env stamp, ``env.backend_source``) differ, the backend's history
between them is bisected (`bisect.bisect_targets`: one walk per root-cause signature). The answers go to
``bisect.json`` next to the diff; `file-issues` reads it and says "first failing at <commit> <subject>" with the
step log. A finding that cannot be bisected gets a note saying why; this command fails only on bad input.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping

from ..config import BackendSpec, Matrix
from ..errors import DeepviewError
from ..fsutil import atomic_write_json
from ..results.model import Finding, backend_commit
from .bisect import Request, Target, bisect_targets, target_in_cell
from .walk import Budget

BISECT_NAME = "bisect.json"


def last_good_commit(baseline_cells: Mapping[str, Any], cell_id: str) -> str | None:
    """The backend commit of `cell_id`'s last good run. Today: the baseline's (``Baseline.cells[id].backend_commit``);
    the run history (issue 20) can answer here instead, nothing else reads it."""
    commit = getattr(baseline_cells.get(cell_id), "backend_commit", None)
    return str(commit) if commit else None


def _budget(source: Mapping[str, Any]) -> Budget:
    d = Budget()
    return Budget(max_steps=int(source.get("max_steps", d.max_steps)),
                  step_timeout=float(source.get("step_timeout", d.step_timeout)),
                  total_timeout=float(source.get("total_timeout", d.total_timeout)))


def _plan(diff: Mapping[str, Any], matrix: Matrix, baseline_cells: Mapping[str, Any], run_dir: Path,
          notes: list[str]) -> dict[tuple[str, str, str], list[Target]]:
    """Regressed findings grouped by (backend, good, bad): what to bisect."""
    backends: dict[str, BackendSpec] = {b.id: b for b in matrix.backends}
    plan: dict[tuple[str, str, str], list[Target]] = {}
    for e in diff.get("entries", []):
        f = e.get("finding")
        if e.get("category") != "regressed" or not f or not f.get("repro"):
            continue
        label = f"{e['cell']} {e.get('fingerprint')}"
        spec = backends.get(e["backend"])
        if spec is None or not spec.source:
            notes.append(f"{label}: backend {e['backend']} has no `source` in the matrix: not bisected")
            continue
        good, bad = last_good_commit(baseline_cells, e["cell"]), backend_commit(e.get("env") or {})
        if not good or not bad or good == bad:
            why = "the baseline names no backend commit" if not good else (
                "this run's env names no backend commit" if not bad else "the backend commit did not change")
            notes.append(f"{label}: {why}: not bisected")
            continue
        try:
            target = target_in_cell(Finding.from_dict(f), run_dir / (e.get("artifacts_dir") or f"cells/{e['cell']}"), e["cell"])
        except DeepviewError as exc:
            notes.append(f"{label}: {exc.message}")
            continue
        plan.setdefault((spec.id, good, bad), []).append(target)
    return plan


def bisect_regressions(diff: Mapping[str, Any], matrix: Matrix, baseline_cells: Mapping[str, Any], *, run_dir: Path, out: Path,
                       cache: Path | None = None) -> dict[str, Any]:
    """Bisect the regressed findings of `diff` (module docstring) and write `out` (``bisect.json``)."""
    notes: list[str] = []
    found: list[dict[str, Any]] = []
    for (backend_id, good, bad), targets in _plan(diff, matrix, baseline_cells, run_dir, notes).items():
        spec = matrix.backend(backend_id)
        source = dict(spec.source or {})
        kw = {"cache": cache} if cache else {}
        req = Request(repo=Path(source["repo"]), good=good, bad=bad, setup=tuple(source["setup"]),
                      python=str(source.get("python") or spec.python or sys.executable), budget=_budget(source), **kw)
        try:
            for b in bisect_targets(req, targets):
                found.append({"backend": backend_id, **b.to_dict()})
        except DeepviewError as exc:  # one backend's broken source must not stop the report
            notes.append(f"{backend_id} {good[:12]}..{bad[:12]}: not bisected: {exc.message}")
    report = {"bisections": found, "notes": notes}
    atomic_write_json(out, report)
    return report


def bisections_by_finding(report: Mapping[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """``(cell, fingerprint)`` → its bisection, from a `bisect.json` (for the issue bodies)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for b in report.get("bisections", []):
        for label in b.get("findings", []):
            cell, _, fp = str(label).partition(" ")
            out[(cell, fp)] = b
    return out
