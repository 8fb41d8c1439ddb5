"""The target child: both views of the target against the reference dumps, records appended to a file.

`TargetPlan` is the JSON payload of the child (`target_child`, started by the numerics mode through
`ci_runner.procs.isolate`); `compare_target` also runs in-process (`isolate: false`). Records are JSON lines
(`read_records`); after a crash the mode starts a fresh child that skips what is done (`done_keys`) and the
module the journal names (`parse_journal_entry`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ...backends import resolve_backend
from ...config import BackendSpec, ModelSpec, spec_from_json
from ...fsutil import append_line, atomic_write_json
from ...engine.handoff import load_handoff
from ...procs.isolate import child_journal
from ...models.load import LoadedModel, load_model
from ...workloads.rounding import TORCH_DTYPES
from ...options import ThresholdOptions
from ...results.model import clean, number
from ...workloads.precision import storage_dtype
from .capture import ResultFn
from .settings import VIEWS, dynamo_settings
from .store import DumpReader
from .thresholds import ThresholdTable, exceeded, load_table
from .views import cast_tree, run_cumulative_view, run_isolated_view, short_error
from .watched import NOT_RAN, WatchedRunner
from .weights import check_value

TARGET_CHILD = "ci_runner.modes.numerics.target:target_child"


@dataclass(frozen=True, kw_only=True)
class TargetPlan:
    """What a target run does (JSON-able: it is the payload of the child process)."""

    model: Mapping[str, Any]  # ModelSpec fields
    backend: Mapping[str, Any]  # BackendSpec fields
    seed: int
    dtype: str  # the dtype the target runs the weights in: the primary reference's, or the model's bf16/fp16
    dumps: tuple[str, ...]  # one reference dump folder per compared sample
    results: str  # JSONL file the comparison records are appended to
    journal: str
    views: tuple[str, ...] = VIEWS
    skip: Mapping[str, Sequence[str]] = field(default_factory=dict)  # "<view>:<sample>" -> keys already done
    deadline_wall: float | None = None  # time.time() after which no new module is started
    isolated: str = "all"  # "auto": only when the cumulative view flags or fails something (needs `thresholds`)
    thresholds: str | None = None  # the thresholds file, for `isolated: auto`
    threshold_options: Mapping[str, Any] = field(default_factory=dict)
    weights: Mapping[str, Any] | None = None  # {"out": file, "chunk_mb": …}: the weights check first (`weights_first`)
    model_file: str | None = None  # the parent's model tensors (`engine.handoff.save_handoff`): not built again


def target_dtype(model_dtype: str, primary_dtype: str) -> str:
    """The dtype the target runs the model in: the model's own when the matrix loads it in bfloat16 or float16
    (the references then run its stored weights in their dtypes), else the primary reference's."""
    return storage_dtype(model_dtype) or primary_dtype


def compare_target(module: nn.Module, backend: Any, plan: TargetPlan, emit: ResultFn,
                   journal: Callable[[str, str], None] | None = None, *, table: ThresholdTable | None = None) -> None:
    """Both views of the target against every dump of `plan`; each record goes to `emit` as it is made.

    `module` is the model in `plan.dtype` on CPU (the primary reference's, or the model's own bfloat16/float16,
    to which the reference's inputs are then cast); it is moved to the backend's device (eager
    devices) and compiled whole for the cumulative view, then module by module for the isolated view. With
    `plan.isolated == "auto"` the isolated view runs only when the cumulative view flags a layer (against `table`,
    else the thresholds file of the plan), fails, or misses one; otherwise a `{"view": "isolated", "status":
    "skipped"}` record says so. Each view ends with a status record carrying its `seconds`.
    """
    if plan.isolated == "auto" and table is None and plan.thresholds:
        table = load_table(Path(plan.thresholds), ThresholdOptions(**plan.threshold_options))
    needed = plan.isolated != "auto" or table is None
    inner = emit

    def emit(rec: dict[str, Any]) -> None:  # noqa: F811 - watches the cumulative records go by
        nonlocal needed
        if rec.get("view") == "cumulative" and not needed:
            if "error" in rec or rec.get("status") == "error" or rec.get("unobserved_count"):
                needed = True
            elif "metrics" in rec and table is not None and exceeded(rec["metrics"], table.get(rec["key"], "cumulative")[0]):
                needed = True
        inner(rec)

    device = getattr(backend, "device", "cpu")
    if device != "cpu":
        module = backend.to_device(module)
    readers = [DumpReader(Path(d)) for d in plan.dumps]
    deadline = None
    if plan.deadline_wall is not None:
        deadline = time.monotonic() + max(0.0, plan.deadline_wall - time.time())

    store = storage_dtype(plan.dtype)
    low = TORCH_DTYPES[store] if store else None  # a model stored in bf16/fp16

    def to_dev(x: Any) -> Any:  # the reference's inputs and stubbed outputs, as the target's model holds them
        return cast_tree(x, dtype=low, device=device)

    with torch._dynamo.config.patch(**dynamo_settings()):
        if "cumulative" in plan.views:
            run_cumulative_view(module, backend, readers, plan.skip, emit, to_dev, journal)
        if "isolated" in plan.views and not needed:
            emit({"view": "isolated", "status": "skipped", "seconds": 0.0,
                  "reason": "the cumulative view flagged no layer (isolated: auto)"})
        elif "isolated" in plan.views:
            t0 = time.monotonic()
            runner = WatchedRunner(backend)  # each module's first call watched: did the backend run it

            modules = dict(module.named_modules())
            for s, reader in enumerate(readers):
                skip = set(plan.skip.get(f"isolated:{s}", ()))

                def emit_s(rec: dict[str, Any], s: int = s) -> None:
                    why = runner.not_ran.get(str(rec.get("key", "")).partition("#")[0]) if "metrics" in rec else None
                    if why:  # measured, but not on the backend: no comparison
                        rec = {"view": rec["view"], "key": rec["key"], "stage": NOT_RAN,
                               "error": f"the backend did not run it: {why}"[:600]}
                    emit({**rec, "sample": s})

                run_isolated_view(modules, reader, runner, emit_s, cast=to_dev, skip=skip, journal=journal,
                                  prefix=f"isolated:{s}:", deadline=deadline)
            emit({"view": "isolated", "status": "done", "seconds": round(time.monotonic() - t0, 4)})
    for r in readers:
        r.close()



