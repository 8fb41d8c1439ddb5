"""`deepview-ci file-issues`: one GitHub issue per new failing operator per backend, deduplicated.

What is filed (from `diff.json`, see `load_diff`):

- **operators**: `unsupported_op` / `op_error` / `op_mismatch` findings → one issue per
  (backend, op), listing every model it blocks with the signatures from `finding.details`;
- with `--layers`: `layer_failure` → one per (backend, culprit op) when the culprit search found one op failing
  alone (`details.culprit`), listing every layer and model it breaks; else one per (backend, model, module); `divergence` → one per
  (backend, layer class or pattern).

Every issue body starts with a hidden marker ``<!-- deepview-ci:fingerprint=<fp> -->``; the
fingerprint hashes the group key only, so the same failure always maps to the same issue.
Deduplication lists the issues carrying the dedicated label (``state=all``, every page) and matches
that marker exactly; the search API is never used (it lags behind writes).

What happens to a group (``run`` is this run: ``GITHUB_RUN_ID``, else a hash of the diff file):

==================================  ===========================================================
the group in this diff               the matching issue → action
==================================  ===========================================================
a finding is new (``regressed``, or  none → create; open → comment once per run; closed → reopen
in a ``new_cell``)                   and comment (not when closed as "not planned"); carries the
                                     opt-out label → skip
only ``persisting`` / ``flaky``      nothing (the baseline already knows it)
gone: ``fixed`` entries, or absent   open → comment, and close when `close_fixed`; a finding
from results where every cell the    counts as gone only if its cells ran the mode that found it
issue names ran that mode
==================================  ===========================================================

A rerun of the same run (or the same diff, locally) files nothing new: comments carry
``<!-- deepview-ci:event=… run=… -->`` markers that are checked first.

Writes are serial and at least `min_interval` s apart. Anything not done because the API failed
is written as a draft (``<drafts>/NN-<action>-<fingerprint>.md`` plus ``drafts.json``) and makes
the exit code 6. `dry_run` writes every planned issue as a draft and calls no API at all.

Safe with another filer at once (issue 34): right before each create the issues changed since the first listing
are listed again (``since=``), and after it an issue another run created that same moment wins if it is older
(ours is closed as its duplicate). At most `max_new` creates a run and `write_budget` content-creating requests an
hour (this run's plus the labelled issues created in the hour before it): the rest are drafts, said in the notes
(exit 0). A repro cut in the issue body is posted whole as its first comment when it fits one.

Grouping, the issue and comment bodies and the neutralising of untrusted text live in
`ci_runner/github/render.py`.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..commits.pipeline import BISECT_NAME, bisections_by_finding
from ..errors import EXIT_GITHUB, EXIT_OK, ConfigError, InputError
from ..fsutil import atomic_write_json, atomic_write_text
from ..log import append_step_summary
from ..results.model import load_results, read_json, validate
from .actions import set_output
from .client import (
    DEFAULT_API_URL,
    ApiError,
    GitHubClient,
    NotFound,
    ServerUnavailable,
    redact,
)
from ..registry import mode_of_group
from .options import FilingOptions
from .render import (
    NEW,
    Group,
    RenderContext,
    code_span,
    group_entries,
    group_fingerprint,
    group_key,
    plain,
    render_comment,
    render_issue,
    render_repro_comment,
)

CATEGORIES = ("regressed", "fixed", "persisting", "flaky", "new_cell", "missing_cell")
_REPO_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}$")
_FP_MARKER = re.compile(r"<!-- deepview-ci:fingerprint=([0-9a-f]{8,64}) -->")
_META_MARKER = re.compile(r"<!-- deepview-ci:meta (\{.*?\}) -->")
_EVENT_MARKER = re.compile(r"<!-- deepview-ci:event=([a-z]+) run=([A-Za-z0-9._-]+) -->")


# --------------------------------------------------------------------------- the report


@dataclass(kw_only=True)
class FilingReport:
    """What `file_issues` did. `exit_code` is 6 when the API failed and drafts were kept."""

    repo: str
    dry_run: bool = False
    created: int = 0
    commented: int = 0
    reopened: int = 0
    closed: int = 0
    skipped: int = 0  # opted out with the opt-out label
    unchanged: int = 0  # known findings, or nothing new since this run already filed
    drafts: int = 0
    api_failures: int = 0
    stopped: str | None = None  # why API work stopped early, with the hint
    drafts_dir: Path | None = None
    actions: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_GITHUB if self.api_failures and self.drafts else EXIT_OK

    def counts(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("created", "commented", "reopened", "closed", "skipped",
                                              "unchanged", "drafts")}

    def to_dict(self) -> dict[str, Any]:
        return {
            "repo": self.repo,
            "dry_run": self.dry_run,
            "counts": self.counts(),
            "exit_code": self.exit_code,
            "stopped": self.stopped,
            "drafts_dir": str(self.drafts_dir) if self.drafts_dir else None,
            "actions": self.actions,
            "notes": self.notes,
        }

    def summary(self) -> str:
        """Plain-text lines for the terminal."""
        c = self.counts()
        head = "file-issues (dry run)" if self.dry_run else f"file-issues {self.repo}"
        lines = [f"{head}: " + ", ".join(f"{v} {k}" for k, v in c.items())]
        for a in self.actions:
            where = f"#{a['issue']}" if a.get("issue") else "new"
            line = f"  {a['action']:<8} {where:<6} {a['result']:<8} {a['title']}"
            if a.get("reason"):
                line += f"  ({a['reason']})"
            lines.append(line)
        if self.stopped:
            lines.append(f"stopped: {self.stopped}")
        if self.drafts:
            lines.append(f"{self.drafts} draft(s) kept in {self.drafts_dir}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def markdown(self) -> str:
        """A short step-summary section."""
        c = self.counts()
        out = ["### deepview-ci issues" + (" (dry run)" if self.dry_run else ""), "",
               "| " + " | ".join(c) + " |", "|" + "---|" * len(c), "| " + " | ".join(str(v) for v in c.values()) + " |", ""]
        for a in self.actions:
            link = f"[#{a['issue']}]({a['url']})" if a.get("url") else (f"#{a['issue']}" if a.get("issue") else "draft")
            out.append(f"- {a['action']} {link}: {code_span(a['title'])} — {a['result']}")
        if self.stopped:
            out += ["", f"> [!WARNING]\n> Filing stopped: {plain(self.stopped)}"]
        if self.drafts:
            out += ["", f"{self.drafts} draft(s) kept in {code_span(str(self.drafts_dir))}."]
        out += [f"- {plain(n)}" for n in self.notes]
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the diff


def load_diff(path: Path) -> dict[str, Any]:
    """Read `diff.json` and validate it with `schemas/diff.schema.json`."""
    data = read_json(path, what="diff file")
    validate(data, "diff.schema.json", source=str(path))
    if data.get("schema_version") not in (None, 1):
        raise InputError(f"{path}: diff schema_version {data.get('schema_version')!r} is not 1",
                         hint="produce it with a matching deepview-ci version")
    for i, e in enumerate(data["entries"]):
        if e.get("category") not in CATEGORIES:
            raise InputError(f"{path}: entries/{i} has unknown category {e.get('category')!r}",
                             hint=f"categories are {', '.join(CATEGORIES)}")
    return data


# --------------------------------------------------------------------------- the run


def check_repo(repo: str) -> str:
    """`repo` when it reads OWNER/NAME; else `ConfigError` (exit 2)."""
    if not _REPO_RE.match(repo or ""):
        raise ConfigError(f"--repo {repo!r} is not OWNER/NAME", hint="e.g. --repo acme/models (in Actions: ${{ github.repository }})")
    return repo


def run_key_from(env: Mapping[str, str], diff_path: Path) -> str:
    """This run's id for idempotence: the Actions run (reruns included), else the diff's content."""
    run_id = env.get("GITHUB_RUN_ID", "").strip()
    if re.fullmatch(r"\d+", run_id):
        return f"gh-{run_id}"
    return "diff-" + hashlib.sha256(diff_path.read_bytes()).hexdigest()[:16]


def run_url_from(env: Mapping[str, str]) -> str | None:
    server, repo, run_id = env.get("GITHUB_SERVER_URL"), env.get("GITHUB_REPOSITORY"), env.get("GITHUB_RUN_ID")
    if server and repo and run_id and re.fullmatch(r"\d+", run_id):
        return f"{server.rstrip('/')}/{repo}/actions/runs/{run_id}"
    return None


def _resolve_path(value: str | None, *bases: Path) -> Path | None:
    if not value:
        return None
    p = Path(value)
    if p.is_absolute():
        return p if p.exists() else None
    for base in (Path.cwd(), *bases):
        if (base / p).exists():
            return base / p
    return None


def _run_dir_of(diff: Mapping[str, Any], diff_path: Path) -> Path | None:
    """The run folder (the one holding `cells/`) of a diff that names none: the folder of its results file or of
    the diff, or the one above (`run --out OUT` writes OUT/cells and OUT/report/results.json)."""
    results = _resolve_path(diff.get("results"), diff_path.parent)
    for folder in [results.parent] if results else []:
        for candidate in (folder, folder.parent):
            if (candidate / "cells").is_dir():
                return candidate
    for candidate in (diff_path.parent, diff_path.parent.parent):
        if (candidate / "cells").is_dir():
            return candidate
    return None


def _results_coverage(diff: Mapping[str, Any], diff_path: Path, run_dir: Path | None) -> dict[str, set[str]] | None:
    """cell id → modes that ran to a verdict (pass/fail), from the results file the diff names."""
    bases = [diff_path.parent] + ([run_dir] if run_dir else [])
    path = _resolve_path(diff.get("results"), *bases)
    if path is None:
        return None
    try:
        results = load_results(path)
    except InputError:
        return None
    return {c.id: {name for name, m in c.modes.items() if m.status in ("pass", "fail")} for c in results.cells}


@dataclass
class _Issue:
    number: int
    state: str
    title: str
    body: str
    labels: set[str]
    url: str | None
    meta: dict[str, Any]
    state_reason: str | None = None


def _parse_issue(item: Mapping[str, Any]) -> tuple[str, _Issue] | None:
    body = item.get("body") or ""
    m = _FP_MARKER.search(body)
    if not m:
        return None
    meta: dict[str, Any] = {}
    mm = _META_MARKER.search(body)
    if mm:
        try:
            meta = json.loads(mm.group(1))
        except json.JSONDecodeError:
            meta = {}
    labels = {str(lab.get("name", "") if isinstance(lab, dict) else lab).lower() for lab in item.get("labels") or []}
    return m.group(1), _Issue(number=int(item["number"]), state=str(item.get("state", "open")), title=str(item.get("title", "")),
                              body=body, labels=labels, url=item.get("html_url"), meta=meta,
                              state_reason=item.get("state_reason"))


@dataclass
class _Action:
    action: str  # create | comment | reopen | close | file (state unknown: the API failed first)
    group: Group
    issue: _Issue | None = None
    body: str = ""
    comment: str = ""


class _Filer:
    """Reads the tracker, plans one action per group, and carries it out."""

    def __init__(self, client: GitHubClient, repo: str, options: FilingOptions, ctx: RenderContext,
                 report: FilingReport) -> None:
        self.client = client
        self.repo = repo
        self.options = options
        self.ctx = ctx
        self.report = report
        self.base = f"/repos/{repo}"
        self.writes = 0  # content-creating requests made (issues, comments, state changes), for the budget
        self.hour = 0  # issues with the label created in the last hour before this run (earlier runs' share)
        self.since: str | None = None  # the re-check before a create lists what changed from here on

    # ----------------------------------------------------------------- reads

    def ensure_labels(self) -> None:
        have = {str(lab.get("name", "")).lower() for lab in self.client.paginate(f"{self.base}/labels")}
        wanted = [
            (self.options.label, "5319e7", "Filed by deepview-ci: a failing operator, submodule or layer class"),
            (self.options.opt_out_label, "cfd3d7", "deepview-ci leaves issues with this label alone"),
        ]
        for name, color, desc in wanted:
            if name.lower() not in have:
                try:
                    self.client.post(f"{self.base}/labels", {"name": name, "color": color, "description": desc})
                except ApiError as exc:
                    if exc.status != 422:  # 422 already_exists: someone made it meanwhile
                        raise

    def existing(self) -> dict[str, _Issue]:
        found: dict[str, _Issue] = {}
        first = self.since is None
        if first:
            self.since = _iso(time.time() - self.options.recheck_window)
        hour_ago = _iso(time.time() - 3600)
        for item in self.client.paginate(f"{self.base}/issues", {"labels": self.options.label, "state": "all"}):
            if "pull_request" in item:
                continue
            if first and str(item.get("created_at") or "") >= hour_ago:
                self.hour += 1
            parsed = _parse_issue(item)
            if parsed is None:
                continue
            fp, issue = parsed
            old = found.get(fp)
            # duplicates from an earlier mishap: prefer the open one, then the oldest
            if old is None or (issue.state == "open", -issue.number) > (old.state == "open", -old.number):
                found[fp] = issue
        return found

    def same(self, fingerprint: str) -> list[_Issue]:
        """Issues with this fingerprint changed since the first listing (another run may have filed one meanwhile),
        oldest first: one page in the usual case, `since` keeps it short."""
        out = []
        params = {"labels": self.options.label, "state": "all", "since": self.since or _iso(time.time() - self.options.recheck_window)}
        for item in self.client.paginate(f"{self.base}/issues", params):
            parsed = _parse_issue(item) if "pull_request" not in item else None
            if parsed is not None and parsed[0] == fingerprint:
                out.append(parsed[1])
        return sorted(out, key=lambda i: i.number)

    def _events(self, issue: _Issue) -> list[tuple[str, str]]:
        out = []
        for c in self.client.paginate(f"{self.base}/issues/{issue.number}/comments"):
            for m in _EVENT_MARKER.finditer(c.get("body") or ""):
                out.append((m.group(1), m.group(2)))
        return out

    # ----------------------------------------------------------------- writes

    def _post_verified(self, path: str, body: Mapping[str, Any], already: Any) -> Any:
        """POST, and after an answer that leaves its effect unknown, look before posting again."""
        attempt = 0
        while True:
            try:
                return self.client.post(path, body).data
            except ServerUnavailable as exc:
                if not exc.uncertain:
                    raise
                attempt += 1
                found = already()
                if found is not None:
                    return found
                if attempt > self.options.max_retries:
                    raise ServerUnavailable(str(exc.message), status=exc.status, hint=exc.hint) from None
                self.client.wait(self.options.backoff * 2 ** (attempt - 1))

    def create(self, a: _Action) -> None:
        labels = [self.options.label, *self.options.extra_labels]

        def already() -> Any:
            issue = self.existing().get(a.group.fingerprint)
            return {"number": issue.number, "html_url": issue.url} if issue else None

        # another filer (a concurrent run) may have created it since this run listed the issues: look again
        meanwhile = self.same(a.group.fingerprint)
        if meanwhile:
            self._done(a, "unchanged", issue=meanwhile[0].number, url=meanwhile[0].url,
                       reason=f"filed meanwhile by another run (#{meanwhile[0].number})")
            return
        data = self._post_verified(f"{self.base}/issues", {"title": a.group.title, "body": a.body, "labels": labels}, already)
        self.writes += 1
        number = data.get("number")
        older = [i for i in self.same(a.group.fingerprint) if isinstance(number, int) and i.number < number]
        if older:  # both looked, then both created: the older issue stays, this one is closed as its duplicate
            first = older[0]
            self.client.post(f"{self.base}/issues/{number}/comments",
                             {"body": f"Duplicate of #{first.number}: another deepview-ci run filed the same finding at "
                                      "the same moment. Closed; follow that issue."})
            self.client.patch(f"{self.base}/issues/{number}", {"state": "closed", "state_reason": "not_planned"})
            self.writes += 2
            self._done(a, "unchanged", issue=first.number, url=first.url,
                       reason=f"filed at the same moment by another run; #{number} closed as its duplicate")
            return
        self._done(a, "created", issue=number, url=data.get("html_url"))
        self._attach_repro(a, number)

    def _attach_repro(self, a: _Action, number: Any) -> None:
        """The whole repro as the first comment when the body had to cut it: it outlives the run's artifacts."""
        text = render_repro_comment(a.group, self.ctx) if isinstance(number, int) else None
        if text is None:
            return
        if self.hour + self.writes + 1 > self.options.write_budget:
            self.report.notes.append(f"#{number}: the whole repro was not attached (the hour's write budget is spent)")
            return
        try:
            self.client.post(f"{self.base}/issues/{number}/comments", {"body": text})
            self.writes += 1
        except ApiError as exc:  # the issue exists; only the attachment is missing, and its note names the artifact
            self.report.notes.append(f"#{number}: the whole repro was not attached ({exc.message})")

    def comment(self, a: _Action, event: str) -> None:
        assert a.issue is not None
        marker = (event, self.ctx.run_key)

        def already() -> Any:
            return {} if marker in self._events(a.issue) else None  # type: ignore[arg-type]

        self._post_verified(f"{self.base}/issues/{a.issue.number}/comments", {"body": a.comment}, already)
        self.writes += 1

    def set_state(self, issue: _Issue, state: str) -> None:
        body = {"state": state, "state_reason": "completed" if state == "closed" else "reopened"}
        self.client.patch(f"{self.base}/issues/{issue.number}", body)
        self.writes += 1
        issue.state = state

    def _done(self, a: _Action, result: str, *, issue: int | None = None, url: str | None = None, reason: str | None = None) -> None:
        number = issue if issue is not None else (a.issue.number if a.issue else None)
        self.report.actions.append({
            "action": a.action, "result": result, "fingerprint": a.group.fingerprint, "title": a.group.title,
            "issue": number, "url": url if url is not None else (a.issue.url if a.issue else None), "reason": reason,
        })
        if result in ("created", "commented", "reopened", "closed", "skipped", "unchanged"):
            setattr(self.report, result, getattr(self.report, result) + 1)

    # ----------------------------------------------------------------- the plan

    def plan(self, groups: Sequence[Group], existing: Mapping[str, _Issue],
             coverage: Mapping[str, set[str]] | None, present: set[str]) -> list[_Action]:
        """`present`: fingerprints of every group still failing, of any kind, filed or not this run."""
        actions: list[_Action] = []
        for g in groups:
            issue = existing.get(g.fingerprint)
            if g.regressed:
                if issue is None:
                    actions.append(_Action("create", g, body=render_issue(g, self.ctx)))
                elif issue.state == "open":
                    actions.append(_Action("comment", g, issue, comment=render_comment(g, self.ctx, "recurrence")))
                else:
                    actions.append(_Action("reopen", g, issue, comment=render_comment(g, self.ctx, "reopen")))
            elif g.present:
                if issue is not None:
                    actions.append(_Action("none", g, issue))
            elif g.fixed and issue is not None and issue.state == "open":
                actions.append(_Action("close", g, issue, comment=render_comment(g, self.ctx, "fixed", closing=self.options.close_fixed)))
        # issues whose findings vanished without a baseline entry: fixed if their cells ran the mode
        if coverage is not None:
            planned = {a.group.fingerprint for a in actions} | present
            for fp, issue in sorted(existing.items(), key=lambda kv: kv[1].number):
                if fp in planned or issue.state != "open" or not issue.meta.get("key"):
                    continue
                key = tuple(str(k) for k in issue.meta["key"])
                cells = [str(c) for c in issue.meta.get("cells") or []]
                mode = mode_of_group().get(key[0])
                if not cells or mode is None or group_fingerprint(key) != fp:
                    continue
                if all(mode in coverage.get(c, set()) for c in cells):
                    g = Group(kind=key[0], key=key, fingerprint=fp, title=issue.title,
                              fixed=[{"cell": c, "category": "fixed", "backend": key[1]} for c in cells])
                    actions.append(_Action("close", g, issue, comment=render_comment(g, self.ctx, "fixed", closing=self.options.close_fixed)))
        return actions

    def execute(self, a: _Action) -> None:
        issue = a.issue
        if issue is not None and self.options.opt_out_label.lower() in issue.labels:
            self._done(a, "skipped", reason=f"has the label {self.options.opt_out_label}")
            return
        if a.action == "reopen" and issue is not None and issue.state_reason == "not_planned":
            self._done(a, "skipped", reason="closed as not planned")  # a person decided; do not fight it
            return
        if a.action == "none":
            self._done(a, "unchanged", reason="known finding (persisting or flaky in the baseline)")
        elif a.action == "create":
            self.create(a)
        elif a.action == "comment":
            assert issue is not None
            if issue.meta.get("run") == self.ctx.run_key or any(
                    ev in (("recurrence", self.ctx.run_key), ("reopen", self.ctx.run_key)) for ev in self._events(issue)):
                self._done(a, "unchanged", reason="already reported for this run")
                return
            self.comment(a, "recurrence")
            self._done(a, "commented")
        elif a.action == "reopen":
            assert issue is not None
            self.set_state(issue, "open")
            if ("reopen", self.ctx.run_key) not in self._events(issue):
                self.comment(a, "reopen")
            self._done(a, "reopened")
        elif a.action == "close":
            assert issue is not None
            events = self._events(issue)
            last = events[-1][0] if events else None
            if self.options.close_fixed:
                if ("fixed", self.ctx.run_key) not in events:
                    self.comment(a, "fixed")
                self.set_state(issue, "closed")
                self._done(a, "closed")
            elif last == "fixed":
                self._done(a, "unchanged", reason="already marked fixed")
            else:
                self.comment(a, "fixed")
                self._done(a, "commented", reason="fixed; left open (--no-close-fixed)")


