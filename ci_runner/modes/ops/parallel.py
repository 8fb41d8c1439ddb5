"""The ops mode's tensor-parallel hook: with `parallel: {tp: N}` on the cell, the collectives and DTensor
redistributions the backend sees are inventoried and probed like any other op (inside the ranks: `tpops.py`).

Its rank task (`tpops.rank_task`, declared in the registry with `rank_part`, its part of the payload) runs in the
cell's one launch of ranks (`procs/ranks.py`), beside the single-rank inventory and probes; after them the mode takes
its value (`ModeContext.ranks().take`) and adds one `unsupported_op` (or `op_mismatch`) per collective call the backend fails on
alone, carrying `parallel: "tpN"` and a repro that starts its own ranks (`workloads/collectives.write_repro`), verified
by running it (it must fail with the same error type and first line); and `data["parallel"]`: the layout, every
collective call (op, shape, dtype, arguments, count, module) with its status and the ranks it had.

The sharded graphs' other ops (rank 0's inventory of them, `tpops.sharded_inventory`) whose signatures the
single-rank inventory lacks (local shapes, and what DTensor itself adds: a vocabulary-sharded embedding's mask and
`index_put`) are probed like the single-rank ones, in this process's probe children (a local op on local shapes
needs no ranks), by the mode's own prober: the same outcomes, findings (`parallel: "tpN"`) and verified one-op
repros (`ops/parallel/ops/`), the same semantics for a probe the backend never ran (inconclusive, not a pass);
`data["parallel"]["ops"]` lists them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ...backends import backend_recipe
from ...config import BackendSpec, spec_to_json
from ...engine.repro import key_text, safe_filename, verify_script
from ...workloads.collectives import write_repro
from ...options import OpsOptions
from ...quoting import shell_command
from ...workloads.parallel import ParallelSpec
from ...registry import FindingKind
from ...results.model import Finding, Repro, fingerprint
from .phases import ProbeFn
from .signature import Inventory

if TYPE_CHECKING:
    from .. import ModeContext

TASK = "ci_runner.modes.ops.tpops:rank_task"  # the mode's `rank_task` (registry.py)


def rank_part(ctx: "ModeContext") -> dict[str, Any]:
    """The ops task's part of the ranks' payload: the backend whose collectives it probes."""
    return {"ops_backend": spec_to_json(ctx.cell.backend)}


def run_tp(ctx: "ModeContext", opts: OpsOptions, single: Inventory, probe: ProbeFn, already: set[str]
           ) -> tuple[list[Finding], dict[str, Any]]:
    """(findings, data) of the cell's collectives on its backend and of the sharded graphs' ops the single-rank
    inventory `single` lacks (probed with `probe`; findings whose fingerprint is in `already` are not repeated);
    data["status"] is "error" when the ranks failed, "inconclusive" when a sharded op's probe never ran."""
    layout = ctx.cell.parallel
    assert layout is not None
    t = time.monotonic()
    folder = ctx.artifact_dir("ops") / "parallel"
    task = ctx.ranks().take("ops")
    data: dict[str, Any] = {"layout": layout.key(), "label": layout.label(), "ranks": task.run.describe()}
    value = task.value
    if value is None:
        data.update(status="error", seconds=round(time.monotonic() - t, 3))
        return [], data
    findings = [collective_finding(row, ctx.cell.backend, ctx.cell.model.id, layout, opts, folder, ctx.cell_dir)
                for row in value["rows"] if row["status"] in ("unsupported", "mismatch")]
    data.update(graphs=value["graphs"], plan=value["plan"],
                collectives=[{**row["call"], "status": row["status"], "ranks": row.get("ranks", [])}
                             for row in value["rows"]])
    ops_found, data["ops"] = sharded_ops(Inventory.from_dict(value["ops"]), single, probe, layout, folder / "ops",
                                         already)
    findings += ops_found
    left = [row for row in value["rows"] if row["status"] == "not_ran"]  # a right result the backend did not run
    if left:
        why = (f"{len(left)} collective probe(s) the backend never ran (inconclusive, not passed): "
               + ", ".join(f"{row['op']} ({row.get('message', '')[:160]})" for row in left))
        data["ops"]["reason"] = "; ".join(filter(None, [why, data["ops"].get("reason")]))
        if data["ops"].get("status") == "pass":
            data["ops"]["status"] = "inconclusive"
    status = "fail" if findings else ("inconclusive" if data["ops"].get("status") in ("inconclusive", "error") else "pass")
    data.update(status=status, seconds=round(time.monotonic() - t, 3))
    return findings, data


def sharded_ops(sharded: Inventory, single: Inventory, probe: ProbeFn, layout: ParallelSpec, folder: Path,
                already: set[str]) -> tuple[list[Finding], dict[str, Any]]:
    """Probe the sharded graphs' signatures that `single` lacks: (findings carrying the layout, `data.parallel.ops`:
    counts, the new signatures, the probe result's status and reason)."""
    known = {s.key for s in single.signatures}
    new = [s for s in sharded.signatures if s.key not in known]
    row: dict[str, Any] = {"signatures": len(sharded.signatures), "new_count": len(new),
                           "new_signatures": [s.describe()[:200] for s in new[:50]], "status": "pass"}
    if not new:
        return [], row
    result = probe(new, "tp", folder)
    row.update(status=result.status, reason=result.reason, probe_counts=result.data.get("probe_counts"),
               probes=[p for p in result.data.get("probes", []) if p.get("status") != "pass"][:50])
    findings = []
    for f in result.findings:
        if f.fingerprint in already:  # the op failed in the single-rank probes too: reported there
            row.setdefault("also_single_rank", []).append(f.op)
            continue
        f.parallel = layout.label()
        f.details["shapes"] = "rank 0's local shapes in the sharded graph"
        findings.append(f)
    return findings, row


def collective_finding(row: Mapping[str, Any], spec: BackendSpec, model_id: str, layout: ParallelSpec,
                       opts: OpsOptions, folder: Path, cell_dir: Path) -> Finding:
    """One failing collective call (a merged row of `workloads/collectives.merge_rows`): the finding, its repro written
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
    f.repro = Repro(path=rel, verified=False, command=shell_command(["python", rel]), note="not verified (options.ops.verify is false)")
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
        expect, error_type = key_text(str(row.get("message") or "")), row.get("error_type")  # past boilerplate
    else:
        expect, error_type = ["MISMATCH"], None
    v = verify_script(script, expect_text=[t for t in expect if t], expect_error_type=error_type, timeout=timeout, env=env)
    return v.verified, v.note, v.output_tail
