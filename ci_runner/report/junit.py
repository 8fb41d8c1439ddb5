"""`junit.xml`, shaped for the tools that read it: Jenkins (junit and xunit plugins, the latter
validating against its ``junit-10.xsd``), EnricoMi/publish-unit-test-result-action (junitparser),
dorny/test-reporter, mikepenz/action-junit-report and junit2html.

Built with ElementTree, never string templates. The mapping (docs/reports.md, "junit.xml"):

- ``<testsuites name="deepview-ci">`` with ``tests``/``failures``/``errors``/``time`` totals;
- one ``<testsuite name="<cell id>">`` per cell, with ``<properties>`` (model, backend, status,
  duration_s, artifacts_dir and the flattened env stamp ``env.torch``, ``env.device``, …);
- every test case of a cell has ``classname`` = the cell id with each ``.`` written ``·``
  (`classname`), so Jenkins, which splits a classname at its last dot, shows one cell as one class;
- per finding one ``<testcase name="<mode>: <kind> <op|module>">`` with a ``<failure>`` whose
  message is the finding's own headline and whose body holds the metrics and the repro;
- per mode without findings one ``<testcase name="<mode>">``: passed, ``<error>`` (error, timeout,
  crashed), ``<skipped>`` or, for a failed mode with no finding, ``<failure>``;
- a cell error (crash, timeout, setup failure) is told on the mode it hit; only a cell with no such
  mode gets a ``<testcase name="cell">`` of its own.

So tests = findings + modes without findings (+ a ``cell`` case), failures = findings (+ failed modes
without findings), errors = modes that errored, timed out or crashed (+ cell errors no mode carries),
skipped = skipped modes and skipped cells. `junit_counts` computes these for summary.md.

No ``file`` attribute (Jenkins' schema has none, and mikepenz would glob an unrelated file): repro
paths are in the failure body. Case times never overlap: a suite's time is the sum of its cases'.

Characters that XML 1.0 cannot carry (NUL, most C0 controls, lone surrogates, U+FFFE/U+FFFF)
become visible ``\\xNN`` escapes.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Mapping

from ..fsutil import atomic_write_chunks
from ..registry import mode_hooks
from ..results.model import CellError, Results
from ..failures.failure import headline
from .view import CellView, FindingView, ReportView, build_view

_ILLEGAL_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
MESSAGE_LIMIT = 1000  # characters in a `message` attribute; the full text goes in the body
BODY_LIMIT = 64_000


def xml_safe(text: Any) -> str:
    """`text` as a string XML 1.0 can hold: illegal characters become ``\\xNN``/``\\uNNNN`` escapes."""
    s = str(text) if text is not None else ""

    def esc(m: re.Match[str]) -> str:
        o = ord(m.group())
        return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}"

    return _ILLEGAL_XML.sub(esc, s)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 40] + f"\n… [{len(text) - limit + 40} characters cut]"


def _sub(parent: ET.Element, tag: str, attrs: Mapping[str, Any] | None = None, text: str | None = None) -> ET.Element:
    # Text is made XML-safe once, on the serialized document (`render_junit`): the escapes are
    # plain ASCII, so replacing illegal characters after serialization is the same and much faster.
    el = ET.SubElement(parent, tag, {k: str(v) for k, v in (attrs or {}).items() if v is not None})
    if text:
        el.text = _clip(text, BODY_LIMIT)
    return el


def _timestamp(text: str | None) -> str | None:
    """An ISO 8601 `xs:dateTime` for `timestamp`, or None when `text` is not one."""
    if not text:
        return None
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return dt.isoformat(timespec="seconds")


def _time(seconds: float) -> str:
    return f"{max(0.0, float(seconds or 0.0)):.3f}"


def _finding_body(fv: FindingView, cell_dir: str) -> str:
    f = fv.finding
    lines = [f.message.rstrip(), ""]
    lines.append(f"kind: {f.kind}   stage: {f.stage}   fingerprint: {f.fingerprint}")
    if f.op:
        lines.append(f"op: {f.op}")
    if f.module:
        lines.append(f"module: {f.module}" + (f" ({f.module_class})" if f.module_class else ""))
    if f.error_type:
        lines.append(f"error type: {f.error_type}")
    if fv.metrics_text:
        lines.append(f"metrics: {fv.metrics_text}")
    if fv.repro:
        lines.append(f"repro: {fv.repro} ({'verified' if fv.verified else 'not verified'})")
        if fv.command:
            lines.append(f"run it from the cell folder {cell_dir}: {fv.command}")
    return "\n".join(lines)


CLASS_DOT = "·"  # stands for "." in classnames: Jenkins splits a classname at its last dot
ERROR_STATUSES = ("error", "timeout", "crashed")


def classname(cell_id: str) -> str:
    """The classname of a cell's cases: its id with dots written ``·`` (``qwen2.5@x`` → ``qwen2·5@x``)."""
    return cell_id.replace(".", CLASS_DOT)


