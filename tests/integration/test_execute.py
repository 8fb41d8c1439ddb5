"""The executor: each cell in its own process; SIGKILL/SIGABRT/SIGSEGV/hang give the right status,
the other cells complete, and the run folder resumes cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from ci_runner.results.model import load_cell_result, load_results
from tests.fixtures.cli import run_cli as cli
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT
from tests.fixtures.procs import TAG_VAR, new_tag, sigint_default, wait_until_gone


FAULTS = {"compile": "tests.fixtures.faults:backend", "import": ["tests.fixtures.faults"]}


TINY = {"id": "tiny", "config": "llama",  # the tiny Llama every matrix of this file runs
        "overrides": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "num_key_value_heads": 1, "vocab_size": 64}}


def faults_matrix(timeout: float) -> str:
    """A tiny Llama on the fault-injecting backend: ok, and one backend per way a cell can die. The ops mode probes
    the matmuls only: the faults strike at the plugin's import, and the `ok` cell needs only to run."""
    faults = [{"id": f, **FAULTS, "env": {"DEEPVIEW_TEST_FAULT": e}} for f, e in
              (("abort", "abort"), ("segv", "segv"), ("kill", "kill"), ("raises", "raise"), ("hang", "hang"))]
    faults[-1]["timeout"] = 6
    return matrix_text(
        modes=["ops"], timeout=timeout, options={"ops": {"only_ops": ["aten.mm*"]}},
        models=[TINY],
        backends=[{"id": "ok", **FAULTS}, *faults],
    )


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faults") / "matrix.yaml"
    path.write_text(faults_matrix(120), encoding="utf-8")
    return path


@dataclass(frozen=True)
class Run:
    """One `deepview-ci run` that several tests assert on: its out folder, its process, and what it left running."""

    out: Path
    proc: subprocess.CompletedProcess[str]
    left: list[str]


@pytest.fixture(scope="module")
def faults_run(matrix: Path) -> Run:
    """The faults matrix run once, every cell (`--jobs 2`): the statuses, the resume and the corrupt-result tests
    each go on from its folder."""
    out = matrix.parent / "out"
    tag = new_tag()
    proc = cli("run", str(matrix), "--out", str(out), "--jobs", "2", env={TAG_VAR: tag})
    return Run(out, proc, wait_until_gone(out, tag))


@pytest.mark.slow
def test_faults_get_statuses_others_complete_and_the_run_resumes(matrix: Path, faults_run: Run) -> None:
    out, proc = faults_run.out, faults_run.proc
    assert faults_run.left == []  # the timed-out and crashed cells left no process behind
    assert proc.returncode == 1, proc.stderr  # findings: some cells did not pass
    assert "Traceback" not in proc.stderr
    cells = {p.parent.name: load_cell_result(p) for p in (out / "cells").glob("*/result.json")}
    assert set(cells) == {f"tiny@{b}" for b in ("ok", "abort", "segv", "kill", "hang", "raises")}
    assert cells["tiny@abort"].status == "crashed" and cells["tiny@abort"].error.signal == "SIGABRT"
    assert cells["tiny@segv"].status == "crashed" and cells["tiny@segv"].error.signal == "SIGSEGV"
    assert cells["tiny@kill"].status == "crashed" and cells["tiny@kill"].error.signal == "SIGKILL"
    assert cells["tiny@hang"].status == "timeout" and "timed out" in cells["tiny@hang"].error.message
    raises = cells["tiny@raises"]
    assert raises.status == "error" and "no device found" in raises.error.message
    assert cells["tiny@ok"].status in ("pass", "fail", "skipped")  # what the ops mode found; never a crash
    assert cells["tiny@ok"].error is None
    for c in cells.values():
        assert set(c.modes) == {"ops"}
        assert c.env.get("torch")
    results = load_results(out / "report" / "results.json")  # validates against the shipped schema
    assert results.counts()["total"] == 6

    # resume: nothing reruns (fast), unless --force
    before = {k: (out / "cells" / k / "result.json").stat().st_mtime_ns for k in cells}
    t0 = time.monotonic()
    proc = cli("run", str(matrix), "--out", str(out))
    assert time.monotonic() - t0 < 60
    assert "finished earlier" in proc.stderr
    after = {k: (out / "cells" / k / "result.json").stat().st_mtime_ns for k in cells}
    assert before == after
    proc = cli("run", str(matrix), "--out", str(out), "--select", "tiny@abort", "--force")
    assert (out / "cells" / "tiny@abort" / "result.json").stat().st_mtime_ns != before["tiny@abort"]


