"""Expand a `Matrix` into cells (model × backend) with stable ids; select, skip and chunk them."""

from __future__ import annotations

import base64
import difflib
import fnmatch
import json
import math
import re
import urllib.parse
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Iterable, Mapping, Sequence

from .config import Cell, Matrix, cell_parallel, raw_entry, spec_to_json
from .workloads.parallel import with_process_group
from .errors import ConfigError
from .zoo.shards import Shard, split, zoo_plan_sizes

GITHUB_MATRIX_LIMIT = 256
ARTIFACT_PREFIX = "deepview-cell-"
ZOO_ARTIFACT = "deepview-zoo-"  # inventory-I-of-N, probes-b<row>-I-of-N, cells-b<row>, merged
ATTEMPT_SEP = "-attempt-"  # the workflow appends `-attempt-${{ github.run_attempt }}` to a cell's artifact name
_KEEP = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789.-")


def cell_id(model_id: str, backend_id: str) -> str:
    return f"{model_id}@{backend_id}"


def artifact_name(cid: str) -> str:
    """The GitHub artifact name of a cell: letters, digits, `.` and `-` kept, every other character `_XX`
    (its UTF-8 bytes in hex; `_` itself is `_5f`). A prefix code, so two cell ids never share a name."""
    return ARTIFACT_PREFIX + "".join(ch if ch in _KEEP else "".join(f"_{b:02x}" for b in ch.encode()) for ch in cid)


def artifact_cell(name: str) -> tuple[str, int] | None:
    """(cell id, attempt) of a folder named `<artifact_name(cell)>-attempt-N`, or None for any other name."""
    base, sep, attempt = name.rpartition(ATTEMPT_SEP)
    if not sep or not attempt.isdigit() or not base.startswith(ARTIFACT_PREFIX):
        return None
    escaped = base[len(ARTIFACT_PREFIX):]
    if not re.fullmatch(r"(?:[A-Za-z0-9.-]|_[0-9a-f]{2})*", escaped):
        return None
    raw = re.sub(r"_([0-9a-f]{2})", lambda m: f"%{m.group(1)}", escaped)
    try:
        return urllib.parse.unquote(raw, errors="strict"), int(attempt)
    except UnicodeDecodeError:
        return None


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
                    inputs=matrix.inputs.merged(m_raw.get("inputs")).merged(b_raw.get("inputs")),
                    references=matrix.references,
                    options=_merge_options(matrix.options, b_raw.get("options"), m_raw.get("options")),
                    parallel=with_process_group(cell_parallel(matrix.raw.get("defaults") or {}, m_raw, b_raw),
                                                backend.process_group, backend.device, spec_to_json(backend)),
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
        hint=(f"did you mean {', '.join(close)}?" if close else "list the cells with `deepview-ci cells MATRIX`"),
    )


FORK_SKIP_REASON = ("not run: a pull request from a fork does not run cells on self-hosted runners "
                    "(the calling workflow can opt in with `allow-fork-self-hosted: true`; see docs/github.md)")


def artifacts_pattern(names: Sequence[str]) -> str:
    """One `actions/download-artifact` pattern for the named artifacts ("" for none)."""
    if len(names) <= 1:
        return names[0] if names else ""
    return "{" + ",".join(names) + "}"


