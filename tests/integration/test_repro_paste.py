"""Repros paste: every command a real run prints (summary.md, report.html, junit.xml, each script's header, a local
issue draft) runs in a fresh shell from the folder it names, and holds no placeholder and no path of this machine. The
run starts from a folder that holds another `ci_runner` (a checkout of another version): its cell workers still
run this process's package, the same code as the CLI."""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ci_runner.procs.isolate import run_isolated
from tests.fixtures.paths import ROOT

FIXTURES = ROOT / "tests" / "fixtures"


def _decoy(folder: Path) -> None:
    """A `ci_runner` package that fails on import, as a stale checkout in the working folder would."""
    (folder / "ci_runner").mkdir(parents=True)
    (folder / "ci_runner" / "__init__.py").write_text("raise ImportError('the decoy ci_runner was imported')\n")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH needs Python 3.11")
@pytest.mark.parametrize("warm", ["0", "1"])
def test_children_import_this_package_not_the_working_folders(tmp_path: Path, warm: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _decoy(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DEEPVIEW_CI_WARM_CHILDREN", warm)
    got = run_isolated("tests.fixtures.iso_targets:whoami", {}, timeout=120)
    assert got.ok, got.stderr_tail


def _commands(run: Path, drafts: Path) -> list[tuple[Path, str, str]]:
    """(folder, command, where it was printed) for every repro command the run's outputs print."""
    out: list[tuple[Path, str, str]] = []
    report = run / "report"
    summary = (report / "summary.md").read_text(encoding="utf-8")
    for folder, cmd in re.findall(r"run it from the cell folder `([^`]+)`: `([^`]+)`", summary):
        out.append((report / folder, cmd, "summary.md"))
    page = (report / "report.html").read_text(encoding="utf-8")
    for folder, cmd in re.findall(r"run it from the cell folder <code>([^<]+)</code>: <code>([^<]+)</code>", page):
        out.append((report / html.unescape(folder), html.unescape(cmd), "report.html"))
    junit = (report / "junit.xml").read_text(encoding="utf-8")
    for folder, cmd in re.findall(r"run it from the cell folder (\S+): ([^\n<]+)", junit):
        out.append((run / folder, cmd.strip(), "junit.xml"))
    for script in run.glob("cells/*/**/*.py"):
        for cmd in re.findall(r"^# Run it(?: from this folder)?:\s+(.+)$", script.read_text(encoding="utf-8"), re.M):
            out.append((script.parent, cmd.strip(), str(script.relative_to(run))))
    for draft in drafts.glob("*.md"):
        for folder, cmd in re.findall(r"Run it from the cell folder `([^`]+)` \([^)]*\): `([^`]+)`",
                                      draft.read_text(encoding="utf-8")):
            out.append((run / folder, cmd, draft.name))
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_printed_repro_command_runs_in_a_fresh_shell(tmp_path: Path) -> None:
    repo = tmp_path / "repo"  # the user's checkout: their plugin (not installed) and model, and a stale ci_runner
    shutil.copytree(FIXTURES / "vendor_repo" / "compiler" / "acme_compiler", repo / "compiler" / "acme_compiler")
    (repo / "models").mkdir()
    shutil.copy(FIXTURES / "vendor_repo" / "vendor_models.py", repo / "models")
    _decoy(repo)
    (repo / "matrix.yaml").write_text(
        "version: 1\ndefaults: {modes: [ops, layers], timeout: 300}\n"
        "models: [{id: tiny-softplus, factory: 'vendor_models:tiny_softplus'}]\n"
        "backends: [{id: acme, compile: 'acme_compiler:compile_fn', import: [acme_compiler]}]\n", encoding="utf-8")
    launcher = tmp_path / "deepview-ci"  # what the console script does: this package, not the working folder's
    launcher.write_text("import sys\nfrom ci_runner.cli import main\nsys.exit(main())\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(repo / "compiler"), str(repo / "models")])}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(launcher), *args], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=900)

    proc = cli("run", "matrix.yaml", "--out", "out")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # findings
    assert "decoy" not in proc.stdout + proc.stderr
    base = tmp_path / "baseline.json"
    assert cli("baseline", "update", "out/report/results.json", "--out", str(base)).returncode == 0
    doc = json.loads(base.read_text(encoding="utf-8"))  # a baseline where the cell passed: every finding regressed
    for cell in doc["cells"]:
        cell.update(status="pass", modes={m: "pass" for m in cell["modes"]})
    doc["findings"] = []
    base.write_text(json.dumps(doc), encoding="utf-8")
    d = cli("diff", "out/report/results.json", "--baseline", str(base), "--out", "out/diff")
    assert d.returncode == 1, d.stdout + d.stderr
    f = cli("file-issues", "out/diff/diff.json", "--repo", "acme/models", "--dry-run", "out/drafts", "--layers")
    assert f.returncode == 0, f.stdout + f.stderr

    run = repo / "out"
    commands = _commands(run, run / "drafts")
    where = {w.split("/")[0] if "/" in w else w for _, _, w in commands}
    assert {"summary.md", "report.html", "junit.xml", "cells"} <= where and any(w.endswith(".md") and w != "summary.md" for w in where), commands
    assert any("PYTHONPATH=" in c for _, c, _ in commands), "the plugin is not installed: commands must carry it"
    fresh = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    ran: set[tuple[Path, tuple[Path, ...]]] = set()
    for folder, cmd, printed in commands:
        assert "<" not in cmd and str(tmp_path) not in cmd and not re.search(r"(^|[ =:])/", cmd), (printed, cmd)
        m = re.fullmatch(r"(?:cd (\S+) && )?(?:PYTHONPATH=(\S+) )?python (\S+)", cmd)
        assert m, (printed, cmd)
        here = (folder / (m.group(1) or ".")).resolve()
        script = (here / m.group(3)).resolve()
        paths = tuple((here / p).resolve() for p in (m.group(2) or "").split(os.pathsep) if p)
        assert script.is_file() and all(p == (repo / "compiler").resolve() for p in paths), (printed, cmd)
        if (script, paths) in ran:  # the same script with the same path, printed in another place: run once
            continue
        ran.add((script, paths))
        done = subprocess.run(["bash", "-c", cmd], cwd=folder, env=fresh, capture_output=True, text=True, timeout=300)
        text = done.stdout + done.stderr
        assert done.returncode == 1, (printed, folder, cmd, text[-2000:])  # 1: the failure is reproduced
        assert "AcmeLoweringError" in text or "softplus" in text, (printed, cmd, text[-2000:])
    for path in [*run.glob("cells/*/**/*.py"), *(run / "drafts").glob("*.md"), *(run / "report").glob("*.md")]:
        assert str(tmp_path) not in path.read_text(encoding="utf-8"), path


def test_repro_commands_carry_only_the_plugins_a_fresh_shell_lacks(tmp_path: Path) -> None:
    """deepview-ci itself is installed wherever a repro is run (no PYTHONPATH for `ci_runner.sim`); a plugin found
    through PYTHONPATH or the working folder is carried, relative to the folder the command runs from."""
    from ci_runner.backends import plugin_pythonpath
    from ci_runner.engine.repro import run_command

    assert plugin_pythonpath(["ci_runner", "ci_runner.sim"]) == []
    assert plugin_pythonpath(["tests.fixtures.plugin_compiler"]) == [str(ROOT)]
    folder = ROOT / "out" / "cells" / "m@b" / "ops"
    assert run_command("repro_x.py", folder, [str(ROOT)]) == "PYTHONPATH=../../../.. python repro_x.py"
    assert run_command("repro.py", folder, []) == "python repro.py"
