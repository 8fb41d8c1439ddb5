"""Zoo: matrix select/exclude errors, left-out records, the results.json `zoo` section and its reports."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from ci_runner.config import load_matrix
from ci_runner.errors import ConfigError
from ci_runner.report.html import render_html
from ci_runner.report.summary import render_summary
from ci_runner.results.model import Results, load_results, save_results
from ci_runner.zoo.report import group_reasons, zoo_section

pytest.importorskip("transformers")

ZOO = """version: 1
models:
  - id: zoo
    zoo: transformers
    select: [llama, "qwen2*"]
    exclude: [{exclude}]
backends:
  - id: aot_eager
    compile: aot_eager
"""


def test_zoo_entry_expands_to_one_model_per_architecture(write_matrix: Callable[..., Path]) -> None:
    m = load_matrix(write_matrix(ZOO.format(exclude="qwen2_vl")))
    ids = [s.id for s in m.models]
    assert "llama" in ids and "qwen2" in ids and "qwen2_moe" in ids and "qwen2_vl" not in ids
    spec = m.model("llama")
    assert (spec.zoo, spec.config, spec.zoo_entry, spec.source) == ("transformers", "llama", "zoo",
                                                                     "zoo:transformers/llama")


@pytest.mark.parametrize(("text", "where", "hint"), [
    (ZOO.format(exclude="qwen2_vll"), "matrix.yaml:6:15: models[0].exclude[0]", "did you mean 'qwen2_vl'"),
    (ZOO.format(exclude="llama").replace('"qwen2*"', '"no_such_arch*"'), "matrix.yaml:5:21: models[0].select[1]",
     "glob"),
    (ZOO.format(exclude="llama").replace("    zoo: transformers\n", "    config: llama\n"), "models[0]",
     "zoo: transformers"),
], ids=["exclude-typo", "select-glob", "select-without-zoo"])
def test_select_exclude_errors_name_the_file_and_place(write_matrix: Callable[..., Path], text: str, where: str,
                                                        hint: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_matrix(write_matrix(text))
    assert where in err.value.message and hint in (err.value.hint or "")


def _record(backend: str, status: dict[str, str]) -> dict[str, Any]:
    table = [{"key": k, "op": f"aten.{k}.default", "signature": f"aten.{k}.default(f32[2])", "status": s,
              "models": ["llama", "mamba"] if k == "add" else ["llama"]} for k, s in status.items()]
    return {"backend": backend, "level": "aten", "architectures": ["llama", "mamba", "bark"],
            "scanned": ["llama", "mamba"], "families": {"llama": "decoder", "mamba": "SSM/hybrid", "bark": "audio"},
            "left_out": {"bark": {"stage": "inputs", "reason": "the model config has no vocab_size"}},
            "pairs": 3, "distinct": 2, "table": table}


def test_zoo_section_schema_and_reports(tmp_path: Path) -> None:
    zoo = zoo_section([_record("aot_eager", {"add": "pass", "mul": "pass"}),
                       _record("sim-fail", {"add": "fail", "mul": "inconclusive"}),
                       _record("sim-big", {"add": "pass", "mul": "inconclusive"})])
    assert zoo["scanned"] == ["llama", "mamba"] and zoo["left_out"] == {"bark": "inputs: the model config has no vocab_size"}
    assert zoo["signatures"]["sim-fail"] == 2 and zoo["pairs"] == {"aot_eager": 3, "sim-fail": 3, "sim-big": 3}
    assert zoo["probed"] == {"aot_eager": 2, "sim-fail": 2, "sim-big": 2}
    # a signature without a verdict (not run: inputs over ops.max_probe_input_mb) is no full support, nor a lack
    big = zoo["backends"]["sim-big"]
    assert big["supported"] == ["mamba"] and big["lacks"] == {} and big["inconclusive"] == {"llama": ["aten.mul.default"]}
    sim = zoo["backends"]["sim-fail"]
    assert sim["supported"] == [] and sim["lacks"] == {"llama": ["aten.add.default"], "mamba": ["aten.add.default"]}
    assert sim["ranked"] == [{"op": "aten.add.default", "models": ["llama", "mamba"], "signatures": 1}]
    assert zoo["backends"]["aot_eager"]["supported"] == ["llama", "mamba"]
    assert {r["op"]: r["status"] for r in zoo["cross"]}["aten.mul.default"] == {
        "aot_eager": "pass", "sim-fail": "inconclusive", "sim-big": "inconclusive"}
    path = save_results(Results(zoo=zoo), tmp_path / "results.json")  # validated against the schema on load
    assert load_results(path).zoo == json.loads(path.read_text())["zoo"]
    page = render_html(Results(zoo=zoo))
    assert 'id="zoo-cross"' in page and "zoo-filter" in page and "<script src" not in page
    assert "SSM/hybrid" in page and "fully supported" in page
    md = render_summary(Results(zoo=zoo))
    assert "### Zoo: 2 of 3 architectures scanned" in md and "| `sim-fail` | 0 of 2 | 3 | 2 | 2 | `aten.add.default` (2) |" in md


def test_left_out_reasons_grouped() -> None:
    groups = group_reasons({
        "a": {"stage": "build", "reason": "ValueError: embed_dim must be divisible by num_heads (got 96 and 5)"},
        "b": {"stage": "build", "reason": "ValueError: embed_dim must be divisible by num_heads (got 64 and 3)"},
        "c": {"stage": "inputs", "reason": "c: the forward requires 'bbox'"},
    })
    assert [(g["stage"], g["models"]) for g in groups] == [("build", ["a", "b"]), ("inputs", ["c"])]


def test_scan_one_lists_an_architecture_it_cannot_feed() -> None:
    from ci_runner.config import InputSpec
    from ci_runner.zoo.scan import scan_one

    rec = scan_one("decision_transformer", level="aten", device="cpu", inputs=InputSpec(seq_len=8, samples=1))
    assert "inventory" not in rec and rec["left_out"]["stage"] == "inputs"
    assert "'states'" in rec["left_out"]["reason"] and rec["family"] and rec["tried"] == {}
