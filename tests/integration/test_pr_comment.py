"""`deepview-ci pr-comment` against the local fake GitHub: one comment per pull request, created once and updated in
place (found by its marker over every page), cut to GitHub's 65,536 characters with a link to the run, skipped with
one line on a fork's read-only token (from the event payload, or a 403), and a dry run that touches nothing."""

from __future__ import annotations

import json
from pathlib import Path

from ci_runner.github.client import ClientOptions
from ci_runner.github.prcomment import COMMENT_LIMIT, MARKER, post_pr_comment, pull_request_of
from ci_runner.results.model import save_results
from tests.fixtures.fake_github import FakeGitHub, entry, op_finding, write_diff
from tests.fixtures.results_factory import sample_results

REPO = "acme/models"
FAST = ClientOptions(min_write_interval=0.0, backoff=0.0, max_wait=5.0)


def pull_request(gh: FakeGitHub, *, others: int = 0) -> int:
    """A pull request (an issue with `pull_request`) with `others` comments by people before any of ours."""
    pr = gh.add_issue(REPO, title="Speed up the lowering of cumsum", pull_request=True)
    for i in range(others):
        gh.add_comment(REPO, pr["number"], f"review comment {i}")
    return int(pr["number"])


def diff_of(tmp_path: Path, entries: list[dict] | None = None, name: str = "diff.json") -> Path:
    save_results(sample_results(), tmp_path / "results.json")
    cumsum = op_finding("aten.cumsum.default", "sim-subset", repro="repro/op_000_aten_cumsum_default.py")
    pad = op_finding("aten.constant_pad_nd.default", "sim-subset")
    return write_diff(tmp_path / name, entries if entries is not None else [
        entry("regressed", "tiny-llama", "sim-subset", cumsum), entry("fixed", "tiny-bamba", "sim-subset", pad)])


def env_for(gh: FakeGitHub, tmp_path: Path, *, token: str | None = None, event: dict | None = None) -> dict[str, str]:
    env = {"GITHUB_TOKEN": token or gh.token, "GITHUB_API_URL": gh.url, "GITHUB_RUN_ID": "4242",
           "GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": REPO,
           "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"), "GITHUB_OUTPUT": str(tmp_path / "output.txt"),
           "GITHUB_EVENT_PATH": ""}
    if event is not None:
        (tmp_path / "event.json").write_text(json.dumps(event), encoding="utf-8")
        env["GITHUB_EVENT_PATH"] = str(tmp_path / "event.json")
    return env


def pr_event(number: int, *, head: str = REPO, sha: str = "0123456789abcdef0123") -> dict:
    return {"action": "synchronize", "number": number, "pull_request": {
        "number": number, "head": {"sha": sha, "repo": {"full_name": head}}, "base": {"repo": {"full_name": REPO}}}}


def ours(gh: FakeGitHub, number: int) -> list[dict]:
    return [c for c in gh.comments(REPO, number) if MARKER in c["body"] and c["user"]["type"] == "Bot"]


