"""The history folder: immutable per-run record files, merged when read into one SQLite database.

Layout of ``--store DIR``::

    DIR/history.sqlite          the database (`db`): every folded run, old ones compacted to weeks
    DIR/runs/<date>_<id>.json.gz one immutable record per run not yet folded (`records`)

`add_run` writes this run's record file first (a unique name, written atomically), then folds every pending
record into the database inside one SQLite write transaction and removes the folded files. Two writers at
once each write their own file; the second to get the lock folds what the first did not, so neither run is
lost. A reader (`load_history(write=False)`) never writes: it merges the pending files into an in-memory
copy of the database.

A run id ``N-A`` is attempt A of workflow run N: a later attempt replaces an earlier one (`db`), here too
(`holds_run`, `drop_earlier_attempts`). A history that cannot be read does not stop a run: `load_history_or_fresh`
(what `aggregate`/`diff --history` use) sets the unreadable parts aside with a warning, and `repair` (what
`history push` uses) removes them from the branch; a newer version's files are never removed.
"""

from __future__ import annotations

import datetime as _dt
import json
import sqlite3
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

from ..errors import InputError, NewerFileError
from ..fsutil import output_error
from ..results.model import Results
from . import db
from .records import RunMeta, read_record, record_of, write_record

DB_NAME = "history.sqlite"
RUNS_DIR = "runs"


@dataclass(frozen=True, kw_only=True)
class RunRow:
    seq: int
    run_id: str
    date: str
    trigger: str
    commit: str
    tool_version: str
    generated_at: str
    kind: str  # run | weekly
    nights: int


class FindingDef(NamedTuple):
    id: int
    cell: str
    fingerprint: str
    kind: str
    mode: str
    op: str
    module: str
    signature: str
    first_seen: str
    last_seen: str
    streak_from: str  # first night of the current streak ("" when not seen on the newest night it could be)

    @property
    def key(self) -> str:
        return self.op or self.module


class CellRun(NamedTuple):
    status: str
    duration_s: float
    env: int
    modes: Mapping[str, str]


class LazySets(Mapping[int, frozenset[int]]):
    """Run seq → finding ids, decoded from the database's blobs on first use (a year is 365 of them)."""

    def __init__(self, blobs: dict[int, bytes]) -> None:
        self._blobs = blobs
        self._sets: dict[int, frozenset[int]] = {}
        self._by_blob: dict[bytes, frozenset[int]] = {}

    def __getitem__(self, seq: int) -> frozenset[int]:
        if seq not in self._sets:
            blob = self._blobs[seq]
            if blob not in self._by_blob:
                self._by_blob[blob] = db.unpack_ids(blob)
            self._sets[seq] = self._by_blob[blob]
        return self._sets[seq]

    def __iter__(self) -> Iterator[int]:
        return iter(self._blobs)

    def __len__(self) -> int:
        return len(self._blobs)


