"""`modes/ops/reach.py` without a child: the output comparison, the finding's words, the time floor, and the
injection itself on a real backend (aot_eager) in this process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ci_runner.modes.ops.reach import Inject, apply, clause, measure, output_effect
from ci_runner.options import OpsOptions
from ci_runner.report.view import reach_words
from ci_runner.results.model import Finding, fingerprint
from tests.fixtures.matrices import matrix_text

TOL = {"float32": (1e-4, 1e-5), "int64": (0.0, 0.0)}


def _mismatch(op: str = "aten.cumsum.default") -> Finding:
    return Finding(kind="op_mismatch", stage="compare", message=f"OpMismatch: {op} differs from CPU eager\nmore",
                   fingerprint=fingerprint("op_mismatch", "b", op), op=op)


def test_output_effect_judges_each_tensor_by_its_dtypes_tolerance() -> None:
    e = torch.tensor([1.0, 2.0, 4.0])
    within = output_effect([e], [e + 1e-6], TOL)
    assert within["reaches"] is False and 0 < within["max_abs"] < 2e-6
    beyond = output_effect([e, torch.tensor([1, 2])], [e + 0.5, torch.tensor([1, 2])], TOL)
    assert beyond["reaches"] is True and beyond["max_abs"] == pytest.approx(0.5) and beyond["rel"] == pytest.approx(0.125)
    ints = output_effect([torch.tensor([1, 2])], [torch.tensor([1, 3])], TOL)  # integers: exactly
    assert ints["reaches"] is True and ints["max_abs"] == 1.0
    nan = output_effect([e], [torch.tensor([1.0, float("nan"), 4.0])], TOL)
    assert nan["reaches"] is True and "NaN" in nan["problem"]
    json.dumps(nan, allow_nan=False)  # non-finite values never reach the result file


def test_the_clause_goes_on_the_first_line_and_the_cause_keeps_the_error() -> None:
    f = _mismatch()
    apply([f], {"aten.cumsum.default": {"reaches_output": False, "output_effect": {"max_abs": 0.0, "rel": 0.0},
                                        "calls": 2, "differing_calls": 2}})
    assert f.message == ("OpMismatch: aten.cumsum.default differs from CPU eager; its mismatch does not reach the "
                         "model's output for these inputs (max abs 0)\nmore")
    assert f.details["message_full"] == "OpMismatch: aten.cumsum.default differs from CPU eager\nmore"
    assert f.fingerprint == fingerprint("op_mismatch", "b", "aten.cumsum.default")
    assert reach_words(f.details) == "its mismatch does not reach the model's output for these inputs (max abs 0)"
    assert clause({"reaches_output": None, "note": "x"}) == ""
    assert reach_words({"reaches_output": None, "reaches_output_note": "not measured: x"}) == (
        "whether it reaches the model's output is unknown: not measured: x")
    assert reach_words({}) is None


def test_under_thirty_seconds_left_no_child_starts(mode_context: Any, tmp_path: Path) -> None:
    matrix = matrix_text(models=[{"id": "m", "factory": "tests.fixtures.plugin_ops_models:cumsum_masked"}],
                         backends=[{"id": "b", "compile": "aot_eager"}])
    ctx = mode_context(matrix, "m", "b", seconds=20)
    f, other = _mismatch(), Finding(kind="unsupported_op", stage="compile", message="x", fingerprint="f", op="aten.x")
    data = measure(ctx, OpsOptions(), [f, other], tmp_path / "reach")
    assert data is not None and data["status"] == "skipped"
    assert f.details["reaches_output"] is None and "cell's time left" in f.details["reaches_output_note"]
    assert "reaches_output" not in other.details and not (tmp_path / "reach").exists()
    assert measure(ctx, OpsOptions(), [other], tmp_path / "reach") is None  # a cell without mismatches pays nothing


def test_inject_computes_every_call_of_the_op_on_the_backend(fresh_dynamo: Any) -> None:
    from ci_runner.backends import resolve_backend
    from ci_runner.config import BackendSpec
    from tests.fixtures.plugin_ops_models import cumsum_reaches

    wrong = resolve_backend(BackendSpec(id="w", compile="tests.fixtures.plugin_ops_wrong:make",
                                        backend_options={"offset": 2}))
    model, kwargs = cumsum_reaches()
    mode = Inject(torch.ops.aten.cumsum.default, wrong)
    with torch.no_grad():
        plain = model(**kwargs)
        with mode:
            injected = model(**kwargs)
        torch.cumsum(torch.ones(3), 0)  # outside the mode: not counted
    assert mode.calls == 1 and mode.differing == 1
    assert torch.allclose(injected - plain, torch.full_like(plain, 2.0))


def test_an_in_place_op_is_computed_from_its_inputs_before_the_call_and_the_model_reads_the_backends_value(
        fresh_dynamo: Any) -> None:
    """`x.mul_(2)` as a statement: the model reads `x`, not the return value. The backend (mul off by 1, reached
    through the in-place op's functionalised graph) computes from `x` as it was before the call, and `x` takes that
    value, so the injected run differs from the plain one by exactly the offset."""
    from ci_runner.backends import resolve_backend
    from ci_runner.config import BackendSpec

    wrong = resolve_backend(BackendSpec(id="w", compile="tests.fixtures.plugin_ops_wrong:make",
                                        backend_options={"op": "aten.mul.Tensor", "offset": 1, "input_dtype": ""}))

    def model(t: torch.Tensor) -> torch.Tensor:
        x = t.clone()
        x.mul_(2.0)  # the return value unused
        return x + 0

    t = torch.arange(4.0)
    mode = Inject(torch.ops.aten.mul_.Tensor, wrong)
    with torch.no_grad():
        plain = model(t)
        with mode:
            injected = model(t)
    assert mode.calls == 1 and mode.differing == 1
    assert torch.equal(plain, t * 2) and torch.equal(injected, t * 2 + 1)  # from the inputs before the call, once
    assert torch.equal(t, torch.arange(4.0))  # the caller's tensor untouched
