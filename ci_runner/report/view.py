"""One view of a `Results` that every report renders: the summary, the HTML page and the JUnit file.

Building it once keeps the three reports saying the same thing: the same order of cells, the same
icons, the same repro paths. Nothing here formats Markdown or HTML.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Mapping, Sequence
from typing import Any

from ..registry import SECTION_DIVERGENT, SECTION_LAYERS, SECTION_OPS, SECTION_OTHER, FindingKind, kinds_in
from ..registry import layer_table_modes, mode_names as registered_modes
from ..results.model import STATUS_SEVERITY, CellResult, Finding, Repro, Results, number
from ..failures.failure import headline
from ..backends.vendor import boilerplate_lines
from ..results.rootcause import root_causes

ICONS: dict[str, str] = {
    "pass": "✅",
    "fail": "❌",
    "error": "⚠️",
    "timeout": "⚠️",
    "crashed": "⚠️",
    "skipped": "➖",
    "inconclusive": "❔",  # nothing failed, but the backend did not run everything: not a pass
}
BAD_STATUSES = frozenset({"fail", "error", "timeout", "crashed"})
METRIC_KEYS: tuple[str, ...] = ("rel", "cos", "mad", "max_abs", "sqnr_db")
ENV_KEYS: tuple[str, ...] = ("torch", "transformers", "backend_version", "device")


def icon(status: str | None) -> str:
    return ICONS.get(status or "", "·")


_INF = float("inf")


def fmt_num(value: Any) -> str:
    """Short, exact-enough text for a metric: 3 significant digits, NaN/Inf spelled out."""
    if type(value) is float and value == value and value not in (_INF, -_INF):  # the common case first
        if value == 0:
            return "0"
        a = abs(value)
        if 0.999 < a < 1:  # cosines: show enough digits to see how far from 1
            return f"{value:.{min(15, math.ceil(-math.log10(1 - a)) + 2)}f}".rstrip("0")
        return f"{value:.4g}" if 1e-3 <= a < 1e4 else f"{value:.3g}"
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value).lower()
    try:
        x = number(value) if isinstance(value, (int, float, str)) else None
    except (TypeError, ValueError):
        return str(value)
    if x is None:
        return str(value)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if isinstance(value, int):
        return str(value)
    if x == 0:
        return "0"
    if 0.999 < abs(x) < 1:
        return f"{x:.{min(15, math.ceil(-math.log10(1 - abs(x))) + 2)}f}".rstrip("0")
    if 1e-3 <= abs(x) < 1e4:
        return f"{x:.4g}"
    return f"{x:.3g}"


def as_float(value: Any) -> float | None:
    """A metric as a float (NaN/Inf included), or None when absent or not numeric."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return number(value)
    except (TypeError, ValueError):
        return None


def cell_base(cell: CellResult, *, out_dir: Path | None, run_dir: Path | None) -> str:
    """The cell folder as the report reader reaches it: relative to `out_dir` when `run_dir` is
    known, else relative to the run folder."""
    base = (cell.artifacts_dir or f"cells/{cell.id}").replace("\\", "/")
    if run_dir is None or out_dir is None:
        return posixpath.normpath(base)
    full = os.path.join(os.path.abspath(run_dir), base)
    try:
        return Path(os.path.relpath(full, os.path.abspath(out_dir))).as_posix()
    except ValueError:  # another drive on Windows
        return Path(full).as_posix()


def repro_path(cell: CellResult, finding: Finding, *, out_dir: Path | None, run_dir: Path | None,
               base: str | None = None) -> str | None:
    """Where a finding's repro lies, as a reader of the report folder should open it.

    Repro paths are relative to the cell folder (``artifacts_dir``, itself relative to the run
    folder). With `run_dir`, the result is relative to `out_dir`; without, relative to the run folder.
    `base` is `cell_base` precomputed for the cell.
    """
    if finding.repro is None or not finding.repro.path:
        return None
    rel = finding.repro.path.replace("\\", "/")
    if posixpath.isabs(rel):
        if out_dir is None:
            return rel
        try:
            return Path(os.path.relpath(rel, os.path.abspath(out_dir))).as_posix()
        except ValueError:
            return rel
    if base is None:
        base = cell_base(cell, out_dir=out_dir, run_dir=run_dir)
    return posixpath.normpath(posixpath.join(base, rel))


