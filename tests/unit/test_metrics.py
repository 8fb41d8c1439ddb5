"""metrics.py: float64 comparison metrics, their invariants (property-based) and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ci_runner.errors import DeepviewError
from ci_runner.modes.numerics.metrics import (
    METRIC_KEYS,
    MetricsError,
    compare_outputs,
    compare_tensors,
    flag_for,
    public,
    severity,
    worst,
)

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def pairs(draw: st.DrawFn, min_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    n = draw(st.integers(min_value=min_size, max_value=40))
    a = draw(st.lists(finite, min_size=n, max_size=n))
    b = draw(st.lists(finite, min_size=n, max_size=n))
    return torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32)


@st.composite
def vectors(draw: st.DrawFn) -> torch.Tensor:
    n = draw(st.integers(min_value=1, max_value=40))
    return torch.tensor(draw(st.lists(finite, min_size=n, max_size=n)), dtype=torch.float32)


# ------------------------------------------------------------------------------------------- invariants

@settings(max_examples=150, deadline=None)
@given(vectors())
def test_identical_inputs_are_exact(a: torch.Tensor) -> None:
    m = compare_tensors(a, a.clone())
    assert m["rel"] == 0.0 and m["mad"] == 0.0 and m["max_abs"] == 0.0
    assert m["sqnr_db"] == math.inf
    if bool(a.abs().max() > 0):
        assert m["cos"] == pytest.approx(1.0, abs=1e-12)
    else:
        assert m["cos"] == 1.0
    assert severity(m) == "exact"


@settings(max_examples=150, deadline=None)
@given(pairs())
def test_cos_is_never_outside_minus_one_one(ab: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = ab
    for x, y in ((a, b), (a, a), (a, -a), (a, 3 * a)):
        c = compare_tensors(x, y)["cos"]
        assert -1.0 <= c <= 1.0


@settings(max_examples=150, deadline=None)
@given(pairs())
def test_symmetric_metrics_are_symmetric(ab: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = ab
    m1 = compare_tensors(a, b)
    m2 = compare_tensors(b, a)
    for key in ("mad", "max_abs"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-12, abs=0)
    assert m1["cos"] == pytest.approx(m2["cos"], abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(pairs(), st.sampled_from([1e-3, 0.5, 2.0, 1024.0, -1.0, -7.5]))
def test_scale_behaviour(ab: tuple[torch.Tensor, torch.Tensor], c: float) -> None:
    a, b = (t.double() for t in ab)
    m = compare_tensors(a, b)
    s = compare_tensors(a * c, b * c)
    # scale-free metrics do not move; absolute ones scale with |c|
    assert s["cos"] == pytest.approx(m["cos"], abs=1e-9)
    if math.isfinite(m["rel"]):
        assert s["rel"] == pytest.approx(m["rel"], rel=1e-9, abs=1e-300)
    else:
        assert s["rel"] == math.inf
    assert s["mad"] == pytest.approx(abs(c) * m["mad"], rel=1e-9, abs=1e-300)
    assert s["max_abs"] == pytest.approx(abs(c) * m["max_abs"], rel=1e-9, abs=1e-300)


@settings(max_examples=100, deadline=None)
@given(pairs())
def test_rel_and_sqnr_agree_and_match_definitions(ab: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = (t.double() for t in ab)
    assume(float(a.norm()) > 0 and float((a - b).norm()) > 0)
    m = compare_tensors(a, b)
    assert m["rel"] == pytest.approx(float((b - a).norm() / a.norm()), rel=1e-9)
    assert m["sqnr_db"] == pytest.approx(-20 * math.log10(m["rel"]), rel=1e-9, abs=1e-9)
    assert m["mad"] == pytest.approx(float((b - a).abs().mean()), rel=1e-9)
    assert m["max_abs"] == pytest.approx(float((b - a).abs().max()), rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(vectors(), st.floats(min_value=1e-6, max_value=1e-1))
def test_rel_grows_with_the_perturbation(a: torch.Tensor, eps: float) -> None:
    a = a.double()
    assume(float(a.norm()) > 0)
    small = compare_tensors(a, a * (1 + eps))
    big = compare_tensors(a, a * (1 + 10 * eps))
    assert small["rel"] == pytest.approx(eps, rel=1e-6)
    assert big["rel"] > small["rel"]
    assert big["cos"] == pytest.approx(1.0, abs=1e-9)  # a pure rescale keeps the direction: cos cannot see it


# ------------------------------------------------------------------------------------------- edge cases

def test_fp32_cosine_rounding_is_not_above_one() -> None:
    torch.manual_seed(0)
    x = torch.randn(4096) * 1e3
    naive = torch.nn.functional.cosine_similarity(x, x, dim=0)
    m = compare_tensors(x, x.clone())
    assert m["cos"] == 1.0 and m["cos"] <= 1.0
    assert float(naive) == pytest.approx(1.0, abs=1e-5)  # fp32 may read above 1; float64 here does not


def test_shape_mismatch_is_an_error_never_a_broadcast() -> None:
    with pytest.raises(MetricsError, match=r"shape mismatch: reference \[3, 1\] vs target \[3\]"):
        compare_tensors(torch.ones(3, 1), torch.ones(3))
    with pytest.raises(MetricsError):
        compare_tensors(torch.ones(1), torch.ones(4))
    assert issubclass(MetricsError, DeepviewError)


def test_nan_and_inf_are_reported_not_hidden() -> None:
    ref = torch.tensor([1.0, 2.0, float("nan"), float("-inf"), 3.0])
    same = ref.clone()
    m = compare_tensors(ref, same)
    assert m["nonfinite_ref"] == 2 and m["nonfinite_tgt"] == 2 and m["nonfinite_mismatch"] == 0
    assert m["rel"] == 0.0 and m["cos"] == pytest.approx(1.0)  # matching NaN/-inf count as agreement

    bad = ref.clone()
    bad[0] = float("nan")
    m = compare_tensors(ref, bad)
    assert m["nonfinite_mismatch"] == 1
    assert m["rel"] == math.inf and m["mad"] == math.inf and m["max_abs"] == math.inf and m["sqnr_db"] == -math.inf
    assert -1.0 <= m["cos"] <= 1.0
    assert severity(m) == "broken"

    flipped = ref.clone()
    flipped[3] = float("inf")  # -inf became +inf
    assert compare_tensors(ref, flipped)["nonfinite_mismatch"] == 1


def test_all_zero_and_empty_tensors() -> None:
    z = torch.zeros(5)
    m = compare_tensors(z, z.clone())
    assert (m["rel"], m["cos"], m["mad"], m["sqnr_db"]) == (0.0, 1.0, 0.0, math.inf)
    m = compare_tensors(z, torch.ones(5))
    assert m["rel"] == math.inf and m["cos"] == 0.0 and m["sqnr_db"] == -math.inf
    m = compare_tensors(torch.ones(5), z)
    assert m["rel"] == pytest.approx(1.0) and m["cos"] == 0.0
    e = torch.empty(0, 3)
    m = compare_tensors(e, e.clone())
    assert m["rel"] == 0.0 and m["cos"] == 1.0 and m["numel"] == 0


def test_extreme_magnitudes_neither_overflow_nor_underflow() -> None:
    big = torch.tensor([1e300, -2e300, 3e300], dtype=torch.float64)
    m = compare_tensors(big, big * (1 + 1e-6))
    assert m["rel"] == pytest.approx(1e-6, rel=1e-6) and m["cos"] == pytest.approx(1.0)
    tiny = torch.tensor([1e-310, 2e-310, -3e-310], dtype=torch.float64)
    m = compare_tensors(tiny, tiny * 2)
    assert m["rel"] == pytest.approx(1.0, rel=1e-3) and m["cos"] == pytest.approx(1.0, abs=1e-6)
    one = torch.tensor([3.0])
    assert compare_tensors(one, torch.tensor([-3.0]))["cos"] == -1.0


def test_integer_bool_complex_and_half_tensors() -> None:
    i = torch.tensor([1, 2, 3])
    assert compare_tensors(i, torch.tensor([1, 2, 4]))["max_abs"] == 1.0
    b = torch.tensor([True, False])
    assert compare_tensors(b, b.clone())["rel"] == 0.0
    c = torch.tensor([1 + 1j, 2 - 1j])
    m = compare_tensors(c, c * 1.01)
    assert m["rel"] == pytest.approx(0.01)
    h = torch.randn(16).half()
    assert compare_tensors(h, h.clone())["rel"] == 0.0
    with pytest.raises(MetricsError):
        compare_tensors(c, torch.ones(2))


def test_inputs_are_not_mutated() -> None:
    a = torch.tensor([1.0, float("nan"), 3.0])
    b = torch.tensor([1.5, float("nan"), 2.0])
    a0, b0 = a.clone(), b.clone()
    compare_tensors(a, b)
    assert torch.equal(a.nan_to_num(), a0.nan_to_num()) and torch.equal(b.nan_to_num(), b0.nan_to_num())


def test_compare_outputs_walks_structures_and_skips_caches() -> None:
    ref = {"logits": torch.ones(2, 3), "past_key_values": object(), "hidden": (torch.ones(2), torch.zeros(2))}
    tgt = {"logits": torch.ones(2, 3) * 1.1, "past_key_values": None, "hidden": (torch.ones(2), torch.zeros(2))}
    out = compare_outputs(ref, tgt)
    assert set(out) == {"logits", "hidden.0", "hidden.1"}
    assert out["logits"]["rel"] == pytest.approx(0.1, rel=1e-6)
    agg = worst(out.values())
    assert agg["rel"] == pytest.approx(0.1, rel=1e-6) and agg["cos"] == pytest.approx(1.0)
    with pytest.raises(MetricsError, match="structure differs"):
        compare_outputs((torch.ones(1), torch.ones(1)), (torch.ones(1),))
    assert set(compare_outputs(torch.ones(2), torch.ones(2))) == {""}


def test_worst_keeps_nan_and_picks_worst_values() -> None:
    a = {"rel": 0.1, "cos": 0.99, "mad": 1.0, "max_abs": 2.0, "sqnr_db": 20.0}
    b = {"rel": 0.2, "cos": 0.999, "mad": 0.5, "max_abs": 3.0, "sqnr_db": 14.0}
    w = worst([a, b])
    assert w == {"rel": 0.2, "cos": 0.99, "mad": 1.0, "max_abs": 3.0, "sqnr_db": 14.0}
    assert math.isnan(worst([{**a, "cos": math.nan}, b])["cos"])
    assert worst([])["rel"] == 0.0


def test_severity_levels_trust_rel_over_cos() -> None:
    base = {"max_abs": 1.0, "mad": 0.1, "sqnr_db": 0.0}
    assert severity({**base, "cos": 0.999999, "rel": 1e-5}) == "close"
    assert severity({**base, "cos": 0.9995, "rel": 1e-3}) == "drift"
    assert severity({**base, "cos": 0.995, "rel": 0.05}) == "diverged"
    # cos looks fine while rel says 57 %: the dump-bisect warning case
    assert severity({**base, "cos": 0.9998, "rel": 0.57}) == "broken"
    assert flag_for({**base, "cos": 0.9998, "rel": 0.57}) == "✗✗"
    assert severity({**base, "max_abs": 0.0, "cos": 1.0, "rel": 0.0}) == "exact"
    assert set(public({**base, "cos": 1.0, "rel": 0.0, "numel": 3})) == set(METRIC_KEYS)


def test_tensors_of_many_blocks_give_the_whole_tensor_definitions() -> None:
    """Metrics are summed block by block (`metrics.CHUNK`); across block boundaries they are still the definitions
    over the whole tensor, a non-finite value in a later block is still seen, and scaling still applies."""
    from ci_runner.modes.numerics import metrics

    n = 3 * metrics.CHUNK + 17
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, dtype=torch.float64, generator=g)
    b = (a + 1e-3 * torch.randn(n, dtype=torch.float64, generator=g)).float()
    m = compare_tensors(a, b)
    d = b.double() - a
    assert m["rel"] == pytest.approx(float(d.norm() / a.norm()), rel=1e-12)
    assert m["mad"] == pytest.approx(float(d.abs().mean()), rel=1e-12)
    assert m["max_abs"] == float(d.abs().max())
    assert m["cos"] == pytest.approx(float(a.dot(b.double()) / (a.norm() * b.double().norm())), rel=1e-12)
    late = b.clone()
    late[-1] = float("nan")
    assert compare_tensors(a, late)["nonfinite_mismatch"] == 1
    big = a * 1e200
    assert compare_tensors(big, big * (1 + 1e-6))["rel"] == pytest.approx(1e-6, rel=1e-6)
