"""Issue 22: `deepview-ci bisect-commits` over a 40-commit history of a real torch.compile plugin (`tinyc`).

The repository is built by one script (tests/fixtures/bisect_repo.py): commit 7 changes an unrelated op (relu),
commit 13 drops softplus's lowering, commit 19 breaks the build (the walk's first probe: a skip) and 20 repairs it.
The repros are real: cut from a run of two cells on the plugin at HEAD (tests/fixtures/bisect_run/regenerate.sh).
Each step's setup checks the build file and installs the package into the per-commit prefix (a no-op build: the
plugin is pure Python); each repro is a one-op torch.compile in a fresh interpreter, a few CPU-seconds each.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ci_runner.commits.scratch import RepoState
from tests.fixtures.bisect_repo import BREAK_AT, COMMITS, DROP_AT, BisectRepo, build

pytestmark = pytest.mark.slow

from tests.fixtures.paths import ROOT
from tests.fixtures.procs import sigint_default
RUN = ROOT / "tests" / "fixtures" / "bisect_run"
CELL_A, CELL_B = "tiny-softplus@tinyc", "tiny-softplus-b@tinyc"
# check the build file, then install: a pure-Python package's build is a copy into the per-commit prefix
SETUP = ['python -c "import tomllib; tomllib.load(open(\'pyproject.toml\', \'rb\'))"', 'cp -r tinyc "$DEEPVIEW_BISECT_PREFIX"/']
MAX_RUNS = math.ceil(math.log2(COMMITS)) + 2


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("bisect")
    repo = build(root / "repo")
    # the user's checkout is on a branch of its own, with local edits: all of it must survive
    subprocess.run(["bash", "-c", "git checkout -q -b wip HEAD~2 && echo local >> NOTES.md && echo x > scratch.txt"],
                   cwd=repo.path, check=True)
    run = root / "run"
    shutil.copytree(RUN, run)
    return {"repo": repo, "run": run, "cache": root / "cache", "tmp": root / "tmpdir"}


def scratch_left(tmp: Path) -> list[str]:
    """Scratch clones left in TMPDIR (torch's own caches there, e.g. torchinductor_<user>, do not count)."""
    return [p.name for p in tmp.iterdir() if p.name.startswith("deepview-bisect-")]


def cli(world: dict[str, object], *args: str, out: Path | None = None) -> subprocess.CompletedProcess[str]:
    repo: BisectRepo = world["repo"]  # type: ignore[assignment]
    tmp: Path = world["tmp"]  # type: ignore[assignment]
    tmp.mkdir(exist_ok=True)
    cmd = [sys.executable, "-m", "ci_runner", "bisect-commits", "--repo", str(repo.path), "--good", repo.at(0),
           "--bad", repo.at(COMMITS - 1), "--python", sys.executable, "--cache", str(world["cache"]), "--step-timeout", "240"]
    for s in SETUP:
        cmd += ["--setup", s]
    if out:
        cmd += ["--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)


def test_the_ops_repro_names_the_dropping_commit_and_a_second_finding_reuses_it(world: dict[str, object], tmp_path: Path) -> None:
    repo: BisectRepo = world["repo"]  # type: ignore[assignment]
    run: Path = world["run"]  # type: ignore[assignment]
    before = RepoState.of(repo.path)
    results = json.loads((run / "report" / "results.json").read_text())
    fps = {c["id"]: [f["fingerprint"] for f in c["modes"]["ops"]["findings"]] for c in results["cells"]}
    out = tmp_path / "bisect.json"
    proc = cli(world, "--finding", f"{run}/cells/{CELL_A}/result.json:{fps[CELL_A][0]}",
               "--finding", f"{run}/report/results.json:{fps[CELL_B][0]}", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    drop = repo.at(DROP_AT)
    assert proc.stdout.splitlines()[0].startswith(f"first bad commit: {drop} softplus: drop the lowering")
    d = json.loads(out.read_text())
    assert d["first_bad"]["commit"] == drop and d["first_bad"]["author"].startswith("Tinyc Dev")
    [b] = d["bisections"]  # two findings, one root-cause signature: one bisection
    assert b["findings"] == [f"{CELL_A} {fps[CELL_A][0]}", f"{CELL_B} {fps[CELL_B][0]}"]
    runs = [s for s in d["steps"] if s["repro_ran"]]
    assert 0 < len(runs) <= MAX_RUNS, [(s["commit"][:8], s["verdict"]) for s in d["steps"]]
    assert {"commit", "verdict", "seconds", "log"} <= set(d["steps"][0])
    skipped = [s for s in d["steps"] if s["verdict"] == "skip"]
    assert [s["commit"] for s in skipped] == [repo.at(BREAK_AT)] and "setup failed" in skipped[0]["log"]
    assert all(s["verdict"] == ("bad" if repo.commits.index(s["commit"]) >= DROP_AT else "good") for s in runs)
    assert RepoState.of(repo.path) == before and scratch_left(Path(world["tmp"])) == []  # type: ignore[arg-type]

    # a later invocation with another finding of that signature (by its repro script) reuses the answer
    again = cli(world, "--repro", f"{run}/cells/{CELL_B}/ops/repro_aten.softplus.default.py", out=tmp_path / "again.json")
    assert again.returncode == 0 and "(reused)" in again.stdout and f"first bad commit: {drop}" in again.stdout, again.stderr
    assert json.loads((tmp_path / "again.json").read_text())["first_bad"]["commit"] == drop


def test_a_layers_findings_culprit_repro_bisects_the_same_way(world: dict[str, object], tmp_path: Path) -> None:
    repo: BisectRepo = world["repo"]  # type: ignore[assignment]
    run: Path = world["run"]  # type: ignore[assignment]
    out = tmp_path / "layers.json"
    done_before = {p.parent.name for p in Path(world["cache"]).rglob("setup.json")}  # type: ignore[arg-type]
    proc = cli(world, "--repro", f"{run}/cells/{CELL_A}/layers/repro/act/culprit/repro.py", out=out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    d = json.loads(out.read_text())
    assert d["first_bad"]["commit"] == repo.at(DROP_AT)
    assert d["bisections"][0]["findings"][0].startswith(f"{CELL_A} ")  # the layers finding the culprit belongs to
    assert 0 < d["bisections"][0]["repro_runs"] <= MAX_RUNS
    # a commit set up by an earlier bisection (the ops one, when it ran first) is not built again
    assert all(s["setup_cached"] == (s["commit"] in done_before) for s in d["steps"])


def test_ctrl_c_in_the_middle_leaves_the_repository_as_it_was(world: dict[str, object], tmp_path: Path) -> None:
    repo: BisectRepo = world["repo"]  # type: ignore[assignment]
    run: Path = world["run"]  # type: ignore[assignment]
    before = RepoState.of(repo.path)
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "ci_runner", "bisect-commits", "--repo", str(repo.path), "--good", repo.at(0), "--bad",
           repo.at(COMMITS - 1), "--python", sys.executable, "--cache", str(tmp_path / "cache"),
           "--repro", f"{run}/cells/{CELL_A}/ops/repro_aten.softplus.default.py"]
    for s in SETUP:
        cmd += ["--setup", s]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp)}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=sigint_default)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((tmp_path / "cache").rglob("setup.json"))) < 2:
        time.sleep(0.2)  # the second commit is set up: its repro is running now
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert RepoState.of(repo.path) == before and not before.bisecting
    assert scratch_left(tmp) == []  # the scratch clone is gone


