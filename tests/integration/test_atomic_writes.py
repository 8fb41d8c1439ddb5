"""History writes are atomic and idempotent per run id, and the report folder is written whole or not at all:
a damaged record never wedges a history, a full disk (a child under `RLIMIT_FSIZE`) never leaves an empty database, a
stray record file or a partial report."""

from __future__ import annotations

import io
import os
import sqlite3
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from ci_runner import cli, errors
from ci_runner.history import db
from ci_runner.history.records import dump_record, record_of, run_meta
from ci_runner.history.store import DB_NAME, REJECTED_SUFFIX, RUNS_DIR
from ci_runner.results.model import save_results
from tests.fixtures.paths import ROOT
from tests.fixtures.results_factory import sample_results

FULL_DISK = ("import resource, signal, sys\n"
             "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like ENOSPC\n"
             "limit = int(sys.argv[1])\n"
             "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))\n"
             "from ci_runner.cli import main\n"
             "sys.exit(main(sys.argv[2:]))\n")


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def _cli_on_a_full_disk(limit: int, *args: str) -> subprocess.CompletedProcess[str]:
    """`deepview-ci ARGS` in a child that cannot write a file past `limit` bytes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    for var in ("GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-c", FULL_DISK, str(limit), *args], env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    for var in ("GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY", "GITHUB_ACTIONS"):
        monkeypatch.delenv(var, raising=False)
    save_results(sample_results(), tmp_path / "results.json")
    return tmp_path


def _add(workdir: Path, run_id: str, date: str) -> tuple[int, str, str]:
    return _cli("history", "add", str(workdir / "results.json"), "--store", str(workdir / "hist"), "--run-id", run_id,
                "--date", date)


def _runs(store: Path) -> list[str]:
    conn = sqlite3.connect(store / DB_NAME)
    try:
        return [r[0] for r in conn.execute("SELECT run_id FROM runs ORDER BY seq")]
    finally:
        conn.close()


def _pending_record(workdir: Path, run_id: str, date: str, damage: str) -> Path:
    results = sample_results()
    if damage == "cell-twice":
        results.cells.append(results.cells[0])
    record = record_of(results, run_meta(results, run_id=run_id, date=date, env={}))
    if damage == "bad-index":
        record["findings"][0][0] = 999  # a finding of a cell the record does not have
    path = workdir / "hist" / RUNS_DIR / f"{date}_{run_id}.json.gz"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(dump_record(record))
    return path


def test_a_pending_record_with_a_cell_twice_folds_once_per_cell(workdir: Path) -> None:
    assert _add(workdir, "r1", "2031-01-01")[0] == 0
    _pending_record(workdir, "r2", "2031-01-02", "cell-twice")  # written by another version: not refused at add
    code, out, err = _add(workdir, "r3", "2031-01-03")
    assert code == 0, err
    assert sorted(_runs(workdir / "hist")) == ["r1", "r2", "r3"]
    conn = sqlite3.connect(workdir / "hist" / DB_NAME)
    seq = conn.execute("SELECT seq FROM runs WHERE run_id = 'r2'").fetchone()[0]
    assert conn.execute("SELECT COUNT(*) FROM cell_runs WHERE run = ?", (seq,)).fetchone()[0] == len(sample_results().cells)
    conn.close()
    code, out, err = _cli("history", "show", "--store", str(workdir / "hist"))
    assert code == 0 and "r2" in out, err


def test_a_damaged_pending_record_is_set_aside_not_a_wedge(workdir: Path) -> None:
    assert _add(workdir, "r1", "2031-01-01")[0] == 0
    bad = _pending_record(workdir, "r2", "2031-01-02", "bad-index")
    code, out, err = _cli("history", "show", "--store", str(workdir / "hist"))  # a reader: left out, file untouched
    assert code == 0 and "Traceback" not in err and "left out" in err, err
    assert bad.exists()
    code, out, err = _add(workdir, "r3", "2031-01-03")  # a writer: set aside, the other runs go in
    assert code == 0 and "set aside" in err, err
    assert not bad.exists() and bad.with_name(bad.name + REJECTED_SUFFIX).exists()
    assert _runs(workdir / "hist") == ["r1", "r3"]
    assert _add(workdir, "r4", "2031-01-04")[0] == 0  # and every later add works
    assert _cli("history", "show", "--store", str(workdir / "hist"))[0] == 0


def test_a_full_disk_leaves_no_empty_database_nor_a_record(workdir: Path) -> None:
    store = workdir / "hist"
    proc = _cli_on_a_full_disk(8192, "history", "add", str(workdir / "results.json"), "--store", str(store),
                               "--run-id", "r1", "--date", "2031-01-01")
    assert proc.returncode == errors.EXIT_EXECUTION, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 3, proc.stderr
    assert not (store / DB_NAME).exists()  # never a 0-byte or half-made database
    assert [p.name for p in store.rglob("*") if p.is_file()] == []  # nor a record or temp file
    code, out, err = _cli("history", "show", "--store", str(store))
    assert code == 0 and out.startswith("0 run(s)"), err
    assert _add(workdir, "r1", "2031-01-01")[0] == 0  # with space again, the same add works
    assert _runs(store) == ["r1"]


def test_a_full_disk_on_a_second_run_keeps_the_history_as_it_was(workdir: Path) -> None:
    store = workdir / "hist"
    assert _add(workdir, "r1", "2031-01-01")[0] == 0
    proc = _cli_on_a_full_disk(2048, "history", "add", str(workdir / "results.json"), "--store", str(store),
                               "--run-id", "r2", "--date", "2031-01-02")
    assert proc.returncode == errors.EXIT_EXECUTION, proc.stderr
    assert "Traceback" not in proc.stderr and "history database" in proc.stderr, proc.stderr
    assert _runs(store) == ["r1"] and list((store / RUNS_DIR).glob("*")) == []
    assert _add(workdir, "r2", "2031-01-02")[0] == 0
    assert _add(workdir, "r2", "2031-01-02")[1].startswith("history: already holds")  # idempotent per run id
    assert _runs(store) == ["r1", "r2"]


def test_an_empty_database_file_reads_as_a_new_history(workdir: Path) -> None:
    store = workdir / "hist"
    store.mkdir()
    (store / DB_NAME).write_bytes(b"")  # what a full disk left under an older version
    code, out, err = _cli("history", "show", "--store", str(store))
    assert code == 0 and out.startswith("0 run(s)"), err
    assert _add(workdir, "r1", "2031-01-01")[0] == 0
    assert _runs(store) == ["r1"]


def test_fold_without_skip_keeps_nothing_of_a_damaged_record(workdir: Path) -> None:
    conn = db.memory_copy(None)
    good = record_of(sample_results(), run_meta(sample_results(), run_id="r1", date="2031-01-01", env={}))
    bad = record_of(sample_results(), run_meta(sample_results(), run_id="r2", date="2031-01-02", env={}))
    bad["findings"][0][0] = 999
    with pytest.raises(errors.InputError):
        db.fold(conn, [(Path("a"), good), (Path("b"), bad)])
    assert conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 0
    skipped: list[Path] = []
    assert db.fold(conn, [(Path("a"), good), (Path("b"), bad)], skip=lambda p, why: skipped.append(p)) == ["r1"]
    assert skipped == [Path("b")]


def test_aggregate_on_a_full_disk_leaves_the_old_report(workdir: Path) -> None:
    run = workdir / "run"
    for cell in sample_results().cells:
        from ci_runner.results.model import save_cell_result
        save_cell_result(cell, run / "cells" / cell.id / "result.json")
    report = workdir / "report"
    assert _cli("aggregate", str(run), "--out", str(report))[0] == 0
    sizes = {p.name: p.stat().st_size for p in report.iterdir()}
    assert sorted(sizes) == ["junit.xml", "report.html", "results.json", "summary.md"]
    for p in report.iterdir():
        p.write_text("old\n", encoding="utf-8")
    proc = _cli_on_a_full_disk(min(sizes.values()) + 1, "aggregate", str(run), "--out", str(report))
    assert proc.returncode == errors.EXIT_EXECUTION, proc.stderr
    assert "Traceback" not in proc.stderr and "left as it was" in proc.stderr, proc.stderr
    assert {p.name: p.read_text(encoding="utf-8") for p in report.iterdir()} == {name: "old\n" for name in sizes}
