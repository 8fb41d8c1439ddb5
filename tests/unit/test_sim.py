"""Each self-test backend fails exactly the way its documentation says, and is correct everywhere else."""

from __future__ import annotations

from collections.abc import Callable
import re
from types import MappingProxyType

import pytest
import torch

import ci_runner.sim as sim
from ci_runner.config import BackendSpec, load_matrix
from ci_runner.models.load import build_inputs, load_model
from ci_runner.backends import COULD_NOT_RUN_RE, UNSUPPORTED_RE
from ci_runner.backends import unsupported_op_from_error as parse_unsupported_op
from ci_runner.sim import SIM_BACKENDS, SimCompilerError, make_backend
from ci_runner.sim import simdev

EXAMPLE = load_matrix(None)
SIMDEV_MSG = re.compile(r"Could not run 'aten::(?P<op>[\w.]+)' with arguments from the 'simdev' backend")


pytestmark = [pytest.mark.oldtorch, pytest.mark.usefixtures("fresh_dynamo")]  # tests/conftest.py


@pytest.fixture(scope="module")
def llama():
    loaded = load_model(EXAMPLE.model("tiny-llama"))
    return loaded, build_inputs(loaded, EXAMPLE.inputs, sample=0)


def _logits(module, kw) -> torch.Tensor:
    with torch.no_grad():
        return module(**kw).logits


def _compiled_error(backend, fn, *args) -> BaseException:
    with pytest.raises(Exception) as info:
        torch.compile(fn, backend=backend)(*args)
    return info.value


def _chain(exc: BaseException):
    seen = exc
    while seen is not None:
        yield seen
        seen = getattr(seen, "inner_exception", None) or seen.__cause__


# --------------------------------------------------------------------------------------------- docs

def test_every_sim_backend_is_documented() -> None:
    doc = sim.__doc__ or ""
    table = sim.table_markdown()
    for name, info in SIM_BACKENDS.items():
        assert f"| `{name}` |" in doc, name  # the table of docs/backends.md is written from it
        assert f"| `{name}` |" in table
        assert info.reproduces and info.stage in ("compile", "run")
        for option in info.options:
            assert f"`{option}`" in doc, (name, option)
    assert set(SIM_BACKENDS) == {"sim-subset", "sim-drift", "sim-crash", "sim-abort", "sim-segv", "sim-hang", "sim-decode",
                                 "sim-slow", "sim-kvdrift", "sim-masknan", "sim-long", "sim-reuse", "sim-memhog", "sim-tp-drop", "sim-tp-dup",
                                 "sim-tp-shard", "simdev", "sim-precision"}


def test_unknown_sim_and_options() -> None:
    with pytest.raises(ValueError, match="did you mean 'sim-crash'"):
        make_backend("sim-crsh")
    with pytest.raises(ValueError, match="unknown option 'ops' .*did you mean 'op'"):
        make_backend("sim-crash", {"ops": "attention"})
    with pytest.raises(ValueError, match="dtype"):
        make_backend("sim-drift", {"dtype": "int8"})
    with pytest.raises(ValueError, match="sim-crash: unknown option .seconds.; known: op"):
        make_backend("sim-crash", {"seconds": 1})


# --------------------------------------------------------------------------------------------- sim-subset

def softplus_then_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(torch.nn.functional.softplus(x @ x), dim=0)


def test_subset_raises_at_compile_time_on_the_first_unsupported_op() -> None:
    x = torch.randn(4, 4)
    gm = torch.fx.symbolic_trace(lambda x: (softplus_then_cumsum(x),))
    with pytest.raises(SimCompilerError) as info:
        make_backend("sim-subset")(gm, [x])  # the compiler call itself raises: compile time
    assert info.value.op == "aten.softplus.default"  # the first one, not cumsum
    assert str(info.value).startswith("[sim-subset] unsupported operator aten.softplus.default in node softplus")
    # through torch.compile, Dynamo wraps it; the op stays parseable from the text
    err = _compiled_error(make_backend("sim-subset"), softplus_then_cumsum, x)
    assert type(err).__name__ == "BackendCompilerFailed"
    assert any(isinstance(e, SimCompilerError) for e in _chain(err))
    assert UNSUPPORTED_RE.search(str(err)).group("op") == "aten.softplus.default"
    assert parse_unsupported_op(str(err)) == "aten.softplus.default"


