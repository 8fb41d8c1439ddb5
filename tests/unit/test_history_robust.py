"""Issue 34: one night is one run (a re-run replaces its attempt), and a history that cannot be read is set aside
with a warning while the run goes on (the branch itself is repaired by the next push:
tests/integration/test_history_git.py)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import sqlite3
from pathlib import Path

import pytest

from ci_runner.history.records import RunMeta, record_of, write_record
from ci_runner.history.store import add_run, fold_pending, load_history
from ci_runner.results.model import fingerprint
from tests.fixtures.history_sim import FAILING_OP, date_of, night_results


def meta(run_id: str, night: int) -> RunMeta:
    return RunMeta(run_id=run_id, date=date_of(night), trigger="schedule", generated_at=f"{date_of(night)}T02:0{run_id[-1]}:00Z")


def with_failing(night: int, failing: bool):
    """Night `night`'s results; `failing` keeps the scripted failing op in or takes it out."""
    r = night_results(night)
    subset = next(c for c in r.cells if c.id == "tiny-llama@sim-subset")
    findings = subset.modes["ops"].findings
    if failing and not any(f.op == FAILING_OP for f in findings):
        from tests.fixtures.results_factory import unsupported_op

        findings.append(unsupported_op("sim-subset", FAILING_OP))
    if not failing:
        subset.modes["ops"].findings = [f for f in findings if f.op != FAILING_OP]
    return r


FAILING_FP = fingerprint("unsupported_op", "sim-subset", FAILING_OP)


def streak_of(store: Path) -> tuple[list[str], str]:
    h = load_history(store)
    try:
        ids = [r.run_id for r in h.runs]
        row = next((f for f in h.findings.values() if f.fingerprint == FAILING_FP), None)
        return ids, (row.first_seen if row else "")
    finally:
        h.close()


def test_a_rerun_replaces_its_attempt_and_counts_once(tmp_path: Path) -> None:
    store = tmp_path / "h"
    add_run(store, with_failing(1, False), meta("100-1", 1))
    add_run(store, with_failing(2, True), meta("200-1", 2))  # night 2, attempt 1: the op fails (a flake)
    add_run(store, with_failing(2, False), meta("200-2", 2))  # its re-run: the op passes
    ids, first = streak_of(store)
    assert ids == ["100-1", "200-2"] and first == ""  # one run for night 2; the flake left no trace
    _, new = add_run(store, with_failing(2, True), meta("200-1", 2))  # attempt 1 arriving late is not added
    assert not new and streak_of(store)[0] == ["100-1", "200-2"]
    add_run(store, with_failing(3, True), meta("300-1", 3))
    add_run(store, with_failing(3, True), meta("300-2", 3))
    ids, first = streak_of(store)
    assert ids == ["100-1", "200-2", "300-2"] and first == date_of(3)
    h = load_history(store)
    try:
        assert sum(r.nights for r in h.runs) == 3
    finally:
        h.close()


def test_pending_attempts_fold_to_one_run_and_leave_no_file(tmp_path: Path) -> None:
    store = tmp_path / "h"
    for rid in ("7-1", "7-3", "7-2"):
        write_record(record_of(with_failing(1, rid == "7-1"), meta(rid, 1)), store / "runs")
    assert streak_of(store)[0] == ["7-3"]  # a reader merges the pending files the same way
    fold_pending(store)
    assert list((store / "runs").iterdir()) == [] and streak_of(store)[0] == ["7-3"]


