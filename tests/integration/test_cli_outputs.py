"""Every output path of every command: an unwritable one (a read-only folder, a file in the way, `/proc/x`) is one
`deepview-ci: error:` line naming the option and the path, exit 5, before the command does any work; a write
that fails later (in the library) is one line too. Output files follow the umask."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

import pytest

from ci_runner import cli
from ci_runner.errors import EXIT_EXECUTION
from ci_runner.fsutil import atomic_write_text
from ci_runner.results.baseline import update_baseline
from ci_runner.results.model import save_results
from tests.fixtures.cli import run_cli
from tests.fixtures.results_factory import sample_results

OUTPUT_FLAGS = ("--out", "--store", "--json", "--dry-run", "--cache", "--summary")
READ_ONLY = {("history show", "store"), ("history export", "store"), ("thresholds-key", "out")}  # these name folders the command only reads


def _walk() -> list[tuple[str, argparse.ArgumentParser]]:
    return [(" ".join(path), sp) for path, sp, _ in cli._subparsers(cli.build_parser())]


def _output_options() -> list[tuple[str, str]]:
    """(command, dest) of every option that looks like an output path: the parser itself, not a list kept by hand."""
    found = []
    for name, sp in _walk():
        for action in sp._actions:
            if set(action.option_strings) & set(OUTPUT_FLAGS) and action.nargs != 0 and (name, action.dest) not in READ_ONLY:
                found.append((name, action.dest))
    return found


def _argv(command: str, dest: str, value: str) -> list[str]:
    """The shortest command line that parses: every required argument a placeholder, `dest` set to `value`."""
    sp = dict(_walk())[command]
    argv = command.split()
    for action in sp._actions:
        if action.dest == dest:
            argv += [action.option_strings[0], value] if action.option_strings else [value]  # `init PATH`
        elif not action.option_strings and action.dest != "help":
            argv += ["x"]
        elif action.required:
            argv += [action.option_strings[0], "x"]
    return argv


def _read_only_folder(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes through any mode bits: a file system it cannot write
        return Path("/sys/deepview-ci-test")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return ro / "sub"


def test_every_output_like_option_is_checked() -> None:
    declared = {(cmd, dest) for cmd, dests in cli.OUTPUT_PATHS.items() for dest in dests}
    missing = set(_output_options()) - declared
    assert not missing, f"add these to cli.OUTPUT_PATHS: {sorted(missing)}"
    assert ("history add", "store") in declared and ("compare", "json") in declared


@pytest.mark.parametrize("command,dest", sorted((c, d) for c, ds in cli.OUTPUT_PATHS.items() for d in ds))
def test_an_unwritable_output_is_one_line_and_exit_5(command: str, dest: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    kind = cli.OUTPUT_PATHS[command][dest]
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad = [Path("/proc/x"), a_file / "sub", _read_only_folder(tmp_path)]
    if kind == "dir":
        bad.append(a_file)
    else:
        bad = [p / "out.json" for p in bad] + [tmp_path]  # and a folder where the file should be
    flag = "--" + dest.replace("_", "-")
    for path in bad:
        code = cli.main(_argv(command, dest, str(path)))
        err = capsys.readouterr().err
        assert code == EXIT_EXECUTION, (path, err)
        first, *rest = err.splitlines()
        assert first.startswith(f"deepview-ci: error: cannot write {flag} {path}: "), err
        assert len(rest) == 1 and rest[0].startswith("  hint: "), err


@pytest.mark.subprocess
def test_run_to_proc_is_one_line_before_any_cell_runs(tmp_path: Path, write_matrix) -> None:  # type: ignore[no-untyped-def]
    matrix = write_matrix(models=[{"id": "m", "config": "llama"}], backends=[{"id": "b", "compile": "inductor"}])
    proc = run_cli("run", str(matrix), "--out", "/proc/x", timeout=120)
    assert proc.returncode == EXIT_EXECUTION, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 2, proc.stderr
    assert "deepview-ci: error: cannot write --out /proc/x: No such file or directory" in proc.stderr


def test_a_write_that_fails_later_is_one_line_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`diff` without --out writes next to RESULTS: a folder named diff.json there fails the write itself."""
    run = tmp_path / "run"
    save_results(sample_results(), run / "results.json")
    update_baseline(run / "results.json", tmp_path / "baseline.json")
    (run / "diff.json").mkdir()
    code = cli.main(["diff", str(run / "results.json"), "--baseline", str(tmp_path / "baseline.json")])
    err = capsys.readouterr().err
    assert code == EXIT_EXECUTION, err
    assert err.startswith(f"deepview-ci: error: cannot write {run / 'diff.json'}: "), err
    assert "Traceback" not in err


def test_outputs_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "r.md", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_every_help_screen_has_a_description() -> None:
    bare = [name for name, sp in _walk() if not name.startswith("_") and not (sp.description or "").strip()]
    assert not bare, f"commands whose --help has no description: {bare}"
