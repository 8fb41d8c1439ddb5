"""Cells: stable ids, include/exclude, select/skip globs, GitHub chunking and GITHUB_OUTPUT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ci_runner.config import load_matrix_text
from ci_runner.errors import ConfigError
from ci_runner.matrix import ATTEMPT_SEP, artifact_cell, artifact_name, chunk, expand, expand_json, find_cell, select
from tests.fixtures.matrices import matrix_text
from tests.fixtures.matrices import tiny_matrix_text as matrix

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)


def test_ids_are_model_at_backend_in_matrix_order() -> None:
    cells = expand(load_matrix_text(matrix()))
    assert [c.id for c in cells] == ["m0@b0", "m0@b1", "m1@b0", "m1@b1"]
    assert cells[0].modes == ("ops", "layers", "numerics")


def test_exclude_include_and_globs() -> None:
    m = load_matrix_text(matrix(3, 2, "exclude:\n  - {model: m1}\n  - {model: m2, backend: b0}\n"))
    assert [c.id for c in expand(m)] == ["m0@b0", "m0@b1", "m2@b1"]
    m = load_matrix_text(matrix(3, 2, "include:\n  - {backend: b1}\n"))
    assert [c.id for c in expand(m)] == ["m0@b1", "m1@b1", "m2@b1"]
    cells = expand(load_matrix_text(matrix(3, 2)))
    assert [c.id for c in select(cells, ["m1@*", "*@b0"], ["m0@*"])] == ["m1@b0", "m1@b1", "m2@b0"]


def test_per_entry_modes_timeout_inputs_and_options_override_defaults() -> None:
    text = matrix_text(
        modes=["ops"], timeout=50, inputs={"seq_len": 8}, options={"numerics": {"margin": 2, "percentile": 99}},
        models=[{"id": "a", "config": "llama", "modes": ["numerics"], "timeout": 7, "inputs": {"seq_len": 4},
                 "options": {"numerics": {"margin": 9}}},
                {"id": "b", "config": "llama"}],
        backends=[{"id": "x", "compile": "inductor", "options": {"numerics": {"percentile": 90}}}])
    a, b = expand(load_matrix_text(text))
    assert a.modes == ("numerics",) and a.timeout == 7 and a.inputs.seq_len == 4
    assert dict(a.options["numerics"]) == {"margin": 9, "percentile": 90}
    assert b.modes == ("ops",) and b.timeout == 50 and b.inputs.seq_len == 8
    assert dict(b.options["numerics"]) == {"margin": 2, "percentile": 90}


def test_chunking_at_256_and_failing_loudly_past_the_limit() -> None:
    cells = expand(load_matrix_text(matrix(30, 20)))  # 600 cells
    doc = expand_json(cells, max_jobs=1000)
    assert doc["count"] == 600 and doc["chunks"] == 3
    assert [len(m["include"]) for m in doc["matrix"]] == [256, 256, 88]
    with pytest.raises(ConfigError, match="600 cells, more than the limit of 512"):
        chunk(cells, max_jobs=512)
    with pytest.raises(ConfigError, match="outside 1..256"):
        chunk(cells, max_jobs=1000, chunk_size=300)


def test_the_backend_table_carries_runs_on_and_entries_carry_safe_artifact_names() -> None:
    text = matrix(1, 0) + "  - {id: v, compile: 'pkg.mod:fn', runs-on: [self-hosted, card]}\n  - {id: c, compile: inductor}\n"
    doc = expand_json(expand(load_matrix_text(text)), max_jobs=10)
    inc = doc["matrix"][0]["include"]
    backends = doc["backends"]
    assert [b["backend"] for b in backends] == ["v", "c"]
    assert backends[inc[0]["b"]]["runs-on"] == ["self-hosted", "card"] and backends[inc[1]["b"]]["runs-on"] == "ubuntu-latest"
    for entry in inc:
        assert set(entry) == {"cell", "artifact", "b", "minutes", "job-minutes"}
        assert not set('":<>|*?\\/') & set(entry["artifact"])
    assert artifact_name("a/b@c:d") == "deepview-cell-a_2fb_40c_3ad"


@pytest.mark.parametrize("a, b", [("a__b@c", "a@b__c"), ("a_b@c", "a@b_c"), ("x_40y@z", "x@y@z"), ("m@b", "m@b_")])
def test_two_cell_ids_that_used_to_escape_alike_get_different_artifact_names(a: str, b: str) -> None:
    assert artifact_name(a) != artifact_name(b)
    for cid in (a, b):  # and the name gives the id back (a prefix code: `_` always starts an escape)
        assert artifact_cell(artifact_name(cid) + ATTEMPT_SEP + "2") == (cid, 2)


def test_artifact_names_are_injective_over_many_ids() -> None:
    alphabet = "ab_@.-"  # the characters of the old collisions, plus the ones kept as they are
    ids = {"".join(alphabet[(n // len(alphabet) ** k) % len(alphabet)] for k in range(5)) for n in range(len(alphabet) ** 5)}
    names = {artifact_name(i) for i in ids}
    assert len(names) == len(ids) == 6 ** 5
    assert all(artifact_cell(artifact_name(i) + "-attempt-1") == (i, 1) for i in ids)
    assert artifact_cell("deepview-cell-a_zz-attempt-1") is None and artifact_cell("deepview-plan") is None
    assert artifact_cell("deepview-cell-m0_40b0-attempt-x") is None


def test_find_cell_suggests_close_ids() -> None:
    m = load_matrix_text(matrix())
    assert find_cell(m, "m1@b0").id == "m1@b0"
    with pytest.raises(ConfigError, match="did you mean .*m1@b0"):
        find_cell(m, "m1@bo")


def test_expand_cli_writes_github_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from ci_runner.cli import main

    mpath = tmp_path / "m.yaml"
    mpath.write_text(matrix(2, 2), encoding="utf-8")
    out = tmp_path / "gh_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(out))
    assert main(["expand", str(mpath)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["count"] == 4
    text = out.read_text(encoding="utf-8")
    assert "count=4" in text or "count<<" in text
    assert "m1@b1" in text
    assert main(["expand", str(mpath), "--max-jobs", "3"]) == 2
