"""The toolbox's hooks into the numerics mode: the weights check before it, batch invariance and the bisect of
the divergent layer after it, and reference dumps made elsewhere (`deepview-ci dump --reference`) instead of the
reference pass. Gated by the toolbox options (`options.ToolboxOptions`, part of `options.numerics`)."""

from __future__ import annotations
from ...registry import FindingKind

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ...errors import ConfigError, InputError
from ...models.load import model_fingerprint
from ...options import ToolboxOptions
from ...results.model import Finding
from .batch_invariance import check_cell as batch_check
from .bisect import bisect_cell
from .dumps import INDEX_NAME, DumpInputsMismatch, input_hash, load_dump, split_inputs
from .settings import CellContext
from .thresholds import ThresholdTable
from .weights import cell_outcome as weights_cell_outcome, check_cell as weights_check_cell, needs_round_trip


def reference_dumps(ctx: CellContext, tb: ToolboxOptions) -> tuple[list[Path], list[int]]:
    """The reference dump folders the numerics mode compares against (`reference_dump`), checked against the cell.

    Each must be an eager reference dump (with per-call inputs), of this model (same fingerprint), made on exactly
    the input this cell builds for its sample (same input hash); otherwise `ConfigError`/`InputError` says which.
    Paths are absolute or relative to the working directory. A dump of another reference than the primary (say
    float64) is still compared (metrics are float64) against the primary's thresholds. Returns (folders, samples).
    """
    primary = ctx.cell.references[0]
    folders: list[Path] = []
    samples: list[int] = []
    for raw in tb.reference_dump:
        folder = Path(raw).expanduser()
        dump = load_dump(folder)
        side = dump.side
        if side.get("role") != "reference" or side.get("capture") != "eager":
            raise ConfigError(f"options.numerics.reference_dump: {folder} is a {side.get('role')} dump "
                              f"({side.get('capture')}), not an eager reference dump",
                              hint="dump the reference with `deepview-ci dump --reference ID` (no --backend)")
        if not (folder / INDEX_NAME).is_file():
            raise InputError(f"{folder / INDEX_NAME}: missing: the dump has no per-call index",
                             hint="dump it again with this version of deepview-ci")
        fp = (dump.manifest.get("model") or {}).get("fingerprint")
        mine = model_fingerprint(ctx.cell.model)
        if json.loads(json.dumps(fp, default=str)) != json.loads(json.dumps(mine, default=str)):
            raise ConfigError(f"options.numerics.reference_dump: {folder} is a dump of another model "
                              f"({(dump.manifest.get('model') or {}).get('id')!r}, fingerprint differs)",
                              hint=f"dump model {ctx.cell.model.id!r} of this matrix")
        sample = int(dump.manifest.get("sample", 0))
        loaded = ctx.model(dtype=side.get("dtype") or primary.dtype, device="cpu")
        tensors, other = split_inputs(ctx.inputs(loaded, sample=sample, device="cpu"))
        if input_hash(tensors, other) != dump.input_hash:
            raise DumpInputsMismatch(f"options.numerics.reference_dump: {folder} was made on another input than "
                                     f"this cell's sample {sample}",
                                     hint="dump with the same matrix inputs (seed, seq_len, batch) and --sample")
        dump.close()
        folders.append(folder)
        samples.append(sample)
    return folders, samples


@dataclass
class ToolboxRun:
    """What the toolbox adds to the numerics mode's result."""

    findings: list[Finding] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def weights_in_target(ctx: CellContext, tb: ToolboxOptions, *, isolate: bool = True) -> bool:
    """Whether the weights check runs in the numerics target child, before its forward (`target.weights_first`):
    wanted, isolated, and a backend that transfers or compiles the weights. That child builds the model anyway;
    a check of its own would cost another process and another build of the model."""
    return tb.weights_check and isolate and needs_round_trip(ctx.backend)


def before_numerics(ctx: CellContext, tb: ToolboxOptions, *, isolate: bool = True) -> ToolboxRun:
    """The weights check (when `weights_check`), run before any forward comparison; nothing when it runs in the
    target child instead (`weights_in_target`, read back with `weights_from_target`)."""
    if not tb.weights_check or weights_in_target(ctx, tb, isolate=isolate):
        return ToolboxRun()
    t0 = time.monotonic()
    findings, data = weights_check_cell(ctx, isolate=isolate)
    data["seconds"] = round(time.monotonic() - t0, 3)
    return _weights_run(findings, data)


def weights_from_target(ctx: CellContext, path: Path) -> ToolboxRun:
    """The weights check the target child ran before its forward, from the file it wrote (`path`)."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        value = {"status": "error", "reason": "weights check did not run: the target child ended before it"}
    if value.get("status") == "ok":
        findings, data = weights_cell_outcome(ctx, value)
    else:
        findings, data = [], {k: value[k] for k in ("status", "reason", "stderr_tail") if k in value}
    if "seconds" in value:
        data["seconds"] = value["seconds"]
    data["in_target_child"] = True  # its seconds are part of the target's
    return _weights_run(findings, data)


def _weights_run(findings: list[Finding], data: dict[str, Any]) -> ToolboxRun:
    out = ToolboxRun(findings=list(findings), data={"weights": data})
    if findings:
        out.notes.append(f"weights check: {len(findings)} tensor(s) differ after the round trip to the target; "
                         f"divergence below may come from them, not from the forward")
    return out


def after_numerics(ctx: CellContext, tb: ToolboxOptions, *, table: ThresholdTable, layers: Sequence[Any],
                   verdict: Mapping[str, Any], findings: list[Finding], isolate: bool = True) -> ToolboxRun:
    """Batch invariance (when `batch_invariance`) and the compiler-pass bisect of the divergent layer (`bisect`).

    The bisect result is also attached to the divergence finding of the bisected layer (`details["bisect"]` and
    its message)."""
    out = ToolboxRun()
    if tb.batch_invariance:
        t0 = time.monotonic()
        bf, bdata = batch_check(ctx, table=table, slots=tb.batch_slots, position=tb.batch_position, isolate=isolate)
        bdata["seconds"] = round(time.monotonic() - t0, 3)
        out.findings.extend(bf)
        out.data["batch_invariance"] = bdata
    if tb.bisect:
        t0 = time.monotonic()
        bres = bisect_cell(ctx, layers=layers, verdict=verdict, table=table, method=tb.bisect_method,
                           timeout=tb.bisect_timeout, isolate=isolate)
        if bres is not None:
            bres["seconds"] = round(time.monotonic() - t0, 3)
            out.data["bisect"] = bres
            for f in findings:
                if f.kind == FindingKind.DIVERGENCE and f.module == bres.get("layer"):
                    f.details["bisect"] = bres
                    if bres.get("summary"):
                        f.message += f"; bisect: {bres['summary']}"
    return out



__all__ = ["ToolboxRun", "after_numerics", "before_numerics", "reference_dumps", "weights_from_target",
           "weights_in_target"]
