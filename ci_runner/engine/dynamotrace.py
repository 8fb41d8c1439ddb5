"""What Dynamo says while it compiles: graph breaks, recompiles, compile time, recompile-limit hits.

Read from torch's own structured trace (`torch._logging.trace_structured`, the records `TORCH_TRACE` writes and
tlparse reads): a handler on the ``torch.__trace`` logger for the duration of a phase. The records used:

- artifact ``dynamo_graph_break_reason``: "Graph break in user code at FILE:LINE", the reason as Dynamo gives it
  (its graph-break type and explanation) and the user code traceback;
- artifact ``recompile_reasons``: the guard that failed for each cache entry, e.g. "0/0: tensor 'input_ids' size
  mismatch at index 1. expected 5, actual 1" (the newest entry first);
- ``create_symbol``: a value made symbolic (a size, the KV cache's length): the recompile compiles a dynamic graph;
- ``compilation_metrics``: one per frame compile: the function (file, first line), seconds
  (`entire_frame_compile_time_s`), and `fail_reason` "Dynamo recompile limit exceeded" when Dynamo gave up on the
  frame (its later calls run in eager).

Each event is tagged with the phase call it happened in (`mark`). Nothing here changes what Dynamo does.
"""

from __future__ import annotations

import json
import logging
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Event", "TraceWatch", "short_path", "changed_input", "LIMIT_TEXT"]

TRACE_LOGGER = "torch.__trace"  # torch._logging's structured trace logger (never propagates)
LIMIT_TEXT = "Dynamo recompile limit exceeded"  # the graph-break type Dynamo gives up a frame with
# what `compilation_metrics.fail_reason` says when Dynamo gave up on a frame at its limit: torch ≥ 2.8 the graph-break
# type above; torch 2.7 `RecompileLimitExceeded("<limit_type> reached")` or its "Dynamo cache limit exceeded" break
_LIMIT_HIT = re.compile(r"^(?:Dynamo recompile limit exceeded|Dynamo cache limit exceeded|"
                        r"(?:accumulated_)?(?:recompile_limit|cache_size_limit) reached)")
_BREAK_AT = re.compile(r"Graph break in user code at (.+):(\d+)")
_OBJECT_ID = re.compile(r"(___check_(?:type|obj)_id\([^,]+, )\d+")
_IDS = {"frame_id", "frame_compile_id", "attempt", "compiled_autograd_id", "rank", "has_payload"}
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_CHANGED = (re.compile(r"\['([^']+)'\]"), re.compile(r"tensor '([^']+)'"), re.compile(r"___check_\w+\(([^,()]+)"),
            re.compile(r"^\S+: (\S+) (?:==|!=|is|<|>)"), re.compile(r"'([^']+)'"))


@dataclass
class Event:
    """One thing Dynamo reported: `kind` is ``graph_break``, ``recompile``, ``compile`` or ``limit``."""

    kind: str
    call: str  # the phase call (label) it happened in
    frame: str  # Dynamo's frame id / compile id, e.g. "0/1"
    reason: str = ""
    source: str = ""  # the user's file:line (short path)
    stack: list[tuple[str, int, str]] = field(default_factory=list)  # user frames (file, line, function)
    seconds: float = 0.0
    detail: str = ""
    dynamic: bool = False  # a recompile that made a size symbolic (automatic dynamic shapes)
    symbolic: list[str] = field(default_factory=list)  # what it made symbolic (`input_ids.size()[1]`, a cache length)
    at: str = ""  # a graph break's own place (torch's or the stdlib's code, where `source` is the user's frame above it)
    resized: list[str] = field(default_factory=list)  # a recompile's cache entries that failed on a size ("0/1")


def short_path(path: str) -> str:
    """`path` without the machine's prefix: from the site-packages folder down, else relative to the working
    folder, else its last three parts (a fingerprint must not hold a machine's path)."""
    p = str(path)
    for root in {sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")}:
        if root and p.startswith(root.rstrip("/") + "/"):
            return p[len(root.rstrip("/")) + 1:]
    try:
        return Path(p).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return "/".join(Path(p).parts[-3:])


def _library_roots() -> tuple[str, ...]:
    import torch  # deferred: only to find its folder

    return (str(Path(torch.__file__).resolve().parent) + "/", str(Path(sysconfig.get_paths()["stdlib"]).resolve()) + "/")


def user_frame_of(at: tuple[str, int] | None, stack: list[tuple[str, int, str]]) -> tuple[str, int] | None:
    """The user's frame of a graph break: where it happened unless that is in torch's or the stdlib's code, else the
    innermost frame of the user code traceback outside them (the line of the model that called into it)."""
    roots = _library_roots()

    def library(path: str) -> bool:
        return str(Path(path).resolve()).startswith(roots)

    if at is not None and not library(at[0]):
        return at
    for file, line, _fn in reversed(stack):
        if not library(file):
            return file, line
    return at


def changed_input(reason: str) -> str | None:
    """The input a guard failure names (`tensor 'x' size mismatch…` → ``x``), None when it names none."""
    for rx in _CHANGED:
        m = rx.search(reason.splitlines()[0] if reason else "")
        if m:
            return m.group(1)
    return None


def _first_line(text: str) -> str:
    """A guard failure's first line, its trailing `# user source` comment cut off."""
    line = (text.splitlines() or [""])[0].split("  #", 1)[0].strip()
    return _OBJECT_ID.sub(r"\1<id>", line)  # an ID_MATCH guard's object address differs every run


def _break_reason(payload: str) -> tuple[str, str]:
    """(reason, full text) of a graph-break artifact: the break type and its explanation, as Dynamo words them."""
    body = payload.split("Graph Break Reason:", 1)[-1].split("User code traceback:", 1)[0]
    lines = [ln.strip() for ln in body.strip().splitlines()]
    if lines and lines[0].startswith("Encountered graph break") and len(lines) > 1:
        lines = lines[1:]
    lines = [ln for ln in lines if ln]
    kind = lines[0] if lines else "graph break"
    why = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("Explanation:")), "")
    return (f"{kind}: {why}" if why else kind)[:500], "\n".join(lines)[:2000]


