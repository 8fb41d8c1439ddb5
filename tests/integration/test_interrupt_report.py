"""Ctrl-C during `deepview-ci run`: exit 130, and the report of the cells that finished is written."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fixtures.paths import ROOT
from tests.fixtures.procs import sigint_default

MODELS = '''\
import time


def broken(seed):
    raise RuntimeError("no weights")


def hangs(seed):
    time.sleep(3600)
'''


@pytest.mark.subprocess
def test_ctrl_c_writes_the_report_of_the_finished_cells(tmp_path: Path) -> None:
    (tmp_path / "two_models.py").write_text(MODELS, encoding="utf-8")
    matrix = tmp_path / "m.yaml"
    matrix.write_text("version: 1\ndefaults: {modes: [ops]}\n"
                      "models: [{id: a, factory: 'two_models:broken'}, {id: z, factory: 'two_models:hangs'}]\n"
                      "backends: [{id: b, compile: aot_eager}]\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.Popen([sys.executable, "-m", "ci_runner", "run", str(matrix), "--out", "out", "--jobs", "1"],
                            cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    assert proc.stderr is not None
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stderr:  # the first cell finished, the second runs (hangs)
        lines.append(line)
        if "z@b: running" in line or time.monotonic() > deadline:
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[1]
    err = "".join(lines) + rest
    assert proc.returncode == 130, err
    assert "interrupted; the report of the 1 finished cell(s) of 2: out/report/summary.md" in err, err
    results = json.loads((tmp_path / "out" / "report" / "results.json").read_text())
    assert [c["id"] for c in results["cells"]] == ["a@b"]
    assert (tmp_path / "out" / "report" / "summary.md").is_file()
