"""`deepview-ci init` (issue 48): a commented starter matrix that loads and expands, never written over an existing
file without --force; and `run`/`cells` with no MATRIX use ./deepview.yaml when it exists, else the bundled example."""

from __future__ import annotations

import json
import re

import yaml

from ci_runner.config import load_matrix, load_matrix_text
from ci_runner.starter import LOCAL_MATRIX, local_matrix, starter_matrix, write_starter
from ci_runner.errors import ConfigError
from ci_runner.matrix import expand
from tests.fixtures.paths import ROOT

CELLS = ["tiny-llama@inductor", "tiny-llama@sim-subset", "tiny-vit@inductor", "tiny-vit@sim-subset"]


def test_init_writes_a_starter_that_expands_and_never_overwrites(tmp_path, cli):
    res = cli("init", cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr
    path = tmp_path / LOCAL_MATRIX
    assert path.read_text(encoding="utf-8") == starter_matrix() and "deepview-ci expand deepview.yaml" in res.stdout
    plan = cli("expand", LOCAL_MATRIX, cwd=tmp_path, timeout=120)
    assert plan.returncode == 0, plan.stderr
    assert sorted(e["cell"] for m in json.loads(plan.stdout)["matrix"] for e in m["include"]) == CELLS
    path.write_text("version: 1  # mine\n", encoding="utf-8")
    again = cli("init", cwd=tmp_path, timeout=60)
    assert again.returncode == 2 and "already exists; not overwritten" in again.stderr and "--force" in again.stderr
    assert "Traceback" not in again.stderr and path.read_text() == "version: 1  # mine\n"
    forced = cli("init", "--force", cwd=tmp_path, timeout=60)
    assert forced.returncode == 0 and path.read_text(encoding="utf-8") == starter_matrix()
    other = cli("init", "sub/vendor.yaml", cwd=tmp_path, timeout=60)
    assert other.returncode == 0 and "deepview-ci run sub/vendor.yaml" in other.stdout
    assert [c.id for c in expand(load_matrix(tmp_path / "sub" / "vendor.yaml"))] == CELLS


def test_what_the_starter_shows_commented_out_is_valid_when_uncommented():
    text = starter_matrix()
    shown = [line for line in text.splitlines() if re.match(r"\s*# (phases|parallel):", line)]
    assert len(shown) == 2
    for line in shown:
        on = load_matrix_text(text.replace(line, line.replace("# ", "", 1)), path="starter.yaml")
        assert [c.id for c in expand(on)] == CELLS
    phases = load_matrix_text(text.replace(shown[0], shown[0].replace("# ", "", 1)), path="starter.yaml")
    assert [p.name for p in expand(phases)[0].inputs.workload()] == ["prefill", "decode", "batch", "long"]


def test_the_starter_is_the_readme_matrix():
    """The README's matrix and the starter are one matrix: the starter only adds comments."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"cat > matrix.yaml <<'YAML'\n(.*?)^YAML$", readme, flags=re.S | re.M)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == yaml.safe_load(starter_matrix())


def test_write_starter_refuses_a_folder_and_an_existing_file(tmp_path):
    (tmp_path / "d").mkdir()
    for target in (tmp_path / "d",):
        try:
            write_starter(target)
        except ConfigError as exc:
            assert "is a folder" in exc.message
        else:
            raise AssertionError("wrote over a folder")
    assert write_starter(tmp_path / "m.yaml").is_file()
    try:
        write_starter(tmp_path / "m.yaml")
    except ConfigError as exc:
        assert "already exists" in exc.message
    else:
        raise AssertionError("overwrote without force")


def test_run_and_cells_with_no_matrix_use_the_local_deepview_yaml(tmp_path, cli):
    assert local_matrix(tmp_path) is None
    write_starter(tmp_path / LOCAL_MATRIX)
    assert local_matrix(tmp_path) == tmp_path / LOCAL_MATRIX
    listed = cli("cells", cwd=tmp_path, timeout=60)
    assert listed.returncode == 0 and listed.stdout.split() == CELLS
    # `run` with no MATRIX: one line naming the file, then that matrix (a --select matching none of its cells stops
    # it before any cell runs: the error names the file it loaded)
    ran = cli("run", "--select", "no-such-cell", "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=120)
    assert ran.returncode == 2
    assert f"deepview-ci: no MATRIX given: running ./{LOCAL_MATRIX}" in ran.stderr
    assert f"{tmp_path / LOCAL_MATRIX}: no cell matches" in ran.stderr
    (tmp_path / LOCAL_MATRIX).unlink()
    bundled = cli("run", "--select", "no-such-cell", "--out", str(tmp_path / "out"), cwd=tmp_path, timeout=120)
    assert bundled.returncode == 2 and "running the bundled example" in bundled.stderr
    assert "example.yaml: no cell matches" in bundled.stderr
