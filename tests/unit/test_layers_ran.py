"""Issue 13, layers mode: a module probe passes only when the backend compiled and executed it. A probe that
raised nothing but ran elsewhere (no graph given to the backend, Dynamo's suppressed error, OpenVINO declining a
one-node graph) is `inconclusive`: the search treats it as not failing, the mode counts and names it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec
from ci_runner.failures.outcome import ProbeOutcome
from ci_runner.modes.layers.search import ROOT, ModuleTree, probe_one, own_code_candidates, search


def refusing_backend(gm: Any, example_inputs: Any) -> Any:
    """A torch.compile backend whose compiler always raises (Dynamo may suppress it and run the frame eagerly)."""
    raise RuntimeError("refusing_backend: unsupported operator aten.addmm.default")


class _Disabled(nn.Module):
    """Its forward never reaches the backend: Dynamo is told to skip it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _probe(backend: Any, module: nn.Module, tmp_path: Path, fd2: Path | None = None) -> ProbeOutcome:
    model = nn.Sequential()
    model.add_module("m", module)
    with open(tmp_path / "t.txt", "a") as fh:
        return probe_one("m", model=model, backend=backend, calls=[((torch.randn(2, 4),), {})], all_calls=False,
                          timeout=120, timeout_fh=fh, fd2_file=str(fd2) if fd2 else None)


def test_a_module_the_backend_compiled_and_ran_passes_with_what_it_ran(tmp_path: Path) -> None:
    backend = resolve_backend(BackendSpec(id="aot", compile="aot_eager"))
    o = _probe(backend, nn.Linear(4, 4), tmp_path, fd2=tmp_path / "fd2.txt")
    assert o.status == "pass", o.message
    assert o.ran["graphs"] == 1 and o.ran["graphs_executed"] == 1 and o.ran["nodes"] >= 1, o.ran
    assert ProbeOutcome.from_json(o.to_json()).ran == o.ran  # the outcome file keeps it


def test_a_module_dynamo_never_handed_to_the_backend_is_inconclusive(tmp_path: Path) -> None:
    backend = resolve_backend(BackendSpec(id="aot", compile="aot_eager"))
    o = _probe(backend, _Disabled(), tmp_path)
    assert o.status == "inconclusive" and not o.failed, o
    assert "did not run on the backend" in o.message and "no graph" in o.message, o.message


def test_a_suppressed_compiler_error_is_inconclusive_not_pass(tmp_path: Path) -> None:
    import torch._dynamo.config

    backend = resolve_backend(BackendSpec(id="refuse", compile="tests.unit.test_layers_ran:refusing_backend"))
    with torch._dynamo.config.patch(suppress_errors=True):
        o = _probe(backend, nn.Linear(4, 4), tmp_path)
    assert o.status == "inconclusive", o
    assert "fell back to eager" in o.message or "never executed" in o.message, o.message


def test_without_suppression_the_compiler_error_is_a_failure_with_its_words(tmp_path: Path) -> None:
    backend = resolve_backend(BackendSpec(id="refuse", compile="tests.unit.test_layers_ran:refusing_backend"))
    o = _probe(backend, nn.Linear(4, 4), tmp_path, fd2=tmp_path / "fd2.txt")
    assert o.status == "fail" and o.stage == "compile", o
    assert o.message.startswith("refusing_backend: unsupported operator aten.addmm.default"), o.message
    assert o.ran["graphs"] == 1 and o.ran["graphs_executed"] == 0, o.ran


def test_the_search_treats_inconclusive_as_not_failing() -> None:
    # `b.y`: `a` is not the root's only child with children (such a wrapper is looked through, not probed)
    tree = ModuleTree.build([(ROOT, "Net", 1, True, None), ("a", "A", 1, True, None), ("a.x", "X", 1, True, None),
                             ("b", "B", 1, True, None), ("b.y", "Y", 1, True, None)])
    status = {ROOT: "fail", "a": "inconclusive", "a.x": "fail", "b": "fail", "b.y": "pass"}
    tried: list[str] = []

    def probe(name: str) -> ProbeOutcome:
        tried.append(name)
        return ProbeOutcome(name=name, status=status[name])

    result = search(tree, probe)
    assert "a.x" not in tried and result.minimal == ["b"]  # an inconclusive module's subtree is not searched
    # an inconclusive child does not prevent the own-code probe (it decides own code vs children together)
    outcomes = {ROOT: ProbeOutcome(name=ROOT, status="fail"), "a": ProbeOutcome(name="a", status="inconclusive"),
                "b": ProbeOutcome(name="b", status="pass")}
    assert own_code_candidates(tree, outcomes) == [ROOT]


