"""`deepview-ci file-issues`: one GitHub issue per new failing operator per backend, deduplicated.

What is filed (from `diff.json`, see `load_diff`):

- **operators**: `unsupported_op` / `op_error` / `op_mismatch` findings → one issue per
  (backend, op), listing every model it blocks with the signatures from `finding.details`;
- with `--layers`: `layer_failure` → one per (backend, model, module); `divergence` → one per
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

Untrusted text (error messages, module names, repro scripts) is never pasted raw: inline values
become code spans, blocks become fences longer than any backtick run inside, prose is escaped, and
``@mentions`` / ``#123`` references get a zero-width joiner so nobody is pinged or cross-linked.
"""

from __future__ import annotations

import hashlib
import html as _html
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2

from ..errors import EXIT_GITHUB, EXIT_OK, ConfigError, InputError
from ..fsutil import atomic_write_json, atomic_write_text
from ..log import append_step_summary
from ..matrix import artifact_name
from ..results import fingerprint as _hash_key
from ..results import load_results, read_json, validate
from .actions import set_output
from .client import (
    DEFAULT_API_URL,
    ApiError,
    ClientOptions,
    GitHubClient,
    NotFound,
    ServerUnavailable,
    redact,
)

ISSUE_BODY_LIMIT = 65536  # characters; GitHub answers 422 above it
TITLE_LIMIT = 256
OP_KINDS = ("unsupported_op", "op_error", "op_mismatch")
NEW = ("regressed", "new_cell")  # a finding the baseline does not know: filed
FAILING = ("regressed", "new_cell", "persisting", "flaky")  # still failing, whether filed or not
CATEGORIES = ("regressed", "fixed", "persisting", "flaky", "new_cell", "missing_cell")
MODE_OF_GROUP = {"op": "ops", "layer": "layers", "divergence": "numerics"}
_REPO_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,38})/[A-Za-z0-9._-]{1,100}$")
_FP_MARKER = re.compile(r"<!-- deepview-ci:fingerprint=([0-9a-f]{8,64}) -->")
_META_MARKER = re.compile(r"<!-- deepview-ci:meta (\{.*?\}) -->")
_EVENT_MARKER = re.compile(r"<!-- deepview-ci:event=([a-z]+) run=([A-Za-z0-9._-]+) -->")
_ZWJ = "\u200d"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
MAX_ENTRIES = 50
MAX_MESSAGES = 5
MESSAGE_LIMIT = 4000
MAX_SIGNATURES = 10


# --------------------------------------------------------------------------- options and report


