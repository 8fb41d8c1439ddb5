"""`deepview-ci history push`: this run's record onto the history branch, pushed as a compare-and-swap.

The branch (default ``deepview-history``) holds a history folder at its root: ``runs/<date>_<id>.json.gz``
(one file per run not yet folded) and ``history.sqlite`` (the runs folded so far). Each push:

1. fetches the branch (``--depth 1``; a missing branch starts from nothing);
2. checks its tip out in a temporary worktree of the given clone and repairs it: a database or run file that
   cannot be read (garbage, truncated, someone else's) is removed, and said, so the history goes on fresh; a
   newer deepview-ci's files are kept (then this run's file is added and nothing is folded);
3. adds this run's record file (an earlier attempt of the same workflow run is replaced: one night, one run),
   and, once ``compact_every`` run files are pending, folds them into ``history.sqlite`` and compacts runs past
   ``keep`` into weeks;
4. commits the result as **one commit without parents** and pushes it with ``--force-with-lease`` on the tip it
   read (on "no branch" the first time). The branch is always a single commit of the current state, so it stays
   about the size of the database (a full ``history.sqlite`` per compaction in the branch's history made it
   grow ten times faster), and a clone fetches only that. The lease makes the push a compare-and-swap: when
   another run pushed first it is rejected, and the push fetches again and redoes 2-4 on the new tip, up to
   ``retries`` times, so a run is added to what is there and never written over it.

Git runs with the clone's own credentials, or with ``GITHUB_TOKEN`` when it is set (the reusable workflow
passes the job token so that no checkout persists it); the token needs ``contents: write`` for this step only.
"""

from __future__ import annotations

import base64
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..procs.isolate import CommandResult, run_command
from ..errors import ExecutionError, UsageError
from ..results.model import Results
from .compact import compact
from .records import RunMeta, record_of, write_record
from .store import RUNS_DIR, drop_earlier_attempts, holds_run, repair

LOCAL_REF = "refs/deepview-ci/history"
EMPTY_TREE = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"
# another run pushed first: the lease no longer holds (or the server's ref lock was taken that instant)
_REJECTED = re.compile(r"stale info|failed to update ref|cannot lock ref")
# the server refuses the rewrite itself (a protected branch, receive.denyNonFastForwards, a hook): no retry helps
_REFUSED = re.compile(r"remote rejected|protected branch|GH006|declined")
_CREDS = re.compile(r"(://)[^/@\s]+@")
IDENTITY = {"GIT_AUTHOR_NAME": "deepview-ci", "GIT_AUTHOR_EMAIL": "deepview-ci@users.noreply.github.com",
            "GIT_COMMITTER_NAME": "deepview-ci", "GIT_COMMITTER_EMAIL": "deepview-ci@users.noreply.github.com"}


@dataclass(frozen=True, kw_only=True)
class PushOptions:
    remote: str = "origin"
    branch: str = "deepview-history"
    repo_dir: Path = Path(".")
    retries: int = 5
    compact_every: int = 7
    keep: int = 90


class _Rejected(Exception):
    pass


def _git(args: list[str], cwd: Path, env: Mapping[str, str], *, check: bool = True) -> CommandResult:
    """git through the one child engine (its own session, killed at the timeout or on Ctrl-C)."""
    proc = run_command(["git", *args], cwd=cwd, env=env, timeout=300)
    if check and proc.returncode != 0:
        err = _CREDS.sub(r"\1***@", (proc.stderr or proc.stdout).strip())
        raise ExecutionError(f"git {args[0]} failed (exit {proc.returncode}): {err[-800:]}",
                             hint="the clone needs the remote and a token with `contents: write` for the history branch")
    return proc


def git_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """git's environment: a commit identity when none is set, no prompts, and, when ``GITHUB_TOKEN`` is set
    (the action's `github-token`), an auth header for the server given to git through its environment (never
    on a command line, never written to the clone's config)."""
    env = dict(os.environ if base is None else base)
    for k, v in IDENTITY.items():
        env.setdefault(k, v)
    env["GIT_TERMINAL_PROMPT"] = "0"
    token = (env.get("GITHUB_TOKEN") or "").strip()
    if token:
        server = env.get("GITHUB_SERVER_URL", "https://github.com").rstrip("/")
        n = int(env.get("GIT_CONFIG_COUNT", "0") or 0)
        basic = base64.b64encode(f"x-access-token:{token}".encode()).decode("ascii")
        env.update({"GIT_CONFIG_COUNT": str(n + 1), f"GIT_CONFIG_KEY_{n}": f"http.{server}/.extraheader",
                    f"GIT_CONFIG_VALUE_{n}": f"AUTHORIZATION: basic {basic}"})
    return env


