"""Probing one op alone: synthetic inputs, the verdicts (unsupported / error / mismatch), options, parsing."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.backends import named_op_from_error as parse_named_op
from ci_runner.config import BackendSpec, spec_from_json, spec_to_json
from ci_runner.errors import ConfigError
from ci_runner.modes.ops.mode import run
from ci_runner.modes.ops.compare import compare
from ci_runner.modes.ops.inputs import build_tensors, make_tensor, with_ranges
from ci_runner.modes.ops.probe import assemble, run_probe
from ci_runner.engine.codec import encode_arg
from ci_runner.options import DEFAULT_TOLERANCE
from ci_runner.registry import parse_options
from tests.fixtures.matrices import matrix_text

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)


def _probe(op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    enc_args = [encode_arg(a) for a in args]
    enc_kwargs = {k: encode_arg(v) for k, v in kwargs.items()}
    a, k = with_ranges(op, enc_args, enc_kwargs)
    return {"id": "p0000", "op": op, "args": a, "kwargs": k, "seed": 1234, "tolerance": [1e-4, 1e-5]}


class SimBackend:
    """The parts of `backends.Backend` a probe uses, around a sim torch.compile backend (no child process)."""

    is_eager = False
    device = "cpu"

    def __init__(self, name: str, **options: Any) -> None:
        from ci_runner.sim import make_backend

        self.spec = BackendSpec(id=name, compile=name, backend_options=MappingProxyType(options))
        self._backend = make_backend(name, options)

    def compiler_backend(self) -> Any:
        return self._backend

    def compile(self, fn: Any) -> Any:
        return torch.compile(fn, backend=self._backend)

    def to_device(self, obj: Any) -> Any:
        return obj


def test_make_tensor_keeps_layout_and_is_deterministic() -> None:
    t = make_tensor([4, 6], [1, 4], "float32", -1.0, 1.0, 7)
    assert t.shape == (4, 6) and t.stride() == (1, 4) and t.dtype == torch.float32
    assert torch.equal(t, make_tensor([4, 6], [1, 4], "float32", -1.0, 1.0, 7))
    assert not torch.equal(t, make_tensor([4, 6], [1, 4], "float32", -1.0, 1.0, 8))
    assert float(t.min()) >= -1.0 and float(t.max()) < 1.0
    expanded = make_tensor([3, 5], [0, 1], "bfloat16", 0.1, 1.1, 1)  # stride 0: an expanded (overlapping) input
    assert expanded.stride() == (0, 1) and torch.equal(expanded[0], expanded[2])
    ints = make_tensor([100], [1], "int64", 0, 7, 3)
    assert int(ints.min()) >= 0 and int(ints.max()) < 7
    bools = make_tensor([2, 2], [2, 1], "bool", 0, 2, 3)
    assert bools.dtype == torch.bool
    assert make_tensor([0, 3], [3, 1], "float32", -1, 1, 0).numel() == 0
    assert make_tensor([], [], "float16", -1, 1, 0).shape == ()


def test_integer_inputs_stay_valid_indices() -> None:
    weight, ids = torch.empty(50, 8), torch.zeros(2, 40, dtype=torch.long)
    probe = _probe("aten.embedding.default", weight, ids)
    spec = probe["args"][1]["__tensor__"]
    assert (spec["low"], spec["high"]) == (0, 8)  # smallest other dimension: valid whatever it indexes
    a, k = assemble(probe["args"], probe["kwargs"], build_tensors(probe["args"], probe["kwargs"], 5), "cpu")
    torch.ops.aten.embedding.default(*a, **k)  # in range
    assert _probe("aten.log.default", torch.empty(3))["args"][0]["__tensor__"]["low"] > 0  # domain kept


def test_compare_verdicts() -> None:
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert compare(a, a.clone(), 1e-4, 1e-5) is None
    assert compare(a, a + 1e-7, 1e-4, 1e-5) is None
    assert "beyond" in compare(a, a + torch.tensor([0.0, 0.01, 0.0]), 1e-4, 1e-5)
    assert "NaN" in compare(a, torch.tensor([1.0, 2.0, 3.0]), 1e-4, 1e-5)
    assert "differ" in compare(torch.tensor([1, 2]), torch.tensor([1, 3]), 0, 0)
    assert "shape" in compare(torch.zeros(2), torch.zeros(3), 0, 0)
    assert "dtype" in compare(torch.zeros(2), torch.zeros(2, dtype=torch.float64), 0, 0)
    assert "outputs" in compare([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)], 0, 0)
    assert compare((torch.ones(2), 3), (torch.ones(2), 3), 0, 0) is None
    assert "infinities" in compare(torch.tensor([math.inf]), torch.tensor([-math.inf]), 0, 0)


def test_parse_named_op_in_each_format() -> None:
    assert parse_named_op("[sim-subset] unsupported operator aten.softplus.default in node softplus") == (
        "aten.softplus.default", "unsupported operator aten.softplus.default")
    op, phrase = parse_named_op("Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend. This")
    assert op == "aten.rsqrt.out" and phrase.startswith("Could not run 'aten::rsqrt.out'")
    assert parse_named_op("NPU lowering failed: no kernel for 'aten::softplus' (op 1)")[0] == "aten.softplus.default"
    assert parse_named_op("device lost") == (None, None)


def test_unsupported_at_compile_keeps_the_backend_text() -> None:
    out = run_probe(SimBackend("sim-subset"), _probe("aten.softplus.default", torch.empty(2, 3)),
                    compare_results=True, tolerance=(1e-4, 1e-5))
    assert out["status"] == "unsupported" and out["stage"] == "compile"
    assert out["error_type"] == "SimCompilerError"
    assert out["message"].startswith("[sim-subset] unsupported operator aten.softplus.default")
    assert out["named_op"] == "aten.softplus.default"


@pytest.mark.parametrize("via", ["fx", "dynamo"])
def test_supported_op_passes_and_is_compared(via: str) -> None:
    x = torch.empty(4, 6).t()  # non-contiguous, as recorded
    out = run_probe(SimBackend("sim-subset"), _probe("aten.mul.Tensor", x, x), compare_results=True,
                    tolerance=(1e-4, 1e-5), via=via)
    assert out["status"] == "pass" and out["compare"] == "ok", out
    multi = run_probe(SimBackend("sim-subset"), _probe("aten.split_with_sizes.default", torch.empty(4, 6), [2, 4], 1),
                      compare_results=True, tolerance=(1e-4, 1e-5), via=via)
    assert multi["status"] == "pass" and multi["compare"] == "ok", multi


def test_runtime_error_and_mismatch() -> None:
    q = torch.empty(1, 2, 4, 8)
    crash = run_probe(SimBackend("sim-crash", op="softplus"), _probe("aten.softplus.default", q),
                      compare_results=True, tolerance=(1e-4, 1e-5))
    assert crash["status"] == "error" and crash["stage"] == "run" and crash["error_type"] == "RuntimeError"
    assert "Assertion" in crash["message"] and crash["named_op"] == "aten.softplus.default"
    drift = run_probe(SimBackend("sim-drift", op="exp"), _probe("aten.exp.default", torch.empty(64)),
                      compare_results=True, tolerance=DEFAULT_TOLERANCE["float32"])
    assert drift["status"] == "mismatch" and drift["stage"] == "compare" and drift["error_type"] == "OpMismatch"
    assert drift["metrics"]["max_abs"] > 1e-4 and drift["metrics"]["numel"] == 64
    quiet = run_probe(SimBackend("sim-drift", op="exp"), _probe("aten.exp.default", torch.empty(64)),
                      compare_results=False, tolerance=DEFAULT_TOLERANCE["float32"])
    assert quiet["status"] == "pass"


@pytest.mark.parametrize("via", ["fx", "dynamo"])
def test_invalid_synthetic_inputs_are_not_blamed_on_the_backend(via: str) -> None:
    probe = _probe("aten.view.default", torch.empty(4, 6), [5, 5])  # cannot hold on CPU either
    out = run_probe(SimBackend("sim-subset"), probe, compare_results=True, tolerance=(1e-4, 1e-5), via=via)
    assert out["status"] == "probe_error", out


def test_eager_device_unsupported_op_is_the_dispatcher_error() -> None:
    from ci_runner.sim import simdev
    from ci_runner.models.torchcompat import skip_reason

    if not simdev.supported():
        pytest.skip(skip_reason("simdev"))
    simdev.register()

    class Eager:
        is_eager = True
        device = "simdev"

        def to_device(self, obj: Any) -> Any:
            return obj.to("simdev")

    ok = run_probe(Eager(), _probe("aten.mul.Tensor", torch.empty(3), torch.empty(3)), compare_results=True,
                   tolerance=(1e-4, 1e-5))
    assert ok["status"] == "pass" and ok["compare"] == "ok"
    bad = run_probe(Eager(), _probe("aten.rsqrt.default", torch.empty(3)), compare_results=True, tolerance=(1e-4, 1e-5))
    assert bad["status"] == "unsupported" and bad["stage"] == "run" and bad["error_type"] == "NotImplementedError"
    assert bad["named_op"] == "aten.rsqrt.out" and "'simdev' backend" in bad["named_text"]


def test_options_are_validated_with_suggestions() -> None:
    opts = parse_options("ops", {"probe_timeout": 5, "tolerance": {"bfloat16": [0.1, 0.05]}, "skip_ops": "aten.view*"})
    assert opts.probe_timeout == 5.0 and opts.tolerance_for("bfloat16") == (0.1, 0.05)
    assert opts.tolerance_for("float32") == DEFAULT_TOLERANCE["float32"] and opts.skip_ops == ("aten.view*",)
    with pytest.raises(ConfigError, match="did you mean 'probe_timeout'"):
        parse_options("ops", {"probe_timeot": 3})
    with pytest.raises(ConfigError, match="IR level"):
        parse_options("ops", {"ir": "llvm"})
    with pytest.raises(ConfigError, match=">= 1"):
        parse_options("ops", {"workers": 0})


def test_backend_spec_survives_the_trip_to_the_child() -> None:
    spec = BackendSpec(id="v", compile="pkg.mod:fn", imports=("pkg",), env=MappingProxyType({"A": "1"}),
                       backend_options=MappingProxyType({"deny": ["exp"]}), runs_on=("self-hosted",))
    import json

    assert spec_from_json(BackendSpec, json.loads(json.dumps(spec_to_json(spec)))) == spec


def test_dynamo_level_probe_reaches_a_torch_level_compiler() -> None:
    from tests.fixtures.plugin_ops_torchlevel import compile_fn

    class TorchLevel:
        is_eager = False
        device = "cpu"

        def compiler_backend(self) -> Any:
            return compile_fn

        def compile(self, fn: Any) -> Any:
            return torch.compile(fn, backend=compile_fn)

        def to_device(self, obj: Any) -> Any:
            return obj

    x = torch.empty(2, 5)
    for via in ("fx", "dynamo"):
        bad = run_probe(TorchLevel(), _probe("torch.cumsum", x, dim=1), compare_results=True, tolerance=(1e-4, 1e-5),
                        via=via)
        assert bad["status"] == "unsupported" and bad["error_type"] == "TorchLevelError", (via, bad)
        assert "torch.cumsum" in bad["message"]
        ok = run_probe(TorchLevel(), _probe("torch.Tensor.view", x, 10), compare_results=True, tolerance=(1e-4, 1e-5),
                       via=via)
        assert ok["status"] == "pass" and ok["compare"] == "ok", (via, ok)


def test_a_model_that_does_not_trace_is_an_error_with_the_place_not_a_traceback(mode_context: Any) -> None:
    ctx = mode_context(matrix_text(models=[{"id": "giant", "factory": "tests.fixtures.plugin_ops_models:untraceable"}],
                                   backends=[{"id": "sim-subset", "compile": "sim-subset"}]), "giant", "sim-subset")
    result = run(ctx)
    assert result.status == "error" and not result.findings
    assert "tests/fixtures/plugin_ops_models.py" in result.reason and "in forward" in result.reason
    assert "not retried with real weights on CPU" in result.reason
    assert "Traceback" not in result.reason


def test_sort_like_indices_are_checked_by_the_values_they_select() -> None:
    x = torch.tensor([3, 1, 3, 2, 1])
    ref = torch.sort(x)
    other = (ref.values.clone(), torch.tensor([4, 1, 3, 2, 0]))  # a valid order among equal keys
    assert compare(tuple(ref), other, 0, 0, "aten.sort.default", [x], None) is None
    wrong = (ref.values.clone(), torch.tensor([0, 1, 3, 2, 4]))  # selects 3 where 1 belongs
    assert "select" in compare(tuple(ref), wrong, 0, 0, "aten.sort.default", [x], None)
    # only the indices used (outputs=[1]); without the contract these differ element-wise
    assert compare(ref.indices, other[1], 0, 0, "aten.sort.default", [x], [1]) is None
    y = torch.tensor([[1.0, 5.0, 5.0]])
    assert compare(torch.tensor([1]), torch.tensor([2]), 0, 0, "aten.argmax.default", [y, 1], None) is None
    assert compare(torch.tensor([1]), torch.tensor([2]), 0, 0, "aten.add.Tensor", [y], None) is not None


def test_no_compare_for_random_outputs_and_repeated_index_writes() -> None:
    from ci_runner.modes.ops.compare import no_compare_reason

    assert "random" in no_compare_reason("aten.rand.default", [], {})
    base, src = torch.zeros(4), torch.arange(4.0)
    assert "repeated" in no_compare_reason("aten.scatter.src", [base, 0, torch.tensor([0, 0, 1, 2]), src], {})
    assert no_compare_reason("aten.scatter.src", [base, 0, torch.tensor([3, 0, 1, 2]), src], {}) is None
    assert "repeated" in no_compare_reason("aten.index_put.default", [base, [torch.tensor([1, 1])], src[:2]], {})
    assert no_compare_reason("aten.index_put.default", [base, [torch.tensor([1, 1])], src[:2], True], {}) is None


def test_only_the_used_outputs_are_probed_and_unbuildable_probes_are_probe_errors() -> None:
    x = torch.empty(2, 8)
    probe = _probe("aten.topk.default", x, 3)
    probe["outputs"] = [0]
    out = run_probe(SimBackend("sim-drift", op="none"), probe, compare_results=True, tolerance=(1e-4, 1e-5))
    assert out["status"] == "pass", out
    bad = dict(probe, op="nosuchns.nosuchop.default", imports=["no_such_module_xyz"])
    out = run_probe(SimBackend("sim-drift", op="none"), bad, compare_results=True, tolerance=(1e-4, 1e-5))
    assert out["status"] == "probe_error" and "no_such_module_xyz" in out["message"]


def test_a_graph_dynamo_restarts_on_is_not_counted_as_never_executed() -> None:
    """A float32 tensor times a 0-dim float64 tensor: Dynamo hands aot_eager a graph, restarts its analysis
    (the scalar is tensorified) and compiles a second graph, which is the one that runs. Found by the whole-zoo
    aot_eager scan, where it read `inconclusive` ("1 of 2 compiled graph(s) never executed")."""
    from ci_runner.backends import resolve_backend

    backend = resolve_backend(BackendSpec(id="aot_eager", compile="aot_eager"))
    probe = _probe("aten.mul.Tensor", torch.empty(1, 16, 320), torch.empty((), dtype=torch.float64))
    out = run_probe(backend, probe, compare_results=True, tolerance=(1e-4, 1e-5))
    assert out["status"] == "pass" and out["compare"] == "ok", out
    assert out["ran"]["graphs"] == out["ran"]["graphs_executed"] == 1, out["ran"]


def test_make_tensor_draws_the_values_of_the_out_of_place_formula() -> None:
    """Drawing in place (one float64 buffer, cast by the copy) gives bitwise the values of
    `(rand * (high - low) + low).to(dtype)`, so stored outcomes and repro scripts keep their inputs."""
    for dtype, shape, stride, low, high in [("float32", [5, 7], [1, 5], -1.0, 1.0), ("bfloat16", [3, 4], [0, 1], 0.1, 1.1),
                                            ("float16", [9], [1], -1.0, 1.0), ("complex64", [2, 2], [2, 1], -1.0, 1.0),
                                            ("int32", [4, 4], [4, 1], 0, 16), ("float64", [], [], -1.0, 1.0)]:
        got = make_tensor(shape, stride, dtype, low, high, 11)
        gen = torch.Generator().manual_seed(11)
        n = 1 + sum((s - 1) * st for s, st in zip(shape, stride))
        if dtype.startswith("int"):
            flat = torch.randint(int(low), int(high), (n,), generator=gen).to(getattr(torch, dtype))
        else:
            flat = (torch.rand(n, generator=gen, dtype=torch.float64) * (high - low) + low).to(getattr(torch, dtype))
        assert torch.equal(got.as_strided((n,), (1,)), flat), dtype


def test_copy_tensors_keeps_layout_and_values_and_is_no_view() -> None:
    from ci_runner.modes.ops.inputs import copy_tensors

    built = [make_tensor([4, 6], [1, 4], "float32", -1.0, 1.0, 7), make_tensor([3, 5], [0, 1], "bfloat16", 0.1, 1.1, 1),
             make_tensor([0, 3], [3, 1], "float32", -1, 1, 0), make_tensor([], [], "int64", 0, 7, 3)]
    for t, c in zip(built, copy_tensors(built)):
        assert (c.shape, c.stride(), c.dtype, c._base) == (t.shape, t.stride(), t.dtype, None)
        assert torch.equal(c, t) and (c.numel() == 0 or c.data_ptr() != t.data_ptr())


def test_probe_children_compile_inductor_on_their_share_of_the_cores(monkeypatch: Any) -> None:
    import os

    from ci_runner.modes.ops.probe import probe_child_env

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert probe_child_env({"A": 1}, 2) == {"A": "1", "TORCHINDUCTOR_COMPILE_THREADS": share}
    assert probe_child_env({"TORCHINDUCTOR_COMPILE_THREADS": 4}, 2)["TORCHINDUCTOR_COMPILE_THREADS"] == "4"  # the spec's
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")  # this process's: the children inherit it
    assert probe_child_env({}, 2) == {}


def test_an_op_whose_repro_verified_in_another_cell_is_not_run_again() -> None:
    """The zoo verifies one repro per op: a later architecture's finding on that op names the cell that verified
    it; an op not verified yet is still run (its finding has no `how`, so running it would raise KeyError)."""
    from ci_runner.modes.ops.mode import _verify_all
    from ci_runner.options import OpsOptions
    from ci_runner.results.model import Finding, Repro

    done = Finding(kind="op_unsupported", stage="compile", message="m", fingerprint="f1", op="aten.cumsum.default",
                   repro=Repro(path="ops/repro_cumsum.py"))
    _verify_all(lambda: 600.0, [(done, {})], OpsOptions(verify=True), {"aten.cumsum.default": "jamba"})
    assert done.repro is not None and not done.repro.verified
    assert done.repro.note == "not run again: the repro of aten.cumsum.default verified in jamba's cell"
    new = Finding(kind="op_unsupported", stage="compile", message="m", fingerprint="f2", op="aten.exp.default",
                  repro=Repro(path="ops/repro_exp.py"))
    with pytest.raises(KeyError):
        _verify_all(lambda: 600.0, [(new, {})], OpsOptions(verify=True), {"aten.cumsum.default": "jamba"})


@pytest.mark.parametrize(("tail", "signal", "status"), [
    # the probe timer's dump of a child with many threads: the "Timeout (0:00:30)!" header scrolled out of the tail
    ('unctorch/_aot_autograd/aot_autograd.py", line 1238 in aot_module_simplified\n'
     '  File "/x/torch/_dynamo/output_graph.py", line 2077 in call_user_compiler\n', None, "timeout"),
    ("Timeout (0:00:30)!\nThread 0x7f (most recent call first):\n", None, "timeout"),
    # a fatal signal's dump has the same frames: the signal decides
    ('Fatal Python error: Segmentation fault\n  File "/x/probe.py", line 12 in run\n', "SIGSEGV", "crashed"),
    # a Python traceback (", line N, in"): the child's own exit 1, a crash
    ('Traceback (most recent call last):\n  File "/x/a.py", line 3, in <module>\nSystemExit: 1\n', None, "crashed"),
], ids=["dump-without-header", "dump-with-header", "segfault", "traceback"])
def test_a_probe_the_timer_ended_is_a_timeout_even_when_the_tail_lost_the_header(tail: str, signal: str | None,
                                                                                 status: str) -> None:
    """glm4v's bicubic `grid_sampler_2d` on inductor (a ~25 s cold compile) read `crashed: exit 1` on a loaded machine."""
    from ci_runner.procs.isolate import IsolatedResult
    from ci_runner.procs.limits import HangLimits
    from ci_runner.modes.ops.probe import _crash_outcome

    res = IsolatedResult(status="crashed", exit_code=None if signal else 1, signal=signal, stderr_tail=tail)
    limits = HangLimits(first=30.0, window=30.0, factor=4.0)
    stuck = {"name": "p1", "limit_s": 120.0, "by": "second_limit", "longest_s": 30.0}  # its own watchdog's limit
    out = _crash_outcome({"id": "p1", "op": "aten.grid_sampler_2d.default"}, res, limits, stuck)
    assert out.status.value == status
    if status == "timeout":  # the same timer at the cell's deadline (nothing measured yet): cut short, no verdict
        cut = _crash_outcome({"id": "p1", "op": "aten.grid_sampler_2d.default"}, res, limits,
                             {"name": "p1", "limit_s": 500.0, "by": "time_left", "longest_s": None})
        assert cut.status.value == "not_run" and "not a hang" in cut.message
