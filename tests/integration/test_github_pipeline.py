"""The pipeline the reusable workflow runs, played with the real CLI: expand → cells (one artifact
folder each) → merge → aggregate → diff → file-issues, with GITHUB_OUTPUT, GITHUB_STEP_SUMMARY and
GITHUB_API_URL pointed at temp files and the fake GitHub. Each step's outputs are checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.fake_github import FakeGitHub
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT

GH_REPO = "acme/models"

MATRIX = matrix_text(
    modes=["ops"], timeout=600, inputs={"batch": 1, "seq_len": 8, "samples": 1, "seed": 0},
    models=[{"id": "tiny-vit", "config": "vit",
             "overrides": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                           "image_size": 16, "patch_size": 8, "num_labels": 4}}],
    backends=[{"id": "sim-subset", "compile": "sim-subset", "device": "cpu"}],
)

# the cell passed before: the convolution finding is a regression
BASELINE = {
    "schema_version": 1,
    "kind": "deepview-ci-baseline",
    "cells": [{"backend": "sim-subset", "id": "tiny-vit@sim-subset", "model": "tiny-vit", "modes": {"ops": "pass"},
               "status": "pass"}],
    "findings": [],
}


class Step:
    """One workflow step: its own GITHUB_OUTPUT file, a shared step summary, the run's environment."""

    def __init__(self, tmp: Path, gh: FakeGitHub) -> None:
        self.tmp = tmp
        self.summary = tmp / "step_summary.md"
        self.n = 0
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "GITHUB_ACTIONS": "true", "GITHUB_TOKEN": gh.token,
                    "GITHUB_API_URL": gh.url, "GITHUB_STEP_SUMMARY": str(self.summary), "GITHUB_RUN_ID": "4242",
                    "GITHUB_SERVER_URL": "https://github.com", "GITHUB_REPOSITORY": GH_REPO,
                    "RUNNER_TEMP": str(tmp / "runner-temp")}
        (tmp / "runner-temp").mkdir()

    def __call__(self, *args: str, ok: tuple[int, ...] = (0,)) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
        self.n += 1
        out = self.tmp / f"github_output_{self.n}"
        out.touch()
        proc = subprocess.run([sys.executable, "-m", "ci_runner", *args], env={**self.env, "GITHUB_OUTPUT": str(out)},
                              capture_output=True, text=True, timeout=900, cwd=self.tmp)
        assert proc.returncode in ok, f"{args[0]} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc, parse_outputs(out.read_text())


def parse_outputs(text: str) -> dict[str, str]:
    """GITHUB_OUTPUT records, `name=value` or the `name<<DELIM` … `DELIM` form."""
    out: dict[str, str] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if "<<" in line and ("=" not in line or line.index("<<") < line.index("=")):
            name, delim = line.split("<<", 1)
            j = lines.index(delim, i + 1)
            out[name] = "\n".join(lines[i + 1: j])
            i = j + 1
        elif "=" in line:
            name, value = line.split("=", 1)
            out[name] = value
            i += 1
        else:
            i += 1
    return out


@pytest.mark.slow
def test_expand_cells_aggregate_diff_file_issues(tmp_path):
    (tmp_path / "matrix.yaml").write_text(MATRIX)
    (tmp_path / "baseline.json").write_text(json.dumps(BASELINE))
    with FakeGitHub(repos=(GH_REPO,)) as gh:
        step = Step(tmp_path, gh)

        # plan
        proc, out = step("expand", "matrix.yaml", "--max-jobs", "256")
        assert out["count"] == "1" and out["chunks"] == "1"
        include = json.loads(out["matrix-0"])["include"]
        assert "matrix" not in out and json.loads(out["chunk-ids"]) == [0]
        assert [c["cell"] for c in include] == ["tiny-vit@sim-subset"]
        assert json.loads(proc.stdout)["count"] == 1

        # one job per cell, each uploading its own artifact, named per run attempt
        for c in include:
            art = f"artifacts/{c['artifact']}-attempt-1"
            proc, _ = step("cell", c["cell"], "--matrix", "matrix.yaml", "--out", art, ok=(0, 1))
            result = json.loads((tmp_path / art / "cells" / c["cell"] / "result.json").read_text())
            ops = result["modes"]["ops"]
            if ops["status"] == "skipped" and "not available" in (ops.get("reason") or ""):
                pytest.skip("the ops mode is not in this tree yet: " + ops["reason"])
            assert proc.returncode == 1 and ops["status"] == "fail"
            conv = [f for f in ops["findings"] if f.get("op", "").startswith("aten.convolution")]
            assert conv, ops["findings"]

        # the report job: download-artifact puts each artifact in its own folder; `collect` keeps each cell's newest
        run = tmp_path / "deepview-run"
        step("collect", "artifacts", "--out", "deepview-run")
        _, out = step("aggregate", "deepview-run", "--out", "deepview-run/report", "--run-dir", "deepview-run")
        for name in ("results.json", "junit.xml", "summary.md", "report.html"):
            assert (run / "report" / name).stat().st_size > 0
        assert "tiny-vit@sim-subset" in step.summary.read_text()

        proc, out = step("diff", "deepview-run/report/results.json", "--baseline", "baseline.json", "--fail-on",
                         "regression", "--run-dir", "deepview-run", ok=(1,))
        diff = json.loads((run / "report" / "diff.json").read_text())
        assert diff["counts"]["regressed"] >= 1
        regressed = [e for e in diff["entries"] if e["category"] == "regressed" and e["finding"]]
        assert any(e["finding"]["op"].startswith("aten.convolution") for e in regressed)
        assert "::error" in proc.stdout

        # the issues job
        proc, out = step("file-issues", "deepview-run/report/diff.json", "--repo", GH_REPO, "--run-dir", "deepview-run",
                         "--min-interval", "0")
        assert out["created"] == str(len(gh.issues())) and int(out["created"]) >= 1
        assert out["drafts"] == "0"
        conv_issue = next(i for i in gh.issues() if "aten.convolution" in i["title"])
        assert conv_issue["title"].endswith("fails on sim-subset")
        assert "`tiny-vit`" in conv_issue["body"] and "<details>" in conv_issue["body"]
        assert "https://github.com/acme/models/actions/runs/4242" in conv_issue["body"]
        assert "### deepview-ci issues" in step.summary.read_text()

        # the job rerun: nothing new
        writes = len(gh.writes())
        _, out = step("file-issues", "deepview-run/report/diff.json", "--repo", GH_REPO, "--run-dir", "deepview-run",
                      "--min-interval", "0")
        assert out["created"] == "0" and out["commented"] == "0" and len(gh.writes()) == writes
        assert gh.token not in step.summary.read_text()
