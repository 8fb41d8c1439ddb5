"""The numerics mode's repros of its phase findings: one standalone script per `divergence` finding of a phase, and
per `output_overwritten` finding (the output a call returned, kept, changes after a later call: the script replays
the calls compiled, keeps that call's output and its copy, and exits 1 with "REPRO FAILED: the output returned by
<call> changed after <later call>" when they differ).

A phase finding (`phases.py`) names a module (a layer, `(model)` for the logits, or `kv:layers.<i>.keys|values` for
a KV-cache tensor) and the call of the phase where it diverges first (`details.call`, e.g. `decode step 2`; a module
called more than once in that call: `details.module_call`). Its state (the KV cache) comes from the calls before, so
`numerics/repro/phase-<phase>/<module>/repro.py` (an overwrite's: `<module>-<its call>/`, one per finding;
`templates/repro_numerics_phase.py.j2`) rebuilds the whole model
(`engine.repro.model_source`: its transformers class from `config.json`; every weight from `weights.safetensors`)
and calls it for each call of the phase up to that one, with the calls' tensors (`inputs.safetensors`: the tokens the
reference picked, so both sides see the same ones; an encoder-decoder's encoder output) and one cache carried along,
as `workloads.calls` makes them (`_repro_phase_calls.py.j2`, shared with the layers mode's phase repro): eagerly in
the primary reference's dtype, then compiled once with the backend in the target's dtype. It compares the module's
output at that call (a forward hook), the logits, or the cache tensor, on the real tokens only for a padded batch,
by rel and 1 − cos (the formulas of the single forward's repro), and exits 1 with
"REPRO FAILED: <module> diverges: rel X > threshold T" over the finding's threshold (or "… diverges: NaN/Inf …"
where the target is not finite and the reference is). Each script is run once as the single forward's are
(`repro.verify_repro`: `numerics.verify`, `numerics.verify_timeout`). The reference's run of a phase is made once per
`attach_phase_repros` and shared by the phase's findings (`_Done.reference`; `_Calls.upto` cuts it at each one's call).

The single forward's accumulated drift (a cumulative-only finding: no layer is wrong on its own) gets the same
whole-model script with one call, the forward's inputs from the reference dump (`forward_repro`, called by
`repro.attach_repros`): `numerics/repro/forward/<module>/repro.py`, compared against the cumulative threshold.

No repro (and `details.repro_note` says why): a finding that names no call, a model no script rebuilds, a cell with
under `repro.MIN_SECONDS` left (`repro.too_late`). The tensor-parallel findings get theirs from `tprepro.py`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ...backends import backend_recipe, plugin_pythonpath
from ...engine.codec import Unstorable, save_tensors
from ...engine.repro import model_source, render_template, run_command, safe_filename, template_backend, write_script
from ...models.tree import module_tensors
from ...options import NumericsOptions
from ...registry import FindingKind
from ...results.model import Finding, Repro
from ...workloads.calls import Call, cache_recipe, plain_tensors, run_phase
from ...workloads.phases import Phase
from .repro import attach, too_late, verify_repro
from .store import DumpReader
from .target import target_dtype
from .verdict import Layer

if TYPE_CHECKING:
    from .. import ModeContext

__all__ = ["attach_phase_repros", "forward_repro"]

ROOT = "(model)"  # the module name of a finding on the logits


def attach_phase_repros(ctx: "ModeContext", findings: Sequence[Finding],
                        opts: NumericsOptions | None = None) -> dict[str, float]:
    """A verified repro (or a `details.repro_note`) on each divergence finding of a phase: the timing
    `{"phase_repros_s": seconds}` ({} with no such finding)."""
    opts = opts or NumericsOptions()
    todo = [f for f in findings if f.kind in (FindingKind.DIVERGENCE, FindingKind.OUTPUT_OVERWRITTEN) and f.phase]
    if not todo:
        return {}
    t0 = time.monotonic()
    phases = {p.name: p for p in ctx.cell.inputs.workload()}
    done = _Done()  # what the findings share: the weights file and each phase's reference run
    for f in todo:
        attach(f, lambda: _one(ctx, f, phases.get(f.phase or ""), done, verify=opts.verify,
                               verify_timeout=opts.verify_timeout))
    return {"phase_repros_s": round(time.monotonic() - t0, 3)}


def _watched(module: str) -> tuple[str, tuple[int, str] | None]:
    """A finding's module as (the submodule whose output is compared, "" for the logits; the KV-cache tensor
    `(layer, "keys" | "values")` compared instead, or None)."""
    if module.startswith("kv:"):
        parts = module[3:].split(".")  # layers.<i>.<keys|values>
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in ("keys", "values"):
            return "", (int(parts[1]), parts[2])
        raise ValueError(f"not a KV-cache tensor: {module}")
    return ("" if module == ROOT else module), None


class _Calls:
    """The phase's calls as the reference makes them (its own greedy tokens: what the target was fed): each call's
    tensors, label and real tokens, and the first call (the cache's recipe); `upto(label)` the calls up to the
    first one labelled `label`, as one finding's script replays them."""

    def __init__(self) -> None:
        self.tensors: list[dict[str, torch.Tensor]] = []
        self.labels: list[str] = []
        self.reals: list[torch.Tensor | None] = []
        self.first: Call | None = None

    def keep(self, call: Call) -> None:
        if self.first is None:
            self.first = call
        self.tensors.append(plain_tensors(call.kwargs))
        self.labels.append(call.label)
        self.reals.append(call.real)

    def upto(self, label: str) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]], torch.Tensor | None] | None:
        """(their tensors, keys `<call>.<keyword>`; the calls' labels and tensor keys; the real tokens of the call
        labelled `label`), or None when no call is."""
        if label not in self.labels:
            return None
        tensors: dict[str, torch.Tensor] = {}
        calls: list[dict[str, Any]] = []
        for i in range(self.labels.index(label) + 1):
            names = {name: f"{i}.{name}" for name in self.tensors[i]}
            tensors.update({names[name]: t for name, t in self.tensors[i].items()})
            calls.append({"label": self.labels[i], "tensors": names})
        return tensors, calls, self.reals[self.labels.index(label)]