def test_subset_allowlist_options(fresh_dynamo: Callable[[], None]) -> None:
    x = torch.randn(4, 4)
    # extra_allow the first one: now the second is reported
    err = _compiled_error(make_backend("sim-subset", {"extra_allow": ["softplus"]}), softplus_then_cumsum, x)
    assert "unsupported operator aten.cumsum.default" in str(err)
    fresh_dynamo()
    out = torch.compile(softplus_then_cumsum, backend=make_backend("sim-subset", {"extra_allow": ["aten.softplus.*", "cumsum"]}))(x)
    torch.testing.assert_close(out, softplus_then_cumsum(x))
    fresh_dynamo()
    # allow replaces the default: mm is no longer in it
    err = _compiled_error(make_backend("sim-subset", {"allow": ["softplus", "cumsum"]}), softplus_then_cumsum, x)
    assert "unsupported operator aten.mm.default" in str(err)


def test_subset_runs_a_supported_model_correctly(llama) -> None:
    loaded, kw = llama
    ref = _logits(loaded.module, kw)
    out = _logits(torch.compile(loaded.module, backend=make_backend("sim-subset")), kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("model_id", "op"), [("tiny-vit", "aten.convolution.default"),
                                              ("tiny-mixtral", "aten.topk.default")])
def test_subset_stops_example_models_where_documented(model_id: str, op: str) -> None:
    loaded = load_model(EXAMPLE.model(model_id))
    kw = build_inputs(loaded, EXAMPLE.inputs)
    with pytest.raises(Exception) as info, torch.no_grad():
        torch.compile(loaded.module, backend=make_backend("sim-subset"))(**kw)
    assert parse_unsupported_op(str(info.value)) == op


# --------------------------------------------------------------------------------------------- sim-drift

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_drift_makes_norm_modules_drift_deterministically(norm: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    mod = (LlamaRMSNorm(64) if norm == "rms" else torch.nn.LayerNorm(64)).eval()
    with torch.no_grad():
        mod.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 16, 64) * 3
    compiled = torch.compile(mod, backend=make_backend("sim-drift"))
    with torch.no_grad():
        ref = mod(x)
        out1, out2 = compiled(x), compiled(x)
    assert torch.equal(out1, out2)  # deterministic
    assert out1.dtype == ref.dtype == torch.float32
    assert 1e-4 < _rel(out1, ref) < 2e-2  # bfloat16-sized error, far above float32 noise


def test_drift_leaves_other_ops_alone_and_takes_op_and_dtype(fresh_dynamo: Callable[[], None]) -> None:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(4, 16)
    with torch.no_grad():
        ref = mlp(x)
        torch.testing.assert_close(torch.compile(mlp, backend=make_backend("sim-drift"))(x), ref)
        fresh_dynamo()
        fp16 = torch.compile(mlp, backend=make_backend("sim-drift", {"op": ["gelu"], "dtype": "float16"}))(x)
        fresh_dynamo()
        bf16 = torch.compile(mlp, backend=make_backend("sim-drift", {"op": "aten.gelu.default"}))(x)
    assert 0 < _rel(fp16, ref) < _rel(bf16, ref)  # float16 keeps more mantissa than bfloat16


def test_drift_on_tiny_llama_is_small_but_measurable(llama) -> None:
    loaded, kw = llama
    ref = _logits(loaded.module, kw)
    out = _logits(torch.compile(loaded.module, backend=make_backend("sim-drift")), kw)
    assert 1e-4 < _rel(out, ref) < 5e-2


