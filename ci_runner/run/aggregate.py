"""Merge cell results (from one run folder or many CI artifacts) into one `Results`."""

from __future__ import annotations

import datetime as _dt
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .cellrun import RESULT_NAME
from ..engine.envinfo import tool_version
from ..errors import InputError
from ..report import write_reports
from ..plan import PlannedCell, apply_plan
from ..results.rootcause import root_causes
from ..results.model import CellResult, Results, iter_findings, load_cell_result, save_results

OP_KINDS = ("unsupported_op", "op_error", "op_mismatch")


def find_cell_results(paths: Sequence[Path], *, missing_ok: bool = False) -> list[Path]:
    """Every `result.json` under the given folders (a run folder, an artifact folder, or a cell folder).

    `missing_ok`: a folder that does not exist holds no result (with a plan, every job may have died).
    """
    found: list[Path] = []
    for p in paths:
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(p.rglob(RESULT_NAME)))
        elif missing_ok:
            continue
        else:
            raise InputError(f"{p}: no such file or folder", hint="pass run folders or downloaded cell artifacts")
    return found


def merge(cells: Iterable[tuple[Path, CellResult]]) -> list[CellResult]:
    """One result per cell id. A cell seen twice (a rerun) keeps the latest and records every attempt's status."""
    by_id: dict[str, list[tuple[Path, CellResult]]] = defaultdict(list)
    for path, c in cells:
        by_id[c.id].append((path, c))
    merged: list[CellResult] = []
    for cid, items in sorted(by_id.items()):
        items.sort(key=lambda pc: (pc[1].started_at or "", str(pc[0])))
        latest = items[-1][1]
        if len(items) > 1:
            prior = [c.status for _, c in items[:-1]]
            latest.env = {**latest.env, "attempts": [*prior, latest.status]}
        merged.append(latest)
    return merged


def op_ranking(results: Results) -> list[dict[str, object]]:
    """Failing operators ranked by how many models each one blocks."""
    models: dict[str, set[str]] = defaultdict(set)
    backends: dict[str, set[str]] = defaultdict(set)
    kinds: dict[str, set[str]] = defaultdict(set)
    for cell, _mode, f in iter_findings(results):
        if f.kind in OP_KINDS and f.op:
            models[f.op].add(cell.model)
            backends[f.op].add(cell.backend)
            kinds[f.op].add(f.kind)
    ranking = [
        {"op": op, "count": len(ms), "models": sorted(ms), "backends": sorted(backends[op]), "kinds": sorted(kinds[op])}
        for op, ms in models.items()
    ]
    ranking.sort(key=lambda r: (-int(r["count"]), str(r["op"])))  # type: ignore[call-overload]
    return ranking


def layer_patterns(results: Results) -> list[dict[str, object]]:
    """Divergent module classes / relative paths seen in more than one model or layer (a shared root cause)."""
    by_class: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    for cell, _mode, f in iter_findings(results):
        if f.kind == "divergence" and f.module:
            if f.module_class:
                by_class[("module_class", f.module_class)].add((cell.model, f.module))
            rel = f.module.rsplit(".", 1)[-1]
            by_class[("relative_path", "*." + rel)].add((cell.model, f.module))
    out = []
    for (kind, key), hits in by_class.items():
        models = sorted({m for m, _ in hits})
        if len(hits) > 1:
            out.append({"kind": kind, "pattern": key, "models": models, "modules": sorted(n for _, n in hits), "count": len(hits)})
    out.sort(key=lambda p: (-len(p["models"]), -int(p["count"]), str(p["pattern"])))  # type: ignore[arg-type]
    return out


def aggregate(paths: Sequence[Path], *, plan: Sequence[PlannedCell] | None = None,
              chunk_results: Mapping[int, str] | None = None) -> Results:
    """Merge the cell results under `paths`; with a `plan`, a planned cell without a result is an `error` cell."""
    files = find_cell_results(paths, missing_ok=plan is not None)
    cells = merge((p, load_cell_result(p)) for p in files)
    if plan is not None:
        cells = apply_plan(cells, plan, chunk_results)
    results = Results(cells=cells, tool_version=tool_version(),
                      generated_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    results.ranking = op_ranking(results)
    results.patterns = layer_patterns(results)
    results.root_causes = root_causes(results)  # also puts details.signature on every finding
    return results


def write_report_dir(results: Results, report_dir: Path, *, run_dir: Path | None = None,
                     trends: Any = None) -> dict[str, Path]:
    """results.json, junit.xml, summary.md and report.html (with the history's `trends` when given)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    written = {"results": save_results(results, report_dir / "results.json")}
    written.update(write_reports(results, report_dir, run_dir=run_dir, trends=trends))
    return written
