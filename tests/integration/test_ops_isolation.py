"""Probes in isolated children: an abort, a segfault or a hang costs that probe only, and the rest still run."""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.config import BackendSpec
from ci_runner.modes.ops.inputs import with_ranges
from ci_runner.modes.ops.probe import ProbeRunner
from ci_runner.engine.codec import encode_arg
from ci_runner.registry import parse_options

pytestmark = pytest.mark.slow


def _probe(i: int, op: str, *args: Any) -> dict[str, Any]:
    a, k = with_ranges(op, [encode_arg(x) for x in args], {})
    return {"id": f"p{i:04d}", "op": op, "key": f"{op}#{i}", "args": a, "kwargs": k, "seed": i, "tolerance": [1e-4, 1e-5]}


def _run(tmp_path: Path, spec: BackendSpec, probes: list[dict[str, Any]], **opts: Any) -> tuple[dict[str, Any], list[str]]:
    events: list[str] = []
    runner = ProbeRunner(backend_spec=spec, work_dir=tmp_path / "work",
                         opts=parse_options("ops", {"workers": 1, **opts}), remaining=lambda: 600.0,
                         journal=lambda event, name: events.append(event))
    return runner.run(probes), events


X = torch.empty(2, 3)
PROBES = [_probe(0, "aten.mul.Tensor", X, X), _probe(1, "aten.softplus.default", X), _probe(2, "aten.exp.default", X),
          _probe(3, "aten.add.Tensor", X, X)]


@pytest.mark.parametrize("kind,signal,group", [("sim-abort", "SIGABRT", False), ("sim-segv", "SIGSEGV", True)])
def test_a_hard_crash_costs_one_probe(tmp_path: Path, kind: str, signal: str, group: bool) -> None:
    spec = BackendSpec(id=kind, compile=kind, backend_options=MappingProxyType({"op": "softplus"}))
    out, events = _run(tmp_path, spec, PROBES, group_testing=group)
    assert [out[p["id"]].status for p in PROBES] == ["pass", "crashed", "pass", "pass"]
    crash = out["p0001"]
    assert crash.error_type == signal and crash.stage == "run"
    assert f"[{kind}]" in crash.message and crash.named_op == "aten.softplus.default"
    # one restart with the remaining probes; with groups, one more: the crashed group's members then go alone
    assert events.count("enter-probe-batch") == (3 if group else 2)


def test_a_hang_costs_one_probe_timeout(tmp_path: Path) -> None:
    spec = BackendSpec(id="sim-hang", compile="sim-hang", backend_options=MappingProxyType({"op": "exp"}))
    out, _ = _run(tmp_path, spec, PROBES, probe_timeout=4)  # with group testing: the hung group's members go alone
    assert [out[p["id"]].status for p in PROBES] == ["pass", "pass", "timeout", "pass"]
    hang = out["p0002"]
    assert hang.error_type == "Timeout" and "hung: no progress for 2 s after" in hang.message, hang.message
    assert "(past probe_timeout, 4s)" in hang.message and "[sim-hang]" in hang.message


def test_a_slow_compile_past_probe_timeout_is_a_figure_not_a_hang(tmp_path: Path) -> None:
    """Issue 44: a compile that keeps the CPU busy past probe_timeout is still progressing: it runs on (to the
    second limit, derived from what the cell measured) and every probe passes."""
    spec = BackendSpec(id="sim-slow", compile="sim-slow", backend_options=MappingProxyType({"seconds": 5}))
    out, events = _run(tmp_path, spec, PROBES, probe_timeout=2)
    assert [out[p["id"]].status for p in PROBES] == ["pass"] * 4, [out[p["id"]].message for p in PROBES]
    assert events.count("enter-probe-batch") == 1  # one child: nothing was killed
    limits = [json.loads(x) for x in (tmp_path / "work" / "limits-000.jsonl").read_text().splitlines()]
    compiles = [r for r in limits if r["name"].startswith("g:")]
    assert compiles and compiles[0]["by"] == "time_left"  # the first compile: nothing measured yet


def test_a_backend_that_cannot_be_set_up_is_reported_not_probed(tmp_path: Path) -> None:
    spec = BackendSpec(id="missing", compile="no_such_plugin_module:compile_fn")
    runner = ProbeRunner(backend_spec=spec, work_dir=tmp_path / "w", opts=parse_options("ops", {"workers": 1}),
                         remaining=lambda: 600.0)
    out = runner.run(PROBES[:2])
    assert {o.status for o in out.values()} == {"not_run"}
    assert runner.setup_error is not None and "no_such_plugin_module" in runner.setup_error


def test_probes_split_over_two_children(tmp_path: Path) -> None:
    spec = BackendSpec(id="sim-subset", compile="sim-subset")
    probes = [_probe(i, op, X) for i, op in enumerate(["aten.exp.default", "aten.neg.default"] * 24)]
    out, events = _run(tmp_path, spec, probes, workers=2)
    assert events.count("enter-probe-batch") == 2
    assert [out[p["id"]].status for p in probes] == ["unsupported", "pass"] * 24
    few, events = _run(tmp_path, spec, PROBES, workers=2)  # too few probes to pay for a second child
    assert events.count("enter-probe-batch") == 1
    assert [few[p["id"]].status for p in PROBES] == ["pass", "unsupported", "unsupported", "pass"]
