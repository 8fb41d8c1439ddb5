"""From the target's records to the numerics result: layers, verdict, findings and the per-layer table.

The verdict names the first divergent layer (the first, in completion order, flagged in the isolated view: wrong
on its own; else the first flagged in the cumulative view) and a kind: `algorithmic` (one layer wrong on its own),
`layer_class` (two or more layers wrong on their own share a class or a relative path) or `drift` (the
cumulative error grows past thresholds with no layer wrong on its own).
"""

from __future__ import annotations
from ...registry import FindingKind

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ...results.model import Finding, fingerprint
from .metrics import cos_text, public, severity, worst
from .settings import VIEWS
from .store import DumpReader
from .thresholds import ThresholdTable, exceeded

def rel_path(name: str) -> str:
    """`model.layers.3.post_attention_layernorm` → `model.layers.*.post_attention_layernorm`."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


@dataclass
class Layer:
    """One module call of the reference, with what both views measured against its thresholds."""

    key: str
    name: str
    module_class: str
    call_index: int
    idx: int
    done: int
    depth: int
    metrics: dict[str, dict[str, Any] | None] = field(default_factory=lambda: {"cumulative": None, "isolated": None})
    errors: dict[str, str] = field(default_factory=dict)
    threshold: dict[str, dict[str, float]] = field(default_factory=dict)
    threshold_source: dict[str, str] = field(default_factory=dict)
    exceeded: dict[str, list[str]] = field(default_factory=dict)
    via: str | None = None  # isolated view: the sub-call whose inputs (computed by this layer) differ most
    reordered: list[str] = field(default_factory=list)  # views that compared its rows in the reference's order

    def flagged(self, view: str) -> bool:
        return bool(self.exceeded.get(view))


def merge_metrics(layer: Layer, view: str, metrics: Mapping[str, Any]) -> None:
    cur = layer.metrics.get(view)
    layer.metrics[view] = dict(metrics) if cur is None else worst([cur, metrics])


def build_layers(reader: DumpReader, records: list[dict[str, Any]], table: ThresholdTable) -> list[Layer]:
    """One `Layer` per reference call with its metrics, errors and thresholds from the target's records."""
    layers = {c["key"]: Layer(key=c["key"], name=c["name"], module_class=c["module_class"],
                               call_index=c["call_index"], idx=c["idx"], done=c.get("done", c["idx"]), depth=c["depth"])
              for c in reader.calls}
    # a call whose paths differ (stage `paths`: the run called the module another number of times, or its
    # sub-modules otherwise) is not compared in that view, whatever numbers were taken before that was known
    differ = {(r["view"], r["key"]) for r in records if r.get("stage") == "paths" and r.get("key") is not None}
    for r in records:
        key = r.get("key")
        if key is None or key not in layers:
            continue
        layer = layers[key]
        if "metrics" in r and (r["view"], key) in differ:
            continue
        if "metrics" in r:
            if r["metrics"].get("reordered") and r["view"] not in layer.reordered:
                layer.reordered.append(r["view"])
            prev = layer.metrics.get(r["view"])
            merge_metrics(layer, r["view"], r["metrics"])
            if r["view"] == "isolated" and (prev is None or float(r["metrics"]["rel"]) >= float(prev["rel"])):
                layer.via = r.get("via")
        elif "error" in r:
            layer.errors.setdefault(r["view"], f"{r.get('stage', 'run')}: {r['error']}")
    for layer in layers.values():
        for view in VIEWS:
            if view not in table.views and layer.metrics.get(view) is None:  # not derived, not needed: not run
                layer.exceeded[view] = []
                continue
            thr, source = table.get(layer.key, view)
            layer.threshold[view] = thr
            layer.threshold_source[view] = source
            m = layer.metrics.get(view)
            layer.exceeded[view] = exceeded(m, thr) if m is not None else []
    return sorted(layers.values(), key=lambda l: l.idx)


