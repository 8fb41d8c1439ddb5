"""Inside the cell's own process: resolve the backend, run the selected modes in order.

This module is what the `_worker` command runs. The parent (`execute.py`) owns timeouts and crash
handling; here, a Python exception in a mode becomes that mode's `error` status and the next mode
still runs. After each mode the partial result is written atomically, so a hard crash later loses
nothing already diagnosed.
"""

from __future__ import annotations

import datetime as _dt
import time
import traceback
from pathlib import Path
from typing import Callable

from ..backends import resolve_backend
from ..config import Cell
from ..watch import compiles
from ..engine.envinfo import base_stamp, cell_stamp, plugin_modules
from ..errors import DeepviewError, ModelLoadError, TorchTooOldError
from ..fsutil import atomic_write_json
from ..modes import ModeContext, get_mode
from ..registry import load_ref, mode_spec
from .heartbeat import Heartbeat
from ..results.model import PARTIAL_NAME, RESULT_NAME, CellError, CellResult, ModeResult, save_cell_result


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def run_cell_inprocess(cell: Cell, cell_dir: Path, *, modes: tuple[str, ...], deadline: float,
                       previous: CellResult | None = None) -> CellResult:
    """Run `modes` of `cell` in this process; returns the (partial-merged) result and writes it."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result = previous or CellResult(
        id=cell.id, model=cell.model.id, backend=cell.backend.id, status="skipped",
        env=base_stamp(), artifacts_dir=f"cells/{cell.id}", started_at=_now(),
    )
    result.parallel = cell.parallel.label() if cell.parallel is not None else None

    def checkpoint() -> None:
        atomic_write_json(cell_dir / PARTIAL_NAME, result.to_dict())

    try:
        backend = resolve_backend(cell.backend)
        backend.prepare()
        result.env = cell_stamp(backend.device, backend.versions(),
                                plugins=plugin_modules(cell.backend.compile, cell.backend.imports))
    except TorchTooOldError as exc:  # the backend needs a newer torch: each mode is skipped, with the reason
        for name in modes:
            result.modes[name] = ModeResult(status="skipped", reason=f"backend setup: {exc.message}")
        return _finish(result, cell_dir, started)
    except Exception as exc:  # a DeepviewError, or a plugin import raising anything
        text = str(exc) if isinstance(exc, DeepviewError) else f"{type(exc).__name__}: {exc}"
        for name in modes:
            result.modes[name] = ModeResult(status="error", reason=f"backend setup failed: {text}")
        result.error = CellError(type="backend_setup", message=f"backend setup failed: {text}")
        return _finish(result, cell_dir, started)

    def keep_partial(name: str, partial: ModeResult) -> None:  # a mode's result so far (`ModeContext.checkpoint`)
        result.modes[name] = partial
        checkpoint()

    if _layout_failed(cell, result, modes):  # a matrix mistake its ranks would refuse: not the backend's finding
        return _finish(result, cell_dir, started)

    heartbeat = Heartbeat(cell_dir, cell.id)  # where the cell is, for the run's console and CI logs
    for note in fit_notes(cell, modes):  # limits that cannot fit the cell's timeout: said now, not found out later
        if note not in result.notes:
            result.notes.append(note)
            heartbeat.note(note)
    ctx = ModeContext(cell=cell, cell_dir=cell_dir, backend=backend, deadline=deadline, env=result.env,
                      previous=dict(result.modes), on_checkpoint=keep_partial, on_event=heartbeat.event, modes=modes)
    try:
        _run_modes(ctx, result, modes, checkpoint, heartbeat)
    finally:
        ctx.ranks().close()  # the cell's ranks (one launch for its modes' rank tasks) never outlive it
    return _finish(result, cell_dir, started)


def _run_modes(ctx: ModeContext, result: CellResult, modes: tuple[str, ...], checkpoint: Callable[[], None],
               heartbeat: Heartbeat) -> None:
    """Each mode in turn; the cell's ranks start with the first mode that declares a rank task (`ModeContext.ranks`),
    running the tasks of all of them beside the modes' single-rank parts."""
    for i, name in enumerate(modes):
        if ctx.model_error is not None:  # tried once per cell: the modes after the failed load do not retry it
            _model_failed(result, ctx.model_error, modes[i:])
            break
        fn = get_mode(name)
        if fn is None:
            result.modes[name] = ModeResult(status="skipped", reason=f"mode {name!r} is not available in this version of deepview-ci")
            checkpoint()
            continue
        ctx.journal("enter-mode", name)
        t0 = time.monotonic()
        before = compiles.tally()
        try:
            ctx.ranks().start(name)  # the first mode with a rank task launches the ranks once, for every such mode
            mode_result = fn(ctx)
        except TorchTooOldError as exc:
            mode_result = ModeResult(status="skipped", reason=exc.message)
        except DeepviewError as exc:
            mode_result = ModeResult(status="error", reason=str(exc))
        except Exception as exc:
            tb = traceback.format_exc(limit=8)
            mode_result = ModeResult(status="error", reason=f"{type(exc).__name__}: {exc}", data={"traceback": tb[-4000:]})
        mode_result.duration_s = mode_result.duration_s or (time.monotonic() - t0)
        mode_result.data["compiles"] = ctx.compiles_data(name, compiles.since(before))  # where the time went
        ctx.journal("leave-mode", name)
        result.modes[name] = mode_result
        ctx.previous[name] = mode_result
        checkpoint()
        heartbeat.mode_done(name, mode_result.status, mode_result.duration_s)
    else:
        if ctx.model_error is not None:
            _model_failed(result, ctx.model_error, ())


