"""The scratch work tree `bisect-commits` checks commits out in: never the user's checkout.

`scratch_clone(repo)` is a context manager: a ``git clone --shared --no-checkout`` of the user's repository in a
temporary folder (objects are borrowed read-only through alternates; nothing is written to the user's `.git`),
removed on every exit path: normal return, an exception, Ctrl-C (SIGINT) and SIGTERM (turned into
`KeyboardInterrupt` while the clone is open). `RepoState` snapshots the user's HEAD, branch, work-tree status
and bisect state, so a caller can check that they are what they were.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..procs.isolate import CommandResult, run_command
from ..errors import ExecutionError, InputError, UsageError

GIT_TIMEOUT = 120.0


def git_run(repo: Path, *args: str, timeout: float = GIT_TIMEOUT) -> CommandResult:
    """`git -C repo args…` through the child engine (`isolate.run_command`)."""
    try:
        return run_command(["git", "-C", str(repo), *args], timeout=timeout, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except FileNotFoundError as exc:
        raise ExecutionError("git is not installed", hint="install git; bisect-commits walks a git history") from exc


def git(repo: Path, *args: str, check: bool = True, timeout: float = GIT_TIMEOUT) -> str:
    """`git -C repo args…`'s stdout (stripped); with `check`, a failing git is an InputError naming the command."""
    proc = git_run(repo, *args, timeout=timeout)
    if check and not proc.ok:
        raise InputError(f"{repo}: git {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}",
                         hint="check --repo (a local git checkout) and the refs given")
    return proc.stdout.strip()


def resolve(repo: Path, ref: str) -> str:
    """The full hash of `ref` (a branch, tag or hash) in the user's repository."""
    out = git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if not out:
        raise UsageError(f"{repo}: {ref!r} names no commit", hint="give a branch, tag or commit hash of --repo")
    return out


def check_repo(repo: Path) -> Path:
    if not repo.is_dir() or git(repo, "rev-parse", "--is-inside-work-tree", check=False) != "true":
        raise UsageError(f"--repo {repo}: not a git checkout", hint="give the folder of the backend's source repository")
    return Path(git(repo, "rev-parse", "--show-toplevel"))


@dataclass(frozen=True, kw_only=True)
class RepoState:
    """What must be the same after a bisection: HEAD, its branch, the work tree's status, no bisect running."""

    head: str
    branch: str
    status: str
    bisecting: bool

    @classmethod
    def of(cls, repo: Path) -> "RepoState":
        git_dir = Path(git(repo, "rev-parse", "--absolute-git-dir"))
        return cls(head=git(repo, "rev-parse", "HEAD"), branch=git(repo, "symbolic-ref", "-q", "HEAD", check=False),
                   status=git(repo, "status", "--porcelain", "--untracked-files=all"),
                   bisecting=(git_dir / "BISECT_LOG").exists() or (git_dir / "BISECT_START").exists())


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def scratch_clone(repo: Path, *, parent: Path | None = None) -> Iterator[Path]:
    """A throwaway clone of `repo` (no checkout yet); removed on exit, Ctrl-C and SIGTERM included."""
    root = Path(tempfile.mkdtemp(prefix="deepview-bisect-", dir=str(parent) if parent else None))
    old_term = signal.getsignal(signal.SIGTERM)
    in_main = _main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        tree = root / "src"
        git(root, "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(tree))
        git(tree, "config", "advice.detachedHead", "false")
        yield tree
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(root, ignore_errors=True)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def checkout(tree: Path, commit: str) -> None:
    """Put the scratch tree at `commit`, with no file of an earlier step left behind."""
    git(tree, "checkout", "--quiet", "--force", "--detach", commit)
    git(tree, "clean", "-qfdx")


@dataclass(frozen=True, kw_only=True)
class CommitInfo:
    commit: str
    subject: str
    author: str
    date: str

    def to_dict(self) -> dict[str, str]:
        return {"commit": self.commit, "subject": self.subject, "author": self.author, "date": self.date}


def commit_info(repo: Path, commit: str) -> CommitInfo:
    out = git(repo, "show", "-s", "--format=%H%x1f%s%x1f%an <%ae>%x1f%aI", commit)
    h, subject, author, date = out.split("\x1f")
    return CommitInfo(commit=h, subject=subject, author=author, date=date)


def candidates(repo: Path, good: str, bad: str) -> list[str]:
    """The commits that may be the first bad one, oldest first, `bad` last: ``git rev-list --ancestry-path``."""
    if not git_run(repo, "merge-base", "--is-ancestor", good, bad).ok or good == bad:
        raise UsageError(f"--good {good[:12]} is not an older ancestor of --bad {bad[:12]}",
                         hint="give a good commit older than the bad one, on its history")
    out = git(repo, "rev-list", "--ancestry-path", "--topo-order", "--reverse", f"{good}..{bad}")
    return out.split()