def verdict_of(layers: list[Layer], *, isolated_ran: bool, policy: str | None = None) -> dict[str, Any]:
    """The first divergent layer and the kind of divergence (`algorithmic`, `layer_class`, `drift`), with a text.
    Under a precision policy below float32 (`policy`: its label), drift with every layer compared alone and
    within the policy is `policy_drift`: the policy's own rounding compounding from layer to layer (two rounding
    noises of one size compared on a few samples), which `findings_for` does not report."""
    by_done = sorted(layers, key=lambda l: l.done)
    cum = [l for l in by_done if l.flagged("cumulative")]
    iso = [l for l in by_done if l.flagged("isolated")]
    # where the divergence starts: the first layer wrong on its own (its output, or what it passes on, may show
    # up in a sub-call's output first: the attention's error surfaces at o_proj, inside self_attn); else, for
    # pure drift, the first layer over threshold in the cumulative view
    first = (iso or cum or [None])[0]
    if first is None:
        # compared in no view (a layer one view could not hold but the other compared was compared)
        errs = sum(1 for l in layers if l.errors and all(m is None for m in l.metrics.values()))
        text = "no layer exceeds its threshold" + (f" ({errs} layer(s) could not be compared)" if errs else "")
        return {"first_divergent": None, "kind": None, "pattern": None, "text": text}
    kind: str
    pattern: str | None = None
    if iso:
        groups: dict[tuple[str, str], set[str]] = {}
        for l in iso:
            groups.setdefault(("class", l.module_class), set()).add(l.name)
            groups.setdefault(("path", rel_path(l.name)), set()).add(l.name)
        best = max(groups.items(), key=lambda kv: (len(kv[1]), kv[0][0] == "class"))
        if len(best[1]) >= 2:
            kind, pattern = "layer_class", best[0][1]
            members = sorted(best[1])
            text = (f"{len(members)} layers of {'class' if best[0][0] == 'class' else 'path'} {pattern} diverge on "
                    f"their own (isolated view): {', '.join(members[:6])}{' …' if len(members) > 6 else ''}; "
                    f"first divergent layer {first.name or '(root)'}")
        else:
            kind = "algorithmic"
            owner = iso[0]
            text = (f"{owner.name or '(root)'} ({owner.module_class}) diverges on its own (isolated view: a sudden "
                    f"jump, not carried-in drift); first divergent layer {first.name or '(root)'}")
        others = {l.name for l in cum} - {l.name for l in iso}
        if others:
            text += f"; {len(others)} downstream layer(s) carry the error (cumulative view)"
    else:
        kind = "drift"
        rels = [float(l.metrics["cumulative"]["rel"]) for l in by_done if l.metrics.get("cumulative")]
        text = (f"accumulated drift: no layer is wrong on its own{'' if isolated_ran else ' (isolated view not run)'}, "
                f"but the cumulative error grows past the thresholds from {first.name or '(root)'} on "
                f"(rel up to {max(rels):.2e})")
        finite = all(math.isfinite(float((l.metrics.get("cumulative") or {}).get("rel", 0.0)))
                     and not (l.metrics.get("cumulative") or {}).get("nonfinite_tgt") for l in cum)
        if policy is not None and finite and all(l.metrics.get("isolated") for l in layers):  # (NaN/Inf: never)
            kind = "policy_drift"
            text += (f": every layer is within the {policy} policy on its own (isolated view), so this is the "
                     f"policy's rounding compounding, not a finding")
    return {"first_divergent": first.name, "kind": kind, "pattern": pattern, "text": text}


def _fmt(m: Mapping[str, Any] | None) -> str:
    if not m:
        return "n/a"
    return f"rel {float(m['rel']):.2e}, {cos_text(m['cos'])}"


def findings_for(layers: list[Layer], verdict: Mapping[str, Any], *, backend_id: str, model_id: str,
                 max_findings: int) -> tuple[list[Finding], int]:
    """`divergence` findings (most severe first, at most `max_findings`) and how many there were in all. A verdict
    of kind `policy_drift` (cumulative drift under a precision policy, every layer within it on its own) has none."""
    by_name: dict[str, list[Layer]] = {}
    for l in layers:
        by_name.setdefault(l.name, []).append(l)
    iso_names = [n for n, ls in by_name.items() if any(l.flagged("isolated") for l in ls)]
    chosen: list[tuple[str, str]] = [(n, "isolated") for n in iso_names]
    if not chosen and verdict.get("first_divergent") is not None and verdict.get("kind") != "policy_drift":
        chosen = [(verdict["first_divergent"], "cumulative")]
    downstream = sum(1 for l in layers if l.flagged("cumulative"))
    findings = []
    for name, why in chosen:
        ls = by_name[name]
        worst_l = max(ls, key=lambda l: float((l.metrics.get(why) or {}).get("rel", 0.0)))
        both = any(l.flagged("cumulative") for l in ls) and any(l.flagged("isolated") for l in ls)
        view = "both" if both else why
        m = worst_l.metrics.get(why) or {}
        thr = worst_l.threshold.get(why, {})
        over = worst_l.exceeded.get(why, [])
        sev = severity(m) if m else "n/a"
        if why == "isolated":
            where = f" in what it passes to {worst_l.via}" if worst_l.via else ""
            msg = (f"{name or '(root)'} ({worst_l.module_class}) diverges on its own{where}: {_fmt(m)} against "
                   f"threshold rel {thr.get('rel', math.nan):.2e} / {cos_text(thr.get('cos', math.nan))} (isolated "
                   f"view, {sev})")
        else:
            msg = (f"accumulated drift first exceeds the threshold at {name or '(root)'} ({worst_l.module_class}): "
                   f"{_fmt(m)} against threshold rel {thr.get('rel', math.nan):.2e} / {cos_text(thr.get('cos', math.nan))} "
                   f"(cumulative view, {sev}); "
                   f"{downstream} layer(s) over threshold downstream, none wrong on its own")
        if name == verdict.get("first_divergent"):
            msg += "; first divergent layer"
        findings.append(Finding(
            kind=FindingKind.DIVERGENCE, stage="compare", message=msg,
            fingerprint=fingerprint(FindingKind.DIVERGENCE, backend_id, model_id, name),
            module=name, module_class=worst_l.module_class,
            metrics={v: public(worst_l.metrics[v]) for v in VIEWS if worst_l.metrics.get(v)},
            threshold={v: dict(worst_l.threshold[v]) for v in VIEWS if v in worst_l.threshold},
            details={"view": view, "exceeded": over, "severity": sev, "calls": len(ls), "via": worst_l.via,
                     "relative_path": rel_path(name), "first_divergent": name == verdict.get("first_divergent"),
                     "verdict": verdict.get("kind"), "pattern": verdict.get("pattern"),
                     "downstream_flagged": downstream if why == "cumulative" else None},
        ))
    findings.sort(key=lambda f: -float((f.metrics.get("isolated") or f.metrics.get("cumulative") or {}).get("rel", 0.0)))
    total = len(findings)
    return findings[:max_findings], total