# --------------------------------------------------------------------------- drafts


class _Drafts:
    def __init__(self, folder: Path, repo: str, report: FilingReport) -> None:
        self.folder = folder
        self.repo = repo
        self.report = report
        self.index: list[dict[str, Any]] = []

    def keep(self, a: _Action, reason: str, labels: Sequence[str]) -> None:
        n = len(self.index) + 1
        name = f"{n:03d}-{a.action}-{a.group.fingerprint}.md"
        text = a.body if a.action in ("create", "file") else a.comment
        head = {
            "action": a.action,
            "repo": self.repo,
            "title": a.group.title,
            "labels": list(labels),
            "issue": a.issue.number if a.issue else None,
            "fingerprint": a.group.fingerprint,
            "reason": reason,
            "file": name,
        }
        atomic_write_text(self.folder / name, text)
        self.index.append(head)
        self.report.drafts += 1
        self.report.drafts_dir = self.folder
        self.report.actions.append({"action": a.action, "result": "draft", "fingerprint": a.group.fingerprint,
                                    "title": a.group.title, "issue": head["issue"], "url": a.issue.url if a.issue else None,
                                    "reason": reason})

    def flush(self) -> None:
        if self.index:
            atomic_write_json(self.folder / "drafts.json", {"repo": self.repo, "drafts": self.index})