@dataclass(frozen=True)
class Case:
    """One ``<testcase>``: `outcome` is None (passed), ``failure``, ``error`` or ``skipped``."""

    name: str
    time: float = 0.0
    outcome: str | None = None
    message: str = ""
    type: str | None = None
    body: str | None = None
    out: str | None = None  # system-out


def _error_body(e: CellError) -> str:
    body = [e.message]
    if e.exit_code is not None:
        body.append(f"exit code: {e.exit_code}")
    if e.signal:
        body.append(f"signal: {e.signal}")
    if e.last_module:
        body.append(f"last module entered: {e.last_module}")
    if e.stderr_tail:
        body += ["", "stderr (tail):", e.stderr_tail]
    return "\n".join(body)


def _error_carrier(cv: CellView) -> str | None:
    """The mode that tells the cell's error: the one whose reason is that error, else the first that
    crashed, timed out or errored."""
    e = cv.cell.error
    if e is None:
        return None
    bad = [m for m, st in cv.modes.items() if st in ERROR_STATUSES]
    same = [m for m in bad if (cv.cell.modes[m].reason or "") == e.message]
    return (same or [m for m in bad if cv.modes[m] == e.type] or bad or [None])[0]


def cell_cases(cv: CellView, *, detail: bool = True) -> list[Case]:
    """The test cases of one cell, in execution order (see the module docstring for the mapping).

    Without `detail`, bodies are left out (enough for counting)."""
    c = cv.cell
    modes = {m: st for m, st in cv.modes.items() if st is not None}
    rest = max(0.0, (c.duration_s or 0.0) - sum(c.modes[m].duration_s or 0.0 for m in modes))
    carrier = _error_carrier(cv)
    by_mode: dict[str, list[FindingView]] = {}
    for fv in cv.findings:
        by_mode.setdefault(fv.mode, []).append(fv)
    cell_dir = c.artifacts_dir or f"cells/{c.id}"
    cases: list[Case] = []
    e = c.error
    if e is not None and carrier is None:
        cases.append(Case("cell", rest, "error", headline(e.message, 400) or f"cell {c.status}", e.type,
                          _error_body(e) if detail else None))
        rest = 0.0
    elif not modes:
        if c.status == "skipped":
            cases.append(Case("cell", rest, "skipped", "cell skipped"))
        elif c.status != "pass":
            cases.append(Case("cell", rest, "error", f"cell {c.status} without mode results", c.status))
        else:
            cases.append(Case("cell", rest))
        rest = 0.0
    for mname, status in modes.items():
        mode = c.modes[mname]
        t = (mode.duration_s or 0.0) + (rest if mname == carrier else 0.0)
        verdict = None
        if cv.numerics and mname == cv.numerics.mode and cv.numerics.verdict.get("text"):
            verdict = str(cv.numerics.verdict["text"])
        mine = by_mode.get(mname, [])
        if status in ERROR_STATUSES:
            if mname == carrier and e is not None:
                msg = headline(e.message, 400)
                body = (_error_body(e) if detail else None)
                cases.append(Case(mname, t, "error", msg, e.type, body, verdict))
            else:
                msg = headline(mode.reason or "", 400) or f"{mname} {status}"
                cases.append(Case(mname, t, "error", msg, status, mode.reason or None, verdict))
            t, verdict = 0.0, None
        elif status == "skipped":
            cases.append(Case(mname, t, "skipped", headline(mode.reason or "", 400) or f"{mname} skipped"))
            t = 0.0
        elif status == "inconclusive" and not mine:  # the backend did not run everything: never a pass
            cases.append(Case(mname, t, "skipped", "inconclusive: " + (headline(mode.reason or "", 400) or
                                                                      "the backend did not run everything")))
            t = 0.0
        elif not mine:
            if status == "fail":
                cases.append(Case(mname, t, "failure", headline(mode.reason or "", 400) or f"{mname} failed",
                                  "fail", mode.reason or None, verdict))
            else:
                cases.append(Case(mname, t, out=verdict))
            continue
        for fv in mine:
            f = fv.finding
            cases.append(Case(f"{mname}: {f.kind} {fv.title}", t, "failure", fv.summary or f.kind,
                              f.error_type or f.kind, _finding_body(fv, cell_dir) if detail else None, verdict))
            t, verdict = 0.0, None
    return cases


def junit_counts(view: ReportView) -> dict[str, int]:
    """``tests``, ``failures``, ``errors`` and ``skipped`` as junit.xml states them."""
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for cv in view.cells:
        for case in cell_cases(cv, detail=False):
            out["tests"] += 1
            if case.outcome == "failure":
                out["failures"] += 1
            elif case.outcome == "error":
                out["errors"] += 1
            elif case.outcome == "skipped":
                out["skipped"] += 1
    return out