def repro_command(finding: Finding) -> str | None:
    """The repro command as run from the cell folder (or the downloaded cell artifact).

    Repro scripts find their data next to themselves, so ``python <path relative to the cell>``
    works from there. The recorded command's ``PYTHONPATH`` (a plugin's folder, relative to the script's
    folder: `engine.repro.run_command`) is rebased onto the cell folder; an absolute one (written by an older
    version) is left out: no path of the machine that ran the cell is printed.
    """
    r = finding.repro
    if r is None or not r.path:
        return None
    return cell_command(r.path, r.command)


def cell_command(repro_path: str, recorded: str | None) -> str:
    """`repro_command` of a repro at `repro_path` (relative to its cell folder) whose recorded command is
    `recorded`."""
    path = repro_path.replace("\\", "/")
    if posixpath.isabs(path):
        path = posixpath.basename(path)
    cmd = f"python {shlex.quote(path)}"
    m = re.search(r"PYTHONPATH=(\S+)", recorded or "")
    if m:
        folder = posixpath.dirname(path)
        rebased = [posixpath.normpath(posixpath.join(folder, p)) for p in m.group(1).split(os.pathsep)
                   if p and not posixpath.isabs(p)]
        if rebased:
            cmd = f"PYTHONPATH={shlex.quote(os.pathsep.join(rebased))} {cmd}"
    return cmd


def cos_distance(value: Any) -> str:
    """A cosine shown as its distance from 1 (``1 − cos``), readable where cos itself is 0.99999…"""
    x = as_float(value)
    if x is None:
        return "–"
    if math.isnan(x):
        return "NaN"
    return fmt_num(1.0 - x) if x != 1.0 else "0"


def format_threshold(metric: str, threshold: Any) -> str:
    """``rel ≤ 0.002``; a cosine threshold as ``1 − cos ≤ 5.8e-11``."""
    if metric == "cos":
        return f"1 − cos ≤ {cos_distance(threshold)}"
    return f"{metric} ≤ {fmt_num(threshold)}"


@dataclass
class FindingView:
    cell: str
    model: str
    backend: str
    mode: str
    finding: Finding
    title: str  # op, or module, or kind
    summary: str  # first line of the message
    repro: str | None
    verified: bool
    view: str | None = None  # numerics: the view(s) it was flagged in: cumulative / isolated / both
    # the metrics to show in one table row: (view, metrics, threshold); see `metric_views`
    primary: tuple[str | None, dict[str, Any], dict[str, Any]] = (None, {}, {})
    metrics_text: str = ""
    command: str | None = None  # how to run the repro from the cell folder (see `repro_command`)
    culprit: str | None = None  # layer failures: the op(s) the culprit search found (`culprit_text`)
    culprit_repro: str | None = None  # the culprit's own repro, as `repro` is the layer's
    culprit_verified: bool = False
    culprit_label: str = "culprit"  # or "culprit (repro did not reproduce)" / "culprit (not verified)"
    call: str | None = None  # an op finding: the call that failed, `aten.cumsum.default(f32[1, 4, 1, 16], -1)`
    more_calls: int = 0  # its other failing signatures
    cell_dir: str | None = None  # the cell folder `command` runs from, as `repro` names it (relative to the report)
    reach: str | None = None  # whether its wrong values reach the model's output (`reach_words`)
    same_cause: str | None = None  # the operator finding whose cause it shares (`same_cause_words`)


VIEWS: tuple[str, ...] = ("cumulative", "isolated")


