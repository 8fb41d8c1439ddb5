"""Lint the composite action and the workflows.

- check-jsonschema with its built-in GitHub schemas (`vendor.github-actions`, `vendor.github-workflows`);
- zizmor, offline, strict collection (a file it cannot parse is an error): no finding of medium
  severity or above;
- the rules of DESIGN §6 that neither tool checks: every composite `run` step has `shell:`, no
  `${{ }}` inside any `run:` script, setup-python with `update-environment: false`, every remote
  `uses:` pinned to a commit, no persisted checkout credentials, and a PR check that can file nothing;
- the action's run step executed with bash against hostile arguments: they reach the CLI as a list,
  and nothing in them is evaluated.

Both tools are in the `test` extra; where one is missing its test is skipped and says so.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTION = ROOT / "action.yml"
PINNED = re.compile(r"^[\w.-]+/[\w.-]+(/[\w./-]+)?@[0-9a-f]{40}$")


def tool(name: str) -> str:
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install '.[test]')")
    return found


def load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    if True in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


def steps_of(doc: dict):
    if "runs" in doc:
        yield from doc["runs"].get("steps", [])
    for job in (doc.get("jobs") or {}).values():
        yield from job.get("steps", []) or []


def test_there_is_something_to_lint():
    assert ACTION.exists()
    assert {p.name for p in WORKFLOWS} >= {"deepview.yml", "nightly.yml", "pr-check.yml", "ci.yml"}


# --------------------------------------------------------------------------- the two tools


def test_check_jsonschema_builtin_github_schemas():
    exe = tool("check-jsonschema")
    for schema, files in (("vendor.github-actions", [ACTION]), ("vendor.github-workflows", WORKFLOWS)):
        proc = subprocess.run([exe, "--builtin-schema", schema, *map(str, files)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_zizmor_offline_has_no_medium_or_high_finding():
    exe = tool("zizmor")
    env = {k: v for k, v in os.environ.items() if k not in ("GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN")}
    proc = subprocess.run([exe, "--offline", "--strict-collection", "--no-exit-codes", "--min-severity", "medium",
                           "--format", "json", str(ACTION), *map(str, WORKFLOWS)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**env, "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stderr  # with --no-exit-codes, non-zero means zizmor itself failed
    findings = json.loads(proc.stdout or "[]")
    described = [f"{f['ident']} ({f['determinations']['severity']}): {f['desc']}" for f in findings]
    assert findings == [], "\n".join(described)


# --------------------------------------------------------------------------- rules of DESIGN §6


def test_composite_action_shape():
    doc = load(ACTION)
    assert doc["runs"]["using"] == "composite"
    assert doc["branding"]["icon"] and doc["branding"]["color"]
    steps = doc["runs"]["steps"]
    for step in steps:
        if "run" in step:
            assert step.get("shell"), f"composite step {step.get('name')!r} has no shell:"
    setup = [s for s in steps if str(s.get("uses", "")).startswith("actions/setup-python@")]
    assert setup and all(str(s["with"]["update-environment"]).lower() == "false" for s in setup)
    install = next(s for s in steps if "pip install" in s.get("run", ""))
    assert "$GITHUB_ACTION_PATH" in install["run"] and "venv" in install["run"]
    outputs = doc["outputs"]
    for name in ("exit-code", "report-dir", "results", "junit", "summary", "html", "diff", "matrix", "count",
                 "created", "commented", "reopened", "closed", "drafts"):
        assert name in outputs and outputs[name]["value"].startswith("${{ steps.")


@pytest.mark.parametrize("path", [ACTION, *WORKFLOWS], ids=lambda p: p.name)
def test_no_expression_inside_scripts_and_pinned_uses(path):
    doc = load(path)
    for step in steps_of(doc):
        if "run" in step:
            assert "${{" not in step["run"], f"{path.name}: {step.get('name')!r} expands an expression inside run:"
        uses = step.get("uses")
        if uses and not uses.startswith("./"):
            assert PINNED.match(uses), f"{path.name}: {uses} is not pinned to a commit"
        if str(uses or "").startswith("actions/checkout@"):
            assert step.get("with", {}).get("persist-credentials") is False, f"{path.name}: checkout persists credentials"
    for job in (doc.get("jobs") or {}).values():
        if "uses" in job:
            assert job["uses"].startswith("./") or PINNED.match(job["uses"])


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_permissions_are_explicit(path):
    doc = load(path)
    assert "pull_request_target" not in doc["on"] and "workflow_run" not in doc["on"]
    reusable = "workflow_call" in doc["on"]
    if not reusable:
        assert doc.get("permissions") == {}, f"{path.name}: start from no permissions and grant per job"
    for name, job in doc["jobs"].items():
        if reusable and name == "issues":
            assert "permissions" not in job  # inherits the caller's grant; see the workflow's comment
            continue
        assert "permissions" in job, f"{path.name}: job {name} has no permissions block"
        perms = job["permissions"] or {}
        writes = {k for k, v in perms.items() if v == "write"}
        assert writes <= {"issues"}, f"{path.name}: job {name} writes {writes}"


def test_reusable_pipeline_shape():
    doc = load(ROOT / ".github" / "workflows" / "deepview.yml")
    jobs = doc["jobs"]
    assert list(jobs) == ["plan", "cells", "report", "issues"]
    assert jobs["cells"]["runs-on"] == "${{ matrix.runs-on }}"
    assert jobs["cells"]["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    upload = [s for s in jobs["cells"]["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert upload and upload[0]["with"]["name"] == "${{ matrix.artifact }}"
    commands = [s["with"]["command"] for s in jobs["report"]["steps"] if s.get("uses") == "./.deepview-ci"]
    assert commands == ["aggregate", "diff"]
    assert "inputs.file-issues" in jobs["issues"]["if"]


def test_nightly_files_issues_and_pr_check_files_nothing():
    nightly = load(ROOT / ".github" / "workflows" / "nightly.yml")
    assert "schedule" in nightly["on"]
    job = nightly["jobs"]["deepview"]
    assert job["with"]["file-issues"] is True and job["permissions"]["issues"] == "write"
    pr = load(ROOT / ".github" / "workflows" / "pr-check.yml")
    assert set(pr["on"]) == {"pull_request"} and pr["on"]["pull_request"]["paths"]
    job = pr["jobs"]["deepview"]
    assert job["with"]["file-issues"] is False and job["with"]["fail-on"] == "regression"
    assert job["permissions"] == {"contents": "read"}
    assert "secrets" not in job


def test_ci_runs_the_action_from_this_checkout():
    ci = load(ROOT / ".github" / "workflows" / "ci.yml")
    used = [s["uses"] for job in ci["jobs"].values() for s in job["steps"] if "uses" in s]
    assert "./" in used


# --------------------------------------------------------------------------- the run step, executed


def test_action_run_step_passes_arguments_as_a_list(tmp_path):
    """Hostile `args` reach the CLI verbatim, as separate arguments; nothing is evaluated."""
    if not shutil.which("bash"):
        pytest.skip("bash is not available")
    step = next(s for s in load(ACTION)["runs"]["steps"] if s.get("id") == "run")
    venv = tmp_path / "runner-temp" / "deepview-ci-venv-3.11.9" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    fake_cli = venv / "deepview-ci"
    fake_cli.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n"
                        "sys.exit(1)\n")
    fake_cli.chmod(0o755)
    marker = tmp_path / "pwned"
    hostile = f"diff.json --repo 'a b/c' \"$(touch {marker})\" '`touch {marker}`' ; touch {marker} --x=\"q'uote\""
    out = tmp_path / "github_output"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RUNNER_TEMP": str(tmp_path / "runner-temp"),
           "GITHUB_OUTPUT": str(out), "DEEPVIEW_PYTHON_VERSION": "3.11.9",
           "DEEPVIEW_COMMAND": "baseline update", "DEEPVIEW_ARGS": hostile, "GITHUB_TOKEN": "t"}
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr  # the CLI's exit code is the step's
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert argv == ["baseline", "update", "diff.json", "--repo", "a b/c", f"$(touch {marker})", f"`touch {marker}`",
                    ";", "touch", str(marker), "--x=q'uote"]
    assert not marker.exists()
    assert out.read_text() == "exit-code=1\n"

    env["DEEPVIEW_ARGS"] = ""
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert json.loads((tmp_path / "argv.json").read_text()) == ["baseline", "update"]
