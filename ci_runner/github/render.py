"""Rendering filed issues: untrusted text made safe, findings grouped into issues, issue and comment bodies.

Used by `ci_runner/github/issues.py` (which files them). Untrusted text (error messages, module names, repro
scripts) is never pasted raw: inline values become code spans, blocks become fences longer than any backtick run
inside, prose is escaped, and ``@mentions`` / ``#123`` references get a zero-width joiner so nobody is pinged or
cross-linked.
"""

from __future__ import annotations

import datetime as _dt
import html as _html
import json
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2

from ..report.view import cell_command, reach_words
from ..matrix import artifact_name
from ..plan import collected_artifacts
from ..registry import IssueGroup, group_order, issue_group, kind_spec, mode_of_group, template_packages
from ..results.model import fingerprint as _hash_key
from .client import redact
from .options import FilingOptions

TITLE_LIMIT = 256
NEW = ("regressed", "new_cell")  # a finding the baseline does not know: filed
FAILING = ("regressed", "new_cell", "persisting", "flaky")  # still failing, whether filed or not
_ZWJ = "\u200d"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
MAX_ENTRIES = 50
MAX_MESSAGES = 5
MESSAGE_LIMIT = 4000
MAX_SIGNATURES = 10
LOG_TAIL = 1200  # characters of each bisection step's log in an issue


# --------------------------------------------------------------------------- neutralising text


def _clean(text: Any) -> str:
    return _CONTROL.sub("", str(text)).replace("\r\n", "\n").replace("\r", "\n")


def _break_refs(text: str) -> str:
    """Keep `@user`, `@org/team` and `#123` / `GH-123` from pinging or cross-linking (outside code)."""
    # after a letter or digit it is an e-mail address; after a dot or a backtick it still pings (issue 34)
    text = re.sub(r"(?<![A-Za-z0-9_/-])@(?=[A-Za-z0-9])", "@" + _ZWJ, text)
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


def size_text(value: Any) -> str:
    """A number of bytes as a code span with its MiB beside it ("`34340864` (32.75 MiB)"); anything else as a span."""
    try:
        n = float(str(value))
    except ValueError:
        return code_span(value)
    return code_span(value) + (f" ({n / 2**20:.2f} MiB)" if n.is_integer() and abs(n) >= 2**10 else "")


def html_text(text: Any) -> str:
    """Text inside an HTML element (`<summary>`): escaped, references broken."""
    return _break_refs(_html.escape(_clean(text).replace("\n", " "), quote=True))


def safe_title(text: str) -> str:
    s = _break_refs(re.sub(r"\s+", " ", _clean(text))).strip()
    return s if len(s) <= TITLE_LIMIT else s[: TITLE_LIMIT - 1] + "…"


def safe_url(url: str | None) -> str | None:
    """`url` when it is a plain http(s) URL safe inside a Markdown link; None otherwise."""
    if not url:
        return None
    p = urllib.parse.urlsplit(url)
    if p.scheme not in ("http", "https") or not p.netloc or any(c in url for c in " \n\r\t<>\"'`"):
        return None
    return url.replace("(", "%28").replace(")", "%29")


# --------------------------------------------------------------------------- grouping


@dataclass
class Group:
    """The findings that share one issue."""

    kind: str  # the issue group (`registry.IssueGroup.name`)
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
    """The issue a finding belongs to, or None when such findings are not filed.

    The kind's issue group and its key come from the mode registry (`registry.IssueGroup`); only the groups marked
    `always` (op issues) are filed unless `layers` is set."""
    spec = kind_spec(str(finding.get("kind")))
    if spec is None or spec.issue_group is None:
        return None
    group = issue_group(spec.issue_group) or IssueGroup(name=spec.issue_group)
    if not group.always and not layers:
        return None
    return group.key_of(backend, model, finding, finding.get(spec.key))


def group_fingerprint(key: Sequence[str]) -> str:
    return _hash_key("issue", *key)


