"""The compile mode's warm-up rule, and a figure its torch's trace did not give (unknown, never 0) (`modes/compile/checks.py`): automatic dynamic shapes' first recompile of a
function after the warm-up is expected; a second recompile of it, a static one, or one the backend then failed on is
a `compile_after_warmup` finding. Pure: signals built by hand as Dynamo's trace gives them (no compile)."""

from __future__ import annotations

import json
from typing import Any

from ci_runner.watch.dynamotrace import Event, TraceWatch
from ci_runner.modes.compile.checks import PhaseSignals, expected_recompiles, warmup_findings, warmup_of
from ci_runner.options import CompileOptions
from ci_runner.workloads.phases import Phase
from ci_runner.registry import parse_options


def _sig(phase: Phase | None, calls: list[tuple[str, int]], events: list[Event], failed: str | None = None) -> PhaseSignals:
    sig = PhaseSignals(name=phase.name if phase else "forward", label="", phase=phase)
    sig.per_call = [{"call": c, "graphs": g, "ran": 1, "compile_s": 0.0} for c, g in calls]
    sig.events, sig.failed_call = events, failed
    if failed:
        sig.error = "BackendCompilerFailed: sym_max"
    return sig


def _rc(call: str, frame: str, dynamic: bool, reason: str = "0/0: tensor 'input_ids' size mismatch at index 1. "
                                                              "expected 6, actual 1") -> Event:
    return Event("recompile", call, frame, reason=reason, source="model.py:10", dynamic=dynamic)


def _kinds(opts: CompileOptions, sig: PhaseSignals) -> list[Any]:
    return [(f.details["call"], f.details["dynamic"] if "dynamic" in f.details else None) for f in warmup_findings("b", opts, sig)]


DEFAULT = parse_options("compile", {})
DECODE = Phase(name="decode", steps=3)


def test_the_default_warmup_is_the_first_call_and_the_first_decode_step() -> None:
    assert DEFAULT.warmup_calls is None and DEFAULT.dynamic_recompile_expected is True
    assert warmup_of(DEFAULT, _sig(DECODE, [], [])) == 2 and warmup_of(DEFAULT, _sig(None, [], [])) == 1
    assert warmup_of(parse_options("compile", {"warmup_calls": 3}), _sig(DECODE, [], [])) == 3


def test_a_second_sample_of_another_length_recompiling_dynamic_is_expected() -> None:
    sig = _sig(None, [("forward", 1), ("forward sample 1", 1)], [_rc("forward sample 1", "0/1", True)])
    assert expected_recompiles(DEFAULT, sig, {"forward sample 1"}) == {0}
    assert _kinds(DEFAULT, sig) == []
    strict = parse_options("compile", {"dynamic_recompile_expected": False})
    assert _kinds(strict, sig) == [("forward sample 1", True)]


def test_a_shared_decorators_frame_recompiling_once_per_decorated_forward_is_expected() -> None:
    """transformers' `wrapper` (generic.py) is one code object for every decorated forward: tiny Llava's second sample
    recompiles it once for the model's forward and once for its language model's (each entry's own size changed;
    checked by hand with TORCH_LOGS=recompiles), which is not its dynamic shapes settling."""
    outer = _rc("forward sample 1", "0/3", True, "0/2: ___check_obj_id(func.__code__, 1)")
    outer.resized = ["0/0"]
    inner = _rc("forward sample 1", "0/4", True, "0/3: len(kwargs) == 3")
    inner.resized = ["0/1"]
    sig = _sig(None, [("forward", 3), ("forward sample 1", 2)], [outer, inner])
    assert expected_recompiles(DEFAULT, sig, {"forward sample 1"}) == {0, 1} and _kinds(DEFAULT, sig) == []
    again = _rc("forward sample 1", "0/5", True, "0/4: len(kwargs) == 10")
    again.resized = ["0/0"]  # the model's forward's entry again: settled, then recompiled
    assert _kinds(DEFAULT, _sig(None, [("forward", 3), ("forward sample 1", 2)], [outer, inner, again])) == [
        ("forward sample 1", True)]
    watch = TraceWatch()  # Dynamo's recompile_reasons payload: one failed guard per cache entry, newest first
    watch.take({"artifact": {"name": "recompile_reasons"}, "frame_id": 0, "frame_compile_id": 2},
               json.dumps(["0/1: n == 2  # return x * n\nUser stack trace:\n  File", "0/0: tensor 'x' size mismatch at "
                           "index 0. expected 4, actual 6"]))
    (e,) = watch.events
    assert e.reason.startswith("0/1: n == 2") and e.resized == ["0/0"]