# --------------------------------------------------------------------------- entry point


def file_issues(diff_path: Path, *, repo: str, dry_run: Path | None, run_dir: Path | None,
                artifacts_url: str | None, options: FilingOptions, env: Mapping[str, str], bisect: Path | None = None) -> FilingReport:
    """File, comment on, reopen or close issues for `diff_path`; see the module docstring.

    Raises `ConfigError` (exit 2) for a malformed repo or a missing token without `dry_run`, and
    `InputError` (exit 3) for an unreadable diff. API failures do not raise: the report says what
    stopped and why, the drafts are on disk, and `exit_code` is 6. Bisections (`bisect`, default bisect.json by the diff) go in.
    """
    check_repo(repo)
    diff_path = Path(diff_path)
    diff = load_diff(diff_path)
    token = (env.get("GITHUB_TOKEN") or "").strip()
    if dry_run is None and not token:
        raise ConfigError("file-issues: GITHUB_TOKEN is not set",
                          hint="export a token that can write issues (in Actions: `env: GITHUB_TOKEN: ${{ github.token }}` "
                          "with `permissions: issues: write`), or use --dry-run DIR to only write drafts")
    if run_dir is None:
        run_dir = _resolve_path(diff.get("run_dir"), diff_path.parent) or _run_dir_of(diff, diff_path)
    run_url = run_url_from(env)
    ctx = RenderContext(options=options, run_key=run_key_from(env, diff_path), run_url=run_url,
                        artifacts_url=artifacts_url or (run_url + "#artifacts" if run_url else None), run_dir=run_dir,
                        secret=token or None, bisections=_bisections(bisect or diff_path.parent / BISECT_NAME))
    groups = group_entries(diff, layers=options.layers)
    report = FilingReport(repo=repo, dry_run=dry_run is not None)
    _note_unfiled(report, diff, options)
    labels = [options.label, *options.extra_labels]
    if dry_run is not None:
        _draft_all(groups, ctx, _Drafts(Path(dry_run), repo, report), options, labels)
    else:
        drafts = _Drafts(options.drafts_dir or diff_path.parent / "issue-drafts", repo, report)
        filer = _Filer(GitHubClient(env.get("GITHUB_API_URL") or DEFAULT_API_URL, token, options.client_options()),
                       repo, options, ctx, report)
        actions = _plan(filer, diff, diff_path, groups, drafts, labels, token)
        _execute(filer, actions, drafts, labels, token)
        drafts.flush()
    _publish(report, env, token)
    return report


