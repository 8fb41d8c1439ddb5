"""Issue 12: how a backend's job is set up (python/container/setup/artifacts), the plan with its fork guard,
`aggregate --plan` (no silent gaps) and `cell --setup-failed`."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from ci_runner import cli
from ci_runner.config import load_matrix_text
from ci_runner.errors import ConfigError, InputError
from ci_runner.matrix import FORK_SKIP_REASON, artifact_name, expand, expand_json
from ci_runner.plan import NO_RESULT, apply_plan, load_plan, parse_chunk_results
from ci_runner.results.model import CellResult, ModeResult, load_cell_result, load_results, save_cell_result
from tests.fixtures.matrices import matrix_text

VENDOR_BACKENDS: list[dict[str, Any]] = [
    {"id": "acme", "compile": "acme_compiler:compile_fn", "runs-on": ["self-hosted", "acme-card"],
     "container": {"image": "ghcr.io/acme/pytorch@sha256:0123", "options": "--device=/dev/acme0 --shm-size=16g",
                   "env": {"ACME_LOG": 1, "FAST": True}},
     "python": "/opt/acme/venv/bin/python", "artifacts": ["acme-compiler-wheel", "acme-runtime"],
     "setup": ["pip install acme-compiler-wheel/*.whl", "acme-smi --check"]},
    {"id": "acme-hosted", "compile": "acme_compiler:compile_fn", "runs-on": "ubuntu-24.04",
     "artifacts": ["acme-compiler-wheel"], "setup": ["pip install acme-compiler-wheel/*.whl"]},
    {"id": "inductor", "compile": "inductor"},
]


def vendor_matrix(n_models: int, *, timeout: float | None = None) -> str:
    return matrix_text(modes=["ops"], timeout=timeout, backends=VENDOR_BACKENDS,
                       models=[{"id": f"m{i:03d}", "factory": f"pkg.models:m{i}"} for i in range(n_models)])


def test_600_cells_with_containers_give_3_chunks_and_one_backend_table() -> None:
    cells = expand(load_matrix_text(vendor_matrix(200)))
    doc = expand_json(cells, max_jobs=1024)
    assert doc["count"] == 600 and doc["chunks"] == 3 and doc["skipped"] == []
    assert [len(m["include"]) for m in doc["matrix"]] == [256, 256, 88]
    entries = [e for m in doc["matrix"] for e in m["include"]]
    assert {e["cell"] for e in entries} == {c.id for c in cells} == {c["cell"] for c in doc["cells"]}
    table = {b["backend"]: b for b in doc["backends"]}
    assert list(table) == ["acme", "acme-hosted", "inductor"]  # each backend once, however many cells use it
    acme = table["acme"]
    assert acme["container"] == {"image": "ghcr.io/acme/pytorch@sha256:0123", "options": "--device=/dev/acme0 --shm-size=16g",
                                 "env": {"ACME_LOG": "1", "FAST": "true"}}
    assert acme["python"] == "/opt/acme/venv/bin/python" and acme["self-hosted"] is True
    setup = [base64.b64decode(line).decode() for line in acme["setup"].split("\n")]
    assert setup == ["pip install acme-compiler-wheel/*.whl", "acme-smi --check"]
    assert acme["artifacts-pattern"] == "{acme-compiler-wheel,acme-runtime}"
    hosted = table["acme-hosted"]
    assert hosted["container"] == "" and hosted["python"] == "" and hosted["self-hosted"] is False
    assert hosted["artifacts-pattern"] == "acme-compiler-wheel"
    plain = table["inductor"]
    assert plain["setup"] == "" and plain["artifacts-pattern"] == ""
    for e in entries:  # a cell entry: its id, artifact name, backend row and time limits, nothing repeated
        assert doc["backends"][e["b"]]["backend"] == e["cell"].split("@")[1]
        assert e["artifact"] == artifact_name(e["cell"])
        assert e["minutes"] == 15 + 2 and e["job-minutes"] == 30 + 17 + 5  # the default timeout, 900 s
    with pytest.raises(ConfigError, match="600 cells, more than the limit of 512"):
        expand_json(cells, max_jobs=512)


def test_time_limits_are_the_cells_timeout_then_setup_and_margin() -> None:
    doc = expand_json(expand(load_matrix_text(vendor_matrix(1, timeout=1801))), max_jobs=10, setup_minutes=45, margin_minutes=3)
    [entry, *_] = doc["matrix"][0]["include"]
    assert entry["minutes"] == 31 + 2  # the cell's own 1801 s, rounded up, + 2: its own timeout fires first
    assert entry["job-minutes"] == 45 + 33 + 3


def test_fork_pull_request_plans_self_hosted_cells_as_skipped() -> None:
    cells = expand(load_matrix_text(vendor_matrix(2)))
    doc = expand_json(cells, max_jobs=1024, fork_pr=True)
    ran = {e["cell"] for m in doc["matrix"] for e in m["include"]}
    assert [b["backend"] for b in doc["backends"]] == ["acme-hosted", "inductor"]  # no row for a backend that never runs
    assert ran == {"m000@acme-hosted", "m000@inductor", "m001@acme-hosted", "m001@inductor"}  # hosted unaffected
    assert [(s["cell"], s["reason"]) for s in doc["skipped"]] == [("m000@acme", FORK_SKIP_REASON), ("m001@acme", FORK_SKIP_REASON)]
    assert "fork" in FORK_SKIP_REASON and "allow-fork-self-hosted" in FORK_SKIP_REASON
    everything_skipped = expand_json([c for c in cells if c.backend.id == "acme"], max_jobs=1024, fork_pr=True)
    assert everything_skipped["count"] == 0 and everything_skipped["chunks"] == 0  # no chunk job starts


@pytest.mark.parametrize("labels, self_hosted", [
    ("ubuntu-latest", False), ("[ubuntu-24.04]", False), ("macos-14", False), ("windows-2022", False),
    ("[self-hosted, acme-card]", True), ("acme-card", True), ("[ubuntu-latest, gpu]", True),
    ("ubuntu-24.04-arm", False), ("macos-15-xlarge", False), ("windows-11-arm", False),
    # labels a vendor may give its own machines: only the exact names GitHub hosts count as GitHub-hosted
    ("ubuntu-gpu", True), ("ubuntu-latest-acme", True), ("macos-m2-lab", True), ("windows-acme", True),
])
def test_self_hosted_means_any_label_that_is_not_a_github_hosted_image(labels: str, self_hosted: bool) -> None:
    m = load_matrix_text(f"version: 1\nmodels: [{{id: a, config: llama}}]\nbackends: [{{id: b, runs-on: {labels}}}]\n")
    assert m.backends[0].self_hosted is self_hosted


@pytest.mark.parametrize("backend, message", [
    ("{id: b, container: {image: x}}", "needs `python`"),
    ("{id: b, python: p, container: {options: --x}}", "'image' is a required property"),
    ("{id: b, artifacts: ['a/b']}", "artifacts"),
    ("{id: b, setup: pip install x}", "setup"),
    ("{id: b, pyhton: python3}", "did you mean 'python'"),
])
def test_bad_job_setup_keys_are_one_clear_config_error(backend: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_matrix_text(f"version: 1\nmodels: [{{id: a, config: llama}}]\nbackends: [{backend}]\n", path="m.yaml")
    assert str(info.value).startswith("m.yaml:")


def test_container_as_a_bare_image_name_and_specs_survive_the_child_process_round_trip() -> None:
    from ci_runner.config import BackendSpec, spec_from_json, spec_to_json

    m = load_matrix_text("version: 1\nmodels: [{id: a, config: llama}]\nbackends: [{id: b, container: 'img:1', python: python3}]\n")
    b = m.backends[0]
    assert dict(b.container or {}) == {"image": "img:1", "options": "", "env": {}}
    back = spec_from_json(BackendSpec, json.loads(json.dumps(spec_to_json(b))))
    assert back.python == "python3" and back.container["image"] == "img:1" and back.setup == ()


# --------------------------------------------------------------------------- no silent gaps


def _cell(cid: str, status: str = "pass") -> CellResult:
    model, backend = cid.split("@")
    return CellResult(id=cid, model=model, backend=backend, status=status, modes={"ops": ModeResult(status=status)})


def _plan_and_results(tmp_path: Path) -> tuple[Path, Path]:
    text = ("version: 1\ndefaults: {modes: [ops]}\nmodels: [{id: a, config: llama}, {id: b, config: llama}]\n"
            "backends: [{id: x, compile: inductor}, {id: y, compile: inductor}]\n")
    (tmp_path / "m.yaml").write_text(text)
    plan = tmp_path / "plan.json"
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--out", str(plan), "--skip", "b@y"]) == 0
    run = tmp_path / "artifacts"
    for cid in ("a@x", "a@y"):  # b@x was planned but its job died before uploading anything
        save_cell_result(_cell(cid), run / f"deepview-cell-{cid}" / "cells" / cid / "result.json")
    return plan, run


def test_a_planned_cell_without_a_result_is_an_error_and_a_regression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan, run = _plan_and_results(tmp_path)
    baseline = tmp_path / "base"
    base_results = tmp_path / "base-results"
    for cid in ("a@x", "a@y", "b@x", "b@y"):  # in the baseline every cell passed, b@y included
        save_cell_result(_cell(cid), base_results / "cells" / cid / "result.json")
    assert cli.main(["aggregate", str(base_results), "--out", str(baseline)]) == 0
    assert cli.main(["baseline", "update", str(baseline / "results.json"), "--out", str(tmp_path / "baseline.json")]) == 0

    report = tmp_path / "report"
    assert cli.main(["aggregate", str(run), "--out", str(report), "--plan", str(plan),
                     "--chunk-results", "0=failure"]) == 0
    results = load_results(report / "results.json")
    by_id = {c.id: c for c in results.cells}
    assert set(by_id) == {"a@x", "a@y", "b@x"}  # b@y was not planned (deselected): not invented
    gap = by_id["b@x"]
    assert gap.status == "error" and gap.error is not None
    assert gap.error.message == NO_RESULT + " (the cell jobs of chunk 0 concluded: failure)"
    assert gap.modes["ops"].status == "error"
    assert "b@x" in (report / "summary.md").read_text()

    capsys.readouterr()
    code = cli.main(["diff", str(report / "results.json"), "--baseline", str(tmp_path / "baseline.json"),
                     "--fail-on", "regression", "--out", str(tmp_path / "diff")])
    assert code == 1
    diff = json.loads((tmp_path / "diff" / "diff.json").read_text())
    cats = {(e["category"], e["cell"]) for e in diff["entries"]}
    assert ("regressed", "b@x") in cats and ("missing_cell", "b@y") in cats


def test_without_the_plan_an_empty_artifact_folder_still_passes_so_the_workflow_must_pass_it(tmp_path: Path) -> None:
    """The failure mode of the issue, kept visible: only the plan turns a dead job into a cell."""
    plan, _ = _plan_and_results(tmp_path)
    empty = tmp_path / "nothing-downloaded"
    assert cli.main(["aggregate", str(empty), "--out", str(tmp_path / "r"), "--plan", str(plan)]) == 0
    cells = load_results(tmp_path / "r" / "results.json").cells
    assert [(c.id, c.status) for c in cells] == [("a@x", "error"), ("a@y", "error"), ("b@x", "error")]
    assert cli.main(["aggregate", str(empty), "--out", str(tmp_path / "r2")]) == 3  # no plan: the folder must exist


def test_fork_skipped_cells_come_back_as_skipped_with_the_reason(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(vendor_matrix(1))
    plan = tmp_path / "plan.json"
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--out", str(plan), "--fork-pr"]) == 0
    cells = apply_plan([_cell("m000@inductor")], load_plan(plan))
    by_id = {c.id: c for c in cells}
    assert by_id["m000@acme"].status == "skipped" and by_id["m000@acme"].modes["ops"].reason == FORK_SKIP_REASON
    assert by_id["m000@acme-hosted"].status == "error"  # planned to run, no result
    assert by_id["m000@inductor"].status == "pass"


def test_bad_plan_and_chunk_results_are_input_errors(tmp_path: Path) -> None:
    bad = tmp_path / "plan.json"
    bad.write_text('{"count": 1}')
    with pytest.raises(InputError, match="not a plan written by this version of `deepview-ci expand`"):
        load_plan(bad)
    with pytest.raises(InputError, match="CHUNK=RESULT"):
        parse_chunk_results("0=success,x")
    assert parse_chunk_results("0=success,1=,2=cancelled") == {0: "success", 2: "cancelled"}
    assert parse_chunk_results("*=failure") == {-1: "failure"}  # the chunks as one matrix job: one result for all


def test_a_failed_setup_is_an_error_cell_naming_the_command_and_its_output(tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(vendor_matrix(1))
    setup = tmp_path / ".deepview-setup"
    setup.mkdir()
    (setup / "command.txt").write_text("pip install acme-compiler-wheel/*.whl\n")
    (setup / "output.log").write_text("noise\n" * 2000 + "ERROR: acme_compiler-1.4-py3-none-any.whl is not a valid wheel filename.\n")
    (setup / "exit-code").write_text("1\n")
    code = cli.main(["cell", "m000@acme", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "out"),
                     "--setup-failed", str(setup)])
    assert code == 1
    r = load_cell_result(tmp_path / "out" / "cells" / "m000@acme" / "result.json")
    assert r.status == "error" and r.error is not None and r.error.type == "setup_failed" and r.error.exit_code == 1
    assert r.error.message.startswith("setup failed: `pip install acme-compiler-wheel/*.whl` exited with 1")
    assert r.error.stderr_tail.endswith("is not a valid wheel filename.\n") and len(r.error.stderr_tail) <= 4000
    assert r.modes["ops"].status == "error"
    assert cli.main(["cell", "m000@acme", "--matrix", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "out"),
                     "--setup-failed", str(tmp_path / "nope")]) == 3
