"""`inputs.phases`: the matrix spelling, its checks at load, and what a cell resolves it to."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci_runner.config import InputSpec, load_matrix
from ci_runner.errors import ConfigError
from ci_runner.matrix import expand
from ci_runner.workloads.phases import Phase, check_phases, default_batch_lengths, parse_phases

HEAD = "version: 1\ndefaults:\n  inputs: {seq_len: 12, phases: %s}\nmodels:\n  - {id: m, config: llama}\n"
BACKENDS = "backends:\n  - {id: b, compile: aot_eager}\n"


def _load(tmp_path: Path, phases: str, backends: str = BACKENDS) -> object:
    path = tmp_path / "m.yaml"
    path.write_text(HEAD % phases + backends)
    return load_matrix(path)


def test_the_issue_spelling_parses_with_defaults() -> None:
    raw = ["prefill", {"decode": {"steps": 8}}, {"batch": {"lengths": [16, 11, 7, 3], "padding": "left"}},
           {"long": {"seq_len": [512, 2048]}}]
    assert check_phases(raw) == []
    got = parse_phases(raw, seq_len=32)
    assert [p.name for p in got] == ["prefill", "decode", "batch", "long"]
    assert got[1] == Phase(name="decode", steps=8, cache="static")
    assert got[2].lengths == (16, 11, 7, 3) and got[2].padding == "left"
    assert got[3].lengths == (512, 2048)
    assert parse_phases(["batch", "decode"], seq_len=12)[0].lengths == default_batch_lengths(12) == (12, 8, 4, 2)
    assert parse_phases(["decode"], seq_len=12)[0].steps == 8


@pytest.mark.parametrize("phases, where, text, hint", [
    ("[prefil]", "phases[0]", "unknown phase 'prefil'", "did you mean 'prefill'?"),
    ("[{decode: {stpes: 2}}]", "phases[0]", "unknown option 'stpes'", "did you mean 'steps'?"),
    ("[{decode: {steps: 0}}]", "phases[0]", "decode.steps: 0 is not", "steps"),
    ("[{batch: {padding: middle}}]", "phases[0]", "padding: 'middle' is not one of left, right", "padding"),
    ("[{long: {seq_len: []}}]", "phases[0]", "not a non-empty list", "seq_len"),
    ("[prefill, prefill]", "phases[1]", "listed twice", "once"),
])
def test_mistakes_are_one_error_with_place_and_fix(tmp_path: Path, phases: str, where: str, text: str,
                                                   hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, phases)
    message = str(err.value)
    assert f"m.yaml:3:" in message and f"defaults.inputs.{where}" in message and text in message
    assert hint in (err.value.hint or "")


def test_a_backend_sets_phases_over_the_defaults(tmp_path: Path) -> None:
    backends = "backends:\n  - {id: b, compile: aot_eager}\n  - {id: c, compile: aot_eager, inputs: {phases: [batch]}}\n"
    cells = {c.id: c for c in expand(_load(tmp_path, "[prefill]", backends))}
    assert cells["m@b"].inputs.workload()[0].name == "prefill"
    assert [p.name for p in cells["m@c"].inputs.workload()] == ["batch"]
    assert cells["m@c"].inputs.seq_len == 12


def test_no_phases_keeps_the_inputs_key_as_it_was() -> None:
    plain = InputSpec(seq_len=16)
    assert "phases" not in plain.key() and plain.workload() == ()
    assert InputSpec(seq_len=16, phases=("prefill",)).key()["phases"] == ["prefill"]


def test_the_bundled_example_has_no_phases(example_matrix: object) -> None:
    assert all(not c.inputs.phases for c in expand(example_matrix))
