"""Expand a `Matrix` into cells (model × backend) with stable ids; select, skip and chunk them."""

from __future__ import annotations

import difflib
import fnmatch
import json
import re
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from .config import Cell, Matrix, raw_entry
from .errors import ConfigError

GITHUB_MATRIX_LIMIT = 256
_UNSAFE_ARTIFACT = re.compile(r'[":<>|*?\\/\r\n]')


def cell_id(model_id: str, backend_id: str) -> str:
    return f"{model_id}@{backend_id}"


def artifact_name(cid: str) -> str:
    """A GitHub artifact name for a cell: no `" : < > | * ? \\ /`."""
    return "deepview-cell-" + _UNSAFE_ARTIFACT.sub("_", cid.replace("@", "__"))


def _matches(sel: Mapping[str, str], model_id: str, backend_id: str) -> bool:
    return fnmatch.fnmatchcase(model_id, sel.get("model", "*")) and fnmatch.fnmatchcase(backend_id, sel.get("backend", "*"))


def _merge_options(*layers: Mapping[str, Any] | None) -> Mapping[str, Mapping[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for mode, opts in (layer or {}).items():
            out.setdefault(mode, {}).update(opts or {})
    return MappingProxyType({k: MappingProxyType(v) for k, v in out.items()})


def expand(matrix: Matrix) -> list[Cell]:
    """All cells, in matrix order (models outer, backends inner), include/exclude applied."""
    cells: list[Cell] = []
    for model in matrix.models:
        m_raw = raw_entry(matrix, "models", model.id)
        for backend in matrix.backends:
            if matrix.include and not any(_matches(s, model.id, backend.id) for s in matrix.include):
                continue
            if any(_matches(s, model.id, backend.id) for s in matrix.exclude):
                continue
            b_raw = raw_entry(matrix, "backends", backend.id)
            modes = tuple(m_raw.get("modes") or b_raw.get("modes") or matrix.modes)
            timeout = float(m_raw.get("timeout") or b_raw.get("timeout") or matrix.timeout)
            cells.append(
                Cell(
                    id=cell_id(model.id, backend.id),
                    model=model,
                    backend=backend,
                    modes=modes,
                    timeout=timeout,
                    inputs=matrix.inputs.merged(m_raw.get("inputs")),
                    references=matrix.references,
                    options=_merge_options(matrix.options, b_raw.get("options"), m_raw.get("options")),
                )
            )
    return cells


def select(cells: Iterable[Cell], select_globs: Sequence[str] = (), skip_globs: Sequence[str] = ()) -> list[Cell]:
    """Keep cells whose id matches any `select` glob (all when none), minus any `skip` glob."""
    out = []
    for c in cells:
        if select_globs and not any(fnmatch.fnmatchcase(c.id, g) for g in select_globs):
            continue
        if any(fnmatch.fnmatchcase(c.id, g) for g in skip_globs):
            continue
        out.append(c)
    return out


def find_cell(matrix: Matrix, cid: str) -> Cell:
    cells = expand(matrix)
    for c in cells:
        if c.id == cid:
            return c
    close = difflib.get_close_matches(cid, [c.id for c in cells], n=3)
    raise ConfigError(
        f"{matrix.path}: no cell {cid!r} in this matrix",
        hint=(f"did you mean {', '.join(close)}?" if close else "list the cells with `deepview-ci expand MATRIX`"),
    )


FORK_SKIP_REASON = ("not run: a pull request from a fork does not run cells on self-hosted runners "
                    "(the calling workflow can opt in with `allow-fork-self-hosted: true`; see docs/github.md)")


def artifacts_pattern(names: Sequence[str]) -> str:
    """One `actions/download-artifact` pattern for the named artifacts ("" for none)."""
    if len(names) <= 1:
        return names[0] if names else ""
    return "{" + ",".join(names) + "}"


def github_include(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """GitHub `strategy.matrix.include` entries, one per cell, with how its job is set up."""
    out = []
    for c in cells:
        b = c.backend
        out.append({
            "cell": c.id,
            "model": c.model.id,
            "backend": b.id,
            "runs-on": list(b.runs_on) if len(b.runs_on) > 1 else b.runs_on[0],
            "timeout-minutes": max(1, int(c.timeout // 60) + 5),
            "artifact": artifact_name(c.id),
            "modes": list(c.modes),
            "self-hosted": b.self_hosted,
            "python": b.python or "",
            # "" runs the job on the runner itself (GitHub accepts an empty `container:`)
            "container": {"image": b.container["image"], "options": b.container["options"],
                          "env": dict(b.container["env"])} if b.container else "",
            "setup": list(b.setup),
            "artifacts": list(b.artifacts),
            "artifacts-pattern": artifacts_pattern(b.artifacts),
        })
    return out


def chunk(cells: Sequence[Cell], *, max_jobs: int, chunk_size: int = GITHUB_MATRIX_LIMIT) -> list[list[Cell]]:
    """Split into GitHub-sized chunks; fail loudly past `max_jobs` cells."""
    if chunk_size < 1 or chunk_size > GITHUB_MATRIX_LIMIT:
        raise ConfigError(f"chunk size {chunk_size} is outside 1..{GITHUB_MATRIX_LIMIT}", hint=f"GitHub allows at most {GITHUB_MATRIX_LIMIT} jobs per matrix")
    if len(cells) > max_jobs:
        raise ConfigError(
            f"the matrix expands to {len(cells)} cells, more than the limit of {max_jobs}",
            hint="narrow it with exclude/include or --select/--skip, or raise --max-jobs (each chunk of "
            f"{chunk_size} needs its own matrix job in the workflow)",
        )
    return [list(cells[i : i + chunk_size]) for i in range(0, len(cells), chunk_size)] or [[]]


def expand_json(cells: Sequence[Cell], *, max_jobs: int, chunk_size: int = GITHUB_MATRIX_LIMIT,
                fork_pr: bool = False) -> dict[str, Any]:
    """The plan: chunks of include entries to run, and the planned cells that will not run, with why.

    With `fork_pr`, cells bound for self-hosted runners are planned as skipped (a fork's
    pull request could rewrite `setup`/`container` and run anything on the vendor's machine).
    """
    skipped = [c for c in cells if fork_pr and c.backend.self_hosted]
    run = [c for c in cells if not (fork_pr and c.backend.self_hosted)]
    chunks = chunk(run, max_jobs=max_jobs, chunk_size=chunk_size)
    return {
        "count": len(run),
        "chunks": len(chunks) if run else 0,
        "matrix": [{"include": github_include(ch)} for ch in chunks],
        "skipped": [{"cell": c.id, "model": c.model.id, "backend": c.backend.id, "modes": list(c.modes),
                     "reason": FORK_SKIP_REASON}
                    for c in skipped],
    }


def dumps_compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
