"""Issue 22, the parts that start processes: the scratch clone and the candidates (git), the environment stamp of a
plugin imported from a checkout, `run_command`'s timeout (the fast walk and the issue text: `tests/unit/test_commits.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci_runner.commits.scratch import RepoState, candidates, checkout, scratch_clone
from ci_runner.engine.envinfo import plugin_modules
from ci_runner.errors import UsageError
from ci_runner.results.model import backend_commit
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.subprocess  # every test here runs git or a child process


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def small_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    script = ["git init -q -b main .", "git config user.email a@b.c", "git config user.name A", "git config commit.gpgsign false"]
    for i in range(4):
        script += [f"echo {i} > f.txt", "git add f.txt", f"git commit -q -m c{i}"]
    script += ["git checkout -q -b topic HEAD~1", "echo local > f.txt", "echo new > untracked.txt"]
    subprocess.run(["bash", "-c", " && ".join(script)], cwd=repo, check=True, capture_output=True)
    return repo


def test_scratch_clone_never_touches_the_users_checkout_and_goes_away_on_interrupt(small_repo: Path, tmp_path: Path) -> None:
    before = RepoState.of(small_repo)
    assert before.branch == "refs/heads/topic" and "untracked.txt" in before.status and not before.bisecting
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    with pytest.raises(KeyboardInterrupt):
        with scratch_clone(small_repo, parent=scratch) as tree:
            checkout(tree, git(small_repo, "rev-parse", "main~3"))
            assert (tree / "f.txt").read_text() == "0\n"
            raise KeyboardInterrupt
    assert list(scratch.iterdir()) == []
    assert RepoState.of(small_repo) == before


def test_candidates_are_the_ancestry_path_oldest_first_and_bad_refs_are_usage_errors(small_repo: Path) -> None:
    main = git(small_repo, "rev-list", "--reverse", "main").split()
    assert candidates(small_repo, main[0], main[3]) == main[1:]
    with pytest.raises(UsageError, match="not an older ancestor"):
        candidates(small_repo, main[3], main[0])


def test_the_stamp_names_the_commit_of_a_plugin_imported_from_a_checkout(small_repo: Path, tmp_path: Path) -> None:
    (small_repo / "myplugin.py").write_text("__version__ = '1.0'\n")
    code = ("from ci_runner.engine.envinfo import source_stamp; import json; "
            "print(json.dumps(source_stamp('myplugin')))")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{small_repo}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    head = git(small_repo, "rev-parse", "HEAD")
    assert f'"commit": "{head}"' in out and '"from": "checkout"' in out
    assert backend_commit({"backend_source": {"myplugin": {"commit": head}}}) == head and backend_commit({}) is None
    assert plugin_modules("tinyc.sub:compile_fn", ["tinyc", "extra.ops"]) == ["tinyc", "extra"]


def test_run_command_kills_the_whole_session_at_its_timeout(tmp_path: Path) -> None:
    import time

    from ci_runner.procs.isolate import run_command

    marker = tmp_path / "late"
    t0 = time.monotonic()
    r = run_command(["bash", "-c", f"(sleep 2; touch {marker}) & echo started; sleep 30"], timeout=0.5, merge_stderr=True)
    assert r.returncode is None and "started" in r.stdout and time.monotonic() - t0 < 10
    time.sleep(2.5)
    assert not marker.exists()  # the background grandchild died with the session
    assert run_command(["bash", "-c", "echo out; echo err >&2; exit 3"], timeout=30).stderr == "err\n"
