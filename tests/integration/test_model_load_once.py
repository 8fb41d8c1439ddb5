"""A cell whose model does not load: the model is tried once per cell (not once per mode), and the console names
the reason and the fix on one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fixtures.cli import run_cli

FACTORY = '''\
import os


def build(seed):
    with open(os.environ["LOAD_LOG"], "a") as fh:
        fh.write("load\\n")
    raise RuntimeError("weights.bin is missing")
'''


@pytest.mark.subprocess
def test_a_failed_model_load_is_tried_once_and_printed_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "flaky_models.py").write_text(FACTORY, encoding="utf-8")
    matrix = tmp_path / "m.yaml"
    matrix.write_text("version: 1\ndefaults: {modes: [ops, layers, numerics]}\n"
                      "models: [{id: broken, factory: 'flaky_models:build'}]\n"
                      "backends: [{id: b, compile: aot_eager}]\n", encoding="utf-8")
    log = tmp_path / "loads.log"
    proc = run_cli("run", str(matrix), "--out", str(tmp_path / "out"),
                   env={"LOAD_LOG": str(log), "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""),
                                                                             str(tmp_path)])}, timeout=300)
    assert proc.returncode == 4, proc.stderr  # README: a model that could not be loaded is an environment error
    assert log.read_text().count("load") == 1, "each mode loaded the model again"
    lines = proc.stderr.splitlines()
    [i] = [i for i, ln in enumerate(lines) if "broken@b: ERROR in" in ln]
    assert lines[i + 1].strip() == ("the model did not load: model 'broken' (factory:flaky_models:build): factory "
                                    "raised RuntimeError: weights.bin is missing (fix: fix the factory, or call it "
                                    "by hand to debug)"), lines[i + 1]
    result = json.loads((tmp_path / "out" / "cells" / "broken@b" / "result.json").read_text())
    assert result["error"]["type"] == "model_load"
    assert result["modes"]["layers"]["reason"].startswith("not run: the model did not load: ")
    assert result["modes"]["numerics"]["status"] == "error"
