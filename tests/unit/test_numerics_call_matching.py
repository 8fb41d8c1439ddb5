"""Issue 45: module calls matched by what they are, not by order. ModernBERT calls its rotary embedding once per
layer type in an order that follows the process's hash seed; matched by index, the calls "differ" by 1.06 and
the model is blamed for a divergence it does not have. A tiny model that calls a submodule twice, in an order a
flag controls (reference: full, sliding; target: sliding, full), must compare clean in both views."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ci_runner.modes.numerics import capture as ncap
from ci_runner.modes.numerics import views
from ci_runner.modes.numerics.store import DumpReader


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", torch.linspace(0.5, 2.0, 8))

    def forward(self, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        return torch.cos(x * self.inv) if layer_type == "full_attention" else torch.sin(x * self.inv) * 3.0


class TwoCalls(nn.Module):
    """Calls `rotary` once per layer type; `swap` reverses the order (as another hash seed does)."""

    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.rotary = Rotary()
        self.proj = nn.Linear(8, 8)
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kinds = ["sliding_attention", "full_attention"] if self.swap else ["full_attention", "sliding_attention"]
        emb = {k: self.rotary(x, k) for k in kinds}
        return self.proj(emb["full_attention"]) - emb["sliding_attention"]


def _setup(tmp_path: Path) -> tuple[DumpReader, TwoCalls]:
    torch.manual_seed(0)
    ref = TwoCalls(swap=False)
    x = torch.randn(2, 8)
    ncap.record_reference(ref, {"x": x}, tmp_path / "dump")
    target = copy.deepcopy(ref)
    target.swap = True
    return DumpReader(tmp_path / "dump"), target


def test_signatures_tell_the_calls_apart_and_the_matcher_pairs_them() -> None:
    full = ncap.call_signature((torch.ones(1), "full_attention"), {})
    sliding = ncap.call_signature((torch.ones(1), "sliding_attention"), {})
    assert full != sliding and "full_attention" in full
    assert ncap.call_signature((torch.ones(1), 3), {}) == ncap.call_signature((torch.ones(2), 7), {})  # sizes: type only
    ref = [{"key": "r", "name": "r", "sig": full}, {"key": "r#1", "name": "r", "sig": sliding}]
    assert ncap.match_calls(ref, [("r", "r", sliding), ("r#1", "r", full)]) == {"r": "r#1", "r#1": "r"}
    assert ncap.match_calls(ref, [("r", "r", "other")]) == {"r": None}  # no counterpart: not compared
    old = [{"key": "r", "name": "r"}, {"key": "r#1", "name": "r"}]  # a dump from before signatures: by index
    assert ncap.match_calls(old, [("r", "r", sliding), ("r#1", "r", full)]) == {"r": "r", "r#1": "r#1"}


def test_the_reference_dump_records_each_calls_signature(tmp_path: Path) -> None:
    reader, _ = _setup(tmp_path)
    sigs = {c["key"]: c["sig"] for c in reader.calls}
    assert "full_attention" in sigs["rotary"] and "sliding_attention" in sigs["rotary#1"]


def test_cumulative_view_pairs_calls_made_in_another_order(tmp_path: Path) -> None:
    reader, target = _setup(tmp_path)
    got: list[dict[str, Any]] = []
    sink = ncap.CompareSink(reader, got.append)
    ncap.capture_layer_outputs(target, (), {"x": reader.inputs(reader.root())[1]["x"]}, sink)
    rel = {r["key"]: float(r["metrics"]["rel"]) for r in got}
    assert set(rel) == {"", "rotary", "rotary#1", "proj"}
    assert max(rel.values()) == 0.0, rel  # by index, rotary and rotary#1 would differ by O(1)
    assert sink.moved == {"rotary": "rotary#1", "rotary#1": "rotary"}
    assert views.calls_differ(reader, sink.counts) == {}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_isolated_view_hands_each_stubbed_call_its_own_output(tmp_path: Path, compiled: bool) -> None:
    reader, target = _setup(tmp_path)
    got: list[dict[str, Any]] = []

    def runner(_name: str, module: nn.Module) -> Any:
        return torch.compile(module, backend="aot_eager") if compiled else module

    views.run_isolated_view(dict(target.named_modules()), reader, runner, got.append)
    torch._dynamo.reset()
    by_key = {r["key"]: r for r in got}
    root = by_key[""]
    assert "error" not in root, root
    # by order the model would get sin where it reads cos: a false "diverges on its own" (issue 45)
    assert float(root["metrics"]["rel"]) == 0.0, root
    assert root.get("calls_matched", "").startswith("by signature")
    assert all(float(by_key[k]["metrics"]["rel"]) == 0.0 for k in ("rotary", "rotary#1", "proj"))


def test_a_call_order_by_index_is_kept_when_nothing_tells_the_calls_apart(tmp_path: Path) -> None:
    """Same signature, same order: nothing changes (the matcher falls back to the k-th call of that signature)."""
    torch.manual_seed(0)
    ref = TwoCalls(swap=False)
    ncap.record_reference(ref, {"x": torch.randn(2, 8)}, tmp_path / "d")
    reader = DumpReader(tmp_path / "d")
    got: list[dict[str, Any]] = []
    sink = ncap.CompareSink(reader, got.append)
    ncap.capture_layer_outputs(ref, (), {"x": reader.inputs(reader.root())[1]["x"]}, sink)
    assert sink.moved == {} and max(float(r["metrics"]["rel"]) for r in got) == 0.0


def test_compiled_cumulative_view_pairs_calls_made_in_another_order(tmp_path: Path) -> None:
    """The compiled capture's hooks record each call's signature inside the graph (constants at trace time)."""
    from ci_runner.backends import resolve_backend
    from ci_runner.config import BackendSpec

    reader, target = _setup(tmp_path)
    got: list[dict[str, Any]] = []
    be = resolve_backend(BackendSpec(id="aot_eager", compile="aot_eager"))
    torch._dynamo.reset()
    views.run_cumulative_view(target, be, [reader], (), got.append, lambda v: v, None)
    torch._dynamo.reset()
    status = [r for r in got if "status" in r]
    assert status and status[0]["status"] == "ok" and status[0]["capture"] == "hooks-copy", status
    rel = {r["key"]: float(r["metrics"]["rel"]) for r in got if "metrics" in r}
    assert set(rel) == {"", "rotary", "rotary#1", "proj"}, got
    assert max(rel.values()) < 1e-6, rel  # by index: O(1) on both rotary calls


class Block(nn.Module):
    """Its sub-call has no non-tensor input: only its caller tells its calls apart."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, layer_type: str) -> torch.Tensor:
        return self.inner(x * (2.0 if layer_type == "full_attention" else -5.0))


