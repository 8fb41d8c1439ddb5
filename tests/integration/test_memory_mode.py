"""The memory mode end to end (issue 37): prediction on meta against simdev's allocator, the budget, an
out-of-memory localised with a verified repro, and a compiled layer that needs more memory than eager."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from ci_runner.config import InputSpec
from ci_runner.models.load import load_model
from ci_runner.modes.memory.meters import MEM_AVAILABLE_ENV, DispatchMeter, SimdevMeter
from ci_runner.modes.memory.mode import cannot_fit, run
from ci_runner.modes.memory.runs import metered_run
from ci_runner.modes.memory.tables import compare_rows, kv_growth
from ci_runner.workloads.phases import parse_phases
from ci_runner.procs.isolate import open_entry
from ci_runner.results.model import JOURNAL_NAME, CellResult, Results, validate
from tests.fixtures.matrices import matrix_text

TINY = {"id": "llama", "config": "llama", "overrides": {
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 128}}
SIMDEV = {"extra_allow": ["rsqrt", "_softmax"]}
TINY_REGRESSION = {"min_bytes": 0}  # a 2-layer model's regression is kilobytes, under the default floor of 1 MiB


def test_prediction_matches_simdev_per_layer_in_every_phase(example_matrix: Any) -> None:
    """The example's tiny-llama: every module's predicted peak within 10% of simdev's, the working bytes (the peak
    above the call's entry) within 10% except in the padded batch (the masked attention's `repeat_kv` clones an
    expanded K/V on meta, as on a real device, and not on simdev: docs/memory.md), the KV growth per step exact."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ci_runner.sim import simdev

    simdev.register(**SIMDEV)
    spec = next(m for m in example_matrix.models if m.id == "tiny-llama")
    inputs = InputSpec(seq_len=16)
    meta, real = load_model(spec, meta=True), load_model(spec)
    phases = [None, *parse_phases([{"decode": {"steps": 2, "cache": "dynamic"}}, {"batch": {"lengths": [16, 5]}},
                                   {"long": {"seq_len": [40]}}], seq_len=16)]
    for phase in phases:
        with sdpa_kernel(SDPBackend.MATH):
            pred = metered_run(meta.module, meta, inputs, phase, "meta", DispatchMeter(shadow_numel=1 << 22))
        meas = metered_run(copy.deepcopy(real.module).to("simdev"), real, inputs, phase, "simdev", SimdevMeter())
        assert pred.error is None and meas.error is None and meas.oom is None
        rows = compare_rows(pred, meas)
        assert {r["module"] for r in rows} >= {"", "model.layers.0", "model.layers.1", "lm_head"}
        for r in rows:
            assert abs(r["peak_ratio"] - 1) <= 0.10, r
            if phase is None or phase.name != "batch":  # the padded batch: see docs/memory.md (masked attention)
                assert r["working_ratio"] is None or abs(r["working_ratio"] - 1) <= 0.10, r
        if phase is not None and phase.name == "decode":
            hd = 64 // 4  # head dim; 2 layers × (K, V) × 2 KV heads × head dim × 4 bytes per new token
            assert kv_growth(pred) == kv_growth(meas) == [2 * 2 * 2 * hd * 4] * 2


def _context(mode_context: Callable[..., Any], backend: dict[str, Any], options: dict[str, Any],
             phases: list[Any]) -> Any:
    text = matrix_text(models=[TINY], backends=[backend], modes=["memory"],
                       inputs={"seq_len": 8, "samples": 1, "phases": phases}, options={"memory": options})
    return mode_context(text, "llama", backend["id"])


def test_budget_and_an_out_of_memory_localised_to_its_layer(mode_context: Callable[..., Any]) -> None:
    # the weights are 26976 bytes; the first decoder layer's prefill needs a few KiB more than 28 KiB
    backend = {"id": "simdev", "device": "simdev", "backend_options": {**SIMDEV, "capacity_mb": 29 * 1024 / 2**20}}
    ctx = _context(mode_context, backend, {"budget_gb": 28 * 1024 / 2**30}, ["prefill"])
    try:
        result = run(ctx)
    finally:
        from ci_runner.sim import simalloc

        simalloc.set_capacity(None)
    data = result.data
    assert data["params_bytes"] == 26976 and data["first_over_budget"]["phase"] == "prefill"
    assert data["figures"]["params_bytes"] == 26976 and set(data["figures"]) >= {"params_bytes"}  # the history's
    assert data["first_over_budget"]["module"].startswith("model.layers.0")
    kinds = {f.kind: f for f in result.findings}
    assert set(kinds) == {"memory_oom", "memory_over_budget"}
    oom = kinds["memory_oom"]
    assert (oom.module, oom.phase, oom.step) == ("model.layers.0", "prefill", None)
    assert "out of memory in model.layers.0" in oom.message and oom.metrics["parameters"] == 26944
    assert oom.metrics["buffers"] == 32 and oom.metrics["total"] > 29 * 1024 - 1024
    assert set(oom.metrics) == {"parameters", "buffers", "kv_cache", "activations", "total"}
    assert oom.repro is not None and oom.repro.verified, oom.repro
    journal = (ctx.cell_dir / JOURNAL_NAME).read_text(encoding="utf-8")  # what a killed process would leave
    assert "enter-module\tmodel.layers.0 [prefill, prefill]" in journal
    assert open_entry(ctx.cell_dir / JOURNAL_NAME, "module") is None  # the OOM was caught: the layer was left
    cell = CellResult(id=ctx.cell.id, model="llama", backend="simdev", status="fail", duration_s=1.0,
                      modes={"memory": result})
    validate(Results(cells=[cell]).to_dict(), "results.schema.json", source="test")


