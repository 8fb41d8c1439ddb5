"""Backend mistakes are found at load, all at once, before any cell runs (`ci_runner/backends/check.py`): `expand`,
`run`, `cell` and `dump` alike, exit 2 with file:line:col and a did-you-mean; a plugin that crashes on import is
checked in a child and cannot crash the run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ci_runner import cli
from ci_runner.backends.check import SIM_OPTIONS, static_problems
from ci_runner.config import BackendSpec
from ci_runner.errors import EXIT_USAGE

BAD = """\
version: 1
models:
  - {id: m0, config: llama}
backends:
  - {id: b0, compile: inductr}
  - id: b1
    compile: sim-drift
    backend_options: {dtpye: float16}
  - id: b2
    compile: inductor
    compile_options: {fulgraph: true}
  - id: b3
    compile: tests.fixtures.plugin_compiler:nope
  - id: b4
    import: [tests.fixtures.plugin_compilr]
    compile: test-plugin
  - id: b5
    compile: tests.fixtures.plugin_compiler:make
    backend_options: {tga: x}
  - id: b6
    import: [ci_runner.sim.simccl]
    device: simdev
    process_group: simcl
  - {id: ok, compile: inductor}
"""
EXPECTED = [  # (line:col, text, did-you-mean)
    ("5:23", "backends[0].compile (backend 'b0'): unknown torch.compile backend 'inductr'", "'inductor'"),
    ("8:23", "backends[1].backend_options.dtpye (backend 'b1'): unknown sim-drift option 'dtpye'", "'dtype'"),
    ("11:23", "backends[2].compile_options.fulgraph (backend 'b2'): unknown compile_options key 'fulgraph'", "'fullgraph'"),
    ("13:14", "backends[3].compile (backend 'b3'): 'tests.fixtures.plugin_compiler' has no attribute 'nope'", None),
    ("15:14", "backends[4].import[0] (backend 'b4'): module 'tests.fixtures.plugin_compilr' not found", None),
    ("19:23", "backends[5].backend_options.tga (backend 'b5'): unknown option 'tga'", "'tag'"),
    # known to c10d once the backend's plugin (its `import:`) registered it: the names listed then
    ("23:20", "backends[6].process_group (backend 'b6'): unknown c10d backend 'simcl' (process_group)", "'simccl'"),
]


@pytest.fixture
def bad_matrix(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD, encoding="utf-8")
    return path


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert "Traceback" not in err
    return err


@pytest.mark.subprocess
def test_expand_and_run_list_every_backend_mistake_before_any_cell(bad_matrix: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["expand", str(bad_matrix)], ["run", str(bad_matrix), "--out", str(tmp_path / "out")]):
        err = _error(argv, capsys)
        expected = [e for e in EXPECTED if argv[0] == "run" or "not found" not in e[1]]  # expand: see the next test
        assert f"{bad_matrix}: {len(expected)} problems in the matrix:" in err, err
        lines = err.splitlines()
        for place, text, close in expected:
            [i] = [i for i, ln in enumerate(lines) if ln.strip().startswith(f"{bad_matrix}:{place}: {text}")] or [err]
            if close:
                assert f"did you mean {close}" in lines[i + 1], lines[i + 1]
        assert "'ok'" not in err
    assert not (tmp_path / "out" / "cells").exists()  # no cell started


@pytest.mark.subprocess
def test_cell_and_dump_check_their_backend(bad_matrix: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(["cell", "m0@b0", "--matrix", str(bad_matrix), "--out", str(tmp_path / "o")], capsys)
    assert err.startswith(f"deepview-ci: error: {bad_matrix}:5:23: backends[0].compile (backend 'b0'): unknown "
                          "torch.compile backend 'inductr'\n  hint: did you mean 'inductor'?"), err
    err = _error(["dump", "--matrix", str(bad_matrix), "--model", "m0", "--backend", "b2", "--out", str(tmp_path / "d")],
                 capsys)
    assert f"{bad_matrix}:11:23: backends[2].compile_options.fulgraph" in err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


@pytest.mark.subprocess
def test_expand_accepts_a_plugin_not_installed_where_the_plan_runs(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The plan job lacks the vendor's packages (its cells install them): `expand` lets a missing module pass,
    `run` here cannot."""
    path = tmp_path / "m.yaml"
    path.write_text("version: 1\nmodels: [{id: m, config: llama}]\n"
                    "backends: [{id: v, import: [vendor_pkg_not_here], compile: vendor_backend}]\n", encoding="utf-8")
    assert cli.main(["expand", str(path)]) == 0
    capsys.readouterr()
    err = _error(["run", str(path), "--out", str(tmp_path / "o")], capsys)
    assert "backends[0].import[0] (backend 'v'): module 'vendor_pkg_not_here' not found" in err