def _resized(reasons: list[Any]) -> list[str]:
    """The cache entries (Dynamo's "frame/compile" ids) whose first failed guard is a tensor size: the entry a
    dynamic recompile re-specialises (one frame can hold entries of several functions: a shared decorator's
    `wrapper` compiled once per decorated forward, told apart by a guard on the wrapped code object)."""
    out = []
    for r in reasons:
        m = re.match(r"\s*(\d+/\d+): (.*)", _first_line(str(r)))
        if m and "size mismatch" in m.group(2):
            out.append(m.group(1))
    return out


class TraceWatch:
    """`with TraceWatch() as w:` … `w.mark(label)` before each call; `w.events` afterwards."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.seen: set[str] = set()  # the kinds of record this torch gave (artifact names, metadata keys)
        self.call = ""
        self._first_source: dict[str, str] = {}  # frame id -> the compiled function's file:line
        self._logger = logging.getLogger(TRACE_LOGGER)
        self._saved_level = logging.NOTSET
        watch = self

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                try:
                    watch.take(getattr(record, "metadata", {}) or {}, getattr(record, "payload", None))
                except Exception:  # a record we cannot read costs that record, never the run  # noqa: BLE001
                    pass

        self._handler = _Keep(logging.DEBUG)

    def __enter__(self) -> "TraceWatch":
        self._saved_level = self._logger.level
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._saved_level)

    def mark(self, label: str) -> None:
        self.call = label

    def take(self, meta: dict[str, Any], payload: Any) -> None:
        """One structured record (its metadata and payload)."""
        frame = f"{meta.get('frame_id')}/{meta.get('frame_compile_id')}"
        art = meta.get("artifact") or {}
        self.seen.add(str(art.get("name")) if art else next((k for k in meta if k not in _IDS), "?"))
        if art.get("name") == "dynamo_graph_break_reason" and isinstance(payload, str):
            self._graph_break(frame, payload)
        elif art.get("name") == "recompile_reasons" and payload:
            reasons = json.loads(payload) if isinstance(payload, str) and payload[:1] in "[\"" else payload
            every = reasons if isinstance(reasons, list) else [reasons]
            text = str(every[0] if every else "").strip()
            self.events.append(Event("recompile", self.call, frame, reason=_first_line(text)[:500], detail=text[:2000],
                                     source=self._first_source.get(str(meta.get("frame_id")), ""),
                                     resized=_resized(every)))
        elif "create_symbol" in meta:
            self._symbol(frame, str((meta["create_symbol"] or {}).get("source", "")))
        elif "compilation_metrics" in meta:
            self._metrics(frame, str(meta.get("frame_id")), meta["compilation_metrics"] or {})

    def _symbol(self, frame: str, source: str) -> None:
        """A value made symbolic while recompiling: the recompile compiles a dynamic graph in it (a size, the KV
        cache's length). A tensor's `.item()` is a data-dependent value, not a length: left out."""
        last = next((e for e in reversed(self.events) if e.kind == "recompile" and e.frame == frame), None)
        if last is not None and source and not source.endswith(".item()"):
            last.dynamic = True
            name = re.sub(r"^L\['(?:args|kwargs)'\]", "", source)
            name = re.sub(r"^\['([^']+)'\]", r"\1", re.sub(r"^L\['([^']+)'\]", r"\1", name))
            if name not in last.symbolic:
                last.symbolic.append(name)

    def _graph_break(self, frame: str, payload: str) -> None:
        m = _BREAK_AT.search(payload)
        reason, detail = _break_reason(payload)
        user = payload.split("User code traceback:", 1)[-1].split("Traceback (most recent call last)", 1)[0]
        stack = [(f, int(n), fn) for f, n, fn in _FRAME.findall(user)]
        at = (m.group(1), int(m.group(2))) if m else None
        user_frame = user_frame_of(at, stack)
        source = f"{short_path(user_frame[0])}:{user_frame[1]}" if user_frame else ""
        self.events.append(Event("graph_break", self.call, frame, reason=reason, source=source, stack=stack,
                                 detail=detail, at=f"{short_path(at[0])}:{at[1]}" if at else ""))

    def _metrics(self, frame: str, frame_id: str, cm: dict[str, Any]) -> None:
        if cm.get("co_filename") and frame_id not in self._first_source:
            self._first_source[frame_id] = f"{short_path(cm['co_filename'])}:{cm.get('co_firstlineno')}"
        seconds = float(cm.get("entire_frame_compile_time_s") or 0.0)
        fail = str(cm.get("fail_reason") or "")
        if _LIMIT_HIT.search(fail):
            limit = re.search(r"currently set to (\d+)", fail)
            self.events.append(Event("limit", self.call, frame, reason=str(cm.get("recompile_reason") or "")[:500],
                                     source=self._first_source.get(frame_id, ""), seconds=seconds,
                                     detail=f"recompile_limit {limit.group(1)}" if limit else fail.split("\n")[0][:80]))
            return
        self.events.append(Event("compile", self.call, frame, reason=fail[:300], seconds=seconds,
                                 source=self._first_source.get(frame_id, "")))
