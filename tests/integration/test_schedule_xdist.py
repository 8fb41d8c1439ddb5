"""pytest-xdist's `--dist loadfile` really starts files in the order `heaviest_first` gives (a real pytest run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.subprocess

_CONFTEST = """
from tests.fixtures.schedule import heaviest_first

def pytest_collection_modifyitems(config, items):
    items[:] = heaviest_first(items, {"test_c.py": 50.0, "test_b.py": 10.0})
"""


def _started_files(tmp_path: Path, *extra: str) -> list[str]:
    """The files of a 3-file suite in the order one xdist worker ran them."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")  # its own rootdir: not this repo's addopts
    (tmp_path / "conftest.py").write_text(_CONFTEST, encoding="utf-8")
    for name, count in (("test_a.py", 3), ("test_b.py", 1), ("test_c.py", 2)):
        (tmp_path / name).write_text("".join(f"def test_{i}():\n    pass\n\n" for i in range(count)), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}  # xdist alone: seconds less
    argv = [sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-n", "1", "--dist", "loadfile", "-v",
            "-p", "no:cacheprovider", *extra]
    proc = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = re.findall(r"PASSED (test_\w+\.py)::", proc.stdout)
    assert len(ran) == 6, proc.stdout
    return list(dict.fromkeys(ran))


def test_loadfile_follows_the_collection_order_without_its_own_reordering(tmp_path: Path) -> None:
    assert _started_files(tmp_path, "--no-loadscope-reorder") == ["test_c.py", "test_b.py", "test_a.py"]


def test_xdist_default_reorders_by_test_count(tmp_path: Path) -> None:
    """Why pyproject turns it off: by default the file with the most tests starts first, whatever the hook did."""
    assert _started_files(tmp_path) == ["test_a.py", "test_c.py", "test_b.py"]