@dataclass
class History:
    """A loaded history: runs oldest first, and what each run saw. Layer figures are read on demand."""

    runs: list[RunRow] = field(default_factory=list)
    cells: dict[str, tuple[str, str]] = field(default_factory=dict)  # cell id → (model, backend)
    cell_runs: dict[int, dict[str, CellRun]] = field(default_factory=dict)  # run seq → cell id → what it did
    envs: dict[int, dict[str, Any]] = field(default_factory=dict)
    findings: dict[int, FindingDef] = field(default_factory=dict)
    present: Mapping[int, frozenset[int]] = field(default_factory=dict)  # run seq → finding ids
    conn: sqlite3.Connection | None = None
    _sets: dict[int, tuple[list[str], list[float | None]]] = field(default_factory=dict, repr=False)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def layer_series(self, cell: str) -> list[tuple[RunRow, list[str], list[float | None], list[float | None]]]:
        """Per run (oldest first) with a numerics table for `cell`: layer names, thresholds and worst figures,
        flattened per layer as (rel, 1 − cos, mad)."""
        assert self.conn is not None
        rows = self.conn.execute("SELECT lf.run, lf.layer_set, lf.figures FROM layer_figures lf JOIN cells c "
                                 "ON c.id = lf.cell WHERE c.cell = ?", (cell,)).fetchall()
        return self._decode(rows)

    def figures_at(self, runs: list[RunRow]) -> dict[str, list[tuple[RunRow, list[str], list[float | None], list[float | None]]]]:
        """Every cell's layer figures in `runs` only (cell → per run, oldest first)."""
        assert self.conn is not None
        marks = ",".join("?" * len(runs))
        out: dict[str, list[Any]] = {}
        for cell, run, lsid, blob in self.conn.execute(
                "SELECT c.cell, lf.run, lf.layer_set, lf.figures FROM layer_figures lf JOIN cells c ON c.id = lf.cell "
                f"WHERE lf.run IN ({marks})", [r.seq for r in runs]):
            out.setdefault(cell, []).append((run, lsid, blob))
        return {cell: self._decode(rows) for cell, rows in out.items()}

    def named_figures(self, owners: Sequence[Mapping[str, int]], cells: Sequence[str]
                      ) -> dict[str, dict[str, list[float | None]]]:
        """cell → figure name → its value per night (`owners`: per night, cell → the run that had it), for `cells`."""
        assert self.conn is not None
        seqs = sorted({seq for own in owners for seq in own.values()})
        if not seqs:
            return {}
        got: dict[tuple[int, str], dict[str, float]] = {}
        for i in range(0, len(seqs), 500):  # SQLite's host parameters per statement
            part = seqs[i:i + 500]
            try:
                rows = self.conn.execute(
                    "SELECT cf.run, c.cell, cf.figures FROM cell_figures cf JOIN cells c ON c.id = cf.cell "
                    f"WHERE cf.run IN ({','.join('?' * len(part))})", part).fetchall()
            except sqlite3.OperationalError:  # a schema 1 history, read as it is (db.READS_AS_IS_FROM): no figures
                return {}
            for run, cell, text in rows:
                got[(run, cell)] = json.loads(text)
        out: dict[str, dict[str, list[float | None]]] = {}
        for cell in cells:
            per_night = [got.get((own[cell], cell)) if cell in own else None for own in owners]
            names = sorted({n for figs in per_night if figs for n in figs})
            if names:
                out[cell] = {n: [figs.get(n) if figs else None for figs in per_night] for n in names}
        return out

    def _decode(self, rows: list[Any]) -> list[tuple[RunRow, list[str], list[float | None], list[float | None]]]:
        assert self.conn is not None
        order = {r.seq: i for i, r in enumerate(self.runs)}
        out = []
        for seq, lsid, blob in sorted((r for r in rows if r[0] in order), key=lambda r: order[r[0]]):
            if lsid not in self._sets:
                names, thr = self.conn.execute("SELECT names, thresholds FROM layer_sets WHERE id = ?", (lsid,)).fetchone()
                self._sets[lsid] = (json.loads(names), db.dequantize(thr))
            names, thr = self._sets[lsid]
            out.append((self.runs[order[seq]], names, thr, db.dequantize(blob)))
        return out


def _pending(store: Path) -> list[Path]:
    return sorted((store / RUNS_DIR).glob("*.json.gz")) if (store / RUNS_DIR).is_dir() else []


