"""Ops per phase (`inputs.phases`): what the backend is given only in generation, probed in its regime.

Each phase runs on the CPU model as users run it (`workloads/calls.py`), through `torch.compile` with the
backend's `compile_options` and a recording compiler at the ATen level (after aot_autograd, as the single
forward's `aot` inventory): every graph of every call, recompiles included. From them:
- the phase's **inventory**, and the signatures the single forward never had (cache writes such as `index_copy`,
  one-token attention, padded-batch masks). Those are probed like the forward's, in isolated children, with the
  probe store and repros of `modes/ops`;
- the **regime** of a padded phase: an attention op's mask gets a fully-masked query row (`masked_rows`), as the
  padded queries of a left-padded batch have; eager SDPA returns 0 there, a backend without safe softmax NaN;
- the **symbolic-shape functions** a dynamic recompile hands the backend (`torch.sym_max` from a sliding-window
  mask, …). Each is probed by its repro (`repro_symbolic.py.j2`: the smallest function that calls it on a dynamic
  size), run in a fresh process: the probe and the verification are the same run.
Findings carry their `phase`; an op that already failed in the single forward is not reported twice.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ...backends import backend_recipe
from ...engine.repro import (render_template, run_command, safe_filename, template_backend,
                               verify_script, write_script)
from ...watch.hooks import aten_recording
from ...workloads.calls import run_phase, symbolic_functions
from ...options import OpsOptions
from ...workloads.phases import Phase
from ...results.model import Finding, ModeResult, Repro, fingerprint
from .inventory import inventory_of_graphs
from .signature import Inventory, OpSignature, signature_key

if TYPE_CHECKING:
    from .. import ModeContext

MODE = "ops"
ATTENTION = ("scaled_dot_product", "_safe_softmax")
# probes new signatures (method: "phase", "tp") with the forward's prober, writing under the folder; the findings'
# repro paths are relative to the cell (`mode._prober`)
ProbeFn = Callable[[Sequence[OpSignature], str, Path], ModeResult]


def record_phase_graphs(ctx: "ModeContext", phase: Phase) -> tuple[list[torch.fx.GraphModule], list[str]]:
    """Every ATen graph the backend would be given over the phase's calls, and the calls that failed on CPU."""
    loaded = ctx.model()
    options = {k: v for k, v in ctx.cell.backend.compile_options.items() if k in ("dynamic", "fullgraph")}
    with aten_recording(copy.deepcopy(loaded.module), **options) as (fn, graphs):
        run = run_phase(fn, loaded, ctx.cell.inputs, phase, keep_going=False)
    return graphs, [f"{r.label}: {r.error}" for r in run.records if r.error]


def _is_attention(op: str) -> bool:
    return any(a in op for a in ATTENTION)


def with_masked_rows(sig: OpSignature) -> OpSignature | None:
    """The attention signature with its mask's first query row fully masked (None when it takes no mask)."""
    args, kwargs = copy.deepcopy(sig.args), copy.deepcopy(sig.kwargs)
    mask = kwargs.get("attn_mask")
    if mask is None and len(args) > 3:
        mask = args[3]
    body = mask.get("__tensor__") if isinstance(mask, dict) else None
    if not isinstance(body, dict) or len(body.get("shape") or ()) < 2:
        return None
    body["masked_rows"] = [0]
    key = signature_key(sig.op, args, kwargs, sig.outputs)
    return replace(sig, args=args, kwargs=kwargs, key=key, sites=list(sig.sites))


def phase_signatures(phase: Phase, inventory: Inventory, known: set[str]) -> list[OpSignature]:
    """The phase's signatures the single forward did not have, in the phase's regime."""
    out = []
    for sig in inventory.signatures:
        if phase.name == "batch" and _is_attention(sig.op):
            masked = with_masked_rows(sig)
            if masked is not None:
                sig = masked
        if sig.key not in known:
            out.append(sig)
    return out