class _Done:
    """What one attach pass does once and its findings share: the model's weights file (written once per cell, the
    other repros link to it) and the reference's run of each phase (`runs`: how many were made)."""

    def __init__(self) -> None:
        self.weights: list[Path] = []
        self.phases: dict[str, _Calls] = {}
        self.runs = 0

    def reference(self, loaded: Any, ctx: "ModeContext", phase: Phase) -> _Calls:
        """The reference's calls of `phase`, run once (a run that raised is made again for the next finding)."""
        if phase.name not in self.phases:
            calls = _Calls()
            self.runs += 1
            run_phase(loaded.module, loaded, ctx.cell.inputs, phase, before_call=calls.keep)
            self.phases[phase.name] = calls
        return self.phases[phase.name]


def _save_weights(module: torch.nn.Module, path: Path, written: list[Path]) -> None:
    """Every parameter and buffer of `module` into `path`: a hard link to the file an earlier repro of the cell
    wrote where one was (a real model's weights are large, and the same in every phase), else written."""
    path.unlink(missing_ok=True)
    for earlier in written:
        try:
            os.link(earlier, path)
            return
        except OSError:  # another file system, or no hard links there: written again
            break
    save_tensors(module_tensors(module), path, copy=True)
    written.append(path)


def _one(ctx: "ModeContext", f: Finding, phase: Phase | None, done: _Done, *, verify: bool,
         verify_timeout: float) -> Repro | str:
    overwritten = {"call": f.details.get("call"), "after": f.details.get("changed_after")} \
        if f.kind == FindingKind.OUTPUT_OVERWRITTEN else None
    label = overwritten["after"] if overwritten else f.details.get("call")  # an overwrite shows after the later call
    if phase is None or not isinstance(label, str):
        return "no repro: the finding does not name the call of its phase it diverges at"
    if (late := too_late(ctx)) is not None:
        return late
    watched, kv = _watched(f.module or ROOT)
    ref_dtype = ctx.cell.references[0].dtype
    loaded = ctx.model(dtype=ref_dtype)
    name = safe_filename(f.module or "model")  # an overwrite per call: findings of one phase never share a script
    folder = ctx.artifact_dir("numerics") / "repro" / f"phase-{phase.name}" / (
        f"{name}-{safe_filename(str(overwritten['call']))}" if overwritten else name)
    folder.mkdir(parents=True, exist_ok=True)
    source = model_source(ctx.cell.model, ctx.cell.inputs.seed, loaded, folder)
    if source is None:
        return f"no repro: the model cannot be rebuilt from its source ({ctx.cell.model.source})"
    ref = done.reference(loaded, ctx, phase)
    upto = ref.upto(label)
    if upto is None or ref.first is None:
        return f"no repro: the reference's {phase.name} has no call {label!r}"
    tensors, calls, real = upto
    save_tensors(tensors, folder / "inputs.safetensors", copy=True)  # small, and per finding: findings of one
    _save_weights(loaded.module, folder / "weights.safetensors", done.weights)  # phase may share a folder
    cached = phase.name in ("prefill", "decode")
    expect = f"the output returned by {overwritten['call']} changed after" if overwritten else \
        f"{f.module or ROOT} diverges"
    return _write(ctx, f, folder, dict(
        qualified_name=watched, source=source, phase=phase.label(), call_label=label,
        module_call=int(f.details.get("module_call") or 0), kv=list(kv) if kv is not None else None, calls=calls,
        cache=cache_recipe(loaded, phase, ref.first) if cached else None, use_cache=cached,
        real=real.tolist() if real is not None and kv is None else None, ref_dtype=ref_dtype,
        threshold=f.threshold, overwritten=overwritten), expect=expect, verify=verify, verify_timeout=verify_timeout)


