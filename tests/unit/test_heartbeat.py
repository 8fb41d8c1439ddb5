"""Progress inside a cell: the worker's heartbeat file, the run's lines read from it, and the per-phase checkpoints
a killed worker's cell keeps (the whole path, with a real timeout: tests/integration/test_execute.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ci_runner.config import load_matrix_text
from ci_runner.matrix import expand
from ci_runner.modes import ModeContext
from ci_runner.results.model import CHECKPOINT_KEY, HEARTBEAT_NAME, JOURNAL_NAME, Finding, ModeResult
from ci_runner.run.cellrun import fit_notes
from ci_runner.run.heartbeat import Heartbeat, Watch, mode_seconds, read_heartbeat
from tests.fixtures.matrices import matrix_text


def test_the_heartbeat_follows_modes_and_phases(tmp_path: Path) -> None:
    beat = Heartbeat(tmp_path, "m@b")
    beat.event("enter-mode", "ops")
    assert read_heartbeat(tmp_path)["mode"] == "ops" and read_heartbeat(tmp_path)["phase"] is None
    beat.event("enter-workload", "ops.decode")
    beat.event("enter-probe", "x")  # not a boundary: ignored, nothing written
    hb = read_heartbeat(tmp_path)
    assert (hb["mode"], hb["phase"], hb["cell"]) == ("ops", "decode", "m@b") and hb["updated_at"]
    assert hb["cell_elapsed_s"] >= hb["mode_elapsed_s"] >= hb["phase_elapsed_s"] >= 0
    assert mode_seconds(tmp_path, "ops") is not None and mode_seconds(tmp_path, "layers") is None
    beat.event("leave-workload", "ops.decode")
    beat.event("leave-mode", "ops")
    beat.mode_done("ops", "pass", 1.23)
    assert read_heartbeat(tmp_path)["modes_done"] == [{"mode": "ops", "status": "pass", "seconds": 1.2}]
    again = Heartbeat(tmp_path, "m@b")  # a worker restarted after a crash continues the list
    again.mode_done("layers", "crashed", 2.0)
    assert [d["mode"] for d in read_heartbeat(tmp_path)["modes_done"]] == ["ops", "layers"]
    assert list(tmp_path.glob("*.tmp")) == [] and list(tmp_path.glob(".*.tmp")) == []


def test_the_watch_says_each_start_and_end_once(tmp_path: Path) -> None:
    said: list[str] = []
    watch = Watch(tmp_path, "m@b", said.append)
    beat = Heartbeat(tmp_path, "m@b")
    watch.poll()  # no heartbeat yet: nothing
    beat.event("enter-mode", "ops")
    watch.poll()
    watch.poll()
    beat.event("enter-workload", "ops.prefill")
    watch.poll()
    beat.event("leave-workload", "ops.prefill")
    beat.event("leave-mode", "ops")
    beat.mode_done("ops", "fail", 3.0)
    beat.event("enter-mode", "layers")
    watch.poll()
    assert said[0] == "m@b: ops started" and said[1].startswith("m@b: ops: phase prefill started (")
    assert said[2:] == ["m@b: ops fail in 3.0s", "m@b: layers started"]
    (tmp_path / HEARTBEAT_NAME).write_text("{torn", encoding="utf-8")
    watch.poll()  # an unreadable file says nothing and raises nothing
    assert len(said) == 4


def test_each_finished_phase_is_checkpointed_onto_the_forwards(tmp_path: Path) -> None:
    saved: dict[str, ModeResult] = {}
    ctx = ModeContext(cell=None, cell_dir=tmp_path, backend=None, deadline=0.0,  # type: ignore[arg-type]
                      on_checkpoint=lambda mode, r: saved.__setitem__(mode, json.loads(json.dumps(r.to_dict()))))
    forward = Finding(kind="layer_failure", stage="run", message="forward", fingerprint="f1")
    data: dict[str, Any] = {"whole_model": {"status": "fail"}}
    ctx.checkpoint_phase("layers", "prefill", [], {"status": "pass"})  # no checkpoint yet: nothing to add to
    assert saved == {}
    ctx.checkpoint("layers", [forward], data)
    decode = Finding(kind="layer_failure", stage="run", message="decode", fingerprint="f2", phase="prefill")
    ctx.checkpoint_phase("layers", "prefill", [decode], {"status": "fail"})
    got = saved["layers"]
    assert [f["message"] for f in got["findings"]] == ["forward", "decode"]
    assert got["data"]["phases"] == {"prefill": {"status": "fail"}} and got["data"][CHECKPOINT_KEY] == "phases"
    assert got["data"]["whole_model"] == {"status": "fail"} and "phases" not in data  # the mode's own data untouched
    assert "(prefill)" in got["reason"]
    ctx.journal("enter-mode", "layers")  # the journal feeds `on_event` (the heartbeat) as well
    assert (tmp_path / JOURNAL_NAME).read_text().strip() == "enter-mode\tlayers"


def test_a_mode_whose_limits_cannot_fit_the_cell_says_so_at_its_start(tmp_path: Path) -> None:
    """Issue 44: the layers mode's first probe needs startup_timeout + probe_timeout; a shorter cell timeout is said
    once on the console (through the heartbeat) and kept in the cell's notes; a cell that fits says nothing."""
    def cell(timeout: int, probe: int) -> Any:
        text = matrix_text(models=[{"id": "m", "config": "llama"}], backends=[{"id": "b", "compile": "aot_eager"}],
                           modes=["ops", "layers"], timeout=timeout, options={"layers": {"probe_timeout": probe}})
        return next(iter(expand(load_matrix_text(text))))

    assert fit_notes(cell(900, 120), ("ops", "layers")) == []
    notes = fit_notes(cell(200, 120), ("ops", "layers"))
    assert len(notes) == 1 and notes[0].startswith("layers: the cell's timeout (200 s) is shorter than the first "
                                                   "probe may need (startup_timeout 180 s + probe_timeout 120 s)")
    assert fit_notes(cell(200, 120), ("ops",)) == []  # only the modes the cell runs
    said: list[str] = []
    watch = Watch(tmp_path, "m@b", said.append)
    Heartbeat(tmp_path, "m@b").note(notes[0])
    watch.poll()
    watch.poll()
    assert said == [f"m@b: note: {notes[0]}"]