def test_the_current_run_replaces_its_earlier_attempt_in_the_trends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`aggregate --history` on a re-run: the branch holds attempt 1 of tonight; tonight counts once."""
    from ci_runner.history.commands import trends_for

    store = tmp_path / "h"
    for night in range(1, 4):
        add_run(store, with_failing(night, True), meta(f"{night}0-1", night))
    monkeypatch.setenv("GITHUB_RUN_ID", "30")
    monkeypatch.setenv("GITHUB_RUN_ATTEMPT", "2")
    args = type("A", (), {"history": str(store), "flaky_window": 14, "flaky_flips": 3, "drift_nights": 5,
                          "drift_min_slope": 0.03})()
    trends = trends_for(args, dataclasses.replace(with_failing(3, True), generated_at=f"{date_of(3)}T05:00:00Z"))
    assert trends is not None and trends.nights == 3 and trends.dates == [date_of(1), date_of(2), date_of(3)]
    since = trends.since[("tiny-llama@sim-subset", FAILING_FP)]
    assert since.date == date_of(1) and since.nights == 3


# --------------------------------------------------------------------------- a history that cannot be read


def _cells_dir(night: int, run: Path) -> Path:
    from ci_runner.results.model import save_cell_result

    for c in night_results(night).cells:
        save_cell_result(c, run / "cells" / c.id / "result.json")
    return run


def _break(store: Path, how: str) -> None:
    dbfile = store / "history.sqlite"
    if how == "garbage":
        dbfile.write_bytes(b"not a database at all " * 400)
    elif how == "truncated":
        data = dbfile.read_bytes()
        dbfile.write_bytes(data[: len(data) // 2])
    elif how == "newer":
        con = sqlite3.connect(dbfile)
        con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
        con.commit()
        con.close()
    elif how == "bad-run-file":
        (store / "runs").mkdir(exist_ok=True)
        (store / "runs" / "2031-01-05_x.json.gz").write_bytes(b"\x1f\x8b garbage")
    elif how == "damaged-record":
        (store / "runs").mkdir(exist_ok=True)
        bad = {"kind": "deepview-ci-history-run", "schema_version": 1, "run": {"run_id": "y", "date": "2031-01-05"},
               "envs": [], "cells": [["only", "three", "fields"]], "findings": [], "layers": []}
        (store / "runs" / "2031-01-05_y.json.gz").write_bytes(gzip.compress(json.dumps(bad).encode()))


@pytest.mark.parametrize("how, nights", [("garbage", 1), ("truncated", 1), ("newer", 1), ("bad-run-file", 4),
                                         ("damaged-record", 4)])
def test_aggregate_and_diff_set_a_broken_history_aside_and_go_on(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 how: str, nights: int) -> None:
    """Before: exit 3, so the diff, the policy, the issues and the history job never ran and nothing repaired it."""
    from ci_runner.cli import main
    from ci_runner.results.baseline import dumps_baseline, make_baseline

    store = tmp_path / "h"
    for night in range(1, 4):
        add_run(store, night_results(night), meta(f"{night}0-1", night))
    _break(store, how)
    before = {p.name: p.read_bytes() for p in store.rglob("*") if p.is_file()}
    run = _cells_dir(4, tmp_path / "run")
    assert main(["aggregate", str(run), "--out", str(tmp_path / "rep"), "--history", str(store)]) == 0
    err = capsys.readouterr().err
    assert "deepview-ci: warning: history" in err and "set aside" in err and "Traceback" not in err, err
    summary = (tmp_path / "rep" / "summary.md").read_text(encoding="utf-8")
    assert f"History: {nights} night(s)" in summary
    base = tmp_path / "baseline.json"
    base.write_text(dumps_baseline(make_baseline(night_results(4))))
    assert main(["diff", str(tmp_path / "rep" / "results.json"), "--baseline", str(base), "--history", str(store)]) == 0
    assert "set aside" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in store.rglob("*") if p.is_file()} == before  # a reader writes nothing


def test_split_workflows_writing_one_history_count_each_night_once(tmp_path: Path) -> None:
    """Two workflows, each with part of the matrix, push a run each night. Before: the streak of a finding restarted
    at every run of the other workflow (its cell did not run there), so 'failing since' said 1 night, and the
    history counted 2 nights a night."""
    from ci_runner.history.trends import compute

    store = tmp_path / "h"
    for night in range(1, 6):
        whole = with_failing(night, True)
        part_a = dataclasses.replace(whole, cells=[c for c in whole.cells if c.id == "tiny-llama@sim-subset"],
                                     generated_at=f"{date_of(night)}T02:00:00Z")
        part_b = dataclasses.replace(whole, cells=[c for c in whole.cells if c.id != "tiny-llama@sim-subset"],
                                     generated_at=f"{date_of(night)}T03:00:00Z")
        add_run(store, part_a, meta(f"{night}00-1", night))
        add_run(store, part_b, meta(f"{night}50-1", night))
    h = load_history(store)
    try:
        assert len(h.runs) == 10
        trends = compute(h)
    finally:
        h.close()
    assert trends.nights == 5
    since = trends.since[("tiny-llama@sim-subset", FAILING_FP)]
    assert since.date == date_of(1) and since.nights == 5 and "sim-subset 0.4.1" in since.first_at
    # the charts: one point a night, each cell's own run of it (before: 10 points, every other one without the cell)
    assert trends.dates == [date_of(n) for n in range(1, 6)]
    [subset] = [b for b in trends.burndown if b.backend == "sim-subset"]
    assert subset.unsupported == [subset.unsupported[0]] * 5 and subset.unsupported[0] >= 1 and subset.blocked == [1] * 5
    assert all(None not in times and len(times) == 5 for times in trends.cell_times.values())
    # the walk over every night (a run added late) agrees with the incremental update
    from ci_runner.history import db

    conn = db.open_for_write(store / "history.sqlite")
    try:
        before = dict(conn.execute("SELECT id, streak_from FROM findings").fetchall())
        db.recompute_streaks(conn)
        assert dict(conn.execute("SELECT id, streak_from FROM findings").fetchall()) == before
    finally:
        conn.close()


def test_a_check_after_the_nightly_on_the_same_date_is_the_same_night_and_wins_for_its_cells(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ci_runner.history.commands import trends_for

    store = tmp_path / "h"
    for night in range(1, 4):
        add_run(store, with_failing(night, True), meta(f"{night}0-1", night))
    monkeypatch.setenv("GITHUB_RUN_ID", "999")  # another workflow (a PR check), later the same date
    monkeypatch.setenv("GITHUB_RUN_ATTEMPT", "1")
    args = type("A", (), {"history": str(store), "flaky_window": 14, "flaky_flips": 3, "drift_nights": 5,
                          "drift_min_slope": 0.03})()
    fixed = dataclasses.replace(with_failing(3, False), generated_at=f"{date_of(3)}T15:00:00Z")
    trends = trends_for(args, fixed)
    assert trends is not None and trends.nights == 3
    assert ("tiny-llama@sim-subset", FAILING_FP) not in trends.since  # the check's own result for that cell
    assert any(s.fingerprint == FAILING_FP for s in trends.gone)


def test_split_workflows_still_see_a_drifting_layer(tmp_path: Path) -> None:
    """The drift window is nights, not runs: with two workflows a night, the last 6 runs held only 3 of the drifting
    cell's figures, too few to ever call it drifting."""
    from ci_runner.history.trends import compute
    from tests.fixtures.history_sim import DRIFT_CELL, DRIFT_LAYER

    store = tmp_path / "h"
    for night in range(38, 47):
        whole = night_results(night)
        for k, part in enumerate(([c for c in whole.cells if c.id == DRIFT_CELL], [c for c in whole.cells if c.id != DRIFT_CELL])):
            add_run(store, dataclasses.replace(whole, cells=part, generated_at=f"{date_of(night)}T0{k + 2}:00:00Z"),
                    meta(f"{night}{k}0-1", night))
    h = load_history(store)
    try:
        trends = compute(h)
    finally:
        h.close()
    assert trends.nights == 9 and len(trends.dates) == 9
    assert any(d.cell == DRIFT_CELL and d.layer == DRIFT_LAYER for d in trends.drifting), trends.drifting


def test_baseline_propose_counts_nights_of_split_workflows(tmp_path: Path) -> None:
    """Before: the last 3 runs were a night and a half, and a cell missing from one of them proposed nothing ever."""
    from ci_runner.history.propose import propose
    from ci_runner.results.baseline import dumps_baseline, load_baseline, make_baseline

    store = tmp_path / "h"
    for night in range(1, 7):
        whole = with_failing(night, night <= 3)
        for k, part in enumerate(([c for c in whole.cells if c.id == "tiny-llama@sim-subset"],
                                  [c for c in whole.cells if c.id != "tiny-llama@sim-subset"])):
            add_run(store, dataclasses.replace(whole, cells=part, generated_at=f"{date_of(night)}T0{k + 2}:00:00Z"),
                    meta(f"{night}{k}0-1", night))
    path = tmp_path / "baseline.json"
    path.write_text(dumps_baseline(make_baseline(with_failing(1, True))))
    h = load_history(store)
    try:
        prop = propose(h, load_baseline(path))
    finally:
        h.close()
    assert [n.date for n in prop.nights] == [date_of(n) for n in (4, 5, 6)]
    assert any(c.what == "remove finding" and "cumsum" in c.detail for c in prop.changes), prop.changes
