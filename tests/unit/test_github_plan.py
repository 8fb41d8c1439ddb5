"""Issue 19: the plan within GitHub's output limit, the newest attempt per cell after a re-run, and what a cell's
job leaves behind when it writes no result (a setup record, a journal)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ci_runner import cli
from ci_runner.matrix import artifact_name
from ci_runner.plan import OUTPUT_LIMIT_UNITS, collect_attempts, utf16_units
from ci_runner.results.model import CellResult, ModeResult, load_results, save_cell_result
from tests.fixtures.matrices import matrix_text

HEAVY_BACKEND: dict[str, Any] = {  # a vendor's backend as it is really written: runner labels, container, setup
    "compile": "acme_compiler:compile_fn",
    "container": {"image": "ghcr.io/acme/pytorch@sha256:4f1c6a0b9e8d7c6b5a4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c8b7a6f5e4d3c2b",
                  "options": "--device=/dev/acme0 --shm-size=16g --ulimit memlock=-1 --cap-add SYS_PTRACE",
                  "env": {"ACME_VISIBLE_DEVICES": "0", "ACME_LOG_LEVEL": "warning", "HF_HUB_OFFLINE": "1"}},
    "python": "/opt/acme/venv/bin/python",
    "artifacts": ["acme-compiler-wheel", "acme-runtime-libs"],
    "setup": ["pip install --no-deps acme-compiler-wheel/*.whl acme-runtime-libs/*.whl",
              'python -c "import acme_compiler; print(acme_compiler.__version__)"',
              "acme-smi --check --device 0 --expect-firmware 4.2"],
}


def heavy_matrix(n_models: int, n_backends: int = 4, *, model_id: str = "vendor-model-{i:04d}",
                 backend_id: str = "acme-npu-{j}") -> str:
    ids = [backend_id.format(j=j) for j in range(n_backends)]
    return matrix_text(modes=["ops", "layers", "numerics"],
                       models=[{"id": model_id.format(i=i), "factory": f"pkg.models:m{i}"} for i in range(n_models)],
                       backends=[{"id": b, **HEAVY_BACKEND, "runs-on": ["self-hosted", "acme-card", b]} for b in ids])


def test_1024_heavy_cells_write_at_most_450000_characters_to_github_output(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m.yaml").write_text(heavy_matrix(256))
    out = tmp_path / "github_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--max-jobs", "1024", "--out", str(tmp_path / "plan.json")]) == 0
    text = out.read_text(encoding="utf-8")
    assert len(text) <= 450_000 and utf16_units(text) <= OUTPUT_LIMIT_UNITS
    names = [line.split("<<")[0].split("=")[0] for line in text.splitlines() if line and not line.startswith(("{", "["))]
    assert "matrix" not in names  # no second copy of chunk 0
    assert {"count", "chunks", "chunk-ids", "backends", "matrix-0", "matrix-3", "skipped-cells"} <= set(names)
    print(f"1024 cells, 4 heavy backends: {len(text):,} characters in GITHUB_OUTPUT")


def test_a_plan_past_the_limit_fails_with_exit_2_saying_how_many_cells_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # ids at the schema's 80-character limit, and 128 heavy backends: the one way past 900 kB within 1024 cells
    ids = {"model_id": "m" * 75 + "-{i:03d}", "backend_id": "acme-npu-" + "b" * 66 + "-{j:03d}"}
    (tmp_path / "m.yaml").write_text(heavy_matrix(8, 128, **ids))
    out = tmp_path / "github_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    capsys.readouterr()
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--max-jobs", "1024", "--out", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "450,000" in err and "1 MB" in err and "of these 1024 cells fit" in err and "select" in err
    fit = int(err.split("about ")[1].split(" of these")[0])
    assert 500 < fit < 1024
    assert not out.exists() and not (tmp_path / "plan.json").exists()  # nothing half-written
    (tmp_path / "m.yaml").write_text(heavy_matrix(8, fit // 8, **ids))  # the count it names does fit
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--max-jobs", "1024"]) == 0


# --------------------------------------------------------------------------- re-runs: the newest attempt per cell


def _cell(cid: str, status: str, note: str = "") -> CellResult:
    model, backend = cid.split("@")
    return CellResult(id=cid, model=model, backend=backend, status=status,
                      modes={"ops": ModeResult(status=status, reason=note)})


def test_collect_keeps_each_cells_newest_attempt(tmp_path: Path) -> None:
    art = tmp_path / "artifacts"
    for cid, attempt, status in (("a@x", 1, "error"), ("a@x", 2, "pass"), ("a@x", 10, "fail"), ("b@x", 1, "pass")):
        save_cell_result(_cell(cid, status, f"attempt {attempt}"),
                         art / f"{artifact_name(cid)}-attempt-{attempt}" / "cells" / cid / "result.json")
    (art / f"{artifact_name('a@x')}-attempt-1" / "cells" / "a@x" / "stale.txt").write_text("from attempt 1")
    (art / "deepview-plan").mkdir()  # not a cell artifact: ignored
    run = tmp_path / "run"
    assert collect_attempts(art, run) == {"a@x": 10, "b@x": 1}
    assert json.loads((run / "cells" / "a@x" / "result.json").read_text())["modes"]["ops"]["reason"] == "attempt 10"
    assert not (run / "cells" / "a@x" / "stale.txt").exists()  # the cell's folder is the newest attempt's, whole
    assert collect_attempts(tmp_path / "nothing-downloaded", run) == {}
    assert cli.main(["collect", str(art), "--out", str(tmp_path / "run2")]) == 0
    assert (tmp_path / "run2" / "cells" / "b@x" / "result.json").exists()


def test_collect_passes_over_an_unreadable_newest_attempt_and_says_so(tmp_path: Path) -> None:
    art = tmp_path / "artifacts"
    save_cell_result(_cell("a@x", "fail", "attempt 1"), art / f"{artifact_name('a@x')}-attempt-1" / "cells" / "a@x" / "result.json")
    newest = art / f"{artifact_name('a@x')}-attempt-2" / "cells" / "a@x" / "result.json"
    newest.parent.mkdir(parents=True)
    newest.write_text('{"id": "a@x", "model": "a", "backend"')  # cut short by a failed upload
    said: list[str] = []
    assert collect_attempts(art, tmp_path / "run", warn=said.append) == {"a@x": 1}
    assert json.loads((tmp_path / "run" / "cells" / "a@x" / "result.json").read_text())["modes"]["ops"]["reason"] == "attempt 1"
    assert len(said) == 1 and "a@x: took" in said[0] and "attempt-2" in said[0] and "not valid JSON" in said[0], said


@pytest.mark.parametrize("damage", ["truncated", "no-cell-folder", "another-cell"])
def test_collect_makes_a_cell_no_attempt_can_read_an_error_cell_never_a_gap(damage: str, tmp_path: Path,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    art = tmp_path / "artifacts"
    save_cell_result(_cell("b@x", "pass"), art / f"{artifact_name('b@x')}-attempt-1" / "cells" / "b@x" / "result.json")
    folder = art / f"{artifact_name('a@x')}-attempt-1"
    if damage == "truncated":
        (folder / "cells" / "a@x").mkdir(parents=True)
        (folder / "cells" / "a@x" / "result.json").write_bytes(b"\x00\x01 not json")
    elif damage == "no-cell-folder":
        (folder / "cells" / "other").mkdir(parents=True)
    else:
        save_cell_result(_cell("b@x", "pass"), folder / "cells" / "a@x" / "result.json")
    (art / "deepview-cell-%%bad-attempt-1").mkdir()  # named like a cell artifact, but not one we make
    run = tmp_path / "run"
    assert cli.main(["collect", str(art), "--out", str(run)]) == 0  # the report job goes on
    err = capsys.readouterr().err
    assert "a@x: collect: no attempt of this cell can be read" in err and "Traceback" not in err, err
    assert "deepview-cell-%%bad-attempt-1: not collected" in err, err
    assert cli.main(["aggregate", str(run), "--out", str(run / "report")]) == 0
    cells = {c.id: c for c in load_results(run / "report" / "results.json").cells}
    assert sorted(cells) == ["a@x", "b@x"]
    assert cells["a@x"].status == "error" and cells["a@x"].error is not None
    assert cells["a@x"].error.type == "unreadable_artifact" and "attempt-1" in cells["a@x"].error.message
    if damage == "truncated":  # the unreadable file is kept, out of aggregate's way
        assert (run / "cells" / "a@x" / "result.json.unreadable").read_bytes() == b"\x00\x01 not json"


# --------------------------------------------------------------------------- what a job left behind


def _plan(tmp_path: Path) -> Path:
    (tmp_path / "m.yaml").write_text(matrix_text(modes=["ops", "layers"], models=[{"id": "a", "config": "llama"}],
                                                 backends=[{"id": b, "compile": "inductor"} for b in "xyz"]))
    plan = tmp_path / "plan.json"
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--out", str(plan)]) == 0
    return plan


def test_a_cell_killed_while_its_journal_shows_it_running_is_timeout_not_no_result(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    run = tmp_path / "run"
    cdir = run / "cells" / "a@x"  # killed by the job's time limit during layers, after ops had finished
    cdir.mkdir(parents=True)
    (cdir / "journal.log").write_text("enter-mode\tops\nleave-mode\tops\nenter-mode\tlayers\nenter-module\tmodel.layers.1\n")
    partial = _cell("a@x", "pass")
    (cdir / "result.partial.json").write_text(json.dumps(partial.to_dict()))
    (cdir / "stderr.log").write_text("compiling model.layers.1 …\n")
    ydir = run / "cells" / "a@y"  # finished every mode it entered, then the job died: no evidence it was running
    ydir.mkdir(parents=True)
    (ydir / "journal.log").write_text("enter-mode\tops\nleave-mode\tops\n")
    report = tmp_path / "report"
    assert cli.main(["aggregate", str(run), "--out", str(report), "--plan", str(plan), "--chunk-results", "*=failure"]) == 0
    by_id = {c.id: c for c in load_results(report / "results.json").cells}
    x = by_id["a@x"]
    assert x.status == "timeout" and x.error is not None and x.error.type == "timeout"
    assert "during mode 'layers' while running module 'model.layers.1'" in x.error.message and "journal" in x.error.message
    assert x.modes["ops"].status == "pass" and x.modes["layers"].status == "timeout"  # what finished is kept
    assert x.error.stderr_tail.startswith("compiling model.layers.1")
    for cid in ("a@y", "a@z"):
        assert by_id[cid].status == "error" and by_id[cid].error is not None
        assert by_id[cid].error.message.endswith("(the cell jobs of chunk 0 concluded: failure)")


def test_a_setup_record_written_by_the_shell_is_an_error_cell_with_command_exit_code_and_output(tmp_path: Path) -> None:
    plan = _plan(tmp_path)
    rec = tmp_path / "run" / "cells" / "a@z" / "setup-failed"
    rec.mkdir(parents=True)
    (rec / "command.txt").write_text("pip install acme-compiler-wheel/*.whl\n")
    (rec / "exit-code").write_text("1\n")
    (rec / "output.log").write_text("x\n" * 5000 + "ERROR: No matching distribution found for acme-runtime==4.2\n")
    report = tmp_path / "report"
    assert cli.main(["aggregate", str(tmp_path / "run"), "--out", str(report), "--plan", str(plan)]) == 0
    z = {c.id: c for c in load_results(report / "results.json").cells}["a@z"]
    assert z.status == "error" and z.error is not None and z.error.type == "setup_failed" and z.error.exit_code == 1
    assert z.error.message.startswith("setup failed: `pip install acme-compiler-wheel/*.whl` exited with 1")
    assert z.error.stderr_tail.endswith("No matching distribution found for acme-runtime==4.2\n")
    assert {m.status for m in z.modes.values()} == {"error"}
