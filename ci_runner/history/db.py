"""The history database: one SQLite file (standard library), with a schema version and migrations.

Tables (schema version 1 unless said):

- ``meta(key, value)``: ``kind`` = ``deepview-ci-history``, ``schema_version``.
- ``runs(seq, run_id, date, trigger, commit_sha, tool_version, kind, nights)``: ``kind`` is ``run``, or
  ``weekly`` for a compacted week (``nights`` runs folded into one).
- ``cells(id, cell, model, backend)``, ``envs(id, hash, json)``: each distinct cell and env stamp once.
- ``cell_runs(run, cell, status, duration_s, env, modes)``: a cell's status, time, stamp and mode statuses
  (``ops=fail,layers=pass``) in a run.
- ``strings(id, text)``: the kinds, modes, ops, modules and signatures the findings name, each once.
- ``findings(id, cell, fingerprint, kind, mode, op, module, signature, first_seen, last_seen, streak_from)``:
  each distinct finding once (its texts as ``strings`` ids), with the first and last night it was seen and the first night of its current
  streak (kept up to date on every insert, so reading them needs no walk over the nights);
  ``run_findings(run, ids)``: the finding ids present in a run, a zlib'd delta-encoded uint32 array.
- ``layer_sets(id, hash, names, thresholds)`` and ``layer_figures(run, cell, layer_set, figures)``:
  per-layer worst rel, 1 − cos and mad, log-quantised to int16 (0.3 % steps; see `quantize`).
- ``cell_figures(run, cell, figures)`` (schema version 2): a cell's named figures in a run (JSON
  ``{"<mode>.<name>": number}``: a mode's ``data.figures``, e.g. ``memory.peak_bytes.decode``), for the trends.

A run id ``N-A`` (digits, a dash, digits: what `history` makes of ``GITHUB_RUN_ID-GITHUB_RUN_ATTEMPT``) is attempt
``A`` of workflow run ``N``; one workflow run is one night, so a later attempt replaces an earlier one (its rows
go, first/last seen and streaks are walked again) and an earlier attempt arriving after a later one is not added.

A file that is not SQLite, or is SQLite of someone else, is an `InputError`. A file written by a newer
version is refused and left untouched; an older one is migrated in place when the history is written.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import sqlite3
import tempfile
import zlib
from array import array
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..errors import InputError, NewerFileError
from ..fsutil import OutputError, file_mode, output_error

DB_KIND = "deepview-ci-history"
DB_VERSION = 2
READS_AS_IS_FROM = 1  # older schemas read without a migration: version 2 only added `cell_figures`
# MIGRATIONS[v] takes a database from version v - 1 to v. Append; never edit a shipped step.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "CREATE TABLE runs(seq INTEGER PRIMARY KEY, run_id TEXT NOT NULL UNIQUE, date TEXT NOT NULL, trigger TEXT,"
        " commit_sha TEXT, tool_version TEXT, generated_at TEXT, kind TEXT NOT NULL DEFAULT 'run',"
        " nights INTEGER NOT NULL DEFAULT 1)",
        "CREATE TABLE cells(id INTEGER PRIMARY KEY, cell TEXT NOT NULL UNIQUE, model TEXT, backend TEXT)",
        "CREATE TABLE envs(id INTEGER PRIMARY KEY, hash TEXT NOT NULL UNIQUE, json TEXT NOT NULL)",
        "CREATE TABLE cell_runs(run INTEGER NOT NULL, cell INTEGER NOT NULL, status TEXT NOT NULL, duration_s REAL,"
        " env INTEGER, modes TEXT, PRIMARY KEY(run, cell)) WITHOUT ROWID",
        "CREATE TABLE strings(id INTEGER PRIMARY KEY, text TEXT NOT NULL UNIQUE)",
        "CREATE TABLE findings(id INTEGER PRIMARY KEY, cell INTEGER NOT NULL, fingerprint TEXT NOT NULL, kind INTEGER,"
        " mode INTEGER, op INTEGER, module INTEGER, signature INTEGER, first_seen TEXT, last_seen TEXT,"
        " streak_from TEXT, UNIQUE(cell, fingerprint))",
        "CREATE TABLE run_findings(run INTEGER PRIMARY KEY, ids BLOB NOT NULL)",
        "CREATE TABLE layer_sets(id INTEGER PRIMARY KEY, hash TEXT NOT NULL UNIQUE, names TEXT NOT NULL,"
        " thresholds BLOB NOT NULL)",
        "CREATE TABLE layer_figures(run INTEGER NOT NULL, cell INTEGER NOT NULL, layer_set INTEGER NOT NULL,"
        " figures BLOB NOT NULL, PRIMARY KEY(run, cell)) WITHOUT ROWID",
    ),
    2: (
        "CREATE TABLE IF NOT EXISTS cell_figures(run INTEGER NOT NULL, cell INTEGER NOT NULL, figures TEXT NOT NULL,"
        " PRIMARY KEY(run, cell)) WITHOUT ROWID",
    ),
}
BUSY_TIMEOUT_S = 60.0

_ZERO, _NAN, _INF = -32768, 32767, 32766
_STEPS = 256.0  # per octave


def _q(v: float | str | None) -> int:
    if type(v) is str:
        v = float(v)
    if v is None or v != v:
        return _NAN
    if v <= 0:
        return _ZERO
    if v == math.inf:
        return _INF
    q = round(math.log2(v) * _STEPS)
    return -32767 if q < -32767 else 32765 if q > 32765 else q


def quantize(values: Iterable[float | str | None]) -> bytes:
    """Non-negative figures as int16 log2 steps (1/256 octave: 0.27 % apart); 0, NaN (also None) and +inf get
    codes of their own. Strings are the result model's non-finite spellings ("nan", "inf")."""
    return zlib.compress(array("h", [_q(v) for v in values]).tobytes(), 6)


