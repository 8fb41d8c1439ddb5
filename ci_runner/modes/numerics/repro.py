"""The numerics mode's repros: one standalone script per `divergence` finding of the single forward.

A finding that a layer diverges on its own (isolated view, `details.view` `isolated` or `both`) gets
`numerics/repro/<module>/repro.py` (`templates/repro_numerics.py.j2`): the layer rebuilt from the model's source (its
factory, or its transformers class from `config.json`: `engine.repro.model_source`) with its own weights from
`weights.safetensors`, called on the inputs the reference dump recorded for the flagged call (`store.DumpReader`,
written to `inputs.safetensors` in the codec's wire format) eagerly in the primary reference's dtype and compiled
with the backend in the target's dtype. It prints rel and 1 − cos (computed in the script from their formulas) against
the finding's isolated threshold and exits 1 with "REPRO FAILED: <module> diverges: …" when over, 0 when within. A
finding "in what it passes to <child>" (the record's `via`) compares what the layer passes to that child. The script
is run once (`engine.repro.verify_script`) and the finding's `Repro.verified` says whether it showed the divergence.

A cumulative-only finding (drift: no layer is wrong on its own, so no one layer alone shows it) gets a whole-model
script instead (`phaserepro.forward_repro`: the model called once on the forward's inputs, eagerly and compiled, the
module's output compared at its call against the cumulative threshold).

No repro (and `details.repro_note` says why): a model whose source no script rebuilds, a call whose inputs were not stored, a cell
with under `MIN_SECONDS` left. A phase's findings get theirs from `phaserepro.py`; a sharded layer's divergence
under tensor parallelism (`parallel.py`) from `tprepro.py` (its own ranks; verified with `verify_at`, as here).
"""

from __future__ import annotations

import os
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from ...backends import backend_recipe, plugin_pythonpath
from ...engine.codec import TensorStore, Unstorable, encode_call, save_tensors
from ...engine.repro import (model_source, render_template, run_command, safe_filename, template_backend,
                             verify_script, write_script)
from ...failures.failure import first_line
from ...models.tree import module_tensors
from ...options import NumericsOptions
from ...registry import FindingKind
from ...results.model import Finding, Repro
from .store import DumpReader
from .target import target_dtype
from .verdict import Layer

if TYPE_CHECKING:
    from .. import ModeContext

__all__ = ["MIN_SECONDS", "attach", "attach_repros", "too_late", "verify_at", "verify_repro"]

MIN_SECONDS = 90.0  # a cell with less left writes no repro: its result comes first


Drift = Callable[[Finding, Sequence[Layer], DumpReader], "Repro | str"]  # a cumulative-only finding's whole-model repro


def attach_repros(ctx: "ModeContext", findings: Sequence[Finding], layers: Sequence[Layer],
                  dump: Path, opts: NumericsOptions | None = None, *, drift: Drift) -> dict[str, float]:
    """A verified repro (or a `details.repro_note`) on each divergence finding of the single forward: the timing
    `{"repros_s": seconds}` ({} with no finding). `dump`: the primary reference's dump of the compared sample (still
    on disk). The layer runs eagerly in the primary reference's dtype, compiled in the target's (`target_dtype`). Each
    repro is run once when `opts.verify` (`numerics.verify`), within `opts.verify_timeout` and a quarter of the cell's
    time left. A cumulative-only finding (accumulated drift) gets `drift`'s whole-model repro (`phaserepro.forward_repro`)."""
    opts = opts or NumericsOptions()
    if not findings:
        return {}
    t0 = time.monotonic()
    ref_dtype = ctx.cell.references[0].dtype
    compiled_dtype = target_dtype(ctx.cell.model.dtype, ref_dtype)
    reader = DumpReader(dump)
    try:
        for f in findings:
            if f.kind != FindingKind.DIVERGENCE:
                continue
            if f.details.get("view") not in ("isolated", "both"):  # accumulated drift: no layer alone shows it
                attach(f, partial(drift, f, layers, reader))
                continue
            attach(f, lambda: _one(ctx, f, layers, reader, ref_dtype=ref_dtype, compiled_dtype=compiled_dtype,
                                   verify=opts.verify, verify_timeout=opts.verify_timeout))
    finally:
        reader.close()
    return {"repros_s": round(time.monotonic() - t0, 3)}


def too_late(ctx: "ModeContext") -> str | None:
    """Why a repro is not written when the cell has under `MIN_SECONDS` left (its result comes first), else None."""
    left = ctx.remaining()
    return f"no repro: the cell had {left:.0f} s left (under {MIN_SECONDS:.0f} s)" if left < MIN_SECONDS else None


def attach(f: Finding, write: Callable[[], Repro | str]) -> None:
    """`f.repro` from `write()`, or `details.repro_note` when it gives a reason (a str) or raises: a repro problem
    never loses the finding."""
    try:
        written = write()
    except Exception as exc:  # noqa: BLE001
        written = f"no repro: writing it failed: {type(exc).__name__}: {first_line(str(exc), 200)}"
    if isinstance(written, str):
        f.details["repro_note"] = written
    else:
        f.repro = written