def github_backends(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Each backend's job settings, once (the plan's backend table; a cell entry names its row by index).

    `setup` travels as one line of base64 per command, so the job's shell decodes it without Python
    (the cell's own interpreter may be what the failing setup broke)."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for c in cells:
        b = c.backend
        if b.id in seen:
            continue
        seen.add(b.id)
        out.append({
            "backend": b.id,
            "runs-on": list(b.runs_on) if len(b.runs_on) > 1 else b.runs_on[0],
            "self-hosted": b.self_hosted,
            "python": b.python or "",
            # "" runs the job on the runner itself (GitHub accepts an empty `container:`)
            "container": {"image": b.container["image"], "options": b.container["options"],
                          "env": dict(b.container["env"])} if b.container else "",
            "setup": "\n".join(base64.b64encode(cmd.encode()).decode() for cmd in b.setup),
            "artifacts-pattern": artifacts_pattern(b.artifacts),
        })
    return out


def cell_minutes(c: Cell) -> int:
    """The step limit of running the cell: its own timeout (which normally fires first) plus 2 minutes."""
    return max(1, math.ceil(c.timeout / 60)) + 2


def github_include(cells: Sequence[Cell], backends: Sequence[Mapping[str, Any]], *, setup_minutes: int,
                   margin_minutes: int) -> list[dict[str, Any]]:
    """GitHub `strategy.matrix.include` entries, one per cell: its id, artifact name, backend row and time limits
    (`minutes` for the cell step; `job-minutes` = `setup_minutes` + `minutes` + `margin_minutes` for the job)."""
    row = {b["backend"]: i for i, b in enumerate(backends)}
    return [{"cell": c.id, "artifact": artifact_name(c.id), "b": row[c.backend.id], "minutes": cell_minutes(c),
             "job-minutes": setup_minutes + cell_minutes(c) + margin_minutes} for c in cells]


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


ZOO_STEP_MINUTES = 300  # a zoo job's own step at most (GitHub-hosted jobs end at 360 minutes)
ZOO_ARCH_MINUTES = 3  # an inventory shard's time per architecture at most (the scan's per-model limit, 180 s)


@dataclass(frozen=True, kw_only=True)
class ZooSplit:
    """How many zoo jobs (0: as many as `zoo/shards.zoo_plan_sizes` chooses), and their set-up and upload time."""

    inventory: int = 0
    probe: int = 0
    setup_minutes: int = 30
    margin_minutes: int = 5


def zoo_job(c_id: str, *, step: str, backend: str, shard: Shard, row: int, minutes: int,
            split_: ZooSplit, artifact: str) -> dict[str, Any]:
    """One include entry of a zoo job on a backend's runner (the cells workflow runs it like a cell's job)."""
    return {"cell": c_id, "zoo": step, "backend": backend, "shard": str(shard), "b": row, "artifact": artifact,
            "minutes": minutes, "job-minutes": split_.setup_minutes + minutes + split_.margin_minutes}


def zoo_plan(zoo: Sequence[Cell], backends: Sequence[Mapping[str, Any]], split_: ZooSplit) -> dict[str, Any]:
    """The zoo's jobs: inventory shards (any runner), then per backend its probe shards and one cells job (on the
    backend's runner). Every include matrix stays within GitHub's 256 jobs (`zoo_plan_sizes`)."""
    row = {b["backend"]: i for i, b in enumerate(backends)}
    types = sorted({c.model.config or c.model.id for c in zoo})
    per_backend: dict[str, list[Cell]] = {}
    for c in zoo:
        per_backend.setdefault(c.backend.id, []).append(c)
    n_inv, n_probe = zoo_plan_sizes(len(types), len(per_backend), inventory=split_.inventory, probe=split_.probe)
    inventory = [{"shard": str(s), "artifact": f"{ZOO_ARTIFACT}inventory-{s.name}",
                  "job-minutes": split_.setup_minutes + split_.margin_minutes
                  + min(ZOO_STEP_MINUTES, ZOO_ARCH_MINUTES * len(split(types, s)) + 2)}
                 for s in (Shard(index=i, count=n_inv) for i in range(1, n_inv + 1))]
    probe, cells = [], []
    for bid, group in per_backend.items():
        b = row[bid]
        total = sum(c.timeout for c in group) / 60
        for i in range(1, n_probe + 1):
            s = Shard(index=i, count=n_probe)
            probe.append(zoo_job(f"zoo-probe-b{b}-{s.name}", step="probe", backend=bid, shard=s, row=b,
                                 minutes=min(ZOO_STEP_MINUTES, math.ceil(total / n_probe) + 2), split_=split_,
                                 artifact=f"{ZOO_ARTIFACT}probes-b{b}-{s.name}"))
        cells.append(zoo_job(zoo_job_name(b), step="cells", backend=bid, shard=Shard(), row=b,
                             minutes=min(ZOO_STEP_MINUTES, math.ceil(total) + 2), split_=split_,
                             artifact=f"{ZOO_ARTIFACT}cells-b{b}") | {"probes": f"{ZOO_ARTIFACT}probes-b{b}-*"})
    return {"architectures": len(types), "backends": list(per_backend), "inventory": {"include": inventory},
            "probe": {"include": probe}, "cells": {"include": cells}}


def zoo_job_name(row: int) -> str:
    """The job that writes a backend's zoo cells (`zoo-cells-b<row>`): the plan names it in each of those cells."""
    return f"zoo-cells-b{row}"


def _planned(c: Cell, row: Mapping[str, int], **extra: Any) -> dict[str, Any]:
    entry = {"cell": c.id, "model": c.model.id, "backend": c.backend.id, "modes": list(c.modes)}
    if c.model.zoo:
        entry["job"] = zoo_job_name(row[c.backend.id]) if c.backend.id in row else "zoo-cells"
    return entry | extra


def expand_json(cells: Sequence[Cell], *, max_jobs: int, chunk_size: int = GITHUB_MATRIX_LIMIT,
                fork_pr: bool = False, setup_minutes: int = 30, margin_minutes: int = 5,
                zoo_split: ZooSplit | None = None) -> dict[str, Any]:
    """The plan: the backend table, chunks of include entries to run, the zoo's jobs (`zoo`, when the matrix has a
    zoo entry: its architectures are not one job each), and the planned cells that will not run.

    With `fork_pr`, cells bound for self-hosted runners are planned as skipped (a fork's
    pull request could rewrite `setup`/`container` and run anything on the vendor's machine).
    """
    skipped = [c for c in cells if fork_pr and c.backend.self_hosted]
    run = [c for c in cells if not (fork_pr and c.backend.self_hosted)]
    jobs = [c for c in run if not c.model.zoo]
    zoo = [c for c in run if c.model.zoo]
    chunks = chunk(jobs, max_jobs=max_jobs, chunk_size=chunk_size)
    backends = github_backends(run)
    row = {b["backend"]: i for i, b in enumerate(backends)}
    split_ = replace(zoo_split or ZooSplit(), setup_minutes=setup_minutes, margin_minutes=margin_minutes)
    return {
        "count": len(run),
        "chunks": len(chunks) if jobs else 0,
        "backends": backends,
        "matrix": [{"include": github_include(ch, backends, setup_minutes=setup_minutes, margin_minutes=margin_minutes)}
                   for ch in chunks],
        "zoo": zoo_plan(zoo, backends, split_) if zoo else None,
        "cells": [_planned(c, row) for c in run],
        "skipped": [_planned(c, row, reason=FORK_SKIP_REASON) for c in skipped],
    }


def dumps_compact(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
