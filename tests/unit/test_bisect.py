"""Compiler-pass bisect: graph splitting, the node bisect on a wrong kernel, the inductor CompilerBisector."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.backends import resolve_backend
from ci_runner.modes.numerics.bisect import (
    BisectError,
    _cut,
    _Hybrid,
    _prefix_module,
    _units,
    bisect_layer,
    capture_call_inputs,
    choose_layer,
    export_layer,
    node_bisect,
)
from ci_runner.config import BackendSpec
from tests.fixtures.plugin_toolbox_models import base

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)

TIGHT = {"rel": 7.6e-6, "cos": 1 - 5.8e-11}
GELU_OFF = BackendSpec(id="gelu-off", compile="tests.fixtures.plugin_toolbox_perturb:make",
                       backend_options=MappingProxyType({"op": "aten.gelu.default", "scale": 0.01}))


def _net_and_input() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model, inputs = base(seed=0)
    return model, inputs(0)


def test_graph_split_reproduces_the_eager_output_at_every_cut() -> None:
    model, kw = _net_and_input()
    gm, flat = export_layer(model, (), kw)
    units = _units(gm)
    assert [str(n.target) for n in units][:2] == ["aten.linear.default", "aten.linear.default"]
    with torch.no_grad():
        expected = model(**kw)
        for k in range(len(units) + 1):
            cut, live = _cut(gm, units, k)
            prefix = _prefix_module(gm, cut, live)
            vals = prefix(*flat)
            out = _Hybrid(gm, dict(zip(live, vals)), cut).run(*flat)
            got = out[0] if isinstance(out, (tuple, list)) else out
            assert torch.equal(got, expected), f"cut after {k} nodes"


def test_capture_call_inputs_returns_what_the_layer_received() -> None:
    model, kw = _net_and_input()
    args, kwargs = capture_call_inputs(model, kw, "block.fc2")
    with torch.no_grad():
        assert torch.equal(args[0], model.block.act(model.block.fc1(model.embed(kw["x"]))))
    with pytest.raises(BisectError, match="called 1 time"):
        capture_call_inputs(model, kw, "block.fc2", call_index=1)


def test_node_bisect_finds_the_node_with_the_wrong_kernel() -> None:
    model, kw = _net_and_input()
    res = node_bisect(model, (), kw, resolve_backend(GELU_OFF), threshold=TIGHT, layer_name="")
    assert res["reproduced"] is True
    node = res["first_node"]
    assert node["op"] == "aten.gelu.default" and node["module"] == "block.act" and node["module_class"] == "GELU"
    assert "self.act" in (node["source"] or "") or "gelu" in (node["source"] or "")
    assert res["steps"] <= 2 + res["nodes"].bit_length()
    assert "first node: gelu = aten.gelu.default in block.act (GELU)" in res["summary"]


def test_node_bisect_on_a_sublayer_names_modules_from_the_model_root() -> None:
    model, kw = _net_and_input()
    res = bisect_layer(model, kw, resolve_backend(GELU_OFF), layer="block", call_index=0, threshold=TIGHT)
    assert res["method"] == "nodes" and res["layer"] == "block"
    assert res["first_node"]["module"] == "block.act"


def test_node_bisect_says_when_the_divergence_does_not_reproduce() -> None:
    model, kw = _net_and_input()
    res = node_bisect(model, (), kw, resolve_backend(BackendSpec(id="aot", compile="aot_eager")), threshold=TIGHT)
    assert res["reproduced"] is False and "does not reproduce" in res["summary"]


def test_compiler_method_is_for_inductor_only() -> None:
    model, kw = _net_and_input()
    with pytest.raises(BisectError, match="inductor-family"):
        bisect_layer(model, kw, resolve_backend(GELU_OFF), layer="block", call_index=0, threshold=TIGHT,
                     method="compiler")


@dataclass
class _L:
    name: str
    done: int
    iso: bool = False
    cum: bool = False
    key: str = ""
    module_class: str = "X"
    call_index: int = 0
    threshold: dict[str, Any] = field(default_factory=dict)

    def flagged(self, view: str) -> bool:
        return self.iso if view == "isolated" else self.cum


def test_choose_layer_prefers_the_first_layer_wrong_on_its_own() -> None:
    layers = [_L("a", 0, cum=True), _L("b", 3, iso=True, cum=True), _L("c", 2, iso=True)]
    assert choose_layer(layers, {"first_divergent": "a"}) == (layers[2], "isolated")
    layers = [_L("a", 0, cum=True), _L("b", 1, cum=True)]
    assert choose_layer(layers, {"first_divergent": "a"}) == (layers[0], "cumulative")
    assert choose_layer([_L("a", 0)], {"first_divergent": None}) is None


@pytest.fixture
def wrong_eps_pass(fresh_dynamo: Callable[[], None]):  # type: ignore[no-untyped-def]
    from tests.fixtures import plugin_toolbox_inductor

    plugin_toolbox_inductor.install()
    yield plugin_toolbox_inductor
    plugin_toolbox_inductor.uninstall()  # fresh_dynamo then drops the graphs compiled with it


@pytest.mark.slow
def test_compiler_bisector_traces_an_injected_inductor_pass(wrong_eps_pass) -> None:  # type: ignore[no-untyped-def]
    model, kw = _net_and_input()
    backend = resolve_backend(BackendSpec(id="inductor", compile="inductor",
                                          imports=("tests.fixtures.plugin_toolbox_inductor",)))
    res = bisect_layer(model, kw, backend, layer="norm", call_index=0, threshold=TIGHT)
    assert res["method"] == "compiler" and res["reproduced"] is True
    assert res["backend"] == "inductor" and res["subsystem"] == "post_grad_passes"
    assert res["debug_info"] == "post_grad_custom_post_pass" and res["bisect_number"] >= 0
    assert [s["backend"] for s in res["log"][:5]] == ["eager", "aot_eager", "aot_eager_decomp_partition",
                                                      "aot_eager_decomp_partition_crossref", "inductor"]
    assert res["summary"].startswith("compiler bisect: inductor › post_grad_passes")
    assert "post_grad_custom_post_pass" in res["summary"]


def test_a_search_step_the_backend_did_not_run_stops_the_search_without_a_verdict() -> None:
    """`first_bad` is the node bisect's binary search: a step that did not run (`StepNotRan`) ends it, leaving the
    range the steps that ran narrowed the first bad prefix to; `inconclusive` turns that into the result."""
    from ci_runner.modes.numerics.bisect import StepNotRan, first_bad, inconclusive

    asked: list[int] = []

    def is_bad(k: int) -> bool:
        asked.append(k)
        if k == 2:  # this prefix ran in PyTorch: it would have read as "good"
            raise StepNotRan(f"the step with the first {k} of 8 nodes on the target", "the backend was given no graph")
        return k >= 3

    assert first_bad(8, lambda k: k >= 3, {}) == 3
    out: dict = {}
    with pytest.raises(StepNotRan) as exc:
        first_bad(8, is_bad, out)
    assert asked == [4, 2] and out["between"] == [0, 4]
    res = inconclusive(out, exc.value, [{"k": 4, "bad": True}, {"k": 2, "bad": False, "not_ran": "…"}])
    assert res["status"] == "inconclusive" and res["reproduced"] is None and res["between"] == [0, 4]
    assert res["summary"].startswith("inconclusive: the step with the first 2 of 8 nodes on the target did not run")