def phase_text(f: Finding) -> str | None:
    """Where in the workload a finding was made: ``decode step 3``, ``batch``, ``tp2`` (a tensor-parallel layout,
    after the phase); None for the single forward on one rank."""
    where = (f"{f.phase} step {f.step}" if f.step is not None else f.phase) if f.phase else None
    if f.parallel:
        return f"{where}, {f.parallel}" if where else f.parallel
    return where


def finding_title(f: Finding) -> str:
    """What failed (op, module or kind), with the phase it failed in: ``model [decode step 1]``."""
    what = f.op or f.module or f.kind
    where = phase_text(f)
    return f"{what} [{where}]" if where else what


def metric_views(f: Finding) -> list[tuple[str | None, dict[str, Any], dict[str, Any]]]:
    """A finding's metrics per view. Numerics findings may nest them (``metrics.cumulative.rel``,
    ``threshold.isolated.rel``) or keep them flat with ``details.view`` saying which view."""
    m = f.metrics if isinstance(f.metrics, Mapping) else {}
    t = f.threshold if isinstance(f.threshold, Mapping) else {}
    nested = [v for v in VIEWS if isinstance(m.get(v), Mapping)]
    if nested:
        flat_t = {k: x for k, x in t.items() if not isinstance(x, Mapping)}
        return [(v, dict(m[v]), dict(t[v]) if isinstance(t.get(v), Mapping) else flat_t) for v in nested]
    view = f.details.get("view") if isinstance(f.details, Mapping) else None
    return [(view if view in VIEWS else None, dict(m), dict(t))]


def primary_metrics(f: Finding, view: str | None) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """The view that says most about the layer itself: isolated when it was flagged there."""
    views = metric_views(f)
    want = "isolated" if view in ("isolated", "both", None) else view
    for v in views:
        if v[0] == want:
            return v
    return views[0]


def format_metrics(f: Finding) -> str:
    """``rel 0.04 (threshold 0.002) · cos 0.9992 (threshold 0.9995)``, per view when nested."""
    parts = []
    views = metric_views(f)
    for view, m, t in views:
        items = []
        for k, val in m.items():
            if isinstance(val, (Mapping, list)):
                continue
            thr = t.get(k)
            shown = f"1 − cos {cos_distance(val)}" if k == "cos" else f"{k} {fmt_num(val)}"
            has_thr = thr is not None and not isinstance(thr, (Mapping, list))
            shown_thr = cos_distance(thr) if k == "cos" else fmt_num(thr)
            items.append(shown + (f" (threshold {shown_thr})" if has_thr else ""))
        if items:
            parts.append((f"{view}: " if view and len(views) > 1 else "") + " · ".join(items))
    return "; ".join(parts)


@dataclass
class LayerPoint:
    name: str
    module_class: str
    index: int
    cumulative: dict[str, float | None]
    isolated: dict[str, float | None]
    threshold: dict[str, float | None]
    flagged_cumulative: bool
    flagged_isolated: bool
    threshold_isolated: dict[str, float | None] = field(default_factory=dict)  # when it differs

    @property
    def label(self) -> str:
        return self.name or "(whole model)"


@dataclass
class NumericsView:
    layers: list[LayerPoint]
    verdict: dict[str, Any]
    total: int = 0  # the model's layers (module calls); more than `layers` when it kept only part of the table
    compared: int | None = None  # layers compared in at least one view (`data["coverage"]`), when fewer than total
    mode: str = ""  # the mode whose table it is (`registry.ModeSpec.layer_table`)

    @property
    def flagged(self) -> list[LayerPoint]:
        return [p for p in self.layers if p.flagged_cumulative or p.flagged_isolated]


