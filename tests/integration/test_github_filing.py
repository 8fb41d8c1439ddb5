"""`file_issues` against the local fake GitHub: dedupe over reruns, recurrence, reopen, close on fix,
rate limits, truncation, drafts when the API fails, and no token anywhere in the output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ci_runner.github.issues import file_issues
from ci_runner.github.options import FilingOptions
from ci_runner.github.render import group_fingerprint
from ci_runner.results.model import CellResult, ModeResult, Results, save_results
from tests.fixtures.fake_github import SECONDARY_MESSAGE, FakeGitHub, entry, op_finding, write_diff
from tests.fixtures.paths import ROOT

GH_REPO = "acme/models"
SOFTPLUS = ("op", "sim-subset", "aten.softplus.default")


def run(gh: FakeGitHub, diff: Path, *, run_id: str | None = "100", token: str | None = None, run_dir: Path | None = None,
        **opts):
    env = {"GITHUB_TOKEN": token or gh.token, "GITHUB_API_URL": gh.url}
    if run_id:
        env.update(GITHUB_RUN_ID=run_id, GITHUB_SERVER_URL="https://github.com", GITHUB_REPOSITORY=GH_REPO)
    options = FilingOptions(**{"min_interval": 0.0, "backoff": 0.0, "max_wait": 5.0, **opts})
    return file_issues(diff, repo=GH_REPO, dry_run=None, run_dir=run_dir, artifacts_url=None, options=options, env=env)


def softplus_diff(tmp_path: Path, category: str = "regressed", models=("tiny-bamba", "tiny-llama"), name="diff.json") -> Path:
    f = op_finding("aten.softplus.default", "sim-subset")
    return write_diff(tmp_path / name, [entry(category, m, "sim-subset", f) for m in models])


def comments(issue: dict) -> list[str]:
    return [c["body"] for c in issue["comments_list"]]


# --------------------------------------------------------------------------- dedupe, recurrence, reopen, close


def test_filing_twice_files_nothing_new(gh, tmp_path):
    f1 = op_finding("aten.softplus.default", "sim-subset")
    f2 = op_finding("aten.erf.default", "sim-subset", kind="op_mismatch")
    f3 = op_finding("aten.softplus.default", "inductor", kind="op_error")
    d = write_diff(tmp_path / "diff.json", [entry("regressed", "tiny-bamba", "sim-subset", f1),
                                            entry("regressed", "tiny-llama", "sim-subset", f1),
                                            entry("regressed", "tiny-vit", "sim-subset", f2),
                                            entry("regressed", "tiny-bamba", "inductor", f3)])
    first = run(gh, d)
    assert (first.created, first.drafts, first.exit_code) == (3, 0, 0)
    issues = gh.issues()
    assert sorted(i["title"] for i in issues) == [
        "[deepview-ci] aten.erf.default fails on sim-subset",
        "[deepview-ci] aten.softplus.default fails on inductor",
        "[deepview-ci] aten.softplus.default fails on sim-subset",
    ]
    assert all([lab["name"] for lab in i["labels"]] == ["deepview-ci"] for i in issues)
    writes = len(gh.writes())
    for _ in range(2):  # a rerun of the same run, then the same diff again
        again = run(gh, d)
        assert (again.created, again.commented, again.unchanged) == (0, 0, 3)
    assert len(gh.writes()) == writes and len(gh.issues()) == 3
    assert all(i["comments"] == 0 for i in gh.issues())


def test_recurrence_comments_once_per_run(gh, tmp_path):
    d = softplus_diff(tmp_path)
    run(gh, d, run_id="100")
    r = run(gh, d, run_id="101")
    assert (r.created, r.commented) == (0, 1)
    [issue] = gh.issues()
    [c] = comments(issue)
    assert c.startswith("<!-- deepview-ci:event=recurrence run=gh-101 -->") and "Seen again" in c
    assert "`tiny-bamba`" in c
    r = run(gh, d, run_id="101")  # the rerun of run 101 does not repeat it
    assert r.commented == 0 and len(comments(gh.issues()[0])) == 1


def test_local_reruns_key_on_the_diff_content(gh, tmp_path):
    d = softplus_diff(tmp_path)
    assert run(gh, d, run_id=None).created == 1
    assert run(gh, d, run_id=None).commented == 0
    d2 = softplus_diff(tmp_path, models=("tiny-bamba", "tiny-mixtral"), name="diff2.json")
    assert run(gh, d2, run_id=None).commented == 1


def test_closed_issue_is_reopened(gh, tmp_path):
    d = softplus_diff(tmp_path)
    run(gh, d, run_id="100")
    gh.issues()[0]["state"] = "closed"
    r = run(gh, d, run_id="101")
    assert (r.created, r.reopened) == (0, 1)
    [issue] = gh.issues()
    assert issue["state"] == "open" and issue["state_reason"] == "reopened"
    assert "Reopened" in comments(issue)[0]
    assert run(gh, d, run_id="101").reopened == 0 and len(gh.issues()[0]["comments_list"]) == 1


def test_issue_closed_as_not_planned_stays_closed(gh, tmp_path):
    d = softplus_diff(tmp_path)
    run(gh, d, run_id="100")
    issue = gh.issues()[0]
    issue["state"], issue["state_reason"] = "closed", "not_planned"
    r = run(gh, d, run_id="101")
    assert (r.reopened, r.skipped) == (0, 1) and issue["state"] == "closed" and issue["comments"] == 0


def test_fixed_finding_closes_its_issue(gh, tmp_path):
    run(gh, softplus_diff(tmp_path), run_id="100")
    fixed = softplus_diff(tmp_path, category="fixed", name="fixed.json")
    r = run(gh, fixed, run_id="102")
    assert r.closed == 1
    [issue] = gh.issues()
    assert issue["state"] == "closed" and issue["state_reason"] == "completed"
    assert "Fixed" in comments(issue)[0] and "Closing" in comments(issue)[0]
    writes = len(gh.writes())
    assert run(gh, fixed, run_id="102").closed == 0
    assert len(gh.writes()) == writes


def test_fixed_without_close_comments_once(gh, tmp_path):
    run(gh, softplus_diff(tmp_path), run_id="100")
    fixed = softplus_diff(tmp_path, category="fixed", name="fixed.json")
    r = run(gh, fixed, run_id="102", close_fixed=False)
    assert (r.closed, r.commented) == (0, 1)
    r = run(gh, fixed, run_id="103", close_fixed=False)
    assert r.commented == 0
    [issue] = gh.issues()
    assert issue["state"] == "open" and len(issue["comments_list"]) == 1


def _results_with(tmp_path: Path, cells: dict[str, str]) -> Path:
    """results.json where each cell ran the ops mode with the given status and no findings."""
    res = Results(cells=[CellResult(id=cid, model=cid.split("@")[0], backend=cid.split("@")[1], status=st,
                                    modes={"ops": ModeResult(status=st)}) for cid, st in cells.items()])
    return save_results(res, tmp_path / "results.json")


def test_finding_gone_from_results_closes_even_without_a_baseline_entry(gh, tmp_path):
    run(gh, softplus_diff(tmp_path), run_id="100")
    # the next night: both cells ran ops and passed; the baseline never had the finding, so no `fixed` entry
    _results_with(tmp_path, {"tiny-bamba@sim-subset": "pass", "tiny-llama@sim-subset": "pass"})
    empty = write_diff(tmp_path / "night2.json", [], results="results.json")
    r = run(gh, empty, run_id="103")
    assert r.closed == 1 and gh.issues()[0]["state"] == "closed"


def test_issue_stays_open_when_its_cells_did_not_run(gh, tmp_path):
    run(gh, softplus_diff(tmp_path), run_id="100")
    _results_with(tmp_path, {"tiny-bamba@sim-subset": "pass"})  # tiny-llama not in this (partial) run
    r = run(gh, write_diff(tmp_path / "partial.json", [], results="results.json"), run_id="103")
    assert r.closed == 0 and gh.issues()[0]["state"] == "open"


def test_opt_out_label_is_respected(gh, tmp_path):
    d = softplus_diff(tmp_path)
    run(gh, d, run_id="100")
    issue = gh.issues()[0]
    issue["labels"].append(gh.add_label(GH_REPO, "deepview-ci:ignore"))
    issue["state"] = "closed"
    writes = len(gh.writes())
    r = run(gh, d, run_id="101")
    assert (r.skipped, r.reopened, r.commented) == (1, 0, 0)
    r = run(gh, softplus_diff(tmp_path, category="fixed", name="f.json"), run_id="102")
    assert r.skipped == 0 and r.closed == 0  # closed already: nothing to do
    assert len(gh.writes()) == writes


def test_dedupe_pages_through_every_labelled_issue_and_skips_prs(gh, tmp_path):
    fp = group_fingerprint(SOFTPLUS)
    gh.add_issue(GH_REPO, title="old", body=f"<!-- deepview-ci:fingerprint={fp} -->\nfiled long ago", labels=("deepview-ci",))
    gh.add_issue(GH_REPO, title="a PR quoting it", body=f"<!-- deepview-ci:fingerprint={fp} -->", labels=("deepview-ci",),
                 pull_request=True)
    gh.add_issue(GH_REPO, title="prefix only", body=f"<!-- deepview-ci:fingerprint={fp}00 -->", labels=("deepview-ci",))
    for i in range(230):  # newest first: the real one ends up on the last page
        gh.add_issue(GH_REPO, title=f"other {i}", body=f"<!-- deepview-ci:fingerprint={i:020x} -->", labels=("deepview-ci",))
    r = run(gh, softplus_diff(tmp_path), run_id="200")
    assert (r.created, r.commented) == (0, 1)
    assert gh.issues()[0]["comments"] == 1
    pages = [q.query.get("page", ["1"])[0] for q in gh.requests if q.method == "GET" and q.path.endswith("/issues")]
    assert pages == ["1", "2", "3"]
    listing = next(q for q in gh.requests if q.path.endswith("/issues"))
    assert listing.query["state"] == ["all"] and listing.query["labels"] == ["deepview-ci"]


def test_findings_of_a_new_cell_are_filed_and_known_ones_are_not(gh, tmp_path):
    f = op_finding("aten.softplus.default", "sim-subset")
    known = op_finding("aten.erf.default", "sim-subset")
    d = write_diff(tmp_path / "d.json", [entry("new_cell", "tiny-new", "sim-subset", f, baseline_status=None),
                                         entry("persisting", "tiny-llama", "sim-subset", known),
                                         entry("flaky", "tiny-vit", "sim-subset", op_finding("aten.cos.default", "sim-subset"))])
    r = run(gh, d)
    assert r.created == 1 and [i["title"] for i in gh.issues()] == ["[deepview-ci] aten.softplus.default fails on sim-subset"]


def test_layers_are_filed_only_when_asked(gh, tmp_path):
    from ci_runner.results.model import fingerprint

    lf = {"kind": "layer_failure", "stage": "compile", "message": "boom", "fingerprint": fingerprint("layer_failure", "sim-crash", "m.attn"),
          "op": None, "module": "model.layers.0.self_attn", "module_class": "LlamaAttention", "repro": None, "details": {}}
    d = write_diff(tmp_path / "d.json", [entry("regressed", "tiny-llama", "sim-crash", lf)])
    r = run(gh, d)
    assert r.created == 0 and any("--layers" in n for n in r.notes)
    assert run(gh, d, layers=True).created == 1
    assert gh.issues()[0]["title"] == "[deepview-ci] model.layers.0.self_attn of tiny-llama fails on sim-crash"


# --------------------------------------------------------------------------- limits and failures


def test_secondary_rate_limit_wait_is_honoured(gh, tmp_path):
    gh.fail("POST", r"/issues$", status=403, headers={"retry-after": "1", "x-ratelimit-remaining": "4990"},
            body={"message": SECONDARY_MESSAGE})
    start = time.monotonic()
    r = run(gh, softplus_diff(tmp_path))
    assert r.created == 1 and r.exit_code == 0 and len(gh.issues()) == 1
    posts = [q for q in gh.writes() if q.path.endswith("/issues")]
    assert [q.status for q in posts] == [403, 201] and posts[1].at - posts[0].at >= 1.0
    assert time.monotonic() - start >= 1.0


def test_primary_rate_limit_reset_is_honoured(gh, tmp_path):
    reset = int(time.time()) + 1
    gh.fail("POST", r"/issues$", status=403, body={"message": "API rate limit exceeded for installation"},
            headers={"x-ratelimit-remaining": "0", "x-ratelimit-reset": str(reset)})
    r = run(gh, softplus_diff(tmp_path))
    assert r.created == 1 and time.time() >= reset


def test_rate_limit_past_max_wait_keeps_drafts_and_exits_6(gh, tmp_path):
    f2 = op_finding("aten.erf.default", "sim-subset")
    d = write_diff(tmp_path / "diff.json", [entry("regressed", "m", "sim-subset", op_finding("aten.softplus.default", "sim-subset")),
                                            entry("regressed", "m", "sim-subset", f2)])
    gh.fail("POST", r"/issues$", status=429, headers={"retry-after": "3600"}, body={"message": SECONDARY_MESSAGE})
    start = time.monotonic()
    r = run(gh, d, max_wait=2)
    assert time.monotonic() - start < 2
    assert (r.created, r.drafts, r.exit_code) == (0, 2, 6)
    assert "3600" in r.stopped and "rate limited" in r.stopped
    index = json.loads((tmp_path / "issue-drafts" / "drafts.json").read_text())
    assert [x["action"] for x in index["drafts"]] == ["create", "create"]
    assert len([q for q in gh.writes() if q.path.endswith("/issues")]) == 1  # stopped: no hammering
    assert "fingerprint=" in (tmp_path / "issue-drafts" / index["drafts"][0]["file"]).read_text()


def test_server_failure_keeps_drafts(gh, tmp_path):
    gh.fail("GET", r"/issues$", status=502, times=99)
    r = run(gh, softplus_diff(tmp_path), max_retries=2)
    assert (r.created, r.drafts, r.exit_code) == (0, 1, 6)
    assert "502" in r.stopped
    drafts = json.loads((tmp_path / "issue-drafts" / "drafts.json").read_text())["drafts"]
    assert drafts[0]["action"] == "file" and "could not list" in drafts[0]["reason"]


def test_5xx_after_create_does_not_duplicate(gh, tmp_path):
    gh.fail("POST", r"/issues$", status=502, after=True)  # GitHub created it, then answered 502
    r = run(gh, softplus_diff(tmp_path))
    assert r.created == 1 and r.exit_code == 0
    assert len(gh.issues()) == 1


def test_fork_read_only_token_stops_with_drafts(gh, tmp_path):
    gh.readonly_tokens.add("ghs_forkReadOnly_0123456789")
    f2 = op_finding("aten.erf.default", "sim-subset")
    d = write_diff(tmp_path / "diff.json", [entry("regressed", "m", "sim-subset", op_finding("aten.softplus.default", "sim-subset")),
                                            entry("regressed", "m", "sim-subset", f2)])
    r = run(gh, d, token="ghs_forkReadOnly_0123456789")
    assert r.exit_code == 6 and r.drafts == 2 and r.created == 0
    assert "Resource not accessible by integration" in r.stopped and "fork" in r.stopped
    assert len(gh.writes()) == 1  # the first write failed; nothing else was tried


def test_oversized_body_422_keeps_a_draft_and_goes_on(tmp_path):
    with FakeGitHub(body_limit=3000) as small:  # a server stricter than GitHub: the body is refused
        f2 = op_finding("aten.erf.default", "sim-subset", message="short")
        big = op_finding("aten.softplus.default", "sim-subset", message="x" * 3500)
        d = write_diff(tmp_path / "diff.json", [entry("regressed", "m", "sim-subset", big),
                                                entry("regressed", "m", "sim-subset", f2)])
        r = run(small, d)
        assert r.exit_code == 6 and r.drafts == 1 and r.stopped is None
        # the draft is the refused issue; the other one was still filed
        assert r.created == 1 and small.issues()[0]["title"].startswith("[deepview-ci] aten.erf.default")


def test_oversized_repro_is_truncated_and_accepted(gh, tmp_path):
    run_dir = tmp_path / "run"
    cell = run_dir / "cells" / "tiny-bamba@sim-subset" / "repro"
    cell.mkdir(parents=True)
    (cell / "op.py").write_text("import torch\n" + "t = torch.ones(3)  # " + "pad " * 60 + "\n" * 1 + ("y = 1\n" * 40000))
    f = op_finding("aten.softplus.default", "sim-subset", repro="repro/op.py")
    d = write_diff(tmp_path / "diff.json", [entry("regressed", "tiny-bamba", "sim-subset", f)], run_dir=str(run_dir))
    r = run(gh, d)
    assert r.created == 1
    body = gh.issues()[0]["body"]
    assert 60000 < len(body) <= 65536
    assert "Truncated to fit GitHub's issue size limit" in body
    assert "https://github.com/acme/models/actions/runs/100" in body


def test_writes_are_serial_and_spaced(tmp_path):
    with FakeGitHub(write_interval=0.2) as strict:  # closer writes get a secondary rate limit
        entries = [entry("regressed", "m", "sim-subset", op_finding(f"aten.op{i}.default", "sim-subset")) for i in range(3)]
        r = run(strict, write_diff(tmp_path / "d.json", entries), min_interval=0.2)
        assert r.created == 3
        w = strict.writes()
        assert all(q.status in (200, 201) for q in w)
        assert all(b.at - a.at >= 0.2 for a, b in zip(w, w[1:]))


def test_ghes_api_url_is_honoured(tmp_path):
    with FakeGitHub(prefix="/api/v3") as ghes:
        r = run(ghes, softplus_diff(tmp_path))
        assert r.created == 1 and ghes.requests[0].path == "/repos/acme/models/issues"


# --------------------------------------------------------------------------- the CLI: outputs and secrecy


def test_cli_outputs_and_no_token_anywhere(gh, tmp_path):
    """Run the real CLI, fail half-way, and look for the token in every byte it produced."""
    token = gh.token
    gh.fail("POST", r"/issues/\d+/comments$", status=403, body={"message": f"echo {token}"},
            headers={"x-ratelimit-remaining": "4000"})
    d = softplus_diff(tmp_path)
    run(gh, d, run_id="100")
    f2 = op_finding("aten.erf.default", "sim-subset", message=f"leaked {token}? @octocat")
    d2 = write_diff(tmp_path / "d2.json", [entry("regressed", "tiny-bamba", "sim-subset", op_finding("aten.softplus.default", "sim-subset")),
                                           entry("regressed", "tiny-bamba", "sim-subset", f2)])
    out, summary = tmp_path / "gh_output", tmp_path / "gh_summary"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GITHUB_TOKEN": token, "GITHUB_API_URL": gh.url,
           "GITHUB_OUTPUT": str(out), "GITHUB_STEP_SUMMARY": str(summary), "GITHUB_RUN_ID": "101",
           "GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": GH_REPO, "GITHUB_ACTIONS": "true"}
    proc = subprocess.run([sys.executable, "-m", "ci_runner", "file-issues", str(d2), "--repo", GH_REPO, "--min-interval", "0",
                           "--max-wait", "5"], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 6, proc.stderr
    assert "stopped" in proc.stdout and "draft" in proc.stdout
    outputs = out.read_text()
    assert "created<<" in outputs and "drafts<<" in outputs
    assert "### deepview-ci issues" in summary.read_text()
    produced = [proc.stdout, proc.stderr, outputs, summary.read_text()]
    produced += [p.read_text() for p in (tmp_path / "issue-drafts").iterdir()]
    produced += [i["body"] for i in gh.issues()] + [c for i in gh.issues() for c in comments(i)]
    assert all(token not in text for text in produced)
    assert len(gh.issues()) == 2  # the new op was filed; the comment on the old one is a draft


# --------------------------------------------------------------------------- issue 34: concurrency, caps, budget


def _many(tmp_path: Path, n: int) -> Path:
    return write_diff(tmp_path / "many.json", [entry("regressed", "tiny-llama", "sim-subset",
                                                     op_finding(f"aten.op{i:02d}.default", "sim-subset"))
                                               for i in range(n)])


def test_two_filers_at_once_leave_one_open_issue_per_finding(gh, tmp_path):
    """Both list the (empty) tracker before either creates. Before: each created all 30, 60 issues."""
    import threading

    d = _many(tmp_path, 30)
    gh.slow("GET", r"/issues$", 0.5, times=2)  # the first listing of each filer
    reports = [None, None]

    def go(k: int) -> None:
        reports[k] = run(gh, d, run_id=str(500 + k))

    threads = [threading.Thread(target=go, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and r.exit_code == 0 for r in reports)
    open_by_title: dict[str, int] = {}
    for i in gh.issues():
        if i["state"] == "open":
            open_by_title[i["title"]] = open_by_title.get(i["title"], 0) + 1
    assert len(open_by_title) == 30 and set(open_by_title.values()) == {1}
    for i in gh.issues():
        if i["state"] == "closed":  # a duplicate made at the very same moment says which issue to follow
            assert i["state_reason"] == "not_planned" and comments(i)[0].startswith("Duplicate of #")
    assert sum(r.created for r in reports) == 30


def test_a_run_creates_at_most_the_cap_and_drafts_the_rest(gh, tmp_path):
    d = _many(tmp_path, 12)
    report = run(gh, d, max_new=5)
    assert report.created == 5 and len(gh.issues()) == 5 and report.drafts == 7
    assert any("7 new issue(s) over the cap of 5" in n for n in report.notes)
    assert "over the cap of 5" in report.markdown()
    drafts = json.loads((tmp_path / "issue-drafts" / "drafts.json").read_text())["drafts"]
    assert len(drafts) == 7 and all("--max-new-issues" in x["reason"] for x in drafts)
    again = run(gh, d, run_id="101", max_new=5)  # the next night files the next five
    assert again.created == 5 and len(gh.issues()) == 10


def test_the_write_budget_stops_writes_and_drafts_the_rest(gh, tmp_path):
    d = _many(tmp_path, 6)
    report = run(gh, d, write_budget=4)
    assert report.created == 4 and report.drafts == 2
    assert any("over the hour's budget of 4 content-creating requests" in n for n in report.notes)
    posts = [r for r in gh.writes() if r.method == "POST" and r.path.endswith("/issues")]
    assert len(posts) == 4
    # an hour later nothing from this run counts; within the hour its issues do: a second run files only 1 more
    more = write_diff(tmp_path / "more.json", [entry("regressed", "tiny-llama", "sim-subset",
                                                     op_finding(f"aten.more{i}.default", "sim-subset")) for i in range(3)])
    second = run(gh, more, run_id="777", write_budget=5)
    assert second.created == 1 and second.drafts == 2
    assert any("4 issue(s) filed in the hour before this run" in n for n in second.notes)


def test_the_truncation_note_names_the_real_artifact_and_its_retention(gh, tmp_path):
    """The cell came from its re-run (attempt 2, as `collect` kept it). Before: the note named
    `deepview-cell-…` without the attempt, an artifact that does not exist, and said nothing of when it expires."""
    from ci_runner.matrix import artifact_name
    from ci_runner.plan import collect_attempts

    arts = tmp_path / "artifacts"
    for attempt in (1, 2):
        repro = arts / f"{artifact_name('tiny-bamba@sim-subset')}-attempt-{attempt}" / "cells" / "tiny-bamba@sim-subset" / "repro"
        repro.mkdir(parents=True)
        (repro / "op.py").write_text("import torch\n" + ("y = 1\n" * 40000))
    run_dir = tmp_path / "run"
    assert collect_attempts(arts, run_dir) == {"tiny-bamba@sim-subset": 2}
    f = op_finding("aten.softplus.default", "sim-subset", repro="repro/op.py")
    d = write_diff(tmp_path / "diff.json", [entry("regressed", "tiny-bamba", "sim-subset", f)], run_dir=str(run_dir))
    assert run(gh, d, artifact_days=30).created == 1
    body = gh.issues()[0]["body"]
    assert "Truncated to fit GitHub's issue size limit" in body
    assert "in the artifact `deepview-cell-tiny-bamba_40sim-subset-attempt-2` of [the run]" in body
    assert "(artifacts are kept 30 days, until about 20" in body and len(body) <= 65536


def test_a_cut_repro_is_attached_whole_as_the_first_comment(gh, tmp_path):
    """Issue 34: a repro cut in the body lived on only in the run's artifact, which expires; now the whole script is
    the issue's first comment whenever it fits one (65 536 characters)."""
    run_dir = tmp_path / "run"
    cell = run_dir / "cells" / "tiny-bamba@sim-subset" / "repro"
    cell.mkdir(parents=True)
    script = "import torch\n" + "".join(f"x{i} = torch.ones({i % 7 + 1})\n" for i in range(2970))
    assert 64000 < len(script) < 65200  # fits a comment, not the issue beside the rest
    (cell / "op.py").write_text(script)
    f = op_finding("aten.softplus.default", "sim-subset", repro="repro/op.py", message="boom " * 400)
    d = write_diff(tmp_path / "diff.json", [entry("regressed", m, "sim-subset", f) for m in ("tiny-bamba", "tiny-llama")],
                   run_dir=str(run_dir))
    assert run(gh, d).created == 1
    [issue] = gh.issues()
    assert "Truncated to fit GitHub's issue size limit" in issue["body"] and "first comment below" in issue["body"]
    [first] = comments(issue)
    assert first.startswith("<!-- deepview-ci:event=repro run=gh-100 -->") and script in first and len(first) <= 65536
    assert run(gh, d).unchanged == 1 and len(comments(gh.issues()[0])) == 1  # the same run again: nothing new
