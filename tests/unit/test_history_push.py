"""Writing the history back: `history push` to a git branch (a bare repository as origin), and the opt-in
baseline pull request through the GitHub REST API (the fake server)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci_runner.cli import main
from ci_runner.github.client import ClientOptions, GitHubClient
from ci_runner.history.gitpush import PushOptions, push_run
from ci_runner.history.pullrequest import TITLE, propose_pr
from ci_runner.history.store import load_history
from ci_runner.results.model import save_results
from tests.fixtures.fake_github import FakeGitHub
from tests.fixtures.history_sim import meta_of, night_results

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout


@pytest.fixture()
def origin(tmp_path: Path) -> tuple[Path, Path]:
    """A bare repository as origin, with main, and one clone of it."""
    bare = tmp_path / "origin.git"
    git(tmp_path, "init", "-q", "--bare", str(bare))
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(bare), str(clone))
    git(clone, "commit", "-q", "--allow-empty", "-m", "init")
    git(clone, "push", "-q", "origin", "HEAD:main")
    return bare, clone


def branch_store(bare: Path, tmp: Path) -> Path:
    out = tmp / "checkout"
    git(tmp, "clone", "-q", "--branch", "deepview-history", str(bare), str(out))
    return out


@pytest.mark.subprocess
def test_push_adds_runs_and_compacts_on_the_branch(origin: tuple[Path, Path], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bare, clone = origin
    for night in range(1, 6):
        results = tmp_path / f"r{night}.json"
        save_results(night_results(night), results)
        assert main(["history", "push", str(results), "--repo", str(clone), "--run-id", f"night-{night:02d}",
                     "--date", f"2031-01-0{night}", "--compact-every", "3", "--keep", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("compaction") == 1 and "nothing to push" not in out
    assert main(["history", "push", str(tmp_path / "r5.json"), "--repo", str(clone), "--run-id", "night-05",
                 "--date", "2031-01-05"]) == 0
    assert "already on deepview-history; nothing to push" in capsys.readouterr().out
    log = git(bare, "log", "--format=%s", "deepview-history").splitlines()
    assert len(log) == 6 and log[-1] == "deepview-ci history: start"
    files = sorted(git(bare, "ls-tree", "-r", "--name-only", "deepview-history").split())
    assert files == ["history.sqlite", "runs/2031-01-04_night-04.json.gz", "runs/2031-01-05_night-05.json.gz"]
    h = load_history(branch_store(bare, tmp_path))
    assert [r.run_id for r in h.runs][-2:] == ["night-04", "night-05"] and h.runs[0].kind == "weekly"
    assert sum(r.nights for r in h.runs) == 5
    h.close()
    assert not git(clone, "worktree", "list").strip().count("\n"), "the temporary worktree is gone"
    assert git(clone, "status", "--porcelain") == ""


@pytest.mark.subprocess
def test_a_push_that_loses_the_race_refetches_and_keeps_both_runs(origin: tuple[Path, Path], tmp_path: Path) -> None:
    """Another run pushes in the gap between our fetch and our push (a pre-push hook does it): our push is
    rejected, and the retry adds our run on top of theirs; nothing is forced or lost."""
    bare, clone = origin
    other = tmp_path / "other"
    git(tmp_path, "clone", "-q", str(bare), str(other))
    push_run(night_results(1), meta_of(1), PushOptions(repo_dir=other))
    r2 = tmp_path / "r2.json"
    save_results(night_results(2), r2)
    hook = clone / ".git" / "hooks" / "pre-push"
    flag = tmp_path / "raced"
    hook.write_text(f"""#!/bin/sh
if [ ! -e "{flag}" ]; then
  touch "{flag}"
  cd "{other}" && env -u GIT_DIR -u GIT_WORK_TREE -u GIT_INDEX_FILE PYTHONPATH="{Path.cwd()}" "{sys.executable}" -m ci_runner history push "{r2}" --run-id night-02 --date 2031-01-02 >/dev/null
fi
exit 0
""")
    hook.chmod(0o755)
    report = push_run(night_results(3), meta_of(3), PushOptions(repo_dir=clone))
    assert flag.exists() and "after 1 retry" in report
    files = git(bare, "ls-tree", "-r", "--name-only", "deepview-history").split()
    assert sorted(files) == [f"runs/2031-01-0{n}_night-0{n}.json.gz" for n in (1, 2, 3)]
    assert len(git(bare, "log", "--format=%H", "deepview-history").split()) == 4  # start + three runs, linear


def test_push_without_a_clone_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "r.json"
    save_results(night_results(1), results)
    assert main(["history", "push", str(results), "--repo", str(tmp_path)]) == 2
    assert "not a git clone" in capsys.readouterr().err


def test_the_baseline_pull_request_is_opened_then_updated() -> None:
    with FakeGitHub() as gh:
        client = GitHubClient(gh.url, gh.token, ClientOptions(min_write_interval=0, backoff=0))
        first = propose_pr(client, "acme/models", path="baselines/nightly.json", content=b'{"a": 1}\n',
                           body="remove `aten.cumsum.default`", branch="deepview-ci/baseline-update")
        assert first.startswith("opened pull request #1")
        assert gh.file_at("acme/models", "deepview-ci/baseline-update", "baselines/nightly.json") == b'{"a": 1}\n'
        second = propose_pr(client, "acme/models", path="baselines/nightly.json", content=b'{"a": 2}\n',
                            body="second night", branch="deepview-ci/baseline-update")
        assert second.startswith("updated pull request #1")
        [pr] = gh.pulls()
        assert pr["title"] == TITLE and pr["body"] == "second night" and pr["base"]["ref"] == "main"
        assert gh.file_at("acme/models", "deepview-ci/baseline-update", "baselines/nightly.json") == b'{"a": 2}\n'
        assert gh.file_at("acme/models", "main", "baselines/nightly.json") is None  # main is never touched
        assert all(r.auth in ("bearer", "token") for r in gh.requests)


def test_the_token_reaches_git_through_its_environment_only() -> None:
    from ci_runner.history.gitpush import git_env

    env = git_env({"GITHUB_TOKEN": "ghs_secret123", "GITHUB_SERVER_URL": "https://github.example.com", "PATH": "/bin"})
    assert env["GIT_CONFIG_COUNT"] == "1" and env["GIT_CONFIG_KEY_0"] == "http.https://github.example.com/.extraheader"
    assert env["GIT_CONFIG_VALUE_0"].startswith("AUTHORIZATION: basic ") and "ghs_secret123" not in env["GIT_CONFIG_VALUE_0"]
    assert "GIT_CONFIG_COUNT" not in git_env({"PATH": "/bin"})
