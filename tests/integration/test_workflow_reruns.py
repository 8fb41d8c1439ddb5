"""Issue 34: the reusable pipeline (deepview.yml) under GitHub's two kinds of re-run, played job by job
(tests/fixtures/workflow_sim.py) against the local GitHub-like server, which refuses a second artifact of one
name in a run (409 Conflict), as upload-artifact v4 does.

Night 1, attempt 1: one cell job dies (an infrastructure fault), so the run is partial: the report fails on the
regression policy, nothing is filed, nothing goes into the history. "Re-run failed jobs" re-runs that cell, the
report and every job after it: the report must upload, the policy must run, the issues must be filed from the
re-run's report and the history must get the re-run's results. "Re-run all jobs" then re-runs the plan too: it
must not stop at the plan's upload, must file nothing twice, and the history keeps one run for the night.

A pull request from a fork on a matrix whose cells all run on self-hosted runners runs nothing: the check must
fail as "not tested", not pass, and the bisect job (vendor builds and repros) must not run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ci_runner.results.model import save_cell_result
from tests.fixtures.fake_github import FakeGitHub
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT
from tests.fixtures.results_factory import cell, ops_mode
from tests.fixtures.workflow_sim import JobRun, Sim, interpolate, load_workflow

pytestmark = pytest.mark.subprocess  # git and bash, as the runner would run them

WORKFLOW = ROOT / ".github" / "workflows" / "deepview.yml"
CELLS = ROOT / ".github" / "workflows" / "deepview-cells.yml"
MATRIX = matrix_text(modes=["ops"], models=[{"id": "tiny", "config": "llama"}],
                     backends=[{"id": "acme", "compile": "sim-subset"}, {"id": "beta", "compile": "sim-subset"}])
BASELINE = {"schema_version": 1, "kind": "deepview-ci-baseline", "findings": [],
            "cells": [{"id": f"tiny@{b}", "model": "tiny", "backend": b, "status": "pass", "modes": {"ops": "pass"}}
                      for b in ("acme", "beta")]}


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, timeout=60,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@e", "PATH": "/usr/bin:/bin", "HOME": str(cwd)}).stdout


def caller_repo(tmp: Path) -> Path:
    """A bare repository holding the caller's matrix and baseline on main."""
    src, bare = tmp / "src", tmp / "origin.git"
    src.mkdir()
    (src / "matrix.yaml").write_text(MATRIX)
    (src / "baseline.json").write_text(json.dumps(BASELINE))
    git("init", "--quiet", "-b", "main", cwd=src)
    git("add", ".", cwd=src)
    git("commit", "--quiet", "-m", "caller", cwd=src)
    git("clone", "--quiet", "--bare", str(src), str(bare), cwd=tmp)
    return bare


def cell_upload_name() -> str:
    [job] = load_workflow(CELLS)["jobs"].values()
    return next(s for s in job["steps"] if s.get("name") == "Upload the cell's results and repros")["with"]["name"]


def play_cells(dying: dict[int, set[str]]):
    """The `cells` job (a call of deepview-cells.yml): each planned cell's job uploads its result under the name
    the cell workflow gives it, unless it dies in this attempt (`dying[attempt]`)."""
    template = cell_upload_name()

    def call(sim: Sim, name: str, ctx: dict[str, Any]) -> JobRun:
        plan = ctx["needs"]["plan"]["outputs"]
        died = False
        for chunk in json.loads(plan["chunk-ids"]):
            for entry in json.loads(plan[f"matrix-{chunk}"])["include"]:
                if entry["cell"] in dying.get(sim.attempt, set()):
                    died = True
                    continue
                model, backend = entry["cell"].split("@")
                result = cell(model, backend, {"ops": ops_mode(backend, () if backend == "beta" else
                                                               ("aten.cumsum.default",))})
                path = sim.work / f"cell-{sim.attempt}-{entry['cell']}.json"
                save_cell_result(result, path)
                artifact = interpolate(template, {**ctx, "matrix": entry})
                err = sim.upload(artifact, {f"cells/{entry['cell']}/result.json": path.read_bytes()})
                assert err is None, err
        return JobRun("failure" if died else "success", attempt=sim.attempt)

    return call


