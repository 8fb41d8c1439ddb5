"""report.html in a real headless browser (Debian's chromium), driven over the DevTools protocol.

The page must load with no script error, no console error, no CSP violation and no request other
than the file itself; its charts must be there, drawn with a real size, one line per view with a
point per layer, the flagged layers marked; the metric tabs must switch charts.

Chromium is talked to over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out, NUL-separated JSON),
so no websocket library or port is needed. Without chromium the test is skipped locally and fails
under CI (``CI`` set), so a missing install step cannot hide.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ci_runner.report import write_reports
from ci_runner.results.model import Results, load_results
from tests.fixtures.results_factory import example_results

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    msg = "no chromium on PATH (apt-get install chromium)"
    if os.environ.get("CI"):
        pytest.fail(msg + ": the browser test must run in CI")
    pytest.skip(msg)


class DevTools:
    """A minimal Chrome DevTools Protocol client over ``--remote-debugging-pipe``."""

    def __init__(self, binary: str, profile: Path) -> None:
        to_r, self._to_w = os.pipe()
        self._from_r, from_w = os.pipe()
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]
        script = f'exec "$@" 3<&{to_r} 4>&{from_w}'
        self.proc = subprocess.Popen(["bash", "-c", script, "chromium", *args], pass_fds=(to_r, from_w),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_r)
        os.close(from_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("chromium did not answer in time")
            ready, _, _ = select.select([self._from_r], [], [], left)
            if ready:
                chunk = os.read(self._from_r, 1 << 16)
                if not chunk:
                    err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                    raise RuntimeError(f"chromium closed the pipe: {err[-2000:]}")
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None,
             timeout: float = 30.0) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        for e in self.events:
            if e.get("method") == method:
                return e
        deadline = time.monotonic() + timeout
        while True:
            e = self._read_message(deadline)
            self.events.append(e)
            if e.get("method") == method:
                return e

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        try:
            while True:
                self.events.append(self._read_message(deadline))
        except TimeoutError:
            pass

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_w, self._from_r):
            try:
                os.close(fd)
            except OSError:
                pass


CHECK_JS = r"""
(() => {
  const root = document.documentElement;
  const visible = [...document.querySelectorAll("svg.chart")].filter(s => !s.classList.contains("hidden"));
  const charts = visible.map(s => {
    const r = s.getBoundingClientRect();
    const lines = [...s.querySelectorAll("polyline.line")].map(p => ({
      view: p.getAttribute("data-view"), points: p.points.numberOfItems, length: p.getTotalLength()}));
    return {cell: s.dataset.cell, metric: s.dataset.metric, layers: +s.dataset.layers, flagged: +s.dataset.flagged,
            width: r.width, height: r.height, lines,
            marks: s.querySelectorAll(".flag").length, thr: s.querySelectorAll("path.thr").length,
            first: s.querySelectorAll("line.first").length};
  });
  // switch every chart box to its second metric, then read what is shown
  const boxes = [...document.querySelectorAll(".chartbox")];
  boxes.forEach(b => b.querySelectorAll(".tabs button")[1].click());
  const switched = boxes.map(b => [...b.querySelectorAll("svg.chart")]
      .filter(s => getComputedStyle(s).display !== "none").map(s => s.dataset.metric));
  return JSON.stringify({ready: root.dataset.ready, errors: root.dataset.errors, count: +root.dataset.charts,
                         charts, switched, title: document.title,
                         rows: document.querySelectorAll("#cells tbody tr").length});
})()
"""


def load_in_browser(page: Path, tmp_path: Path, probe: str | None = None, *, width: int | None = None) -> dict[str, Any]:
    """Open `page` in headless chromium; assert it loaded cleanly and offline; return CHECK_JS's answer
    (with `probe`'s JSON answer under "probe" when given: it runs after the load, errors still count).
    `width`: the viewport's width in CSS pixels (a screen of that size; its screenshot is `report-<width>.png`)."""
    dt = DevTools(_browser(), tmp_path / f"profile-{width or 'default'}")
    try:
        target = dt.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = dt.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            dt.send(f"{domain}.enable", session=session)
        if width is not None:
            dt.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": 900, "deviceScaleFactor": 1,
                                                            "mobile": width < 600}, session=session)
        dt.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
        dt.wait_for("Page.loadEventFired", timeout=60)
        dt.drain(0.3)
        result = dt.send("Runtime.evaluate", {"expression": CHECK_JS, "returnByValue": True}, session=session)
        assert "exceptionDetails" not in result, result
        info = json.loads(result["result"]["value"])
        if probe is not None:
            answer = dt.send("Runtime.evaluate", {"expression": probe, "returnByValue": True}, session=session,
                             timeout=90)
            assert "exceptionDetails" not in answer, answer
            info["probe"] = json.loads(answer["result"]["value"])
            dt.drain(0.3)
            info["errors"] = dt.send("Runtime.evaluate", {"expression": "document.documentElement.getAttribute('data-errors') || '0'",
                                                          "returnByValue": True}, session=session, timeout=90)["result"]["value"]
        shot = dt.send("Page.captureScreenshot", {"format": "png"}, session=session)
        (tmp_path / "report.png").write_bytes(base64.b64decode(shot["data"]))
        if width is not None:
            (tmp_path / f"report-{width}.png").write_bytes(base64.b64decode(shot["data"]))
        dt.drain(0.2)
    finally:
        dt.close()

    exceptions = [e for e in dt.events if e.get("method") == "Runtime.exceptionThrown"]
    console_errors = [e for e in dt.events if e.get("method") == "Runtime.consoleAPICalled"
                      and e["params"].get("type") in ("error", "assert")]
    log_errors = [e for e in dt.events if e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error"]
    requests = [e["params"]["request"]["url"] for e in dt.events if e.get("method") == "Network.requestWillBeSent"]
    assert not exceptions, exceptions
    assert not console_errors, console_errors
    assert not log_errors, log_errors
    assert all(u.startswith("file:") for u in requests), f"the page fetched something: {requests}"
    assert info["ready"] == "1" and info["errors"] == "0", info
    assert (tmp_path / "report.png").stat().st_size > 10_000
    return info


def check_charts(results: Results, info: dict[str, Any]) -> None:
    """Every numerics table is charted: both views, a point per layer, every flagged layer marked."""
    expected = [c for c in results.cells if c.modes.get("numerics") and c.modes["numerics"].data.get("layers")]
    assert info["rows"] == len(results.cells)
    assert info["count"] == 3 * len(expected)  # one chart per metric per cell
    charts = info["charts"]
    assert {c["cell"] for c in charts} == {c.id for c in expected} and len(charts) == len(expected)
    for ch in charts:
        cell = results.cell(ch["cell"])
        assert cell is not None
        layers = cell.modes["numerics"].data["layers"]
        assert ch["metric"] == "rel" and ch["layers"] == len(layers)
        assert ch["width"] > 300 and ch["height"] > 100, ch
        assert {ln["view"] for ln in ch["lines"]} == {"cumulative", "isolated"}
        assert all(ln["points"] == len(layers) and ln["length"] > 0 for ln in ch["lines"]), ch["lines"]
        n_flags = sum(bool(r["flagged_cumulative"]) + bool(r["flagged_isolated"]) for r in layers)
        assert ch["marks"] == n_flags == ch["flagged"] + sum(bool(r["flagged_cumulative"] and r["flagged_isolated"]) for r in layers)
        assert ch["thr"] >= 1
        verdict = cell.modes["numerics"].data.get("verdict") or {}
        names = {r.get("name") for r in layers}
        assert ch["first"] == (1 if verdict.get("first_divergent") in names else 0)
    assert all(shown == ["cos"] for shown in info["switched"]), info["switched"]


@pytest.mark.timeout(120)
def test_example_matrix_report_in_headless_chromium(tmp_path: Path) -> None:
    _browser()
    results = example_results()
    run = tmp_path / "run"
    paths = write_reports(results, run / "report", run_dir=run, env={})
    info = load_in_browser(paths["html"], tmp_path)
    check_charts(results, info)
    assert any(ch["marks"] for ch in info["charts"]), "some example cell must have flagged layers"


OPEN_LAZY_JS = r"""
(() => {
  const boxes = [...document.querySelectorAll("details.lazy")];
  boxes.forEach(b => { b.open = true; b.dispatchEvent(new Event("toggle")); });
  return JSON.stringify({boxes: boxes.length,
    findings: [...document.querySelectorAll("details.lazy[data-kind=findings] tbody tr")].length,
    layers: [...document.querySelectorAll("details.lazy[data-kind=layers] tbody tr")].length,
    first: (document.querySelector("details.lazy[data-kind=findings] tbody tr") || {}).textContent || ""});
})()
"""


LAYOUT_JS = r"""
(() => {
  const root = document.documentElement, vw = root.clientWidth;
  const page = Math.max(root.scrollWidth, document.body.scrollWidth) - vw;
  // boxes that scroll sideways inside themselves (a wide table in its section)
  const inner = [...document.querySelectorAll("section, pre, table, .chartbox, .cell, header")]
      .filter(e => e.clientWidth > 0 && e.scrollWidth > e.clientWidth + 1)
      .map(e => `${e.tagName}#${e.id}.${e.className}: ${e.scrollWidth} > ${e.clientWidth}`);
  // anything drawn past the right edge of the screen
  const past = [...document.body.querySelectorAll("*")].filter(e => {
      const r = e.getBoundingClientRect(); return r.width > 0 && r.right > vw + 1; })
      .slice(0, 8).map(e => `${e.tagName}.${e.className.baseVal ?? e.className}`);
  const links = [...document.querySelectorAll("a.repro")].map(a =>
      decodeURIComponent(new URL(a.getAttribute("href"), location.href).pathname));
  const charts = [...document.querySelectorAll("svg.chart, svg.trend")].map(s => s.getBoundingClientRect())
      .filter(r => r.width > 0).map(r => r.right);
  const legends = [...document.querySelectorAll(".trend-legend")].map(p =>
      [...p.querySelectorAll("span.lg")].map(s => ({text: s.textContent, swatch: s.querySelector("i.sw") !== null,
        color: s.querySelector("i.sw") ? getComputedStyle(s.querySelector("i.sw")).backgroundColor : ""})));
  const series = [...document.querySelectorAll("svg.trend")].map(s =>
      [...s.querySelectorAll("polyline.tline")].map(p => p.dataset.series));
  const clips = [...document.querySelectorAll("details.clip")].map(d => ({
      cut: d.querySelector("summary").textContent, full: d.querySelector(".full").textContent, title: d.title}));
  return JSON.stringify({vw, screen: window.innerWidth, page, inner, past, links, charts, legends, series, clips,
                         calls: [...document.querySelectorAll("code.call")].map(c => c.textContent),
                         emoji: [...document.body.innerText].filter(ch => ch.codePointAt(0) >= 0x1F000).length});
})()
"""


def write_repro_files(results: Results, run: Path) -> int:
    """Every repro a finding of `results` names (its own and its culprit's), as a file in its cell folder."""
    n = 0
    for c in results.cells:
        for f in c.findings:
            culprit = f.details.get("culprit") if isinstance(f.details, dict) else None
            paths = [f.repro.path if f.repro else None,
                     (culprit.get("repro") or {}).get("path") if isinstance(culprit, dict) else None]
            for rel in filter(None, paths):
                target = run / (c.artifacts_dir or f"cells/{c.id}") / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text("raise SystemExit(1)\n", encoding="utf-8")
                n += 1
    return n


@pytest.mark.timeout(180)
def test_the_page_fits_1280_and_390_px_and_every_repro_link_resolves(tmp_path: Path) -> None:
    """Issue 35: at 1280 px nothing scrolls sideways (long cells wrap), at 390 px the page itself does not; every
    repro link opens a file that exists; op findings show their call; long messages are cut at a word."""
    _browser()
    from ci_runner.report.html import cut_words

    results = example_results()
    failing = next(c for c in results.cells if c.findings and c.findings[0].op)
    f = failing.findings[0]
    f.message = "RuntimeError: " + "an_unbroken_identifier_of_a_generated_kernel_" * 12 + " and then the words go on " * 9
    f.op = "aten." + "very_long_operator_name_" * 6 + ".default"
    run = tmp_path / "run"
    assert write_repro_files(results, run) > 0
    paths = write_reports(results, run / "report", run_dir=run, env={})
    wide = load_in_browser(paths["html"], tmp_path, probe=LAYOUT_JS, width=1280)["probe"]
    assert wide["screen"] == 1280 and wide["page"] <= 0, wide
    assert not wide["inner"], wide["inner"]
    assert not wide["past"], wide["past"]
    assert wide["links"] and all(Path(p).is_file() for p in wide["links"]), [p for p in wide["links"] if not Path(p).is_file()]
    shown = [fv for c in results.cells for fv in c.findings if fv.repro]
    assert len(set(wide["links"])) >= len({(c.id, fv.repro.path) for c in results.cells for fv in c.findings if fv.repro}) > 0, shown
    assert any(call.endswith("(f32[1, 4, 1, 16], -1)") for call in wide["calls"]), wide["calls"]
    assert wide["emoji"] == 0
    assert wide["clips"], "the long message must be cut"
    for clipped in wide["clips"]:
        assert clipped["full"] == clipped["title"] and clipped["cut"] == cut_words(clipped["full"], len(clipped["cut"]) + 1) \
            or clipped["full"].startswith(clipped["cut"].rstrip("…")), clipped
    narrow = load_in_browser(paths["html"], tmp_path, probe=LAYOUT_JS, width=390)["probe"]
    assert narrow["screen"] == 390 and narrow["page"] <= 0, narrow
    assert narrow["charts"] and all(right <= 390 for right in narrow["charts"]), narrow["charts"]
    assert (tmp_path / "report-1280.png").stat().st_size > 10_000 and (tmp_path / "report-390.png").stat().st_size > 10_000


@pytest.mark.timeout(180)
def test_a_big_run_page_is_light_and_draws_the_rest_on_demand(tmp_path: Path) -> None:
    """200 cells × 100 findings: under 5 MB; the findings and layers past the page's budgets come from
    the data embedded once, drawn as tables when opened, with no script error."""
    _browser()
    from ci_runner.report.html import MAX_CHART_CELLS, MAX_FINDINGS_PER_CELL, MAX_FULL_FINDINGS
    from tests.fixtures.results_factory import big_results

    results = big_results(200, 100)
    paths = write_reports(results, tmp_path / "report", env={})
    assert paths["html"].stat().st_size <= 5_000_000
    info = load_in_browser(paths["html"], tmp_path, probe=OPEN_LAZY_JS)
    assert info["count"] == 3 * MAX_CHART_CELLS
    total = sum(len(c.findings) for c in results.cells)
    full = sum(min(len(c.findings), MAX_FINDINGS_PER_CELL) for c in results.cells)
    assert info["probe"]["findings"] == total - min(full, MAX_FULL_FINDINGS)
    assert info["probe"]["layers"] == sum(len(c.modes["numerics"].data["layers"]) for c in results.cells[MAX_CHART_CELLS:])
    assert "unsupported_op" in info["probe"]["first"] and "aten.op_" in info["probe"]["first"]


@pytest.mark.timeout(120)
def test_a_real_run_report_in_headless_chromium(tmp_path: Path) -> None:
    """A report from a real `deepview-ci run`, when ``DEEPVIEW_BROWSER_RESULTS`` names its results.json."""
    source = os.environ.get("DEEPVIEW_BROWSER_RESULTS")
    if not source:
        pytest.skip("set DEEPVIEW_BROWSER_RESULTS=path/to/results.json to check a real run's report")
    results = load_results(source)
    run = Path(source).resolve().parent.parent
    paths = write_reports(results, tmp_path / "report", run_dir=run, env={})
    check_charts(results, load_in_browser(paths["html"], tmp_path))

def test_report_html_is_self_contained(tmp_path: Path) -> None:
    """No external asset can be referenced: no src/href to another origin, and a CSP forbidding fetches."""
    import re

    paths = write_reports(example_results(), tmp_path, env={})
    text = paths["html"].read_text(encoding="utf-8")
    assert "default-src 'none'" in text
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:https?:)?//""", text)
    assert "<link" not in text and "@import" not in text and "url(" not in text


