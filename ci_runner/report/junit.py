"""`junit.xml`: one ``<testsuite>`` per cell, test cases per mode, per finding and per crash.

Built with ElementTree, never string templates. The layout, read by the common GitHub reporters
(EnricoMi/publish-unit-test-result-action, dorny/test-reporter, mikepenz/action-junit-report):

- ``<testsuites name="deepview-ci">`` with totals;
- per cell ``<testsuite name="<model>@<backend>">`` with ``<properties>``: model, backend, status,
  artifacts folder and the flattened env stamp (``env.torch``, ``env.device``, …);
- ``<testcase classname="<cell>" name="mode ops">``: ``<failure>`` when the mode found something,
  ``<error>`` when it errored, timed out or crashed, ``<skipped>`` with the reason;
- ``<testcase classname="<cell>.<mode>" name="<kind> <op|module>" file="<repro>">`` per finding,
  each a ``<failure>`` whose body holds the message, the metrics and the repro path;
- ``<testcase classname="<cell>" name="cell">`` with ``<error>`` when the cell process itself died.

Characters that XML 1.0 cannot carry (NUL, most C0 controls, lone surrogates, U+FFFE/U+FFFF)
become visible ``\\xNN`` escapes.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping

from ..fsutil import atomic_write_bytes
from ..results import Results
from .view import CellView, FindingView, ReportView, build_view, first_line

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


def _finding_body(fv: FindingView) -> str:
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
        if f.repro and f.repro.command:
            lines.append(f"run: {f.repro.command}")
    return "\n".join(lines)


class _Suite:
    def __init__(self, el: ET.Element) -> None:
        self.el = el
        self.tests = self.failures = self.errors = self.skipped = 0
        self.names: set[tuple[str, str]] = set()

    def case(self, classname: str, name: str, time: float = 0.0, file: str | None = None) -> ET.Element:
        base, n = name, 2
        while (classname, name) in self.names:  # reporters merge same-named cases: keep them apart
            name, n = f"{base} #{n}", n + 1
        self.names.add((classname, name))
        self.tests += 1
        return _sub(self.el, "testcase", {"classname": classname, "name": name, "time": _time(time), "file": file})

    def fail(self, case: ET.Element, tag: str, message: str, type_: str | None, body: str | None) -> None:
        if tag == "failure":
            self.failures += 1
        elif tag == "error":
            self.errors += 1
        else:
            self.skipped += 1
        _sub(case, tag, {"message": _clip(message, MESSAGE_LIMIT), "type": type_}, body)


def _cell_suite(root: ET.Element, cv: CellView) -> _Suite:
    c = cv.cell
    attrs = {"name": c.id, "tests": "0", "failures": "0", "errors": "0", "skipped": "0", "time": _time(c.duration_s)}
    if _timestamp(c.started_at):
        attrs["timestamp"] = _timestamp(c.started_at)
    if cv.env.get("hostname"):
        attrs["hostname"] = cv.env["hostname"]
    suite = _Suite(_sub(root, "testsuite", attrs))
    props = _sub(suite.el, "properties")
    fixed = [("model", c.model), ("backend", c.backend), ("status", c.status), ("device", cv.env.get("device")),
             ("artifacts_dir", c.artifacts_dir)]
    for k, v in fixed + [(f"env.{k}", v) for k, v in cv.env.items()]:
        if v is not None:
            _sub(props, "property", {"name": k, "value": v})

    if c.error is not None:
        e = c.error
        case = suite.case(c.id, "cell", c.duration_s)
        body = [e.message]
        if e.exit_code is not None:
            body.append(f"exit code: {e.exit_code}")
        if e.signal:
            body.append(f"signal: {e.signal}")
        if e.last_module:
            body.append(f"last module entered: {e.last_module}")
        if e.stderr_tail:
            body += ["", "stderr (tail):", e.stderr_tail]
        suite.fail(case, "error", f"cell {c.status}: {first_line(e.message, 400)}", e.type, "\n".join(body))
    elif not c.modes:
        case = suite.case(c.id, "cell", c.duration_s)
        if c.status == "skipped":
            suite.fail(case, "skipped", "cell skipped", None, None)
        elif c.status != "pass":
            suite.fail(case, "error", f"cell {c.status} without mode results", c.status, None)

    for mname, status in cv.modes.items():
        if status is None:
            continue
        mode = c.modes[mname]
        case = suite.case(c.id, f"mode {mname}", mode.duration_s)
        mine = [f for f in cv.findings if f.mode == mname]
        if status == "fail":
            listing = "\n".join(f"- {f.finding.kind} {f.title}: {f.summary}" for f in mine)
            suite.fail(case, "failure", f"{mname}: {len(mine)} finding(s)" + (f"; first: {mine[0].title}" if mine else ""),
                       "findings", listing or (mode.reason or None))
        elif status in ("error", "timeout", "crashed"):
            suite.fail(case, "error", f"{mname} {status}" + (f": {first_line(mode.reason)}" if mode.reason else ""),
                       status, mode.reason)
        elif status == "skipped":
            suite.fail(case, "skipped", mode.reason or f"{mname} skipped", None, None)
        if mname == "numerics" and cv.numerics and cv.numerics.verdict.get("text"):
            _sub(case, "system-out", None, str(cv.numerics.verdict["text"]))

    for fv in cv.findings:
        f = fv.finding
        case = suite.case(f"{c.id}.{fv.mode}", f"{f.kind} {fv.title}", 0.0, fv.repro)
        suite.fail(case, "failure", fv.summary or f.kind, f.error_type or f.kind, _finding_body(fv))

    for key, val in (("tests", suite.tests), ("failures", suite.failures), ("errors", suite.errors), ("skipped", suite.skipped)):
        suite.el.set(key, str(val))
    return suite


def build_junit(view: ReportView, *, name: str = "deepview-ci") -> ET.ElementTree:
    root = ET.Element("testsuites", {"name": name})
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    time = 0.0
    for cv in sorted(view.cells, key=lambda c: c.id):
        s = _cell_suite(root, cv)
        totals["tests"] += s.tests
        totals["failures"] += s.failures
        totals["errors"] += s.errors
        totals["skipped"] += s.skipped
        time += cv.cell.duration_s or 0.0
    for k, v in totals.items():
        root.set(k, str(v))
    root.set("time", _time(time))
    return ET.ElementTree(root)


def render_junit(results: Results, *, out_dir: Path | None = None, run_dir: Path | None = None,
                 view: ReportView | None = None) -> bytes:
    """The junit.xml bytes (UTF-8, with an XML declaration)."""
    v = view or build_view(results, out_dir=out_dir, run_dir=run_dir)
    tree = build_junit(v)
    ET.indent(tree, space="  ")
    text = xml_safe(ET.tostring(tree.getroot(), encoding="unicode"))
    return ("<?xml version='1.0' encoding='utf-8'?>\n" + text + "\n").encode("utf-8")


def write_junit(results: Results, path: Path, *, run_dir: Path | None = None, view: ReportView | None = None) -> Path:
    return atomic_write_bytes(path, render_junit(results, out_dir=path.parent, run_dir=run_dir, view=view))
