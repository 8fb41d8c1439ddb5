"""`deepview-ci dump` and `compare` as a user runs them: each side dumped by its own process with its own
settings (as on two machines), then compared offline; plus the schema and input gates through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ci_runner import errors
from ci_runner.cli import main
from tests.fixtures.cli import run_cli as cli
from tests.fixtures.matrices import REFERENCES, matrix_text


MATRIX = matrix_text(
    inputs={"seq_len": 8, "samples": 2}, references=REFERENCES,
    models=[{"id": "tiny-llama", "config": "llama",
             "overrides": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}},
            {"id": "net", "factory": "tests.fixtures.plugin_toolbox_models:base"},
            {"id": "net-reshaped", "factory": "tests.fixtures.plugin_toolbox_models:reshaped"}],
    backends=[{"id": "eager", "device": "cpu"},
              {"id": "silu-off", "compile": "tests.fixtures.plugin_toolbox_perturb:make",
               "backend_options": {"op": "aten.silu.default", "scale": 0.2}, "env": {"OMP_NUM_THREADS": "1"}}],
)


@pytest.fixture()
def matrix(tmp_path: Path) -> Path:
    p = tmp_path / "matrix.yaml"
    p.write_text(MATRIX, encoding="utf-8")
    return p


@pytest.mark.slow
def test_two_processes_dump_and_compare_finds_the_injected_divergence(tmp_path: Path, matrix: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ref = tmp_path / "ref"
    tgt = tmp_path / "tgt"
    # the "reference runner": float64, eager, two threads
    p1 = cli("dump", "--matrix", str(matrix), "--model", "tiny-llama", "--reference", "cpu-fp64", "--out", str(ref),
             env={"OMP_NUM_THREADS": "2"})
    assert p1.returncode == 0, p1.stderr
    assert "reference cpu-fp64 on cpu float64 (eager)" in p1.stdout
    # the "accelerator runner": float32, compiled by a backend whose SiLU kernel is 20 % off, one thread
    p2 = cli("dump", "--matrix", str(matrix), "--model", "tiny-llama", "--backend", "silu-off", "--out", str(tgt),
             env={"OMP_NUM_THREADS": "1"})
    assert p2.returncode == 0, p2.stderr
    m_ref = json.loads((ref / "manifest.json").read_text())
    m_tgt = json.loads((tgt / "manifest.json").read_text())
    assert m_ref["env"]["host"] and m_ref["side"]["dtype"] == "float64" and m_tgt["side"]["capture"] == "compiled"
    assert m_ref["input"]["hash"] == m_tgt["input"]["hash"]

    out_json = tmp_path / "cmp.json"
    capsys.readouterr()
    assert main(["compare", str(ref), str(tgt), "--json", str(out_json)]) == errors.EXIT_FINDINGS
    text = capsys.readouterr().out
    assert "inputs: identical" in text and "schema: ok" in text
    assert "first divergent layer: model.layers.0.mlp.act_fn (SiLUActivation)" in text
    doc = json.loads(out_json.read_text())
    assert doc["first_divergent"] == "model.layers.0.mlp.act_fn"
    rows = {r["name"]: r for r in doc["layers"]}
    assert rows["model.layers.0.mlp.gate_proj"]["severity"] in ("exact", "close")
    assert rows["model.layers.0.mlp.act_fn"]["severity"] in ("diverged", "broken")
    assert rows["(root)[logits]"]["flagged"]

    # the same model on another input (sample 1): the comparison stops before any layer
    tgt1 = tmp_path / "tgt-sample1"
    assert main(["dump", "--matrix", str(matrix), "--model", "tiny-llama", "--backend", "eager", "--sample", "1",
                 "--out", str(tgt1)]) == 0
    capsys.readouterr()
    assert main(["compare", str(ref), str(tgt1)]) == errors.EXIT_INPUT
    out, err = capsys.readouterr()
    assert "inputs differ" in err and "has shape [1, 8] in the reference and [1, 6]" in err
    assert "same --sample" in err and "layer " not in out


def test_compare_shows_the_schema_diff_before_any_number(tmp_path: Path, matrix: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    ref, res = tmp_path / "ref", tmp_path / "res"
    assert main(["dump", "--matrix", str(matrix), "--model", "net", "--out", str(ref)]) == 0
    assert main(["dump", "--matrix", str(matrix), "--model", "net-reshaped", "--out", str(res)]) == 0
    capsys.readouterr()
    assert main(["compare", str(ref), str(res)]) == errors.EXIT_FINDINGS
    out = capsys.readouterr().out
    assert "schema: DIFFERS" in out
    assert out.index("shape mismatch:") < out.index("block.fc1: [2, 5, 16] vs [2, 5, 12]") < out.index("layer ")
    assert "\nblock.fc1 " not in out, "no numbers for a reshaped tensor"


def test_compare_refuses_a_dump_cut_short(tmp_path: Path, matrix: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = tmp_path / "ref"
    assert main(["dump", "--matrix", str(matrix), "--model", "net", "--out", str(ref)]) == 0
    half = tmp_path / "half"
    half.mkdir()
    (half / "layers-00000.safetensors").write_bytes(b"\0" * 8)
    capsys.readouterr()
    assert main(["compare", str(ref), str(half)]) == errors.EXIT_INPUT
    err = capsys.readouterr().err
    assert "half/manifest.json: missing" in err and "hint:" in err
    assert main(["dump", "--matrix", str(matrix), "--model", "nope", "--out", str(tmp_path / "x")]) == errors.EXIT_USAGE
