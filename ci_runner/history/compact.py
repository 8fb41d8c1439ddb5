"""Keeping the history bounded (`compact`) and handing it to a warehouse (`export`).

**Compaction.** The newest ``keep`` nightly runs stay as they are; older runs are folded into one
``weekly`` row per ISO week (run id ``week-YYYY-Www``, date of its first night, ``nights`` = how many):
each cell's worst status and mean time, the union of the week's findings, each layer figure's maximum.

**Export** (`export_csv`): four CSV files with a header row, one row per record, UTF-8:

- ``runs.csv``: run_id, date, trigger, commit, tool_version, kind (run | weekly), nights
- ``cells.csv``: run_id, date, cell, model, backend, status, duration_s, modes (``ops=fail,layers=pass``), env (JSON)
- ``findings.csv``: run_id, date, cell, backend, fingerprint, kind, mode, op, module, signature
- ``layers.csv``: run_id, date, cell, layer, rel, one_minus_cos, mad, rel_threshold, one_minus_cos_threshold,
  mad_threshold (the worst of the cumulative and isolated views; empty when not measured)

They load as they are into ClickHouse (``FORMAT CSVWithNames``), Superset or Grafana's CSV source.
"""

from __future__ import annotations

import csv
import io
import json
import sqlite3
from collections import defaultdict
from datetime import date as _date
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_text
from ..results.model import STATUS_SEVERITY
from . import db
from .store import DB_NAME, History, check_store, fold_pending

DEFAULT_KEEP = 90


def _week(day: str) -> str:
    y, w, _ = _date.fromisoformat(day).isocalendar()
    return f"{y}-W{w:02d}"


def compact(store: Path, *, keep: int = DEFAULT_KEEP) -> tuple[int, int]:
    """Fold pending records, then compact runs past the newest `keep` into weeks; (runs folded, weeks made)."""
    store = check_store(store)
    fold_pending(store)
    conn = db.open_for_write(store / DB_NAME)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            runs = conn.execute("SELECT seq, date, run_id FROM runs WHERE kind = 'run' ORDER BY date DESC, run_id DESC").fetchall()
            old = runs[keep:]
            weeks: dict[str, list[int]] = defaultdict(list)
            for seq, day, _ in old:
                weeks[_week(day)].append(seq)
            for week, seqs in sorted(weeks.items()):
                prior = conn.execute("SELECT seq FROM runs WHERE run_id = ?", (f"week-{week}",)).fetchone()
                _fold_week(conn, week, seqs + ([prior[0]] if prior else []))
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite rolls back by itself on a full disk or an I/O error
                conn.execute("ROLLBACK")
            raise
        if old:
            conn.execute("VACUUM")
        return len(old), len(weeks)
    finally:
        conn.close()


