"""The run history (issue 20): sixty scripted nights, flaky versus drifting, proposals, bad files (two writers at
once: `tests/integration/test_history_git.py`)."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ci_runner.cli import main
from ci_runner.errors import EXIT_EXECUTION, EXIT_INPUT
from ci_runner.history.compact import COLUMNS, compact
from ci_runner.history.store import add_run, load_history
from ci_runner.history.trends import compute
from ci_runner.report import write_reports
from ci_runner.results.baseline import dumps_baseline, load_baseline, make_baseline
from ci_runner.results.model import fingerprint, save_cell_result, save_results, schema
from tests.fixtures.history_sim import (ALWAYS_OP, DRIFT_CELL, DRIFT_LAYER, FAILING_OP, FLIPPING_OP, NEW_CELL, NIGHTS,
                                        build_history, date_of, meta_of, night_results)

SUBSET = "tiny-llama@sim-subset"
FAILING_FP = fingerprint("unsupported_op", "sim-subset", FAILING_OP)
FLIPPING_FP = fingerprint("unsupported_op", "sim-subset", FLIPPING_OP)


@pytest.fixture(scope="module")
def nights(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The history built night by night, with a copy of the store kept after nights 30, 39, 41, 42, 45 and 60."""
    root = tmp_path_factory.mktemp("history")
    store = root / "live"
    snaps: dict[int, Path] = {}
    done = 0
    for upto in (30, 39, 41, 42, 45, NIGHTS):
        build_history(store, upto, start=done + 1)
        done = upto
        snaps[upto] = root / f"night-{upto}"
        shutil.copytree(store, snaps[upto])
    return snaps


def _summary(store: Path, night: int, out: Path) -> str:
    h = load_history(store)
    try:
        paths = write_reports(night_results(night), out, env={}, trends=compute(h))
    finally:
        h.close()
    return paths["summary"].read_text(encoding="utf-8")


def test_night_30_summary_says_since_when_the_op_fails(nights: dict[int, Path], tmp_path: Path) -> None:
    text = _summary(nights[30], 30, tmp_path)
    row = next(line for line in text.splitlines() if "cumsum" in line and "failing since" in line)
    assert f"failing since {date_of(20)} (11 nights, first at sim-subset 0.4.1, commit " in row
    assert f"failing since {date_of(1)} (30 nights" in text  # the op failing every night
    assert "sim-subset" in text and "unsupported ops: 2 today, 2 7 nights ago, 1 30 nights ago" not in text
    line = next(x for x in text.splitlines() if x.startswith("- `sim-subset`"))
    assert "unsupported ops: 2 today, 2 7 nights ago, — 30 nights ago" in line, line
    assert "Drifting" not in text and "Flaky" not in text  # nothing flips or rises yet


def test_the_op_is_gone_from_night_40(nights: dict[int, Path]) -> None:
    h = load_history(nights[42])
    try:
        t = compute(h)
    finally:
        h.close()
    assert (SUBSET, FAILING_FP) not in t.since
    gone = next(g for g in t.gone if g.fingerprint == FAILING_FP)
    assert (gone.first_seen, gone.last_seen) == (date_of(20), date_of(39))
    b = next(b for b in t.burndown if b.backend == "sim-subset")
    assert b.unsupported[-1] == 1 and b.unsupported[19:39] == [2] * 20 and b.unsupported[:19] == [1] * 19


