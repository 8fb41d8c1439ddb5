"""The repro of a layers finding under tensor parallelism: a script that starts its own ranks and replays the
sharded submodule that failed, verified by running it.

Inside the ranks (`store_ranks`, called by `tpsearch.rank_task` after the search): every rank saves, for each
smallest failing module, its local state (the local shards of its DTensor parameters, its other parameters and
buffers) and its recorded first-call inputs (the codec's wire format, `engine/codec.py`) with `torch.save` into
`<launch folder>/repro_<module>/rank<r>.pt` (the rank files the TP repros share: `engine/tprepro.py`); rank 0
returns how the script rebuilds the module's structure (the model's source: the factory, or transformers from the
`config.json` it writes beside) and the plan relative to the module.

In the parent (`attach_repros`): `repro.py` is rendered there (`templates/repro_layer_tp.py.j2`): it starts `tp`
ranks (gloo, a free port), each builds the model's structure (meta device when it can), takes the submodule,
shards it with `parallelize_module` by the plan, copies the rank's saved shards and buffers in, loads its inputs
(`torch.load(weights_only=True)`), compiles the submodule with the backend as the probe did (`torch.compile(module,
backend=…, **compile_options)` under `no_grad`) and runs it; exit 1 while any rank fails, each rank's line naming
it. With `options.layers.verify` it is run: verified when every failing rank of the finding fails with the
finding's error type and first line. A module whose rank died or hung has its state saved by a relaunch that
only records (`tpsearch.store_task`); its repro is verified when a rank dies or times out again.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ...engine.codec import TensorStore
from ...engine.repro import key_text, render_template, run_command, safe_filename, template_backend, verify_script, \
    write_script
from ...engine.tprepro import agree_errors, brief_source, errors_of, local_state, rank_model_source, relative_plan, \
    save_rank_file, script_pythonpath
from ...failures.failure import first_line
from ...fsutil import atomic_write_text
from ...quoting import shell_quote
from ...results.model import Finding, Repro
from .groups import run_parallel
from .search import encode_call
from .tree import ROOT, label

if TYPE_CHECKING:
    from ...config import BackendSpec
    from ...options import LayersOptions
    from ...workloads.parallel import ParallelSpec

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]
STARTUP_S = 60.0  # a repro rank's start, model build and shard, on top of the probe's own limit


def repro_dir(folder: Path, name: str) -> Path:
    """Where a module's per-rank files and its script go: `<launch folder>/repro_<module>/`."""
    return Path(folder) / f"repro_{safe_filename(label(name))}"


# --------------------------------------------------------------------------- inside the ranks

