"""`env`, progress output styles, usage errors: small CLI behaviours."""

from __future__ import annotations

import io
import json

import pytest

from ci_runner.cli import main
from ci_runner.log import OutputStyle, Progress
from tests.fixtures.matrices import matrix_text


def test_env_lists_versions_devices_and_the_sim_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] and report["transformers"] and report["python"]
    names = {b["name"] for b in report["backends"]}
    assert {"inductor", "aot_eager", "sim-subset", "sim-drift", "sim-crash", "sim-abort", "sim-segv", "sim-hang",
            "sim-decode", "sim-kvdrift", "sim-masknan", "sim-long", "sim-reuse", "simdev"} <= names
    assert "cpu" in report["devices"]
    assert main(["env"]) == 0
    assert "sim-subset (sim)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("env", "tty", "expect", "absent"),
    [
        ({}, True, ["[0/2] a@b: running", "[1/2] a@b: FAIL in 1.0s", "    boom"], ["::group::"]),
        ({"CI": "true"}, False, ["[1/2] a@b: FAIL in 1.0s"], ["::group::"]),
        ({"CI": "true", "GITHUB_ACTIONS": "true"}, False, ["::group::[1/2] a@b: FAIL in 1.0s", "boom", "::endgroup::"], ["running"]),
    ],
)
def test_progress_styles(env: dict, tty: bool, expect: list[str], absent: list[str]) -> None:
    buf = io.StringIO()
    style = OutputStyle.detect(env, buf)
    style = OutputStyle(github=style.github, ci=style.ci, tty=tty)
    p = Progress(2, style=style, stream=buf)
    p.cell_started("a@b")
    p.cell_finished("a@b", "fail", 1.0, "boom")
    p.cell_reused("c@d", "pass")
    out = buf.getvalue()
    for needle in expect:
        assert needle in out
    for needle in absent:
        assert needle not in out
    assert "[2/2] c@d: ok (finished earlier; --force reruns it)" in out


def test_usage_errors_exit_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--modes", "ops,bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown mode(s) bogus" in err and "Traceback" not in err
    assert main([]) == 2
    assert main(["baseline"]) == 2
    assert "baseline update" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("deepview-ci ")


def _options(parser, path=()):  # type: ignore[no-untyped-def]
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if not name.startswith("_"):  # internal commands stay unlisted
                    yield from _options(sub, path + (name,))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, action


def test_every_option_and_argument_has_help_text() -> None:
    from ci_runner.cli import build_parser

    found = list(_options(build_parser()))
    assert len(found) > 40  # the walk reaches every command, `baseline update` included
    missing = [" ".join(path) + " " + (action.option_strings[0] if action.option_strings else action.dest)
               for path, action in found if not (action.help or "").strip()]
    assert not missing, f"options without help text: {missing}"


def test_jobs_defaults_to_auto_and_says_so() -> None:
    from ci_runner.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["run"]).jobs == "auto"
    assert parser.parse_args(["run", "--jobs", "3"]).jobs == 3
    for bad in ("0", "many"):
        with pytest.raises(Exception, match="jobs"):
            parser.parse_args(["run", "--jobs", bad])


def test_auto_jobs_is_cores_over_a_cells_own_workers() -> None:
    from ci_runner.config import load_matrix_text
    from ci_runner.run.execute import auto_jobs, cell_workers
    from ci_runner.matrix import expand

    matrix = load_matrix_text(matrix_text(models=[{"id": "tiny", "hub": "x/y"}], backends=[
        {"id": "a", "compile": "inductor", "modes": ["ops"]}, {"id": "b", "compile": "inductor", "modes": ["numerics"]},
        {"id": "c", "compile": "inductor", "modes": ["ops", "layers"], "options": {"ops": {"workers": 3}}}]))
    cells = {c.backend.id: c for c in expand(matrix)}
    assert [cell_workers(cells[b], 2) for b in "abc"] == [2, 1, 2]  # capped at the cores there are
    assert [cell_workers(cells[b], 8) for b in "abc"] == [2, 1, 3]
    assert cell_workers(cells["b"], 8, modes=("ops",)) == 2  # --modes overrides the cell's
    assert cell_workers(cells["a"], 1) == 1
    assert auto_jobs([cells["a"]], 2) == 1 and auto_jobs([cells["a"]], 16) == 8
    assert auto_jobs(list(cells.values()), 2) == 2  # numerics-only cells share the two cores
    assert auto_jobs([], 1) == 1


