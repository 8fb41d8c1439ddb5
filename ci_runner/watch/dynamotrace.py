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

The records themselves are kept too (`KeptTrace`, up to `keep_bytes`), each written as torch's `TORCH_TRACE` handler
writes it (`trace_line`: a glog-style prefix, the metadata as one JSON object, each payload line after a tab), so
that `write_trace` leaves a `dedicated_log_torch_trace_*.log` file tlparse reads. The file starts with the strings
torch interned before the watch began (`{"str": [text, index]}` records: later stack frames name their files by
index) and the torch version, as a fresh `TORCH_TRACE` file does; a record that does not fit under the cap is left
out and counted (never a part of one).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from ..fsutil import atomic_write_chunks

__all__ = ["Event", "TraceWatch", "KeptTrace", "trace_line", "write_trace", "short_path", "changed_input",
           "LIMIT_TEXT", "TRACE_FILE_PREFIX", "KEEP_BYTES"]

TRACE_LOGGER = "torch.__trace"  # torch._logging's structured trace logger (never propagates)
TRACE_FILE_PREFIX = "dedicated_log_torch_trace_"  # the names TORCH_TRACE's files have and tlparse looks for
KEEP_BYTES = 16 * 2**20  # records kept per watch unless the caller says otherwise
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


@functools.lru_cache(maxsize=512)
def _module_path(path: str) -> str:
    """A record's source file as torch's own trace formatter writes it (relative to the first `sys.path` entry that
    holds it: `.venv/lib/…/torch/…` when the venv sits in the working folder), once per file (records come by the
    thousand); `short_path` on a torch without that helper."""
    try:
        from torch._logging._internal import make_module_path_relative  # deferred: torch's, private, may move
    except ImportError:
        return short_path(path)
    return make_module_path_relative(path)


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


def trace_line(metadata: Any, payload: str | None, *, created: float, pid: int, pathname: str, lineno: int,
               msecs: float | None = None) -> str:
    """One structured record as torch's `TORCH_TRACE` handler writes it (`TorchLogsFormatter(trace=True)`):
    ``V<MMDD HH:MM:SS.micro> <pid> <path>:<line>] <metadata JSON>``, then each payload line after a newline and a
    tab, then a newline. `msecs`: the log record's own (its fraction of a second, as that formatter reads it)."""
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(created))
    micros = int((msecs if msecs is not None else (created - int(created)) * 1000) * 1000)
    line = f"V{stamp}.{micros:06d} {pid} {_module_path(pathname)}:{lineno}] {json.dumps(metadata, default=repr)}"
    if payload is not None:
        line += "".join(f"\n\t{part}" for part in payload.split("\n"))
    return line + "\n"


@dataclass
class KeptTrace:
    """The records of one watch as trace lines: `head` (the interned strings and the torch version a fresh file
    starts with), then `lines` while they fit in `cap` bytes; `left_out` records (`left_out_bytes`) did not."""

    cap: int
    head: list[str] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    size: int = 0
    left_out: int = 0
    left_out_bytes: int = 0

    def add(self, line: str, *, always: bool = False) -> None:
        """One record; `always`: an interned string (later records name files by its index), kept past the cap."""
        n = len(line.encode("utf-8", "replace"))
        if always or self.size + n <= self.cap:
            self.lines.append(line)
            self.size += n
        else:
            self.left_out += 1
            self.left_out_bytes += n

    def chunks(self) -> Iterator[str]:
        yield from self.head
        yield from self.lines

    @property
    def records(self) -> int:
        return len(self.head) + len(self.lines)


def _head_lines() -> list[str]:
    """What a fresh `TORCH_TRACE` file holds before its first record: the strings torch interned earlier in this
    process (`torch._logging.structured.INTERN_TABLE`, feature-detected) and the torch version artifact."""
    import torch  # deferred: only for its version and its intern table

    now, pid = time.time(), os.getpid()
    here = str(Path(__file__))
    table = getattr(getattr(getattr(torch, "_logging", None), "structured", None), "INTERN_TABLE", None)
    lines = [trace_line({"str": [text, index]}, None, created=now, pid=pid, pathname=here, lineno=0)
             for text, index in (table.items() if isinstance(table, dict) else ())]
    payload = json.dumps({"pytorch_version": torch.__version__, "oss": True}, indent=0)
    meta = {"artifact": {"name": "torch_version", "encoding": "json"},
            "has_payload": hashlib.md5(payload.encode("utf-8"), usedforsecurity=False).hexdigest()}
    return lines + [trace_line(meta, payload, created=now, pid=pid, pathname=here, lineno=0)]


def write_trace(path: Path, kept: KeptTrace, *, cap: int | None = None) -> dict[str, Any]:
    """`kept` written atomically to `path` (a `dedicated_log_torch_trace_*.log` name), cut again to `cap` bytes when
    given: {"file": name, "records", "bytes", "left_out", "left_out_bytes"} (`left_out` only when records were)."""
    if cap is not None and cap < kept.size:
        recut = KeptTrace(cap=cap, head=list(kept.head), left_out=kept.left_out, left_out_bytes=kept.left_out_bytes)
        for line in kept.lines:
            recut.add(line, always=line.split("] ", 1)[-1].startswith('{"str":'))
        kept = recut
    atomic_write_chunks(path, kept.chunks(), sync=False)
    out: dict[str, Any] = {"file": path.name, "records": kept.records,
                           "bytes": sum(len(x.encode("utf-8", "replace")) for x in kept.head) + kept.size}
    if kept.left_out:
        out.update(left_out=kept.left_out, left_out_bytes=kept.left_out_bytes)
    return out


class TraceWatch:
    """`with TraceWatch() as w:` … `w.mark(label)` before each call; `w.events` afterwards, and `w.kept` the records
    as trace lines (up to `keep_bytes`; 0 keeps none)."""

    def __init__(self, *, keep_bytes: int = KEEP_BYTES) -> None:
        self.events: list[Event] = []
        self.seen: set[str] = set()  # the kinds of record this torch gave (artifact names, metadata keys)
        self.call = ""
        self.kept: KeptTrace | None = KeptTrace(cap=keep_bytes) if keep_bytes > 0 else None
        self._first_source: dict[str, str] = {}  # frame id -> the compiled function's file:line
        self._logger = logging.getLogger(TRACE_LOGGER)
        self._saved_level = logging.NOTSET
        watch = self

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                meta, payload = getattr(record, "metadata", {}) or {}, getattr(record, "payload", None)
                try:
                    watch.take(meta, payload)
                except Exception:  # a record we cannot read costs that record, never the run  # noqa: BLE001
                    pass
                try:
                    watch.keep(record, meta, payload)
                except Exception:  # nor one we cannot write  # noqa: BLE001
                    pass

        self._handler = _Keep(logging.DEBUG)

    def __enter__(self) -> "TraceWatch":
        if self.kept is not None and not self.kept.head:
            try:
                self.kept.head = _head_lines()
            except Exception:  # the file then starts without them; tlparse still reads it  # noqa: BLE001
                self.kept.head = []
        self._saved_level = self._logger.level
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self._handler)
        return self

    def keep(self, record: logging.LogRecord, meta: Any, payload: Any) -> None:
        """One record as its trace line, into `kept`."""
        if self.kept is None:
            return
        line = trace_line(meta, payload if isinstance(payload, str) else None, created=record.created,
                          pid=record.process or os.getpid(), pathname=record.pathname, lineno=record.lineno,
                          msecs=record.msecs)
        self.kept.add(line, always=isinstance(meta, dict) and "str" in meta)

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
