"""Writing the history back: `history push`'s usage errors (its pushes to a git branch:
`tests/integration/test_history_git.py`), and the opt-in baseline pull request through the GitHub REST API (the
fake server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci_runner.cli import main
from ci_runner.github.client import ClientOptions, GitHubClient
from ci_runner.history.pullrequest import TITLE, propose_pr
from ci_runner.results.model import save_results
from tests.fixtures.fake_github import FakeGitHub
from tests.fixtures.history_sim import night_results

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
