"""What a rerun into the same `--out` may reuse, and one run at a time per `--out`.

A cell's result records the key of its resolved configuration (`cell_config`): a sha256 of the sorted JSON of each
part that decides what the cell computes (the model spec, the backend spec, each input field, `parallel`, the
modes it runs, each of those modes' options, the references, deepview-ci's version), and of all of them together.
A rerun reuses a finished cell only when its key is the same; otherwise it reruns it and says which parts changed
(`rerun_reason`). A part is hashed from plain JSON (sorted keys, no addresses, no timestamps): the same matrix gives
the same key in any process on any machine. The cell's `timeout` is kept beside the key, not in it: a cell that
finished is not rerun for a new timeout, but a cell that timed out is, when its timeout changed.

`run_lock` holds an exclusive `flock` on `OUT/.deepview-ci.lock` for the whole run: a second run into the same
folder refuses at once (`OutBusyError`, exit 7); the kernel drops the lock of a killed run, so a stale file never
blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from .. import __version__
from ..config import Cell, plain_json, spec_to_json
from ..errors import RunBusyError
from ..fsutil import try_lock
from ..results.model import CellResult

PART_CHARS = 16  # of each part's sha256 kept in the result (the key itself is the whole sha256 of all of them)
LOCK_NAME = ".deepview-ci.lock"  # in the run folder: held by the run writing it (`run_lock`)
# the backend's GitHub-job settings that a cell's own computation never reads (`config.BackendSpec`)
_JOB_ONLY = ("runs_on", "source")


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def config_parts(cell: Cell, modes: Sequence[str] | None = None, *, base: Path | None = None) -> dict[str, Any]:
    """The parts of the cell's resolved configuration, by name (`model`, `backend`, `inputs.<field>`, `parallel`,
    `modes`, `options.<mode>` for each mode it runs, `references`, `version`), as plain JSON. A `path:` model inside
    `base` (the matrix file's folder) is keyed by its path relative to it: the same checkout elsewhere, same key."""
    run_modes = list(modes or cell.modes)
    backend = {k: v for k, v in spec_to_json(cell.backend).items() if k not in _JOB_ONLY}
    model = spec_to_json(cell.model)
    if model.get("path") and base is not None and Path(model["path"]).is_relative_to(base.resolve()):
        model["path"] = Path(model["path"]).relative_to(base.resolve()).as_posix()
    parts: dict[str, Any] = {"model": model, "backend": backend}
    parts.update({f"inputs.{k}": v for k, v in spec_to_json(cell.inputs).items()})
    parts["parallel"] = cell.parallel.key() if cell.parallel is not None else None
    parts["modes"] = run_modes
    for mode in run_modes:
        parts[f"options.{mode}"] = cell.options.get(mode, {})
    parts["references"] = [spec_to_json(r) for r in cell.references]
    parts["version"] = __version__
    return plain_json(parts)


def cell_config(cell: Cell, modes: Sequence[str] | None = None, *, base: Path | None = None) -> dict[str, Any]:
    """What a cell's result records of its configuration: `key` (sha256 of every part's sha256), `parts` (each part's
    sha256, its first `PART_CHARS` hex digits: to say what changed), `timeout`."""
    whole = {name: _digest(value) for name, value in config_parts(cell, modes, base=base).items()}
    parts = {name: digest[:PART_CHARS] for name, digest in whole.items()}  # enough to say which part changed
    return {"key": _digest(whole), "parts": parts, "timeout": cell.timeout}


def rerun_reason(prior: CellResult, config: Mapping[str, Any]) -> str | None:
    """Why a finished cell must run again under `config` (`cell_config`), or None when its result is reusable."""
    recorded = prior.config or {}
    if not recorded.get("key"):
        return "its result records no configuration key (written by an earlier deepview-ci)"
    if recorded["key"] != config["key"]:
        old, new = dict(recorded.get("parts") or {}), dict(config["parts"])
        if old.get("version") != new.get("version"):
            return f"deepview-ci's version changed ({__version__} now)"
        changed = sorted({k for k in old.keys() | new.keys() if old.get(k) != new.get(k)})
        return f"matrix changed: {', '.join(changed) or 'its configuration'}"
    if prior.status == "timeout" and recorded.get("timeout") != config.get("timeout"):
        return f"it timed out, and its timeout changed ({recorded.get('timeout')} s → {config.get('timeout')} s)"
    return None


@contextlib.contextmanager
def run_lock(out_dir: Path) -> Iterator[None]:
    """Hold `OUT/.deepview-ci.lock` for the block; another live run holding it: `RunBusyError` at once. The file
    says who holds it (pid), for the message; a killed holder's lock is released by the kernel."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_NAME
    fh = try_lock(path)
    if fh is None:
        holder = _holder(path)
        raise RunBusyError(f"{out_dir} is in use by another run{holder}: one run at a time per --out",
                           hint="wait for it to finish, or give this run another --out")
    try:
        fh.truncate(0)
        fh.write(f"{os.getpid()}\n".encode())
        fh.flush()
        yield
    finally:
        fh.close()


def _holder(path: Path) -> str:
    try:
        pid = path.read_text(encoding="utf-8").split()[0]
    except (OSError, IndexError):
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""