def test_first_run_creates_second_run_updates_the_same_comment_across_pages(gh, tmp_path):
    number = pull_request(gh, others=130)  # two pages of 100: ours lands on the second
    gh.add_comment(REPO, number, f"quoting the bot: {MARKER}")  # a person's comment holding the marker is not ours
    env = env_for(gh, tmp_path, event=pr_event(number))
    first = post_pr_comment(diff_of(tmp_path), repo=REPO, env=env, client_options=FAST)
    assert first.action == "created" and first.url and len(ours(gh, number)) == 1
    [posted] = ours(gh, number)
    body = posted["body"]
    assert body.startswith(MARKER) and "Regressed (1)" in body and "Fixed (1)" in body
    assert body.index("Regressed") < body.index("Fixed") < body.index("| cells |")
    assert "cells/tiny-llama@sim-subset/repro/op_000_aten_cumsum_default.py" in body
    assert "(https://github.com/acme/models/actions/runs/4242#artifacts)" in body  # the repro's artifact, linked
    assert "| 5 | 1 | 3 | 0 | 0 | 1 | 0 | 10 |" in body  # the one-line table of cell counts (sample_results)

    # the PR's next run: a new regression; the same comment is edited, none added
    erf = op_finding("aten.erf.default", "sim-subset", kind="op_mismatch")
    second_diff = diff_of(tmp_path, [entry("regressed", "tiny-vit", "sim-subset", erf)], name="diff2.json")
    second = post_pr_comment(second_diff, repo=REPO, env=env, client_options=FAST)
    assert second.action == "updated" and second.comment_id == posted["id"]
    [edited] = ours(gh, number)
    assert edited["id"] == posted["id"] and "aten.erf.default" in edited["body"] and "cumsum" not in edited["body"]
    pages = [r for r in gh.requests if r.method == "GET" and r.path.endswith(f"/issues/{number}/comments")]
    assert len(pages) == 4  # every page listed, on both runs
    assert [r.method for r in gh.writes()] == ["POST", "PATCH"]
    assert gh.writes()[1].path == f"/repos/{REPO}/issues/comments/{posted['id']}"

    # the same diff again: nothing to write
    third = post_pr_comment(second_diff, repo=REPO, env=env, client_options=FAST)
    assert third.action == "unchanged" and len(gh.writes()) == 2
    outputs = (tmp_path / "output.txt").read_text()
    assert "pr-comment<<" in outputs and "unchanged" in outputs
    assert "PR comment created" in (tmp_path / "summary.md").read_text()


def test_a_key_keeps_one_comment_per_matrix(gh, tmp_path):
    number = pull_request(gh)
    env = env_for(gh, tmp_path, event=pr_event(number))
    post_pr_comment(diff_of(tmp_path), repo=REPO, env=env, client_options=FAST)
    post_pr_comment(diff_of(tmp_path), repo=REPO, env=env, client_options=FAST, key="nightly-vendor")
    bodies = [c["body"] for c in gh.comments(REPO, number)]
    assert len(bodies) == 2 and bodies[1].startswith("<!-- deepview-ci:pr-comment:nightly-vendor -->")
    again = post_pr_comment(diff_of(tmp_path), repo=REPO, env=env, client_options=FAST, key="nightly-vendor")
    assert again.action == "unchanged" and len(gh.comments(REPO, number)) == 2


def test_an_oversized_comment_is_cut_with_a_line_linking_the_run(gh, tmp_path):
    number = pull_request(gh)
    many = []
    for i in range(600):  # 600 regressions with long messages: about 400 kB before cutting
        f = op_finding(f"aten.op{i}.default", "sim-subset", message="boom " * 120, repro=f"repro/op_{i:03d}.py")
        many.append(entry("regressed", f"model-{i}", "sim-subset", f))
    env = env_for(gh, tmp_path, event=pr_event(number))
    report = post_pr_comment(diff_of(tmp_path, many), repo=REPO, env=env, client_options=FAST)
    assert report.action == "created"
    [posted] = ours(gh, number)
    body = posted["body"]
    assert len(body) <= COMMENT_LIMIT
    assert "Regressed (600)" in body and "more regression(s)" in body
    assert "left out to fit GitHub's comment limit" in body
    assert "[the run's artifacts](https://github.com/acme/models/actions/runs/4242#artifacts)" in body
    assert not [r for r in gh.requests if r.status == 422]


def test_the_fake_refuses_a_comment_over_the_limit_like_github(gh, tmp_path):
    number = pull_request(gh)
    env = env_for(gh, tmp_path, event=pr_event(number))
    post_pr_comment(diff_of(tmp_path), repo=REPO, env=env, client_options=FAST)
    [posted] = ours(gh, number)
    from ci_runner.github.client import GitHubClient, ValidationFailed

    client = GitHubClient(gh.url, gh.token, FAST)
    try:
        client.patch(f"/repos/{REPO}/issues/comments/{posted['id']}", {"body": "x" * (COMMENT_LIMIT + 1)})
    except ValidationFailed as exc:
        assert exc.status == 422
    else:
        raise AssertionError("a body over 65536 characters was accepted")
    assert ours(gh, number)[0]["body"] == posted["body"]


