"""The numerics overlay for Model Explorer (`modes/numerics/overlay.py`) on hand-made rows and graph nodes: the ratio to the
threshold, the node → module mapping (later calls, modules held in globals), the gradient that puts 1.0 at the
amber edge, and the file's format (our JSON Schema of Model Explorer's documented node data). The real numerics
run, its exported program and Model Explorer's own code on them: tests/integration/test_model_explorer_overlay.py."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
import torch

from ci_runner.modes.numerics.overlay import (AMBER, GREEN, ORANGE, RATIO_CAP, RED, colour_at, gradient, graph_node_data,
                                        module_ratios, node_stacks, ratio)
from tests.fixtures.paths import ROOT

SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "model_explorer_node_data.schema.json").read_text(encoding="utf-8"))
THR = {"rel": 1e-5, "cos": 1.0 - 1e-10, "mad": 1e-6}


def _node(name: str, *stack: tuple[str, str]) -> Any:
    return SimpleNamespace(op="call_function", name=name,
                           meta={"nn_module_stack": {key: (path, "torch.nn.Linear") for key, path in stack}})


def colour_of(data: dict[str, Any], value: float) -> str:
    """The colour Model Explorer's web app gives `value` from the file's gradient (stops relative to the smallest and
    largest value; the first segment that holds the value, linear between its two colours)."""
    values = [r["value"] for r in data["results"].values()]
    lo, hi = min(values), max(values)
    at = (value - lo) / (hi - lo)
    stops = sorted(data["gradient"], key=lambda s: s["stop"])
    for a, b in zip(stops, stops[1:]):
        if a["stop"] <= at <= b["stop"]:
            f = 0.0 if b["stop"] == a["stop"] else (at - a["stop"]) / (b["stop"] - a["stop"])
            ca, cb = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (a["bgColor"], b["bgColor"]))
            return "#" + "".join(f"{math.floor(x + (y - x) * f):02x}" for x, y in zip(ca, cb))
    raise AssertionError(f"{value} outside the gradient")


def near(a: str, b: str) -> bool:
    """Two hex colours within one unit per channel."""
    ca, cb = (tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in (a, b))
    return all(abs(x - y) <= 1 for x, y in zip(ca, cb))


def test_ratio_is_the_worst_metric_over_its_threshold() -> None:
    assert ratio({"rel": 2e-5, "cos": 1.0 - 5e-11, "mad": 1e-7}, THR) == pytest.approx(2.0)
    assert ratio({"rel": 1e-6, "cos": 1.0 - 3e-10, "mad": 1e-7}, THR) == pytest.approx(3.0, rel=1e-5)
    assert ratio({"rel": 0.0, "cos": 1.0, "mad": 0.0}, THR) == 0.0
    assert ratio({"rel": float("nan"), "cos": 1.0, "mad": 0.0}, THR) == RATIO_CAP  # JSON has no NaN
    assert ratio({"rel": 1.0}, {"rel": 0.0}) == RATIO_CAP and ratio({"rel": 0.0}, {"rel": 0.0}) == 0.0
    assert ratio(None, THR) is None and ratio({"rel": 1.0}, {}) is None


def test_nodes_take_their_innermost_compared_module_and_its_later_calls() -> None:
    nodes = [_node("linear", ("L__self__", ""), ("L__self__l", "l")),
             _node("linear_1", ("L__self__", ""), ("L__self__l@1", "l")),
             _node("rope", ("L__self__", ""), ("G['fn'].apply_rotary", "G['fn'].apply_rotary")),
             _node("add", ("L__self__", ""), ("L__self__block", "block"), ("L__self__block.act", "block.act")),
             SimpleNamespace(op="placeholder", name="x", meta={})]
    stacks = node_stacks(nodes)
    assert stacks == {"linear": ["l", ""], "linear_1": ["l#1", ""], "rope": [""], "add": ["block.act", "block", ""]}
    rows = [{"key": "", "cumulative": {"rel": 5e-6}, "threshold": {"rel": 1e-5}},
            {"key": "l", "cumulative": {"rel": 1e-6}, "threshold": {"rel": 1e-5}},
            {"key": "l#1", "cumulative": {"rel": 3e-4}, "threshold": {"rel": 1e-5}},
            {"key": "block", "cumulative": {"rel": 2e-5}, "threshold": {"rel": 1e-5},
             "isolated": {"rel": 0.0}, "threshold_isolated": {"rel": 1e-5}},
            {"key": "block.act", "cumulative": None, "threshold": {"rel": 1e-5}}]  # not compared: its parent counts
    data = graph_node_data(stacks, module_ratios(rows, "cumulative"), view="cumulative")
    assert {k: v["value"] for k, v in data["results"].items()} == {"linear": 0.1, "linear_1": 30.0, "rope": 0.5,
                                                                  "add": 2.0}
    jsonschema.validate(data, SCHEMA)
    iso = graph_node_data(stacks, module_ratios(rows, "isolated"), view="isolated")
    assert iso["results"] == {"add": {"value": 0.0, "bgColor": GREEN}}  # one value: coloured by hand
    jsonschema.validate(iso, SCHEMA)


@pytest.mark.parametrize("values", [[0.0, 0.4, 1.0, 1.5, 30.0], [0.1, 0.9], [2.0, 500.0], [0.0, 1.0, 10.0, RATIO_CAP]])
def test_the_gradient_puts_the_threshold_at_the_amber_edge(values: list[float]) -> None:
    data = {"results": {f"n{i}": {"value": v} for i, v in enumerate(values)}, "gradient": gradient(min(values),
                                                                                                   max(values))}
    jsonschema.validate(data, SCHEMA)
    stops = [s["stop"] for s in data["gradient"]]
    assert stops == sorted(stops) and stops[0] == 0 and stops[-1] == 1
    for v in values:  # what the web app draws is the absolute scale (to a unit of float rounding)
        assert near(colour_of(data, v), colour_at(v)), v
    assert colour_at(0.0) == GREEN and colour_at(1.0) == AMBER and near(colour_at(1.0 + 1e-9), ORANGE)
    assert colour_at(10.0) == RED == colour_at(RATIO_CAP)


def test_the_schema_refuses_what_model_explorer_would_not_read() -> None:
    good = {"results": {"linear": {"value": 1.0}}, "gradient": [{"stop": 0, "bgColor": GREEN},
                                                                {"stop": 1, "bgColor": RED}]}
    jsonschema.validate(good, SCHEMA)
    for bad in ({"graph": good},  # a model's node data, not one graph's: then `results` is not at the top
                {**good, "results": {"linear": {"val": 1.0}}},
                {**good, "gradient": [{"stop": 0, "bgColor": GREEN}]},
                {**good, "gradient": [{"stop": 0, "bgColor": "rgb(0,0,0)"}, {"stop": 1, "bgColor": RED}]},
                {**good, "gradient": [{"stop": 0.5, "bgColor": GREEN}, {"stop": 1, "bgColor": RED}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)


def test_the_program_is_exported_once_per_model_key_and_linked_into_each_cell(tmp_path: Any) -> None:
    from ci_runner.modes.numerics.overlay import PROGRAM_FILE, export_program, place, shared_program

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    calls = []

    def export() -> Any:
        calls.append(1)
        return torch.export.export(model, (torch.ones(2, 4),), strict=False)

    shared = tmp_path / "run" / "model_explorer" / "m-key-sample0"
    first = shared_program(shared, export, save=False)
    assert first == ({"linear": ["0", ""], "relu": ["1", ""]}, None) and len(calls) == 1
    stacks, program = shared_program(shared, export, save=True)  # the program wanted now: exported again, saved
    assert program == shared / PROGRAM_FILE and len(calls) == 2
    assert shared_program(shared, export, save=True) == (stacks, program) and len(calls) == 2  # reused
    for cell in ("a", "b"):
        place(program, tmp_path / cell / PROGRAM_FILE)
        assert (tmp_path / cell / PROGRAM_FILE).stat().st_ino == program.stat().st_ino  # one copy on disk
    loaded = torch.export.load(str(tmp_path / "a" / PROGRAM_FILE))
    assert [n.name for n in loaded.graph.nodes if n.op == "call_function"] == ["linear", "relu"]
    # keyword inputs that are not tensors are constants of the program; its outputs a flat tuple of tensors
    wrapped = export_program(_DictOut(), {"x": torch.ones(1, 4), "double": True})
    assert [n.name for n in wrapped.graph.nodes if n.op == "placeholder"] == ["x"]
    assert len(wrapped.graph.output_node().args[0]) == 2 and wrapped.module()(x=torch.ones(1, 4))[0].sum() == 8


class _DictOut(torch.nn.Module):
    def forward(self, x: torch.Tensor, double: bool = False) -> dict[str, Any]:
        return {"y": x * 2 if double else x, "skip": None, "pair": (x.sum(),)}
