"""`deepview-ci pr-comment`: one comment per pull request, created once and updated in place on every run.

The comment says what a change did to the matrix: the regressions first (each with its repro script's path in the
cell's artifact, linked to the run's artifacts), then the fixed findings, then one table row of cell counts. Its
body starts with a hidden marker, ``<!-- deepview-ci:pr-comment -->`` (``<!-- deepview-ci:pr-comment:KEY -->``
with ``--key KEY``, for several matrices commenting on one pull request). Every page of the pull request's comments
is listed (``GET /repos/O/R/issues/N/comments``) and the first comment holding that marker exactly, preferring one
written by a bot, is updated (``PATCH /repos/O/R/issues/comments/ID``); without one, a comment is created (``POST
/repos/O/R/issues/N/comments``). A body equal to the one already there is not written again.

The body stays within GitHub's 65,536 characters: the lists are shortened first, and whatever is left out is said
in one line linking to the run (where the whole diff is, in the `deepview-report` artifact).

A pull request from a fork gets a read-only token: when the event payload (``GITHUB_EVENT_PATH``) says the head
repository is not the base repository, no request is made; when GitHub answers 403 anyway, nothing more is tried.
Both end in one line, on the terminal and in the step summary, and exit 0: the comment is a convenience, the check's
verdict is the diff's. Other API failures raise (`GitHubError`, exit 6). `dry_run` renders the body, prints it and
makes no request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, InputError
from ..failures.failure import headline
from ..jsontext import parse_json
from ..log import append_step_summary
from ..matrix import artifact_name
from ..results.baseline import DiffEntry
from ..results.model import CELL_STATUSES, load_results
from .actions import set_output
from .client import DEFAULT_API_URL, ClientOptions, GitHubClient, PermissionDenied, ServerUnavailable, redact
from .issues import check_repo, load_diff, run_url_from
from .render import safe_url, templates

COMMENT_LIMIT = 65536  # characters; GitHub answers 422 above it
MARKER = "<!-- deepview-ci:pr-comment -->"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MESSAGE_LIMIT = 300  # characters of each finding's first line
MAX_ENTRIES = 100  # per list, before the body limit shortens them further


def marker_for(key: str | None) -> str:
    """The hidden marker that finds this tool's comment: one per pull request, or one per `key`."""
    if not key:
        return MARKER
    if not _KEY.match(key):
        raise ConfigError(f"--key {key!r} is not a usable comment key",
                          hint="1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return f"<!-- deepview-ci:pr-comment:{key} -->"


# --------------------------------------------------------------------------- the pull request


@dataclass(frozen=True, kw_only=True)
class PullRequest:
    number: int
    fork: str | None = None  # the head repository, when it is not the base repository
    head_sha: str | None = None


def pull_request_of(env: Mapping[str, str], number: int | None) -> PullRequest:
    """The pull request to comment on: `number` (--pr), else the event payload's; its fork and head commit from the
    payload when it is about that pull request."""
    event: Mapping[str, Any] = {}
    path = env.get("GITHUB_EVENT_PATH")
    if path and Path(path).is_file():
        data = parse_json(Path(path).read_bytes(), source=path, what="GitHub event payload")
        pr = data.get("pull_request") if isinstance(data, Mapping) else None
        event = pr if isinstance(pr, Mapping) else {}
    found = event.get("number")
    if number is None:
        if not isinstance(found, int):
            raise ConfigError("pr-comment: no pull request number",
                              hint="pass --pr N, or run it in a workflow triggered by `pull_request`")
        number = found
    if number < 1:
        raise ConfigError(f"--pr {number} is not a pull request number")
    if found != number:
        return PullRequest(number=number)
    head = (event.get("head") or {}) if isinstance(event.get("head"), Mapping) else {}
    base = (event.get("base") or {}) if isinstance(event.get("base"), Mapping) else {}
    head_repo = (head.get("repo") or {}).get("full_name") if isinstance(head.get("repo"), Mapping) else None
    base_repo = (base.get("repo") or {}).get("full_name") if isinstance(base.get("repo"), Mapping) else None
    fork = None
    if base_repo and head_repo != base_repo:  # a deleted fork has no head repo: still a fork
        fork = str(head_repo or "a deleted fork")
    sha = head.get("sha")
    return PullRequest(number=number, fork=fork, head_sha=str(sha) if isinstance(sha, str) else None)


# --------------------------------------------------------------------------- the body


def _entry_view(e: Mapping[str, Any]) -> dict[str, Any]:
    entry = DiffEntry(**{k: e.get(k) for k in DiffEntry.__dataclass_fields__ if k != "env"}, env={})
    f = e.get("finding") or {}
    repro = f.get("repro") if isinstance(f.get("repro"), Mapping) else {}
    cell = str(e.get("cell"))
    path = None
    if repro and repro.get("path"):
        path = f"{e.get('artifacts_dir') or 'cells/' + cell}/{repro['path']}".replace("\\", "/")
    return {"cell": cell, "what": entry.title(), "message": headline(str(f.get("message") or ""), MESSAGE_LIMIT),
            "reason": str(e.get("reason") or ""), "repro": path, "verified": bool(repro and repro.get("verified")),
            "artifact": artifact_name(cell)}


def _cell_counts(diff: Mapping[str, Any], diff_path: Path, results: Path | None) -> dict[str, int] | None:
    """The run's cell counts by status, from its results.json: `results`, else the one the diff names (from the
    working folder or the diff's), else results.json next to the diff; None when there is none."""
    candidates = [results] if results else []
    named = diff.get("results")
    if not results and named:
        candidates += [Path(named), diff_path.parent / named, diff_path.parent / Path(named).name]
    if not results:
        candidates.append(diff_path.parent / "results.json")
    for p in candidates:
        if p is not None and p.is_file():
            return load_results(p).counts()
    if results:
        raise InputError(f"{results}: results file not found", hint="give the results.json the diff was made from")
    return None


def render_pr_comment(diff: Mapping[str, Any], *, counts: Mapping[str, int] | None, marker: str = MARKER,
                      run_url: str | None = None, artifacts_url: str | None = None, head_sha: str | None = None,
                      limit: int = COMMENT_LIMIT) -> str:
    """The comment body (`pr_comment.md.j2`), within `limit` characters: the lists shortened first, then cut."""
    entries = diff.get("entries") or []
    by = {c: [_entry_view(e) for e in entries if e.get("category") == c]
          for c in ("regressed", "new_cell", "fixed", "missing_cell")}
    n = {c: sum(1 for e in entries if e.get("category") == c)
         for c in ("regressed", "fixed", "persisting", "flaky", "new_cell", "missing_cell")}
    links = {"run": safe_url(run_url), "artifacts": safe_url(artifacts_url or (run_url + "#artifacts" if run_url else None))}
    statuses = [s for s in CELL_STATUSES if s in ("pass", "fail", "error", "timeout", "crashed", "skipped")
                or (counts or {}).get(s)]
    template = templates().get_template("pr_comment.md.j2")
    shown = MAX_ENTRIES
    body = ""
    while True:
        lists = {c: v[:shown] for c, v in by.items()}
        left = sum(len(v) - len(lists[c]) for c, v in by.items())
        body = template.render(marker=marker, n=n, lists=lists, left=left, counts=counts, statuses=statuses,
                               links=links, policy=str(diff.get("policy") or "regression"),
                               sha=(head_sha or "")[:12] or None)
        body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
        if len(body) <= limit or shown == 0:
            break
        shown = shown // 2
    if len(body) > limit:  # even the empty lists do not fit (a tiny limit): cut, and point at the run
        tail = f"\n\n… cut to fit GitHub's comment limit; the whole diff is in {_where(links)}.\n"
        body = body[: max(0, limit - len(tail))] + tail
    return body


def _where(links: Mapping[str, str | None]) -> str:
    url = links.get("artifacts") or links.get("run")
    return f"[the run's artifacts]({url}) (`deepview-report`)" if url else "the run's `deepview-report` artifact"


# --------------------------------------------------------------------------- posting


@dataclass(kw_only=True)
class CommentReport:
    """What `post_pr_comment` did: `action` is created, updated, unchanged, skipped or dry-run."""

    repo: str
    pr: int
    action: str
    body: str = field(repr=False)
    url: str | None = None
    comment_id: int | None = None
    reason: str | None = None

    def line(self) -> str:
        where = f"{self.repo}#{self.pr}"
        if self.action == "skipped":
            return f"deepview-ci: PR comment skipped on {where}: {self.reason}"
        if self.action == "dry-run":
            return f"deepview-ci: PR comment on {where} (dry run, nothing posted): {len(self.body)} characters"
        return f"deepview-ci: PR comment {self.action} on {where}" + (f": {self.url}" if self.url else "")

    def markdown(self) -> str:
        if self.action == "skipped":
            return f"> [!NOTE]\n> deepview-ci did not comment on this pull request: {self.reason}\n"
        link = f"[the pull request's comment]({safe_url(self.url)})" if safe_url(self.url) else "the pull request's comment"
        return f"deepview-ci PR comment {self.action}: {link}.\n"


def _find(client: GitHubClient, base: str, pr: int, marker: str) -> Mapping[str, Any] | None:
    """The comment that starts with `marker`, over every page: the first by a bot (the Actions token writes as
    `github-actions[bot]`), else the first (a personal token's comment); a comment that only quotes it is not ours."""
    found = [c for c in client.paginate(f"{base}/issues/{pr}/comments")
             if isinstance(c, Mapping) and str(c.get("body") or "").lstrip().startswith(marker)]
    bots = [c for c in found if str((c.get("user") or {}).get("type", "")).lower() == "bot"
            or str((c.get("user") or {}).get("login", "")).endswith("[bot]")]
    return (bots or found or [None])[0]


def _denied(pr: PullRequest, why: str) -> str:
    return (f"{why}; the results are in this run's step summary and its `deepview-report` artifact"
            + ("" if pr.fork else " (grant the calling job `pull-requests: write` for the comment)"))


def post_pr_comment(diff_path: Path, *, repo: str, env: Mapping[str, str], pr: int | None = None,
                    results: Path | None = None, artifacts_url: str | None = None, key: str | None = None,
                    dry_run: bool = False, client_options: ClientOptions | None = None,
                    limit: int = COMMENT_LIMIT) -> CommentReport:
    """Create or update this tool's comment on the pull request; see the module docstring."""
    check_repo(repo)
    marker = marker_for(key)
    diff_path = Path(diff_path)
    diff = load_diff(diff_path)
    counts = _cell_counts(diff, diff_path, results)
    pull = pull_request_of(env, pr)
    token = (env.get("GITHUB_TOKEN") or "").strip()
    body = render_pr_comment(diff, counts=counts, marker=marker, run_url=run_url_from(env),
                             artifacts_url=artifacts_url, head_sha=pull.head_sha or env.get("GITHUB_SHA"), limit=limit)
    body = redact(body, token)
    if dry_run:
        return CommentReport(repo=repo, pr=pull.number, action="dry-run", body=body)
    if pull.fork:
        report = CommentReport(repo=repo, pr=pull.number, action="skipped", body=body, reason=_denied(
            pull, f"the pull request comes from the fork {pull.fork}, whose GITHUB_TOKEN is read-only"))
        return _publish(report, env, token)
    if not token:
        raise ConfigError("pr-comment: GITHUB_TOKEN is not set",
                          hint="in Actions: the action's github-token input with `permissions: pull-requests: write`; "
                          "or --dry-run to print the comment")
    client = GitHubClient(env.get("GITHUB_API_URL") or DEFAULT_API_URL, token, client_options or ClientOptions())
    base = f"/repos/{repo}"
    try:
        old = _find(client, base, pull.number, marker)
        if old is not None and old.get("body") == body:
            report = CommentReport(repo=repo, pr=pull.number, action="unchanged", body=body, url=old.get("html_url"),
                                   comment_id=old.get("id"))
        elif old is not None:
            data = client.patch(f"{base}/issues/comments/{int(old['id'])}", {"body": body}).data or {}
            report = CommentReport(repo=repo, pr=pull.number, action="updated", body=body,
                                   url=data.get("html_url") or old.get("html_url"), comment_id=int(old["id"]))
        else:
            data = _create(client, base, pull.number, marker, body)
            report = CommentReport(repo=repo, pr=pull.number, action="created", body=body, url=data.get("html_url"),
                                   comment_id=data.get("id"))
    except PermissionDenied as exc:
        report = CommentReport(repo=repo, pr=pull.number, action="skipped", body=body, reason=_denied(
            pull, f"GitHub refused the write ({redact(exc.api_message or '403', token)}): the token cannot comment here"))
    return _publish(report, env, token)


def _create(client: GitHubClient, base: str, pr: int, marker: str, body: str) -> Mapping[str, Any]:
    """POST the comment; when the answer leaves it unknown whether GitHub made it, look before posting again."""
    attempts = 3
    for attempt in range(attempts):
        try:
            return client.post(f"{base}/issues/{pr}/comments", {"body": body}).data or {}
        except ServerUnavailable as exc:
            if not exc.uncertain or attempt == attempts - 1:
                raise
            made = _find(client, base, pr, marker)
            if made is not None:
                return made
    raise AssertionError("unreachable")  # pragma: no cover


def _publish(report: CommentReport, env: Mapping[str, str], token: str) -> CommentReport:
    """Step outputs and the step summary's line under GitHub Actions (no-ops elsewhere)."""
    set_output("pr-comment", report.action, env=env)
    set_output("pr-comment-url", report.url or "", env=env)
    append_step_summary(redact(report.markdown(), token), env=env)
    return report


__all__ = ["COMMENT_LIMIT", "MARKER", "CommentReport", "PullRequest", "post_pr_comment", "pull_request_of",
           "render_pr_comment"]