BURNDOWN_JS = r"""
(() => {
  const charts = [...document.querySelectorAll("#history svg.trend[data-kind=burndown]")].map(s => {
    const r = s.getBoundingClientRect();
    return {points: +s.dataset.points, width: r.width, height: r.height,
            lines: [...s.querySelectorAll("polyline.tline")].map(p => ({series: p.dataset.series,
              n: p.points.numberOfItems, length: p.getTotalLength()}))};
  });
  return JSON.stringify({charts, layers: document.querySelectorAll("#history svg.trend[data-kind=layers]").length,
                         seen: document.querySelectorAll("#history table tbody tr").length});
})()
"""


@pytest.mark.timeout(180)
def test_sixty_nights_burndown_in_headless_chromium(tmp_path: Path) -> None:
    """The 60-night simulation (issue 20): each backend's burn-down is drawn with 60 points, offline."""
    _browser()
    from ci_runner.history.store import load_history
    from ci_runner.history.trends import compute
    from tests.fixtures.history_sim import NIGHTS, build_history, night_results

    build_history(tmp_path / "history", NIGHTS)
    h = load_history(tmp_path / "history")
    try:
        paths = write_reports(night_results(NIGHTS), tmp_path / "report", env={}, trends=compute(h))
    finally:
        h.close()
    info = load_in_browser(paths["html"], tmp_path, probe=BURNDOWN_JS)
    charts = info["probe"]["charts"]
    layout = load_in_browser(paths["html"], tmp_path, probe=LAYOUT_JS, width=1280)["probe"]
    assert layout["page"] <= 0 and not layout["inner"] and not layout["past"], layout
    assert layout["legends"] and len(layout["legends"]) == len(layout["series"])
    for names, legend in zip(layout["series"], layout["legends"]):  # every line has its whole name and a swatch
        assert [item["text"] for item in legend][: len(names)] == names, (names, legend)
        assert all(item["swatch"] and item["color"] not in ("", "rgba(0, 0, 0, 0)") for item in legend[: len(names)]), legend
        assert len({item["color"] for item in legend[: len(names)]}) == len(names), legend
    assert len(charts) == 3  # one per backend
    for ch in charts:
        assert ch["points"] == NIGHTS and ch["width"] > 300 and ch["height"] > 100, ch
        assert {ln["series"] for ln in ch["lines"]} == {"unsupported ops", "models blocked"}
        assert all(ln["n"] == NIGHTS for ln in ch["lines"]), ch["lines"]
    assert info["probe"]["layers"] >= 1 and info["probe"]["seen"] >= 2