def _cell_suite(root: ET.Element, cv: CellView) -> dict[str, Any]:
    c = cv.cell
    cases = cell_cases(cv)
    counts = {"tests": len(cases), "failures": 0, "errors": 0, "skipped": 0}
    for case in cases:
        if case.outcome:
            counts[{"failure": "failures", "error": "errors", "skipped": "skipped"}[case.outcome]] += 1
    times = [_time(case.time) for case in cases]
    total = sum(float(t) for t in times)
    attrs: dict[str, Any] = {"name": c.id, **{k: str(v) for k, v in counts.items()}, "time": _time(total)}
    attrs["timestamp"] = _timestamp(c.started_at)
    attrs["hostname"] = cv.env.get("hostname")
    suite = _sub(root, "testsuite", attrs)
    props = _sub(suite, "properties")
    fixed = [("model", c.model), ("backend", c.backend), ("status", c.status), ("device", cv.env.get("device")),
             ("duration_s", f"{c.duration_s or 0.0:.3f}"), ("artifacts_dir", c.artifacts_dir),
             ("parallel", cv.layout)]
    modes = [p for _, h in mode_hooks() for p in h.junit_properties(c)]  # each mode's own (registry.ModeHooks)
    for k, v in fixed + [(f"env.{k}", v) for k, v in cv.env.items()] + modes:
        if v is not None:
            _sub(props, "property", {"name": k, "value": v})
    cls = classname(c.id)
    seen: set[str] = set()
    for case, t in zip(cases, times):
        name, n = case.name, 2
        while name in seen:  # reporters merge same-named cases: keep them apart
            name, n = f"{case.name} #{n}", n + 1
        seen.add(name)
        el = ET.SubElement(suite, "testcase", {"classname": cls, "name": name, "time": t})
        if case.outcome:
            _sub(el, case.outcome, {"message": _clip(case.message, MESSAGE_LIMIT), "type": case.type}, case.body)
        if case.out:
            _sub(el, "system-out", None, case.out)
    return {**counts, "time": total}


def _totals(cells: list[CellView]) -> tuple[dict[str, int], float]:
    """The root's `tests`/`failures`/`errors` and `time`: the sums of what each suite states."""
    totals = {"tests": 0, "failures": 0, "errors": 0}
    time = 0.0
    for cv in cells:
        cases = cell_cases(cv, detail=False)
        totals["tests"] += len(cases)
        totals["failures"] += sum(1 for case in cases if case.outcome == "failure")
        totals["errors"] += sum(1 for case in cases if case.outcome == "error")
        time += sum(float(_time(case.time)) for case in cases)
    return totals, time


def _root(name: str, totals: Mapping[str, int], time: float) -> ET.Element:
    root = ET.Element("testsuites", {"name": name})
    for k, v in totals.items():  # Jenkins' schema has no `skipped` here: readers sum the suites'
        root.set(k, str(v))
    root.set("time", _time(time))
    return root


def build_junit(view: ReportView, *, name: str = "deepview-ci") -> ET.ElementTree:
    cells = sorted(view.cells, key=lambda c: c.id)
    root = _root(name, *_totals(cells))
    for cv in cells:
        _cell_suite(root, cv)
    return ET.ElementTree(root)


_INSIDE = "\ue000"  # a stand-in for the root's children while its start tag is serialized


def junit_chunks(view: ReportView, *, name: str = "deepview-ci") -> Iterator[str]:
    """The junit.xml text (`build_junit`, indented), one suite at a time: a suite is built, serialized and dropped,
    so a run of many cells never holds the whole tree nor the whole text."""
    cells = sorted(view.cells, key=lambda c: c.id)
    root = _root(name, *_totals(cells))
    yield "<?xml version='1.0' encoding='utf-8'?>\n"
    if not cells:
        yield xml_safe(ET.tostring(root, encoding="unicode")) + "\n"
        return
    root.text = _INSIDE
    start, end = xml_safe(ET.tostring(root, encoding="unicode")).split(_INSIDE)
    yield start + "\n  "
    for i, cv in enumerate(cells):
        holder = ET.Element("testsuites")
        _cell_suite(holder, cv)
        suite = holder[0]
        ET.indent(suite, space="  ", level=1)
        suite.tail = "\n  " if i < len(cells) - 1 else "\n"
        yield xml_safe(ET.tostring(suite, encoding="unicode"))
    yield end + "\n"


def render_junit(results: Results, *, out_dir: Path | None = None, run_dir: Path | None = None,
                 view: ReportView | None = None) -> bytes:
    """The junit.xml bytes (UTF-8, with an XML declaration)."""
    v = view or build_view(results, out_dir=out_dir, run_dir=run_dir)
    return "".join(junit_chunks(v)).encode("utf-8")


def write_junit(results: Results, path: Path, *, run_dir: Path | None = None, view: ReportView | None = None) -> Path:
    v = view or build_view(results, out_dir=path.parent, run_dir=run_dir)
    return atomic_write_chunks(path, junit_chunks(v))
