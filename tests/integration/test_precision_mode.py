"""Issue 43: the numerics and ops modes under a precision policy, on the self-test classes of `sim-precision`.

A correct bf16 backend passes under `precision: bfloat16` and fails under `float32` (every Linear); a backend that
breaks the policy in one class is found at that class only (isolated view, or at op level for a softmax). One tiny
Llama, thresholds shared by the module's tests (derived once per policy)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec, load_matrix_text
from ci_runner.workloads.emulate import resolve_policy
from ci_runner.matrix import expand
from ci_runner.modes import ModeContext
from ci_runner.modes.numerics.mode import run as run_numerics
from ci_runner.modes.ops.mode import run as run_ops
from ci_runner.results.model import ModeResult
from tests.fixtures.matrices import REFERENCES, matrix_text

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128}
MATRIX = matrix_text(
    inputs={"batch": 1, "seq_len": 8, "samples": 2, "seed": 0}, references=REFERENCES,
    models=[{"id": "tiny-llama", "config": "llama", "overrides": LLAMA},
            {"id": "tiny-llama-eager", "config": "llama", "overrides": {**LLAMA, "attn_implementation": "eager"}},
            {"id": "tiny-llama-bf16", "config": "llama", "overrides": LLAMA, "dtype": "bfloat16"}],
    backends=[
        {"id": "bf16-ok", "compile": "sim-precision", "precision": "bfloat16"},
        {"id": "bf16-as-f32", "compile": "sim-precision", "precision": "float32"},
        {"id": "bf16-norm", "compile": "sim-precision", "precision": "bfloat16", "backend_options": {"norm": "bfloat16"}},
        {"id": "bf16-acc", "compile": "sim-precision", "precision": "bfloat16",
         "backend_options": {"accumulate": "bfloat16"}},
        {"id": "bf16-softmax", "compile": "sim-precision", "precision": "bfloat16",
         "backend_options": {"softmax": "bfloat16"}},
        {"id": "kv-fp8", "compile": "sim-precision", "precision": "bfloat16",
         "backend_options": {"kv_cache": "float8_e4m3fn"}},
        # an fp16 matmul that saturates in one layer (the sim's limit is tiny: a tiny model's outputs are ~1e-3)
        {"id": "fp16-overflow", "compile": "sim-precision", "precision": "float16",
         "backend_options": {"matmul": "float16", "overflow": 0.001, "overflow_in": "mlp.down_proj"}},
    ],
)


@pytest.fixture(scope="module")
def cell_run(tmp_path_factory: pytest.TempPathFactory):
    """`cell_run(mode, model, backend) -> ModeResult`, in this process, thresholds and probe stores shared."""
    root = tmp_path_factory.mktemp("precision")
    matrix = load_matrix_text(MATRIX)

    def go(mode: str, model: str, backend: str, phases: tuple[object, ...] = ()) -> ModeResult:
        cell = next(c for c in expand(matrix) if c.model.id == model and c.backend.id == backend)
        opts = {"numerics": {"isolate": False, "thresholds_dir": str(root / "thresholds"), "verify": False}, "ops": {}}
        cell = dataclasses.replace(cell, options=opts, modes=(mode,),
                                   inputs=dataclasses.replace(cell.inputs, phases=phases))
        cell_dir = root / "run" / "cells" / f"{cell.id}-{mode}"
        cell_dir.mkdir(parents=True, exist_ok=True)
        ctx = ModeContext(cell=cell, cell_dir=cell_dir, backend=resolve_backend(cell.backend),
                          deadline=time.monotonic() + 900)
        return (run_numerics if mode == "numerics" else run_ops)(ctx)

    return go


def _flagged_classes(res: ModeResult) -> set[str]:
    return {str(f.module_class) for f in res.findings if f.kind == "divergence"}


@pytest.mark.slow  # ~1 min on 2 cores: five numerics cells of a one-layer Llama
def test_each_precision_class_is_found_at_its_class_only(cell_run, fresh_dynamo: None) -> None:
    ok = cell_run("numerics", "tiny-llama", "bf16-ok")
    assert ok.status == "pass" and not ok.findings, (ok.status, ok.reason, [f.message for f in ok.findings])
    assert ok.data["precision"]["policy"] == "bfloat16" and ok.data["views"]["isolated"] == "ran"
    as_f32 = cell_run("numerics", "tiny-llama", "bf16-as-f32")
    # a float32 policy: every matmul class computed in bf16 is flagged (Linear, and the attention's q/k/v inputs)
    assert _flagged_classes(as_f32) == {"Linear", "LlamaAttention"}, [f.message for f in as_f32.findings]
    norm = cell_run("numerics", "tiny-llama", "bf16-norm")
    assert _flagged_classes(norm) == {"LlamaRMSNorm"}, [f.message for f in norm.findings]
    assert all("isolated view" in f.message for f in norm.findings)
    acc = cell_run("numerics", "tiny-llama", "bf16-acc")
    assert _flagged_classes(acc) <= {"Linear"} and _flagged_classes(acc), [f.message for f in acc.findings]


@pytest.mark.slow  # ~40 s: the ops mode of a one-layer Llama with an explicit softmax, two backends
def test_ops_judge_each_op_against_the_policy(cell_run, fresh_dynamo: None) -> None:
    ok = cell_run("ops", "tiny-llama-eager", "bf16-ok")
    assert ok.status == "pass" and not ok.findings, [f.message for f in ok.findings]
    softmax = cell_run("ops", "tiny-llama-eager", "bf16-softmax")
    assert [(f.kind, f.op) for f in softmax.findings] == [("op_mismatch", "aten._softmax.default")]
    assert softmax.findings[0].repro is not None and softmax.findings[0].repro.verified


@pytest.mark.subprocess
def test_auto_measures_once_per_backend_configuration(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = BackendSpec(id="b", compile="sim-precision")  # a correct bf16 backend
    policy, record = resolve_policy(spec, tmp_path)
    assert policy.detected and policy.low == "bfloat16" and record["policy"] == "bfloat16 (detected)"
    assert record["detected"]["norm"]["dtype"] == "float32"
    files = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert len(files) == 1
    again, _ = resolve_policy(BackendSpec(id="other-id", compile="sim-precision"), tmp_path)  # same configuration
    assert again == policy and [p for p in tmp_path.iterdir() if p.suffix == ".json"] == files
    drift, record = resolve_policy(BackendSpec(id="d", compile="sim-drift"), tmp_path)
    assert drift.is_float32 and "norm measured in bfloat16" in record["note"]


@pytest.mark.slow  # ~40 s: a decode cell and an overflow cell
def test_an_fp8_kv_cache_and_an_fp16_overflow_are_found_at_their_class(cell_run, fresh_dynamo: None) -> None:
    kv = cell_run("numerics", "tiny-llama", "kv-fp8", phases=({"decode": {"steps": 2}},))
    assert kv.findings and {f.module_class for f in kv.findings} == {"KVCache"}, [f.message for f in kv.findings]
    assert "the KV cache layers.0." in kv.findings[0].message
    agreement = kv.data["phases"]["decode"]["agreement"]  # judged against the policy's own token agreement
    assert agreement["policy"]["greedy"] == 1.0 and agreement["within_policy"] is True
    overflow = cell_run("numerics", "tiny-llama", "fp16-overflow")
    assert {(f.module, f.module_class) for f in overflow.findings} == {("model.layers.0.mlp.down_proj", "Linear")}, \
        [f.message for f in overflow.findings]


@pytest.mark.slow  # ~30 s: two numerics cells of a model loaded in bfloat16
def test_a_model_loaded_in_bf16_is_held_to_what_bf16_storage_explains(cell_run, fresh_dynamo: None) -> None:
    ok = cell_run("numerics", "tiny-llama-bf16", "bf16-ok")
    assert ok.status == "pass" and not ok.findings, [f.message for f in ok.findings]
    assert ok.data["precision"]["policy"] == "bfloat16, model in bfloat16"
    acc = cell_run("numerics", "tiny-llama-bf16", "bf16-acc")  # bf16 accumulation: still found, at Linear only
    assert _flagged_classes(acc) == {"Linear"}, [f.message for f in acc.findings]
