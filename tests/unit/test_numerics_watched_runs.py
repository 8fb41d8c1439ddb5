"""Issue 38: every compiled run of the numerics mode is watched. The toolbox's whole-model runs (a dump of a
compiled target, batch invariance) and the per-phase target runs say when the backend did not run them (never a
pass); ops the backend's partitioner left to PyTorch make the modules that call them `not_ran`; the verdict counts
as "could not be compared" only layers compared in no view."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec, InputSpec, ModelSpec
from ci_runner.models.load import load_model
from ci_runner.modes.numerics.mode import _result
from ci_runner.modes.numerics.phases import _watched_run
from ci_runner.modes.numerics.batch_invariance import batch_experiment
from ci_runner.modes.numerics.capture import record_reference
from ci_runner.modes.numerics.dumps import DumpSide, dump_model, load_dump
from ci_runner.modes.numerics.store import DumpReader
from ci_runner.modes.numerics.thresholds import ThresholdOptions, ThresholdTable
from ci_runner.modes.numerics.verdict import build_layers, coverage, verdict_of
from ci_runner.modes.numerics.views import _compare_compiled
from ci_runner.modes.numerics.weights import WeightsReport, check_weights
from ci_runner.modes.numerics.watched import CaptureRun, WatchedRunner, partial_sites, watched_capture, watched_outputs
from ci_runner.workloads.phases import parse_phases

OPENVINO = {"options": {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}
AOT = BackendSpec(id="aot_eager", compile="aot_eager")


def eager_stance() -> Any:
    """Dynamo runs everything in PyTorch eager and gives the backend nothing (`torch.compiler.set_stance`, what
    TORCH_COMPILE_DISABLE-style switches do): the plainest silent fallback there is."""
    return torch.compiler.set_stance("force_eager")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)).eval()


def _table() -> ThresholdTable:
    return ThresholdTable(layers={}, options=ThresholdOptions(), primary_dtype="float32", key={})


def test_whole_model_runs_are_watched_a_silent_fallback_is_not_ran(fresh_dynamo: Any) -> None:
    m, kwargs = _net(), {"input": torch.randn(2, 4)}
    ran = watched_outputs(m, resolve_backend(AOT), (), kwargs)
    assert (ran.way, ran.not_ran) == ("hooks-copy", None)
    assert {k for k, _ in ran.compared()} == {"", "0", "1", "2"}
    with eager_stance():
        fell = watched_outputs(m, resolve_backend(AOT), (), kwargs)
    assert "no graph" in fell.not_ran and fell.status()["not_ran"] == fell.not_ran


def test_batch_invariance_a_compiled_dump_and_the_weights_check_say_when_the_backend_did_not_run(tmp_path: Path,
                                                                               fresh_dynamo: Any) -> None:
    m, kwargs = _net(), {"input": torch.randn(2, 4)}
    with eager_stance():
        result = batch_experiment(m, resolve_backend(AOT), kwargs, slots=2)
        manifest = dump_model(m, kwargs, tmp_path / "tgt", backend=resolve_backend(AOT),
                              side=DumpSide(role="target", id="aot_eager", device="cpu", dtype="float32",
                                            compile="aot_eager"))
        weights = check_weights(m, resolve_backend(AOT))
    assert weights.not_ran and WeightsReport.from_json(weights.to_json()).not_ran == weights.not_ran
    assert result["not_ran"] and all(r.get("not_ran") for r in result["backend_ran"])
    assert load_dump(manifest.parent).side["ran"]["not_ran"]
    ok = batch_experiment(m, resolve_backend(AOT), kwargs, slots=2)
    assert "not_ran" not in ok and ok["backend_ran"] == [{"capture": "hooks-copy"}]
    assert check_weights(m, resolve_backend(AOT)).not_ran is None


def _prefill_of_a_tiny_llama() -> tuple[Any, Any, Any]:
    """A one-layer Llama, a context that carries its inputs, and its prefill phase."""
    spec = ModelSpec(id="llama", config="llama", overrides={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                                            "num_hidden_layers": 1, "num_attention_heads": 2,
                                                            "num_key_value_heads": 1})
    ctx: Any = types.SimpleNamespace(cell=types.SimpleNamespace(inputs=InputSpec(batch=1, seq_len=6, seed=0)))
    return load_model(spec, seed=0), ctx, parse_phases(["prefill"], seq_len=6)[0]


def test_a_phase_the_backend_did_not_run_is_seen(fresh_dynamo: Any) -> None:
    loaded, ctx, phase = _prefill_of_a_tiny_llama()
    run, _rec, ran = _watched_run(resolve_backend(AOT), loaded.module, None, loaded, ctx, phase, forced=None,
                                  device="cpu")
    assert run.failed is None and "not_ran" not in ran and ran["graphs_executed"] >= 1
    fresh_dynamo()
    with eager_stance():
        run, _rec, ran = _watched_run(resolve_backend(AOT), loaded.module, None, loaded, ctx, phase, forced=None,
                                      device="cpu")
    assert run.failed is None and "no graph" in ran["not_ran"], ran


def test_partial_sites_and_the_modules_they_touch_are_not_ran(tmp_path: Path) -> None:
    facts = {"eager_ops": ["aten.gelu.default", "aten.new_ones.default"],
             "eager_sites": {"aten.gelu.default": ["1"]}}  # new_ones: no module known -> the model itself
    assert partial_sites(facts) == {"aten.gelu.default": ["1"], "aten.new_ones.default": [""]}
    m, kwargs = _net(), {"input": torch.randn(2, 4)}
    record_reference(m, kwargs, tmp_path / "r0")
    reader = DumpReader(tmp_path / "r0")
    with torch.no_grad():
        records = [(k, tuple(v)) for k, v in [("0", [("", m[0](kwargs["input"]))])]]
    run = CaptureRun(way="hooks-copy", records=records, facts={"eager_ops": ["aten.gelu.default"],
                                                               "eager_sites": {"aten.gelu.default": ["0"]}},
                     backend="openvino")
    recs: list[dict[str, Any]] = []
    _compare_compiled(reader, run, recs.append)
    assert recs[0]["stage"] == "not_ran" and "openvino's partitioner left aten.gelu.default" in recs[0]["error"]
    assert run.status()["partial"] == {"aten.gelu.default": ["0"]}


def test_the_verdict_counts_only_layers_compared_in_no_view(tmp_path: Path) -> None:
    m, kwargs = _net(), {"input": torch.randn(2, 4)}
    record_reference(m, kwargs, tmp_path / "r0")
    reader = DumpReader(tmp_path / "r0")
    ok = {"rel": 0.0, "cos": 1.0, "mad": 0.0}
    records = [{"view": "cumulative", "key": "", "metrics": ok},
               {"view": "cumulative", "key": "0", "stage": "capture", "error": "not compared in this view"},
               {"view": "isolated", "key": "0", "metrics": ok},  # the other view compared it
               {"view": "cumulative", "key": "1", "stage": "not_ran", "error": "left to PyTorch"}]
    layers = build_layers(reader, records, _table())
    text = verdict_of(layers, isolated_ran=True)["text"]
    assert "(1 layer(s) could not be compared)" in text, text  # "1" (not_ran); not "0", compared in the other view
    assert coverage(layers, ["cumulative", "isolated"])["compared"] == 2
    result = _result([], {}, 0.0, cum_errors=[], layers=layers, expected=["cumulative", "isolated"])
    assert result.status == "inconclusive" and "not run on the backend, first 1 (cumulative view: not_ran: left to " \
        "PyTorch)" in str(result.reason), result.reason


@pytest.mark.slow  # real OpenVINO: a whole-model compile and two modules alone, ~5 s
def test_openvino_partial_partition_makes_the_modules_calling_the_left_op_not_ran(tmp_path: Path,
                                                                                  fresh_dynamo: Any) -> None:
    """OpenVINO has no histc: its partitioner leaves it to PyTorch and runs the rest, and says nothing (no
    fallback). The modules whose own code calls histc are not compared on OpenVINO in either view."""
    pytest.importorskip("openvino")

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + torch.histc(x, bins=8, min=-3, max=3)

    torch.manual_seed(0)
    m = nn.Sequential(Inner(), nn.ReLU(), nn.Linear(8, 4)).eval()
    kwargs = {"input": torch.randn(2, 8)}
    record_reference(m, kwargs, tmp_path / "r0")
    reader = DumpReader(tmp_path / "r0")
    be = resolve_backend(BackendSpec(id="openvino", compile="openvino", compile_options=OPENVINO))
    run = watched_capture(m, be, (), kwargs, set())
    assert run.not_ran is None and run.status()["partial"] == {"aten.histc.default": ["0"]}, run.status()
    recs: list[dict[str, Any]] = []
    _compare_compiled(reader, run, recs.append)
    by = {r["key"]: r for r in recs}
    assert by["0"]["stage"] == "not_ran" and "metrics" in by["0.lin"] and "metrics" in by[""]
    runner = WatchedRunner(be)  # the isolated view: Inner alone keeps histc on PyTorch, its Linear runs on OpenVINO
    for name in ("0", "0.lin"):
        sub = m.get_submodule(name)
        with torch.no_grad():
            runner(name, sub)(kwargs["input"])
    assert "histc" in runner.not_ran.get("0", "") and "0.lin" not in runner.not_ran, runner.not_ran


def test_the_hooked_rerun_of_a_phase_is_not_a_fallback_when_the_backend_ran_it(fresh_dynamo: Any) -> None:
    """The hooked re-run (output and input hooks on every module, the root's included) ran wholly on the backend:
    the root module's hooks run outside its compiled forward, each a frame Dynamo compiles; a generator in the
    input hook was a frame Dynamo refused ("Attempt to trace generator"), counted as a fallback to eager, and
    every localised phase finding said `hooked_not_ran` although the model's graphs all ran on the backend."""
    loaded, ctx, phase = _prefill_of_a_tiny_llama()
    run, rec, ran = _watched_run(resolve_backend(AOT), loaded.module, loaded.module, loaded, ctx, phase, forced=None,
                                 device="cpu", inputs=True)
    assert run.failed is None and "not_ran" not in ran and ran["graphs_executed"] >= 1, ran
    assert rec.inputs and "model.layers.0.mlp.act_fn" in rec.inputs[0], rec.inputs  # the input hooks recorded


class _GeneratorHooked(nn.Module):
    """A model whose own forward hook walks its inputs with a generator (a frame Dynamo cannot compile)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_forward_hook(lambda mod, args, out: next((a for a in args if a.is_floating_point()), None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_frame_dynamo_refused_is_named_with_what_it_could_not_trace(fresh_dynamo: Any) -> None:
    compiled, watch = resolve_backend(AOT).compile_watched(_GeneratorHooked())
    with watch:
        compiled(torch.randn(2, 4))
    why = watch.not_ran(breaks=False) or ""
    assert why.startswith("Dynamo fell back to eager for 1 frame(s)") and "Attempt to trace generator" in why, why