def _handed_model(spec: ModelSpec, plan: TargetPlan) -> LoadedModel | None:
    """The model built on meta and filled from the parent's file (`engine.handoff`); None when it does not fit."""
    try:
        shell = load_model(spec, seed=plan.seed, dtype=plan.dtype, meta=True)
    except Exception:  # the child builds it the usual way, which reports the error
        return None
    got = load_handoff(shell.module, Path(str(plan.model_file)))
    return None if got is None else dataclasses.replace(shell, module=got.module, device="cpu", meta=False)


def target_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Entry point of the target child process (`run_isolated("ci_runner.modes.numerics.target:target_child", …)`)."""
    plan = TargetPlan(**{**payload, "dumps": tuple(payload["dumps"]), "views": tuple(payload["views"])})
    backend = resolve_backend(spec_from_json(BackendSpec, plan.backend))
    spec = spec_from_json(ModelSpec, plan.model)
    loaded = _handed_model(spec, plan) if plan.model_file else None
    handed = loaded is not None
    if loaded is None:
        loaded = load_model(spec, seed=plan.seed, dtype=plan.dtype, device="cpu")
    out = Path(plan.results)
    n = 0

    def emit(rec: dict[str, Any]) -> None:
        nonlocal n
        n += 1
        append_line(out, json.dumps(json_safe(rec), allow_nan=False))

    if plan.weights and not Path(plan.weights["out"]).exists():  # not done, nor crashed in, by an earlier child
        weights_first(loaded.module, backend, plan.weights)
    compare_target(loaded.module, backend, plan, emit, journal=child_journal)
    return {"records": n, "model": "parent" if handed else "built"}


WEIGHTS_ITEM = "weights"  # the journal item of the weights check in the target child


def weights_first(module: nn.Module, backend: Any, spec: Mapping[str, Any]) -> None:
    """The weights check in the target child, before its first forward, on the model it has built anyway (no
    process and no model build of its own): its `weights.check_value` (or why it could not run) goes to
    `spec["out"]`. A child that dies in it leaves the journal item `weights` open: the mode records the check
    as failed and the next child goes on without it."""
    child_journal("enter-module", WEIGHTS_ITEM)
    t0 = time.monotonic()
    try:
        value: dict[str, Any] = {"status": "ok", **check_value(module, backend, chunk_mb=float(spec.get("chunk_mb", 256.0)))}
    except Exception as exc:
        value = {"status": "error", "reason": f"weights check could not run: {short_error(exc)}"}
    value["seconds"] = round(time.monotonic() - t0, 3)
    atomic_write_json(Path(spec["out"]), value)
    child_journal("leave-module", WEIGHTS_ITEM)


def json_safe(obj: Any) -> Any:
    """`obj` as strict JSON data (non-finite floats as strings)."""
    return clean(obj)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records a target run appended to `path` (a line cut by a crash is skipped)."""
    out = []
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash
        if "metrics" in rec:
            rec["metrics"] = {k: (number(v) if k in ("rel", "cos", "mad", "max_abs", "sqnr_db", "ref_absmean") else v)
                              for k, v in rec["metrics"].items()}
        out.append(rec)
    return out



def parse_journal_entry(entry: str | None) -> tuple[str, int, str] | None:
    """`isolated:0:model.layers.0.mlp` → ("isolated", 0, key); `cumulative:1` → ("cumulative", 1, "")."""
    if not entry:
        return None
    parts = entry.split(":", 2)
    if len(parts) < 2 or parts[0] not in VIEWS:
        return None
    try:
        s = int(parts[1])
    except ValueError:
        return None
    return parts[0], s, parts[2] if len(parts) > 2 else ""



def done_keys(records: list[dict[str, Any]], crashed: list[dict[str, Any]]) -> dict[str, list[str]]:
    """What a restarted target child skips: the isolated calls and cumulative samples already done or crashed."""
    skip: dict[str, list[str]] = {}
    for r in records:
        if r.get("view") == "isolated" and "key" in r and "sample" in r:
            skip.setdefault(f"isolated:{r['sample']}", []).append(r["key"])
        elif r.get("view") == "cumulative" and "status" in r:
            skip.setdefault(f"cumulative:{r['sample']}", [])
    for c in crashed:
        if c["view"] == "isolated":
            skip.setdefault(f"isolated:{c['sample']}", []).append(c["key"])
        else:
            skip.setdefault(f"cumulative:{c['sample']}", [])
    return skip