def history_runs(origin: Path, tmp: Path) -> dict[str, dict[str, str]]:
    """The runs on the history branch (run files and the database's): run id → cell → status."""
    from ci_runner.history.store import load_history

    where = tmp / f"hist-{len(list(tmp.glob('hist-*')))}"
    git("clone", "--quiet", "--branch", "deepview-history", str(origin), str(where), cwd=tmp)
    h = load_history(where)
    try:
        return {r.run_id: {c: cr.status for c, cr in h.cell_runs.get(r.seq, {}).items()} for r in h.runs}
    finally:
        h.close()


@pytest.fixture()
def sim(tmp_path: Path):
    with FakeGitHub() as gh:
        work = tmp_path / "runs"
        work.mkdir()
        yield Sim(WORKFLOW, {"matrix": "matrix.yaml", "baseline": "baseline.json", "fail-on": "regression",
                             "file-issues": True, "issue-args": "", "select": "", "python-version": "3.11",
                             "pip-args": "", "bisect": False, "runner": "ubuntu-latest", "history": "deepview-history",
                             "history-write": True, "setup-minutes": 30, "allow-fork-self-hosted": False,
                             "deepview-repository": "deepview-ci/deepview-ci", "deepview-ref": "main",
                             "bisect-runner": '"ubuntu-latest"', "bisect-minutes": 120},
                  gh, caller_repo(tmp_path), work, calls={"cells": play_cells({1: {"tiny@beta"}})})


def report_of(sim: Sim) -> dict[str, Any]:
    """The results.json of the newest report artifact the run holds."""
    arts = [a for a in sim.listed() if a["name"].startswith("deepview-report")]
    newest = max(arts, key=lambda a: a["id"])
    into = sim.work / f"report-{newest['id']}"
    sim.download(newest, into)
    return json.loads((into / "results.json").read_text())


def test_rerun_failed_jobs_reports_files_and_records_the_rerun(sim: Sim, tmp_path: Path) -> None:
    first = sim.run()
    assert first["plan"].result == "success" and first["cells"].result == "failure"
    assert first["report"].result == "failure"  # the regression policy on a partial run
    assert first["report"].outputs["file-issues"] == "false" and first["report"].outputs["no-result"] == "1"
    assert first["issues"].result == "skipped" and first["history"].result == "skipped"
    assert sim.gh.issues() == []

    second = sim.run("failed")
    report = second["report"]
    assert second["cells"].result == "success" and second["plan"].attempt == 1  # the plan was not re-run
    assert report.steps["Upload the report"]["outcome"] == "success", report.log
    assert report.steps["Apply the diff policy; decide whether issues may be filed"]["outcome"] == "failure"  # ran: exit 1
    assert report.outputs["file-issues"] == "true" and report.outputs["no-result"] == "0"
    cells = {c["id"]: c["status"] for c in report_of(sim)["cells"]}
    assert cells == {"tiny@acme": "fail", "tiny@beta": "pass"}  # the re-run's report, not attempt 1's
    assert second["issues"].result == "success", second["issues"].log
    titles = [i["title"] for i in sim.gh.issues()]
    assert len(titles) == 1 and "aten.cumsum.default" in titles[0] and "acme" in titles[0]
    assert second["history"].result == "success", second["history"].log
    # the re-run's results (attempt 1's report had tiny@beta as "no result")
    assert history_runs(sim.origin, tmp_path) == {"4242-2": {"tiny@acme": "fail", "tiny@beta": "pass"}}

    third = sim.run("all")
    assert third["plan"].result == "success", third["plan"].log
    assert third["plan"].attempt == 3 and third["report"].steps["Upload the report"]["outcome"] == "success"
    assert third["issues"].result == "success" and len(sim.gh.issues()) == 1  # nothing filed twice
    assert list(history_runs(sim.origin, tmp_path)) == ["4242-3"]  # one night, one run: the re-run replaced its attempt
    names = [a["name"] for a in sim.listed()]
    assert len(names) == len(set(names))


