"""The plan `expand` printed, held against the results that came back: no planned cell goes missing silently.

A planned cell whose job wrote no result becomes an `error` cell ("no result: its job ended before writing
one"), with its chunk job's conclusion where known; a cell planned as skipped (a fork's pull request and a
self-hosted runner) becomes a `skipped` cell with the reason. A cell whose `setup` commands failed is
recorded by `setup_failed_result` as an `error` cell naming the command and the tail of its output.

Also the GitHub side of the plan: the step outputs `expand` writes (`plan_outputs`), kept under GitHub's
1 MB per job (`check_output_size`), and the newest attempt of each cell's artifact (`collect_attempts`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .errors import ConfigError, InputError
from .fsutil import atomic_write_json
from .matrix import ARTIFACT_PREFIX, ATTEMPT_SEP, ZOO_ARTIFACT, artifact_cell, dumps_compact
from .results.model import RESULT_NAME, CellError, CellResult, ModeResult, load_cell_result, read_json

NO_RESULT = "no result: its job ended before writing one"
TAIL_CHARS = 4000
COLLECTED = "artifacts.json"  # written by `collect` into the run folder: cell → the artifact it came from
SETUP_RECORD = "setup-failed"  # cells/<id>/setup-failed/{command.txt,exit-code,output.log}, written by the job's shell
# GitHub caps a job's outputs at 1 MB, counted as UTF-16; deepview-ci stops at 900 kB (2 bytes a code unit)
OUTPUT_LIMIT_UNITS = 450_000


@dataclass(frozen=True, kw_only=True)
class PlannedCell:
    cell: str
    model: str
    backend: str
    modes: tuple[str, ...]
    chunk: int | None  # None: planned as skipped, or a zoo cell
    skip_reason: str | None = None
    job: str | None = None  # a zoo cell: the job that writes it (`zoo-cells-<row>`), whose setup record it shares


def load_plan(path: Path) -> list[PlannedCell]:
    """The cells of a plan file (what `deepview-ci expand --out PLAN.json` wrote)."""
    doc = read_json(path, what="plan")
    try:
        chunk_of = {e["cell"]: i for i, m in enumerate(doc["matrix"]) for e in m["include"]}
        planned = [
            PlannedCell(cell=e["cell"], model=e["model"], backend=e["backend"], modes=tuple(e.get("modes") or ()),
                        chunk=None if e.get("job") else chunk_of[e["cell"]], job=e.get("job"))
            for e in doc["cells"]
        ]
        planned += [
            PlannedCell(cell=e["cell"], model=e["model"], backend=e["backend"], modes=tuple(e.get("modes") or ()),
                        chunk=None, skip_reason=str(e["reason"]), job=e.get("job"))
            for e in doc.get("skipped") or ()
        ]
    except (KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"{path}: not a plan written by this version of `deepview-ci expand` (missing {exc})",
                         hint="pass the file `deepview-ci expand MATRIX --out PLAN.json` wrote") from None
    return planned


def parse_chunk_results(text: str | None) -> dict[int, str]:
    """`0=success,1=cancelled` (the chunk jobs' `needs.<job>.result`) → {0: "success", 1: "cancelled"};
    `*=failure` (one result for every chunk, when the chunks run as one matrix job) → {-1: "failure"}."""
    out: dict[int, str] = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        if sep and key.strip() == "*":
            key = "-1"
        if not sep or not key.strip().lstrip("-").isdigit():
            raise InputError(f"--chunk-results: {part!r} is not CHUNK=RESULT",
                             hint="e.g. --chunk-results 0=success,1=failure, or '*=failure' for every chunk")
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


Evidence = Callable[[PlannedCell], CellResult | None]  # what a job left behind, as a result


def apply_plan(cells: Sequence[CellResult], plan: Sequence[PlannedCell],
               chunk_results: Mapping[int, str] | None = None, evidence: Evidence | None = None) -> list[CellResult]:
    """`cells` plus one result for every planned cell that has none; unplanned cells are kept as they are.

    `evidence(p)` may rebuild a result from what the cell's job left behind (a setup record, a journal);
    otherwise the cell is `error` ("no result"), with its chunk job's conclusion where known."""
    have = {c.id for c in cells}
    added: list[CellResult] = []
    results = chunk_results or {}
    for p in plan:
        if p.cell in have:
            continue
        have.add(p.cell)
        if p.skip_reason is not None:
            added.append(_planned_result(p, status="skipped", message=p.skip_reason, error_type="skipped"))
            continue
        found = evidence(p) if evidence is not None else None
        if found is not None:
            added.append(found)
            continue
        conclusion = results.get(p.chunk, results.get(-1)) if p.chunk is not None else None
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


def read_setup_record(folder: Path, *, cell_id: str, model: str, backend: str, modes: Sequence[str],
                      env: Mapping[str, Any]) -> CellResult:
    """The `error` result of a failed setup, from the plain files the job's shell wrote (no deepview-ci needed there):
    `command.txt`, `exit-code` and `output.log`."""
    def read(name: str) -> str:
        try:
            return (folder / name).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        except OSError as exc:
            raise InputError(f"{folder / name}: cannot read: {exc.strerror}") from None

    if not folder.is_dir():
        raise InputError(f"{folder}: no such folder", hint="pass the folder holding command.txt, output.log and exit-code")
    code = read("exit-code").strip()
    return setup_failed_result(cell_id=cell_id, model=model, backend=backend, modes=modes, command=read("command.txt"),
                               log_text=read("output.log"), exit_code=int(code) if code.lstrip("-").isdigit() else None,
                               env=env)


# --------------------------------------------------------------------------- GitHub: outputs and attempts


def utf16_units(text: str) -> int:
    """Length as GitHub sizes job outputs: UTF-16 code units (a character outside the BMP counts 2)."""
    return len(text.encode("utf-16-le")) // 2


def plan_outputs(doc: Mapping[str, Any]) -> dict[str, str]:
    """The step outputs `expand` writes: counts, the backend table once, the chunk indices, one matrix per chunk, and
    the zoo's three include matrices (`zoo-inventory`, `zoo-probe`, `zoo-cells`; `zoo-shards` = 0 without a zoo)."""
    out = {
        "count": str(doc["count"]),
        "chunks": str(doc["chunks"]),
        "chunk-ids": json.dumps(list(range(doc["chunks"]))),
        "skipped-cells": str(len(doc["skipped"])),
        "backends": dumps_compact(doc["backends"]),
    }
    for i, m in enumerate(doc["matrix"] if doc["chunks"] else ()):
        out[f"matrix-{i}"] = dumps_compact(m)
    zoo = doc.get("zoo") or {}
    out["zoo-shards"] = str(len(zoo["inventory"]["include"])) if zoo else "0"
    for step in ("inventory", "probe", "cells"):  # the zoo's include matrices (empty without a zoo entry)
        out[f"zoo-{step}"] = dumps_compact(zoo[step] if zoo else {"include": []})
    return out


def check_output_size(outputs: Mapping[str, str], *, limit: int = OUTPUT_LIMIT_UNITS) -> int:
    """The outputs' size as GitHub counts it (names and values, UTF-16 code units); past `limit`, a ConfigError
    saying how many cells would fit."""
    total = sum(utf16_units(k) + utf16_units(v) for k, v in outputs.items())
    if total <= limit:
        return total
    cells = sum(len(json.loads(v)["include"]) for k, v in outputs.items() if k.startswith("matrix-"))
    fit = cells * limit // total  # entries and backend rows both shrink with a narrower matrix
    raise ConfigError(
        f"the plan's job outputs would be {total:,} UTF-16 code units ({2 * total / 1000:,.0f} kB as GitHub counts them), "
        f"past deepview-ci's limit of {limit:,} ({2 * limit // 1000} kB; GitHub fails a job whose outputs pass 1 MB); "
        f"about {fit} of these {cells} cells fit",
        hint="narrow the matrix (the `select` input: --select/--skip, or exclude in the matrix), shorten long model or "
             "backend ids, or split the matrix over two workflow calls (docs/github.md, Limits)")


UNREADABLE_SUFFIX = ".unreadable"  # a cell's result.json that `collect` could not read is kept beside, renamed so


def collect_attempts(artifacts: Path, run_dir: Path, *, warn: Callable[[str], None] | None = None) -> dict[str, int]:
    """Copy each cell's newest attempt (`<artifact>-attempt-N` folders, one per downloaded artifact) into
    `run_dir`, replacing that cell's folder there; returns {cell: attempt}. Other folders are left alone.

    No cell is dropped in silence. An attempt that cannot be read (no `cells/<id>/` folder in it, or a `result.json`
    that is not a readable result of that cell) is passed over for the newest attempt that can, with a `warn` line;
    when none can, the cell gets an `error` result that says why (the unreadable file kept as
    `result.json.unreadable`), so the report shows the cell and the step goes on. A folder named like a cell
    artifact whose name does not decode is a `warn` line too."""
    say = warn or (lambda _message: None)
    attempts: dict[str, list[tuple[int, Path]]] = {}
    for folder in sorted(artifacts.iterdir()) if artifacts.is_dir() else ():
        parsed = artifact_cell(folder.name) if folder.is_dir() else None
        if parsed is None:
            if folder.is_dir() and folder.name.startswith(ARTIFACT_PREFIX):
                say(f"{folder}: not collected: the name does not decode to a cell id and attempt "
                    f"({ARTIFACT_PREFIX}<cell>{ATTEMPT_SEP}N)")
            continue
        cid, attempt = parsed
        attempts.setdefault(cid, []).append((attempt, folder))
    newest: dict[str, tuple[int, Path]] = {}
    for cid, found in sorted(attempts.items()):
        found.sort(reverse=True)
        passed: list[str] = []
        for attempt, folder in found:
            why = _unreadable(folder / "cells" / cid, cid)
            if why is None:
                break
            passed.append(f"{folder.name}: {why}")
        else:
            attempt, folder = found[0]
        newest[cid] = (attempt, folder)
        target = run_dir / "cells" / cid
        if len(passed) < len(found):
            _replace_tree(folder / "cells" / cid, target)
            if passed:
                say(f"{cid}: took {folder.name}; passed over {'; '.join(passed)}")
            continue
        _replace_tree(folder / "cells" / cid, target)
        if (target / RESULT_NAME).is_file():
            (target / RESULT_NAME).replace(target / (RESULT_NAME + UNREADABLE_SUFFIX))
        message = f"collect: no attempt of this cell can be read ({'; '.join(passed)})"
        model, _, backend = cid.partition("@")
        result = CellResult(id=cid, model=model or cid, backend=backend or "?", status="error", env={"collected": True},
                            artifacts_dir=f"cells/{cid}")
        result.error = CellError(type="unreadable_artifact", message=message)
        atomic_write_json(target / RESULT_NAME, result.to_dict())
        say(f"{cid}: {message}; it is an `error` cell in the report")
    names = {cid: folder.name for cid, (_a, folder) in newest.items()}
    zoo = collect_zoo(artifacts, run_dir, names)
    if names:  # which artifact (and attempt) each cell came from: the issues name it, never a guess
        atomic_write_json(run_dir / COLLECTED, {"kind": "deepview-ci-collected", "artifacts": dict(sorted(names.items()))})
    return {**{cid: attempt for cid, (attempt, _f) in newest.items()}, **zoo}


def _unreadable(cdir: Path, cid: str) -> str | None:
    """Why the cell folder of an attempt cannot be used, or None. A folder without `result.json` is usable: its job
    ended before writing one, and what it left (journal, setup record) is what `aggregate --plan` reads."""
    if not cdir.is_dir():
        return f"it holds no cells/{cid}/ folder"
    if not (cdir / RESULT_NAME).exists():
        return None
    try:
        result = load_cell_result(cdir / RESULT_NAME)
    except InputError as exc:
        return exc.message
    if result.id != cid:
        return f"its {RESULT_NAME} is the result of cell {result.id!r}"
    return None


def collected_artifacts(run_dir: Path | None) -> dict[str, str]:
    """cell → the artifact `collect` took it from (``<name>-attempt-N``), from the run folder; {} when unknown."""
    path = Path(run_dir) / COLLECTED if run_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    got = doc.get("artifacts") if isinstance(doc, dict) else None
    return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}


def _replace_tree(source: Path, target: Path) -> None:
    if target.exists():
        shutil.rmtree(target)
    if source.is_dir():
        shutil.copytree(source, target)


def collect_zoo(artifacts: Path, run_dir: Path, names: dict[str, str] | None = None) -> dict[str, int]:
    """Copy what the zoo cells jobs uploaded (`deepview-zoo-cells-b<row>` folders, one per backend, replaced on a
    re-run): every architecture's `cells/<id>/` and the backend's `zoo/<backend>.json`; returns {cell: 1} (and
    notes each cell's artifact in `names`)."""
    got: dict[str, int] = {}
    for folder in sorted(artifacts.glob(f"{ZOO_ARTIFACT}cells-*")) if artifacts.is_dir() else ():
        for cdir in sorted((folder / "cells").iterdir()) if (folder / "cells").is_dir() else ():
            if cdir.is_dir():
                _replace_tree(cdir, run_dir / "cells" / cdir.name)
                got[cdir.name] = 1
                if names is not None:
                    names[cdir.name] = folder.name
        for record in sorted((folder / "zoo").glob("*.json")):
            (run_dir / "zoo").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(record, run_dir / "zoo" / record.name)
    return got
