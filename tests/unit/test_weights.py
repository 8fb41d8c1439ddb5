"""Weights check: bitwise comparison per tensor, the round trip through real backends, findings."""

from __future__ import annotations

import json
import math
from types import MappingProxyType

import pytest
import torch

from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec
from ci_runner.results.model import fingerprint
from ci_runner.models.torchcompat import available, skip_reason
from ci_runner.modes.numerics.weights import WeightsReport, check_tensor, check_weights, findings_for, named_tensors
from tests.fixtures.plugin_toolbox_models import TinyNet, base


def _net() -> torch.nn.Module:
    model, _inputs = base(seed=0)
    model.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
    return model


# --------------------------------------------------------------------------------------------- check_tensor

def test_check_tensor_is_bitwise() -> None:
    a = torch.randn(4, 6)
    assert check_tensor("w", "parameter", a, a.clone()).byte_equal
    b = a.clone()
    b[1, 2] += 1e-6
    c = check_tensor("w", "parameter", a, b)
    assert not c.byte_equal
    assert c.equal_share == pytest.approx(23 / 24)
    assert c.max_abs == pytest.approx(1e-6, rel=0.2)
    z = torch.zeros(3)
    assert not check_tensor("z", "buffer", z, -z).byte_equal, "-0.0 has other bytes than 0.0"
    n = torch.tensor([float("nan"), 1.0])
    assert check_tensor("n", "buffer", n, n.clone()).byte_equal


def test_check_tensor_other_dtypes_and_shapes() -> None:
    h = torch.randn(5).to(torch.bfloat16)
    assert check_tensor("h", "parameter", h, h.clone()).byte_equal
    h2 = h.clone()
    h2[0] = -h2[0]
    assert check_tensor("h", "parameter", h, h2).equal_share == pytest.approx(0.8)
    c = torch.randn(3, dtype=torch.complex64)
    c2 = c.clone()
    c2[2] = c2[2] * 1j
    assert check_tensor("c", "buffer", c, c2).equal_share == pytest.approx(2 / 3)
    m = torch.tensor([True, False])
    assert not check_tensor("m", "buffer", m, ~m).byte_equal
    wrong = check_tensor("w", "parameter", torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float16))
    assert not wrong.byte_equal and "came back as float16 [2, 3]" in (wrong.error or "")
    assert math.isinf(wrong.max_abs)


# --------------------------------------------------------------------------------------------- round trips

def test_a_backend_that_corrupts_one_weight_is_named() -> None:
    model = _net()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    backend = resolve_backend(BackendSpec(id="bad-transfer", compile="tests.fixtures.plugin_toolbox_weights:make",
                                          backend_options=MappingProxyType({"tensor": "block.fc2.weight"})))
    report = check_weights(model, backend)
    assert report.method == "compiled"
    assert len(report.tensors) == len(named_tensors(model)) == 11  # 10 parameters + 1 buffer
    assert [t.name for t in report.mismatched] == ["block.fc2.weight"]
    bad = report.mismatched[0]
    assert bad.equal_share == pytest.approx(2 / 3, abs=0.02) and bad.max_abs == pytest.approx(0.25)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items()), "the model is not modified"
    s = report.summary()
    assert s["byte_equal"] == 10 and s["mismatched"] == ["block.fc2.weight"]
    classes = {n: type(m).__name__ for n, m in model.named_modules()}
    [f] = findings_for(report, backend_id="bad-transfer", model_id="net", module_classes=classes)
    assert f.kind == "weights_mismatch" and f.stage == "compare"
    assert f.fingerprint == fingerprint("weights_mismatch", "bad-transfer", "net", "block.fc2.weight")
    assert f.module == "block.fc2" and f.module_class == "Linear"
    assert "block.fc2.weight" in f.message and "byte-equal" in f.message
    again = WeightsReport.from_json(json.loads(json.dumps(report.to_json())))
    assert [t.name for t in again.mismatched] == ["block.fc2.weight"]