def test_a_recompile_after_the_dynamic_shapes_settled_or_a_static_one_is_a_finding() -> None:
    calls = [("prefill", 1), ("decode step 1", 1), ("decode step 2", 1), ("decode step 3", 0)]
    settled = _sig(DECODE, calls, [_rc("decode step 1", "0/1", True), _rc("decode step 2", "0/2", True,
                                                                          "0/1: cache_len == 7")])
    assert _kinds(DEFAULT, settled) == [("decode step 2", True)]
    assert "had settled" in warmup_findings("b", DEFAULT, settled)[0].message
    static = _sig(DECODE, [("prefill", 1), ("decode step 1", 1), ("decode step 2", 0), ("decode step 3", 1)], [_rc("decode step 3", "1/1", False, "1/0: L['n'] == 3")])
    assert _kinds(DEFAULT, static) == [("decode step 3", False)]


def test_a_dynamic_recompile_the_backend_then_fails_on_is_a_finding_linked_to_the_workload() -> None:
    sig = _sig(None, [("forward", 1), ("forward sample 1", 1)], [_rc("forward sample 1", "0/1", True)],
               failed="forward sample 1")
    (f,) = warmup_findings("b", DEFAULT, sig)
    assert f.details["workload_finding"] == "layers:forward" and f.details["changed"] == "input_ids"


def test_a_recompile_in_the_warmup_the_backend_fails_on_is_a_finding() -> None:
    """The sliding-window decoder on IREE: decode step 1 recompiles with a dynamic length, then the backend fails."""
    sig = _sig(DECODE, [("prefill", 1), ("decode step 1", 0)], [_rc("decode step 1", "0/1", True)],
               failed="decode step 1")
    (f,) = warmup_findings("b", DEFAULT, sig)
    assert f.details["call"] == "decode step 1" and f.details["dynamic"] and "after the warm-up" not in f.message
    assert "settled" not in f.message and "the backend then failed on that call" in f.message
    assert f.details["workload_finding"] == "layers:decode"


def test_a_figure_the_trace_did_not_give_is_unknown_not_zero() -> None:
    """Dynamo counted a graph break and compiled twice, but no break, recompile or metrics record came (an older
    torch's structured trace): those figures are None with the reason, and the history's figures leave them out."""
    from ci_runner.modes.compile.mode import figures_of

    sig = _sig(None, [("forward", 2), ("forward sample 1", 1)], [])
    sig.counters = {"graph_break": {"Tensor.item()": 1}, "frames": {"total": 3, "ok": 3}}
    row = sig.row()
    assert row["graph_breaks"] is None and row["recompiles"] is None and row["compile_s"] is None
    assert set(row["unknown"]) == {"graph_breaks", "recompiles", "compile_s", "eager_after_limit"}
    assert "dynamo_graph_break_reason" in row["unknown"]["graph_breaks"]
    assert figures_of({"forward": row}) == {"graphs.forward": 0, "eager_fallbacks.forward": 0}
    sig.events = [Event("compile", "forward", "0/0", seconds=0.5), Event("graph_break", "forward", "0/0",
                                                                         source="m.py:3")]
    known = sig.row()
    assert "unknown" not in known and known["graph_breaks"][0]["source"] == "m.py:3" and known["recompiles"] == []
