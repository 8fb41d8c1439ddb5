"""Batch invariance: input replication, slot comparison, thresholds, and real backends (one slot-dependent)."""

from __future__ import annotations

import json
from types import MappingProxyType

import pytest
import torch

from ci_runner.backends import resolve_backend
from ci_runner.modes.numerics.batch_invariance import (
    batch_experiment,
    batched,
    default_threshold,
    evaluate,
    findings_for,
    first_row,
    other_input,
    slot_spread,
)
from ci_runner.config import BackendSpec
from ci_runner.results.model import fingerprint
from tests.fixtures.plugin_toolbox_models import base

SLOT_GELU = BackendSpec(id="slotty", compile="tests.fixtures.plugin_toolbox_batch:make",
                        backend_options=MappingProxyType({"op": "aten.gelu.default", "delta": 1e-3}))


def test_inputs_replicated_and_varied() -> None:
    kw = {"input_ids": torch.tensor([[5, 6, 7], [1, 2, 3]]), "attention_mask": torch.ones(2, 3, dtype=torch.long),
          "use_cache": False}
    row = first_row(kw)
    assert row["input_ids"].tolist() == [[5, 6, 7]] and row["use_cache"] is False
    b = batched([row] * 3)
    assert b["input_ids"].shape == (3, 3) and bool((b["input_ids"] == row["input_ids"]).all())
    other = other_input(row)
    assert other["input_ids"].tolist() == [[7, 5, 6]], "token ids rolled: another valid input"
    assert torch.equal(other["attention_mask"], row["attention_mask"]), "masks kept"
    assert torch.equal(other_input({"x": torch.tensor([[1.0, 2.0]])})["x"], torch.tensor([[2.0, 1.0]]))
    with pytest.raises(ValueError):
        first_row({"flag": True})


def test_slot_spread_compares_slot_zero_with_the_others() -> None:
    same = torch.ones(3, 2)
    off = torch.ones(3, 2)
    off[2, 1] = 1.5
    shared = torch.ones(1, 2)  # not batched: skipped
    calls = [("a", {"": same}), ("b", {"": off, "1": same}), ("rope", {"": shared})]
    rows = slot_spread(calls, 3, {"a": "A", "b": "B"})
    assert [r.key for r in rows] == ["a", "b"]
    assert rows[0].bitwise and rows[0].metrics["max_abs"] == 0.0
    assert not rows[1].bitwise and rows[1].worst_slot == 2 and rows[1].metrics["max_abs"] == 0.5
    assert rows[1].compared == 2 and rows[1].module_class == "B"


def test_evaluate_raises_thresholds_to_the_references_own_slot_spread() -> None:
    m = {"rel": 1e-4, "cos": 1 - 5e-9, "mad": 1e-5, "max_abs": 1e-4, "sqnr_db": 80.0}
    row = {"key": "l1", "module_class": "L", "order": 0, "bitwise": False, "metrics": m, "worst_slot": 1, "compared": 1}
    ok = {**row, "key": "l0", "bitwise": True, "metrics": {**m, "rel": 0.0, "cos": 1.0}}
    result = {"slots": 2, "same_input": [ok, row], "reference": []}
    v = evaluate(result, default_threshold("float32"))
    assert v["same_input"]["first_flagged"] == "l1" and v["same_input"]["first_nonbitwise"] == "l1"
    noisy_ref = {**row, "metrics": {**m, "rel": 2e-5, "cos": 1 - 2e-10}}
    v = evaluate({**result, "reference": [noisy_ref]}, default_threshold("float32"), margin=8.0)
    assert v["same_input"]["first_flagged"] is None, "8 × the reference's own spread covers it"
    assert v["same_input"]["layers"][1]["threshold"]["rel"] == pytest.approx(1.6e-4)


def test_slot_dependent_backend_is_caught_at_the_right_layer() -> None:
    model, inputs = base(seed=0)
    result = batch_experiment(model, resolve_backend(SLOT_GELU), inputs(0), slots=4, position=True)
    json.dumps(result, allow_nan=False)
    assert all(r["bitwise"] for r in result["reference"]), "eager CPU is batch-invariant on this model"
    v = evaluate(result, default_threshold())
    same = v["same_input"]
    assert same["first_flagged"] == "block.act" and same["first_nonbitwise"] == "block.act"
    assert {r["key"] for r in same["layers"] if r["flagged"]} >= {"block.act", "block.fc2", "block", "head"}
    assert not any(r["flagged"] for r in same["layers"] if r["key"] in ("embed", "block.fc1"))
    assert v["position"]["first_flagged"] == "block.act"
    findings = findings_for(v, backend_id="slotty", model_id="net")
    assert [f.module for f in findings] == ["block.act"], "one finding per module"
    f = findings[0]
    assert f.kind == "batch_variance" and f.module_class == "GELU"
    assert f.fingerprint == fingerprint("batch_variance", "slotty", "net", "block.act")
    assert f.details["worst_slot"] == 3 and f.details["experiment"] == "same_input"


def test_a_batch_invariant_backend_is_not_flagged() -> None:
    model, inputs = base(seed=0)
    result = batch_experiment(model, resolve_backend(BackendSpec(id="aot", compile="aot_eager")), inputs(0), slots=3)
    v = evaluate(result, default_threshold())
    assert v["same_input"]["first_flagged"] is None and v["same_input"]["bitwise"]
    assert findings_for(v, backend_id="aot", model_id="net") == []


@pytest.mark.slow
def test_inductor_on_cpu_is_not_flagged_on_a_tiny_llama() -> None:
    from ci_runner.config import InputSpec, ModelSpec
    from ci_runner.models.load import build_inputs, load_model

    spec = ModelSpec(id="tiny-llama", config="llama", overrides=MappingProxyType(dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128)))
    loaded = load_model(spec, seed=0)
    kwargs = build_inputs(loaded, InputSpec(seq_len=8), sample=0)
    target = load_model(spec, seed=0).module
    result = batch_experiment(target, resolve_backend(BackendSpec(id="inductor", compile="inductor")), kwargs,
                              slots=4, reference=loaded.module)
    v = evaluate(result, default_threshold())
    assert len(v["same_input"]["layers"]) > 20
    assert v["same_input"]["first_flagged"] is None, v["same_input"]
    assert findings_for(v, backend_id="inductor", model_id="tiny-llama") == []


def test_slot_spread_compares_the_given_pairs() -> None:
    """`pairs` chooses which slots are compared: slots 1 and 2 agree bit for bit while slot 0 differs."""
    t = torch.stack([torch.zeros(3), torch.ones(3), torch.ones(3)])
    calls = [("layer", {"": t})]
    default = slot_spread(calls, 3, {"layer": "Linear"})
    assert not default[0].bitwise
    only = slot_spread(calls, 3, {"layer": "Linear"}, pairs=[(1, 2)])
    assert only[0].bitwise and only[0].worst_slot == 2 and float(only[0].metrics["rel"]) == 0.0
    with pytest.raises(ValueError, match="outside"):
        slot_spread(calls, 3, {"layer": "Linear"}, pairs=[(0, 3)])
