"""The one result model. Everything downstream of a cell reads these, never live torch objects.

A `CellResult` is written by each cell as `cells/<cell-id>/result.json`; `aggregate` merges many
into a `Results` (`results.json`). Both validate against `schemas/results.schema.json`.

Non-finite floats (NaN/Inf in metrics) are stored as the strings ``"nan"``, ``"inf"``, ``"-inf"``
so that the files stay strict JSON; `number()` reads them back.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from functools import lru_cache
from importlib.resources import files
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping

import fastjsonschema
import jsonschema

from ..errors import InputError
from ..fsutil import atomic_write_chunks, atomic_write_json, utf8_text
from ..jsontext import parse_json
from ..registry import apply_to_schema, kind_names, mode_names

SCHEMA_VERSION = 1

# The cell folder (`DIR/cells/<cell-id>/`), its file names in one place; each mode's artifacts go in `<mode>/`.
RESULT_NAME = "result.json"  # the finished cell's `CellResult` (what `aggregate` reads)
PARTIAL_NAME = "result.partial.json"  # written after each mode, so a hard crash loses nothing already diagnosed
CHECKPOINT_KEY = "checkpoint"  # in a mode's data: a result saved mid-mode (`ModeContext.checkpoint`), not final
JOURNAL_NAME = "journal.log"  # enter/leave events (fsync'd), read by the parent after a hard crash
STDERR_NAME = "stderr.log"  # the cell worker's stderr
HEARTBEAT_NAME = "heartbeat.json"  # where the worker is: mode, phase, since when (run/heartbeat.py)
RESULTS_LISTED: tuple[str, ...] = ("root_causes", "cells", "ranking", "patterns")  # results.json: one item per line, in this order
STARTED_NAME = "started.json"  # written and uploaded by the cell job's shell before the cell runs (the workflow)

CellStatus = Literal["pass", "fail", "error", "timeout", "crashed", "skipped", "inconclusive"]
# inconclusive: nothing failed, but the backend did not run everything (a probe ran in eager): never a pass
CELL_STATUSES: tuple[str, ...] = ("pass", "fail", "error", "timeout", "crashed", "skipped", "inconclusive")
STAGES: tuple[str, ...] = ("trace", "compile", "run", "compare")
# Worst first: used to fold mode statuses into a cell status and to rank "got worse".
STATUS_SEVERITY: dict[str, int] = {
    "crashed": 6,
    "timeout": 5,
    "error": 4,
    "fail": 3,
    "inconclusive": 2,
    "pass": 1,
    "skipped": 0,
}


def fingerprint(kind: str, backend: str, *key: str) -> str:
    """Stable id of a finding: kind, backend and a semantic key; never paths, times or addresses."""
    text = "\x1f".join((kind, backend, *key))
    return hashlib.sha256(utf8_text(text).encode("utf-8")).hexdigest()[:20]


def encode_number(value: float | int | None) -> float | int | str | None:
    if value is None or isinstance(value, (bool, int)):
        return value
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def number(value: Any) -> float | None:
    """Read back a number written by `encode_number`."""
    if value is None:
        return None
    if isinstance(value, str):
        return float(value)
    return float(value)


def clean(obj: Any) -> Any:
    """Recursively make `obj` strict-JSON-safe (non-finite floats to strings, tuples to lists, keys to str).

    Concrete type checks come first: a big run calls this on every finding."""
    t = type(obj)
    if t is str:
        return obj if obj.isascii() else utf8_text(obj)  # a lone surrogate from a compiler: U+FFFD
    if t is int or t is bool or obj is None:
        return obj
    if t is float:
        return encode_number(obj)
    if t is dict:
        return {utf8_text(str(k)): clean(v) for k, v in obj.items()}
    if t is list or t is tuple:
        return [clean(v) for v in obj]
    if isinstance(obj, float):
        return encode_number(obj)
    if isinstance(obj, str):
        return utf8_text(str.__str__(obj))  # an enum's value, as json writes it
    if isinstance(obj, Mapping):
        return {utf8_text(str(k)): clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def backend_commit(env: Any) -> str | None:
    """The backend's source commit in a cell's env stamp (the first plugin that names one), or None."""
    sources = env.get("backend_source") if isinstance(env, dict) else None
    for src in (sources or {}).values():
        if isinstance(src, dict) and src.get("commit"):
            return str(src["commit"])
    return None


@dataclass
class Repro:
    path: str  # relative to the cell folder
    verified: bool = False
    command: str | None = None
    note: str | None = None


@dataclass
class Finding:
    kind: str
    stage: str
    message: str
    fingerprint: str
    op: str | None = None
    module: str | None = None
    module_class: str | None = None
    error_type: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    threshold: dict[str, Any] = field(default_factory=dict)
    repro: Repro | None = None
    details: dict[str, Any] = field(default_factory=dict)
    phase: str | None = None  # the workload phase (prefill, decode, batch, long); None: the single forward
    step: int | None = None  # the decode step (1-based) where it applies
    parallel: str | None = None  # the tensor-parallel layout (`tp2`, ci_runner/workloads/parallel.py); None: one rank

    def to_dict(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in _FINDING_FIELDS}  # no deep copy: clean builds new containers
        for name in ("phase", "step", "parallel"):  # the single forward's findings read as before phases existed
            if d[name] is None:
                del d[name]
        if self.repro is not None:
            d["repro"] = {"path": self.repro.path, "verified": self.repro.verified, "command": self.repro.command,
                          "note": self.repro.note}
        return clean(d)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Finding":
        d = dict(data)
        repro = d.pop("repro", None)
        return cls(**d, repro=Repro(**repro) if repro else None)


_FINDING_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Finding))


@dataclass
class ModeResult:
    status: str
    findings: list[Finding] = field(default_factory=list)
    duration_s: float = 0.0
    reason: str | None = None  # why skipped/error, in words
    data: dict[str, Any] = field(default_factory=dict)  # mode-specific tables (per-layer metrics, inventory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "duration_s": round(self.duration_s, 4),
            "reason": self.reason,
            "findings": [f.to_dict() for f in self.findings],
            "data": clean(self.data),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModeResult":
        return cls(
            status=data["status"],
            findings=[Finding.from_dict(f) for f in data.get("findings", [])],
            duration_s=float(data.get("duration_s", 0.0)),
            reason=data.get("reason"),
            data=dict(data.get("data") or {}),
        )


# `CellError.type`s that are no finding, with the exit code of `run`/`cell` when every cell that did not pass
# failed this way (README's table): the model or backend could not be loaded (4), a matrix mistake only the model
# could show, a tensor-parallel layout it cannot take (2)
SETUP_ERRORS = {"model_load": 4, "backend_setup": 4, "layout": 2}


@dataclass
class CellError:
    """What killed a cell: exception, exit code, signal, and the tail of stderr."""

    type: str
    message: str
    exit_code: int | None = None
    signal: str | None = None
    stderr_tail: str = ""
    last_module: str | None = None  # from the crash journal, when a mode keeps one

    @property
    def setup_exit_code(self) -> int | None:
        """The exit code of a cell that never reached its backend (`SETUP_ERRORS`), else None."""
        return SETUP_ERRORS.get(self.type)


@dataclass
class CellResult:
    id: str
    model: str
    backend: str
    status: str
    duration_s: float = 0.0
    env: dict[str, Any] = field(default_factory=dict)
    modes: dict[str, ModeResult] = field(default_factory=dict)
    error: CellError | None = None
    artifacts_dir: str | None = None  # relative to the run folder: cells/<id>
    started_at: str | None = None
    # the key of the cell's resolved configuration (`run/resume.cell_config`: key, parts, timeout); None: not recorded
    config: dict[str, Any] | None = None
    parallel: str | None = None  # the tensor-parallel layout the cell ran under (`tp2`); None: one rank
    notes: list[str] = field(default_factory=list)  # said at the cell's start: limits that cannot fit its timeout

    @property
    def findings(self) -> list[Finding]:
        return [f for m in self.modes.values() for f in m.findings]

    def fold_status(self) -> str:
        """Cell status from its modes: the worst of them; skipped only when all were skipped."""
        if not self.modes:
            return "skipped"
        worst = max(self.modes.values(), key=lambda m: STATUS_SEVERITY.get(m.status, 3))
        return worst.status

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "backend": self.backend,
            "status": self.status,
            "duration_s": round(self.duration_s, 4),
            "started_at": self.started_at,
            "env": clean(self.env),
            "artifacts_dir": self.artifacts_dir,
            "error": clean(asdict(self.error)) if self.error else None,
            "modes": {name: m.to_dict() for name, m in self.modes.items()},
            **({"config": self.config} if self.config else {}),
            **({"parallel": self.parallel} if self.parallel else {}),
            **({"notes": list(self.notes)} if self.notes else {}),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CellResult":
        err = data.get("error")
        return cls(
            id=data["id"],
            model=data["model"],
            backend=data["backend"],
            status=data["status"],
            duration_s=float(data.get("duration_s", 0.0)),
            env=dict(data.get("env") or {}),
            modes={k: ModeResult.from_dict(v) for k, v in (data.get("modes") or {}).items()},
            error=CellError(**err) if err else None,
            artifacts_dir=data.get("artifacts_dir"),
            started_at=data.get("started_at"),
            config=dict(data["config"]) if isinstance(data.get("config"), Mapping) else None,
            parallel=str(data["parallel"]) if data.get("parallel") else None,
            notes=[str(n) for n in data.get("notes") or ()],
        )


@dataclass
class Results:
    """The merged results of a run: `results.json`."""

    cells: list[CellResult] = field(default_factory=list)
    tool_version: str = ""
    generated_at: str | None = None
    ranking: list[dict[str, Any]] = field(default_factory=list)  # failing ops ranked by models blocked
    patterns: list[dict[str, Any]] = field(default_factory=list)  # cross-model layer-class patterns
    root_causes: list[dict[str, Any]] = field(default_factory=list)  # findings grouped by error signature
    zoo: dict[str, Any] | None = None  # the zoo scan (zoo/report.zoo_section), when the run had zoo models

    def cell(self, cell_id: str) -> CellResult | None:
        return next((c for c in self.cells if c.id == cell_id), None)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in CELL_STATUSES}
        for c in self.cells:
            out[c.status] = out.get(c.status, 0) + 1
        out["total"] = len(self.cells)
        out["findings"] = sum(len(c.findings) for c in self.cells)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**self.to_dict_head(), "cells": [c.to_dict() for c in sorted(self.cells, key=lambda c: c.id)]}

    def to_dict_head(self) -> dict[str, Any]:
        """`to_dict` without the cells (`results_chunks` writes them one at a time); the same key order."""
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "tool_version": self.tool_version,
                               "generated_at": self.generated_at, "counts": self.counts()}
        out.update(cells=[], ranking=clean(self.ranking), patterns=clean(self.patterns), root_causes=clean(self.root_causes))
        if self.zoo is not None:
            out["zoo"] = clean(self.zoo)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Results":
        return cls(
            cells=[CellResult.from_dict(c) for c in data.get("cells", [])],
            tool_version=data.get("tool_version", ""),
            generated_at=data.get("generated_at"),
            ranking=list(data.get("ranking") or []),
            patterns=list(data.get("patterns") or []),
            root_causes=list(data.get("root_causes") or []),
            zoo=dict(data["zoo"]) if data.get("zoo") is not None else None,
        )


# --------------------------------------------------------------------------- schema + I/O

def schema_file(name: str) -> dict[str, Any]:
    """A JSON Schema shipped in `ci_runner/schemas/`, as the file holds it."""
    return json.loads((files("ci_runner") / "schemas" / name).read_text(encoding="utf-8"))


def schema(name: str) -> dict[str, Any]:
    """A JSON Schema shipped in `ci_runner/schemas/`, with the mode registry's mode names and finding kinds."""
    return apply_to_schema(schema_file(name))


