"""One run's record set: what the history keeps of a `Results`, as one immutable file.

A record file (``runs/<date>_<run-id>.json.gz``, gzip with no timestamp, so equal runs give equal bytes)::

    {"kind": "deepview-ci-history-run", "schema_version": 1,
     "run": {"run_id", "date", "trigger", "commit", "tool_version", "generated_at"},
     "envs": [<env stamp>, …],                                   # distinct stamps, no host names or reruns
     "cells": [[id, model, backend, status, duration_s, env_index, {mode: status}], …],
     "findings": [[cell_index, fingerprint, kind, mode, op, module, signature], …],
     "layers": [[cell_index, [name, …], [[rel, 1-cos, mad] threshold, …], [[rel, 1-cos, mad] worst, …]], …],
     "figures": [[cell_index, {"<mode>.<name>": number, …}], …]}   # optional: older records have none

A layer's figures are the worst of its cumulative and isolated views; its thresholds are the cumulative
view's. Findings carry their root-cause signature (`results.rootcause.signature`).
"""

from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import json
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..errors import InputError, NewerFileError, UsageError
from ..jsontext import parse_json
from ..fsutil import atomic_write_bytes
from ..registry import layer_table_modes
from ..results.model import CellResult, Results, clean, encode_number
from ..backends.vendor import boilerplate_lines
from ..results.rootcause import signature

RECORD_KIND = "deepview-ci-history-run"
RECORD_VERSION = 1
VOLATILE_ENV = frozenset({"hostname", "host", "attempts", "pid", "started_at", "executable"})
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
FIGURES = ("rel", "cos", "mad")  # stored as rel, 1 - cos, mad


@dataclass(frozen=True, kw_only=True)
class RunMeta:
    run_id: str
    date: str  # YYYY-MM-DD
    trigger: str = "local"
    commit: str = ""
    tool_version: str = ""
    generated_at: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "date": self.date, "trigger": self.trigger, "commit": self.commit,
                "tool_version": self.tool_version, "generated_at": self.generated_at}


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.fullmatch(run_id):
        raise UsageError(f"--run-id {run_id!r}: use letters, digits, '.', '_' or '-' (at most 100)",
                         hint="e.g. the workflow's run id and attempt: 123456789-1")
    return run_id


def check_date(date: str) -> str:
    try:
        if _DATE.fullmatch(date):
            _dt.date.fromisoformat(date)
            return date
    except ValueError:
        pass
    raise UsageError(f"--date {date!r} is not a date YYYY-MM-DD", hint="e.g. --date 2031-03-04")


def run_meta(results: Results, *, run_id: str | None, date: str | None, env: Mapping[str, str]) -> RunMeta:
    """This run's identity: CLI values first, then the Actions environment, then the results' own time."""
    when = date or (results.generated_at or "")[:10] or _dt.datetime.now(_dt.timezone.utc).date().isoformat()
    if not run_id:
        gh = env.get("GITHUB_RUN_ID")
        ident = "\x1f".join([results.generated_at or "", results.tool_version, *sorted(c.id for c in results.cells)])
        run_id = f"{gh}-{env.get('GITHUB_RUN_ATTEMPT', '1')}" if gh else "local-" + hashlib.sha256(ident.encode()).hexdigest()[:12]
    return RunMeta(run_id=check_run_id(run_id), date=check_date(when), trigger=env.get("GITHUB_EVENT_NAME", "local"),
                   commit=env.get("GITHUB_SHA", ""), tool_version=results.tool_version,
                   generated_at=results.generated_at or "")


def env_stamp(cell: CellResult) -> dict[str, Any]:
    """The cell's environment stamp without what changes between two machines of one setup."""
    return {k: v for k, v in sorted(clean(cell.env).items()) if k not in VOLATILE_ENV}


def _fig(v: Any, flip: bool) -> float | str | None:
    """A figure as strict JSON: a finite float, "nan"/"inf" (the result model's spelling), or None."""
    if v is None:
        return None
    if type(v) is str:
        return v if v in ("nan", "inf", "-inf") else None
    v = 1.0 - float(v) if flip else float(v)
    return v if math.isfinite(v) else encode_number(v)


def _worst(layer: Mapping[str, Any]) -> list[float | str | None]:
    """Per figure, the worst of the two views; NaN (a broken layer) beats any number."""
    cum, iso = layer.get("cumulative") or {}, layer.get("isolated") or {}
    out: list[float | str | None] = []
    for name in FIGURES:
        a, b = _fig(cum.get(name), name == "cos"), _fig(iso.get(name), name == "cos")
        if a is None or b is None:
            out.append(b if a is None else a)
        elif type(a) is str or type(b) is str:
            out.append("nan" if "nan" in (a, b) else "inf")
        else:
            out.append(a if a >= b else b)
    return out