def test_a_fork_pull_request_makes_no_request_and_says_why(gh, tmp_path, cli):
    number = pull_request(gh)
    diff = diff_of(tmp_path)
    env = env_for(gh, tmp_path, event=pr_event(number, head="outsider/models"))
    res = cli("pr-comment", str(diff), "--repo", REPO, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "PR comment skipped" in res.stdout and "fork outsider/models" in res.stdout
    assert gh.requests == []
    summary = (tmp_path / "summary.md").read_text()
    assert "did not comment on this pull request" in summary and "read-only" in summary


def test_a_403_from_a_read_only_token_is_one_line_and_exit_0(gh, tmp_path, cli):
    number = pull_request(gh)
    gh.readonly_tokens.add("ghs_readOnly_0123456789abcdef")
    env = env_for(gh, tmp_path, token="ghs_readOnly_0123456789abcdef")  # no event payload: only the 403 tells
    res = cli("pr-comment", str(diff_of(tmp_path)), "--repo", REPO, "--pr", str(number), env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    [line] = [x for x in res.stdout.splitlines() if x.strip()]
    assert "PR comment skipped" in line and "Resource not accessible by integration" in line
    assert "pull-requests: write" in line and "ghs_readOnly" not in res.stdout + res.stderr
    assert gh.comments(REPO, number) == []
    assert "did not comment" in (tmp_path / "summary.md").read_text()


def test_dry_run_prints_the_body_and_touches_nothing(gh, tmp_path, cli):
    number = pull_request(gh)
    env = env_for(gh, tmp_path, event=pr_event(number))
    env["GITHUB_TOKEN"] = ""  # needs no token
    res = cli("pr-comment", str(diff_of(tmp_path)), "--repo", REPO, "--dry-run", env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(MARKER) and "aten.cumsum.default" in res.stdout
    assert "dry run, nothing posted" in res.stderr
    assert gh.requests == [] and not (tmp_path / "summary.md").exists() and not (tmp_path / "output.txt").exists()


def test_mentions_and_references_in_messages_are_neutralised(gh, tmp_path):
    number = pull_request(gh)
    f = op_finding("aten.cumsum.default", "sim-subset", message="ping @octocat and @acme/compilers about #12 <b>x</b>")
    env = env_for(gh, tmp_path, event=pr_event(number))
    post_pr_comment(diff_of(tmp_path, [entry("regressed", "tiny-llama", "sim-subset", f)]), repo=REPO, env=env,
                    client_options=FAST)
    body = ours(gh, number)[0]["body"]
    assert "@\u200doctocat" in body and "@\u200dacme" in body and "#\u200d12" in body
    assert "@octocat" not in body and "<b>" not in body


def test_the_pull_request_comes_from_the_event_payload(tmp_path):
    (tmp_path / "e.json").write_text(json.dumps(pr_event(9, head="outsider/models")), encoding="utf-8")
    env = {"GITHUB_EVENT_PATH": str(tmp_path / "e.json")}
    pr = pull_request_of(env, None)
    assert (pr.number, pr.fork, pr.head_sha) == (9, "outsider/models", "0123456789abcdef0123")
    assert pull_request_of(env, 3).fork is None  # another pull request than the event's: nothing known about it
    deleted = pr_event(9)
    deleted["pull_request"]["head"]["repo"] = None  # the fork was deleted
    (tmp_path / "e.json").write_text(json.dumps(deleted), encoding="utf-8")
    assert pull_request_of(env, None).fork == "a deleted fork"


def test_without_a_pull_request_or_token_it_is_a_usage_error(gh, tmp_path, cli):
    diff = diff_of(tmp_path)
    env = env_for(gh, tmp_path)
    res = cli("pr-comment", str(diff), "--repo", REPO, env=env, timeout=120)
    assert res.returncode == 2 and "no pull request number" in res.stderr
    env["GITHUB_TOKEN"] = ""
    res = cli("pr-comment", str(diff), "--repo", REPO, "--pr", "1", env=env, timeout=120)
    assert res.returncode == 2 and "GITHUB_TOKEN is not set" in res.stderr
    assert gh.requests == []
