"""Merge cell results (from one run folder or many CI artifacts) into one `Results`."""

from __future__ import annotations

import datetime as _dt
import os
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..engine.envinfo import tool_version
from ..procs.isolate import open_entry
from ..errors import InputError
from ..fsutil import OutputError, output_error
from ..report import write_reports
from ..plan import NO_RESULT, SETUP_RECORD, TAIL_CHARS, Evidence, PlannedCell, apply_plan, read_setup_record
from ..registry import SECTION_OPS, FindingKind, kinds_in
from ..backends.vendor import boilerplate_lines
from ..results.rootcause import cause_row, root_causes, shared_causes, signature
from ..zoo.report import zoo_section
from ..results.model import (JOURNAL_NAME, PARTIAL_NAME, RESULT_NAME, STARTED_NAME, STDERR_NAME, CellError, CellResult, ModeResult,
                             Results, iter_findings, load_cell_result, read_json, save_results)


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
    """Failing operators ranked by how many models each one blocks; an op that fails only through an error shared
    by several ops (raised in torch, e.g. Dynamo's guard building) counts under that cause (`rootcause.shared_causes`),
    as one row with `op` None, `cause`, `error_type`, `message`, `raised_in` and the `ops` it failed."""
    found = [(cell, f) for cell, _mode, f in iter_findings(results) if f.kind in kinds_in(SECTION_OPS) and f.op]
    shared = shared_causes((f for _, f in found), boilerplate=boilerplate_lines())
    rows: dict[str, dict[str, Any]] = {}
    for cell, f in found:
        sig = signature(f, boilerplate=boilerplate_lines()) if shared and f.error_type else None
        key = sig.id if sig is not None and sig.id in shared else f"op:{f.op}"
        row = rows.get(key)
        if row is None:
            row = rows[key] = {**(cause_row(shared[key]) if key in shared else {"op": f.op}),
                               "models": set(), "backends": set(), "kinds": set()}
        row["models"].add(cell.model)
        row["backends"].add(cell.backend)
        row["kinds"].add(f.kind)
        if key in shared and f.op not in row["ops"]:
            row["ops"].append(f.op)
    ranking = [{**r, "count": len(r["models"]), "models": sorted(r["models"]), "backends": sorted(r["backends"]),
                "kinds": sorted(r["kinds"])} for r in rows.values()]
    for r in ranking:
        if r.get("ops"):
            r["ops"] = sorted(r["ops"])
    ranking.sort(key=lambda r: (-int(r["count"]), r["op"] is not None, -len(r.get("ops") or ()),
                                str(r["op"] or r["cause"])))
    return ranking


def layer_patterns(results: Results) -> list[dict[str, object]]:
    """Divergent module classes / relative paths seen in more than one model or layer (a shared root cause)."""
    by_class: dict[tuple[str, str], set[tuple[str, str]]] = defaultdict(set)
    for cell, _mode, f in iter_findings(results):
        if f.kind == FindingKind.DIVERGENCE and f.module:
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


