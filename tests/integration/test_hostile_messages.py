"""One undecodable compiler message (lone surrogates, as a compiler's badly decoded bytes give) costs only its own
finding's text: the ops and layers modes still report every failing op and layer (issue 46; about 2 minutes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest

MATRIX = """\
version: 1
defaults: {modes: [ops, layers], timeout: 600}
models:
  - id: tl
    config: llama
    overrides: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 1, num_attention_heads: 4,
                num_key_value_heads: 2, vocab_size: 128, max_position_embeddings: 128}
backends:
  - {id: surr, compile: "tests.fixtures.plugin_surrogate:surrogate_backend"}
"""


@pytest.mark.slow
def test_lone_surrogates_in_one_op_error_keep_every_finding(tmp_path: Path,
                                                             cli: Callable[..., CompletedProcess[str]]) -> None:
    (tmp_path / "m.yaml").write_text(MATRIX, encoding="utf-8")
    proc = cli("run", str(tmp_path / "m.yaml"), "--out", str(tmp_path / "out"), "--jobs", "1", timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # findings, not an error
    cell = json.loads((tmp_path / "out" / "report" / "results.json").read_text(encoding="utf-8"))["cells"][0]
    ops, layers = cell["modes"]["ops"], cell["modes"]["layers"]
    assert ops["status"] == "fail" and layers["status"] == "fail", (ops.get("reason"), layers.get("reason"))
    assert {f["op"] for f in ops["findings"]} >= {"aten.silu.default", "aten.rsqrt.default"}
    assert any("\ufffd" in f["message"] for f in ops["findings"])  # the bad bytes, replaced
    assert any(f["module"].endswith("act_fn") for f in layers["findings"])