def _schema_spec(schema_name: str) -> dict[str, Any]:
    if schema_name == "cell.schema.json":  # one file holds the model; a cell is one of its $defs
        full = schema("results.schema.json")
        return {"$defs": full["$defs"], "$ref": "#/$defs/cell"}
    return schema(schema_name)


@lru_cache(maxsize=None)
def _fast_validator(schema_name: str, registry: tuple[tuple[str, ...], tuple[str, ...]]) -> Any:
    """A compiled validator (fastjsonschema: ~50× faster on big results files), one per registry state."""
    return fastjsonschema.compile(_schema_spec(schema_name))


def validate(obj: Any, schema_name: str, *, source: str) -> None:
    """Validate against a shipped schema; raise `InputError` naming the file and JSON path.

    The compiled validator answers first; jsonschema runs only to word the error precisely."""
    try:
        _fast_validator(schema_name, (mode_names(), kind_names()))(obj)
        return
    except fastjsonschema.JsonSchemaException:  # reported below, with jsonschema's wording
        pass
    validator = jsonschema.Draft202012Validator(_schema_spec(schema_name))
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise InputError(
            f"{source}: does not match {schema_name} at {where}: {err.message}",
            hint="regenerate it with this version of deepview-ci, or check that the right file was given",
        )


def read_json(path: str | Path, *, what: str) -> Any:
    """A JSON file others may have written or cut short: any malformed content is one `InputError` (`jsontext`)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{p}: {what} not found", hint="check the path") from None
    except IsADirectoryError:
        raise InputError(f"{p}: is a folder, not a {what}", hint="give the path of the file") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read {what}: {exc.strerror}") from None
    return parse_json(data, source=str(p), what=what)


def load_cell_result(path: str | Path) -> CellResult:
    data = read_json(path, what="cell result")
    validate(data, "cell.schema.json", source=str(path))
    return CellResult.from_dict(data)


def load_results(path: str | Path) -> Results:
    """A results.json, validated. The layout deepview-ci writes (`results_chunks`: one cell per line) is read a line at
    a time (`_load_by_line`), so a run of many cells is never held as text and dict and model at once; any other
    layout, or any fault, is read whole, which also words the error."""
    streamed = _load_by_line(Path(path))
    if streamed is not None:
        return streamed
    data = read_json(path, what="results file")
    if isinstance(data, dict) and data.get("schema_version") not in (None, SCHEMA_VERSION):
        raise InputError(
            f"{path}: results schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}",
            hint="produce it with a matching deepview-ci version",
        )
    validate(data, "results.schema.json", source=str(path))
    return Results.from_dict(data)


_OPENS = re.compile(rb', "(' + "|".join(RESULTS_LISTED).encode() + rb')": \[\n\Z')  # a frame line that opens a list
_CELL_SCHEMA = "cell.schema.json"


def _load_by_line(path: Path) -> Results | None:
    """`path` read in the one-item-per-line layout `results_chunks` writes: the frame lines (the head, each list's
    opening and closing) parsed as one small object, each item line parsed alone, each cell validated and turned into
    a `CellResult` before the next is read. None when the file is not in that layout or anything in it is wrong
    (not JSON, not valid, another schema version): the caller reads it whole, which is also what words the error.
    The items joined back are exactly the file's text, so what this accepts, the whole-file read accepts too."""
    try:
        fh = open(path, "rb")
    except OSError:
        return None
    lists: dict[str, list[Any]] = {}
    cells: list[CellResult] = []
    frame: list[bytes] = []
    with fh:
        key: str | None = None  # the list whose items are being read
        pending: bytes | None = None  # the previous item line (it must end with "," unless the list closes after it)
        for line in fh:
            if key is None or line.startswith(b"]"):
                if key is not None:  # the list closes: its last item has no comma
                    if pending is None or not _take_item(path, key, pending, lists, cells):
                        return None
                    pending = None
                    line = line[1:]  # the frame holds the list closed already
                m = _OPENS.search(line) if line.endswith(b"[\n") else None
                if m is None:
                    frame.append(line)
                    key = None
                    continue
                key = m.group(1).decode()
                if key in lists:
                    return None
                lists[key] = []
                frame.append(line[:-1] + b"]")  # the frame holds the list empty
                continue
            if pending is not None:
                if not pending.endswith(b",\n") or not _take_item(path, key, pending[:-2] + b"\n", lists, cells):
                    return None
            pending = line
        if key is not None or not lists:
            return None
    try:
        data = parse_json(b"".join(frame), source=str(path), what="results file")
    except InputError:
        return None
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        return None
    if any(data.get(k) != [] for k in lists):
        return None  # a key given twice, or the frame is not what it seemed
    data.update({k: v for k, v in lists.items() if k != "cells"})
    try:
        validate(data, "results.schema.json", source=str(path))
    except InputError:
        return None
    results = Results.from_dict(data)
    results.cells = cells
    return results


