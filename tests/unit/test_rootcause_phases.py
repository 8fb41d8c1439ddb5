"""Issue 45: causes counted once. The same error failing the forward and several phases is one root-cause group,
keyed past a backend's boilerplate first line everywhere; two different run-time fallbacks stay two groups.
Fabricated findings shaped as the modes make them (layers/phases.py, ops/phases.py, compile/checks.py)."""

from __future__ import annotations

import copy

from ci_runner.backends import boilerplate_lines
from ci_runner.results.model import CellResult, Finding, ModeResult, Results
from ci_runner.results.rootcause import root_causes, signature

BOILER = "JIT compilation failed. See diagnostics."
SDPA = "error: failed to legalize operation 'torch.aten._scaled_dot_product_flash_attention_for_cpu'"
TOPK = "error: 'torch.aten.topk' op result type mismatch"
IREE_TB = ('Traceback (most recent call last):\n'
           '  File "/v/lib/python3.12/site-packages/iree/turbine/runtime/launch.py", line 292, in _compile\n'
           '    raise RuntimeError("JIT compilation failed. See diagnostics.")\n'
           'RuntimeError: JIT compilation failed. See diagnostics.\n')


def _forward(module: str, cause: str) -> Finding:
    """A layers-mode finding of the single forward (layers/mode.py: message_full, traceback_tail)."""
    return Finding(kind="layer_failure", stage="compile", module=module, module_class="LlamaAttention",
                   error_type="RuntimeError", message=f"{module} fails alone at compile: RuntimeError: {BOILER}",
                   fingerprint=f"fwd-{module}", details={"message_full": f"{BOILER}\n{cause}", "traceback_tail": IREE_TB})


def _phase(phase: str, cause: str, *, traceback: bool = True, step: int | None = None) -> Finding:
    """A layers-mode phase finding (layers/phases.py): the phase's words in `message`, the error in details."""
    where = f"{phase} step {step}" if step else phase
    details = {"call": where, "message_full": f"RuntimeError: {BOILER}\n{cause}"}
    if traceback:
        details["traceback_tail"] = IREE_TB
    return Finding(kind="layer_failure", stage="compile", module="model.layers.0.self_attn",
                   module_class="LlamaAttention", error_type="RuntimeError", phase=phase, step=step,
                   message=f"{where} fails on the backend: RuntimeError: {BOILER}", fingerprint=f"ph-{phase}",
                   details=details)


def _results(*cells: tuple[str, dict[str, list[Finding]]]) -> Results:
    return Results(cells=[CellResult(id=cid, model=cid.split("@")[0], backend=cid.split("@")[1], status="fail",
                                     modes={m: ModeResult(status="fail", findings=fs) for m, fs in modes.items()})
                          for cid, modes in cells])


def test_one_error_in_the_forward_and_three_phases_is_one_cause() -> None:
    found = [_forward("model.layers.0.self_attn", SDPA), _phase("prefill", SDPA), _phase("decode", SDPA, step=1),
             _phase("long", SDPA, traceback=False)]  # one kept no traceback: it joins the group all the same
    fps = [f.fingerprint for f in found]
    causes = root_causes(_results(("llama4@iree", {"layers": found})), boilerplate=boilerplate_lines())
    assert len(causes) == 1, causes  # SDPA 3 -> 1 (issue 45)
    c = causes[0]
    assert c["count"] == 4 and c["message"] == SDPA and c["raised_in"].startswith("iree")
    assert {f.details["signature"] for f in found} == {c["signature"]}
    assert [f.fingerprint for f in found] == fps  # grouping never touches a finding's fingerprint


def test_phase_groups_are_keyed_past_the_boilerplate_line_and_different_causes_stay_apart() -> None:
    found = [_phase("prefill", SDPA), _phase("decode", TOPK, step=1), _phase("batch", TOPK)]
    causes = root_causes(_results(("gpt-oss@iree", {"layers": found})), boilerplate=boilerplate_lines())
    assert sorted(c["message"] for c in causes) == sorted([SDPA, TOPK])  # never "JIT compilation failed."
    assert all(BOILER not in c["message"] for c in causes)
    assert {c["message"]: c["count"] for c in causes} == {SDPA: 1, TOPK: 2}


def test_a_symbolic_op_failing_in_four_phases_of_four_models_is_one_cause() -> None:
    err = "TypeError: unsupported operand type(s) for max: 'SymInt' and 'SymInt'"
    cells = []
    for model, phase in (("a", "prefill"), ("b", "decode"), ("c", "batch"), ("d", "long")):
        f = Finding(kind="unsupported_op", stage="compile", op="sym_max", error_type="TypeError",
                    message=f"{phase}: sym_max on a dynamic size fails: {err}; Dynamo hands the backend this "
                            f"symbolic-shape function when it recompiles a call with a new length",
                    fingerprint="fp-sym_max", details={"symbolic": True, "phase": phase, "message_full": err})
        cells.append((f"{model}@openvino", {"ops": [f]}))
    causes = root_causes(_results(*cells), boilerplate=boilerplate_lines())
    assert len(causes) == 1 and causes[0]["count"] == 4 and len(causes[0]["cells"]) == 4  # sym_max 4 -> 1


def _fallback(phase: str, cause: str | None) -> Finding:
    """compile/checks.py's run-time fallback: no error type; the backend's words in `details.cause`."""
    details: dict[str, object] = {"openvino_partitions": 3, "perm_fallback": 1}
    if cause is not None:
        details["cause"] = cause
    return Finding(kind="eager_fallback", stage="run", op="(partition)", phase=phase,
                   message="1 partition(s) failed at run time and ran in PyTorch eager from then on",
                   fingerprint="fp-partition", details=details)


def test_two_different_run_time_fallbacks_are_two_causes_one_fallback_in_two_phases_is_one() -> None:
    words = "OpenVINO's execution failed and the graph ran in PyTorch eager: OpenVINO execution failed with {}"
    a = words.format("Exception from src/core/shape_inference: Broadcast: incompatible shapes [16] and [64]")
    b = words.format("Exception from src/plugins/intel_cpu: Gather: index 70 out of range")
    found = [_fallback("long", a), _fallback("batch", a), _fallback("decode", b)]
    causes = root_causes(_results(("llama4@openvino", {"compile": found})), boilerplate=boilerplate_lines())
    assert sorted(c["count"] for c in causes) == [1, 2]
    assert signature(found[0]).id == signature(found[1]).id != signature(found[2]).id
    # without the backend's words (an older result) they are keyed as before: kind and op
    old = [_fallback("long", None), _fallback("batch", None)]
    assert signature(old[0]).id == signature(copy.deepcopy(old[1])).id
    assert signature(old[0]).message == "eager_fallback in (partition)"
