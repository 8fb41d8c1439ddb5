"""Issue 38: numerics watches whether the backend ran what it compares (`modes/numerics/watched.py`). A capture the backend
did not run is no comparison (`not_ran`, held against a pass); where the capture hooks make the backend fall back,
the view captures without them and says so (`capture` records, left to the isolated view)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec
from ci_runner.watch.capture import iter_tensors
from ci_runner.modes.numerics import target
from ci_runner.modes.numerics.capture import record_reference
from ci_runner.modes.numerics.store import DumpReader
from ci_runner.modes.numerics.thresholds import ThresholdOptions, ThresholdTable
from ci_runner.modes.numerics.verdict import build_layers, coverage
from ci_runner.modes.numerics.views import _compare_compiled
from ci_runner.modes.numerics.watched import CaptureRun, watched_capture

OPENVINO = {"options": {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}


@pytest.fixture(scope="module")
def mlp_dump(tmp_path_factory: pytest.TempPathFactory) -> tuple[nn.Module, dict[str, Any], DumpReader]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)).eval()
    kwargs = {"input": torch.randn(2, 4)}
    folder = tmp_path_factory.mktemp("ref") / "r0"
    record_reference(m, kwargs, folder)
    return m, kwargs, DumpReader(folder)


def _layers(reader: DumpReader, records: list[dict[str, Any]]) -> Any:
    table = ThresholdTable(layers={}, options=ThresholdOptions(), primary_dtype="float32", key={})
    return build_layers(reader, records, table)


def test_a_capture_the_backend_did_not_run_compares_nothing(mlp_dump: Any) -> None:
    m, kwargs, reader = mlp_dump
    with torch.no_grad():
        out = m(**kwargs)
    run = CaptureRun(way="no-hooks", records=[("", tuple(iter_tensors(out)))],
                     not_ran="OpenVINO's execution failed and the graph ran in PyTorch eager: (no message)")
    recs: list[dict[str, Any]] = []
    seen, _ = _compare_compiled(reader, run, recs.append)
    assert seen == {c["key"] for c in reader.calls}
    assert all(r["stage"] == "not_ran" and "metrics" not in r for r in recs) and len(recs) == len(reader.calls)
    cov = coverage(_layers(reader, [{**r, "sample": 0} for r in recs]), ["cumulative"])
    assert cov["views"]["cumulative"] == 0 and len(cov["missing"]) == len(reader.calls)  # never a pass
    # compared in the other view on the backend: that comparison stands
    iso = [{"view": "isolated", "key": c["key"], "metrics": {"rel": 0.0, "cos": 1.0, "mad": 0.0}, "sample": 0}
           for c in reader.calls]
    cov = coverage(_layers(reader, [{**r, "sample": 0} for r in recs] + iso), ["cumulative", "isolated"])
    assert cov["compared"] == len(reader.calls) and cov["failed_count"] == 0


def test_without_hooks_the_output_is_compared_and_the_layers_are_left_to_the_isolated_view(mlp_dump: Any) -> None:
    m, kwargs, reader = mlp_dump
    with torch.no_grad():
        out = m(**kwargs)
    run = CaptureRun(way="no-hooks", records=[("", tuple(iter_tensors(out)))],
                     tried=[{"capture": "hooks-copy", "not_ran": "Tensor name is not a number: add"}])
    recs: list[dict[str, Any]] = []
    _compare_compiled(reader, run, recs.append)
    by = {r["key"]: r for r in recs}
    assert by[""]["metrics"]["rel"] == 0.0
    assert {r["stage"] for k, r in by.items() if k} == {"capture"} and "Tensor name" in by["0"]["error"]
    iso = [{"view": "isolated", "key": c["key"], "metrics": {"rel": 0.0, "cos": 1.0, "mad": 0.0}, "sample": 0}
           for c in reader.calls]
    cov = coverage(_layers(reader, [{**r, "sample": 0} for r in recs] + iso), ["cumulative", "isolated"])
    assert cov["failed_count"] == 0 and cov["compared"] == len(reader.calls)  # compared in the other view
    assert cov["not_comparable_count"] == len(reader.calls) - 1


def test_a_backend_that_runs_with_hooks_is_captured_the_first_way(mlp_dump: Any, fresh_dynamo: None) -> None:
    m, kwargs, reader = mlp_dump
    run = watched_capture(m, resolve_backend(BackendSpec(id="aot_eager", compile="aot_eager")), (), kwargs, set())
    assert (run.way, run.tried, run.not_ran) == ("hooks-copy", [], None)
    assert {k for k, _ in run.records} == {c["key"] for c in reader.calls}
    assert run.facts["graphs_executed"] >= 1


@pytest.mark.slow  # real OpenVINO: two compiles of the model and one per module, ~15 s on 2 shared cores
def test_openvino_falling_back_under_the_hooks_is_seen_and_captured_without_them(tmp_path: Path,
                                                                                fresh_dynamo: None) -> None:
    """The dishonest pass of issue 38: hooks on every module of a shifted-window model make OpenVINO's conversion
    fail ("Tensor name is not a number: add") and it runs PyTorch instead. The view sees it, captures without
    hooks (the output compared), and the isolated view compares every module on OpenVINO itself."""
    pytest.importorskip("openvino")
    from transformers import SwinConfig, SwinForImageClassification

    torch.manual_seed(0)
    cfg = SwinConfig(embed_dim=16, depths=[1], num_heads=[1], image_size=32, patch_size=4, window_size=4,
                     num_labels=10)
    m = SwinForImageClassification(cfg).eval()
    record_reference(m, {"pixel_values": torch.randn(1, 3, 32, 32)}, tmp_path / "r0")
    be = resolve_backend(BackendSpec(id="openvino", compile="openvino", compile_options=OPENVINO))
    plan = target.TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(tmp_path / "r0"),),
                             results="", journal="")
    recs: list[dict[str, Any]] = []
    target.compare_target(m, be, plan, recs.append)
    status = next(r for r in recs if r["view"] == "cumulative" and "status" in r)
    assert status["capture"] == "no-hooks" and "not_ran" not in status, status
    assert [f["capture"] for f in status["fallbacks"]] == ["hooks-copy"]
    assert "Tensor name is not a number" in status["fallbacks"][0]["not_ran"], status
    cum = {r["key"]: r for r in recs if r["view"] == "cumulative" and "key" in r}
    assert "metrics" in cum[""] and all(r["stage"] == "capture" for k, r in cum.items() if k)
    iso = [r for r in recs if r["view"] == "isolated" and "key" in r]
    assert iso and all("metrics" in r for r in iso), [r for r in iso if "metrics" not in r][:3]
    assert max(r["metrics"]["rel"] for r in iso) < 1e-5
