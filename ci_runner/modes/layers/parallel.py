"""The layers mode's tensor-parallel hook: with `parallel: {tp: N}` on the cell, the smallest submodule whose
sharded run dies on the backend, on any rank, the ranks named (the search inside the ranks: `tpsearch.py`).

Its rank task (`tpsearch.rank_task`, declared in the registry with `rank_part`, its part of the payload) runs in
the cell's one launch of ranks (`procs/ranks.py`), beside the single-rank search; after the search the mode takes its
value (`ModeContext.ranks().take`) and adds one `layer_failure` per smallest failing module (each carrying `parallel: "tpN"`, the failing ranks in `details.ranks`) and `data["parallel"]`. A rank that
died or hung is one finding naming the rank and the module it was probing (its progress file's last
`probe:<backend>:<module>` step); a rank waiting in a collective for it fails with gloo's timeout, and the hang
report names the ranks that did not arrive. Each finding gets a repro that starts its own ranks and replays the
sharded module (`tprepro.py`), verified by running it; when the ranks died, a recovery launch of ranks of its own
(`store_after_death`: the cell's launch is over by then) that only records stores the module's shards and inputs
first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ...config import spec_to_json
from ...options import LayersOptions
from ...failures.failure import first_line
from ...failures.outcome import ProbeOutcome
from ...procs.ranks import PROGRESS, RANK_TASKS, RankRun, launch_ranks, read_progress
from ...workloads.parallel import ParallelSpec
from ...registry import FindingKind, parse_options
from ...results.model import Finding, fingerprint
from .tprepro import attach_repros
from .tpsearch import PROBE_STEP, STORE_TASK
from .tree import ModuleTree, label, unlabel

if TYPE_CHECKING:
    from .. import ModeContext

TASK = "ci_runner.modes.layers.tpsearch:rank_task"  # the mode's `rank_task` (registry.py)


def rank_part(ctx: "ModeContext") -> dict[str, Any]:
    """The layers task's part of the ranks' payload: the backend it searches, the probes' limit, and where the ranks
    store each smallest failing module's shards and inputs for its repro (``layers/parallel/``)."""
    opts: LayersOptions = parse_options("layers", ctx.options("layers"))
    return {"search_backends": [spec_to_json(ctx.cell.backend)], "probe_timeout": opts.probe_timeout,
            "repro_folder": str(ctx.artifact_dir("layers") / "parallel")}


def run_tp(ctx: "ModeContext", opts: "LayersOptions") -> tuple[list[Finding], dict[str, Any]]:
    """(findings, data) of the cell's tensor-parallel search on its backend, each finding with its repro
    (`tprepro.py`; with `opts.repro`)."""
    layout = ctx.cell.parallel
    assert layout is not None
    t = time.monotonic()
    folder = ctx.artifact_dir("layers") / "parallel"
    task = ctx.ranks().take("layers")
    value, run = task.value, task.run
    found = tp_findings(value, run, ctx.cell.backend.id, ctx.cell.model.id, layout, ctx.ranks().folder("layers"))
    data = {"layout": layout.key(), "label": layout.label(), "ranks": run.describe(),
            "seconds": round(time.monotonic() - t, 3)}
    if found and opts.repro:
        t_repro = time.monotonic()
        stored = dict(value.get("stored") or {}) if value else \
            store_after_death(found, ctx.ranks().task_payload("layers"), world=layout.tp, folder=folder,
                              time_left=ctx.remaining())
        versions = {str(k): str(v) for k, v in (ctx.env.get("backend") or {}).items() if k != "torch"}
        attach_repros(found, stored, spec=ctx.cell.backend, layout=layout, model_id=ctx.cell.model.id, folder=folder,
                      cell_dir=ctx.cell_dir, opts=opts, time_left=ctx.remaining(), versions=versions)
        data["repro_seconds"] = round(time.monotonic() - t_repro, 3)
    if value:
        res = value["backends"].get(ctx.cell.backend.id, {})
        data.update(minimal=[label(n) for n in res.get("minimal", [])], complete=res.get("complete"),
                    probed=len(res.get("outcomes", {})), plan=value.get("plan"))
    return found, data