def _layout_error(cell: Cell) -> str | None:
    """Why the cell's tensor-parallel layout cannot shard its model (`tpplan.layout_problem`), or None."""
    from ..workloads.tpplan import layout_problem  # deferred: torch; this module is imported by the run parent too

    if cell.parallel is None:
        return None
    exc = layout_problem(cell.model, cell.inputs.seed, cell.parallel.tp, dict(cell.parallel.plan) or None)
    if exc is None:
        return None
    return f"{cell.parallel.label()}: {exc.message}" + (f" (fix: {exc.hint})" if exc.hint else "")


def _layout_failed(cell: Cell, result: CellResult, modes: tuple[str, ...]) -> bool:
    """Record a layout the cell's model cannot take as the cell's error (every mode not run); True when it did."""
    layout = _layout_error(cell)
    if layout is None:
        return False
    result.error = CellError(type="layout", message=layout)
    for name in modes:
        result.modes[name] = ModeResult(status="error", reason=f"not run: {layout}")
    return True


def fit_notes(cell: Cell, modes: tuple[str, ...]) -> list[str]:
    """What each mode's `ModeSpec.fit` says of the cell's timeout against its limits (nothing: they fit)."""
    out = []
    for name in modes:
        spec = mode_spec(name)
        if spec is not None and spec.fit and (note := load_ref(spec.fit)(cell)):
            out.append(str(note))
    return out


def _model_failed(result: CellResult, exc: ModelLoadError, rest: tuple[str, ...]) -> None:
    """The cell's model did not load: the cell's one-line error (what the console prints, with the fix), and the
    modes not run yet marked with it."""
    fix = f" (fix: {exc.hint})" if exc.hint else ""
    result.error = CellError(type="model_load", message=f"the model did not load: {exc.message}{fix}")
    for name in rest:
        result.modes[name] = ModeResult(status="error", reason=f"not run: the model did not load: {exc.message}")


def _finish(result: CellResult, cell_dir: Path, started: float) -> CellResult:
    result.duration_s += time.monotonic() - started
    result.status = result.fold_status()
    atomic_write_json(cell_dir / PARTIAL_NAME, result.to_dict())
    return result


def write_final(result: CellResult, cell_dir: Path) -> Path:
    path = save_cell_result(result, cell_dir / RESULT_NAME)
    try:
        (cell_dir / PARTIAL_NAME).unlink()
    except FileNotFoundError:
        pass
    return path
