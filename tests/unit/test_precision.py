"""Precision policies: spelling and checks (workloads/precision.py), the CPU emulation and the detection
(workloads/emulate.py), the thresholds and op tolerances they widen (modes/numerics/thresholds.py, modes/ops/probe.py)."""

from __future__ import annotations

import copy
import math
from types import MappingProxyType

import pytest
import torch

from ci_runner.config import load_matrix_text
from ci_runner.workloads.emulate import classify, emulate, resolve_policy, _probe_fn, _probe_inputs
from ci_runner.workloads.rounding import op_class, round_to
from ci_runner.errors import ConfigError
from ci_runner.modes.numerics.thresholds import LayerStats, threshold_from_stats, threshold_key
from ci_runner.options import ThresholdOptions
from ci_runner.workloads.precision import (PrecisionPolicy, check_precision, convention, detected_policy,
                                           parse_precision)

MATRIX = """version: 1
models: [{{id: m, config: llama}}]
backends:
  - {{id: b, compile: aot_eager, precision: {precision}}}
"""


def test_spellings_resolve_to_the_convention() -> None:
    bf16 = parse_precision("bfloat16")
    assert bf16.low == "bfloat16" and bf16.dtype("attention") == "bfloat16" and bf16.dtype("conv") == "bfloat16"
    assert all(bf16.dtype(c) == "float32" for c in ("softmax", "norm", "reduction", "elementwise", "kv_cache",
                                                    "accumulate"))
    table = parse_precision({"default": "bfloat16", "kv_cache": "float8_e4m3fn"})
    assert table.dtype("kv_cache") == "float8_e4m3fn" and table.low == "bfloat16"
    assert table.label() == "bfloat16 + kv_cache=float8_e4m3fn"
    auto = parse_precision(None)
    assert auto.auto and auto.is_float32 and auto.key() == {}
    assert parse_precision("float32").key() == {} and parse_precision("float16").key()["matmul"] == "float16"


@pytest.mark.parametrize(("raw", "said"), [
    ("bf16", "did you mean 'bfloat16'"),
    ({"default": "bfloat16", "softmx": "float32"}, "did you mean 'softmax'"),
    ({"norm": "bfloat17"}, "did you mean 'bfloat16'"),
    (3, "a name or a table"),
])
def test_a_misspelled_policy_is_one_error_at_its_place(raw: object, said: str) -> None:
    assert any(said in m + " " + h for _p, m, h in check_precision(raw))
    text = MATRIX.format(precision=raw if not isinstance(raw, dict) else "{" + ", ".join(f"{k}: {v}" for k, v in raw.items()) + "}")
    if isinstance(raw, int):
        return  # the schema's own message (a number is neither a string nor a mapping)
    with pytest.raises(ConfigError) as err:
        load_matrix_text(text, path="m.yaml")
    assert "m.yaml:4:" in str(err.value) and said in str(err.value) + str(getattr(err.value, "hint", ""))


def test_a_valid_policy_loads_onto_the_backend() -> None:
    matrix = load_matrix_text(MATRIX.format(precision="{default: bfloat16, kv_cache: float8_e4m3fn}"))
    assert matrix.backends[0].precision.dtype("kv_cache") == "float8_e4m3fn"


def test_the_emulation_rounds_matmul_inputs_only() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 32, generator=gen), torch.randn(32, 8, generator=gen)
    with emulate(parse_precision("bfloat16")) as mode:
        mm = a @ b
        sm = torch.softmax(a, dim=-1)
    assert torch.equal(mm, a.bfloat16().float() @ b.bfloat16().float())
    assert torch.equal(sm, torch.softmax(a, dim=-1))  # softmax stays float32
    assert mode.rounded == {"matmul": 1}
    with emulate(parse_precision("float32")) as mode:
        assert torch.equal(a @ b, a @ b)
    assert mode.rounded == {}


def test_fp8_rounding_is_scaled_per_tensor() -> None:
    x = torch.linspace(-1e-3, 1e-3, 101)  # far below fp8's smallest normal: unscaled it would flush to zero
    y = round_to(x, "float8_e4m3fn")
    assert float((y - x).norm() / x.norm()) < 0.07 and bool((y != 0).sum() > 90)
    assert op_class("aten.mm.default") == "matmul" and op_class(torch.ops.aten._softmax.default) == "softmax"


