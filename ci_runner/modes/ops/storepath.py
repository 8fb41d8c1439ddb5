"""Where a run keeps each backend's probe store, without the probing engine (no torch): `deepview-ci run --force`
clears the stores before any cell starts, in the parent process, which never imports torch."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable

from ...engine.repro import safe_filename


def store_root(out_dir: Path, backend_id: str) -> Path:
    """The probe store of one backend in a run's output folder: `<out>/probes/<backend-id>`."""
    return Path(out_dir) / "probes" / safe_filename(backend_id)


def clear_stores(out_dir: Path, backend_ids: Iterable[str]) -> None:
    """Forget the stored outcomes of these backends (a `--force` run probes again)."""
    for bid in backend_ids:
        shutil.rmtree(store_root(out_dir, bid), ignore_errors=True)
