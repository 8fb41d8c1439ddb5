"""Issue 19: the workflow's own step scripts, executed with bash as the runner would run them.

- a failing `setup` is recorded by plain shell, with nothing but a bare interpreter (no deepview-ci, no pip) on
  PATH, and the report reads that cell as `error` with the command, its exit code and the tail of its output;
- the report job's policy step keeps exit codes apart: only a diff that ran (exit 0, or 1 for a policy failure)
  from a whole run lets issues be filed; a diff that exits 3 (corrupt results) fails the job as an input error.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ci_runner import cli
from ci_runner.results.model import load_results
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT

WORKFLOW = ROOT / ".github" / "workflows" / "deepview.yml"
CELLS = ROOT / ".github" / "workflows" / "deepview-cells.yml"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not available")


def load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    data["on"] = data.pop(True, data.get("on"))
    return data


def step(path: Path, job: str, step_id: str) -> dict:
    return next(s for s in load(path)["jobs"][job]["steps"] if s.get("id") == step_id)


def read_output(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with nothing installed, not even pip: the broken environment a vendor's setup can leave."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    probe = subprocess.run([str(python), "-c", "import ci_runner"], capture_output=True, text=True, timeout=60, env=clean,
                           cwd=where)
    assert probe.returncode != 0 and "No module named 'ci_runner'" in probe.stderr
    return python


def test_a_failed_setup_is_recorded_without_deepview_ci_and_reads_as_error(tmp_path: Path, bare_python: Path) -> None:
    setup = step(CELLS, "cell", "setup")
    assert setup["env"]["DEEPVIEW_SETUP"] == "${{ fromJSON(inputs.backends)[matrix.b].setup }}"
    (tmp_path / "m.yaml").write_text(matrix_text(
        modes=["ops", "layers"], models=[{"id": "tiny", "config": "llama"}],
        backends=[{"id": "acme", "compile": "acme_compiler:compile_fn", "runs-on": ["self-hosted", "acme-card"],
                   "python": "python", "setup": ["echo building > built.txt",
                                                 "python -c 'import ci_runner' && echo never-printed",
                                                 "touch third.txt"]}]))
    plan = tmp_path / "plan.json"
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--out", str(plan)]) == 0
    [table] = json.loads(plan.read_text())["backends"]
    marker = tmp_path / "pwned"
    out = tmp_path / "github_output"
    out.write_text("")
    work = tmp_path / "job"
    work.mkdir()
    env = {"PATH": f"{bare_python.parent}:/usr/bin:/bin", "GITHUB_OUTPUT": str(out), "RUNNER_TEMP": str(tmp_path),
           "DEEPVIEW_SETUP": table["setup"], "DEEPVIEW_CELL": "tiny@acme"}
    proc = subprocess.run([BASH, "-e", "-c", setup["run"]], env=env, capture_output=True, text=True, timeout=60, cwd=work)
    assert proc.returncode == 0, proc.stderr  # the step itself succeeds: the failure is data for the cell
    assert read_output(out) == {"failed": "true"}
    assert (work / "built.txt").exists() and not (work / "third.txt").exists()
    record = work / "deepview-run" / "cells" / "tiny@acme" / "setup-failed"
    assert (record / "command.txt").read_text() == "python -c 'import ci_runner' && echo never-printed\n"
    assert (record / "exit-code").read_text().strip() == "1"
    assert "No module named 'ci_runner'" in (record / "output.log").read_text()

    # what the upload step sends, aggregated by the report job (its own Python, with deepview-ci)
    report = tmp_path / "report"
    assert cli.main(["aggregate", str(work / "deepview-run"), "--out", str(report), "--plan", str(plan)]) == 0
    [cell] = load_results(report / "results.json").cells
    assert cell.id == "tiny@acme" and cell.status == "error" and cell.error is not None
    assert cell.error.type == "setup_failed" and cell.error.exit_code == 1
    assert cell.error.message.startswith("setup failed: `python -c 'import ci_runner' && echo never-printed` exited with 1")
    assert "No module named 'ci_runner'" in cell.error.stderr_tail
    assert not marker.exists()


def test_setup_commands_are_data_never_evaluated_by_the_step(tmp_path: Path, bare_python: Path) -> None:
    setup = step(CELLS, "cell", "setup")
    marker = tmp_path / "pwned"
    commands = [f"echo 'two $(touch {marker})'", "true"]
    out = tmp_path / "github_output"
    out.write_text("")
    env = {"PATH": f"{bare_python.parent}:/usr/bin:/bin", "GITHUB_OUTPUT": str(out), "RUNNER_TEMP": str(tmp_path),
           "DEEPVIEW_SETUP": "\n".join(base64.b64encode(c.encode()).decode() for c in commands), "DEEPVIEW_CELL": "a@b"}
    proc = subprocess.run([BASH, "-e", "-c", setup["run"]], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert read_output(out) == {"failed": "false"} and not marker.exists()
    assert f"two $(touch {marker})" in proc.stdout
    assert not (tmp_path / "deepview-run" / "cells" / "a@b" / "setup-failed").exists()


def run_policy(tmp_path: Path, **env: str) -> tuple[int, dict[str, str], str]:
    policy = step(WORKFLOW, "report", "policy")
    out = tmp_path / "policy_output"
    out.write_text("")
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GITHUB_OUTPUT": str(out), "FAIL_ON": "regression",
            "NO_RESULT": "0", "CELLS_RESULT": "success", "BASELINE": "baseline.json", "PLANNED": "2", "FORK_SKIPPED": "0",
            **env}
    proc = subprocess.run([BASH, "-e", "-c", policy["run"]], env=full, capture_output=True, text=True, timeout=60)
    return proc.returncode, read_output(out), proc.stdout


def test_a_diff_that_exits_3_fails_the_report_as_an_input_error_and_files_nothing(tmp_path: Path) -> None:
    """The real diff on a corrupt results file, then the step script with its exit code."""
    corrupt = tmp_path / "results.json"
    corrupt.write_text('{"cells": [')
    (tmp_path / "baseline.json").write_text("{}")
    code = cli.main(["diff", str(corrupt), "--baseline", str(tmp_path / "baseline.json"), "--out", str(tmp_path / "d")])
    assert code == 3
    rc, out, log = run_policy(tmp_path, DIFF_EXIT=str(code))
    assert rc != 0 and out == {"outcome": "error", "file-issues": "false"}
    assert "input error, not a policy result" in log
    policy = step(WORKFLOW, "report", "policy")
    assert policy["env"]["DIFF_EXIT"] == "${{ steps.diff.outputs.exit-code }}"


@pytest.mark.parametrize("env, rc, outcome, file_issues", [
    ({"DIFF_EXIT": "0"}, 0, "success", "true"),
    ({"DIFF_EXIT": "1"}, 1, "failure", "true"),  # a policy failure: regressions are exactly what gets filed
    ({"DIFF_EXIT": "2"}, 2, "error", "false"),
    ({"DIFF_EXIT": "4"}, 2, "error", "false"),
    ({"DIFF_EXIT": ""}, 2, "error", "false"),  # deepview-ci did not even start
    ({"DIFF_EXIT": "1", "NO_RESULT": "3"}, 1, "failure", "false"),  # partial run: cells without a result
    ({"DIFF_EXIT": "0", "CELLS_RESULT": "cancelled"}, 0, "success", "false"),
    # issue 34: a fork's PR that ran nothing (every cell self-hosted) is not a pass, whatever the diff said
    ({"DIFF_EXIT": "0", "PLANNED": "0", "FORK_SKIPPED": "2"}, 1, "not-tested", "false"),
    ({"DIFF_EXIT": "0", "PLANNED": "1", "FORK_SKIPPED": "2"}, 0, "success", "true"),  # partly tested: a warning
])
def test_only_a_diff_that_ran_on_a_whole_run_lets_issues_be_filed(tmp_path: Path, env: dict, rc: int, outcome: str,
                                                                   file_issues: str) -> None:
    got_rc, out, _ = run_policy(tmp_path, **env)
    assert (got_rc, out) == (rc, {"outcome": outcome, "file-issues": file_issues})


def test_a_failed_install_of_deepview_ci_is_recorded_by_the_shell_and_fails_the_job_after_the_upload(tmp_path: Path) -> None:
    job = load(CELLS)["jobs"]["cell"]
    names = [s.get("name") for s in job["steps"]]
    record_step = next(s for s in job["steps"] if s.get("name") == "Record a failed install as the cell's result")
    assert record_step["if"] == "steps.install.outcome == 'failure'"
    assert names.index("Upload the cell's results and repros") < names.index("Fail the job when the cell could not be set up")
    out = tmp_path / "github_output"
    out.write_text("")
    env = {"PATH": "/usr/bin:/bin", "GITHUB_OUTPUT": str(out), "DEEPVIEW_CELL": "tiny@acme", "CELL_PYTHON": "python3",
           "GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": "acme/compiler", "GITHUB_RUN_ID": "4242"}
    proc = subprocess.run([BASH, "-e", "-c", record_step["run"]], env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    plan = tmp_path / "plan.json"
    (tmp_path / "m.yaml").write_text(matrix_text(
        models=[{"id": "tiny", "config": "llama"}],
        backends=[{"id": "acme", "runs-on": ["self-hosted", "acme"], "python": "python3"}]))
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--out", str(plan)]) == 0
    assert cli.main(["aggregate", str(tmp_path / "deepview-run"), "--out", str(tmp_path / "report"), "--plan", str(plan)]) == 0
    [cell] = load_results(tmp_path / "report" / "results.json").cells
    assert cell.status == "error" and cell.error is not None and cell.error.type == "setup_failed"
    assert cell.error.message.startswith("setup failed: `install deepview-ci into python3")
    assert "https://github.com/acme/compiler/actions/runs/4242" in cell.error.stderr_tail


def test_a_cell_job_killed_before_its_last_upload_reads_timeout(tmp_path: Path) -> None:
    """Issue 34: the start record (plain shell) is uploaded before the cell runs, under the cell's artifact name, and the
    last upload replaces it. When the job is killed so hard that the last upload never runs, the report reads the cell
    as `timeout`. Before: "no result" (error), as if the job had never started."""
    job = load(CELLS)["jobs"]["cell"]
    names = [s.get("name") for s in job["steps"]]
    started = step(CELLS, "cell", "started")
    early = job["steps"][names.index(started["name"]) + 1]
    last = next(s for s in job["steps"] if s.get("name") == "Upload the cell's results and repros")
    assert early["with"]["name"] == last["with"]["name"] == "${{ matrix.artifact }}-attempt-${{ github.run_attempt }}"
    assert early["with"]["path"] == last["with"]["path"] and last["with"]["overwrite"] is True
    assert names.index(early["name"]) < names.index("Run the cell") < names.index(last["name"])
    work = tmp_path / "job"
    work.mkdir()
    env = {"PATH": "/usr/bin:/bin", "GITHUB_OUTPUT": str(tmp_path / "out"), "DEEPVIEW_CELL": 'tiny@acme',
           "CELL_MINUTES": "32"}
    proc = subprocess.run([BASH, "-e", "-c", started["run"]], env=env, capture_output=True, text=True, timeout=60, cwd=work)
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "m.yaml").write_text(matrix_text(models=[{"id": "tiny", "config": "llama"}], modes=["ops", "layers"],
                                                 backends=[{"id": "acme", "runs-on": ["self-hosted", "acme"]}]))
    plan = tmp_path / "plan.json"
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--out", str(plan)]) == 0
    assert cli.main(["aggregate", str(work / "deepview-run"), "--out", str(tmp_path / "report"), "--plan", str(plan)]) == 0
    [cell] = load_results(tmp_path / "report" / "results.json").cells
    assert cell.status == "timeout" and cell.error is not None and cell.error.type == "timeout"
    assert "ended after the cell started" in cell.error.message and "32 minutes" in cell.error.message
    assert set(cell.modes) == {"ops", "layers"} and all(m.status == "timeout" for m in cell.modes.values())