def test_a_correct_compiler_returns_every_weight_byte_equal() -> None:
    model = _net()
    report = check_weights(model, resolve_backend(BackendSpec(id="aot", compile="aot_eager")), chunk_mb=0.0005)
    assert report.method == "compiled" and len(report.tensors) == 11
    assert not report.mismatched
    assert findings_for(report, backend_id="aot", model_id="net") == []


def test_eager_cpu_transfers_nothing_and_a_device_round_trips_each_tensor() -> None:
    model = TinyNet()
    assert check_weights(model, resolve_backend(BackendSpec(id="cpu"))).method == "none"
    if not available("simdev"):
        pytest.skip(skip_reason("simdev"))
    report = check_weights(model, resolve_backend(BackendSpec(id="dev", device="simdev")))
    assert report.method == "device" and len(report.tensors) == 10 and not report.mismatched


# --------------------------------------------------------------------------------------------- in the target child

def _ctx() -> object:
    from types import SimpleNamespace

    return SimpleNamespace(cell=SimpleNamespace(backend=SimpleNamespace(id="bad-transfer"), model=SimpleNamespace(id="net")))


def test_the_target_child_runs_the_check_first_and_the_mode_reads_it_back(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`target.weights_first` (the check on the model the target child built anyway) → weights.json →
    `toolbox.weights_from_target`: the same findings and data as the check's own child gives."""
    from ci_runner.modes.numerics import target
    from ci_runner.modes.numerics.toolbox import weights_from_target

    journal: list[tuple[str, str]] = []
    monkeypatch.setattr(target, "child_journal", lambda event, name: journal.append((event, name)))
    backend = resolve_backend(BackendSpec(id="bad-transfer", compile="tests.fixtures.plugin_toolbox_weights:make",
                                          backend_options=MappingProxyType({"tensor": "block.fc2.weight"})))
    out = tmp_path / "weights.json"
    target.weights_first(_net(), backend, {"out": str(out), "chunk_mb": 256.0})
    assert journal == [("enter-module", "weights"), ("leave-module", "weights")]
    run = weights_from_target(_ctx(), out)  # type: ignore[arg-type]
    assert [f.details["tensor"] for f in run.findings] == ["block.fc2.weight"]
    assert run.findings[0].fingerprint == fingerprint("weights_mismatch", "bad-transfer", "net", "block.fc2.weight")
    assert run.findings[0].module_class == "Linear"
    assert run.data["weights"]["status"] == "mismatch" and run.data["weights"]["byte_equal"] == 10
    assert run.data["weights"]["seconds"] >= 0 and run.notes and "weights check" in run.notes[0]


def test_a_check_that_raised_crashed_or_never_ran_is_an_error_not_a_pass(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from ci_runner.modes.numerics import target
    from ci_runner.modes.numerics.toolbox import weights_from_target

    monkeypatch.setattr(target, "child_journal", lambda event, name: None)

    class Broken:
        is_eager = False
        device = "cpu"

        def compile_watched(self, fn):  # type: ignore[no-untyped-def]  # (the check compiles watched)
            raise RuntimeError("no such op\nmore")

    out = tmp_path / "weights.json"
    target.weights_first(_net(), Broken(), {"out": str(out)})
    raised = weights_from_target(_ctx(), out).data["weights"]  # type: ignore[arg-type]
    assert raised["status"] == "error" and "RuntimeError: no such op" in raised["reason"]
    out.write_text(json.dumps({"status": "error", "reason": "weights check could not run: the child crashed (SIGSEGV)"}))
    assert "SIGSEGV" in weights_from_target(_ctx(), out).data["weights"]["reason"]  # type: ignore[arg-type]
    never = weights_from_target(_ctx(), tmp_path / "none.json")  # type: ignore[arg-type]
    assert never.data["weights"]["status"] == "error" and not never.findings