def store_after_death(found: Sequence[Finding], payload: Mapping[str, Any], *, world: int, folder: Path,
                      time_left: float) -> dict[str, Any]:
    """The ranks died in a probe, before they stored anything: a recovery launch, ranks of their own (the cell's one
    launch is over), record the module they were probing (`tpsearch.store_task`: no probe, one eager forward), so
    the repro can replay it. `payload` is what the search task was given (`CellRanks.task_payload`)."""
    names = [unlabel(f.module) for f in found if f.module]
    if not names or time_left < 60.0:
        return {}
    # its own progress files (the search's keep where the ranks died); the module files go where the search's would
    run = launch_ranks(RANK_TASKS, {**payload, "tasks": [STORE_TASK], "store_modules": names,
                                    "repro_folder": str(folder)}, world=world, folder=Path(folder) / "store",
                       timeout=max(60.0, min(300.0, time_left - 30.0)))
    if not (run.ok and run.results and run.results[0].value):
        for f in found:
            f.details["repro_note"] = f"no repro: the ranks that store the module's shards failed: {run.describe()}"
        return {}
    return dict(run.results[0].value[STORE_TASK].get("stored") or {})


def tp_findings(value: Mapping[str, Any] | None, run: RankRun, backend_id: str, model_id: str,
                layout: ParallelSpec, folder: Any) -> list[Finding]:
    """One `layer_failure` per smallest failing module of rank 0's answer; or, when a rank died or hung, one
    naming the ranks and the module being probed."""
    if value is None:
        return [_dead_ranks(run, backend_id, model_id, layout, folder)]
    res = value["backends"].get(backend_id) or {}
    tree = ModuleTree.from_json(value["tree"])
    outcomes = {n: ProbeOutcome.from_json(o) for n, o in (res.get("outcomes") or {}).items()}
    return [_layer_finding(tree, outcomes[n], list(res.get("ranks", {}).get(n, [])), backend_id, model_id, layout,
                           dict(value.get("plan") or {})) for n in res.get("minimal", [])]


def _layer_finding(tree: ModuleTree, o: ProbeOutcome, ranks: Sequence[int], backend_id: str, model_id: str,
                   layout: ParallelSpec, plan: Mapping[str, str]) -> Finding:
    who = "every rank" if len(ranks) == layout.tp else "rank" + ("s " if len(ranks) > 1 else " ") + \
        ", ".join(map(str, ranks))
    node = tree.nodes[o.name]
    message = (f"{label(o.name)} ({layout.label()}, on {who}) fails alone on the backend: "
               f"{o.error_type}: {first_line(o.message, 600)}")
    return Finding(kind=FindingKind.LAYER_FAILURE, stage=o.stage or "run", message=message, module=label(o.name),
                   module_class=node.module_class, error_type=o.error_type, parallel=layout.label(),
                   fingerprint=fingerprint(FindingKind.LAYER_FAILURE, backend_id, model_id, layout.label(), o.name),
                   details={"plan": dict(plan), "tp": layout.tp, "ranks": list(ranks), "status": o.status,
                            "path": [label(p) for p in tree.path(o.name)], "message_full": o.message[:4000],
                            "traceback": o.traceback[-3000:]})


def _dead_ranks(run: RankRun, backend_id: str, model_id: str, layout: ParallelSpec, folder: Any) -> Finding:
    """The ranks did not all finish: the module each failed rank was probing (its last progress step); a rank whose
    probe watchdog fired (faulthandler's "Timeout (…)!" in `rank<r>.progress.faults`) hung there."""
    prefix = PROBE_STEP.format(backend=backend_id, module="")
    where: dict[int, str] = {}
    hung_ranks: set[int] = set()
    for r, _ in run.failed():
        steps = read_progress(folder, r)
        if steps and steps[-1].startswith(prefix):
            where[r] = steps[-1][len(prefix):]
        if _watchdog_fired(Path(folder) / f"{PROGRESS.format(rank=r)}.faults"):
            hung_ranks.add(r)
    module = next(iter(where.values()), "")
    words = "; ".join(f"rank {r} {'hung (probe_timeout) in' if r in hung_ranks else 'was probing'} {m}"
                      for r, m in where.items())
    message = f"the {layout.label()} search did not finish: {run.describe()}" + (f" ({words})" if words else "")
    hung = bool(hung_ranks) or run.hang is not None or any(r.status == "timeout" for _, r in run.failed())
    return Finding(kind=FindingKind.LAYER_FAILURE, stage="run", message=message, module=module or None,
                   parallel=layout.label(),
                   fingerprint=fingerprint(FindingKind.LAYER_FAILURE, backend_id, model_id, layout.label(),
                                           module or "ranks"),
                   details={"tp": layout.tp, "plan": dict(layout.plan), "hang": run.hang,
                            "status": "timeout" if hung else "crashed",
                            "ranks": sorted(where) or [r for r, _ in run.failed()]})


def _watchdog_fired(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(64).startswith("Timeout (")
    except OSError:
        return False
