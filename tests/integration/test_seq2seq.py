"""Issue 38: an encoder-decoder from `config:` is built with its seq2seq head and decoder inputs (the zoo's), and
runs: its numerics compare the encoder's and the decoder's layers. Tiny T5 on aot_eager (the point is our model
building, not a compiler; checked by hand on IREE and OpenVINO, /work/notes/issue38.md). The three modes on both
real compilers are in `benchmarks/bench_truth_archs.py` (too big for the suite)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from ci_runner.config import InputSpec, ModelSpec, load_matrix_text
from ci_runner.models.load import build_inputs, load_model
from ci_runner.workloads.calls import skip_reason
from ci_runner.matrix import expand
from ci_runner.workloads.phases import parse_phases
from ci_runner.results.model import CellResult, validate
from ci_runner.run.cellrun import run_cell_inprocess
from ci_runner.zoo.inputs import zoo_inputs
from tests.fixtures.matrices import matrix_text

T5 = {"d_model": 16, "d_ff": 32, "d_kv": 8, "num_heads": 2, "num_layers": 1, "num_decoder_layers": 1,
      "vocab_size": 64}


@pytest.fixture(scope="module")
def t5_cell(tmp_path_factory: pytest.TempPathFactory) -> CellResult:
    """The numerics mode on tiny T5, run once for the file."""
    tmp = tmp_path_factory.mktemp("t5")
    text = matrix_text(modes=["numerics"], timeout=900,
                       inputs={"batch": 1, "seq_len": 8, "samples": 1, "seed": 0},
                       models=[{"id": "tiny-t5", "config": "t5", "overrides": T5}],
                       backends=[{"id": "aot_eager", "compile": "aot_eager"}])
    cell = next(iter(expand(load_matrix_text(text, path=str(tmp / "matrix.yaml")))))
    result = run_cell_inprocess(cell, tmp / "cells" / cell.id, modes=("numerics",),
                                deadline=time.monotonic() + cell.timeout)
    validate(result.to_dict(), "cell.schema.json", source="seq2seq test")
    return result


def test_t5_from_config_has_its_seq2seq_head_and_the_zoos_decoder_inputs() -> None:
    loaded = load_model(ModelSpec(id="t5", config="t5", overrides=T5), seed=0)
    assert loaded.task == "seq2seq" and type(loaded.module).__name__ == "T5ForConditionalGeneration"
    spec = InputSpec(batch=1, seq_len=8, samples=1, seed=0)
    kwargs = build_inputs(loaded, spec)
    zoo = zoo_inputs(loaded.module, loaded.config, model_type="t5", task="seq2seq", inputs=spec)
    assert set(kwargs) >= {"input_ids", "attention_mask", "decoder_input_ids"}
    for key in ("input_ids", "decoder_input_ids"):  # one builder for both paths
        assert torch.equal(kwargs[key], zoo[key]), key
    with torch.no_grad():
        logits = loaded.module(**kwargs).logits
    assert logits.shape == (1, kwargs["decoder_input_ids"].shape[1], T5["vocab_size"])
    # prefill and decode are its generation (tests/unit/test_encoder_decoder_phases.py); batch and long prompts are
    # built for decoder-only models: skipped with the reason, not failed
    assert skip_reason(loaded, parse_phases(["decode"], seq_len=8)[0], spec) is None
    for phase in parse_phases(["batch", "long"], seq_len=8):
        assert "encoder-decoder" in (skip_reason(loaded, phase, spec) or ""), phase


@pytest.mark.slow  # the numerics mode's reference, thresholds and target children
def test_t5_numerics_compares_encoder_and_decoder_layers(t5_cell: CellResult) -> None:
    numerics = t5_cell.modes["numerics"]
    assert numerics.status == "pass", numerics.reason
    compared = {str(row.get("module") or row.get("name")) for row in numerics.data["layers"]
                if row.get("cumulative") or row.get("isolated")}
    assert any(m.startswith("encoder.") for m in compared) and any(m.startswith("decoder.") for m in compared), compared
    assert any(m.startswith("decoder.block.0.layer.1.EncDecAttention") for m in compared), sorted(compared)