def test_the_fake_server_refuses_a_second_artifact_of_one_name(sim: Sim) -> None:
    sim.attempt = 1
    assert sim.upload("deepview-plan", {"plan.json": b"{}"}) is None
    err = sim.upload("deepview-plan", {"plan.json": b"{}"})
    assert err is not None and "(409)" in err
    sim.attempt = 2
    assert sim.upload("deepview-plan", {"plan.json": b"[]"}, overwrite=True) is None
    [art] = [a for a in sim.listed() if a["name"] == "deepview-plan"]
    assert art["workflow_run"]["run_attempt"] == 2


def test_every_artifact_of_the_pipeline_is_safe_under_a_rerun() -> None:
    """Each upload either carries the attempt in its name or replaces the earlier one (`overwrite: true`)."""
    for path in (WORKFLOW, CELLS):
        for name, job in load_workflow(path)["jobs"].items():
            for step in job.get("steps") or []:
                if str(step.get("uses", "")).startswith("actions/upload-artifact@"):
                    w = step["with"]
                    assert "github.run_attempt" in str(w["name"]) or w.get("overwrite") is True, (path.name, name, w["name"])


def test_a_fork_pull_request_that_ran_nothing_is_not_a_pass(sim: Sim, tmp_path: Path) -> None:
    """Before: 0 cells ran, the diff said "passes" and the check was green; the bisect job had no fork guard."""
    sim.event = "pull_request"
    sim.event_payload = {"pull_request": {"head": {"repo": {"full_name": "mallory/models"}}}}
    sim.inputs.update({"bisect": True, "file-issues": False, "history-write": False})
    text = MATRIX.replace("compile: sim-subset", "compile: sim-subset\n  runs-on: [self-hosted, acme-card]")
    work = tmp_path / "pr"
    git("clone", "--quiet", str(sim.origin), str(work), cwd=tmp_path)
    (work / "matrix.yaml").write_text(text)
    git("commit", "--quiet", "-am", "self-hosted only", cwd=work)
    git("push", "--quiet", "origin", "HEAD:main", cwd=work)
    jobs = sim.run()
    assert jobs["plan"].outputs["count"] == "0" and jobs["plan"].outputs["skipped"] == "2"
    assert jobs["plan"].outputs["fork-pr"] == "true" and jobs["cells"].result == "skipped"
    report = jobs["report"]
    assert report.steps["Diff against the baseline"]["outputs"]["exit-code"] == "0"  # the diff alone passes
    assert report.result == "failure" and report.outputs["diff-outcome"] == "not-tested"
    assert "not tested: self-hosted cells skipped for a fork" in "\n".join(report.log)
    assert jobs["bisect"].result == "skipped" and jobs["issues"].result == "skipped"
    # the same pull request from a branch of the repository itself is planned to run its cells
    sim2 = Sim(sim.workflow, sim.inputs, sim.gh, sim.origin, tmp_path / "same", run_id=4343, event="pull_request",
               event_payload={"pull_request": {"head": {"repo": {"full_name": "acme/models"}}}},
               calls={"cells": play_cells({})})
    (tmp_path / "same").mkdir()
    same = sim2.run()
    assert same["plan"].outputs["count"] == "2" and same["plan"].outputs["fork-pr"] == "false"