def dequantize(blob: bytes) -> list[float | None]:
    arr = array("h")
    arr.frombytes(zlib.decompress(blob))
    return [0.0 if q == _ZERO else None if q == _NAN else math.inf if q == _INF else 2.0 ** (q / _STEPS) for q in arr]


def pack_ids(ids: Iterable[int]) -> bytes:
    """Sorted ids, delta-encoded (a run's ids are mostly consecutive: a few hundred bytes for 20 000)."""
    s = sorted(ids)
    return zlib.compress(array("I", [b - a for a, b in zip([0] + s, s)]).tobytes(), 6)


def unpack_ids(blob: bytes) -> frozenset[int]:
    arr = array("I")
    arr.frombytes(zlib.decompress(blob))
    return frozenset(accumulate(arr))


def _fail(path: Path, what: str) -> InputError:
    return InputError(f"{path}: {what}", hint="point --store at a folder made by `deepview-ci history add`, "
                                              "or move the file away to start a new history")


def connect(path: Path, *, create: bool) -> sqlite3.Connection:
    """Open the database: check it is ours and not newer; create or migrate it when `create` (a writer)."""
    path = Path(path)
    if not path.exists() and not create:
        raise InputError(f"{path}: no history database here", hint="add a run first with `deepview-ci history add`")
    try:
        conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    except sqlite3.DatabaseError as exc:
        raise _fail(path, f"not a history database ({exc})") from None
    if not tables:
        if not create:
            raise _fail(path, "an empty database, not a history")
        migrate(conn, 0)
        return conn
    if "meta" not in tables:
        raise _fail(path, "an SQLite database of something else (no meta table)")
    meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
    if meta.get("kind") != DB_KIND:
        raise _fail(path, f"an SQLite database of something else (kind {meta.get('kind')!r})")
    try:
        version = int(meta.get("schema_version", ""))
    except ValueError:
        raise _fail(path, f"bad schema_version {meta.get('schema_version')!r}") from None
    if version > DB_VERSION:
        conn.close()
        raise NewerFileError(f"{path}: history schema_version {version} was written by a newer deepview-ci "
                         f"(this one reads up to {DB_VERSION}); it is left untouched",
                         hint="upgrade deepview-ci to read or add to this history")
    if version < DB_VERSION:
        if not create and version >= READS_AS_IS_FROM:  # read as it is: what later versions add is missing, not changed
            return conn
        if not create:
            raise _fail(path, f"history schema_version {version} needs a migration; run `deepview-ci history add` "
                              "or `history compact` once with this version")
        migrate(conn, version)
    return conn