def _expand_with_plugin(tmp_path: Path, capsys: pytest.CaptureFixture[str], plugin: str, v_backend: str,
                        import_limit: float | None = None) -> tuple[str, float]:
    """`expand` of a matrix whose backend `v` ({v_backend}) uses `plugin_v.py` (text `plugin`) and whose backend `w`
    after it has a typo; exit 2 expected. Returns stderr and the seconds it took."""
    (tmp_path / "plugin_v.py").write_text(plugin, encoding="utf-8")
    path = tmp_path / "m.yaml"
    path.write_text("version: 1\nmodels: [{id: m, config: llama}]\n"
                    f"backends: [{{id: v, {v_backend}}},\n"
                    "           {id: w, import: [json], compile: inductorr}]\n", encoding="utf-8")
    monkey = pytest.MonkeyPatch()
    monkey.syspath_prepend(str(tmp_path))
    monkey.setenv("PYTHONPATH", f"{tmp_path}:{Path.cwd()}")
    if import_limit is not None:
        monkey.setattr("ci_runner.backends.check.IMPORT_LIMIT_S", import_limit)
    t0 = time.monotonic()
    try:
        assert cli.main(["expand", str(path), "--out", str(tmp_path / "plan.json")]) == EXIT_USAGE
    finally:
        monkey.undo()
    return capsys.readouterr().err, time.monotonic() - t0


@pytest.mark.subprocess
def test_a_plugin_that_crashes_on_import_cannot_crash_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The child that aborts in `v`'s import is replaced: `w` (after it) is still checked."""
    err, _ = _expand_with_plugin(tmp_path, capsys, "import os\nos.abort()\n", "import: [plugin_v], compile: inductor")
    assert ":4:45: backends[1].compile (backend 'w'): unknown torch.compile backend 'inductorr'" in err, err
    assert ("deepview-ci: note: backend 'v' was not checked at load (the check crashed (SIGABRT) in its imports); "
            "its cells will say what is wrong") in err, err