def run_phases(ctx: "ModeContext", opts: OpsOptions, forward: Inventory, ops_dir: Path, probe: ProbeFn,
               already: set[str]) -> tuple[list[Finding], dict[str, Any]]:
    """Findings (new fingerprints only: `already` holds the forward's) and `data.phases`."""
    known = {s.key for s in forward.signatures}
    seen = set(already)

    def one(phase: Phase) -> tuple[list[Finding], dict[str, Any]]:
        t0 = time.monotonic()
        graphs, cpu_errors = record_phase_graphs(ctx, phase)
        if cpu_errors:
            return [], {"status": "error", "reason": f"the phase fails on CPU: {cpu_errors[0][:300]}"}
        inv = inventory_of_graphs(graphs, type(ctx.model().module).__name__, level="aten", method="phase", device="cpu")
        new = phase_signatures(phase, inv, known)
        symbolic = sorted({f"torch.{name}" for gm in graphs for name in symbolic_functions(gm)})
        row: dict[str, Any] = {"status": "pass", "phase": phase.label(), "graphs": len(graphs),
                               "ops": len(inv.op_names()), "signatures": len(inv.signatures),
                               "new_signatures": [s.describe()[:200] for s in new[:50]], "new_count": len(new),
                               "symbolic": symbolic}
        phase_dir = ops_dir / "phases" / phase.name
        phase_dir.mkdir(parents=True, exist_ok=True)
        got: list[Finding] = []
        if new:
            result = probe(new, "phase", phase_dir)
            row["probe_counts"] = result.data.get("probe_counts")
            got += result.findings
        for name in symbolic:
            f = _symbolic_probe(ctx, opts, phase, name, phase_dir)
            if f is not None:
                got.append(f)
        kept: list[Finding] = []
        for f in got:
            f.phase = phase.name
            if f.fingerprint in seen:
                row.setdefault("also_in_forward_or_earlier_phase", []).append(f.op)
                continue
            seen.add(f.fingerprint)
            kept.append(f)
        if kept:
            row["status"] = "fail"
        row["seconds"] = round(time.monotonic() - t0, 2)
        return kept, row

    return ctx.each_phase(MODE, one, loaded=ctx.model())  # type: ignore[arg-type]


def _symbolic_probe(ctx: "ModeContext", opts: OpsOptions, phase: Phase, op: str, out_dir: Path) -> Finding | None:
    """Run the symbolic function's repro: a finding when it fails (verified by that very run)."""
    spec = ctx.cell.backend
    if spec.compile is None:  # an eager device runs Python's own arithmetic on sizes
        return None
    file_name = f"repro_{safe_filename(op)}.py"
    compile_options = {k: v for k, v in spec.compile_options.items() if k != "dynamic"}
    recipe = backend_recipe(spec)
    command = run_command(file_name, out_dir, recipe.pythonpath)
    text = render_template("repro_symbolic.py.j2", op=op, backend_id=spec.id, model_id=ctx.cell.model.id,
                           phase=phase.label(), file_name=command,
                           backend=template_backend(spec, compile_options=compile_options))
    script = write_script(out_dir / file_name, text)
    env = {str(k): str(v) for k, v in spec.env.items()}
    if recipe.pythonpath:
        env["PYTHONPATH"] = ":".join(recipe.pythonpath)
    ver = verify_script(script, expect_text=["REPRO FAILED"], timeout=max(30.0, min(opts.verify_timeout,
                                                                                    ctx.remaining() / 2)), env=env)
    if ver.exit_code == 0 or (ver.exit_code is None and not ver.verified):
        return None
    tail = [line for line in ver.output_tail.splitlines() if line.startswith("REPRO FAILED")]
    message = tail[-1].split(": ", 2)[-1] if tail else ver.note
    rel = script.relative_to(ctx.cell_dir).as_posix()
    return Finding(kind="unsupported_op", stage="compile", op=op,
                   message=(f"{phase.name}: {op} on a dynamic size fails: {message}; Dynamo hands the backend this "
                            f"symbolic-shape function when a call recompiles with a size or an int input that changed "
                            f"(automatic dynamic shapes: a new length, or a cache's position counter)")[:2000],
                   error_type=message.split(":", 1)[0] if ":" in message else None,
                   repro=Repro(path=rel, verified=ver.verified, command=command, note=ver.note),
                   details={"symbolic": True, "phase": phase.label(),
                            "message_full": message},  # root causes key on the error, not the phase's words
                   fingerprint=fingerprint("unsupported_op", spec.id, op))