def _read_pending(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for p in paths:
        try:
            out.append((p, read_record(p)))
        except InputError:
            if p.exists():
                raise
            # another writer folded and removed it after we listed it: it is in the database now
    return out


def check_store(store: Path) -> Path:
    store = Path(store)
    if store.exists() and not store.is_dir():
        raise InputError(f"{store}: --store must be a folder (it holds {DB_NAME} and {RUNS_DIR}/)",
                         hint="give the history folder, not a file in it")
    return store


REJECTED_SUFFIX = ".rejected"  # a pending record that cannot be folded is renamed so, out of the way, kept for a look


def set_aside(path: Path, why: str, warn: Callable[[str], None] | None) -> None:
    """Rename a pending record that cannot be folded to `<name>.rejected` (no longer pending), and say so."""
    try:
        path.replace(path.with_name(path.name + REJECTED_SUFFIX))
    except FileNotFoundError:
        return
    if warn is not None:
        warn(f"history run file set aside as {path.name}{REJECTED_SUFFIX}: it cannot be folded ({why})")


def fold_pending(store: Path, conn: sqlite3.Connection | None = None,
                 known: Mapping[Path, dict[str, Any]] | None = None, *,
                 warn: Callable[[str], None] | None = None) -> list[str]:
    """Fold every pending record file into the database and remove the folded files; the run ids added.
    `known`: records already in memory by path (the one just written), not read back: one of them that cannot be
    folded is an `InputError` (and nothing is kept); any other file that cannot be folded is set aside (`set_aside`)."""
    store = check_store(store)
    own = conn is None
    conn = conn or db.open_for_write(store / DB_NAME)
    try:
        paths = _pending(store)
        records = [(p, known[p]) for p in paths if known and p in known]
        records += _read_pending([p for p in paths if not known or p not in known])

        def skip(path: Path, why: str) -> None:
            if known and path in known:
                raise InputError(f"{path}: history record cannot be added ({why})",
                                 hint="nothing was added; check the results file")
            set_aside(path, why, warn)

        try:
            added = db.fold(conn, records, skip=skip)
        except sqlite3.OperationalError as exc:
            raise db.write_error(store / DB_NAME, exc) from None
        for path, rec in records:
            if db.superseded(conn, rec["run"]["run_id"]):  # folded, or an earlier attempt a later one replaced
                path.unlink(missing_ok=True)
        return added
    finally:
        if own:
            conn.close()


def _pending_run_id(path: Path) -> str:
    return path.name[:-len(".json.gz")].split("_", 1)[-1]


def holds_run(store: Path, run_id: str, *, files_only: bool = False) -> bool:
    """Whether the history already has this run, or a later attempt of its workflow run (folded, or as a pending
    record file; `files_only`: the pending files alone, when the database is a newer version's)."""
    store = check_store(store)
    mine = db.attempt_of(run_id)
    for p in _pending(store):
        other = _pending_run_id(p)
        theirs = db.attempt_of(other)
        if other == run_id or (mine and theirs and theirs[0] == mine[0] and theirs[1] >= mine[1]):
            return True
    if files_only or not (store / DB_NAME).exists():
        return False
    conn = db.connect(store / DB_NAME, create=False)
    try:
        return db.superseded(conn, run_id)
    finally:
        conn.close()


def drop_earlier_attempts(store: Path, run_id: str) -> list[Path]:
    """Remove the pending record files of earlier attempts of this run's workflow run (a re-run replaces its
    attempt); the removed paths."""
    mine = db.attempt_of(run_id)
    gone = []
    for p in _pending(store) if mine else ():
        theirs = db.attempt_of(_pending_run_id(p))
        if theirs and mine and theirs[0] == mine[0] and theirs[1] < mine[1]:
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


def check_cells(results: Results, source: str) -> None:
    """`InputError` naming `source` when the results hold a cell id twice (a history keeps one row per cell and run)."""
    seen: set[str] = set()
    for c in results.cells:
        if c.id in seen:
            raise InputError(f"{source}: cell {c.id!r} appears twice in the results",
                             hint="aggregate the run again (each cell once), then add it; nothing was written")
        seen.add(c.id)


def add_run(store: Path, results: Results, meta: RunMeta, *, source: str = "results",
            warn: Callable[[str], None] | None = None) -> tuple[Path, bool]:
    """Add one run: its record file, then a fold. Returns the record's path and whether the run was new.
    Results that hold a cell twice are refused before anything is written (`check_cells`). Atomic and idempotent per
    run id: a run already held is not added again, and a fold that fails (disk full: `OutputError`, exit 5) keeps
    nothing of this run, its record file included, so the next add or show finds the history as it was."""
    check_cells(results, source)
    store = check_store(store)
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(store, exc) from None
    conn = db.open_for_write(store / DB_NAME)  # refuses a foreign or newer database before anything is written
    try:
        if db.superseded(conn, meta.run_id):
            return store / RUNS_DIR / f"{meta.date}_{meta.run_id}.json.gz", False
        record = record_of(results, meta)
        path = write_record(record, store / RUNS_DIR)
        try:
            added = fold_pending(store, conn, {path: record}, warn=warn)
        except BaseException:
            if not db.has_run(conn, meta.run_id):
                path.unlink(missing_ok=True)  # this run's own file: a failed add leaves nothing behind
            raise
        return path, meta.run_id in added or db.has_run(conn, meta.run_id)
    finally:
        conn.close()


def load_history(store: Path, *, current: Results | None = None, current_meta: RunMeta | None = None,
                 missing_ok: bool = False, window: int | None = None,
                 warn: Callable[[str], None] | None = None) -> History:
    """Read the history (database plus pending records, merged in memory; nothing on disk is written).

    With `current`, that run is merged in as the newest night unless the history already holds it (same
    ``generated_at``): `aggregate --history` reports on a run before it is added. `missing_ok`: no folder yet
    (the first night) reads as an empty history. `window`: only the findings seen in the newest `window` runs are
    loaded (what the reports draw); None loads all (export). With `warn`, a pending record that cannot be folded is
    left out with a warning (nothing on disk changes); without, it is an `InputError`. An empty database file (what
    a full disk left under an older version) holds nothing and reads as a new history."""
    store = check_store(store)
    if not store.is_dir() and not missing_ok:
        raise InputError(f"{store}: no history folder", hint="create it with `deepview-ci history add RESULTS --store DIR`")
    dbpath = store / DB_NAME
    conn = db.memory_copy(dbpath if dbpath.exists() and dbpath.stat().st_size > 0 else None)
    skip = (lambda path, why: warn(f"history run file left out: {path}: it cannot be folded ({why})")) if warn else None
    db.fold(conn, _read_pending(_pending(store)), skip=skip)
    _merge_current(conn, current, current_meta)
    return read_all(conn, window=window)


def _merge_current(conn: sqlite3.Connection, current: Results | None, current_meta: RunMeta | None) -> None:
    if current is not None and current_meta is not None:
        known = {r[0] for r in conn.execute("SELECT generated_at FROM runs") if r[0]}
        if not current.generated_at or current.generated_at not in known:
            newest = conn.execute("SELECT MAX(date) FROM runs").fetchone()[0] or current_meta.date
            day = current_meta.date
            if day < newest:  # a clock behind the history's: tonight is still the newest night, after the others
                day = (_dt.date.fromisoformat(newest) + _dt.timedelta(days=1)).isoformat()
            # the same date as the newest stored run is the same night (a check after the nightly, split workflows)
            db.fold(conn, [(Path("-"), record_of(current, replace(current_meta, date=day)))])


def _readable_copy(dbpath: Path) -> sqlite3.Connection:
    """The database in memory, read through once (a truncated file fails only when a damaged page is read)."""
    conn = db.memory_copy(dbpath)
    try:
        check = conn.execute("PRAGMA quick_check").fetchall()
        if check != [("ok",)]:
            raise sqlite3.DatabaseError("; ".join(str(r[0]) for r in check[:3]))
        read_all(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def repair(store: Path) -> tuple[list[str], bool]:
    """For a writer of the branch (`history push`): remove what cannot be read, the database and run files, so the
    history goes on fresh. Returns what was removed (with why) and whether a newer deepview-ci's files are there;
    those are kept, and then nothing may be folded into the database."""
    store = check_store(store)
    removed: list[str] = []
    newer = False
    dbpath = store / DB_NAME
    if dbpath.exists():
        try:
            _readable_copy(dbpath).close()
        except NewerFileError:
            newer = True
        except (InputError, sqlite3.DatabaseError) as exc:
            dbpath.unlink()
            removed.append(f"{DB_NAME} ({exc.message if isinstance(exc, InputError) else f'damaged: {exc}'})")
    for path in _pending(store):
        try:
            db.fold(db.memory_copy(None), [(path, read_record(path))])
        except NewerFileError:
            newer = True
        except (InputError, KeyError, IndexError, TypeError, ValueError, sqlite3.Error) as exc:
            path.unlink()
            removed.append(f"{RUNS_DIR}/{path.name} ({exc.message if isinstance(exc, InputError) else type(exc).__name__})")
    return removed, newer


def load_history_or_fresh(store: Path, *, current: Results | None, current_meta: RunMeta | None,
                          window: int | None, warn: Callable[[str], None]) -> History:
    """`load_history` for a run that must go on (`aggregate`/`diff --history`): a database that cannot be read
    (garbage, truncated, someone else's, a newer version's) and run files that cannot be read are set aside, each
    with a `warn`, and the trends use what is left: at worst a fresh history that starts with this run. Nothing
    on disk is changed; the next `history push` repairs the branch."""
    store = check_store(store)
    dbpath = store / DB_NAME
    conn: sqlite3.Connection | None = None
    if dbpath.exists():
        try:
            conn = _readable_copy(dbpath)
        except (InputError, sqlite3.DatabaseError) as exc:
            why = exc.message if isinstance(exc, InputError) else f"{dbpath}: a damaged database ({exc})"
            warn(f"history set aside, the trends start from a fresh one: {why}")
    conn = conn or db.memory_copy(None)
    for path in _pending(store):
        try:
            record = read_record(path)
            db.fold(conn, [(path, record)])
        except InputError as exc:
            if path.exists():
                warn(f"history run file set aside: {exc.message}")
        except (KeyError, IndexError, TypeError, ValueError, sqlite3.Error) as exc:
            warn(f"history run file set aside: {path}: a damaged record ({type(exc).__name__}: {exc})")
    _merge_current(conn, current, current_meta)
    return read_all(conn, window=window)


def read_all(conn: sqlite3.Connection, *, window: int | None = None) -> History:
    """The history in `conn`; with `window`, only the findings last seen in its newest `window` runs."""
    h = History(conn=conn)
    rows = conn.execute("SELECT seq, run_id, date, trigger, commit_sha, tool_version, generated_at, kind, nights "
                        "FROM runs ORDER BY date, seq").fetchall()
    h.runs = [RunRow(seq=r[0], run_id=r[1], date=r[2], trigger=r[3] or "", commit=r[4] or "", tool_version=r[5] or "",
                     generated_at=r[6] or "", kind=r[7], nights=r[8]) for r in rows]
    names = {}
    for cid, cell, model, backend in conn.execute("SELECT id, cell, model, backend FROM cells"):
        names[cid] = cell
        h.cells[cell] = (model, backend)
    h.envs = {i: json.loads(t) for i, t in conn.execute("SELECT id, json FROM envs")}
    parsed: dict[str, dict[str, str]] = {}  # the same few mode strings repeat on every row
    for run, cell, status, dur, env, modes in conn.execute("SELECT run, cell, status, duration_s, env, modes FROM cell_runs"):
        mm = parsed.get(modes or "")
        if mm is None:
            mm = parsed[modes or ""] = dict(p.split("=", 1) for p in (modes or "").split(",") if "=" in p)
        h.cell_runs.setdefault(run, {})[names[cell]] = CellRun(status, dur or 0.0, env, mm)
    texts = dict(conn.execute("SELECT id, text FROM strings").fetchall())
    texts[None] = ""
    since = h.runs[-window].date if window and len(h.runs) > window else ""
    for fid, cell, fp, kind, mode, op, module, sig, first, last, streak in conn.execute(
            "SELECT id, cell, fingerprint, kind, mode, op, module, signature, first_seen, last_seen, streak_from FROM findings"
            " WHERE last_seen >= ?", (since,)):
        h.findings[fid] = FindingDef(fid, names[cell], fp, texts[kind], texts[mode], texts[op], texts[module], texts[sig],
                                     first or "", last or "", streak or "")
    h.present = LazySets(dict(conn.execute("SELECT run, ids FROM run_findings").fetchall()))
    return h


def size_on_disk(store: Path) -> int:
    return sum(p.stat().st_size for p in Path(store).rglob("*") if p.is_file())