class Nested(nn.Module):
    def __init__(self, swap: bool = False) -> None:
        super().__init__()
        self.block = Block()
        self.swap = swap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kinds = ["sliding_attention", "full_attention"] if self.swap else ["full_attention", "sliding_attention"]
        out = {k: self.block(x, k) for k in kinds}
        return out["full_attention"] * out["sliding_attention"]


def test_eager_calls_inside_a_reordered_parent_call_follow_their_parent(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = Nested()
    ncap.record_reference(ref, {"x": torch.randn(2, 8)}, tmp_path / "d")
    reader = DumpReader(tmp_path / "d")
    target = copy.deepcopy(ref)
    target.swap = True
    got: list[dict[str, Any]] = []
    sink = ncap.CompareSink(reader, got.append)
    ncap.capture_layer_outputs(target, (), {"x": reader.inputs(reader.root())[1]["x"]}, sink)
    rel = {r["key"]: float(r["metrics"]["rel"]) for r in got}
    assert set(rel) == {"", "block", "block#1", "block.inner", "block.inner#1"}
    assert max(rel.values()) == 0.0, rel  # block.inner has one signature: its caller's call says which it is
    assert sink.moved == {"block": "block#1", "block#1": "block", "block.inner": "block.inner#1",
                          "block.inner#1": "block.inner"}


def test_only_a_module_whose_reference_calls_differ_is_matched_by_what_they_are() -> None:
    """A decoder's layers (one signature each) keep their index even when the run's signature differs from the
    reference's (a cache object of another type in a compiled run): by signature they would go unmatched. A module
    whose reference calls differ (the rotary embedding per layer type), and what sits in it, are matched by
    signature."""
    ref = [{"name": "layers.0", "key": "layers.0", "sig": "kwargs.cache=DynamicCache"},
           {"name": "rotary", "key": "rotary", "sig": "args.1=str:sliding"},
           {"name": "rotary.inner", "key": "rotary.inner", "sig": ""},
           {"name": "rotary", "key": "rotary#1", "sig": "args.1=str:full"},
           {"name": "rotary.inner", "key": "rotary.inner#1", "sig": ""}]
    run = [("layers.0", "layers.0", "kwargs.cache=StaticCache"), ("rotary", "rotary", "args.1=str:full"),
           ("rotary#1", "rotary", "args.1=str:sliding")]
    assert ncap.match_calls(ref, run) == {"layers.0": "layers.0", "rotary": "rotary#1", "rotary#1": "rotary"}
    matcher = ncap.CallMatcher(ref)
    assert matcher.by_identity("rotary.inner") and not matcher.by_identity("layers.0")
    assert not matcher.by_identity("rotary_other")
