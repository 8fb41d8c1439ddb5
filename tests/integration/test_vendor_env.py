"""Issue 12: a vendor environment set up the way a runner would, with the step scripts read from action.yml
and the reusable workflow (never copied here).

The environment "already has torch": a venv whose site-packages reach the test venv's (a `.pth` line, the way
a vendor image ships torch outside deepview-ci's reach) with a `pip` of its own, and no package index
(`--no-index`, `PIP_NO_INDEX=1`): nothing can be downloaded, so nothing present can be replaced. The fixture
repository `tests/fixtures/vendor_repo/` holds the backend's source (`compiler/`, built by the matrix's
`setup: [pip install ./compiler]`), its matrix and its committed baseline.

Order matters: the cell without its setup runs before the setup installs the plugin.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.slow

VENDOR_REPO = ROOT / "tests" / "fixtures" / "vendor_repo"
CELL = "tiny-softplus@acme"


def step_script(doc_path: Path, step_id: str, job: str | None = None) -> dict[str, Any]:
    doc = yaml.safe_load(doc_path.read_text(encoding="utf-8"))
    steps = doc["runs"]["steps"] if job is None else doc["jobs"][job]["steps"]
    return next(s for s in steps if s.get("id") == step_id)


def tree_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            st = os.stat(os.path.join(dirpath, name))
            h.update(f"{os.path.relpath(os.path.join(dirpath, name), folder)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


class Runner:
    """GITHUB_* variables and a bash like the runner's (`bash --noprofile --norc -eo pipefail FILE`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.action_path = root / "deepview-ci"  # the action's checkout ($GITHUB_ACTION_PATH)
        self.workspace = root / "workspace"  # the vendor's checkout ($GITHUB_WORKSPACE)
        self.temp = root / "runner-temp"
        self.venv = root / "vendor-env"
        self.temp.mkdir()
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split("\n")
        for rel in filter(None, files):
            src = ROOT / rel
            if src.is_file():
                (self.action_path / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, self.action_path / rel)
        shutil.copytree(VENDOR_REPO, self.workspace)
        # the vendor's environment: its own interpreter and pip, torch already there (reached through a .pth)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)], check=True, timeout=120)
        site = Path(subprocess.run([str(self.venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        (site / "vendor-image.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        pip = self.venv / "bin" / "pip"
        pip.write_text(f"#!{self.venv / 'bin' / 'python'}\nimport sys\nfrom pip._internal.cli.main import main\nsys.exit(main())\n")
        pip.chmod(0o755)
        self.python = self.venv / "bin" / "python"

    def env(self, **extra: str) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "TMPDIR", "PIP_CERT", "PIP_FIND_LINKS")}
        return {**keep, "PATH": f"{self.venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "CI": "true", "GITHUB_ACTIONS": "true",
                "RUNNER_OS": "Linux", "RUNNER_TEMP": str(self.temp), "GITHUB_WORKSPACE": str(self.workspace),
                "GITHUB_ACTION_PATH": str(self.action_path), "GITHUB_OUTPUT": str(self.temp / "output"),
                "GITHUB_STEP_SUMMARY": str(self.temp / "summary"), "GITHUB_REPOSITORY": "acme/compiler",
                "PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0", "PYTHONDONTWRITEBYTECODE": "1", **extra}

    def run(self, script: str, env: dict[str, str], *, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        path = self.temp / "step.sh"
        path.write_text(script)
        (self.temp / "output").write_text("")
        return subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", str(path)], env=env, cwd=cwd or self.workspace,
                              capture_output=True, text=True, timeout=timeout)

    def outputs(self) -> str:
        return (self.temp / "output").read_text()

    def action(self, command: str, args: str) -> subprocess.CompletedProcess[str]:
        """The action's run step with `python: python3` (the matrix's python), after its install step."""
        step = step_script(ACTION, "run")
        return self.run(step["run"], self.env(DEEPVIEW_CI_PYTHON=self.installed_python, DEEPVIEW_COMMAND=command,
                                              DEEPVIEW_ARGS=args, GITHUB_TOKEN=""))

    installed_python = ""


ACTION = ROOT / "action.yml"
CELLS = ROOT / ".github" / "workflows" / "deepview-cells.yml"  # the cell job, called once per chunk


def torch_state(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m, importlib.util as u, json; "
                          "print(json.dumps({'version': m.version('torch'), 'origin': u.find_spec('torch').origin}))"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    state = json.loads(out)
    state["files"] = tree_fingerprint(Path(state["origin"]).parent)
    return state


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> Runner:
    r = Runner(tmp_path_factory.mktemp("vendor-runner"))
    r.torch_before = torch_state(r.python)  # type: ignore[attr-defined]
    # the matrix entry the workflow hands this cell's job (python, setup) comes from `expand`
    plan = subprocess.run([sys.executable, "-m", "ci_runner", "expand", "deepview/matrix.yaml"], cwd=r.workspace,
                          capture_output=True, text=True, check=True, timeout=120).stdout
    doc = json.loads(plan)
    [cell] = doc["matrix"][0]["include"]
    entry = doc["backends"][cell["b"]]  # the backend's job settings: the plan's backend table, one row per backend
    r.entry = entry  # type: ignore[attr-defined]
    install = step_script(ACTION, "install")
    proc = r.run(install["run"], r.env(DEEPVIEW_EXISTING_PYTHON=entry["python"], DEEPVIEW_PYTHON="", DEEPVIEW_PYTHON_VERSION="",
                                       DEEPVIEW_PIP_ARGS="--no-index", DEEPVIEW_EXTRAS=""), timeout=600)
    r.install_log = proc.stdout + proc.stderr  # type: ignore[attr-defined]
    print(r.install_log)  # shown with -s, and on failure
    assert proc.returncode == 0, r.install_log
    r.installed_python = r.outputs().strip().split("python=", 1)[1]
    return r


def test_install_into_the_existing_environment_leaves_torch_alone(runner: Runner) -> None:
    log: str = runner.install_log  # type: ignore[attr-defined]
    before = runner.torch_before  # type: ignore[attr-defined]
    assert runner.installed_python == str(runner.venv / "bin" / "python3")  # `python3` found on PATH, as in a container
    assert f"before: torch {before['version']} at {before['origin']}" in log
    assert f"after:  torch {before['version']} at {before['origin']}" in log
    assert "pinning" in log and "--constraint" not in log  # the pin is announced; pip's own lines follow
    assert "Requirement already satisfied: torch" in log  # pip's output shows torch kept, not reinstalled
    assert "unchanged: every package that was installed before keeps its version" in log
    assert "Successfully installed deepview-ci" in log and "Uninstalling torch" not in log
    assert torch_state(runner.python) == before
    version = subprocess.run([runner.installed_python, "-m", "ci_runner", "--version"], capture_output=True, text=True,
                             cwd=runner.root, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("deepview-ci ")
    # the cell job installs in one step and runs the cell in the next: the second call of the action installs nothing
    again = runner.run(step_script(ACTION, "install")["run"],
                       runner.env(DEEPVIEW_EXISTING_PYTHON=runner.entry["python"], DEEPVIEW_PYTHON="",  # type: ignore[attr-defined]
                                  DEEPVIEW_PYTHON_VERSION="", DEEPVIEW_PIP_ARGS="--no-index", DEEPVIEW_EXTRAS=""))
    assert again.returncode == 0 and "already installed" in again.stdout and "pinning" not in again.stdout, again.stdout
    assert runner.outputs().strip() == f"python={runner.installed_python}"
    where = subprocess.run([runner.installed_python, "-c", "import ci_runner; print(ci_runner.__file__)"], capture_output=True,
                           text=True, cwd=runner.root, timeout=60).stdout
    assert where.startswith(str(runner.venv))  # installed into the vendor environment, not reached from the test venv


def test_without_its_setup_the_cell_is_an_error_naming_the_missing_module(runner: Runner) -> None:
    probe = subprocess.run([str(runner.python), "-c", "import acme_compiler"], capture_output=True, text=True, timeout=60)
    assert probe.returncode != 0  # the plugin is not there before `setup`
    proc = runner.action("cell", f"{CELL} --matrix deepview/matrix.yaml --out out-no-setup")
    assert proc.returncode == 4, proc.stdout + proc.stderr  # the plugin could not be loaded: environment (README)
    assert "exit-code=4" in runner.outputs()
    result = json.loads((runner.workspace / "out-no-setup" / "cells" / CELL / "result.json").read_text())
    assert result["status"] == "error"
    assert "module not found (acme_compiler)" in result["error"]["message"]


def test_setup_makes_the_plugin_importable_and_the_cell_reports_the_injected_op_failure(runner: Runner) -> None:
    setup = step_script(CELLS, "setup", job="cell")
    entry = runner.entry  # type: ignore[attr-defined]
    assert base64.b64decode(entry["setup"]).decode() == "pip install ./compiler"
    assert entry["container"]["image"].startswith("ghcr.io/acme/")
    proc = runner.run(setup["run"], runner.env(DEEPVIEW_SETUP=entry["setup"], DEEPVIEW_CELL=CELL))
    assert proc.returncode == 0 and runner.outputs().strip() == "failed=false", proc.stdout + proc.stderr
    assert "Successfully installed acme-compiler-1.4.0" in proc.stdout
    where = subprocess.run([str(runner.python), "-c", "import acme_compiler; print(acme_compiler.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=runner.root)
    assert where.returncode == 0 and where.stdout.startswith(str(runner.venv)), where.stderr

    proc = runner.action("cell", f"{CELL} --matrix deepview/matrix.yaml --out deepview-run")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # findings: the cell failed, as it should
    result = json.loads((runner.workspace / "deepview-run" / "cells" / CELL / "result.json").read_text())
    assert result["status"] == "fail" and result["env"]["torch"] == runner.torch_before["version"]  # type: ignore[attr-defined]
    [finding] = result["modes"]["ops"]["findings"]
    assert finding["kind"] == "unsupported_op" and finding["op"] == "aten.softplus.default"
    assert "AcmeLoweringError: acme lowering failed: no kernel for 'aten::softplus'" in finding["message"]
    assert torch_state(runner.python) == runner.torch_before  # type: ignore[attr-defined]


def test_the_report_job_finds_nothing_regressed_against_the_committed_baseline(runner: Runner) -> None:
    if not (runner.workspace / "deepview-run" / "cells" / CELL / "result.json").exists():
        pytest.skip("needs the cell of the previous test")
    agg = runner.action("aggregate", "deepview-run --out deepview-run/report --run-dir deepview-run")
    assert agg.returncode == 0, agg.stdout + agg.stderr
    diff = runner.action("diff", "deepview-run/report/results.json --baseline deepview/baseline.json --fail-on regression")
    assert diff.returncode == 0, diff.stdout + diff.stderr
    d = json.loads((runner.workspace / "deepview-run" / "report" / "diff.json").read_text())
    assert [(e["category"], e.get("key")) for e in d["entries"]] == [("persisting", "aten.softplus.default")]