def store_ranks(payload: Mapping[str, Any], sharded: torch.nn.Module, resolved: Mapping[str, str],
                calls: Mapping[str, Calls], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Save this rank's `rank<r>.pt` for each module of `names` (the same on every rank; `engine/tprepro.py`); on
    every rank, per module: {"dir", "plan", "source", "errors": {rank: why it could not be saved}} (agreed by an
    all-gather)."""
    rank = int(payload["rank"])
    folder = Path(str(payload.get("repro_folder") or Path(str(payload["progress"])).parent))
    source = rank_model_source(payload, sharded)
    mine: dict[str, str] = {}
    for name in names:
        try:
            if not calls.get(name):
                raise RuntimeError(f"{label(name)} did not run in the recorded forward")
            sub = sharded if name == ROOT else sharded.get_submodule(name)
            args, kwargs = calls[name][0]
            store = TensorStore()
            call = encode_call(args, kwargs, store)
            save_rank_file(repro_dir(folder, name), rank, {"format": 1, "rank": rank, "module": name,
                                                           "state": local_state(sub), "call": call,
                                                           "tensors": store.tensors}, source)
        except Exception as exc:  # unstorable inputs, a full disk: that module has no repro, the others do
            mine[name] = f"{type(exc).__name__}: {first_line(str(exc), 300)}"
    every = agree_errors(mine)
    return {label(name): {"dir": repro_dir(folder, name).name, "qualified_name": name,
                          "plan": relative_plan(resolved, name), "source": brief_source(source),
                          "errors": errors_of(every, name)}
            for name in names}


# --------------------------------------------------------------------------- in the parent

def attach_repros(findings: Sequence[Finding], stored: Mapping[str, Mapping[str, Any]], *, spec: "BackendSpec",
                  layout: "ParallelSpec", model_id: str, folder: Path, cell_dir: Path, opts: "LayersOptions",
                  time_left: float, versions: Mapping[str, str] | None = None) -> None:
    """Write (and with `opts.verify`, run) the repro of each finding whose module's rank files were stored; a
    finding without them gets a note saying why."""
    deadline = time.monotonic() + time_left
    jobs = [f for f in findings if f.module is not None and f.module in stored]
    for f in findings:
        if f not in jobs:
            f.details["repro_note"] = "no repro: the module's shards and inputs were not stored"

    def one(f: Finding) -> None:
        try:
            f.repro = write_and_verify(f, stored[str(f.module)], spec=spec, layout=layout, model_id=model_id,
                                       folder=folder, cell_dir=cell_dir, opts=opts, deadline=deadline,
                                       versions=versions or {})
        except Exception as exc:  # a repro problem must not lose the finding
            f.repro = Repro(path=str(folder.relative_to(cell_dir)), verified=False,
                            note=f"repro generation failed: {type(exc).__name__}: {first_line(str(exc))}")

    run_parallel(one, jobs, max(1, opts.verify_workers))


def write_and_verify(f: Finding, info: Mapping[str, Any], *, spec: "BackendSpec", layout: "ParallelSpec",
                     model_id: str, folder: Path, cell_dir: Path, opts: "LayersOptions", deadline: float,
                     versions: Mapping[str, str]) -> Repro:
    """The finding's repro: `repro.py` beside the ranks' files in `info["dir"]`, run when `opts.verify` (by
    `deadline`, a `time.monotonic()`)."""
    rdir = folder / str(info["dir"])
    rel = rdir.relative_to(cell_dir)
    if info.get("errors") or info.get("source") is None:
        why = "; ".join(f"rank {r}: {e}" for r, e in dict(info.get("errors") or {}).items()) or \
            "no model-source rebuild for this model source (a factory or a transformers class is needed)"
        atomic_write_text(rdir / "README.txt", f"No repro: {why}\n")
        return Repro(path=str(rel / "README.txt"), verified=False, note=f"no repro: {why}")
    source = dict(info["source"])
    ranks = [int(r) for r in f.details.get("ranks") or []]
    status = str(f.details.get("status") or "fail")
    factory_module, pythonpath = script_pythonpath(spec, source)
    hard = status in ("crashed", "timeout")
    timeout = float(opts.probe_timeout) + STARTUP_S
    run_it = run_command("repro.py", rdir, pythonpath)
    name = str(info["qualified_name"])
    text = render_template(
        "repro_layer_tp.py.j2", module=f.module, qualified_name=name, module_class=f.module_class or "",
        layout=layout.label(), world=layout.tp, ranks=ranks, plan=dict(info["plan"]), source=source,
        model_id=model_id, model_source=source.get("factory") or source.get("model_class"),
        factory_module=factory_module, backend_id=spec.id, status=status, stage=f.stage,
        error_type=f.error_type or "", message=first_line(str(f.details.get("message_full") or f.message), 200),
        torch_version=torch.__version__, versions=dict(versions), backend=template_backend(spec), timeout=timeout,
        run_it=run_it)
    script = write_script(rdir / "repro.py", text)
    command = f"cd {shell_quote(rel)} && {run_it}"
    if not opts.verify:
        return Repro(path=str(rel / "repro.py"), verified=False, command=command,
                     note="not verified (options.layers.verify: false)")
    env = {str(k): str(v) for k, v in spec.env.items()}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    limit = max(5.0, min(opts.verify_timeout if not hard else timeout + 30.0, deadline - time.monotonic() - 5.0))
    if hard:  # a rank died or hung: a rank's death, or the script's own deadline, shows it again
        v = verify_script(script, expect_text=["fails on rank"], timeout=limit, env=env, expect_signal=True)
        if status == "timeout":
            again = "REPRO TIMEOUT" in v.output_tail or v.exit_code is None
        else:  # killed by a signal, or exited without a Python error
            again = "REPRO DIED" in v.output_tail or re.search(r"REPRO FAILED: .*: exit code -?\d+$", v.output_tail,
                                                               re.MULTILINE) is not None
        verified = v.verified and again
        note = v.note if again else f"{v.note}; no rank {'hung' if status == 'timeout' else 'died'} this time"
    else:
        expect = [f"rank {r}: REPRO FAILED" for r in ranks] + key_text(str(f.details.get("message_full") or ""))
        v = verify_script(script, expect_text=expect, expect_error_type=f.error_type, timeout=limit, env=env)
        verified, note = v.verified, v.note
    f.details["repro_output_tail"] = v.output_tail[-1500:]
    return Repro(path=str(rel / "repro.py"), verified=verified, command=command,
                 note=f"own {layout.tp} ranks; {note}")