def zoo_records(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """The per-backend zoo records (`<run>/zoo/<backend>.json`, written by `zoo/run.py`) under `run_dirs`."""
    out = []
    for d in run_dirs:
        for p in sorted((Path(d) / "zoo").glob("*.json")):
            out.append(read_json(p, what="zoo record"))
    return out


def aggregate(paths: Sequence[Path], *, plan: Sequence[PlannedCell] | None = None,
              chunk_results: Mapping[int, str] | None = None, run_dirs: Sequence[Path] | None = None) -> Results:
    """Merge the cell results under `paths`; with a `plan`, a planned cell without a result is an `error` cell.
    The zoo section comes from the zoo records under `run_dirs` (default: the folders among `paths`)."""
    files = find_cell_results(paths, missing_ok=plan is not None)
    cells = merge((p, load_cell_result(p)) for p in files)
    if plan is not None:
        cells = apply_plan(cells, plan, chunk_results, evidence=left_behind(paths))
    results = Results(cells=cells, tool_version=tool_version(),
                      generated_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    results.ranking = op_ranking(results)
    results.patterns = layer_patterns(results)
    results.root_causes = root_causes(results, boilerplate=boilerplate_lines())  # also puts details.signature on every finding
    records = zoo_records(run_dirs if run_dirs is not None else [p for p in paths if Path(p).is_dir()])
    if records:
        results.zoo = zoo_section(records)
    return results


def left_behind(paths: Sequence[Path]) -> Evidence:
    """What a planned cell's job left in its folder when it wrote no result: the shell's record of a failed
    `setup` (an `error` cell with the command, exit code and output), or a journal with a mode still open
    (the job was killed while the cell ran: `timeout`, finished modes kept)."""
    def find(p: PlannedCell) -> CellResult | None:
        for root in paths:
            cdir = root / "cells" / p.cell
            setup = root / "cells" / (p.job or p.cell) / SETUP_RECORD  # a zoo cell: its backend's zoo job's record
            if setup.is_dir():
                return read_setup_record(setup, cell_id=p.cell, model=p.model, backend=p.backend,
                                         modes=p.modes, env={"planned": True})
            running = open_entry(cdir / JOURNAL_NAME, "mode")
            if running:
                return _killed_while_running(p, cdir, running)
        for root in paths:  # only the record uploaded before the cell started: the job ended before its upload
            if (root / "cells" / p.cell / STARTED_NAME).is_file():
                return _killed_before_upload(p, root / "cells" / p.cell / STARTED_NAME)
        return None
    return find


def _killed_before_upload(p: PlannedCell, started: Path) -> CellResult:
    try:
        info = read_json(started, what="the cell job's start record")
    except InputError:
        info = {}
    limit = info.get("minutes") if isinstance(info, dict) else None
    message = (f"{NO_RESULT}: its job was ended after the cell started (the job's time limit, or a lost runner), "
               "before it could upload the cell's journal" + (f"; the cell's own limit was {limit} minutes" if limit else ""))
    modes = {m: ModeResult(status="timeout", reason=message) for m in p.modes}
    result = CellResult(id=p.cell, model=p.model, backend=p.backend, status="timeout", env={"planned": True},
                        modes=modes, artifacts_dir=f"cells/{p.cell}")
    result.error = CellError(type="timeout", message=message)
    return result


def _killed_while_running(p: PlannedCell, cdir: Path, running: str) -> CellResult:
    module = open_entry(cdir / JOURNAL_NAME, "module")
    message = (f"{NO_RESULT}: its job was ended (the job's time limit, or a lost runner) during mode {running!r}"
               + (f" while running module {module!r}" if module else "") + "; the cell's journal shows it was running")
    try:
        result = CellResult.from_dict(read_json(cdir / PARTIAL_NAME, what="partial cell result"))
    except (InputError, KeyError, TypeError):
        result = CellResult(id=p.cell, model=p.model, backend=p.backend, status="timeout", env={"planned": True},
                            artifacts_dir=f"cells/{p.cell}")
    for m in p.modes or (running,):
        if m not in result.modes:
            result.modes[m] = ModeResult(status="timeout", reason=message if m == running else "not run: the job ended first",
                                         data={"last_module": module} if module and m == running else {})
    try:
        tail = (cdir / STDERR_NAME).read_text(encoding="utf-8", errors="replace")[-TAIL_CHARS:]
    except OSError:
        tail = ""
    result.error = CellError(type="timeout", message=message, stderr_tail=tail, last_module=module)
    result.status = "timeout"
    return result


def write_report_dir(results: Results, report_dir: Path, *, run_dir: Path | None = None,
                     trends: Any = None) -> dict[str, Path]:
    """results.json, junit.xml, summary.md and report.html (with the history's `trends` when given), all or none:
    each is written into a staging folder inside `report_dir` first, then moved into place (a rename needs no
    space), so a full disk or a kill while writing (`OutputError`, exit 5) leaves the report folder as it was."""
    report_dir = Path(report_dir)
    try:
        report_dir.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".report.", suffix=".tmp", dir=report_dir))
    except OSError as exc:
        raise output_error(report_dir, exc) from None
    try:
        staged = {"results": save_results(results, stage / "results.json")}
        staged.update(write_reports(results, report_dir, run_dir=run_dir, trends=trends, write_dir=stage))
        written: dict[str, Path] = {}
        for key, path in staged.items():
            os.replace(path, report_dir / path.name)
            written[key] = report_dir / path.name
    except OutputError as exc:
        raise OutputError(f"{exc.message}; the report in {report_dir} was left as it was", hint=exc.hint) from None
    except OSError as exc:
        raise output_error(report_dir, exc) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return written