# --------------------------------------------------------------------------------------------- sim-crash

def attention(q: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True) * 2,)


def test_crash_compiles_then_fails_at_run_time() -> None:
    q = torch.randn(1, 2, 8, 16)
    compiled = make_backend("sim-crash")(torch.fx.symbolic_trace(attention), [q])  # compile: no error
    with pytest.raises(RuntimeError) as info:
        compiled(q)
    msg = str(info.value)
    assert msg.startswith("[sim-crash] Assertion `layout.is_contiguous()` failed at lowering/attention.cpp:214")
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in msg


def test_crash_on_tiny_llama_names_the_attention_op(llama) -> None:
    loaded, kw = llama
    with pytest.raises(RuntimeError, match=r"\[sim-crash\] .*while executing aten\._scaled_dot_product_flash_attention_for_cpu"), \
            torch.no_grad():
        torch.compile(loaded.module, backend=make_backend("sim-crash"))(**kw)


def test_crash_spares_graphs_without_the_op_and_takes_op(fresh_dynamo: Callable[[], None]) -> None:
    x = torch.randn(4, 4)
    fn = lambda x: torch.relu(x @ x) + 1  # noqa: E731
    torch.testing.assert_close(torch.compile(fn, backend=make_backend("sim-crash"))(x), fn(x))
    fresh_dynamo()
    with pytest.raises(RuntimeError, match=r"while executing aten\.relu\.default \(node relu\)"):
        torch.compile(fn, backend=make_backend("sim-crash", {"op": "relu"}))(x)


def test_hang_with_seconds_returns_an_error_after_waiting() -> None:
    import time

    q = torch.randn(1, 2, 8, 16)
    compiled = make_backend("sim-hang", {"seconds": 0.3})(torch.fx.symbolic_trace(attention), [q])
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"\[sim-hang\] device fence timed out"):
        compiled(q)
    assert time.monotonic() - t0 >= 0.3


def test_slow_spends_its_seconds_busy_per_graph_and_is_correct(fresh_dynamo: Callable[[], None]) -> None:
    """sim-slow: each graph's compile burns `seconds` of CPU time (not sleep), the result is eager's."""
    import resource

    x = torch.randn(4, 4)
    fn = lambda x: torch.relu(x @ x) + 1  # noqa: E731
    cpu0 = resource.getrusage(resource.RUSAGE_THREAD).ru_utime
    out = torch.compile(fn, backend=make_backend("sim-slow", {"seconds": 0.5}))(x)
    assert resource.getrusage(resource.RUSAGE_THREAD).ru_utime - cpu0 >= 0.5
    torch.testing.assert_close(out, fn(x))
    with pytest.raises(ValueError, match="seconds"):
        make_backend("sim-slow", {"seconds": -1})


# --------------------------------------------------------------------------------------------- simdev

@pytest.fixture
def dev():
    if not simdev.supported():
        from ci_runner.models.torchcompat import skip_reason

        pytest.skip(skip_reason("simdev"))
    ops = simdev.register()
    yield ops
    simdev.register()  # leave the default op set for whoever runs next


def test_simdev_runs_supported_ops_exactly_like_cpu(dev) -> None:
    a, b = torch.randn(3, 5), torch.randn(5, 2)
    da, db = a.to("simdev"), b.to("simdev")
    assert da.device.type == "simdev" and da.device == torch.device("simdev:0")
    out = torch.nn.functional.silu(da @ db + 1.5).sum(dim=0)
    assert out.device.type == "simdev"
    assert torch.equal(out.cpu(), torch.nn.functional.silu(a @ b + 1.5).sum(dim=0))
    assert (da[0, 0] * 2).item() == pytest.approx(float(a[0, 0] * 2))
    assert torch.equal(da.transpose(0, 1).reshape(-1).cpu(), a.transpose(0, 1).reshape(-1))