def group_title(key: Sequence[str]) -> str:
    """The issue title its group declares (`IssueGroup.title`)."""
    group = issue_group(key[0]) or IssueGroup(name=key[0])
    return safe_title(group.title_of(key))


def entry_finding(e: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The entry's finding; for a fixed or not re-checked one (``finding: null``), rebuilt from kind and key."""
    if e.get("finding"):
        return e["finding"]
    kind, key = e.get("kind"), e.get("key")
    if not e.get("fingerprint") or not kind or not key:
        return None
    spec = kind_spec(str(kind))
    return {"kind": kind, spec.key if spec else "module": key}


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
    order = group_order()
    return sorted(groups.values(), key=lambda g: (order.get(g.kind, len(order)), g.key))


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True, kw_only=True)
class RenderContext:
    options: FilingOptions
    run_key: str
    run_url: str | None
    artifacts_url: str | None
    run_dir: Path | None
    secret: str | None = field(default=None, repr=False)  # scrubbed from every body, should a message quote it
    bisections: Mapping[tuple[str, str], Mapping[str, Any]] = field(default_factory=dict)  # (cell, fp) → bisect.json's


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


def phase_words(f: Mapping[str, Any]) -> str | None:
    """Where in the workload it fails, and what passed before it: "fails in decode step 1 only; prefill passes"."""
    phase = f.get("phase")
    layout = f.get("parallel")  # a tensor-parallel layout (`tp2`), said like a phase
    if not phase:
        return f"under tensor parallelism ({layout})" if layout else None
    where = f"{phase} step {f['step']}" if f.get("step") is not None else str(phase)
    where = f"{where}, {layout}" if layout else where
    passed = [str(c) for c in (f.get("details") or {}).get("passed_calls") or []]
    if passed:
        return f"fails in {where} only; {', '.join(passed[:3])} {'passes' if len(passed) == 1 else 'pass'}"
    return f"in {where}"