def layer_table(layers: list[Layer], cap: int) -> list[dict[str, Any]]:
    """The per-layer rows of the mode's `data["layers"]` (the first `cap`)."""
    out = []
    for i, l in enumerate(layers[:cap]):
        row: dict[str, Any] = {
            "name": l.name, "module_class": l.module_class, "index": i, "key": l.key, "call_index": l.call_index,
            "depth": l.depth,
            "cumulative": public(l.metrics["cumulative"]) if l.metrics.get("cumulative") else None,
            "isolated": public(l.metrics["isolated"]) if l.metrics.get("isolated") else None,
            "threshold": dict(l.threshold.get("cumulative") or {}),
            "threshold_isolated": dict(l.threshold.get("isolated") or {}),
            "flagged_cumulative": l.flagged("cumulative"),
            "flagged_isolated": l.flagged("isolated"),
        }
        if l.via:
            row["isolated_via"] = l.via
        if l.reordered:
            row["reordered_rows"] = list(l.reordered)  # the same rows in another order (`compare_any_row_order`)
        if l.errors:
            row["errors"] = dict(l.errors)
        if "fallback" in l.threshold_source.values():
            row["threshold_source"] = dict(l.threshold_source)
        out.append(row)
    return out


def view_status(layers: list[Layer], view: str, *, errors: bool, wanted: bool) -> str:
    """`ran` (every layer compared), `partial`, `error` (nothing compared) or `not run`."""
    if not wanted:
        return "not run"
    compared = sum(1 for l in layers if l.metrics.get(view) is not None)
    failed = errors or any(view in l.errors for l in layers)
    if compared == 0:
        return "error" if failed else "not run"
    return "partial" if failed or compared < len(layers) else "ran"


# errors that leave a layer to the other view, not held against a pass when that view compared it: its paths differ
# in this one (`paths`), this view's capture could not hold it (`capture`: `watched.py`'s ways without hooks), or
# the backend did not run it in this view (`not_ran`: e.g. OpenVINO converts a model whole but not one of its
# modules alone). A layer no view compared is missing: never a pass.
OTHER_VIEW = ("paths:", "capture:", "not_ran:")


def coverage(layers: list[Layer], views: list[str]) -> dict[str, Any]:
    """How much of the model was compared: `{"compared": N, "total": M, "views": {view: n}, "missing": [first keys
    compared in no view], "failed": [first keys where the backend failed, or did not run, in a view],
    "not_comparable": [first keys whose paths differ, or that the capture could not hold, in a view]}`. A layer counts as compared when a view in `views` (those that should have
    run) measured it."""
    per_view = {v: sum(1 for l in layers if l.metrics.get(v) is not None) for v in views}
    missing = [l.key for l in layers if all(l.metrics.get(v) is None for v in views)]
    paths = [l for l in layers if any(e.startswith(OTHER_VIEW) for e in l.errors.values())]
    failed = [l for l in layers if any(not e.startswith(OTHER_VIEW) for v, e in l.errors.items() if v in views)]
    return {"compared": len(layers) - len(missing), "total": len(layers), "views": per_view, "missing": missing[:20],
            "failed": [l.key for l in failed][:20], "failed_count": len(failed),
            "not_comparable": [l.key for l in paths][:20], "not_comparable_count": len(paths)}


def coverage_text(cov: Mapping[str, Any]) -> str:
    """`20 of 42 layers compared (cumulative view 0 of 42, isolated view 20 of 42)`."""
    views = ", ".join(f"{v} view {n} of {cov['total']}" for v, n in cov["views"].items())
    return f"{cov['compared']} of {cov['total']} layers compared" + (f" ({views})" if views else "")