@dataclass(frozen=True, kw_only=True)
class FilingOptions:
    """Resolved `file-issues` settings (CLI flags; tests lower the waits to 0)."""

    label: str = "deepview-ci"
    opt_out_label: str = "deepview-ci:ignore"
    close_fixed: bool = True
    layers: bool = False
    min_interval: float = 1.0  # seconds between writes; GitHub asks for ≥ 1
    max_wait: float = 300.0  # longest single rate-limit wait; longer → stop and keep drafts
    max_retries: int = 4
    backoff: float = 2.0  # first wait after a 5xx/timeout, doubled each retry
    timeout: float = 30.0  # seconds per request
    body_limit: int = ISSUE_BODY_LIMIT
    drafts_dir: Path | None = None  # default: <diff folder>/issue-drafts
    extra_labels: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        named = [("label", self.label), ("opt-out-label", self.opt_out_label)]
        named += [("extra label", x) for x in self.extra_labels]
        for flag, value in named:
            if not value or len(value) > 50 or value != value.strip() or "," in value:
                raise ConfigError(
                    f"--{flag} {value!r} is not a usable GitHub label",
                    hint="a label is 1 to 50 characters, without commas or surrounding spaces",
                )
        if self.label.lower() == self.opt_out_label.lower():
            raise ConfigError("--label and --opt-out-label are the same label",
                              hint="the opt-out label must differ from the dedicated label")
        for name in ("min_interval", "max_wait", "backoff", "timeout"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be ≥ 0, not {getattr(self, name)}")
        if self.body_limit < 2000:
            raise ConfigError(f"body limit {self.body_limit} is too small to hold an issue", hint="keep the default 65536")

    @classmethod
    def from_args(cls, args: Any) -> "FilingOptions":
        """From the `file-issues` argparse namespace; absent attributes keep their defaults."""
        kw: dict[str, Any] = {}
        for name in ("label", "opt_out_label", "close_fixed", "layers", "min_interval", "max_wait",
                     "max_retries", "backoff", "timeout"):
            value = getattr(args, name, None)
            if value is not None:
                kw[name] = value
        drafts = getattr(args, "drafts_dir", None)
        if drafts:
            kw["drafts_dir"] = Path(drafts)
        return cls(**kw)

    def client_options(self) -> ClientOptions:
        return ClientOptions(timeout=self.timeout, max_retries=self.max_retries, backoff=self.backoff,
                             max_wait=self.max_wait, min_write_interval=self.min_interval)


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
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- neutralising text


def _clean(text: Any) -> str:
    return _CONTROL.sub("", str(text)).replace("\r\n", "\n").replace("\r", "\n")


def _break_refs(text: str) -> str:
    """Keep `@user`, `@org/team` and `#123` / `GH-123` from pinging or cross-linking (outside code)."""
    text = re.sub(r"(?<![A-Za-z0-9_.`/-])@(?=[A-Za-z0-9])", "@" + _ZWJ, text)
    text = re.sub(r"(?<![A-Za-z0-9_&])#(?=\d)", "#" + _ZWJ, text)
    return re.sub(r"\b(GH)-(?=\d)", r"\1-" + _ZWJ, text, flags=re.IGNORECASE)


def _longest_run(text: str, char: str) -> int:
    return max((len(m) for m in re.findall(re.escape(char) + "+", text)), default=0)


def code_span(text: Any) -> str:
    """An inline code span that survives any backticks inside; one line. GitHub links no mention in code."""
    s = _clean(text).replace("\n", " ").strip() or " "
    ticks = "`" * (_longest_run(s, "`") + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{ticks}{pad}{s}{pad}{ticks}"


def fenced(text: Any, info: str = "") -> str:
    """A fenced block whose fence is longer than any backtick run in `text` (min 3)."""
    s = _clean(text)
    if not s.endswith("\n"):
        s += "\n"
    fence = "`" * max(3, _longest_run(s, "`") + 1)
    info = re.sub(r"[^A-Za-z0-9_+-]", "", info)
    return f"{fence}{info}\n{s}{fence}"


def plain(text: Any) -> str:
    """Prose from an untrusted source: markdown and HTML inert, references broken, one line."""
    s = _clean(text).replace("\n", " ")
    s = _html.escape(s, quote=False)
    s = re.sub(r"([\\`*_{}\[\]()#+!|~>])", r"\\\1", s)
    return _break_refs(s)


def html_text(text: Any) -> str:
    """Text inside an HTML element (`<summary>`): escaped, references broken."""
    return _break_refs(_html.escape(_clean(text).replace("\n", " "), quote=True))


def safe_title(text: str) -> str:
    s = _break_refs(re.sub(r"\s+", " ", _clean(text))).strip()
    return s if len(s) <= TITLE_LIMIT else s[: TITLE_LIMIT - 1] + "…"


def _safe_url(url: str | None) -> str | None:
    if not url:
        return None
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("http", "https") or not p.netloc or any(c in url for c in " \n\r\t<>\"'`"):
        return None
    return url.replace("(", "%28").replace(")", "%29")


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


# --------------------------------------------------------------------------- grouping


@dataclass
class Group:
    """The findings that share one issue."""

    kind: str  # "op" | "layer" | "divergence"
    key: tuple[str, ...]
    fingerprint: str
    title: str
    entries: list[dict[str, Any]] = field(default_factory=list)  # failing: regressed / persisting / flaky
    fixed: list[dict[str, Any]] = field(default_factory=list)

    @property
    def backend(self) -> str:
        return self.key[1]

    @property
    def regressed(self) -> bool:
        """Some finding is new: not in the baseline (regressed, or in a cell the baseline lacks)."""
        return any(e["category"] in NEW for e in self.entries)

    @property
    def present(self) -> bool:
        return bool(self.entries)

    def cells(self) -> list[str]:
        return sorted({e["cell"] for e in self.entries or self.fixed})


def group_key(backend: str, model: str, finding: Mapping[str, Any], *, layers: bool) -> tuple[str, ...] | None:
    """The issue a finding belongs to, or None when such findings are not filed."""
    kind = finding.get("kind")
    if kind in OP_KINDS and finding.get("op"):
        return ("op", backend, str(finding["op"]))
    if not layers:
        return None
    if kind == "layer_failure" and finding.get("module"):
        return ("layer", backend, model, str(finding["module"]))
    if kind == "divergence":
        details = finding.get("details") or {}
        pattern = details.get("pattern") or finding.get("module_class") or finding.get("module")
        if pattern:
            return ("divergence", backend, str(pattern))
    return None


def group_fingerprint(key: Sequence[str]) -> str:
    return _hash_key("issue", *key)


def group_title(key: Sequence[str]) -> str:
    kind = key[0]
    if kind == "op":
        text = f"[deepview-ci] {key[2]} fails on {key[1]}"
    elif kind == "layer":
        text = f"[deepview-ci] {key[3]} of {key[2]} fails on {key[1]}"
    else:
        text = f"[deepview-ci] {key[2]} layers diverge on {key[1]}"
    return safe_title(text)


def entry_finding(e: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The entry's finding; for a fixed or not re-checked one (``finding: null``), rebuilt from kind and key."""
    if e.get("finding"):
        return e["finding"]
    kind, key = e.get("kind"), e.get("key")
    if not e.get("fingerprint") or not kind or not key:
        return None
    if kind in OP_KINDS:
        return {"kind": kind, "op": key}
    return {"kind": kind, "module": key}


def group_entries(diff: Mapping[str, Any], *, layers: bool) -> list[Group]:
    groups: dict[tuple[str, ...], Group] = {}
    for e in diff.get("entries", []):
        f = entry_finding(e)
        if not f:
            continue  # cell-level entries (a cell got worse, appeared, vanished): not an issue of their own
        key = group_key(e["backend"], e.get("model") or e["cell"].split("@")[0], f, layers=layers)
        if key is None:
            continue
        g = groups.get(key)
        if g is None:
            g = groups[key] = Group(kind=key[0], key=key, fingerprint=group_fingerprint(key), title=group_title(key))
        if e["category"] in FAILING:
            g.entries.append(e)
        elif e["category"] == "fixed":
            g.fixed.append(e)
    order = {"op": 0, "layer": 1, "divergence": 2}
    return sorted(groups.values(), key=lambda g: (order[g.kind], g.key))


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True, kw_only=True)
class RenderContext:
    options: FilingOptions
    run_key: str
    run_url: str | None
    artifacts_url: str | None
    run_dir: Path | None
    secret: str | None = field(default=None, repr=False)  # scrubbed from every body, should a message quote it


def _env_text(env: Mapping[str, Any] | None) -> str:
    if not env:
        return ""
    lines = []
    for k in sorted(env):
        v = env[k]
        lines.append(f"{k}: {json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v}")
    return "\n".join(lines)


def _signatures(details: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """`details["signatures"]` (or `"signature"`) as {text, count, module, module_class, source}.

    Items may be strings, or the ops mode's dicts: ``{"signature": "aten.x(f32[1, 3])", "count": 2,
    "sites": [{"module": …, "module_class": …, "source": …}], …}``.
    """
    if not details:
        return []
    raw = details.get("signatures")
    if raw is None:
        raw = details.get("signature")
    if raw is None:
        return []
    out = []
    for item in raw if isinstance(raw, list) else [raw]:
        if isinstance(item, Mapping):
            sites = item.get("sites") or [{}]
            site = sites[0] if isinstance(sites[0], Mapping) else {}
            text = item.get("signature") or json.dumps(dict(item), sort_keys=True, separators=(",", ":"))[:400]
            out.append({"text": str(text), "count": int(item.get("count") or 1), "module": site.get("module"),
                        "module_class": site.get("module_class"), "source": site.get("source")})
        else:
            out.append({"text": str(item), "count": 1, "module": None, "module_class": None, "source": None})
    return out


def _entry_view(e: Mapping[str, Any]) -> dict[str, Any]:
    f = e.get("finding") or {}
    sigs = _signatures(f.get("details"))
    return {
        "model": e.get("model") or e["cell"].split("@")[0],
        "cell": e["cell"],
        "category": e["category"],
        "kind": f.get("kind", ""),
        "stage": f.get("stage", ""),
        "module": f.get("module"),
        "signatures": sigs[:MAX_SIGNATURES],
        "more_signatures": max(0, len(sigs) - MAX_SIGNATURES),
        "metrics": sorted((str(k), str(v)) for k, v in (f.get("metrics") or {}).items())[:8],
        "threshold": sorted((str(k), str(v)) for k, v in (f.get("threshold") or {}).items())[:8],
    }


def _read_repro(entry: Mapping[str, Any], run_dir: Path | None) -> dict[str, Any] | None:
    f = entry.get("finding") or {}
    repro = f.get("repro")
    if not repro or not repro.get("path"):
        return None
    rel = Path(entry.get("artifacts_dir") or f"cells/{entry['cell']}") / repro["path"]
    text: str | None = None
    if run_dir is not None:
        root = run_dir.resolve()
        target = (root / rel).resolve()
        if root in target.parents and target.is_file():  # never read outside the run folder
            try:
                text = target.read_text(encoding="utf-8", errors="replace")
            except OSError:
                text = None
    suffix = Path(repro["path"]).suffix
    return {
        "path": str(rel).replace("\\", "/"),
        "verified": bool(repro.get("verified")),
        "command": repro.get("command"),
        "text": text,
        "lang": {".py": "python", ".sh": "sh"}.get(suffix, "text"),
        "artifact": artifact_name(entry["cell"]),
        "truncated": False,
        "shown": len(text or ""),
        "total": len(text or ""),
    }


def _group_view(g: Group, *, max_entries: int, message_limit: int) -> dict[str, Any]:
    ordered = sorted(g.entries, key=lambda e: (e["category"] not in NEW, e["cell"], e.get("fingerprint") or ""))
    views = [_entry_view(e) for e in ordered]
    messages: list[str] = []
    for e in ordered:
        msg = str((e.get("finding") or {}).get("message") or "").strip()
        if msg and msg not in messages:
            messages.append(msg)
    shown = [m if len(m) <= message_limit else m[:message_limit] + f"\n… ({len(m) - message_limit} more characters)"
             for m in messages[:MAX_MESSAGES]]
    first = ordered[0] if ordered else (g.fixed[0] if g.fixed else {})
    f = first.get("finding") or {}
    return {
        "kind": g.kind,
        "backend": g.backend,
        "op": g.key[2] if g.kind == "op" else None,
        "model": g.key[2] if g.kind == "layer" else None,
        "module": g.key[3] if g.kind == "layer" else None,
        "pattern": g.key[2] if g.kind == "divergence" else None,
        "module_class": f.get("module_class"),
        "entries": views[:max_entries],
        "more_entries": max(0, len(views) - max_entries),
        "models": sorted({v["model"] for v in views}),
        "new_models": sorted({v["model"] for v in views if v["category"] in NEW}),
        "messages": shown,
        "more_messages": max(0, len(messages) - MAX_MESSAGES),
        "env": _env_text(first.get("env")),
        "repro": None,
    }


_JINJA: Any = None


def _jinja() -> Any:
    global _JINJA
    if _JINJA is None:
        env = jinja2.Environment(
            loader=jinja2.PackageLoader("ci_runner", "templates"),
            autoescape=False,  # markdown: every value goes through one of the filters below
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
        )
        env.filters.update(code=code_span, fence=fenced, plain=plain, html=html_text)
        _JINJA = env
    return _JINJA


def _markers(fp: str, meta: Mapping[str, Any]) -> str:
    blob = json.dumps(meta, sort_keys=True, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
    blob = blob.replace("--", "-\\u002d")
    return f"<!-- deepview-ci:fingerprint={fp} -->\n<!-- deepview-ci:meta {blob} -->"


def _tidy(text: str) -> str:
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def render_issue(g: Group, ctx: RenderContext) -> str:
    """The issue body, within `body_limit` characters: the repro is cut first, then the lists."""
    meta = {"v": 1, "kind": g.kind, "key": list(g.key), "cells": g.cells(), "run": ctx.run_key}
    what = {"op": "operator and backend", "layer": "failing submodule, model and backend",
            "divergence": "layer class and backend"}[g.kind]
    links = {"run": _safe_url(ctx.run_url), "artifacts": _safe_url(ctx.artifacts_url or ctx.run_url)}
    template = _jinja().get_template(f"issue_{g.kind}.md.j2")
    repro = None
    for e in sorted(g.entries, key=lambda e: (e["category"] not in NEW, e["cell"])):
        candidate = _read_repro(e, ctx.run_dir)
        if candidate and (repro is None or (repro["text"] is None and candidate["text"] is not None)):
            repro = candidate
    limit = ctx.options.body_limit
    max_entries, message_limit = MAX_ENTRIES, MESSAGE_LIMIT
    full = repro["text"] if repro and repro["text"] is not None else None
    keep = len(full) if full is not None else 0
    for _ in range(12):
        view = _group_view(g, max_entries=max_entries, message_limit=message_limit)
        if repro is not None:
            r = dict(repro)
            if full is not None and keep < len(full):
                cut = full[:keep]
                nl = cut.rfind("\n")
                r["text"] = cut[: nl + 1] if nl > 0 else cut
                r["truncated"] = True
                r["shown"] = len(r["text"])
            view["repro"] = r
        body = _tidy(template.render(group=view, markers=_markers(g.fingerprint, meta), links=links,
                                     options=ctx.options, meta={"what": what, "fingerprint": g.fingerprint}))
        body = redact(body, ctx.secret)
        over = len(body) - limit
        if over <= 0:
            return body
        if full is not None and keep > 0:
            keep = max(0, keep - over - 200)
        elif max_entries > 5 or message_limit > 500:
            max_entries, message_limit = max(5, max_entries // 2), max(500, message_limit // 2)
        else:
            break
    note = "\n\n… (truncated to fit GitHub's issue size limit)\n"
    return body[: limit - len(note)] + note


def render_comment(g: Group, ctx: RenderContext, event: str, *, closing: bool = False) -> str:
    links = {"run": _safe_url(ctx.run_url), "artifacts": _safe_url(ctx.artifacts_url or ctx.run_url)}
    marker = f"<!-- deepview-ci:event={event} run={ctx.run_key} -->"
    template = _jinja().get_template("issue_comment.md.j2")
    max_entries, message_limit = 20, 1500
    body = ""
    for _ in range(6):
        view = _group_view(g, max_entries=max_entries, message_limit=message_limit)
        body = redact(_tidy(template.render(group=view, markers=marker, links=links, options=ctx.options, event=event,
                                            closing=closing, cells=g.cells())), ctx.secret)
        if len(body) <= ctx.options.body_limit:
            return body
        max_entries, message_limit = max(3, max_entries // 2), max(200, message_limit // 2)
    return body[: ctx.options.body_limit - 40] + "\n… (truncated)\n"


# --------------------------------------------------------------------------- the run


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
        for item in self.client.paginate(f"{self.base}/issues", {"labels": self.options.label, "state": "all"}):
            if "pull_request" in item:
                continue
            parsed = _parse_issue(item)
            if parsed is None:
                continue
            fp, issue = parsed
            old = found.get(fp)
            # duplicates from an earlier mishap: prefer the open one, then the oldest
            if old is None or (issue.state == "open", -issue.number) > (old.state == "open", -old.number):
                found[fp] = issue
        return found

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

        data = self._post_verified(f"{self.base}/issues", {"title": a.group.title, "body": a.body, "labels": labels}, already)
        self._done(a, "created", issue=data.get("number"), url=data.get("html_url"))

    def comment(self, a: _Action, event: str) -> None:
        assert a.issue is not None
        marker = (event, self.ctx.run_key)

        def already() -> Any:
            return {} if marker in self._events(a.issue) else None  # type: ignore[arg-type]

        self._post_verified(f"{self.base}/issues/{a.issue.number}/comments", {"body": a.comment}, already)

    def set_state(self, issue: _Issue, state: str) -> None:
        body = {"state": state, "state_reason": "completed" if state == "closed" else "reopened"}
        self.client.patch(f"{self.base}/issues/{issue.number}", body)
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
                mode = MODE_OF_GROUP.get(key[0])
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
                artifacts_url: str | None, options: FilingOptions, env: Mapping[str, str]) -> FilingReport:
    """File, comment on, reopen or close issues for `diff_path`; see the module docstring.

    Raises `ConfigError` (exit 2) for a malformed repo or a missing token without `dry_run`, and
    `InputError` (exit 3) for an unreadable diff. API failures do not raise: the report says what
    stopped and why, the drafts are on disk, and `exit_code` is 6.
    """
    if not _REPO_RE.match(repo or ""):
        raise ConfigError(f"--repo {repo!r} is not OWNER/NAME", hint="e.g. --repo acme/models (in Actions: ${{ github.repository }})")
    diff_path = Path(diff_path)
    diff = load_diff(diff_path)
    token = (env.get("GITHUB_TOKEN") or "").strip()
    if dry_run is None and not token:
        raise ConfigError("file-issues: GITHUB_TOKEN is not set",
                          hint="export a token that can write issues (in Actions: `env: GITHUB_TOKEN: ${{ github.token }}` "
                          "with `permissions: issues: write`), or use --dry-run DIR to only write drafts")
    if run_dir is None:
        run_dir = _resolve_path(diff.get("run_dir"), diff_path.parent)
    run_url = run_url_from(env)
    ctx = RenderContext(options=options, run_key=run_key_from(env, diff_path), run_url=run_url,
                        artifacts_url=artifacts_url or (run_url + "#artifacts" if run_url else None), run_dir=run_dir,
                        secret=token or None)
    groups = group_entries(diff, layers=options.layers)
    report = FilingReport(repo=repo, dry_run=dry_run is not None)
    labels = [options.label, *options.extra_labels]
    ignored = sum(1 for e in diff.get("entries", []) if e.get("finding") and e["category"] in NEW
                  and group_key(e["backend"], e.get("model") or "", e["finding"], layers=options.layers) is None)
    if ignored:
        report.notes.append(f"{ignored} finding(s) of kinds not filed as issues"
                            + ("" if options.layers else " (layer failures and divergences need --layers)"))

    if dry_run is not None:
        drafts = _Drafts(Path(dry_run), repo, report)
        for g in groups:
            if g.regressed:
                drafts.keep(_Action("create", g, body=render_issue(g, ctx)), "dry run", labels)
            elif g.fixed and not g.present:
                drafts.keep(_Action("close", g, comment=render_comment(g, ctx, "fixed", closing=options.close_fixed)),
                            "dry run: applies if an open issue exists", labels)
        drafts.flush()
        _publish(report, env, token)
        return report

    drafts = _Drafts(options.drafts_dir or diff_path.parent / "issue-drafts", repo, report)
    client = GitHubClient(env.get("GITHUB_API_URL") or DEFAULT_API_URL, token, options.client_options())
    filer = _Filer(client, repo, options, ctx, report)
    actions: list[_Action] = []
    present = {g.fingerprint for g in group_entries(diff, layers=True) if g.present}
    try:
        existing = filer.existing()
        coverage = _results_coverage(diff, diff_path, run_dir) if existing else None
        actions = filer.plan(groups, existing, coverage, present)
    except ApiError as exc:
        report.api_failures += 1
        report.stopped = redact(str(exc), token)
        for g in groups:
            if g.regressed:
                drafts.keep(_Action("file", g, body=render_issue(g, ctx)),
                            "not filed: could not list existing issues; create it, or comment on the issue with this fingerprint",
                            labels)
        actions = []
    if any(a.action == "create" for a in actions):
        try:
            filer.ensure_labels()
        except ApiError as exc:
            report.api_failures += 1
            report.stopped = redact(str(exc), token)
    for a in actions:
        if report.stopped:
            if a.action != "none":
                drafts.keep(a, f"not done: {report.stopped.splitlines()[0]}", labels)
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
    drafts.flush()
    _publish(report, env, token)
    return report


def _publish(report: FilingReport, env: Mapping[str, str], token: str) -> None:
    """Step outputs and summary under GitHub Actions (no-ops elsewhere)."""
    if not env.get("GITHUB_OUTPUT") and not env.get("GITHUB_STEP_SUMMARY"):
        return
    for name, value in report.counts().items():
        set_output(name, str(value), env=env)
    set_output("drafts-dir", str(report.drafts_dir or ""), env=env)
    set_output("issues", json.dumps([a["issue"] for a in report.actions if a.get("issue")]), env=env)
    append_step_summary(redact(report.markdown(), token), env=env)


__all__ = [
    "FilingOptions",
    "FilingReport",
    "Group",
    "code_span",
    "fenced",
    "file_issues",
    "group_entries",
    "group_fingerprint",
    "group_key",
    "group_title",
    "html_text",
    "load_diff",
    "plain",
    "render_comment",
    "render_issue",
    "safe_title",
]

