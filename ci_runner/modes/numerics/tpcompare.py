"""Numerics under tensor parallelism: the sharded model on a backend, layer by layer, against one rank.

The ranks run `modes/numerics/tprank.rank_task` (the numerics mode's rank task, in the cell's one launch:
`procs/ranks.py`; `rank_part` its part of the payload); `analyse` turns rank 0's records into per-layer rows,
thresholds and findings:

* thresholds as `modes/numerics/thresholds.py` derives them (`threshold_from_stats`: margin × percentile over samples,
  with floors), from the spread of two references: the single-rank float64 reference and the plan run eagerly
  (float32, sharded the same way), each against the single-rank float32 primary;
* the first module call (in call order) over its threshold is the divergence, its verdict the signature
  `modes/numerics/tpsignature.classify` names from the measured facts; every later one is listed in its details;
* each weight shard that differs from its slice of the single-rank weight is a `weights_mismatch`;
* a backend that failed on a rank is one finding naming the rank (the run's `hang` names ranks that did not
  arrive);
* a module call the backend did not run (it left the sharded model, or everything but its output, to PyTorch on
  some rank: `not_ran` records) is inconclusive, never a pass, as in the single-rank mode.

Findings carry `parallel` ("tp2") and the plan in `details.plan`; their fingerprints include the layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ...config import BackendSpec, InputSpec, ModelSpec, spec_to_json
from ...options import ThresholdOptions
from ...workloads.parallel import ParallelSpec
from ...registry import FindingKind
from ...results.model import Finding, fingerprint
from .thresholds import LayerStats, exceeded, threshold_from_stats
from .tpsignature import SIGNATURES, classify

TASK = "ci_runner.modes.numerics.tprank:rank_task"  # a task of procs/ranks.rank_tasks


@dataclass
class TPAnalysis:
    """One backend's result under tensor parallelism: findings, the per-layer table, the status."""

    status: str  # pass | fail | inconclusive (module calls the backend did not run: `not_ran` rows) | error
    findings: list[Finding] = field(default_factory=list)
    layers: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None


def rank_part(backends: Sequence[BackendSpec], *, samples: Sequence[int], thresholds: ThresholdOptions | None = None,
              repro_folder: str | None = None) -> dict[str, Any]:
    """The numerics task's own part of a launch's payload: the backends it runs in turn, the samples, the threshold
    options (rank 0 finds each backend's divergence with them, so the ranks store its layer for the repro) and
    where the ranks store it (`numerics_repro_folder`; default: the launch folder's `numerics_repro/`)."""
    part = {"backends": [spec_to_json(b) for b in backends], "samples": list(samples),
            "thresholds": (thresholds or ThresholdOptions()).as_dict()}
    return {**part, "numerics_repro_folder": repro_folder} if repro_folder else part


def rank_payload(model: ModelSpec, inputs: InputSpec, parallel: ParallelSpec, backends: Sequence[BackendSpec], *,
                 samples: Sequence[int], thresholds: ThresholdOptions | None = None) -> dict[str, Any]:
    """A whole payload of a launch of `procs/ranks.rank_tasks` running this task alone (others may be added)."""
    return {"model": spec_to_json(model), "inputs": spec_to_json(inputs), "parallel": parallel.key(),
            "tasks": [TASK], **rank_part(backends, samples=samples, thresholds=thresholds)}


def layer_thresholds(records: Sequence[Mapping[str, Any]], eager: Sequence[Mapping[str, Any]],
                     opts: ThresholdOptions) -> dict[str, dict[str, float]]:
    """Per call key: the threshold from the float64 reference's and the eager plan's spread around the primary,
    over every sample the eager plan ran (the compiled run may take fewer: `tprank.same_shapes`); `records`, the
    compiled run's, add a key the eager plan lacks."""
    stats: dict[str, LayerStats] = {}
    planned = {e.get("key") for e in eager}
    for plan, rows in ((True, eager), (False, [r for r in records if r.get("key") not in planned])):
        for r in rows:
            if "spread" not in r:
                continue
            s = stats.setdefault(r["key"], LayerStats(module_class="", name=r["key"]))
            s.add("cumulative", {**r["spread"], "ref_absmean": r.get("ref_absmean", 0.0)})
            if plan and r.get("metrics"):  # the plan run eagerly against the single-rank primary
                s.add("cumulative", {**r["metrics"], "ref_absmean": r.get("ref_absmean", 0.0)})
    return {k: threshold_from_stats(s.views["cumulative"], opts, "float32") for k, s in stats.items()}


def layer_rows(records: Sequence[Mapping[str, Any]], thresholds: Mapping[str, Mapping[str, float]],
               tp: int) -> list[dict[str, Any]]:
    """One row per call key, in call order: the worst sample's metrics, facts, the metrics over threshold and the
    signature."""
    rows: dict[str, dict[str, Any]] = {}
    for r in sorted(records, key=lambda r: (r["order"], r["sample"])):
        row = rows.setdefault(r["key"], {"module": r["key"], "order": r["order"], "over": [], "error": None})
        if "not_ran" in r:  # the backend did not run it: inconclusive, never a pass
            row["not_ran"] = r["not_ran"]
            continue
        if "error" in r:
            row["error"] = r["error"]
            continue
        over = exceeded(r["metrics"], thresholds.get(r["key"], {}))
        if over and not row["over"] or "metrics" not in row:
            row.update(metrics=r["metrics"], facts=r["facts"], over=over, sample=r["sample"],
                       threshold=dict(thresholds.get(r["key"], {})), signature=classify(r["facts"], tp) if over else None)
    return list(rows.values())