def _entry_view(e: Mapping[str, Any]) -> dict[str, Any]:
    f = e.get("finding") or {}
    sigs = _signatures(f.get("details"))
    return {
        "reach": reach_words(f.get("details")),
        "phase": phase_words(f),
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


def _culprit_view(f: Mapping[str, Any]) -> dict[str, Any] | None:
    """What the issue shows first for a layer finding with a culprit: op(s), nodes, real inputs, source, error."""
    c = (f.get("details") or {}).get("culprit") or {}
    if not c.get("found"):
        return None
    inputs = c.get("inputs") or []
    sources = c.get("sources") or []
    node_ops = c.get("node_ops") or c.get("ops") or []
    nodes = [{"name": n, "op": node_ops[i] if i < len(node_ops) else "",
              "inputs": ", ".join(inputs[i]) if i < len(inputs) else "",
              "source": sources[i] if i < len(sources) else None} for i, n in enumerate((c.get("nodes") or [])[:12])]
    also = [str(r.get("op")) for r in (c.get("failing_ops") or [])[1:] if isinstance(r, Mapping) and r.get("op")]
    return {"kind": c.get("kind"), "ops": list(c.get("ops") or []), "nodes": nodes, "also": also,
            "more_nodes": max(0, len(c.get("nodes") or []) - 12), "status": c.get("status"),
            "error": " ".join(x for x in (f"{c.get('error_type')}:" if c.get("error_type") else "",
                                           str(c.get("message") or "")) if x),
            "note": c.get("note") or "", "ops_mode_note": c.get("ops_mode_note"),
            "verified": bool((c.get("repro") or {}).get("verified")), "level": c.get("level")}


def _read_repro(entry: Mapping[str, Any], run_dir: Path | None, *, culprit: bool = False) -> dict[str, Any] | None:
    f = entry.get("finding") or {}
    repro = f.get("repro")
    if culprit:  # the culprit's own repro (the op alone), else the layer's
        repro = ((f.get("details") or {}).get("culprit") or {}).get("repro") or repro
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
        "command": cell_command(str(repro["path"]), repro.get("command")),  # from the cell folder, as the reports
        "cell_dir": str(Path(entry.get("artifacts_dir") or f"cells/{entry['cell']}")).replace("\\", "/"),
        "text": text,
        "lang": {".py": "python", ".sh": "sh"}.get(suffix, "text"),
        "artifact": collected_artifacts(run_dir).get(entry["cell"]) or artifact_name(entry["cell"]),
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
    fields = dict.fromkeys(VIEW_FIELDS) | {name: g.key[i] if i < len(g.key) else None
                                           for name, i in _group_spec(g).fields.items()}
    return {
        "kind": g.kind,
        "backend": g.backend,
        **fields,
        "module_class": f.get("module_class"),
        "entries": views[:max_entries],
        "more_entries": max(0, len(views) - max_entries),
        "models": sorted({v["model"] for v in views}),
        "new_models": sorted({v["model"] for v in views if v["category"] in NEW}),
        "messages": shown,
        "more_messages": max(0, len(messages) - MAX_MESSAGES),
        "env": _env_text(first.get("env")),
        "repro": None,
        "culprit": _culprit_view(f),
        "bisect": None,
        "layers": sorted({(v["model"], str(v["module"])) for v in views if v.get("module")}),
    }


VIEW_FIELDS = ("op", "model", "module", "pattern", "source")  # always in the group view (None unless declared)


def _group_spec(g: Group) -> IssueGroup:
    return issue_group(g.kind) or IssueGroup(name=g.kind)


_JINJA: dict[tuple[str, ...], Any] = {}


def _bisect_view(g: Group, ctx: RenderContext) -> dict[str, Any] | None:
    """The bisection of the group's first new finding that has one (`deepview-ci bisect-regressions`), logs cut short."""
    for e in sorted(g.entries, key=lambda e: (e["category"] not in NEW, e["cell"])):
        b = ctx.bisections.get((e["cell"], str(e.get("fingerprint"))))
        if b:
            steps = [{**s, "log": ("…" + s["log"][-LOG_TAIL:]) if len(s.get("log") or "") > LOG_TAIL else s.get("log") or ""}
                     for s in b.get("steps", [])]
            return {**b, "good": str(b.get("good", ""))[:12], "bad": str(b.get("bad", ""))[:12], "steps": steps,
                    "repro_runs": b.get("repro_runs", 0), "stopped": b.get("stopped", ""), "range": b.get("range", [])}
    return None


def templates() -> Any:
    """The issue templates' environment: ci_runner's templates, then each registered mode's own folder."""
    packages = template_packages()
    if packages not in _JINJA:
        loaders = [jinja2.PackageLoader("ci_runner", "templates")] + \
            [jinja2.PackageLoader(p, "templates") for p in packages if p != "ci_runner"]
        env = jinja2.Environment(
            loader=jinja2.ChoiceLoader(loaders),
            autoescape=False,  # markdown: every value goes through one of the filters below
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
        )
        env.filters.update(code=code_span, fence=fenced, plain=plain, html=html_text, size=size_text)
        _JINJA[packages] = env
    return _JINJA[packages]


def _markers(fp: str, meta: Mapping[str, Any]) -> str:
    blob = json.dumps(meta, sort_keys=True, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
    blob = blob.replace("--", "-\\u002d")
    return f"<!-- deepview-ci:fingerprint={fp} -->\n<!-- deepview-ci:meta {blob} -->"


def _tidy(text: str) -> str:
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def _retention(days: int | None) -> str:
    """How long the run's artifacts outlive it (the workflow's retention-days), said next to an artifact's name."""
    if not days:
        return ""
    until = (_dt.datetime.now(_dt.timezone.utc) + _dt.timedelta(days=days)).date().isoformat()
    return f"artifacts are kept {days} days, until about {until}; a repository setting can shorten that"


def _pick_repro(g: Group, ctx: RenderContext) -> dict[str, Any] | None:
    """The repro an issue shows: of its new entries first, one whose script is in the run folder if any."""
    repro = None
    for e in sorted(g.entries, key=lambda e: (e["category"] not in NEW, e["cell"])):
        candidate = _read_repro(e, ctx.run_dir, culprit=_group_spec(g).culprit_repro)
        if candidate and (repro is None or (repro["text"] is None and candidate["text"] is not None)):
            repro = candidate
    return repro


def render_repro_comment(g: Group, ctx: RenderContext) -> str | None:
    """The whole repro script as the issue's first comment, when the issue body had to cut it (so the script
    outlives the run's artifacts); None when nothing was cut, or the script does not fit one comment either."""
    repro = _pick_repro(g, ctx)
    if repro is None or repro["text"] is None or not render_issue_cut(g, ctx):
        return None
    head = (f"<!-- deepview-ci:event=repro run={ctx.run_key} -->\n"
            f"The whole repro script {code_span(repro['path'])} ({repro['total']} characters), cut in the issue above"
            + (f"; run it with {code_span(repro['command'])}" if repro.get("command") else "") + ":\n\n")
    body = redact(head + fenced(repro["text"], repro["lang"]) + "\n", ctx.secret)
    return body if len(body) <= ctx.options.body_limit else None


def render_issue_cut(g: Group, ctx: RenderContext) -> bool:
    """Whether `render_issue` cuts the repro script to fit the body limit."""
    return _render_issue(g, ctx)[1]


def render_issue(g: Group, ctx: RenderContext) -> str:
    """The issue body, within `body_limit` characters: the repro is cut first, then the lists."""
    return _render_issue(g, ctx)[0]


def _render_issue(g: Group, ctx: RenderContext) -> tuple[str, bool]:
    meta = {"v": 1, "kind": g.kind, "key": list(g.key), "cells": g.cells(), "run": ctx.run_key}
    spec = _group_spec(g)
    what = spec.what
    links = {"run": safe_url(ctx.run_url), "artifacts": safe_url(ctx.artifacts_url or ctx.run_url),
             "retention": _retention(ctx.options.artifact_days)}
    template = templates().get_template(spec.template)
    repro = _pick_repro(g, ctx)
    limit = ctx.options.body_limit
    max_entries, message_limit = MAX_ENTRIES, MESSAGE_LIMIT
    full = repro["text"] if repro and repro["text"] is not None else None
    keep = len(full) if full is not None else 0
    for _ in range(12):
        view = _group_view(g, max_entries=max_entries, message_limit=message_limit)
        view["bisect"] = _bisect_view(g, ctx)
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
                                     options=ctx.options, meta={"what": what, "fingerprint": g.fingerprint,
                                                                "key": " ".join(g.key[2:]),
                                                                "mode": mode_of_group().get(g.kind, g.kind)}))
        body = redact(body, ctx.secret)
        over = len(body) - limit
        if over <= 0:
            return body, full is not None and keep < len(full)
        if full is not None and keep > 0:
            keep = max(0, keep - over - 200)
        elif max_entries > 5 or message_limit > 500:
            max_entries, message_limit = max(5, max_entries // 2), max(500, message_limit // 2)
        else:
            break
    note = "\n\n… (truncated to fit GitHub's issue size limit)\n"
    return body[: limit - len(note)] + note, full is not None


def render_comment(g: Group, ctx: RenderContext, event: str, *, closing: bool = False) -> str:
    links = {"run": safe_url(ctx.run_url), "artifacts": safe_url(ctx.artifacts_url or ctx.run_url)}
    marker = f"<!-- deepview-ci:event={event} run={ctx.run_key} -->"
    template = templates().get_template("issue_comment.md.j2")
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