def test_a_pull_request_gets_one_comment_updated_by_every_run_and_a_fork_gets_a_summary_line(sim: Sim, tmp_path: Path) -> None:
    """Issue 48: `pr-comment: true` on a pull request. The run's regression (tiny@acme) fails the policy and is the
    comment's news; "re-run all jobs" edits the same comment; a fork's pull request posts nothing and says so."""
    pr = sim.gh.add_issue("acme/models", title="lower cumsum", pull_request=True)
    sim.event = "pull_request"
    sim.event_payload = {"number": pr["number"], "pull_request": {
        "number": pr["number"], "head": {"sha": "c0ffee" * 6, "repo": {"full_name": "acme/models"}},
        "base": {"repo": {"full_name": "acme/models"}}}}
    sim.inputs.update({"file-issues": False, "history": "", "history-write": False, "pr-comment": True,
                       "pr-comment-args": ""})
    sim.calls = {"cells": play_cells({})}
    jobs = sim.run()
    assert jobs["report"].outputs["diff-outcome"] == "failure"  # the regression fails the check
    assert jobs["pr-comment"].result == "success", jobs["pr-comment"].log
    [comment] = sim.gh.comments("acme/models", pr["number"])
    assert comment["body"].startswith("<!-- deepview-ci:pr-comment -->") and "`tiny@acme`" in comment["body"]
    assert "Regressed (1)" in comment["body"] and "| 2 | 1 | 1 |" in comment["body"]
    assert jobs["pr-comment"].steps["Create or update the pull request's deepview-ci comment"]["outputs"]["pr-comment"] == "created"
    again = sim.run(rerun="all")
    assert again["pr-comment"].result == "success"
    assert [c["id"] for c in sim.gh.comments("acme/models", pr["number"])] == [comment["id"]]  # no second comment
    # the same pull request from a fork: the job runs, posts nothing, and its step summary says why
    fork = Sim(sim.workflow, sim.inputs, sim.gh, sim.origin, tmp_path / "fork", run_id=4343, event="pull_request",
               event_payload={**sim.event_payload, "pull_request": {
                   **sim.event_payload["pull_request"], "head": {"sha": "f" * 40, "repo": {"full_name": "mallory/models"}}}},
               calls={"cells": play_cells({})})
    (tmp_path / "fork").mkdir()
    writes = len(sim.gh.writes())
    jobs = fork.run()
    assert jobs["pr-comment"].result == "success"
    assert [w for w in sim.gh.writes()[writes:] if "/comments" in w.path] == []
    summary = (tmp_path / "fork" / "attempt-1" / "pr-comment" / ".step_summary").read_text()
    assert "did not comment on this pull request" in summary and "mallory/models" in summary
    # not a pull request (a nightly): the job does not run
    sim3 = Sim(sim.workflow, sim.inputs, sim.gh, sim.origin, tmp_path / "night", run_id=4444, calls={"cells": play_cells({})})
    (tmp_path / "night").mkdir()
    assert sim3.run()["pr-comment"].result == "skipped"


def test_a_broken_history_branch_stops_nothing_and_the_push_repairs_it(sim: Sim, tmp_path: Path) -> None:
    """A garbage history.sqlite on the branch. Before: `aggregate --history` exited 3, so the diff, the policy, the
    issues and the history job never ran, every night, and nothing repaired the branch."""
    work = tmp_path / "broken"
    git("init", "--quiet", "-b", "deepview-history", str(work), cwd=tmp_path)
    (work / "history.sqlite").write_bytes(b"not a database " * 300)
    git("add", ".", cwd=work)
    git("commit", "--quiet", "-m", "broken", cwd=work)
    git("push", "--quiet", str(sim.origin), "HEAD:deepview-history", cwd=work)
    sim.calls = {"cells": play_cells({})}
    jobs = sim.run()
    report = jobs["report"]
    assert report.steps["Aggregate (JUnit, summary, HTML), every planned cell accounted for"]["outcome"] == "success"
    assert report.outputs["diff-outcome"] == "failure" and report.outputs["file-issues"] == "true"  # the regression
    assert jobs["issues"].result == "success" and len(sim.gh.issues()) == 1
    assert jobs["history"].result == "success", jobs["history"].log
    assert history_runs(sim.origin, tmp_path) == {"4242-1": {"tiny@acme": "fail", "tiny@beta": "pass"}}