def rows_and_bad(records: Sequence[Mapping[str, Any]], eager: Sequence[Mapping[str, Any]], opts: ThresholdOptions,
                 tp: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(every row, the rows over their threshold or in error, in call order) of one backend's compiled records: the
    first bad row is the divergence (`analyse`), and the module whose inputs and shards the ranks store for its
    repro (`tprank`)."""
    rows = layer_rows(records, layer_thresholds(records, eager, opts), tp)
    return rows, [r for r in rows if r["over"] or r["error"]]


def analyse(value: Mapping[str, Any], backend_id: str, *, model_id: str, parallel: ParallelSpec,
            opts: ThresholdOptions) -> TPAnalysis:
    """Findings of one backend from rank 0's value (see the module docstring)."""
    run = value["backends"][backend_id]
    plan = dict(value.get("plan") or {})
    weights = _weights_findings(value.get("weights") or [], backend_id, model_id, parallel, plan)
    if run.get("status") != "ok":
        failed = _failure_findings(run, backend_id, model_id, parallel, plan)
        return TPAnalysis(status="fail", findings=weights + failed, reason=failed[0].message)
    rows, bad = rows_and_bad(run["records"], value["eager"], opts, parallel.tp)
    findings = weights + ([_divergence(bad, backend_id, model_id, parallel, plan)] if bad else [])
    unran = [r for r in rows if r.get("not_ran")]
    reason = (f"{len(unran)} of {len(rows)} module call(s) not run on the backend under {parallel.label()} "
              f"(inconclusive, not passed): {unran[0]['not_ran']}") if unran else None
    status = "fail" if findings else "inconclusive" if unran else "pass"
    return TPAnalysis(status=status, findings=findings, layers=rows, reason=reason)


def _failure_findings(run: Mapping[str, Any], backend_id: str, model_id: str, parallel: ParallelSpec,
                      plan: Mapping[str, str]) -> list[Finding]:
    """A backend that failed on the sharded model: one `unsupported_op` per collective it cannot compile alone
    (`workloads/collectives.py`), else one `layer_failure` naming the rank and the error."""
    out = []
    for row in run.get("collectives") or []:
        if row.get("status") in ("unsupported", "mismatch"):
            kind = FindingKind.UNSUPPORTED_OP if row["status"] == "unsupported" else FindingKind.OP_MISMATCH
            f = _finding(kind, backend_id, model_id, parallel, plan, module="", key=row["op"],
                         stage="compile" if row["status"] == "unsupported" else "compare",
                         message=f"{row['op']} alone ({parallel.label()}, rank {run.get('rank')}): "
                                 f"{row.get('error_type') or row['status']}: {row.get('message')}")
            f.op = row["op"]
            f.error_type = row.get("error_type")
            f.details["model_error"] = f"{run.get('error_type')}: {run.get('message')}"
            if row.get("call"):
                f.details["call"] = dict(row["call"])
            out.append(f)
    if out:
        return out
    return [_finding(FindingKind.LAYER_FAILURE, backend_id, model_id, parallel, plan, module="",
                     stage=str(run.get("stage") or "run"),
                     message=f"the sharded model failed on rank {run.get('rank')}: {run.get('error_type')}: "
                             f"{run.get('message')}")]


def _divergence(bad: list[dict[str, Any]], backend_id: str, model_id: str, parallel: ParallelSpec,
                plan: Mapping[str, str]) -> Finding:
    first = bad[0]
    sig = first.get("signature")
    words = SIGNATURES[sig] if sig else "diverges from the single-rank reference"
    facts = first.get("facts") or {}
    shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in facts.items())
    message = (f"{first['module']} ({parallel.label()}): {words}" + (f" [{shown}]" if shown else "")
               if not first["error"] else f"{first['module']} ({parallel.label()}): {first['error']}")
    f = _finding(FindingKind.DIVERGENCE, backend_id, model_id, parallel, plan, module=first["module"],
                 stage="compare", message=message)
    f.metrics = dict(first.get("metrics") or {})
    f.threshold = dict(first.get("threshold") or {})
    f.details.update(signature=sig, facts=facts, later=[r["module"] for r in bad[1:20]], later_total=len(bad) - 1)
    return f


def _weights_findings(rows: Sequence[Mapping[str, Any]], backend_id: str, model_id: str, parallel: ParallelSpec,
                      plan: Mapping[str, str]) -> list[Finding]:
    out = []
    for row in rows:
        if row.get("equal"):
            continue
        out.append(_finding(FindingKind.WEIGHTS_MISMATCH, backend_id, model_id, parallel, plan,
                            module=str(row["param"]).rsplit(".", 1)[0], stage="compare", key=f"rank{row['rank']}",
                            message=f"{row['param']} on rank {row['rank']}: its shard differs from the single-rank "
                                    f"weight's slice along dim {row['dim']} (weights sharded wrong)"))
    return out


def _finding(kind: str, backend_id: str, model_id: str, parallel: ParallelSpec, plan: Mapping[str, str], *,
             module: str, stage: str, message: str, key: str = "") -> Finding:
    return Finding(kind=kind, stage=stage, message=message, module=module or None, parallel=parallel.label(),
                   fingerprint=fingerprint(kind, backend_id, model_id, parallel.label(), module, key),
                   details={"plan": dict(plan), "tp": parallel.tp})