def _fetch(repo: Path, opts: PushOptions, env: Mapping[str, str]) -> tuple[str, str]:
    """(a commit to start from, the lease): the branch's tip twice when it exists (fetched), else an empty root
    commit and "" (the push then requires that the branch still does not exist)."""
    has = _git(["ls-remote", "--heads", opts.remote, f"refs/heads/{opts.branch}"], repo, env).stdout.strip()
    if has:
        _git(["fetch", "--quiet", "--depth=1", opts.remote, f"+refs/heads/{opts.branch}:{LOCAL_REF}"], repo, env)
        tip = _git(["rev-parse", LOCAL_REF], repo, env).stdout.strip()
        return tip, tip
    _git(["hash-object", "-t", "tree", "-w", "--stdin"], repo, env)  # makes sure the empty tree exists
    return _git(["commit-tree", EMPTY_TREE, "-m", "deepview-ci history: start"], repo, env).stdout.strip(), ""


def _attempt(repo: Path, start: tuple[str, str], record: Mapping[str, object], meta: RunMeta, opts: PushOptions,
             env: Mapping[str, str]) -> str:
    tip, lease = start
    work = Path(tempfile.mkdtemp(prefix="deepview-history-"))
    shutil.rmtree(work)
    _git(["worktree", "add", "--quiet", "--detach", str(work), tip], repo, env)
    try:
        removed, newer = repair(work)
        if holds_run(work, meta.run_id, files_only=newer):
            return f"history push: run {meta.run_id} is already on {opts.branch}; nothing to push"
        write_record(record, work / RUNS_DIR)
        drop_earlier_attempts(work, meta.run_id)  # a re-run replaces its attempt: one night, one run
        pending = len(list((work / RUNS_DIR).glob("*.json.gz")))
        message = f"deepview-ci history: add run {meta.run_id} ({meta.date})"
        if removed:
            message += f"; set aside (could not be read, the history goes on fresh): {', '.join(removed)}"
        if newer:
            message += "; a newer deepview-ci's history: this run's file added, nothing folded"
        elif pending >= opts.compact_every:
            folded, weeks = compact(work, keep=opts.keep)
            message += f"; compaction: {pending} run file(s) folded into history.sqlite, {folded} run(s) into {weeks} week(s)"
        _git(["add", "-A", "."], work, env)
        tree = _git(["write-tree"], work, env).stdout.strip()
        commit = _git(["commit-tree", tree, "-m", message], work, env).stdout.strip()  # no parent: one commit
        proc = _git(["push", "--porcelain", f"--force-with-lease=refs/heads/{opts.branch}:{lease}", opts.remote,
                     f"{commit}:refs/heads/{opts.branch}"], work, env, check=False)
        if proc.returncode != 0:
            text = (proc.stderr or "") + (proc.stdout or "")
            said = _CREDS.sub(r"\1***@", text.strip())[-400:]
            if _REJECTED.search(text):
                raise _Rejected(said)
            if _REFUSED.search(text):
                raise ExecutionError(f"history push: {opts.remote} refused to replace {opts.branch}: {said}",
                                     hint=f"the history branch is rewritten to one commit on every push: allow this "
                                          f"workflow to force-push {opts.branch} (no force-push protection or ruleset on "
                                          "it); the run's record is in the report artifact")
            _git(["push", f"--force-with-lease=refs/heads/{opts.branch}:{lease}", opts.remote,
                  f"{commit}:refs/heads/{opts.branch}"], work, env)  # raises with git's words
        return f"history push: {message} → {opts.remote}/{opts.branch}"
    finally:
        _git(["worktree", "remove", "--force", str(work)], repo, env, check=False)
        shutil.rmtree(work, ignore_errors=True)


def push_run(results: Results, meta: RunMeta, opts: PushOptions) -> str:
    """Add this run to the history branch and push it; retries when another run pushed first."""
    return push_record(record_of(results, meta), meta, opts)


def push_record(record: Mapping[str, object], meta: RunMeta, opts: PushOptions) -> str:
    """`push_run` for a record already made (`records.record_of`)."""
    repo = Path(opts.repo_dir)
    if opts.retries < 1 or opts.compact_every < 1 or opts.keep < 1:
        raise UsageError("history push: --retries, --compact-every and --keep must be at least 1")
    env = git_env()
    if _git(["rev-parse", "--git-dir"], repo, env, check=False).returncode != 0:
        raise UsageError(f"--repo {repo}: not a git clone", hint="run inside the repository's checkout, or pass --repo")
    last = ""
    for attempt in range(opts.retries):
        start = _fetch(repo, opts, env)
        try:
            return _attempt(repo, start, record, meta, opts, env) + (f" (after {attempt} retr{'y' if attempt == 1 else 'ies'})" if attempt else "")
        except _Rejected as exc:
            last = str(exc)
            time.sleep(random.uniform(0.2, 1.0) * (attempt + 1))
    raise ExecutionError(f"history push: {opts.remote}/{opts.branch} kept moving; gave up after {opts.retries} tries: {last}",
                         hint="rerun the step; nothing was overwritten, and the run's record is in the results artifact")