@pytest.mark.slow
def test_a_corrupt_cell_result_is_rerun_not_fatal(matrix: Path, faults_run: Run) -> None:
    """A cell whose result.json is cut short reruns (in the faults run's folder: its `raises` cell finished)."""
    out = faults_run.out
    result = out / "cells" / "tiny@raises" / "result.json"
    assert load_cell_result(result).status == "error"
    result.write_text('{"id": "tiny@raises", "trunc', encoding="utf-8")
    proc = cli("run", str(matrix), "--out", str(out), "--select", "tiny@raises")
    assert proc.returncode == 4, proc.stderr  # its plugin does not import: an environment error (README)
    assert "Traceback" not in proc.stderr
    assert load_cell_result(result).status == "error"


def test_ctrl_c_leaves_a_consistent_folder(tmp_path: Path, matrix: Path) -> None:
    out = tmp_path / "out"
    tag = new_tag()
    env = {**os.environ, "PYTHONPATH": str(ROOT), TAG_VAR: tag}
    proc = subprocess.Popen([sys.executable, "-m", "ci_runner", "run", str(matrix), "--out", str(out),
                             "--select", "tiny@hang", "--select", "tiny@raises"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    deadline = time.monotonic() + 120  # the backends' check at load gives the hanging plugin's import 20 s
    while time.monotonic() < deadline and not (out / "cells" / "tiny@raises" / "result.json").exists():
        time.sleep(0.2)
    time.sleep(1.0)  # the hanging cell is running now
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert load_cell_result(out / "cells" / "tiny@raises" / "result.json").status == "error"
    assert not (out / "cells" / "tiny@hang" / "result.json").exists()
    leftovers = [p for p in out.rglob("*.tmp")]
    assert leftovers == []
    assert wait_until_gone(out, tag) == []  # the hanging cell's worker stopped with the run


def test_a_worker_ends_itself_past_its_budget(tmp_path: Path, matrix: Path) -> None:
    """Without its parent run to kill it, a hanging worker still stops: its own deadline (budget + grace)."""
    out = tmp_path / "out"
    tag = new_tag()
    env = {**os.environ, "PYTHONPATH": str(ROOT), TAG_VAR: tag}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ci_runner", "_worker", "--matrix", str(matrix), "--cell", "tiny@hang",
                           "--out", str(out), "--modes", "ops", "--budget", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert time.monotonic() - t0 < 60
    assert proc.returncode != 0 and "past its budget" in proc.stderr
    assert wait_until_gone(out, tag) == []


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("version: 1\nmodels: [{id: a, config: llama}]\nbackends: [{id: b, compile: inductor, devcie: cpu}]\n", "did you mean 'device'"),
        ("version: 1\nmodels: [{id: a, config: llama}\nbackends: []\n", "invalid YAML"),
    ],
)
def test_bad_matrix_exits_2_with_one_message(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text, encoding="utf-8")
    proc = cli("run", str(p), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert needle in proc.stderr and str(p) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("error:") == 1


def test_unknown_cell_id_exits_2(tmp_path: Path, matrix: Path) -> None:
    proc = cli("cell", "tiny@nope", "--matrix", str(matrix), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "no cell 'tiny@nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_aggregate_rejects_a_corrupt_results_file_with_exit_3(tmp_path: Path) -> None:
    cdir = tmp_path / "run" / "cells" / "a@b"
    cdir.mkdir(parents=True)
    (cdir / "result.json").write_text("{not json", encoding="utf-8")
    proc = cli("aggregate", str(tmp_path / "run"), "--out", str(tmp_path / "rep"))
    assert proc.returncode == 3
    assert "result.json:1:2" in proc.stderr and "not valid JSON" in proc.stderr
    assert "Traceback" not in proc.stderr


def _phase_matrix(folder: Path) -> Path:
    """Two cells that stop in the first decode step (of the layers mode's phases): `dies` (layers only) has its
    worker aborted there, `dh` (ops then layers, 120 s) hangs there until its cell's timeout."""
    path = folder / "matrix.yaml"
    path.write_text(matrix_text(
        inputs={"seq_len": 8, "samples": 1, "phases": ["prefill", "decode"]},
        models=[TINY],
        backends=[{"id": "dies", "compile": "tests.fixtures.plugin_decode_abort:backend", "modes": ["layers"],
                   "timeout": 600, "options": {"layers": {"culprit": False}}},
                  {"id": "dh", "compile": "tests.fixtures.plugin_decode_hang:backend", "modes": ["ops", "layers"],
                   "timeout": 120,
                   "options": {"ops": {"probe_timeout": 5, "verify": False, "only_ops": ["aten._scaled_dot_product*"]},
                               "layers": {"verify": False, "culprit": False}}}]), encoding="utf-8")
    return path


@pytest.fixture(scope="module", autouse=True)
def _phase_run_started(request: pytest.FixtureRequest,
                       tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, subprocess.Popen[str]] | None]:
    """The phase matrix's run (`--jobs 2`), started in the background as this file starts when a selected test
    reads it: the `dh` cell mostly waits out its hang, so the file's other tests run meanwhile (the two tests that
    read it come last)."""
    if not any(item.module is request.module and "phase_run" in item.fixturenames for item in request.session.items):
        yield None
        return
    path = _phase_matrix(tmp_path_factory.mktemp("phases"))
    out = path.parent / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with open(path.parent / "stdout.txt", "w") as stdout, open(path.parent / "stderr.txt", "w") as stderr:
        # files, not pipes: nobody reads the run's output until it ends
        proc = subprocess.Popen([sys.executable, "-m", "ci_runner", "run", str(path), "--out", str(out), "--jobs",
                                 "2"], cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True,
                                start_new_session=True, preexec_fn=sigint_default)
    yield out, proc
    if proc.poll() is None:  # the file stopped before its tests read the run: stopped as Ctrl-C stops it
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def phase_run(_phase_run_started: tuple[Path, subprocess.Popen[str]] | None) -> Run:
    """The phase matrix's run, ended: the `dies` cell ended while `dh` still worked or waited out its hang."""
    assert _phase_run_started is not None
    out, proc = _phase_run_started
    proc.wait(timeout=600)
    stdout, stderr = ((out.parent / name).read_text(encoding="utf-8") for name in ("stdout.txt", "stderr.txt"))
    return Run(out, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), [])