def _diff(store: Path, night: int, base: Path, tmp: Path) -> dict[str, Any]:
    results = tmp / "results.json"
    save_results(night_results(night), results)
    code = main(["diff", str(results), "--baseline", str(base), "--history", str(store), "--out", str(tmp)])
    data = json.loads((tmp / "diff.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema("diff.schema.json")).validate(data)
    data["exit"] = code
    return data


def test_the_flipping_finding_is_flaky_and_files_nothing(nights: dict[int, Path], tmp_path: Path) -> None:
    base = tmp_path / "baseline.json"
    base.write_text(dumps_baseline(make_baseline(night_results(39))), encoding="utf-8")
    d = _diff(nights[45], 45, base, tmp_path)  # night 45 shows it; 41, 43, 45 did, 42 and 44 did not
    flaky = [e for e in d["entries"] if e["category"] == "flaky"]
    assert [e["fingerprint"] for e in flaky] == [FLIPPING_FP]
    assert "came and went 5 times in the last 10 nights" in flaky[0]["reason"]
    assert not [e for e in d["entries"] if e["category"] == "regressed"] and d["exit"] == 0
    drafts = tmp_path / "drafts"
    assert main(["file-issues", str(tmp_path / "diff.json"), "--repo", "acme/models", "--dry-run", str(drafts)]) == 0
    texts = [p.read_text(encoding="utf-8") for p in drafts.glob("*.md")]
    assert texts and not [t for t in texts if FLIPPING_OP in t], "a flaky finding files no issue"
    assert all("-close-" in p.name for p in drafts.glob("*.md"))  # only the fixed op's issue would close
    # without the history the same run calls it a regression
    assert main(["diff", str(tmp_path / "results.json"), "--baseline", str(base), "--out", str(tmp_path / "plain")]) == 1


def test_the_rising_layer_is_drifting_before_it_crosses(nights: dict[int, Path], tmp_path: Path) -> None:
    text = _summary(nights[45], 45, tmp_path)
    rows = [x for x in text.splitlines() if DRIFT_LAYER in x and "drifting" in x]
    assert rows and all(DRIFT_CELL in r for r in rows)
    assert "rel rising +10.0%/night over 5 nights" in rows[0]
    value = 1e-4 * 1.1 ** 5
    assert value < 2e-3  # still under its threshold
    base = tmp_path / "baseline.json"
    base.write_text(dumps_baseline(make_baseline(night_results(45))), encoding="utf-8")
    d = _diff(nights[45], 45, base, tmp_path / "d")
    drift = [x for x in d["drifting"] if x["figure"] == "rel"]
    assert [(x["cell"], x["layer"]) for x in drift] == [(DRIFT_CELL, DRIFT_LAYER)]
    assert drift[0]["value"] == pytest.approx(value, rel=0.01) and drift[0]["crosses_in"] > 10
    # a flat history names nothing drifting
    assert "drifting" not in _summary(nights[39], 39, tmp_path / "flat")


def test_baseline_propose_at_night_42_drops_the_fixed_op(nights: dict[int, Path], tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "baseline.json"
    base.write_text(dumps_baseline(make_baseline(night_results(39))), encoding="utf-8")
    out = tmp_path / "proposed.json"
    args = ["baseline", "propose", "--history", "", "--baseline", str(base), "--out", str(out)]
    args[3] = str(nights[41])
    assert main(args) == 0 and not out.exists()  # two fixed nights: nothing yet
    assert "nothing to propose" in capsys.readouterr().out
    args[3] = str(nights[42])
    assert main(args) == 0
    proposed = load_baseline(out)
    assert (SUBSET, FAILING_FP) not in proposed.findings
    assert set(proposed.findings) == set(load_baseline(base).findings) - {(SUBSET, FAILING_FP)}
    assert (SUBSET, FLIPPING_FP) not in proposed.findings  # a regression never enters the baseline
    summary = (tmp_path / "proposed.md").read_text(encoding="utf-8")
    assert "remove finding" in summary and FAILING_OP in summary and "fixed for 3 nights in a row" in summary


def test_propose_opens_a_pull_request_through_the_api(nights: dict[int, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fixtures.fake_github import FakeGitHub

    base = tmp_path / "baseline.json"
    base.write_text(dumps_baseline(make_baseline(night_results(39))), encoding="utf-8")
    with FakeGitHub() as gh:
        monkeypatch.setenv("GITHUB_TOKEN", gh.token)
        monkeypatch.setenv("GITHUB_API_URL", gh.url)
        assert main(["baseline", "propose", "--history", str(nights[42]), "--baseline", str(base), "--out",
                     str(tmp_path / "p.json"), "--pr", "--repo", "acme/models", "--path", "deepview/baseline.json",
                     "--min-interval", "0"]) == 0
        [pr] = gh.pulls()
        assert "fixed for 3 nights in a row" in pr["body"] and pr["head"]["ref"] == "deepview-ci/baseline-update"
        assert gh.file_at("acme/models", "deepview-ci/baseline-update", "deepview/baseline.json") == \
            (tmp_path / "p.json").read_bytes()


def test_a_new_cell_passing_three_nights_is_proposed(nights: dict[int, Path], tmp_path: Path) -> None:
    base = tmp_path / "baseline.json"
    base.write_text(dumps_baseline(make_baseline(night_results(29))), encoding="utf-8")
    out = tmp_path / "p.json"
    assert main(["baseline", "propose", "--history", str(nights[30]), "--baseline", str(base), "--out", str(out)]) == 0
    assert not out.exists()  # the new model ran one night only
    assert main(["baseline", "propose", "--history", str(nights[39]), "--baseline", str(base), "--out", str(out)]) == 0
    assert load_baseline(out).cells[NEW_CELL].status == "pass"


def test_sixty_nights_report_has_sixty_point_burndowns(nights: dict[int, Path], tmp_path: Path) -> None:
    h = load_history(nights[NIGHTS])
    try:
        paths = write_reports(night_results(NIGHTS), tmp_path, env={}, trends=compute(h))
    finally:
        h.close()
    page = paths["html"].read_text(encoding="utf-8")
    charts = re.findall(r'<svg class="trend" data-kind="burndown" data-points="(\d+)"', page)
    assert charts == ["60"] * 3  # one per backend
    lines = re.findall(r'<polyline class="tline" data-series="unsupported ops"[^>]*points="([^"]*)"', page)
    assert lines and all(len(p.split()) == 60 for p in lines)
    assert "http" not in page.split("<section id=\"history\">")[1].split("</section>")[0].replace("http://www.w3.org/2000/svg", "")


def test_export_writes_the_documented_columns(nights: dict[int, Path], tmp_path: Path) -> None:
    assert main(["history", "export", "--store", str(nights[30]), "--out", str(tmp_path)]) == 0
    for name, cols in COLUMNS.items():
        lines = (tmp_path / f"{name}.csv").read_text(encoding="utf-8").splitlines()
        assert lines[0] == ",".join(cols)
    runs = (tmp_path / "runs.csv").read_text(encoding="utf-8").splitlines()
    assert len(runs) == 31 and runs[1].startswith(f"night-01,{date_of(1)},schedule,")
    findings = (tmp_path / "findings.csv").read_text(encoding="utf-8")
    assert findings.count(FAILING_OP) == 11  # nights 20..30
    layers = (tmp_path / "layers.csv").read_text(encoding="utf-8").splitlines()
    assert any(DRIFT_LAYER in x for x in layers)


def test_compaction_keeps_the_story_and_bounds_the_runs(nights: dict[int, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "h"
    shutil.copytree(nights[NIGHTS], store)
    before = load_history(store)
    t0 = compute(before)
    before.close()
    folded, weeks = compact(store, keep=20)
    assert folded == 40 and 6 <= weeks <= 7
    after = load_history(store)
    t1 = compute(after)
    assert len(after.runs) == 20 + weeks and sum(r.nights for r in after.runs) == 60
    after.close()
    key = (SUBSET, fingerprint("unsupported_op", "sim-subset", ALWAYS_OP))
    assert t1.since[key].nights == t0.since[key].nights == 60 and t1.since[key].date == date_of(1)
    assert main(["history", "show", "--store", str(store)]) == 0
    shown = capsys.readouterr().out
    assert "weekly (7 nights)" in shown and "night-60" in shown and "night-40" not in shown


# --------------------------------------------------------------------------- bad files and versions


def _cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def test_foreign_and_corrupt_histories_exit_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results.json"
    save_results(night_results(1), results)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "history.sqlite").write_bytes(b"this is not sqlite at all" * 100)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    con = sqlite3.connect(foreign / "history.sqlite")
    con.execute("CREATE TABLE users(name TEXT)")
    con.commit()
    con.close()
    badrec = tmp_path / "badrec"
    (badrec / "runs").mkdir(parents=True)
    (badrec / "runs" / "2031-01-01_x.json.gz").write_bytes(gzip.compress(b'{"kind": "something-else"}'))
    afile = tmp_path / "afile"
    afile.write_text("x")
    for store, words in ((garbage, "not a history database"), (foreign, "of something else"),
                         (badrec, "not a deepview-ci history record"), (afile, "must be a folder")):
        for args in (["history", "add", str(results), "--store", str(store)], ["history", "show", "--store", str(store)]):
            code, err = _cli(args, capsys)
            if store is afile and args[1] == "add":  # an output folder that cannot be written: exit 5, before any work
                assert code == EXIT_EXECUTION and "a file is in the way" in err and "Traceback" not in err, err
                continue
            assert code == EXIT_INPUT, (args, err)
            assert words in err and "Traceback" not in err and "hint:" in err


def test_a_newer_history_is_refused_and_left_untouched(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "h"
    add_run(store, night_results(1), meta_of(1))
    con = sqlite3.connect(store / "history.sqlite")
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    before = (store / "history.sqlite").read_bytes()
    results = tmp_path / "results.json"
    save_results(night_results(2), results)
    cells = _cells_dir(2, tmp_path / "run")
    for args in (["history", "add", str(results), "--store", str(store)], ["history", "compact", "--store", str(store)]):
        code, err = _cli(args, capsys)
        assert code == EXIT_INPUT and "newer deepview-ci" in err and "left untouched" in err, err
    # the nightly's report goes on (issue 34): the newer history is set aside with a warning, and left as it is
    code, err = _cli(["aggregate", str(cells), "--out", str(tmp_path / "rep"), "--history", str(store)], capsys)
    assert code == 0 and "warning: history set aside" in err and "newer deepview-ci" in err, err
    assert (store / "history.sqlite").read_bytes() == before
    assert not list((store / "runs").glob("*.json.gz")), "nothing was added beside it either"
    rec = store / "runs" / "2031-01-09_n.json.gz"
    rec.write_bytes(gzip.compress(json.dumps({"kind": "deepview-ci-history-run", "schema_version": 7}).encode()))
    con = sqlite3.connect(store / "history.sqlite")
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    code, err = _cli(["history", "show", "--store", str(store)], capsys)
    assert code == EXIT_INPUT and "newer than this deepview-ci reads" in err


def test_the_first_night_reads_an_empty_history(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The history branch does not exist yet: the report says so and starts the trends with this run."""
    assert main(["aggregate", str(_cells_dir(1, tmp_path / "run")), "--out", str(tmp_path / "rep"),
                 "--history", str(tmp_path / "none")]) == 0
    assert "no history at" in capsys.readouterr().err and not (tmp_path / "none").exists()
    assert "History: 1 night(s)" in (tmp_path / "rep" / "summary.md").read_text(encoding="utf-8")


def _cells_dir(night: int, run: Path) -> Path:
    for c in night_results(night).cells:
        save_cell_result(c, run / "cells" / c.id / "result.json")
    return run


def test_aggregate_with_history_reads_but_never_writes(nights: dict[int, Path], tmp_path: Path) -> None:
    store = tmp_path / "h"
    shutil.copytree(nights[30], store)
    before = {p.name: p.read_bytes() for p in store.rglob("*") if p.is_file()}
    cells = _cells_dir(31, tmp_path / "run")
    assert main(["aggregate", str(cells), "--out", str(tmp_path / "rep"), "--history", str(store)]) == 0
    assert {p.name: p.read_bytes() for p in store.rglob("*") if p.is_file()} == before
    text = (tmp_path / "rep" / "summary.md").read_text(encoding="utf-8")
    assert f"failing since {date_of(20)} (12 nights" in text  # tonight (31) counted, not stored


def test_adding_the_same_run_twice_keeps_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results.json"
    save_results(night_results(3), results)
    args = ["history", "add", str(results), "--store", str(tmp_path / "h"), "--run-id", "n3", "--date", date_of(3)]
    assert main(args) == 0 and main(args) == 0
    out = capsys.readouterr().out
    assert "added run n3" in out and "already holds run n3" in out
    assert main(["history", "add", str(results), "--store", str(tmp_path / "h"), "--date", "2031-02-30"]) == 2
    assert "not a date" in capsys.readouterr().err
    h = load_history(tmp_path / "h")
    assert [r.run_id for r in h.runs] == ["n3"] and len(h.present[h.runs[0].seq]) == 1
    h.close()


def _with_figures(night: int, graphs: int, compile_s: float) -> Any:
    """A night whose ops mode (of the first cell) reports named figures, as the compile and memory modes do."""
    results = night_results(night)
    results.cells[0].modes["ops"].data["figures"] = {"graphs.decode": graphs, "compile_s.decode": compile_s,
                                                      "bad": float("nan"), "flag": True}
    return results


def test_named_figures_are_kept_per_night_and_the_ones_that_moved_are_reported(tmp_path: Path) -> None:
    """A mode's `data.figures` go into the history (schema 2: `cell_figures`); the trends name a count that changed
    (any change) and seconds that moved by more than 20 %, not seconds within it; non-numbers are not kept."""
    store = tmp_path / "h"
    for night, graphs, secs in ((1, 3, 10.0), (2, 3, 10.5), (3, 5, 10.9)):
        add_run(store, _with_figures(night, graphs, secs), meta_of(night))
    h = load_history(store)
    try:
        t = compute(h)
    finally:
        h.close()
    cell = night_results(1).cells[0].id
    assert t.figures[cell] == {"ops.compile_s.decode": [10.0, 10.5, 10.9], "ops.graphs.decode": [3.0, 3.0, 5.0]}
    assert [(m.cell, m.name, m.before, m.now) for m in t.moved] == [(cell, "ops.graphs.decode", 3.0, 5.0)]
    summary = write_reports(_with_figures(3, 5, 10.9), tmp_path / "rep", env={}, trends=t)["summary"].read_text()
    assert "Figures that moved since the night before" in summary and "ops.graphs.decode: 3 → 5 (+67%)" in summary


def test_a_schema_1_history_gains_the_figures_table_when_written(tmp_path: Path) -> None:
    store = tmp_path / "h"
    add_run(store, night_results(1), meta_of(1))
    con = sqlite3.connect(store / "history.sqlite")
    con.execute("DROP TABLE cell_figures")
    con.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    h = load_history(store)  # read as it is, without a migration: no figures yet
    try:
        assert compute(h).figures == {} and len(h.runs) == 1
    finally:
        h.close()
    add_run(store, _with_figures(2, 4, 1.0), meta_of(2))
    con = sqlite3.connect(store / "history.sqlite")
    try:
        assert con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
        assert con.execute("SELECT COUNT(*) FROM cell_figures").fetchone() == (1,)
    finally:
        con.close()