def _note_unfiled(report: FilingReport, diff: Mapping[str, Any], options: FilingOptions) -> None:
    """Say how many new findings are of kinds not filed as issues."""
    ignored = sum(1 for e in diff.get("entries", []) if e.get("finding") and e["category"] in NEW
                  and group_key(e["backend"], e.get("model") or "", e["finding"], layers=options.layers) is None)
    if ignored:
        report.notes.append(f"{ignored} finding(s) of kinds not filed as issues"
                            + ("" if options.layers else " (layer failures and divergences need --layers)"))


def _draft_all(groups: list[Group], ctx: RenderContext, drafts: "_Drafts", options: FilingOptions, labels: list[str]) -> None:
    """--dry-run: every issue that would be created, and every close that applies if the issue is open."""
    for g in groups:
        if g.regressed:
            drafts.keep(_Action("create", g, body=render_issue(g, ctx)), "dry run", labels)
        elif g.fixed and not g.present:
            drafts.keep(_Action("close", g, comment=render_comment(g, ctx, "fixed", closing=options.close_fixed)),
                        "dry run: applies if an open issue exists", labels)
    drafts.flush()


def _plan(filer: "_Filer", diff: Mapping[str, Any], diff_path: Path, groups: list[Group], drafts: "_Drafts",
          labels: list[str], token: str) -> list[_Action]:
    """The actions against the repository's existing issues; when they cannot be listed, every new issue is drafted."""
    report, ctx = filer.report, filer.ctx
    present = {g.fingerprint for g in group_entries(diff, layers=True) if g.present}
    try:
        existing = filer.existing()
        coverage = _results_coverage(diff, diff_path, ctx.run_dir) if existing else None
        return filer.plan(groups, existing, coverage, present)
    except ApiError as exc:
        report.api_failures += 1
        report.stopped = redact(str(exc), token)
        for g in groups:
            if g.regressed:
                drafts.keep(_Action("file", g, body=render_issue(g, ctx)),
                            "not filed: could not list existing issues; create it, or comment on the issue with this fingerprint",
                            labels)
        return []