@pytest.mark.subprocess
def test_a_plugin_that_hangs_on_import_costs_its_limit_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plugin is both the backend's `import:` and its `compile: module:callable`: cut at the limit in the first,
    it is not imported again (where no timer is left), and `w` after it is still checked."""
    err, seconds = _expand_with_plugin(
        tmp_path, capsys, "import time\ntime.sleep(3600)\n\ndef backend(gm, example_inputs):\n    return gm\n",
        "import: [plugin_v], compile: 'plugin_v:backend'", import_limit=2.0)
    assert seconds < 50  # the child's start, 2 s for `v`, `w`: not the whole check's timeout
    assert "backends[1].compile (backend 'w'): unknown torch.compile backend 'inductorr'" in err, err
    assert "backend 'v' was not checked at load (its imports took over 2 s)" in err, err


def test_static_checks_need_no_import_and_match_the_sim_table() -> None:
    from ci_runner.sim import SIM_BACKENDS

    assert {n: (tuple(i.options) if i.factory else None) for n, i in SIM_BACKENDS.items()} == dict(SIM_OPTIONS)
    spec = BackendSpec(id="x", compile="inductor", backend_options={"a": 1})
    [p] = static_problems(0, spec)
    assert p.where == ("backend_options",) and "not used by registered backend 'inductor'" in p.message
    [p] = static_problems(0, BackendSpec(id="x", device="simdev", backend_options={"dny": ["rsqrt"]}))
    assert p.where == ("backend_options", "dny") and "did you mean 'deny'" in str(p.hint)
    [p] = static_problems(0, BackendSpec(id="x", compile="simdev"))
    assert "is a device, not a compiler" in p.message
    assert not static_problems(0, BackendSpec(id="x", compile="sim-subset", device="simdev",
                                              backend_options={"extra_allow": ["a"], "simdev": {"deny": []}}))


@pytest.mark.subprocess
def test_schema_option_phase_and_backend_mistakes_in_one_error(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """A matrix with one mistake of each kind: `expand` lists every one in a single error (exit 2); a backend the
    schema rejected is named by the schema only, one with an unknown key beside its entries is still checked."""
    path = tmp_path / "m.yaml"
    path.write_text("version: 1\n"
                    "defaults:\n  inputs: {phases: [prefil]}\n"
                    "models:\n  - {id: m0, config: llama, colour: red, options: {ops: {wrkers: 2}}}\n"
                    "backends:\n"
                    "  - {id: b0, compile: inductr}\n"
                    "  - {id: b1, compile: sim-drift, backend_options: {dtpye: float16}, extra: 1}\n"
                    "  - {id: b2, compile: 5}\n", encoding="utf-8")
    err = _error(["expand", str(path), "--out", str(tmp_path / "plan.json")], capsys)
    assert err.startswith(f"deepview-ci: error: {path}: 7 problems in the matrix:\n"), err
    for line, close in ((f"{path}:5:29: models[0].colour: unknown key 'colour'", None),
                        (f"{path}:8:69: backends[1].extra: unknown key 'extra'", None),
                        (f"{path}:9:23: backends[2].compile: 5 is not of type 'string'", None),
                        (f"{path}:5:58: models[0].options.ops: unknown option 'wrkers'", "'workers'"),
                        (f"{path}:3:21: defaults.inputs.phases[0]: unknown phase 'prefil'", "'prefill'"),
                        (f"{path}:7:23: backends[0].compile (backend 'b0'): unknown torch.compile backend 'inductr'",
                         "'inductor'"),
                        (f"{path}:8:52: backends[1].backend_options.dtpye (backend 'b1'): unknown sim-drift option "
                         "'dtpye'", "'dtype'")):
        lines = err.splitlines()
        [i] = [i for i, ln in enumerate(lines) if ln == f"  {line}"] or [err]
        if close:
            assert f"did you mean {close}" in lines[i + 1], lines[i + 1]
    assert "backend 'b2'" not in err and "Traceback" not in err
    assert not (tmp_path / "plan.json").exists()


def test_zoo_probe_and_cells_check_their_backend(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`zoo probe|cells --backend ID` check that backend as `run` does, before any probe."""
    path = tmp_path / "z.yaml"
    path.write_text("version: 1\nmodels: [{id: zoo, zoo: transformers, select: [llama]}]\n"
                    "backends: [{id: b1, compile: sim-drift, backend_options: {dtpye: float16}}]\n", encoding="utf-8")
    for sub in ("probe", "cells"):
        err = _error(["zoo", sub, str(path), "--backend", "b1", "--out", str(tmp_path / sub)], capsys)
        assert err.startswith(f"deepview-ci: error: {path}:3:59: backends[0].backend_options.dtpye (backend 'b1'): "
                              "unknown sim-drift option 'dtpye'\n  hint: did you mean 'dtype'?"), err
        assert not (tmp_path / sub).exists() or not any((tmp_path / sub).rglob("*.json"))
