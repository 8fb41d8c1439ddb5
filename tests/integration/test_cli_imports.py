"""What the `deepview-ci run` parent imports (a fresh interpreter: `sys.modules` of the test process says nothing)."""

from __future__ import annotations


def test_the_run_parent_does_not_import_torch() -> None:
    """`deepview-ci run` only starts workers and aggregates: parsing, loading the matrix, clearing the probe stores of
    a `--force` run (`modes/ops/storepath.py`) import no torch (seconds of CPU that competed with the first cells)."""
    import subprocess
    import sys

    code = ("import sys, tempfile; from pathlib import Path\n"
            "from ci_runner.cli import build_parser\n"
            "from ci_runner.config import load_matrix\n"
            "from ci_runner.matrix import expand\n"
            "from ci_runner.modes.ops.storepath import clear_stores, store_root\n"
            "cells = expand(load_matrix(None))\n"
            "out = Path(tempfile.mkdtemp())\n"
            "store_root(out, 'sim-subset').mkdir(parents=True)\n"
            "clear_stores(out, {c.backend.id for c in cells})\n"
            "assert not (out / 'probes' / 'sim-subset').exists()\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