def _write(ctx: "ModeContext", f: Finding, folder: Path, fields: dict[str, Any], *, expect: str, verify: bool,
           verify_timeout: float) -> Repro:
    """`folder/repro.py` from the whole-model template with `fields` (the finding's own filled in), run once when
    `verify`: verified when it exits 1 printing `expect`."""
    pythonpath = plugin_pythonpath([*backend_recipe(ctx.cell.backend).imports, "ci_runner"])  # simdev's included
    script = folder / "repro.py"
    command = run_command(script.name, folder, pythonpath)
    threshold = fields.pop("threshold")
    rel, cos = threshold.get("rel"), threshold.get("cos")
    write_script(script, render_template(
        "repro_numerics_phase.py.j2", module=f.module or ROOT, module_class=f.module_class or "",
        model_id=ctx.cell.model.id, model_source=ctx.cell.model.source, backend_id=ctx.cell.backend.id,
        backend=template_backend(ctx.cell.backend), message=f.message, call=None,
        target_dtype=target_dtype(ctx.cell.model.dtype, fields["ref_dtype"]), command=command,
        threshold_rel=None if rel is None else float(rel), threshold_cos=None if cos is None else float(cos),
        **fields))
    if not verify:
        return Repro(path=str(script.relative_to(ctx.cell_dir)), verified=False, command=command,
                     note="not verified (numerics.verify: false)")
    return verify_repro(ctx, script, pythonpath, command, expect=expect, limit=verify_timeout)


def forward_repro(ctx: "ModeContext", f: Finding, layers: Sequence[Layer], reader: DumpReader, *, verify: bool,
                  verify_timeout: float) -> Repro | str:
    """The repro of a cumulative-only divergence of the single forward (accumulated drift: no layer is wrong on its
    own, so no layer alone shows it): `numerics/repro/forward/<module>/repro.py`, the whole model rebuilt and called
    once on the forward's inputs (the reference dump's root call), eagerly and compiled, comparing the module's output
    at the flagged call against the finding's cumulative threshold (the cumulative view's own comparison)."""
    if (late := too_late(ctx)) is not None:
        return late
    own = [l for l in layers if l.name == f.module and l.flagged("cumulative") and l.metrics.get("cumulative")]
    layer = max(own, key=lambda l: float(l.metrics["cumulative"]["rel"]), default=None)  # type: ignore[index]
    root = next((c for c in reader.calls if c.get("parent") is None), None)
    if layer is None or root is None:
        return "no repro: the flagged call is not in the reference dump"
    try:
        args, kwargs = reader.inputs(root)
    except Unstorable as exc:
        return f"no repro: the model's inputs were not stored ({exc})"
    tensors = plain_tensors(kwargs)
    if args or not tensors:
        return "no repro: the model was called with positional inputs (the whole-model script passes keywords)"
    ref_dtype = ctx.cell.references[0].dtype
    loaded = ctx.model(dtype=ref_dtype, device="cpu")
    folder = ctx.artifact_dir("numerics") / "repro" / "forward" / safe_filename(f.module or "model")
    folder.mkdir(parents=True, exist_ok=True)
    source = model_source(ctx.cell.model, ctx.cell.inputs.seed, loaded, folder)
    if source is None:
        return f"no repro: the model cannot be rebuilt from its source ({ctx.cell.model.source})"
    names = {name: f"0.{name}" for name in tensors}
    save_tensors({names[n]: t for n, t in tensors.items()}, folder / "inputs.safetensors", copy=True)
    save_tensors(module_tensors(loaded.module), folder / "weights.safetensors", copy=True)
    _, _, k = layer.key.partition("#")
    return _write(ctx, f, folder, dict(
        qualified_name=layer.name, source=source, phase="forward", call_label="forward",
        module_call=int(k) if k.isdigit() else 0, kv=None, calls=[{"label": "forward", "tensors": names}],
        cache=None, use_cache=False, real=None, ref_dtype=ref_dtype,
        threshold=f.threshold.get("cumulative") or {}, overwritten=None),
        expect=f"{f.module or ROOT} diverges", verify=verify, verify_timeout=verify_timeout)