def _version(conn: sqlite3.Connection) -> int:
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is None:
        return 0
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 0


def migrate(conn: sqlite3.Connection, version: int) -> None:
    """Apply the migration steps after the database's version, in one write transaction (the version is read
    again inside it: two writers creating one history at once apply each step once)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        for v in range(max(version, _version(conn)) + 1, DB_VERSION + 1):
            for stmt in MIGRATIONS[v]:
                conn.execute(stmt)
        conn.execute("INSERT OR REPLACE INTO meta VALUES('kind', ?)", (DB_KIND,))
        conn.execute("INSERT OR REPLACE INTO meta VALUES('schema_version', ?)", (str(DB_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # SQLite rolls back by itself on a full disk or an I/O error
            conn.execute("ROLLBACK")
        raise


def _id(conn: sqlite3.Connection, cache: dict[Any, int], table: str, key_cols: Sequence[str], key: tuple[Any, ...],
        extra: Mapping[str, Any] | None = None) -> int:
    ck = (table, *key)
    if ck in cache:
        return cache[ck]
    where = " AND ".join(f"{c} = ?" for c in key_cols)
    row = conn.execute(f"SELECT id FROM {table} WHERE {where}", key).fetchone()
    if row is None:
        cols = list(key_cols) + list(extra or {})
        vals = list(key) + list((extra or {}).values())
        cur = conn.execute(f"INSERT INTO {table}({', '.join(cols)}) VALUES({', '.join('?' * len(cols))})", vals)
        row = (cur.lastrowid,)
    cache[ck] = int(row[0])
    return cache[ck]


def has_run(conn: sqlite3.Connection, run_id: str) -> bool:
    return conn.execute("SELECT 1 FROM runs WHERE run_id = ?", (run_id,)).fetchone() is not None


_ATTEMPT = re.compile(r"(\d+)-(\d+)")


def attempt_of(run_id: str) -> tuple[str, int] | None:
    """(workflow run, attempt) of a run id ``N-A``; None for any other id (a local run, a week)."""
    m = _ATTEMPT.fullmatch(run_id)
    return (m.group(1), int(m.group(2))) if m else None


def _attempts(conn: sqlite3.Connection, run_id: str) -> list[tuple[int, int]]:
    """(seq, attempt) of every stored attempt of the workflow run `run_id` belongs to."""
    mine = attempt_of(run_id)
    if mine is None:
        return []
    rows = conn.execute("SELECT seq, run_id FROM runs WHERE run_id LIKE ? AND kind = 'run'", (f"{mine[0]}-%",)).fetchall()
    return [(seq, a[1]) for seq, rid in rows if (a := attempt_of(rid)) is not None and a[0] == mine[0]]


def superseded(conn: sqlite3.Connection, run_id: str) -> bool:
    """Whether the history holds this run, or a later attempt of its workflow run."""
    mine = attempt_of(run_id)
    return has_run(conn, run_id) or (mine is not None and any(a >= mine[1] for _, a in _attempts(conn, run_id)))


def _drop_runs(conn: sqlite3.Connection, seqs: Sequence[int]) -> None:
    for table, col in (("cell_runs", "run"), ("run_findings", "run"), ("layer_figures", "run"), ("cell_figures", "run"),
                       ("runs", "seq")):
        conn.executemany(f"DELETE FROM {table} WHERE {col} = ?", [(s,) for s in seqs])


def recompute_seen(conn: sqlite3.Connection) -> None:
    """Every finding's first and last night and its streak, from a walk over the nights (after runs were dropped)."""
    first: dict[int, str] = {}
    last: dict[int, str] = {}
    for seq, day in conn.execute("SELECT seq, date FROM runs ORDER BY date, seq").fetchall():
        row = conn.execute("SELECT ids FROM run_findings WHERE run = ?", (seq,)).fetchone()
        for fid in unpack_ids(row[0]) if row else ():
            first.setdefault(fid, day)
            last[fid] = day
    conn.execute("UPDATE findings SET first_seen = NULL, last_seen = NULL")
    conn.executemany("UPDATE findings SET first_seen = ?, last_seen = ? WHERE id = ?",
                     [(first[i], last[i], i) for i in first])
    recompute_streaks(conn)