def _flagged_layer(f: Finding, layers: Sequence[Layer]) -> Layer | None:
    """The call of `f`'s module the isolated view found worst (the one the finding's metrics are of)."""
    own = [l for l in layers if l.name == f.module and l.flagged("isolated") and l.metrics.get("isolated")]
    return max(own, key=lambda l: float(l.metrics["isolated"]["rel"]), default=None)  # type: ignore[index]


def _via(name: str, via: str | None) -> tuple[str | None, int]:
    """The record's `via` (a call key `child` or `child#k`) as (path relative to `name`, call index)."""
    if not via:
        return None, 0
    child, _, k = via.partition("#")
    prefix = f"{name}." if name else ""
    if not child.startswith(prefix) or child == name:
        return None, 0
    return child[len(prefix):], int(k) if k.isdigit() else 0


def _one(ctx: "ModeContext", f: Finding, layers: Sequence[Layer], reader: DumpReader, *, ref_dtype: str,
         compiled_dtype: str, verify: bool = True, verify_timeout: float = 180.0) -> Repro | str:
    if (late := too_late(ctx)) is not None:
        return late
    layer = _flagged_layer(f, layers)
    call = reader.by_key.get(layer.key) if layer is not None else None
    if layer is None or call is None:
        return "no repro: the flagged call is not in the reference dump"
    name = layer.name
    folder = ctx.artifact_dir("numerics") / "repro" / safe_filename(name or "model")
    folder.mkdir(parents=True, exist_ok=True)
    loaded = ctx.model(dtype=ref_dtype, device="cpu")
    source = model_source(ctx.cell.model, ctx.cell.inputs.seed, loaded, folder)
    if source is None:
        return f"no repro: the layer cannot be rebuilt from this model's source ({ctx.cell.model.source})"
    try:
        args, kwargs = reader.inputs(call)
        store = TensorStore()
        encoded = encode_call(args, kwargs, store.add, kv=True)
    except Unstorable as exc:
        return f"no repro: the reference's inputs of {layer.key or '(root)'} were not stored ({exc})"
    store.save(folder / "inputs.safetensors")
    save_tensors(module_tensors(loaded.module.get_submodule(name)), folder / "weights.safetensors", copy=True)
    via, via_call = _via(name, layer.via)
    pythonpath = plugin_pythonpath([*backend_recipe(ctx.cell.backend).imports, "ci_runner"])  # simdev's included
    script = folder / "repro.py"
    command = run_command(script.name, folder, pythonpath)
    thr = f.threshold.get("isolated") or {}
    label = name or "(root)"
    write_script(script, render_template(
        "repro_numerics.py.j2", module=label, qualified_name=name, module_class=f.module_class or "",
        model_id=ctx.cell.model.id, model_source=ctx.cell.model.source, backend_id=ctx.cell.backend.id,
        backend=template_backend(ctx.cell.backend), message=f.message, source=source, call=encoded,
        ref_dtype=ref_dtype, target_dtype=compiled_dtype, via=via, via_call=via_call,
        threshold_rel=_number(thr.get("rel")), threshold_cos=_number(thr.get("cos")), command=command))
    if not verify:
        return Repro(path=str(script.relative_to(ctx.cell_dir)), verified=False, command=command,
                     note="not verified (numerics.verify: false)")
    return verify_repro(ctx, script, pythonpath, command, expect=f"{label} diverges", limit=verify_timeout)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def verify_repro(ctx: "ModeContext", script: Path, pythonpath: list[str], command: str, *, expect: str,
            limit: float) -> Repro:
    """Run `script` once within `limit` and a quarter of the cell's time left: verified when it exits 1 printing
    `expect`."""
    return verify_at(script, pythonpath, command, cell_dir=ctx.cell_dir, expect=expect,
                     timeout=min(limit, ctx.remaining() * 0.25))


def verify_at(script: Path, pythonpath: list[str], command: str, *, cell_dir: Path, expect: str,
              timeout: float) -> Repro:
    """Run `script` once within `timeout`, with this deepview-ci importable: verified when it exits 1 printing
    `expect`; the `Repro` with its path relative to `cell_dir`."""
    rel = str(script.relative_to(cell_dir))
    # the repro runs with the deepview-ci that wrote it (a checkout, when that is what runs), as the command says
    own = str(Path(__file__).resolve().parents[3])  # the folder holding `ci_runner/`
    v = verify_script(script, expect_text=[expect], timeout=timeout,
                      env={"PYTHONPATH": os.pathsep.join([*pythonpath, own])})
    verified = v.verified and v.exit_code == 1
    note = v.note if verified or not v.verified else f"{v.note}, but with exit code {v.exit_code}, not 1"
    return Repro(path=rel, verified=verified, command=command, note=note)