@dataclass
class CellView:
    cell: CellResult
    modes: dict[str, str | None]  # mode → status (None when the mode did not run at all)
    reasons: dict[str, str]
    findings: list[FindingView]
    env: dict[str, str]
    numerics: NumericsView | None
    base: str = ""  # the cell folder as the report reader reaches it (`cell_base`)

    @property
    def id(self) -> str:
        return self.cell.id

    @property
    def layout(self) -> str | None:
        """The cell's tensor-parallel layout and what each mode's ranks concluded: ``tp2 (ops pass, layers pass)``;
        None for a one-rank cell."""
        if not self.cell.parallel:
            return None
        ranks = [f"{name} {m.data['parallel'].get('status') or 'ran'}" for name, m in self.cell.modes.items()
                 if isinstance(m.data, Mapping) and isinstance(m.data.get("parallel"), Mapping)]
        return self.cell.parallel + (f" ({', '.join(ranks)})" if ranks else "")

    @property
    def status(self) -> str:
        return self.cell.status

    @property
    def bad(self) -> bool:
        return self.cell.status in BAD_STATUSES

    @property
    def first(self) -> str | None:
        """The first finding in execution order: the verdict's first divergent layer when the
        numerics mode found one and nothing ran into trouble before it, else the first finding."""
        if not self.findings:
            return None
        head = self.findings[0]
        if self.numerics and head.mode == self.numerics.mode and self.numerics.verdict.get("first_divergent"):
            return str(self.numerics.verdict["first_divergent"])
        return head.title


@dataclass
class ReportView:
    cells: list[CellView]
    modes: list[str]
    counts: dict[str, int]
    ranking: list[dict[str, Any]]
    submodules: list[FindingView]  # layer failures
    divergent: list[FindingView]  # divergence findings
    op_findings: list[FindingView]
    other: list[FindingView]
    verdicts: list[tuple[CellView, dict[str, Any]]]
    tool_version: str
    generated_at: str | None
    regressions: list[Any] = field(default_factory=list)  # diff entries, when a diff was given
    diff: Any = None
    root_causes: list[dict[str, Any]] = field(default_factory=list)  # results.root_causes (rootcause.py)
    links: bool = False  # repro paths are relative to the report folder (a page there can link them)

    @property
    def failing(self) -> list[CellView]:
        return [c for c in self.cells if c.bad]

    @property
    def total_findings(self) -> int:
        return self.counts.get("findings", 0)


def _metrics(d: Any) -> dict[str, float | None]:
    if not isinstance(d, Mapping):
        return {}
    return {k: as_float(v) for k, v in d.items()}


def _numerics(cell: CellResult) -> NumericsView | None:
    """The cell's per-layer comparison: the table of the first mode that declares one (`ModeSpec.layer_table`)."""
    name = next((m for m in layer_table_modes() if m in cell.modes), "")
    mode = cell.modes.get(name)
    if mode is None or not isinstance(mode.data, Mapping):
        return None
    rows = mode.data.get("layers")
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        return None
    points: list[LayerPoint] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            continue
        idx = row.get("index", i)
        points.append(LayerPoint(
            name=str(row.get("name", f"layer {i}")),
            module_class=str(row.get("module_class") or ""),
            index=idx if isinstance(idx, int) else i,
            cumulative=_metrics(row.get("cumulative")),
            isolated=_metrics(row.get("isolated")),
            threshold=_metrics(row.get("threshold")),
            flagged_cumulative=bool(row.get("flagged_cumulative")),
            flagged_isolated=bool(row.get("flagged_isolated")),
            threshold_isolated=_metrics(row.get("threshold_isolated")),
        ))
    verdict = mode.data.get("verdict")
    total = mode.data.get("layers_total")
    cov = mode.data.get("coverage")
    compared = cov.get("compared") if isinstance(cov, Mapping) else None
    n = total if isinstance(total, int) and total >= len(points) else len(points)
    return NumericsView(layers=points, verdict=dict(verdict) if isinstance(verdict, Mapping) else {}, total=n,
                        compared=compared if isinstance(compared, int) and compared < n else None, mode=name)


