"""The run history's writers that start processes: `history push` to a git branch (a bare repository as origin; the
baseline pull request and the usage errors: `tests/unit/test_history_push.py`) and two processes adding runs to one
store at once (the store itself: `tests/unit/test_history.py`)."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ci_runner.cli import main
from ci_runner.history.gitpush import PushOptions, push_run
from ci_runner.history.store import add_run, load_history
from ci_runner.results.model import save_results
from tests.fixtures.history_sim import meta_of, night_results

pytestmark = pytest.mark.subprocess  # every test here runs git or a second process

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
    assert log == ["deepview-ci history: add run night-05 (2031-01-05)"]  # one commit: the current state
    files = sorted(git(bare, "ls-tree", "-r", "--name-only", "deepview-history").split())
    assert files == ["history.sqlite", "runs/2031-01-04_night-04.json.gz", "runs/2031-01-05_night-05.json.gz"]
    h = load_history(branch_store(bare, tmp_path))
    assert [r.run_id for r in h.runs][-2:] == ["night-04", "night-05"] and h.runs[0].kind == "weekly"
    assert sum(r.nights for r in h.runs) == 5
    h.close()
    assert not git(clone, "worktree", "list").strip().count("\n"), "the temporary worktree is gone"
    assert git(clone, "status", "--porcelain") == ""


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
    assert len(git(bare, "log", "--format=%H", "deepview-history").split()) == 1  # one commit of the current state


def _writer(store: str, first: int, barrier: Any) -> None:
    barrier.wait()
    for night in range(first, first + 6):
        add_run(Path(store), night_results(night), meta_of(night))


def test_two_processes_adding_at_once_lose_no_run(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path / "h"), first, barrier)) for first in (1, 31)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    h = load_history(tmp_path / "h")
    ids = sorted(r.run_id for r in h.runs)
    h.close()
    assert ids == sorted(f"night-{n:02d}" for n in [*range(1, 7), *range(31, 37)])
    assert not list((tmp_path / "h" / "runs").glob("*.json.gz")), "every record file was folded"


def _put_on_branch(bare: Path, tmp: Path, files: dict[str, bytes]) -> None:
    """Commit files onto the history branch by hand (what a broken writer or a disk fault leaves)."""
    work = tmp / "hand"
    git(tmp, "clone", "-q", "--branch", "deepview-history", str(bare), str(work))
    for rel, data in files.items():
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_bytes(data)
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "broken")
    git(work, "push", "-q", "origin", "HEAD:deepview-history")
    import shutil

    shutil.rmtree(work)


def test_the_next_push_repairs_a_broken_branch(origin: tuple[Path, Path], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A garbage database and a bad run file on the branch: the push removes them, says so, and the history goes on
    fresh with this run; the report after it reads the branch without a warning. Before: the push folded into the
    broken database and failed (exit 3), every night."""
    import gzip

    bare, clone = origin
    for night in (1, 2):
        push_run(night_results(night), meta_of(night), PushOptions(repo_dir=clone, compact_every=2))
    _put_on_branch(bare, tmp_path, {"history.sqlite": b"garbage " * 500, "runs/2031-01-02_bad.json.gz": b"\x1f\x8bxx"})
    results = tmp_path / "r3.json"
    save_results(night_results(3), results)
    assert main(["history", "push", str(results), "--repo", str(clone), "--run-id", "night-03", "--date", "2031-01-03",
                 "--compact-every", "1"]) == 0
    out, err = capsys.readouterr()
    assert "set aside (could not be read, the history goes on fresh): history.sqlite (" in out
    assert "runs/2031-01-02_bad.json.gz" in out and "warning" in err
    h = load_history(branch_store(bare, tmp_path))
    assert [r.run_id for r in h.runs] == ["night-03"]
    h.close()
    # a newer deepview-ci's history is never removed by an older one: this run's file goes beside it, unfolded
    newer = gzip.compress(b'{"kind": "deepview-ci-history-run", "schema_version": 9}')
    _put_on_branch(bare, tmp_path, {"runs/2031-01-03_future.json.gz": newer})
    push_run(night_results(4), meta_of(4), PushOptions(repo_dir=clone, compact_every=1))
    files = sorted(git(bare, "ls-tree", "-r", "--name-only", "deepview-history").split())
    assert files == ["history.sqlite", "runs/2031-01-03_future.json.gz", "runs/2031-01-04_night-04.json.gz"]


def test_a_branch_that_refuses_the_rewrite_fails_at_once_and_says_why(origin: tuple[Path, Path], tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The branch is rewritten to one commit on every push; a server that refuses that (a protected branch; here
    receive.denyNonFastForwards) is told apart from a race: no five retries, one error naming the fix."""
    bare, clone = origin
    push_run(night_results(1), meta_of(1), PushOptions(repo_dir=clone))
    git(bare, "config", "receive.denyNonFastForwards", "true")
    results = tmp_path / "r2.json"
    save_results(night_results(2), results)
    assert main(["history", "push", str(results), "--repo", str(clone), "--run-id", "night-02", "--date", "2031-01-02"]) == 5
    err = capsys.readouterr().err
    assert "refused to replace deepview-history" in err and "force-push" in err and "kept moving" not in err