def test_diff_prints_three_lines_and_writes_the_markdown(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    from ci_runner.results.baseline import update_baseline
    from ci_runner.results.model import save_results
    from tests.fixtures import results_factory as rf

    base = save_results(rf.sample_results(), tmp_path / "base" / "results.json")
    update_baseline(base, tmp_path / "baseline.json")
    now = rf.sample_results()
    now.cells[0] = rf.crashed_cell(now.cells[0].model, now.cells[0].backend)  # one regression
    run = save_results(now, tmp_path / "run" / "results.json")
    code = main(["diff", str(run), "--baseline", str(tmp_path / "baseline.json"), "--out", str(tmp_path / "d")])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1 and len(lines) == 3, lines
    assert lines[0].startswith(f"diff against {tmp_path / 'baseline.json'}: 1 regressed, ")
    assert lines[1] == "--fail-on regression: fails (exit 1)"
    assert lines[2] == f"written: {tmp_path / 'd' / 'diff.md'} (the tables, with repros), {tmp_path / 'd' / 'diff.json'}"
    assert "| cell | what | reason | repro |" in (tmp_path / "d" / "diff.md").read_text(encoding="utf-8")


def test_cells_and_expand_list_print_the_cell_ids(capsys: pytest.CaptureFixture[str]) -> None:
    from ci_runner.config import load_matrix
    from ci_runner.matrix import expand

    ids = [c.id for c in expand(load_matrix(None))]
    assert main(["cells"]) == 0
    assert capsys.readouterr().out.splitlines() == ids
    assert main(["cells", "--select", "*@sim-drift"]) == 0
    assert capsys.readouterr().out.splitlines() == [i for i in ids if i.endswith("@sim-drift")]
    from importlib.resources import files

    assert main(["expand", str(files("ci_runner") / "data" / "example.yaml"), "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == ids


def test_progress_lines_end_with_the_time_left_from_the_expected_costs() -> None:
    buf = io.StringIO()
    p = Progress(3, style=OutputStyle(github=False, ci=True, tty=False), stream=buf)
    p.expect({"a@b": 1.0, "c@b": 1.0, "d@b": 2.0}, width=1)
    p.cell_finished("a@b", "pass", 10.0)  # 10 s per unit of cost; 3 units left
    p.cell_finished("c@b", "fail", 30.0)  # 20 s per unit; 2 left
    p.cell_finished("d@b", "pass", 40.0)  # the last: nothing left
    assert buf.getvalue().splitlines() == ["[1/3] a@b: ok in 10.0s · about 30s left",
                                           "[2/3] c@b: FAIL in 30.0s · about 40s left",
                                           "[3/3] d@b: ok in 40.0s"]
    wide = Progress(3, style=OutputStyle(github=False, ci=True, tty=False), stream=io.StringIO())
    wide.expect({"a@b": 1.0, "c@b": 200.0}, width=2)
    wide.cell_finished("a@b", "pass", 2.0)
    assert wide.stream.getvalue().strip().endswith("· about 3m20s left")  # type: ignore[attr-defined]


def test_run_exit_code_says_environment_when_only_loads_failed() -> None:
    """README's exit codes: 4 when every cell that did not pass could not load its model or backend (a Hub id
    that does not exist, a plugin that does not import); 1 as soon as one cell has something else to say."""
    from ci_runner.cli import _run_exit
    from ci_runner.results.model import CellError, CellResult

    def cell(status: str, error: str | None = None) -> CellResult:
        return CellResult(id=f"m@{status}{error}", model="m", backend="b", status=status, duration_s=1.0,
                          error=CellError(type=error, message="x") if error else None)

    assert _run_exit([cell("pass"), cell("skipped")]) == 0
    assert _run_exit([cell("pass"), cell("error", "model_load"), cell("error", "backend_setup")]) == 4
    assert _run_exit([cell("error", "model_load"), cell("fail")]) == 1
    assert _run_exit([cell("error", "model_load"), cell("error", "RuntimeError")]) == 1
    assert _run_exit([cell("timeout", "timeout")]) == 1
    assert _run_exit([cell("error", "layout"), cell("error", "model_load")]) == 2  # the matrix first