def _execute(filer: "_Filer", actions: list[_Action], drafts: "_Drafts", labels: list[str], token: str) -> None:
    """Do the actions in order; after a fatal API error the rest are drafted."""
    report = filer.report
    if any(a.action == "create" for a in actions):
        try:
            filer.ensure_labels()
        except ApiError as exc:
            report.api_failures += 1
            report.stopped = redact(str(exc), token)
    options = filer.options
    capped = over_budget = 0
    for a in actions:
        if report.stopped:
            if a.action != "none":
                drafts.keep(a, f"not done: {report.stopped.splitlines()[0]}", labels)
            continue
        if a.action == "create" and report.created >= options.max_new:
            capped += 1
            drafts.keep(a, f"not filed: this run already created {options.max_new} new issues (--max-new-issues); "
                           "look at those first, then file this draft or raise the cap", labels)
            continue
        if filer.hour + filer.writes + _WRITES.get(a.action, 0) > options.write_budget:
            over_budget += 1
            drafts.keep(a, f"not done: the hour's budget of {options.write_budget} content-creating requests is "
                           f"spent ({filer.hour} issue(s) filed in the last hour before this run, {filer.writes} "
                           "request(s) by it; --write-budget; GitHub allows 500 an hour)", labels)
            continue
        try:
            filer.execute(a)
        except NotFound as exc:  # the issue vanished (deleted/transferred): draft it, go on
            report.api_failures += 1
            drafts.keep(a, redact(exc.message, token), labels)
        except ApiError as exc:
            report.api_failures += 1
            drafts.keep(a, redact(exc.message, token), labels)
            if exc.fatal:
                report.stopped = redact(str(exc), token)
    if capped:
        report.notes.append(f"{capped} new issue(s) over the cap of {options.max_new} a run kept as drafts "
                            "(--max-new-issues)")
    if over_budget:
        report.notes.append(f"{over_budget} action(s) over the hour's budget of {options.write_budget} content-creating "
                            f"requests kept as drafts ({filer.hour} issue(s) filed in the hour before this run; "
                            "--write-budget; GitHub allows 500 an hour)")


# content-creating requests an action makes at most (a reopen and a close post a comment and change the state)
_WRITES = {"create": 1, "comment": 1, "reopen": 2, "close": 2, "none": 0}


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _bisections(path: Path) -> dict[tuple[str, str], dict[str, Any]]:
    if not path.is_file():
        return {}
    return bisections_by_finding(read_json(path, what="bisect file"))


def _publish(report: FilingReport, env: Mapping[str, str], token: str) -> None:
    """Step outputs and summary under GitHub Actions (no-ops elsewhere)."""
    if not env.get("GITHUB_OUTPUT") and not env.get("GITHUB_STEP_SUMMARY"):
        return
    for name, value in report.counts().items():
        set_output(name, str(value), env=env)
    set_output("drafts-dir", str(report.drafts_dir or ""), env=env)
    set_output("issues", json.dumps([a["issue"] for a in report.actions if a.get("issue")]), env=env)
    append_step_summary(redact(report.markdown(), token), env=env)


__all__ = ["FilingReport", "check_repo", "file_issues", "load_diff"]