def insert_record(conn: sqlite3.Connection, record: Mapping[str, Any], *, kind: str = "run", nights: int = 1) -> bool:
    """Fold one record into the open transaction; False (and nothing written) when the run is already in, or a
    later attempt of its workflow run is. An earlier attempt of it is replaced."""
    run = record["run"]
    if superseded(conn, run["run_id"]):
        return False
    older = [seq for seq, _ in _attempts(conn, run["run_id"])]
    _drop_runs(conn, older)
    seq = conn.execute("INSERT INTO runs(run_id, date, trigger, commit_sha, tool_version, generated_at, kind, nights) "
                       "VALUES(?, ?, ?, ?, ?, ?, ?, ?)", (run["run_id"], run["date"], run.get("trigger", ""),
                                                          run.get("commit", ""), run.get("tool_version", ""),
                                                          run.get("generated_at", ""), kind, nights)).lastrowid
    cache: dict[Any, int] = {}
    env_ids = []
    for stamp in record["envs"]:
        text = json.dumps(stamp, sort_keys=True)
        env_ids.append(_id(conn, cache, "envs", ("hash",), (hashlib.sha256(text.encode()).hexdigest(),), {"json": text}))
    cell_ids = []
    rows: dict[int, tuple[Any, ...]] = {}
    for cid, model, backend, status, duration, env, modes in record["cells"]:
        cell_ids.append(_id(conn, cache, "cells", ("cell",), (cid,), {"model": model, "backend": backend}))
        rows[cell_ids[-1]] = (seq, cell_ids[-1], status, duration, env_ids[env], ",".join(f"{m}={s}" for m, s in modes.items()))
    # a cell given twice (a record made elsewhere: `history add` refuses such results) counts once, its last entry
    last = {ci: i for i, ci in enumerate(cell_ids)}
    conn.executemany("INSERT INTO cell_runs VALUES(?, ?, ?, ?, ?, ?)", list(rows.values()))
    known = dict(((c, fp), i) for i, c, fp in conn.execute("SELECT id, cell, fingerprint FROM findings WHERE cell IN "
                                                            f"({','.join('?' * len(cell_ids))})", cell_ids)) if cell_ids else {}
    present: list[int] = []
    for ci, fp, fkind, mode, op, module, sig in record["findings"]:
        if last[cell_ids[ci]] != ci:
            continue
        key = (cell_ids[ci], fp)
        if key not in known:
            texts = [_id(conn, cache, "strings", ("text",), (t or "",)) for t in (fkind, mode, op, module, sig)]
            known[key] = int(conn.execute("INSERT INTO findings(cell, fingerprint, kind, mode, op, module, signature) "
                                          "VALUES(?, ?, ?, ?, ?, ?, ?)", (*key, *texts)).lastrowid)
        present.append(known[key])
    present = sorted(set(present))
    conn.execute("INSERT INTO run_findings VALUES(?, ?)", (seq, pack_ids(present)))
    _mark_seen(conn, seq, run["date"], present)
    for ci, names, thresholds, worst in record["layers"]:
        if last[cell_ids[ci]] != ci:
            continue
        names_text = json.dumps(names)
        thr = quantize(x for row in thresholds for x in row)
        lsid = _id(conn, cache, "layer_sets", ("hash",), (hashlib.sha256(names_text.encode() + thr).hexdigest(),),
                   {"names": names_text, "thresholds": thr})
        conn.execute("INSERT INTO layer_figures VALUES(?, ?, ?, ?)",
                     (seq, cell_ids[ci], lsid, quantize(x for row in worst for x in row)))
    conn.executemany("INSERT INTO cell_figures VALUES(?, ?, ?)", [(seq, cell_ids[ci], json.dumps(figs, sort_keys=True))
                                                                   for ci, figs in record.get("figures") or ()
                                                                   if figs and last[cell_ids[ci]] == ci])
    if older:
        recompute_seen(conn)
    return True


