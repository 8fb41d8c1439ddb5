"""A rerun into the same `--out` reruns exactly the cells whose configuration changed, and says why; one run at a
time per `--out` (the key's parts and the lock alone: `tests/unit/test_resume.py`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from ci_runner.errors import EXIT_BUSY
from ci_runner.results.model import load_cell_result
from ci_runner.run.resume import LOCK_NAME
from tests.fixtures.cli import run_cli as cli
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT
from tests.fixtures.procs import TAG_VAR, new_tag, wait_until_gone

SMALL = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 64}
FAULTS = {"compile": "tests.fixtures.faults:backend", "import": ["tests.fixtures.faults"]}


def _two_models(b_inputs: dict | None = None) -> str:
    """Two tiny Llamas on aot_eager, the ops mode only, probing the matmuls only (what resumes is the cell, not what
    it probed; the probe store makes the second cell cheap)."""
    b = {"id": "b", "config": "llama", "overrides": SMALL, **({"inputs": b_inputs} if b_inputs else {})}
    return matrix_text(modes=["ops"], timeout=300, inputs={"seq_len": 8, "samples": 1},
                       options={"ops": {"only_ops": ["aten.mm*"]}},
                       models=[{"id": "a", "config": "llama", "overrides": SMALL}, b],
                       backends=[{"id": "ae", "compile": "aot_eager"}])


@pytest.mark.slow
def test_editing_one_model_reruns_exactly_its_cells(tmp_path: Path, write_matrix: Callable[..., Path]) -> None:
    out = tmp_path / "out"
    matrix = write_matrix(_two_models())
    proc = cli("run", str(matrix), "--out", str(out), "--jobs", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {c: out / "cells" / c / "result.json" for c in ("a@ae", "b@ae")}
    before = {c: p.stat().st_mtime_ns for c, p in results.items()}
    assert all(load_cell_result(p).config for p in results.values())

    write_matrix(_two_models(b_inputs={"seed": 1}))  # one model's entry edited
    proc = cli("run", str(matrix), "--out", str(out), "--jobs", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a@ae: ok (finished earlier" in proc.stderr, proc.stderr
    assert "b@ae: rerun (matrix changed: inputs.seed)" in proc.stderr.splitlines(), proc.stderr
    assert results["a@ae"].stat().st_mtime_ns == before["a@ae"]
    assert results["b@ae"].stat().st_mtime_ns != before["b@ae"]

    proc = cli("run", str(matrix), "--out", str(out), "--jobs", "1")  # nothing changed: nothing reruns
    assert ": rerun (" not in proc.stderr and proc.stderr.count("finished earlier") == 2, proc.stderr


@pytest.mark.slow
def test_a_second_run_into_a_busy_out_refuses_and_a_killed_runs_lock_never_blocks(
        tmp_path: Path, write_matrix: Callable[..., Path]) -> None:
    """Run 1 hangs in its cell's worker; run 2 into the same folder refuses at once (exit 7, one line, nothing
    written), and so does `cell`; run 1 is SIGKILLed; run 3 goes ahead: the kernel dropped the lock. Runs 2 select
    a stock compiler's cell (checked at load without a child: the refusal is all they do)."""
    hang = {"id": "hang", **FAULTS, "env": {"DEEPVIEW_TEST_FAULT": "hang"}}
    raises = {"id": "raises", **FAULTS, "env": {"DEEPVIEW_TEST_FAULT": "raise"}}
    matrix = write_matrix(matrix_text(modes=["ops"], timeout=300, models=[{"id": "tiny", "config": "llama",
                                                                          "overrides": SMALL}],
                                      backends=[hang, raises, {"id": "ae", "compile": "aot_eager"}]))
    out = tmp_path / "out"
    tag = new_tag()
    env = {**os.environ, "PYTHONPATH": str(ROOT), TAG_VAR: tag}
    first = subprocess.Popen([sys.executable, "-m", "ci_runner", "run", str(matrix), "--out", str(out), "--select",
                              "tiny@hang"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "cells" / "tiny@hang" / "stderr.log").exists():
            assert first.poll() is None, first.stderr.read() if first.stderr else ""
            time.sleep(0.2)
        assert (out / LOCK_NAME).read_text().split()[0] == str(first.pid)
        for args in (("run", str(matrix)), ("cell", "tiny@ae", "--matrix", str(matrix))):
            proc = cli(*args, "--out", str(out), "--select", "tiny@ae") if args[0] == "run" else \
                cli(*args, "--out", str(out))
            assert proc.returncode == EXIT_BUSY, proc.stderr
            error = [ln for ln in proc.stderr.splitlines() if ln.startswith("deepview-ci: error:")]
            assert len(error) == 1 and f"in use by another run (pid {first.pid})" in error[0], proc.stderr
            assert "Traceback" not in proc.stderr
        assert not (out / "cells" / "tiny@ae").exists()  # refused before touching anything
        assert first.poll() is None  # and run 1 goes on, its cell not marked by anyone
        assert not (out / "cells" / "tiny@hang" / "result.json").exists()
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
    assert wait_until_gone(out, tag) == []
    proc = cli("run", str(matrix), "--out", str(out), "--select", "tiny@raises")
    assert proc.returncode == 4, proc.stderr  # the cell's own error (its plugin): the stale lock file did not block
    assert load_cell_result(out / "cells" / "tiny@raises" / "result.json").status == "error"
