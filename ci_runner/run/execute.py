"""Run cells, each in its own process, with a timeout; survive aborts, segfaults, OOM kills and hangs.

Layout of a run folder::

    DIR/cells/<cell-id>/result.json          final CellResult (atomic)
    DIR/cells/<cell-id>/result.partial.json  written after each mode while the cell runs
    DIR/cells/<cell-id>/journal.log          append-only enter/leave events of modes and modules
    DIR/cells/<cell-id>/heartbeat.json       where the worker is: mode, phase, since when (run/heartbeat.py)
    DIR/cells/<cell-id>/stderr.log           the worker's stderr
    DIR/cells/<cell-id>/<mode>/…             artifacts (repro scripts, dumps)

When a worker dies (a crash, SIGKILL, or the cell's timeout), every mode it finished is kept from the partial
result, and so is what the open mode checkpointed (its single forward, each phase it finished:
`ModeContext.checkpoint`, `checkpoint_phase`); that mode is marked crashed (or timeout) with where it stopped
(`data.stopped`: mode, the phase and module the journal names), and a fresh worker continues with the remaining
modes while time is left.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .cellrun import run_cell_inprocess, write_final
from .heartbeat import Watch, mode_seconds
from .resume import cell_config, rerun_reason
from ..config import Cell, load_matrix
from ..engine.envinfo import base_stamp
from ..errors import EXIT_INTERRUPTED, DeepviewError, ExecutionError, InputError, report_error
from ..fsutil import atomic_write_json
from ..log import Progress
from ..modes.ops.storepath import clear_stores
from ..procs.isolate import ChildExit, LiveChildren, arm_worker, child_env, file_tail, open_entry, run_process
from ..matrix import find_cell
from ..results.model import CHECKPOINT_KEY, HEARTBEAT_NAME, JOURNAL_NAME, PARTIAL_NAME, RESULT_NAME, STDERR_NAME, CellError, CellResult, ModeResult, load_cell_result, read_json

STDERR_TAIL_CHARS = 4000
WORKER_MODULE = "ci_runner.run.execute"  # the cell worker's entry (`worker_main`), started by `_run_worker`
_KILL_GRACE_S = 2.0


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    matrix_path: Path
    out_dir: Path
    jobs: int = 1
    cores: int | None = None  # `--jobs auto`: share this many cores, each cell taking `cell_workers` of them
    force: bool = False
    modes: tuple[str, ...] | None = None  # override the matrix's modes for every cell
    python: str = sys.executable


def available_cores() -> int:
    """CPU cores this process may use (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def cell_workers(cell: Cell, cores: int, modes: Sequence[str] | None = None) -> int:
    """Cores a cell keeps busy at once: the ops mode's probe workers (``options.ops.workers``; its
    default, as in `modes.ops.OpsOptions`, is 2 on two cores or more) when it runs ops, else 1."""
    if "ops" not in (modes or cell.modes):
        return 1
    ops = cell.options.get("ops") if isinstance(cell.options, Mapping) else None
    raw = ops.get("workers") if isinstance(ops, Mapping) else None
    try:
        workers = int(raw) if raw is not None else (2 if cores >= 2 else 1)
    except (TypeError, ValueError):
        workers = 1  # the ops mode refuses it with a clear error; here it only sizes the pool
    return max(1, min(workers, cores))


MODE_COST = {"layers": 1.3, "ops": 1.0, "numerics": 0.8}  # a mode's time relative to ops, on the bundled example


def expected_cost(cell: Cell, modes: Sequence[str] | None = None) -> float:
    """A rough weight of a cell's time, to start the long ones first: its modes' usual relative times."""
    return sum(MODE_COST.get(m, 1.0) for m in (modes or cell.modes))


def auto_jobs(cells: Sequence[Cell], cores: int, modes: Sequence[str] | None = None) -> int:
    """What ``--jobs auto`` runs at once at most: cores / the smallest per-cell workers, at least 1."""
    return max(1, cores // min((cell_workers(c, cores, modes) for c in cells), default=1))


class _Cores:
    """Counts busy cores: a cell waits until its `cell_workers` cores are free."""

    def __init__(self, total: int) -> None:
        self.free = total
        self.cond = threading.Condition()

    def take(self, n: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.free >= n)
            self.free -= n

    def give(self, n: int) -> None:
        with self.cond:
            self.free += n
            self.cond.notify_all()


def cell_dir(out_dir: Path, cid: str) -> Path:
    return out_dir / "cells" / cid


def existing_result(out_dir: Path, cid: str) -> CellResult | None:
    """A finished cell's result, or None when absent or unreadable (then the cell reruns)."""
    path = cell_dir(out_dir, cid) / RESULT_NAME
    if not path.exists():
        return None
    try:
        return load_cell_result(path)
    except DeepviewError:
        return None


def load_partial(cdir: Path) -> CellResult | None:
    """The cell's result so far (written after each mode), or None when there is none or it is unreadable."""
    path = cdir / PARTIAL_NAME
    if not path.exists():
        return None
    try:
        return CellResult.from_dict(read_json(path, what="partial cell result"))
    except (InputError, KeyError, TypeError):
        return None


def run_one(cell: Cell, opts: RunOptions, children: LiveChildren | None = None,
            progress: Progress | None = None) -> CellResult:
    """Run one cell to a final, written result, restarting the worker after a crash; `progress` says each mode's
    start and end (and each phase's start) from the cell's heartbeat while a worker runs."""
    children = children or LiveChildren()
    cdir = cell_dir(opts.out_dir, cell.id)
    cdir.mkdir(parents=True, exist_ok=True)
    for stale in (PARTIAL_NAME, JOURNAL_NAME, STDERR_NAME, HEARTBEAT_NAME):
        (cdir / stale).unlink(missing_ok=True)
    modes = tuple(opts.modes or cell.modes)
    started = time.monotonic()
    deadline = started + cell.timeout
    error: CellError | None = None
    remaining = list(modes)
    while remaining:
        budget = deadline - time.monotonic()
        if budget <= 0:
            break
        with Watch(cdir, cell.id, progress.info if progress is not None else (lambda _: None)):
            end = _run_worker(cell, opts, remaining, budget, cdir, children)
        if children.interrupted:
            raise KeyboardInterrupt
        partial = load_partial(cdir)
        done = {m for m, r in partial.modes.items() if CHECKPOINT_KEY not in r.data} if partial else set()
        if not end.timed_out and end.returncode == 0 and all(m in done for m in remaining):
            break  # an earlier crash in this cell (if any) stays in `error`
        error, result = _record_death(cell, cdir, end, partial, remaining, done)
        remaining = [m for m in remaining if m not in result.modes]
        if end.timed_out:
            break
    return _finish(cell, cdir, modes, error, started, deadline,
                   cell_config(cell, modes, base=opts.matrix_path.parent))


def _run_worker(cell: Cell, opts: RunOptions, remaining: Sequence[str], budget: float, cdir: Path,
                children: LiveChildren) -> ChildExit:
    """One worker process for the `remaining` modes of the cell, killed (with its session) at `budget`."""
    cmd = [
        opts.python, "-m", WORKER_MODULE,
        "--matrix", str(opts.matrix_path), "--cell", cell.id, "--out", str(opts.out_dir),
        "--modes", ",".join(remaining), "--budget", f"{budget:.3f}",
    ]
    env = child_env()  # the worker dies with this process (`isolate.arm_worker`)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return run_process(cmd, timeout=budget, stdout=cdir / STDERR_NAME, env=env, grace=_KILL_GRACE_S, append=True,
                       live=children)


def _record_death(cell: Cell, cdir: Path, end: ChildExit, partial: CellResult | None, remaining: Sequence[str],
                  done: set[str]) -> tuple[CellError, CellResult]:
    """The worker died (or hung): blame the mode that was open (the journal's), keep what was finished, write
    the partial result; returns the cell's error and that result."""
    journal = cdir / JOURNAL_NAME
    running = open_entry(journal, "mode") or next((m for m in remaining if m not in done), remaining[0])
    last_module = open_entry(journal, "module")
    status = "timeout" if end.timed_out else "crashed"
    what = f"cell timed out after {cell.timeout:g}s" if end.timed_out else f"worker process {end.ended()}"
    workload = open_entry(journal, "workload")  # `<mode>.<phase>`: the phase the mode was running
    phase = workload.split(".", 1)[-1] if workload else None
    where = (f" in phase {phase!r}" if phase else "") + (f" while running module {last_module!r}" if last_module else "")
    error = CellError(type=status, message=f"{what} during mode {running!r}{where}",
                      exit_code=None if end.timed_out else end.returncode, signal=end.signal,
                      stderr_tail=file_tail(cdir / STDERR_NAME, STDERR_TAIL_CHARS), last_module=last_module)
    result = partial or CellResult(id=cell.id, model=cell.model.id, backend=cell.backend.id, status=status,
                                   env=base_stamp(), artifacts_dir=f"cells/{cell.id}")
    kept = result.modes.get(running) if running not in done else None  # `ModeContext.checkpoint`'s, if any
    data = {k: v for k, v in kept.data.items() if k != CHECKPOINT_KEY} if kept is not None else {}
    if last_module:
        data["last_module"] = last_module
    if phase:
        data["phases"] = {**dict(data.get("phases") or {}), phase: {"status": status, "reason": error.message}}
    data["stopped"] = {"mode": running, "phase": phase, "module": last_module}  # where the worker stopped
    result.modes[running] = ModeResult(status=status, reason=error.message, data=data,
                                       findings=list(kept.findings) if kept is not None else [],
                                       duration_s=mode_seconds(cdir, running) or 0.0)
    _write_partial(cdir, result)
    return error, result


def _finish(cell: Cell, cdir: Path, modes: Sequence[str], error: CellError | None, started: float,
            deadline: float, config: dict[str, Any]) -> CellResult:
    """The cell's final result: what the workers wrote, modes never reached marked, the crash kept; written."""
    result = load_partial(cdir) or CellResult(id=cell.id, model=cell.model.id, backend=cell.backend.id,
                                                status="skipped", env=base_stamp(), artifacts_dir=f"cells/{cell.id}")
    for m in modes:
        if m not in result.modes:
            reason = "not run: the cell's time ran out" if time.monotonic() >= deadline else "not run"
            result.modes[m] = ModeResult(status="timeout" if error and error.type == "timeout" else "skipped", reason=reason)
    result.modes = {m: result.modes[m] for m in modes if m in result.modes}
    result.error = error or result.error  # a crash found here, else what the worker recorded
    result.config = config  # what a rerun into this folder compares (`resume.rerun_reason`)
    result.duration_s = time.monotonic() - started
    result.status = result.fold_status()
    if error is not None and result.status not in ("crashed", "timeout"):
        result.status = error.type
    write_final(result, cdir)
    return result


def _write_partial(cdir: Path, result: CellResult) -> None:
    atomic_write_json(cdir / PARTIAL_NAME, result.to_dict())


def run_cells(cells: Sequence[Cell], opts: RunOptions, progress: Progress | None = None) -> list[CellResult]:
    """Run (or reuse) every cell; `jobs` at a time. Ctrl-C stops workers and leaves finished cells on disk."""
    if opts.jobs < 1:
        raise ExecutionError(f"--jobs must be at least 1, got {opts.jobs}")
    cores = _Cores(opts.cores) if opts.cores else None
    progress = progress or Progress(len(cells), quiet=True)
    children = LiveChildren()
    results: dict[str, CellResult] = {}
    todo: list[Cell] = []
    for c in cells:
        prior = None if opts.force else existing_result(opts.out_dir, c.id)
        config = cell_config(c, opts.modes, base=opts.matrix_path.parent)
        why = rerun_reason(prior, config) if prior is not None else None
        if prior is not None and why is None:
            results[c.id] = prior
            progress.cell_reused(c.id, prior.status)
        else:
            if why is not None:
                progress.cell_rerun(c.id, why)
            todo.append(c)
    if opts.force:  # a forced run probes again: the probe stores earlier runs left for these backends go

        clear_stores(opts.out_dir, {c.backend.id for c in todo})

    def work(c: Cell) -> CellResult:
        need = cell_workers(c, opts.cores, opts.modes) if opts.cores else 0
        if cores is not None:
            cores.take(need)
        try:
            if children.interrupted:  # Ctrl-C came while this cell waited for cores
                raise KeyboardInterrupt
            progress.cell_started(c.id)
            r = run_one(c, opts, children, progress)
        finally:
            if cores is not None:
                cores.give(need)
        detail = r.error.message if r.error else ""
        progress.cell_finished(c.id, r.status, r.duration_s, detail)
        return r

    width = auto_jobs(todo, opts.cores, opts.modes) if opts.cores else opts.jobs
    if width > 1:  # the longest cells first, so that no long one is left to run alone at the end
        todo.sort(key=lambda c: -expected_cost(c, opts.modes))
    progress.expect({c.id: expected_cost(c, opts.modes) for c in todo}, width)  # the time left on each line
    pool = ThreadPoolExecutor(max_workers=width) if width > 1 else None
    try:
        if pool is None:
            for c in todo:
                results[c.id] = work(c)
        else:
            for r in pool.map(work, todo):
                results[r.id] = r
    except KeyboardInterrupt:
        children.kill_all(grace=_KILL_GRACE_S)
        raise
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    return [results[c.id] for c in cells]


def run_zoo_cells(cells: Sequence[Cell], opts: RunOptions, progress: Progress | None = None) -> list[CellResult]:
    """The zoo cells (`ModelSpec.zoo`): one inventory scan, one probe per signature and backend (`zoo/run.py`);
    reused when every one of them already has a result (unless --force)."""
    if not cells:
        return []
    prior = {c.id: existing_result(opts.out_dir, c.id) for c in cells} if not opts.force else {}
    if prior and all(prior.values()):
        return [r for r in prior.values() if r is not None]
    from ..zoo.run import run_zoo  # deferred: the zoo imports the transformers catalog

    return run_zoo(cells, matrix_path=opts.matrix_path, out_dir=opts.out_dir, jobs=max(1, opts.jobs),
                   force=opts.force, progress=progress)


# --------------------------------------------------------------------------- inside the cell worker

def run_worker(*, matrix: Path, cell_id: str, out_dir: Path, modes: Sequence[str], budget: float) -> int:
    """Inside a cell worker: the `modes` of one cell within `budget` seconds, resuming its partial result."""
    arm_worker(budget)  # dies with its run, and ends itself past its budget
    deadline = time.monotonic() + budget
    cell = find_cell(load_matrix(matrix), cell_id)
    cdir = cell_dir(out_dir, cell.id)
    run_cell_inprocess(cell, cdir, modes=tuple(modes), deadline=deadline, previous=load_partial(cdir))
    return 0


def worker_main(argv: Sequence[str]) -> int:
    """`python -m ci_runner.run.execute --matrix M --cell ID --out DIR --modes a,b --budget S`: the worker
    `_run_worker` starts (also `deepview-ci _worker`). Its own entry rather than the CLI's, so that a worker imports
    the cell runner and not every command's modules (report, GitHub, history, zoo: ~0.35 CPU s a cell here)."""
    parser = argparse.ArgumentParser(prog="deepview-ci _worker")
    for name in ("--matrix", "--cell", "--out", "--modes", "--budget"):
        parser.add_argument(name, required=True)
    args = parser.parse_args(argv)
    try:
        return run_worker(matrix=Path(args.matrix), cell_id=args.cell, out_dir=Path(args.out),
                          modes=args.modes.split(","), budget=float(args.budget))
    except DeepviewError as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