def _take_item(path: Path, key: str, line: bytes, lists: dict[str, list[Any]], cells: list[CellResult]) -> bool:
    try:
        item = parse_json(line, source=str(path), what="results file")
        if key == "cells":
            validate(item, _CELL_SCHEMA, source=str(path))
            cells.append(CellResult.from_dict(item))
        else:
            lists[key].append(item)
    except InputError:
        return False
    return True


def save_cell_result(cell: CellResult, path: str | Path) -> Path:
    return atomic_write_json(path, cell.to_dict())


def _results_chunks(head: Mapping[str, Any], lists: Iterable[tuple[str, Iterable[Any]]]) -> Iterator[str]:
    """results.json text, piece by piece: the `head` object's keys, then each listed key's items one per line."""
    yield json.dumps(dict(head), ensure_ascii=False, allow_nan=False)[:-1]
    for key, items in lists:
        sep = f', "{key}": [\n'
        for item in items:
            yield sep + json.dumps(item, ensure_ascii=False, allow_nan=False)
            sep = ",\n"
        yield f', "{key}": []' if sep != ",\n" else "\n]"
    yield "}\n"


def dumps_results(data: Mapping[str, Any]) -> str:
    """results.json text: one cell per line, so big runs write fast and diffs stay line-oriented."""
    head = {k: v for k, v in data.items() if k not in RESULTS_LISTED}
    return "".join(_results_chunks(head, ((key, data.get(key) or []) for key in RESULTS_LISTED)))


def results_chunks(results: Results) -> Iterator[str]:
    """`dumps_results(results.to_dict())`, produced one cell at a time: the text of a run of many cells is never
    held whole, nor its dict (each cell's dict is made, written and dropped)."""
    full = results.to_dict_head()
    head = {k: v for k, v in full.items() if k not in RESULTS_LISTED}
    cells = (c.to_dict() for c in sorted(results.cells, key=lambda c: c.id))
    return _results_chunks(head, ((key, cells if key == "cells" else full.get(key) or []) for key in RESULTS_LISTED))


def save_results(results: Results, path: str | Path) -> Path:
    return atomic_write_chunks(path, results_chunks(results))


def iter_findings(results: Results) -> Iterable[tuple[CellResult, str, Finding]]:
    for cell in results.cells:
        for mode_name, mode in cell.modes.items():
            for f in mode.findings:
                yield cell, mode_name, f
