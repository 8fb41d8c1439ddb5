"""The plan `expand` printed, held against the results that came back: no planned cell goes missing silently.

A planned cell whose job wrote no result becomes an `error` cell ("no result: its job ended before writing
one"), with its chunk job's conclusion where known; a cell planned as skipped (a fork's pull request and a
self-hosted runner) becomes a `skipped` cell with the reason. A cell whose `setup` commands failed is
recorded by `setup_failed_result` as an `error` cell naming the command and the tail of its output.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import InputError
from .results.model import CellError, CellResult, ModeResult, read_json

NO_RESULT = "no result: its job ended before writing one"
TAIL_CHARS = 4000


@dataclass(frozen=True, kw_only=True)
class PlannedCell:
    cell: str
    model: str
    backend: str
    modes: tuple[str, ...]
    chunk: int | None  # None: planned as skipped
    skip_reason: str | None = None


def load_plan(path: Path) -> list[PlannedCell]:
    """The cells of a plan file (what `deepview-ci expand --out PLAN.json` wrote)."""
    doc = read_json(path, what="plan")
    try:
        planned = [
            PlannedCell(cell=e["cell"], model=e["model"], backend=e["backend"], modes=tuple(e.get("modes") or ()), chunk=i)
            for i, m in enumerate(doc["matrix"]) for e in m["include"]
        ]
        planned += [
            PlannedCell(cell=e["cell"], model=e["model"], backend=e["backend"], modes=tuple(e.get("modes") or ()),
                        chunk=None, skip_reason=str(e["reason"]))
            for e in doc.get("skipped") or ()
        ]
    except (KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"{path}: not a plan written by `deepview-ci expand` (missing {exc})",
                         hint="pass the file `deepview-ci expand MATRIX --out PLAN.json` wrote") from None
    return planned


def parse_chunk_results(text: str | None) -> dict[int, str]:
    """`0=success,1=cancelled` (the chunk jobs' `needs.<job>.result`) → {0: "success", 1: "cancelled"}."""
    out: dict[int, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key.strip().isdigit():
            raise InputError(f"--chunk-results: {part!r} is not CHUNK=RESULT", hint="e.g. --chunk-results 0=success,1=failure")
        if value.strip():
            out[int(key)] = value.strip()
    return out


def _planned_result(p: PlannedCell, *, status: str, message: str, error_type: str) -> CellResult:
    return CellResult(
        id=p.cell, model=p.model, backend=p.backend, status=status,
        modes={m: ModeResult(status=status, reason=message) for m in p.modes},
        error=CellError(type=error_type, message=message) if status == "error" else None,
        env={"planned": True} if status == "error" else {"planned": True, "skip_reason": message},
    )


def apply_plan(cells: Sequence[CellResult], plan: Sequence[PlannedCell],
               chunk_results: Mapping[int, str] | None = None) -> list[CellResult]:
    """`cells` plus one result for every planned cell that has none; unplanned cells are kept as they are."""
    have = {c.id for c in cells}
    added: list[CellResult] = []
    for p in plan:
        if p.cell in have:
            continue
        have.add(p.cell)
        if p.skip_reason is not None:
            added.append(_planned_result(p, status="skipped", message=p.skip_reason, error_type="skipped"))
            continue
        conclusion = (chunk_results or {}).get(p.chunk) if p.chunk is not None else None
        message = NO_RESULT + (f" (the cell jobs of chunk {p.chunk} concluded: {conclusion})" if conclusion else "")
        added.append(_planned_result(p, status="error", message=message, error_type="no_result"))
    return sorted([*cells, *added], key=lambda c: c.id)


def setup_failed_result(*, cell_id: str, model: str, backend: str, modes: Sequence[str], command: str,
                        log_text: str, exit_code: int | None, env: Mapping[str, Any]) -> CellResult:
    """The result of a cell whose `setup` failed: status `error`, the failing command and its output's tail."""
    first = command.strip().splitlines()[0] if command.strip() else "(unknown command)"
    message = f"setup failed: `{first}`" + (f" exited with {exit_code}" if exit_code is not None else "")
    return CellResult(
        id=cell_id, model=model, backend=backend, status="error",
        env=dict(env), artifacts_dir=f"cells/{cell_id}",
        modes={m: ModeResult(status="error", reason=message) for m in modes},
        error=CellError(type="setup_failed", message=message + "\n" + command.strip(), exit_code=exit_code,
                        stderr_tail=log_text[-TAIL_CHARS:]),
    )