def _thresholds(layer: Mapping[str, Any]) -> list[float | str | None]:
    thr = layer.get("threshold") or {}
    return [_fig(thr.get(name), name == "cos") for name in FIGURES]


def _figures(data: Mapping[str, Any]) -> list[tuple[str, float]]:
    """A mode's `data.figures` (name → number: what its trends chart), finite numbers only."""
    figs = data.get("figures")
    if not isinstance(figs, Mapping):
        return []
    return [(str(k), float(v)) for k, v in sorted(figs.items())
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))]


def record_of(results: Results, meta: RunMeta) -> dict[str, Any]:
    """The record set of one run (see the module docstring)."""
    envs: dict[str, int] = {}
    env_list: list[dict[str, Any]] = []
    cells: list[list[Any]] = []
    findings: list[list[Any]] = []
    layers: list[list[Any]] = []
    figures: list[list[Any]] = []
    for i, c in enumerate(sorted(results.cells, key=lambda c: c.id)):
        stamp = env_stamp(c)
        key = json.dumps(stamp, sort_keys=True)
        if key not in envs:
            envs[key] = len(env_list)
            env_list.append(stamp)
        cells.append([c.id, c.model, c.backend, c.status, round(c.duration_s, 3), envs[key],
                      {m: r.status for m, r in sorted(c.modes.items())}])
        seen: set[str] = set()
        for mode_name, mode in c.modes.items():
            for f in mode.findings:
                if f.fingerprint in seen:
                    continue
                seen.add(f.fingerprint)
                sig = f.details.get("signature") if isinstance(f.details.get("signature"), str) else signature(f, boilerplate=boilerplate_lines()).id
                findings.append([i, f.fingerprint, f.kind, mode_name, f.op or "", f.module or "", sig])
        named = {f"{m}.{k}": v for m, r in sorted(c.modes.items()) for k, v in _figures(r.data)}
        if named:
            figures.append([i, named])
        table = next((c.modes[m].data.get("layers") for m in layer_table_modes() if m in c.modes), None) or []
        rows = [r for r in table if isinstance(r, Mapping) and r.get("name")]
        if rows:
            layers.append([i, [str(r["name"]) for r in rows], [_thresholds(r) for r in rows], [_worst(r) for r in rows]])
    return {"kind": RECORD_KIND, "schema_version": RECORD_VERSION, "run": meta.to_dict(), "envs": env_list,
            "cells": cells, "findings": findings, "layers": layers, "figures": figures}


def record_name(meta: Mapping[str, Any]) -> str:
    return f"{meta['date']}_{meta['run_id']}.json.gz"


def dump_record(record: Mapping[str, Any]) -> bytes:
    raw = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
    return gzip.compress(raw, compresslevel=6, mtime=0)


def write_record(record: Mapping[str, Any], runs_dir: Path) -> Path:
    """Write the record file atomically; an existing file of the same run is left as it is (immutable)."""
    path = Path(runs_dir) / record_name(record["run"])
    if path.exists():
        return path
    return atomic_write_bytes(path, dump_record(record))


def read_record(path: Path) -> dict[str, Any]:
    """Read and check one record file: `InputError` (exit 3) when corrupt, foreign or from a newer version."""
    try:
        raw = gzip.decompress(Path(path).read_bytes())
    except FileNotFoundError:
        raise InputError(f"{path}: history record not found") from None
    except (OSError, EOFError, ValueError, zlib.error) as exc:
        raise InputError(f"{path}: not a readable history record ({type(exc).__name__}: {exc})",
                         hint="remove the file from the history's runs/ folder, or restore it from the branch") from None
    data = parse_json(raw, source=str(path), what="history record")
    if not isinstance(data, dict) or data.get("kind") != RECORD_KIND:
        raise InputError(f"{path}: not a deepview-ci history record (no \"kind\": \"{RECORD_KIND}\")",
                         hint="only `deepview-ci history add` writes into the history's runs/ folder")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise InputError(f"{path}: history record has a bad schema_version {version!r}", hint="the file is damaged; remove it")
    if version > RECORD_VERSION:
        raise NewerFileError(f"{path}: history record schema_version {version!r} is newer than this deepview-ci reads "
                             f"({RECORD_VERSION})", hint="upgrade deepview-ci; the file is left as it is")
    for key in ("run", "envs", "cells", "findings", "layers"):
        if key not in data:
            raise InputError(f"{path}: history record has no {key!r}", hint="the file is damaged; remove it")
    return data
