"""Where a cell's numerics thresholds live, and the one key they are stored and cached under.

Thresholds are derived once per model and reused by every backend and every later run: the file is
`<thresholds_dir>/<model-id>-<key-hash>.json`, and the key (`thresholds.threshold_key`) holds everything the
reference-vs-reference statistics depend on: the model's fingerprint (source, config overrides, weights' content
or hub commit, transformers version), the input spec, the references, the number of samples, the method version
and the torch version. `thresholds_dir` defaults to `<run>/thresholds` (the `--out` folder), so the cells of one
run share it, and a later run with the same `--out` reuses it.

A CI cache (the reusable workflow's `actions/cache` step) is keyed by `cache_key` of the same key hashes, computed
by `deepview-ci thresholds-key` in the cell's own Python (the torch version is the cell's): a changed model, input
spec, reference list, torch or method gives another cache key, and a stale file is never restored under a new one.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ...options import NumericsOptions
from ...registry import parse_options
from .thresholds import key_hash, threshold_key, threshold_path

CACHE_PREFIX = "deepview-thresholds"


def numerics_options(cell: Any) -> NumericsOptions:
    """The cell's numerics options (matrix defaults, model and backend merged)."""
    return parse_options("numerics", cell.options.get("numerics", {}))


def thresholds_folder(opts: NumericsOptions, run_dir: Path) -> Path:
    """`thresholds_dir` when the matrix sets it (`~` expanded, relative to the working directory), else
    `<run_dir>/thresholds`."""
    if opts.thresholds.thresholds_dir:
        return Path(os.path.expanduser(opts.thresholds.thresholds_dir))
    return Path(run_dir) / "thresholds"


def cell_key(cell: Any, opts: NumericsOptions, precision: Any = None) -> dict[str, Any]:
    """The thresholds key of a cell (see the module docstring). `precision` is the cell's resolved policy
    (`workloads/precision.py`; default: the backend's declared one, `auto` counting as float32 until measured)."""
    from ...models.load import model_fingerprint  # deferred: it imports torch

    samples = opts.thresholds.samples or max(2, cell.inputs.samples)
    refs = [{"id": r.id, "device": r.device, "dtype": r.dtype} for r in cell.references]
    policy = precision if precision is not None else cell.backend.precision
    return threshold_key(model_fingerprint=model_fingerprint(cell.model), inputs=cell.inputs.key(), references=refs,
                         samples=samples, precision=policy.key())


@dataclass(frozen=True, kw_only=True)
class CellThresholds:
    """A cell's thresholds file and its key."""

    path: Path
    key: dict[str, Any]

    @property
    def key_hash(self) -> str:
        return key_hash(self.key)


def cell_thresholds(cell: Any, run_dir: Path, opts: NumericsOptions | None = None,
                    precision: Any = None) -> CellThresholds:
    """Where the cell's thresholds file is (derived or reused there) and its key."""
    opts = opts or numerics_options(cell)
    key = cell_key(cell, opts, precision)
    return CellThresholds(path=threshold_path(thresholds_folder(opts, run_dir), cell.model.id, key), key=key)


@dataclass(frozen=True, kw_only=True)
class ThresholdsCache:
    """What a CI cache of the thresholds holds: the folders and the cache key (empty: no cell runs numerics)."""

    key: str
    folders: tuple[Path, ...]
    files: tuple[Path, ...]

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "dirs": [str(f) for f in self.folders], "files": [str(f) for f in self.files]}


def cache_for(cells: Iterable[Any], run_dir: Path) -> ThresholdsCache:
    """The thresholds cache of the cells that run the numerics mode: one key over their files' names (each name
    holds its model id and key hash), so the cache hits exactly when every file it should hold is the same."""
    files = sorted({cell_thresholds(c, run_dir).path for c in cells if "numerics" in c.modes})
    if not files:
        return ThresholdsCache(key="", folders=(), files=())
    folders = tuple(sorted({f.parent for f in files}))
    if len(files) == 1:
        key = f"{CACHE_PREFIX}-{files[0].stem}"
    else:
        digest = hashlib.sha256("\n".join(f.name for f in files).encode("utf-8")).hexdigest()[:16]
        key = f"{CACHE_PREFIX}-{len(files)}-models-{digest}"
    return ThresholdsCache(key=key, folders=folders, files=tuple(files))


__all__ = ["CACHE_PREFIX", "CellThresholds", "ThresholdsCache", "cache_for", "cell_key", "cell_thresholds",
           "numerics_options", "thresholds_folder"]