def test_detection_names_the_class_computed_low_and_never_legalises_a_float32_class() -> None:
    inputs = _probe_inputs()
    with emulate(parse_precision("bfloat16")):
        outs = _probe_fn(*inputs)
    assert {c: v["dtype"] for c, v in classify(outs, inputs).items()} == {
        "matmul": "bfloat16", "softmax": "float32", "norm": "float32", "elementwise": "float32"}
    outs = tuple(o.float() for o in _probe_fn(*[t.bfloat16() for t in inputs]))  # model.to(bfloat16): every op
    measured = {c: v["dtype"] for c, v in classify(outs, inputs).items()}
    assert measured["softmax"] == measured["norm"] == "bfloat16"
    policy = detected_policy("auto", {**measured, "matmul": "bfloat16"})
    assert policy.detected and policy.dtype("norm") == "float32" and policy.dtype("softmax") == "float32"
    assert {c: v["dtype"] for c, v in classify(_probe_fn(*inputs), inputs).items()} == dict.fromkeys(
        ("matmul", "softmax", "norm", "elementwise"), "float32")


def test_a_declared_policy_needs_no_probe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from ci_runner.config import BackendSpec

    policy, record = resolve_policy(BackendSpec(id="b", compile="aot_eager", precision=parse_precision("float16")),
                                    tmp_path)
    assert policy.low == "float16" and record["declared"] == "float16" and not list(tmp_path.iterdir())


def test_thresholds_widen_by_the_policy_spread_only_where_it_has_one() -> None:
    opts = ThresholdOptions()
    ref = {"rel": [1e-8, 2e-8], "one_minus_cos": [0.0, 0.0], "mad": [1e-9, 1e-9], "ref_absmean": [1.0, 1.0]}
    plain = threshold_from_stats(ref, opts, "float32")
    assert plain["rel"] == pytest.approx(64 * 2.0 ** -23)
    linear = threshold_from_stats(ref, opts, "float32", {"rel": [2e-3, 2.5e-3], "one_minus_cos": [3e-6, 3e-6],
                                                          "mad": [1e-3, 1e-3], "ref_absmean": [1.0, 1.0]})
    assert linear["rel"] == pytest.approx(2.5 * 2.495e-3, rel=1e-3) and linear["cos"] < plain["cos"]
    norm = threshold_from_stats(ref, opts, "float32", {"rel": [0.0, 0.0], "one_minus_cos": [0.0, 0.0],
                                                        "mad": [0.0, 0.0], "ref_absmean": [1.0, 1.0]})
    assert norm == plain  # a norm under a bf16 policy: no spread, the float32 threshold stands
    layer = LayerStats(module_class="Linear", name="l")
    layer.add("isolated", {"rel": 2e-3, "cos": 1 - 3e-6, "mad": 1e-3}, policy=True)
    assert layer.policy["isolated"]["rel"] == [2e-3] and layer.views == {}


def test_a_float32_policy_keeps_the_thresholds_key() -> None:
    base = dict(model_fingerprint={"m": 1}, inputs={"seq_len": 8}, references=[{"id": "r"}], samples=2)
    assert threshold_key(**base) == threshold_key(**base, precision=parse_precision("auto").key())
    assert threshold_key(**base, precision=parse_precision("bfloat16").key())["precision"]["matmul"] == "bfloat16"


def _probe(op: str, shapes: list[list[int]], precision: dict[str, str]) -> dict[str, object]:
    args = [{"__tensor__": {"shape": s, "stride": [s[1], 1], "dtype": "float32", "low": -2.0, "high": 2.0}} for s in shapes]
    return {"id": "p", "op": op, "key": op, "args": args + ([-1, False] if "softmax" in op else []), "kwargs": {},
            "outputs": None, "imports": [], "seed": 3, "tolerance": [1.3e-6, 1e-5], "precision": precision}


def test_an_op_probe_is_judged_against_the_op_under_the_policy() -> None:
    from ci_runner.modes.ops.probe import judge, reference, resolve_op

    bf16 = parse_precision("bfloat16").key()
    mm = _probe("aten.mm.default", [[16, 64], [64, 16]], bf16)
    ref = reference(resolve_op(mm), mm)
    a, b = ref.inputs
    target = a.bfloat16().float() @ b.bfloat16().float()  # what a correct bf16 backend returns
    assert judge(mm, ref, target, compare_results=True, tolerance=(1.3e-6, 1e-5)) == {"compare": "ok"}
    no_policy = {**mm, "precision": {}}
    assert judge(no_policy, ref, target, compare_results=True, tolerance=(1.3e-6, 1e-5))["status"] == "mismatch"
    sm = _probe("aten._softmax.default", [[8, 64]], bf16)
    ref = reference(resolve_op(sm), sm)
    low = torch.softmax(ref.inputs[0].bfloat16(), -1).float()  # a softmax in bf16: the policy keeps it float32
    verdict = judge(sm, ref, low, compare_results=True, tolerance=(1.3e-6, 1e-5))
    assert verdict["status"] == "mismatch" and "tolerance" not in verdict["metrics"]
    assert not math.isnan(verdict["metrics"]["max_abs"])