def test_simdev_rejects_an_unsupported_op_with_pytorchs_message(dev) -> None:
    assert "rsqrt" not in dev and "_softmax" not in dev
    x = torch.rand(4).to("simdev")
    with pytest.raises(NotImplementedError) as info:
        torch.rsqrt(x)
    msg = str(info.value)
    assert msg.startswith("Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend.")
    assert COULD_NOT_RUN_RE.search(msg).group("backend") == "simdev"
    assert parse_unsupported_op(msg) == "aten.rsqrt.out"
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device, .* simdev:0 and cpu!"):
        x + torch.ones(4)


def test_simdev_compiles_with_fake_tensors_and_still_refuses_what_it_lacks(dev) -> None:
    """torch.compile traces simdev tensors (FakeTensors built over them: simdev's `_fake_kernel`) and runs the graph
    on simdev; before, any compile failed with "... found at least two devices, simdev:0 and meta!"."""
    x = torch.rand(3, 4)
    torch._dynamo.reset()
    out = torch.compile(lambda t: (t * 2 + 1).sum(-1), backend="aot_eager")(x.to("simdev"))
    assert out.device.type == "simdev" and torch.equal(out.cpu(), (x * 2 + 1).sum(-1))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend"):
        torch.compile(lambda t: torch.rsqrt(t + 1), backend="aot_eager")(x.to("simdev"))


def test_simdev_tiny_llama_moves_then_fails_at_rmsnorm(dev, llama) -> None:
    loaded = load_model(EXAMPLE.model("tiny-llama"))
    kw = build_inputs(loaded, EXAMPLE.inputs)
    module = loaded.module.to("simdev")
    assert all(p.device.type == "simdev" for p in module.parameters())
    assert all(isinstance(p, torch.nn.Parameter) for p in module.parameters())
    dkw = {k: v.to("simdev") if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    with pytest.raises(NotImplementedError) as info, torch.no_grad():
        module(**dkw)
    assert SIMDEV_MSG.search(str(info.value)).group("op") == "rsqrt.out"


def test_simdev_with_all_ops_allowed_matches_cpu(dev, llama) -> None:
    ref_model, kw = llama
    ref = _logits(ref_model.module, kw)
    ops = simdev.register(extra_allow=["rsqrt", "_softmax"])
    assert {"rsqrt", "_softmax", "_safe_softmax"} <= ops
    loaded = load_model(EXAMPLE.model("tiny-llama"))  # same seed: same weights
    module = loaded.module.to("simdev")
    out = _logits(module, {k: v.to("simdev") if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)  # math attention vs CPU flash: tiny diffs


def test_simdev_options_and_backend_resolution(dev) -> None:
    from ci_runner.backends import resolve_backend

    ops = simdev.register(deny=["mm", "addmm"])
    assert "rsqrt" in ops and "mm" not in ops  # an explicit deny replaces the default one
    with pytest.raises(NotImplementedError, match=r"Could not run 'aten::mm\.out' .* 'simdev' backend"):
        torch.randn(2, 2).to("simdev") @ torch.randn(2, 2).to("simdev")
    assert simdev.op_set(allow=["add.Tensor", "view"], extra_allow=["softplus"]) >= {"add.Tensor", "view", "softplus"}
    with pytest.raises(ValueError, match="not an ATen operator"):
        simdev.op_set(extra_allow=["definitely_not_an_op"])
    b = resolve_backend(BackendSpec(id="sd", device="simdev",
                                    backend_options=MappingProxyType({"extra_allow": ["rsqrt"]})))
    assert b.is_eager and "rsqrt" in simdev.registered_ops() and "_softmax" not in simdev.registered_ops()
    moved = b.to_device({"x": torch.ones(2), "m": torch.nn.Linear(2, 2)})
    assert moved["x"].device.type == "simdev" and moved["m"].weight.device.type == "simdev"
    assert "deepview-ci" in b.versions()