_IDS = "SELECT value FROM json_each(?)"


def _mark_seen(conn: sqlite3.Connection, seq: int, day: str, present: list[int]) -> None:
    """Update first/last seen and the current streaks for a new run: incrementally when it is the newest night
    (the usual case), else by a walk over every night (a run added late). A finding is new when the last earlier
    run *that ran its cell* did not have it: a run of other cells the same night (split workflows) or a night the
    cell was not selected breaks no streak."""
    ids = json.dumps(present)
    conn.execute("UPDATE findings SET first_seen = CASE WHEN first_seen IS NULL OR first_seen > ?1 THEN ?1 ELSE first_seen END,"
                 " last_seen = CASE WHEN last_seen IS NULL OR last_seen < ?1 THEN ?1 ELSE last_seen END"
                 f" WHERE id IN ({_IDS.replace('?', '?2')})", (day, ids))
    prev = conn.execute("SELECT seq, date FROM runs WHERE seq != ? ORDER BY date DESC, seq DESC LIMIT 1", (seq,)).fetchone()
    if prev is not None and prev[1] > day:
        recompute_streaks(conn)
        return
    if not present:
        return
    cell_of = dict(conn.execute(f"SELECT id, cell FROM findings WHERE id IN ({_IDS})", (ids,)).fetchall())
    last: dict[int, tuple[str, int]] = {}  # cell → (date, seq) of the newest earlier run that ran it
    for cell, run, date in conn.execute(
            "SELECT cr.cell, r.seq, r.date FROM cell_runs cr JOIN runs r ON r.seq = cr.run WHERE r.seq != ? AND cr.cell "
            f"IN ({_IDS})", (seq, json.dumps(sorted(set(cell_of.values()))))):
        if cell not in last or (date, run) > last[cell]:
            last[cell] = (date, run)
    sets: dict[int, frozenset[int]] = {}
    for _, run in last.values():
        if run not in sets:
            row = conn.execute("SELECT ids FROM run_findings WHERE run = ?", (run,)).fetchone()
            sets[run] = unpack_ids(row[0]) if row else frozenset()
    new = [f for f in present if f not in (sets[last[cell_of[f]][1]] if cell_of.get(f) in last else ())]
    conn.execute(f"UPDATE findings SET streak_from = ? WHERE id IN ({_IDS})", (day, json.dumps(new)))


def recompute_streaks(conn: sqlite3.Connection) -> None:
    """Every finding's current streak from a walk over the nights, oldest first, each finding held against the last
    earlier run that ran its cell."""
    cell_of = dict(conn.execute("SELECT id, cell FROM findings").fetchall())
    ran: dict[int, set[int]] = {}
    for run, cell in conn.execute("SELECT run, cell FROM cell_runs"):
        ran.setdefault(run, set()).add(cell)
    start: dict[int, str] = {}
    last: dict[int, frozenset[int]] = {}  # cell → what the last run that ran it found
    for seq, day in conn.execute("SELECT seq, date FROM runs ORDER BY date, seq").fetchall():
        row = conn.execute("SELECT ids FROM run_findings WHERE run = ?", (seq,)).fetchone()
        now = unpack_ids(row[0]) if row else frozenset()
        for fid in now:
            if fid not in last.get(cell_of.get(fid, -1), frozenset()):
                start[fid] = day
        for cell in ran.get(seq, ()):
            last[cell] = now
    conn.execute("UPDATE findings SET streak_from = NULL")
    conn.executemany("UPDATE findings SET streak_from = ? WHERE id = ?", [(d, i) for i, d in start.items()])