def test_the_nightly_bisects_a_regression_and_the_filed_issue_names_the_commit(world: dict[str, object], tmp_path: Path) -> None:
    """aggregate's results (the cells' env stamps name the plugin's commit) → diff against a baseline taken at the
    first commit → bisect-regressions → file-issues against the fake GitHub."""
    from tests.fixtures.fake_github import FakeGitHub

    repo: BisectRepo = world["repo"]  # type: ignore[assignment]
    run: Path = world["run"]  # type: ignore[assignment]
    results = run / "report" / "results.json"
    stamps = {c["id"]: c["env"]["backend_source"]["tinyc"] for c in json.loads(results.read_text())["cells"]}
    assert {s["commit"] for s in stamps.values()} == {repo.at(COMMITS - 1)} and stamps[CELL_A]["from"] == "checkout"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def step(*args: str, ok: tuple[int, ...] = (0,), extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "ci_runner", *args], capture_output=True, text=True, timeout=900,
                              env={**env, **(extra or {})}, cwd=tmp_path)
        assert proc.returncode in ok, f"{args[0]}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    # the last good nightly, at commit 0: both cells passed (its baseline, as `baseline update` wrote it then)
    step("baseline", "update", str(results), "--out", "now.json")
    base = json.loads((tmp_path / "now.json").read_text())
    for c in base["cells"]:
        c.update(status="pass", modes={m: "pass" for m in c["modes"]}, backend_commit=repo.at(0))
    base["findings"] = []
    (tmp_path / "baseline.json").write_text(json.dumps(base))
    matrix = (RUN / "matrix.yaml").read_text().replace(
        'import: [tinyc]}', 'import: [tinyc], source: {repo: "%s", setup: %s, python: "%s"}}'
        % (repo.path, json.dumps(SETUP), sys.executable))
    (tmp_path / "matrix.yaml").write_text(matrix)
    step("diff", str(results), "--baseline", "baseline.json", "--run-dir", str(run), "--out", "report", ok=(1,))
    proc = step("bisect-regressions", "report/diff.json", "--matrix", "matrix.yaml", "--baseline", "baseline.json",
                "--run-dir", str(run), "--cache", str(world["cache"]))
    drop = repo.at(DROP_AT)
    assert f"tinyc: first bad commit: {drop} softplus: drop the lowering" in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "report" / "bisect.json").read_text())
    ops = {f"{c['id']} {f['fingerprint']}" for c in json.loads(results.read_text())["cells"] for f in c["modes"]["ops"]["findings"]}
    assert all(b["first_bad"]["commit"] == drop for b in report["bisections"])
    assert any(ops <= set(b["findings"]) for b in report["bisections"])  # both cells' ops findings: one bisection

    with FakeGitHub(repos=("acme/tinyc",)) as gh:
        step("file-issues", "report/diff.json", "--repo", "acme/tinyc", "--run-dir", str(run), "--min-interval", "0",
             extra={"GITHUB_TOKEN": gh.token, "GITHUB_API_URL": gh.url})
        issue = next(i for i in gh.issues("acme/tinyc") if "aten.softplus" in i["title"])
    assert f"First failing at `{drop}` softplus: drop the lowering" in issue["body"], issue["body"]
    assert "Step log:" in issue["body"] and "**skip**" in issue["body"] and repo.at(BREAK_AT) in issue["body"]


def test_the_stamp_names_the_commit_pip_installed_from_git(world: dict[str, object], tmp_path: Path) -> None:
    """PEP 610: `pip install git+file://…@<commit>` records vcs_info.commit_id; the cell's stamp reads it."""
    repo: BisectRepo = world["repo"]  # type: ignore[assignment]
    target = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                          "--target", str(target), f"git+file://{repo.path}@{repo.at(5)}"], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    code = "import json; from ci_runner.engine.envinfo import source_stamp; print(json.dumps(source_stamp('tinyc')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{target}"}).stdout
    stamp = json.loads(out)
    assert stamp == {"module": "tinyc", "package": "tinyc", "version": "0.1.0", "commit": repo.at(5),
                     "url": f"file://{repo.path}", "from": "vcs"}