def test_a_measurement_that_cannot_fit_is_told_not_tried(mode_context: Callable[..., Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44: the prediction says the measured run needs more host memory than is available (faked: 50 KiB,
    `DEEPVIEW_CI_TEST_MEM_AVAILABLE_MB`): the measurement is skipped with a note, the prediction and the budget's
    finding stay, nothing crashes."""
    monkeypatch.setenv(MEM_AVAILABLE_ENV, str(50 / 1024))
    backend = {"id": "simdev", "device": "simdev", "backend_options": SIMDEV}
    ctx = _context(mode_context, backend, {"budget_gb": 28 * 1024 / 2**30}, ["prefill", {"decode": {"steps": 1}}])
    result = run(ctx)
    rows = result.data["phases"]
    assert [f.kind for f in result.findings] == ["memory_over_budget"]  # the prediction's finding, no OOM
    for name in ("prefill", "decode"):
        assert rows[name]["predicted"]["peak_bytes"] > 26976 and "meter" not in rows[name], rows[name]
        assert rows[name]["measured"]["skipped"].startswith("not measured: the prediction needs about")
        assert "50.00 KiB MemAvailable" in rows[name]["note"]
    assert result.reason is not None and result.reason.startswith("not measured: the prediction needs")
    monkeypatch.setenv(MEM_AVAILABLE_ENV, "4096")  # room enough: measured as before
    assert cannot_fit(ctx, rows["prefill"]["predicted"]["peak_bytes"]) is None


def test_a_layer_that_hoards_activations_compiled_is_a_regression(mode_context: Callable[..., Any],
                                                                   fresh_dynamo: Any) -> None:
    ctx = _context(mode_context, {"id": "memhog", "compile": "sim-memhog", "device": "cpu"}, TINY_REGRESSION,
                   ["prefill"])
    result = run(ctx)
    assert [(f.kind, f.module, f.phase) for f in result.findings] == [("memory_regression", "model.layers.0", "prefill")]
    f = result.findings[0]
    assert f.metrics["ratio"] > 1.5 and f.repro is not None and f.repro.verified, f.repro
    rows = result.data["phases"]["prefill"]["compiled"]["rows"]
    assert [r["ratio"] < 1.5 for r in rows if r["module"] == "model.layers.1"] == [True]  # the other layer


def test_a_compiled_layer_the_backend_did_not_run_is_inconclusive_not_compiled_memory(
        mode_context: Callable[..., Any], fresh_dynamo: Any) -> None:
    """Issue 47: sim-memhog on every layer would be a regression on each, but sim-subset (allowing only `mm`)
    refuses every layer's graph and Dynamo, told to suppress errors, runs them in PyTorch: the compiled figures are
    eager's. The watched compile sees it: every row is `inconclusive` with why, no finding, the reason says so."""
    import torch._dynamo.config

    backend = {"id": "refuse", "compile": "sim-subset", "device": "cpu", "backend_options": {"allow": ["mm"]}}
    with torch._dynamo.config.patch(suppress_errors=True):
        result = run(_context(mode_context, backend, TINY_REGRESSION, ["prefill"]))
    compiled = result.data["phases"]["prefill"]["compiled"]
    assert compiled["rows"] and {r["module"] for r in compiled["rows"]} == {"model.layers.0", "model.layers.1"}
    assert all(r["status"] == "inconclusive" and r["not_ran"] for r in compiled["rows"]), compiled["rows"]
    assert "fell back to eager" in compiled["not_ran"] or "never executed" in compiled["not_ran"], compiled
    assert not result.findings and result.status == "pass"
    assert result.reason is not None and "did not run" in result.reason, result.reason

    ran = run(_context(mode_context, {"id": "memhog", "compile": "sim-memhog", "device": "cpu"}, TINY_REGRESSION,
                       ["prefill"])).data["phases"]["prefill"]["compiled"]
    assert "not_ran" not in ran and all("status" not in r for r in ran["rows"]), ran  # the backend ran every layer


def test_a_decode_step_repro_rebuilds_the_layer_and_its_kv_cache(mode_context: Callable[..., Any],
                                                                  fresh_dynamo: Any) -> None:
    """A decode step's regression repro: no pickle (the layer from config.json and weights.safetensors), the step's
    DynamicCache stored as its keys and values and rebuilt, and it still reproduces (issue 46)."""
    ctx = _context(mode_context, {"id": "memhog", "compile": "sim-memhog", "device": "cpu"}, TINY_REGRESSION,
                   [{"decode": {"steps": 1}}])
    result = run(ctx)
    step = [f for f in result.findings if f.kind == "memory_regression" and f.step is not None]
    assert step and all(f.repro is not None and f.repro.verified for f in step), [f.repro for f in step]
    folder = ctx.cell_dir / Path(step[0].repro.path).parent
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "inputs.safetensors", "repro.py",
                                                        "weights.safetensors"]
    script = (folder / "repro.py").read_text(encoding="utf-8")
    assert "torch.load" not in script and "pickle" not in script and '"__kv_cache__"' in script