@pytest.mark.slow
def test_a_phase_that_kills_the_worker_keeps_the_modes_forward_result(phase_run: Run) -> None:
    """The forward and the prefill compile; the first decode step aborts the cell's worker. The layers mode keeps
    what its single forward found (its search, from the checkpoint before its phases), is `crashed`, and names the
    phase."""
    proc = phase_run.proc
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr[-2000:]
    cell = load_cell_result(phase_run.out / "cells" / "tiny@dies" / "result.json")
    layers = cell.modes["layers"]
    assert set(cell.modes) == {"layers"}
    assert cell.status == "crashed" and layers.status == "crashed", (cell.status, layers)
    assert "in phase 'decode'" in layers.reason and "SIGABRT" in layers.reason, layers.reason
    assert layers.data["whole_model"]["status"] == "pass", layers.data  # the forward's search, kept
    assert layers.data["phases"]["decode"]["status"] == "crashed" and "checkpoint" not in layers.data


@pytest.mark.slow
def test_a_cell_timeout_keeps_every_finished_mode_and_phase_and_names_where_it_stopped(phase_run: Run) -> None:
    """The compiler hangs on the first decode step's graph (in the cell's own worker: the layers mode's phase run).
    The ops mode finished before (its one finding: the decode attention's probe, a hang within its 5 s), the layers
    mode's forward and its prefill phase too: all kept; the cell is `timeout`, naming the mode and the phase; the
    heartbeat and the console said where the cell was."""
    proc = phase_run.proc
    assert "Traceback" not in proc.stderr and proc.returncode == 1, proc.stderr[-2000:]
    cdir = phase_run.out / "cells" / "tiny@dh"
    cell = load_cell_result(cdir / "result.json")
    assert cell.status == "timeout", cell.status
    assert cell.error is not None and "during mode 'layers' in phase 'decode'" in cell.error.message, cell.error
    ops, layers = cell.modes["ops"], cell.modes["layers"]
    assert ops.status == "fail" and [f.error_type for f in ops.findings] == ["Timeout"], (ops.status, ops.findings)
    assert set(ops.data["phases"]) == {"prefill", "decode"} and "checkpoint" not in ops.data
    assert layers.status == "timeout" and "checkpoint" not in layers.data, layers
    assert layers.data["stopped"] == {"mode": "layers", "phase": "decode", "module": None}
    assert layers.data["whole_model"]["status"] == "pass"  # the forward's search, checkpointed before the phases
    assert layers.data["phases"]["prefill"]["status"] == "pass"  # the finished phase, checkpointed after it
    assert layers.data["phases"]["decode"]["status"] == "timeout"
    assert 0 < layers.duration_s < 120
    beat = json.loads((cdir / "heartbeat.json").read_text(encoding="utf-8"))
    assert (beat["mode"], beat["phase"]) == ("layers", "decode")
    assert [d["mode"] for d in beat["modes_done"]] == ["ops"] and beat["modes_done"][0]["status"] == "fail"
    lines = proc.stderr.splitlines()
    for line in ("tiny@dh: ops started", "tiny@dh: layers started"):
        assert line in lines, proc.stderr
    assert any(ln.startswith("tiny@dh: ops fail in ") for ln in lines), proc.stderr
    assert any(ln.startswith("tiny@dh: layers: phase decode started (") for ln in lines), proc.stderr