@pytest.mark.slow
def test_openvino_without_testing_declines_a_one_op_module_inconclusive(tmp_path: Path) -> None:
    """OpenVINO runs a one-node graph in PyTorch eager unless `options: {testing: true}`: never a pass."""
    pytest.importorskip("openvino")
    plain = resolve_backend(BackendSpec(id="ov", compile="openvino",
                                        compile_options={"options": {"aot_autograd": True}}))
    o = _probe(plain, nn.ReLU(), tmp_path)
    assert o.status == "inconclusive", o
    assert "OpenVINO ran no partition" in o.message, o.message
    testing = resolve_backend(BackendSpec(id="ov-t", compile="openvino",
                                          compile_options={"options": {"aot_autograd": True, "testing": True}}))
    o2 = _probe(testing, nn.ReLU(), tmp_path)
    assert o2.status == "pass" and o2.ran.get("openvino_executions", 0) >= 1, o2


def _routes_kernels(fn: Any) -> Any:
    """A wrapper as the `kernels` package (a dependency of transformers since 5.25) puts around the forward of
    every module that calls a hub-kernel function: the call inside try/finally, where Dynamo cannot resume after a
    graph break, so it runs that frame eagerly and compiles the forward as a frame of its own."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        depth = [len(args)]
        try:
            return fn(*args, **kwargs)
        finally:
            depth.pop()

    return wrapped


class _OwnCode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)

    @_routes_kernels
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.q(x)) * 2)


def test_an_own_code_probe_does_not_count_the_frames_its_eager_children_leave_empty(tmp_path: Path) -> None:
    """With the children run eagerly, the wrapper's frame is skipped for the intended break (Dynamo counts a
    frame in eager): by design, not a fallback that makes the probe inconclusive."""
    backend = resolve_backend(BackendSpec(id="aot", compile="aot_eager"))
    model = nn.Sequential()
    model.add_module("m", _OwnCode())
    with open(tmp_path / "t.txt", "a") as fh:
        o = probe_one("m", model=model, backend=backend, calls=[((torch.randn(2, 4),), {})], all_calls=False,
                       timeout=120, timeout_fh=fh, eager_children=["m.q", "m.out"])
    assert o.status == "pass", o.message
    assert o.ran["graphs_executed"] >= 1, o.ran


def test_only_the_models_own_modules_name_a_call_site() -> None:
    from ci_runner.models.load import model_module_stack

    meta = {"nn_module_stack": {"a": ("L['self'].layers[0]", nn.Linear),
                                "b": ("G['__import_transformers_dot_x'].apply_rotary_pos_emb", nn.Module)}}
    assert model_module_stack(meta) == [("L['self'].layers[0]", nn.Linear)]
    assert model_module_stack({}) == []


def test_one_watched_compile_reads_the_record_the_counters_and_the_vendor_watch_as_one(fresh_dynamo: Any) -> None:
    """`Backend.compile_watched`: the compiled callable and ONE watch (`CompileWatch`) whose `not_ran` is the single
    reading (`backends.ran.not_ran_reason`). Ran: none; a frame Dynamo never handed over: no graph; a compiler
    error Dynamo suppressed: eager; compiles that join one watch are read each (`of`) and together; an eager
    backend's watch holds no record (nothing was given to compile) and the callable is the function itself."""
    import torch._dynamo.config

    aot = resolve_backend(BackendSpec(id="aot", compile="aot_eager"))
    fn, watch = aot.compile_watched(nn.Linear(4, 4))
    with watch:
        fn(torch.randn(2, 4))
    assert watch.not_ran() is None and watch.summary() == {"graphs": 1, "nodes": 1, "graphs_executed": 1}
    assert watch.ran() == watch.summary() and watch.vendor_facts() == {} and not watch.active

    skipped, never = aot.compile_watched(_Disabled())
    with never:
        skipped(torch.randn(2, 4))
    assert "no graph" in (never.not_ran() or ""), never.not_ran()

    refuse = resolve_backend(BackendSpec(id="refuse", compile="tests.unit.test_layers_ran:refusing_backend"))
    bad, eager_run = refuse.compile_watched(nn.Linear(4, 4))
    with torch._dynamo.config.patch(suppress_errors=True), eager_run:
        bad(torch.randn(2, 4))
    assert "fell back to eager" in (eager_run.not_ran() or "") or "never executed" in (eager_run.not_ran() or "")

    fresh_dynamo()  # Dynamo skips a frame whose compile it suppressed from then on (Linear.forward here)
    first, joint = aot.compile_watched(nn.Linear(4, 4))
    _second, same = aot.compile_watched(nn.Linear(4, 4), join=joint)
    with joint:
        first(torch.randn(2, 4))
    assert same is joint and len(joint.records) == 2 and joint.record is joint.records[0]
    assert joint.not_ran(of=0) is None and "no graph" in (joint.not_ran(of=1) or "")
    assert joint.not_ran() == joint.not_ran(of=1) and joint.summary()["graphs"] == 1

    module = nn.Linear(4, 4)
    same_fn, nothing = resolve_backend(BackendSpec(id="cpu")).compile_watched(module)
    with nothing:
        same_fn(torch.randn(2, 4))
    assert same_fn is module and nothing.record is None and nothing.summary() == {} and nothing.not_ran() is None