def test_the_policy_round_trips_through_a_child_payload() -> None:
    from ci_runner.config import BackendSpec, spec_from_json, spec_to_json

    spec = BackendSpec(id="b", precision=parse_precision({"default": "float16", "norm": "bfloat16"}))
    back = spec_from_json(BackendSpec, spec_to_json(spec))
    assert back.precision == spec.precision
    assert PrecisionPolicy.from_json(None) == PrecisionPolicy()
    assert convention("bfloat16")["matmul"] == "bfloat16"
    assert MappingProxyType(convention("float32")) == PrecisionPolicy().classes


def test_a_model_stored_in_bf16_rounds_every_op_result_as_eager_bf16_does() -> None:
    from ci_runner.workloads.precision import with_storage

    policy = with_storage(parse_precision("auto"), "bfloat16")
    assert not policy.is_float32 and policy.key() == {"storage": "bfloat16"}
    assert policy.label() == "float32, model in bfloat16"
    assert PrecisionPolicy.from_json(policy.to_json()) == policy
    assert with_storage(parse_precision("bfloat16"), "float32") == parse_precision("bfloat16")  # float32 model: as is
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    with torch.no_grad():  # the weights a bf16 model holds, in float32
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.no_grad():
        eager_bf16 = copy.deepcopy(model).to(torch.bfloat16)(x).float()
        exact = copy.deepcopy(model).double()(x.double()).float()
        with emulate(policy) as mode:
            emulated = model(x.float())
    assert mode.rounded["storage"] >= 4  # every op's result
    assert emulated.dtype == torch.float32
    assert torch.equal(emulated, emulated.to(torch.bfloat16).float())  # the result lies on the bf16 grid
    off_eager = float((emulated - eager_bf16).norm() / eager_bf16.norm())
    off_exact = float((emulated - exact).norm() / exact.norm())
    assert off_eager < 0.5 * off_exact, (off_eager, off_exact)  # it follows eager bf16, not float64


def test_the_emulation_leaves_the_tensors_the_mode_does_not_compute_alone() -> None:
    from ci_runner.workloads.precision import with_storage

    policy = with_storage(parse_precision("auto"), "bfloat16")
    x = torch.randn(64)
    with emulate(policy) as mode:
        with mode.switched(False):  # a dump read or a metric: not the model's own op
            read = x.clone()
        cache = torch.zeros(8)
        cache[2:4] = x[:2]  # a write through a view reaches the cache itself
        written = torch.zeros(3).add_(x[:3])  # an in-place op rounds its target where it lies
        wide = x.double() * 3  # float64 arithmetic (the metrics) is never rounded
    assert torch.equal(read, x)
    assert torch.equal(cache[2:4], x[:2].to(torch.bfloat16).float())
    assert torch.equal(written, x[:3].to(torch.bfloat16).float())
    assert torch.equal(wide, x.double() * 3)


def test_a_model_stored_in_bf16_and_loaded_wider_keeps_its_stored_weights() -> None:
    from ci_runner.config import ModelSpec
    from ci_runner.models.load import load_model

    spec = ModelSpec(id="m", config="llama", dtype="bfloat16", overrides={
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 32})
    low = load_model(spec, seed=0)
    wide = load_model(spec, seed=0, dtype="float64")
    assert low.module.dtype == torch.bfloat16 and wide.module.dtype == torch.float64
    for (name, a), (_, b) in zip(low.module.named_parameters(), wide.module.named_parameters()):
        assert torch.equal(a.double(), b), name


def test_drift_that_is_the_policy_own_is_no_finding() -> None:
    from ci_runner.modes.numerics.verdict import Layer, findings_for, verdict_of

    over = {"rel": 1e-2, "cos": 0.9999, "mad": 1e-3}
    layers = [Layer(key="", name="", module_class="M", call_index=0, idx=0, done=1, depth=0,
                    metrics={"cumulative": over, "isolated": {"rel": 0.0, "cos": 1.0, "mad": 0.0}},
                    threshold={"cumulative": {"rel": 8e-3}}, exceeded={"cumulative": ["rel"]})]
    verdict = verdict_of(layers, isolated_ran=True)  # a float32 policy: drift is a finding
    assert verdict["kind"] == "drift"
    assert len(findings_for(layers, verdict, backend_id="b", model_id="m", max_findings=5)[0]) == 1
    low = verdict_of(layers, isolated_ran=True, policy="bfloat16 (detected)")
    assert low["kind"] == "policy_drift" and "within the bfloat16 (detected) policy" in low["text"]
    assert findings_for(layers, low, backend_id="b", model_id="m", max_findings=5) == ([], 0)
    layers[0].metrics["cumulative"] = {**over, "rel": math.inf}  # an overflow is never the policy's rounding
    assert verdict_of(layers, isolated_ran=True, policy="bfloat16")["kind"] == "drift"
    layers[0].metrics["cumulative"] = over
    layers[0].metrics["isolated"] = None  # a layer not compared alone: the drift stays a finding
    assert verdict_of(layers, isolated_ran=True, policy="bfloat16")["kind"] == "drift"
