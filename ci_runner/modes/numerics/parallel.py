"""The numerics mode's tensor-parallel hook: with `parallel: {tp: N}` on the cell, the sharded model on the backend,
layer by layer, against one rank (the method: `ci_runner/numerics/parallel.py`, docs/parallel.md).

Its ranks (`engine/parallel.launch_ranks`) start with the mode (`start_parallel`) and run while the single-rank
comparison runs: they need nothing from it (each rank builds the model and its references itself), so the cell
waits only for what is left of them when its single-rank part is done (`PendingParallel.finish`). It adds its
findings (each carrying `parallel: "tpN"`) and `data["parallel"]`: the layout, the status, the per-layer rows,
the ranks' outcome, the process group they ran over (`process_group`: c10d's name for it in the ranks, and the
mesh's device type) and the seconds (`seconds`: the ranks' wall time; `waited_s`: the part the cell waited for
after its single-rank comparison). The samples are the thresholds' (`thresholds.samples`, else max(2,
`inputs.samples`)).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from ...config import BackendSpec
from ...engine.tpprobe import PLAN_CALLS, write_repro
from ...engine.parallel import RankRun
from ...numerics.parallel import analyse, run_ranks
from ...options import NumericsOptions
from ...quoting import shell_command
from ...workloads.parallel import ParallelSpec
from ...registry import FindingKind
from ...results.model import Finding, Repro, fingerprint

if TYPE_CHECKING:
    from .. import ModeContext

MAX_ROWS = 200


class PendingParallel:
    """The cell's TP ranks, launched in a thread of their own beside the single-rank comparison (`start_parallel`);
    `finish` waits for them and turns rank 0's value into (findings, data)."""

    def __init__(self, ctx: "ModeContext", opts: NumericsOptions) -> None:
        self.ctx, self.opts = ctx, opts
        self.t0 = time.monotonic()
        self.seconds = 0.0
        self.outcome: tuple[RankRun, dict[str, Any] | None] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._launch, name="deepview-tp-numerics", daemon=True)
        self.thread.start()

    def _launch(self) -> None:
        ctx, opts = self.ctx, self.opts
        layout = ctx.cell.parallel
        assert layout is not None
        try:
            samples = list(range(opts.thresholds.samples or max(2, ctx.cell.inputs.samples)))
            timeout = max(60.0, min(opts.timeout or ctx.remaining(), ctx.remaining()) - 10.0)
            self.outcome = run_ranks(ctx.cell.model, ctx.cell.inputs, layout, [ctx.cell.backend], samples=samples,
                                     folder=ctx.artifact_dir("numerics") / "parallel", timeout=timeout)
        except BaseException as exc:  # raised again by `finish`, in the mode's own thread
            self.error = exc
        finally:
            self.seconds = time.monotonic() - self.t0

    def wait(self) -> float:
        """Wait for the ranks; the seconds waited."""
        t = time.monotonic()
        self.thread.join()
        return time.monotonic() - t

    def finish(self) -> tuple[list[Finding], dict[str, Any]]:
        """(findings, data) of the cell's tensor-parallel run on its backend, once the ranks are done."""
        waited = self.wait()
        if self.error is not None:
            raise self.error
        assert self.outcome is not None
        return _result(self.ctx, self.opts, *self.outcome, seconds=self.seconds, waited=waited)


def start_parallel(ctx: "ModeContext", opts: NumericsOptions) -> PendingParallel:
    """Launch the cell's TP ranks now (they run beside the single-rank comparison); `finish()` for the result."""
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
    for f in result.findings:
        if f.op and f.op.startswith("_c10d_functional."):
            f.repro = collective_repro(ctx, f, ctx.cell.backend)
    return result.findings, data


def declared_group(layout: ParallelSpec) -> dict[str, str]:
    """The process group the cell's ranks join (the backend's `process_group`, else gloo on CPU)."""
    group = layout.process_group
    return {"name": layout.group_name, "device": group.device.split(":")[0] if group is not None else "cpu"}


def collective_repro(ctx: "ModeContext", f: Finding, spec: BackendSpec) -> Repro:
    """A standalone script that starts its own ranks and compiles the collective of `f` alone on the backend
    (`engine/tpprobe.write_repro`; verified by the ops mode's TP hook, which probes the same calls)."""
    layout = ctx.cell.parallel
    assert layout is not None and f.op is not None
    call = f.details.get("call") or next(c for c in PLAN_CALLS if c["op"] == f.op)
    name = f"repro_{f.op.split('.')[1]}.py"
    path = write_repro(ctx.artifact_dir("numerics") / name, call, spec, status=f.kind, world=layout.tp,
                       error_type=f.error_type or "", message=f.message, model_id=ctx.cell.model.id,
                       layout=layout.label())
    return Repro(path=str(path.relative_to(ctx.cell_dir)), verified=False, command=shell_command(["python", f"numerics/{name}"]),
                 note="not run here: the ops mode's TP hook verifies the repro of each collective it finds")