def _flat_env(env: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k in sorted(env, key=str):
        v = env[k]
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat_env(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v, sort_keys=True, ensure_ascii=False, default=str)
        elif v is not None:
            out[key] = str(v)
    return out


def mode_names(results: Results) -> list[str]:
    order = registered_modes()
    seen = {m for c in results.cells for m in c.modes}
    return [m for m in order if m in seen] + sorted(seen - set(order)) or list(order)


def culprit_text(f: Finding) -> str | None:
    """`aten.histc.default fails alone` / `aten.histc.default, aten.cumsum.default each fail alone` / `4 nodes fail together (aten.mm.default, aten.neg.default)` for a
    layer failure whose culprit search found something (`details.culprit`), else None."""
    c = f.details.get("culprit") if isinstance(f.details, Mapping) else None
    if not isinstance(c, Mapping) or not c.get("found") or not c.get("ops"):
        return None
    ops = [str(o) for o in c["ops"]]
    if c.get("kind") == "single":
        alone = list(dict.fromkeys([ops[0], *(str(r.get("op")) for r in c.get("failing_ops") or ()
                                              if isinstance(r, Mapping) and r.get("op"))]))
        return f"{ops[0]} fails alone" if len(alone) == 1 else f"{', '.join(alone)} each fail alone"
    return f"{len(c.get('nodes') or ops)} nodes fail together, no op alone ({', '.join(ops)})"


def culprit_label(f: Finding) -> str:
    """``culprit`` when its repro reproduced the layer's failure; else says why it is not shown to be one."""
    c = f.details.get("culprit") if isinstance(f.details, Mapping) else None
    r = c.get("repro") if isinstance(c, Mapping) else None
    if isinstance(r, Mapping) and r.get("verified"):
        return "culprit"
    note = str(r.get("note") or "") if isinstance(r, Mapping) else ""
    ran = note.startswith(("the repro passed", "failed differently", "killed by", "timed out"))
    return "culprit (repro did not reproduce)" if ran else "culprit (not verified)"


def culprit_repro_path(cell: CellResult, f: Finding, *, out_dir: Path | None, run_dir: Path | None,
                       base: str | None) -> tuple[str | None, bool]:
    c = f.details.get("culprit") if isinstance(f.details, Mapping) else None
    r = c.get("repro") if isinstance(c, Mapping) else None
    if not isinstance(r, Mapping) or not r.get("path"):
        return None, False
    as_finding = Finding(kind=f.kind, stage=f.stage, message=f.message, fingerprint=f.fingerprint,
                         repro=Repro(path=str(r["path"]), verified=bool(r.get("verified"))))
    return repro_path(cell, as_finding, out_dir=out_dir, run_dir=run_dir, base=base), bool(r.get("verified"))


def op_call(f: Finding) -> tuple[str | None, int]:
    """An op finding's failing call as its signature reads (`aten.cumsum.default(f32[1, 4, 1, 16], -1)`, from
    ``details.signatures``, the ops mode's probed signatures) and how many other signatures failed."""
    sigs = f.details.get("signatures") if isinstance(f.details, Mapping) else None
    if not isinstance(sigs, Sequence) or isinstance(sigs, (str, bytes)) or not sigs:
        return None, 0
    first = sigs[0]
    text = first.get("signature") if isinstance(first, Mapping) else None
    return (str(text) if text else None), len(sigs) - 1


def cause_place(cause: Mapping[str, Any], example: "FindingView | None") -> str:
    """Where a root cause happened, for the report's "raised in" column: the frame that raised it when its
    traceback is known; else, for a finding without an error (a divergence), the layer and its class, or the op."""
    raised = str(cause.get("raised_in") or "")
    if cause.get("frame") or (raised and not raised.startswith("unknown")):
        return raised
    ex = cause.get("example") if isinstance(cause.get("example"), Mapping) else {}
    f = example.finding if example is not None else None
    module = (f.module if f else None) or ex.get("module")
    klass = f.module_class if f else None
    layer = f"layer {module}" + (f" ({klass})" if klass else "") if module else ""
    op = (f.op if f else None) or ex.get("op")
    if op:
        return f"op {op}" + (f" in {layer}" if layer else "")
    return layer or raised or "unknown (no traceback)"


def _causes(results: Results, allf: Sequence[FindingView]) -> list[dict[str, Any]]:
    """The root causes, each with `place` (`cause_place`) and `full` (its example finding's whole first line)."""
    causes = results.root_causes if results.root_causes or not allf else root_causes(results, boilerplate=boilerplate_lines())
    by_sig: dict[str, FindingView] = {}
    for fv in allf:
        sig = fv.finding.details.get("signature") if isinstance(fv.finding.details, Mapping) else None
        if isinstance(sig, str):
            by_sig.setdefault(sig, fv)
    out = []
    for r in causes:
        if not isinstance(r, Mapping):
            continue
        row = dict(r)
        ex = by_sig.get(str(r.get("signature")))
        row["place"] = cause_place(r, ex)
        row["full"] = headline(ex.finding.message, 2000) if ex is not None else str(r.get("message") or "")
        out.append(row)
    return out


def same_cause_words(details: Mapping[str, Any] | None) -> str | None:
    """The cause a finding shares with an operator's finding of its cell (`details.same_cause_as`, put there by
    `results.rootcause.links`), in one sentence; None when it shares none."""
    link = (details or {}).get("same_cause_as")
    if not isinstance(link, Mapping) or not link.get("op"):
        return None
    return f"one cause with the {link.get('mode', 'ops')} mode's {link.get('kind', 'finding')} of {link['op']}: {link.get('why', '')}".rstrip(": ")


def reach_words(details: Mapping[str, Any] | None) -> str | None:
    """Whether a finding's wrong values reach the model's output (`details.reaches_output`, measured by the ops
    mode's `reach`): one sentence, or None when the finding carries no such measurement."""
    if not details or "reaches_output" not in details:
        return None
    reaches = details.get("reaches_output")
    max_abs = (details.get("output_effect") or {}).get("max_abs")
    size = f" (max abs {max_abs:.3g})" if isinstance(max_abs, (int, float)) else ""
    if reaches is True:
        return f"its mismatch reaches the model's output{size}"
    if reaches is False:
        return f"its mismatch does not reach the model's output for these inputs{size}"
    return f"whether it reaches the model's output is unknown: {details.get('reaches_output_note') or 'not measured'}"


def build_view(results: Results, *, out_dir: Path | None = None, run_dir: Path | None = None, diff: Any = None) -> ReportView:
    """Order: failing cells first (worst status first), then by id; findings in mode order."""
    modes = mode_names(results)
    cells: list[CellView] = []
    for c in results.cells:
        fviews: list[FindingView] = []
        base = cell_base(c, out_dir=out_dir, run_dir=run_dir)
        for mname in [m for m in modes if m in c.modes]:
            for f in c.modes[mname].findings:
                fview = str(f.details.get("view")) if isinstance(f.details, Mapping) and f.details.get("view") else None
                c_repro, c_ok = culprit_repro_path(c, f, out_dir=out_dir, run_dir=run_dir, base=base)
                fviews.append(FindingView(
                    cell=c.id, model=c.model, backend=c.backend, mode=mname, finding=f,
                    title=finding_title(f), summary=headline(f.message),
                    repro=repro_path(c, f, out_dir=out_dir, run_dir=run_dir, base=base),
                    verified=bool(f.repro and f.repro.verified),
                    view=fview,
                    primary=primary_metrics(f, fview) if f.kind == FindingKind.DIVERGENCE else (None, {}, {}),
                    metrics_text=format_metrics(f) if f.metrics else "",
                    command=repro_command(f),
                    culprit=culprit_text(f), culprit_repro=c_repro, culprit_verified=c_ok,
                    culprit_label=culprit_label(f), cell_dir=base,
                    reach=reach_words(f.details) if isinstance(f.details, Mapping) else None,
                    same_cause=same_cause_words(f.details) if isinstance(f.details, Mapping) else None,
                ))
                if f.op:
                    fviews[-1].call, fviews[-1].more_calls = op_call(f)
        nv = _numerics(c)
        if nv is not None and nv.layers:
            # the numerics mode lists findings worst first; every report shows execution order
            order = {}
            for p in nv.layers:
                order.setdefault(p.name, p.index)
            fviews.sort(key=lambda fv: (modes.index(fv.mode), order.get(fv.finding.module or "", len(order))
                                        if fv.finding.kind == FindingKind.DIVERGENCE else -1))
        cells.append(CellView(
            cell=c,
            modes={m: (c.modes[m].status if m in c.modes else None) for m in modes},
            reasons={m: c.modes[m].reason or "" for m in modes if m in c.modes and c.modes[m].reason},
            findings=fviews,
            env=_flat_env(c.env),
            numerics=nv,
            base=base,
        ))
    cells.sort(key=lambda cv: (0 if cv.bad else 1, -STATUS_SEVERITY.get(cv.status, 3), cv.id))
    allf = [f for cv in cells for f in cv.findings]
    view = ReportView(
        cells=cells,
        modes=modes,
        counts=results.counts(),
        ranking=[r for r in results.ranking if isinstance(r, Mapping)],
        submodules=[f for f in allf if f.finding.kind in kinds_in(SECTION_LAYERS)],
        divergent=[f for f in allf if f.finding.kind in kinds_in(SECTION_DIVERGENT)],
        op_findings=[f for f in allf if f.finding.kind in kinds_in(SECTION_OPS)],
        other=[f for f in allf if f.finding.kind in kinds_in(SECTION_OTHER)],
        verdicts=[(cv, cv.numerics.verdict) for cv in cells if cv.numerics and cv.numerics.verdict.get("first_divergent")],
        tool_version=results.tool_version,
        generated_at=results.generated_at,
        diff=diff,
    )
    if diff is not None:
        view.regressions = [e for e in diff.entries if e.category == "regressed"]
    view.root_causes = _causes(results, allf)
    view.links = out_dir is not None and run_dir is not None
    return view


# --------------------------------------------------------------------------- the cost in compiles

@dataclass(frozen=True)
class CompileCost:
    """One row of where a cell's compile time went: a mode's phase (or its `total`), its graphs and seconds."""

    cell: str
    mode: str
    phase: str
    graphs: int
    compile_s: float


def compile_costs(cell: CellResult) -> list[CompileCost]:
    """Each mode's `data.compiles` rows (`watch/compiles.py`, filled by the cell's mode loop for every mode), phases
    in the order the mode ran them and its `total` last; modes in the cell's order. Nothing names a mode."""
    rows: list[CompileCost] = []
    for mode, result in cell.modes.items():
        table = result.data.get("compiles") if isinstance(result.data, Mapping) else None
        if not isinstance(table, Mapping):
            continue
        for phase, fig in table.items():
            if not isinstance(fig, Mapping):
                continue
            graphs, seconds = fig.get("graphs"), fig.get("compile_s")
            rows.append(CompileCost(cell=cell.id, mode=mode, phase=str(phase),
                                    graphs=graphs if isinstance(graphs, int) and not isinstance(graphs, bool) else 0,
                                    compile_s=float(seconds) if isinstance(seconds, (int, float))
                                    and not isinstance(seconds, bool) else 0.0))
    return rows


def costliest_compiles(cells: Sequence[CellResult], limit: int) -> tuple[list[CompileCost], CompileCost]:
    """The `limit` phases (every mode's, `total` rows left out) that spent the most seconds compiling, costliest
    first, and the run's total (`cell` and `mode` empty)."""
    phases: list[CompileCost] = []
    graphs, seconds = 0, 0.0
    for cell in cells:
        for row in compile_costs(cell):
            if row.phase == "total":
                graphs, seconds = graphs + row.graphs, seconds + row.compile_s
            elif row.graphs or row.compile_s:
                phases.append(row)
    phases.sort(key=lambda r: (-r.compile_s, -r.graphs, r.cell, r.mode, r.phase))
    return phases[:limit], CompileCost(cell="", mode="", phase="total", graphs=graphs, compile_s=seconds)
