"""The ops mode's tensor-parallel hook: with `parallel: {tp: N}` on the cell, the collectives and DTensor
redistributions the backend sees are inventoried and probed like any other op (inside the ranks: `tpops.py`).

It runs after the single-rank inventory and probes, in ranks of its own (`engine/parallel.rank_tasks` with the
`tpops.rank_task` task), and adds one `unsupported_op` (or `op_mismatch`) per collective call the backend fails on
alone, carrying `parallel: "tpN"` and a repro that starts its own ranks (`engine/tpprobe.write_repro`), verified
by running it (it must fail with the same error type and first line); and `data["parallel"]`: the layout, every
collective call (op, shape, dtype, arguments, count, module) with its status and the ranks it had.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...backends import backend_recipe
from ...config import BackendSpec, spec_to_json
from ...engine.failure import first_line
from ...engine.parallel import RANK_TASKS, launch_ranks
from ...engine.repro import safe_filename, verify_script
from ...engine.tpprobe import write_repro
from ...options import OpsOptions
from ...parallel import ParallelSpec
from ...registry import FindingKind
from ...results.model import Finding, Repro, fingerprint

if TYPE_CHECKING:
    from .. import ModeContext

TASK = "ci_runner.modes.ops.tpops:rank_task"


def run_tp(ctx: "ModeContext", opts: OpsOptions) -> tuple[list[Finding], dict[str, Any]]:
    """(findings, data) of the cell's collectives on its backend; data["status"] is "error" when the ranks failed."""
    layout = ctx.cell.parallel
    assert layout is not None
    t = time.monotonic()
    folder = ctx.artifact_dir("ops") / "parallel"
    payload = {"model": spec_to_json(ctx.cell.model), "inputs": spec_to_json(ctx.cell.inputs),
               "parallel": layout.key(), "tasks": [TASK], "ops_backend": spec_to_json(ctx.cell.backend)}
    run = launch_ranks(RANK_TASKS, payload, world=layout.tp, folder=folder, timeout=max(60.0, ctx.remaining() - 10.0))
    data: dict[str, Any] = {"layout": layout.key(), "label": layout.label(), "ranks": run.describe()}
    value = run.results[0].value[TASK] if run.ok and run.results[0].value else None
    if value is None:
        data.update(status="error", seconds=round(time.monotonic() - t, 3))
        return [], data
    findings = [collective_finding(row, ctx.cell.backend, ctx.cell.model.id, layout, opts, folder, ctx.cell_dir)
                for row in value["rows"] if row["status"] != "ok"]
    data.update(status="fail" if findings else "pass", graphs=value["graphs"], plan=value["plan"],
                collectives=[{**row["call"], "status": row["status"], "ranks": row.get("ranks", [])}
                             for row in value["rows"]], seconds=round(time.monotonic() - t, 3))
    return findings, data


def collective_finding(row: Mapping[str, Any], spec: BackendSpec, model_id: str, layout: ParallelSpec,
                       opts: OpsOptions, folder: Path, cell_dir: Path) -> Finding:
    """One failing collective call (a merged row of `engine/tpprobe.merge_rows`): the finding, its repro written
    into `folder` and (with `opts.verify`) verified."""
    call = row["call"]
    unsupported = row["status"] == "unsupported"
    kind = FindingKind.UNSUPPORTED_OP if unsupported else FindingKind.OP_MISMATCH
    shape = "x".join(map(str, call["shape"])) or "scalar"
    message = (f"{row['op']} ({layout.label()}, {call['dtype']}[{shape}], ranks {', '.join(map(str, row['ranks']))}): "
               f"{row.get('error_type') or row['status']}: {row.get('message')}")
    key = f"{row['op']}:{call['dtype']}:{shape}:{call['args']}"
    f = Finding(kind=kind, stage=str(row.get("stage") or "compile") if unsupported else "compare", message=message,
                op=row["op"], error_type=row.get("error_type"), parallel=layout.label(), module=call.get("module") or None,
                fingerprint=fingerprint(kind, spec.id, model_id, layout.label(), row["op"]),
                details={"tp": layout.tp, "call": dict(call), "ranks": list(row.get("ranks", [])), "key": key})
    name = f"repro_{safe_filename(row['op'].split('.')[1])}_{safe_filename(shape)}.py"
    script = write_repro(folder / name, call, spec, status=kind, world=layout.tp, error_type=row.get("error_type") or "",
                         message=str(row.get("message")), model_id=model_id, layout=layout.label())
    rel = str(script.relative_to(cell_dir))
    f.repro = Repro(path=rel, verified=False, command=f"python {rel}", note="not verified (options.ops.verify is false)")
    if opts.verify:
        f.repro.verified, f.repro.note, tail = verify(script, row, spec, opts.verify_timeout)
        f.details["repro_output_tail"] = tail[-1500:]
    return f


def verify(script: Path, row: Mapping[str, Any], spec: Any, timeout: float) -> tuple[bool, str, str]:
    """Run the repro: verified when it fails with the probe's error type and first line (a mismatch: prints
    MISMATCH)."""
    recipe = backend_recipe(spec)
    env = {str(k): str(v) for k, v in recipe.env.items()}
    if recipe.pythonpath:
        env["PYTHONPATH"] = ":".join(recipe.pythonpath)
    if row["status"] == "unsupported":
        expect, error_type = [first_line(str(row.get("message") or ""), 120)], row.get("error_type")
    else:
        expect, error_type = ["MISMATCH"], None
    v = verify_script(script, expect_text=[t for t in expect if t], expect_error_type=error_type, timeout=timeout, env=env)
    return v.verified, v.note, v.output_tail