def _fold_week(conn: sqlite3.Connection, week: str, seqs: list[int]) -> None:
    marks = ",".join("?" * len(seqs))
    first, nights, tool = conn.execute(f"SELECT MIN(date), SUM(nights), MAX(tool_version) FROM runs WHERE seq IN ({marks})",
                                       seqs).fetchone()
    cells: dict[int, list[Any]] = {}
    for cell, status, dur, env, modes in conn.execute(
            f"SELECT cell, status, duration_s, env, modes FROM cell_runs WHERE run IN ({marks}) ORDER BY run", seqs):
        c = cells.setdefault(cell, [status, [], env, modes])
        if STATUS_SEVERITY.get(status, 3) > STATUS_SEVERITY.get(c[0], 3):
            c[0], c[3] = status, modes
        c[1].append(dur or 0.0)
        c[2] = env
    ids: set[int] = set()
    for (blob,) in conn.execute(f"SELECT ids FROM run_findings WHERE run IN ({marks})", seqs):
        ids |= db.unpack_ids(blob)
    figures: dict[int, tuple[int, list[float | None]]] = {}
    for cell, lsid, blob in conn.execute(f"SELECT cell, layer_set, figures FROM layer_figures WHERE run IN ({marks}) "
                                         "ORDER BY run", seqs):
        vals = db.dequantize(blob)
        if cell in figures and figures[cell][0] == lsid:
            vals = [_max(a, b) for a, b in zip(figures[cell][1], vals)]
        figures[cell] = (lsid, vals)
    named: dict[int, dict[str, float]] = {}  # a week's named figures: the worst (largest) night of each
    for cell, text in conn.execute(f"SELECT cell, figures FROM cell_figures WHERE run IN ({marks}) ORDER BY run", seqs):
        week_figs = named.setdefault(cell, {})
        for name, value in json.loads(text).items():
            week_figs[name] = max(value, week_figs.get(name, value))
    for table in ("cell_runs", "layer_figures", "cell_figures"):
        conn.execute(f"DELETE FROM {table} WHERE run IN ({marks})", seqs)
    conn.execute(f"DELETE FROM run_findings WHERE run IN ({marks})", seqs)
    conn.execute(f"DELETE FROM runs WHERE seq IN ({marks})", seqs)
    seq = conn.execute("INSERT INTO runs(run_id, date, trigger, commit_sha, tool_version, generated_at, kind, nights) "
                       "VALUES(?, ?, 'compaction', '', ?, '', 'weekly', ?)", (f"week-{week}", first, tool, nights)).lastrowid
    conn.executemany("INSERT INTO cell_runs VALUES(?, ?, ?, ?, ?, ?)",
                     [(seq, cell, c[0], sum(c[1]) / len(c[1]), c[2], c[3]) for cell, c in cells.items()])
    conn.execute("INSERT INTO run_findings VALUES(?, ?)", (seq, db.pack_ids(ids)))
    conn.executemany("INSERT INTO layer_figures VALUES(?, ?, ?, ?)",
                     [(seq, cell, lsid, db.quantize(vals)) for cell, (lsid, vals) in figures.items()])
    conn.executemany("INSERT INTO cell_figures VALUES(?, ?, ?)",
                     [(seq, cell, json.dumps(f, sort_keys=True)) for cell, f in named.items()])


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)


COLUMNS: dict[str, tuple[str, ...]] = {
    "runs": ("run_id", "date", "trigger", "commit", "tool_version", "kind", "nights"),
    "cells": ("run_id", "date", "cell", "model", "backend", "status", "duration_s", "modes", "env"),
    "findings": ("run_id", "date", "cell", "backend", "fingerprint", "kind", "mode", "op", "module", "signature"),
    "layers": ("run_id", "date", "cell", "layer", "rel", "one_minus_cos", "mad", "rel_threshold",
               "one_minus_cos_threshold", "mad_threshold"),
}


def _csv(rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.6g}"


def export_csv(history: History, out: Path) -> dict[str, Path]:
    """Write runs.csv, cells.csv, findings.csv and layers.csv into `out` (columns in the module docstring)."""
    out = Path(out)
    rows: dict[str, list[tuple[Any, ...]]] = {k: [] for k in COLUMNS}
    for r in history.runs:
        rows["runs"].append((r.run_id, r.date, r.trigger, r.commit, r.tool_version, r.kind, r.nights))
        for cell, cr in sorted(history.cell_runs.get(r.seq, {}).items()):
            model, backend = history.cells[cell]
            rows["cells"].append((r.run_id, r.date, cell, model, backend, cr.status, f"{cr.duration_s:.3f}",
                                  ",".join(f"{m}={s}" for m, s in cr.modes.items()),
                                  json.dumps(history.envs.get(cr.env, {}), sort_keys=True)))
        for fid in sorted(history.present.get(r.seq, ())):
            f = history.findings[fid]
            rows["findings"].append((r.run_id, r.date, f.cell, history.cells[f.cell][1], f.fingerprint, f.kind, f.mode,
                                     f.op, f.module, f.signature))
    for cell in sorted(history.cells):
        for run, names, thr, fig in history.layer_series(cell):
            for i, name in enumerate(names):
                rows["layers"].append((run.run_id, run.date, cell, name, *(_num(x) for x in fig[3 * i:3 * i + 3]),
                                       *(_num(x) for x in thr[3 * i:3 * i + 3])))
    return {k: atomic_write_text(out / f"{k}.csv", _csv(v, COLUMNS[k])) for k, v in rows.items()}
