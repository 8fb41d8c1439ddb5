"""The numerics mode's tensor-parallel hook: with `parallel: {tp: N}` on the cell, the sharded model on the backend,
layer by layer, against one rank (the method: `ci_runner/modes/numerics/tpcompare.py`, docs/parallel.md).

Its rank task (`modes/numerics/tprank.rank_task`, declared in the registry with `rank_part`, its part of the payload) runs
in the cell's one launch of ranks (`procs/ranks.py`: started by the cell's first mode with a rank task, at the
latest when this mode starts: `start_parallel`) while the single-rank comparison runs: it needs nothing from it
(each rank builds the model and its references itself), so the cell waits only for what is left of it when its
single-rank part is done (`PendingParallel.finish`). It adds its
findings (each carrying `parallel: "tpN"`) and `data["parallel"]`: the layout, the status, the per-layer rows,
the ranks' outcome, the process group they ran over (`process_group`: c10d's name for it in the ranks, and the
mesh's device type) and the seconds (`seconds`: from the launch's start until every rank finished the task;
`waited_s`: the part the cell waited for after its single-rank comparison). `options.numerics.timeout`, when set,
bounds how long after the launch's start the mode waits for its task. The samples are the thresholds' (`thresholds.samples`, else max(2,
`inputs.samples`)).

A sharded layer's `divergence` gets a repro that starts its own ranks (`tprepro.py`: the ranks store the layer's
shards and inputs in ``numerics/parallel/<module>/``, `layer_repro` writes and verifies `repro.py` there); a refused
collective gets `collective_repro`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...config import BackendSpec
from ...workloads.collectives import PLAN_CALLS, write_repro
from ...procs.ranks import RankRun, TaskRun
from .repro import attach, too_late
from .tpcompare import analyse, rank_part as rank_part_of
from .tprepro import tp_repro
from ...options import NumericsOptions
from ...quoting import shell_command
from ...workloads.parallel import ParallelSpec
from ...registry import FindingKind, parse_options
from ...results.model import Finding, Repro, fingerprint

if TYPE_CHECKING:
    from .. import ModeContext

MAX_ROWS = 200


def rank_part(ctx: "ModeContext") -> dict[str, Any]:
    """The numerics task's part of the ranks' payload: the backend and the samples (the thresholds')."""
    opts: NumericsOptions = parse_options("numerics", ctx.options("numerics"))
    samples = list(range(opts.thresholds.samples or max(2, ctx.cell.inputs.samples)))
    return rank_part_of([ctx.cell.backend], samples=samples, thresholds=opts.thresholds,
                        repro_folder=str(repro_folder(ctx)))


class PendingParallel:
    """The numerics task in the cell's ranks (`ModeContext.ranks()`), launched at the latest when the mode starts and
    running beside the single-rank comparison (`start_parallel`); `finish` waits for the task and turns rank 0's
    value into (findings, data)."""

    def __init__(self, ctx: "ModeContext", opts: NumericsOptions) -> None:
        self.ctx, self.opts = ctx, opts
        ctx.ranks().start("numerics")

    def wait(self) -> None:
        """Wait for the numerics task (the mode's own time limit, `opts.timeout`, as its ranks had it)."""
        self._take()

    def _take(self) -> TaskRun:
        limit = self.opts.timeout - 10.0 if self.opts.timeout else None
        return self.ctx.ranks().take("numerics", limit=max(60.0, limit) if limit is not None else None)

    def finish(self) -> tuple[list[Finding], dict[str, Any]]:
        """(findings, data) of the cell's tensor-parallel run on its backend, once the ranks are done with it."""
        task = self._take()
        return _result(self.ctx, self.opts, task.run, task.value, seconds=task.seconds, waited=task.waited)


def start_parallel(ctx: "ModeContext", opts: NumericsOptions) -> PendingParallel:
    """The cell's TP ranks, launched now unless the cell's launch already runs (they run beside the single-rank
    comparison); `finish()` for the result."""
    return PendingParallel(ctx, opts)


def _result(ctx: "ModeContext", opts: NumericsOptions, run: RankRun, value: dict[str, Any] | None, *,
            seconds: float, waited: float) -> tuple[list[Finding], dict[str, Any]]:
    layout = ctx.cell.parallel
    assert layout is not None
    data: dict[str, Any] = {"layout": layout.key(), "label": layout.label(), "ranks": run.describe(),
                            "seconds": round(seconds, 3), "waited_s": round(waited, 3),
                            "process_group": declared_group(layout)}
    if value is None:
        data["status"] = "error"
        message = f"the {layout.label()} run did not finish: {run.describe()}"
        f = Finding(kind=FindingKind.LAYER_FAILURE, stage="run", message=message, parallel=layout.label(),
                    fingerprint=fingerprint(FindingKind.LAYER_FAILURE, ctx.cell.backend.id, ctx.cell.model.id,
                                            layout.label(), "ranks"),
                    details={"plan": dict(layout.plan), "tp": layout.tp, "hang": run.hang})
        return [f], data
    result = analyse(value, ctx.cell.backend.id, model_id=ctx.cell.model.id, parallel=layout, opts=opts.thresholds)
    data.update(status=result.status, plan=value.get("plan"), reason=result.reason, layers=result.layers[:MAX_ROWS],
                weights_checked=len(value.get("weights") or []),
                process_group=value.get("process_group") or data["process_group"])  # as c10d named it in the ranks
    stored = dict(value.get("stored") or {}).get(ctx.cell.backend.id)
    for f in result.findings:
        if f.op and f.op.startswith("_c10d_functional."):
            f.repro = collective_repro(ctx, f, ctx.cell.backend)
        elif f.kind == FindingKind.DIVERGENCE and f.repro is None:
            attach(f, lambda: layer_repro(ctx, opts, f, stored))
    return result.findings, data


def repro_folder(ctx: "ModeContext") -> Path:
    """Where the ranks store each divergent layer's shards and inputs, and its repro goes: ``numerics/parallel/``
    (made by the ranks, only when they store one: a clean cell writes nothing)."""
    return ctx.cell_dir / "numerics" / "parallel"


def layer_repro(ctx: "ModeContext", opts: NumericsOptions, f: Finding, stored: Mapping[str, Any] | None) -> Repro | str:
    """The repro of a sharded layer's divergence (`tprepro.tp_repro`), verified within `numerics.verify_timeout` and a
    quarter of the cell's time left; or why it has none."""
    if (late := too_late(ctx)) is not None:
        return late
    layout = ctx.cell.parallel
    assert layout is not None
    return tp_repro(f, stored, spec=ctx.cell.backend, layout=layout, model_id=ctx.cell.model.id,
                    folder=repro_folder(ctx), cell_dir=ctx.cell_dir, verify=opts.verify,
                    timeout=min(opts.verify_timeout, ctx.remaining() * 0.25))


def declared_group(layout: ParallelSpec) -> dict[str, str]:
    """The process group the cell's ranks join (the backend's `process_group`, else gloo on CPU)."""
    group = layout.process_group
    return {"name": layout.group_name, "device": group.device.split(":")[0] if group is not None else "cpu"}


def collective_repro(ctx: "ModeContext", f: Finding, spec: BackendSpec) -> Repro:
    """A standalone script that starts its own ranks and compiles the collective of `f` alone on the backend
    (`workloads/collectives.write_repro`; verified by the ops mode's TP hook, which probes the same calls)."""
    layout = ctx.cell.parallel
    assert layout is not None and f.op is not None
    call = f.details.get("call") or next(c for c in PLAN_CALLS if c["op"] == f.op)
    name = f"repro_{f.op.split('.')[1]}.py"
    path = write_repro(ctx.artifact_dir("numerics") / name, call, spec, status=f.kind, world=layout.tp,
                       error_type=f.error_type or "", message=f.message, model_id=ctx.cell.model.id,
                       layout=layout.label())
    return Repro(path=str(path.relative_to(ctx.cell_dir)), verified=False, command=shell_command(["python", f"numerics/{name}"]),
                 note="not run here: the ops mode's TP hook verifies the repro of each collective it finds")