def open_for_write(path: Path) -> sqlite3.Connection:
    """The database for a writer. A new one is made whole beside it and linked into place (`_create`), so a full disk
    or a kill never leaves an empty or half-made database; later writes are SQLite transactions (rolled back whole).
    `sqlite3.OperationalError` (disk full, I/O error, locked past the timeout) is an `OutputError` (exit 5)."""
    path = Path(path)
    try:
        if not path.exists() or path.stat().st_size == 0:
            _create(path)
        conn = connect(path, create=True)
        conn.execute("PRAGMA journal_mode=DELETE")
    except sqlite3.OperationalError as exc:
        raise write_error(path, exc) from None
    return conn


def write_error(path: Path, exc: sqlite3.Error) -> OutputError:
    return OutputError(f"cannot write the history database {path}: {exc}",
                       hint="free space on that file system (or fix its permissions), then add the run again; "
                            "the history holds what it held before")


def _create(path: Path) -> None:
    """A fresh, migrated database at `path`, made in a temp file beside it and linked into place while holding a lock
    on the folder (two writers creating one history: the second finds the first's). An empty file at `path` (left by
    a version that created the database in place when the disk filled) holds nothing and is replaced."""
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    lock = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists() and path.stat().st_size > 0:
            return  # another writer made it meanwhile
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
        os.fchmod(fd, file_mode())  # as SQLite would create it (mkstemp's 0600 otherwise)
        os.close(fd)
        try:
            conn = sqlite3.connect(tmp, isolation_level=None)
            try:
                migrate(conn, 0)
            finally:
                conn.close()
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise output_error(path, exc) from None
    finally:
        os.close(lock)


FOLD_ERRORS = (sqlite3.IntegrityError, KeyError, IndexError, TypeError, ValueError)  # a damaged or foreign record


def fold(conn: sqlite3.Connection, records: Iterable[tuple[Path, Mapping[str, Any]]], *,
         skip: Callable[[Path, str], None] | None = None) -> list[str]:
    """Fold records into the database in one write transaction (other writers wait); the run ids added.

    Each record is folded whole or not at all (a savepoint each). One that cannot be folded (a damaged record) is
    an `InputError` that keeps nothing, or, with `skip`, is left out (`skip(path, why)`) while the others go in:
    one bad file never wedges a history."""
    added: list[str] = []
    conn.execute("BEGIN IMMEDIATE")
    try:
        for path, rec in records:
            conn.execute("SAVEPOINT record")
            try:
                if insert_record(conn, rec):
                    added.append(rec["run"]["run_id"])
            except FOLD_ERRORS as exc:
                conn.execute("ROLLBACK TO record")
                conn.execute("RELEASE record")
                why = f"{type(exc).__name__}: {exc}"
                if skip is None:
                    raise InputError(f"{path}: history record cannot be added ({why})",
                                     hint="the record is damaged; remove it from the history's runs/ folder and add "
                                          "the run again from its results.json") from None
                skip(path, why)
                continue
            conn.execute("RELEASE record")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:  # SQLite rolls back by itself on a full disk or an I/O error
            conn.execute("ROLLBACK")
        raise
    return added


def memory_copy(path: Path | None) -> sqlite3.Connection:
    """An in-memory copy of the database (or a fresh one), to merge pending records into for reading."""
    mem = sqlite3.connect(":memory:", isolation_level=None)
    if path is None or not Path(path).exists():
        migrate(mem, 0)
        return mem
    src = connect(path, create=False)
    try:
        src.backup(mem)
    finally:
        src.close()
    return mem
