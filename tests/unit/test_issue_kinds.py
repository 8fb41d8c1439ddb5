"""Every finding kind of every registered mode that is filed renders an issue (issue 47): the kinds, their key
fields and issue groups are read from the registry, never listed here, so a mode added later is covered too."""

from __future__ import annotations

from typing import Any

import pytest

from ci_runner.github.options import FilingOptions
from ci_runner.github.render import RenderContext, group_entries, render_comment, render_issue
from ci_runner.registry import ModeSpec, issue_group, modes
from ci_runner.results.model import fingerprint

BACKEND, MODEL = "sim-b", "tiny"


def _filed() -> list[tuple[ModeSpec, Any]]:
    return [(m, k) for m in modes() for k in m.kinds if k.issue_group is not None]


def _finding(mode: ModeSpec, kind: Any) -> dict[str, Any]:
    """The least a finding of `kind` needs: its key field (`KindSpec.key`), a message, its fingerprint."""
    value = "aten.sin.default" if kind.key == "op" else "model.layers.0.mlp"
    return {"kind": kind.kind, "stage": "run", kind.key: value, "message": f"{kind.kind} in {value}: it failed",
            "fingerprint": fingerprint(kind.kind, BACKEND, MODEL, value), "phase": "decode", "step": 1,
            "metrics": {"compiled_bytes": 3 * 2**20, "ratio": 3.0}, "threshold": {"ratio": 1.5}, "details": {}}


def _entry(mode: ModeSpec, f: dict[str, Any]) -> dict[str, Any]:
    cell = f"{MODEL}@{BACKEND}"
    return {"category": "regressed", "cell": cell, "model": MODEL, "backend": BACKEND, "fingerprint": f["fingerprint"],
            "finding": f, "status": "fail", "baseline_status": "pass", "artifacts_dir": f"cells/{cell}",
            "env": {"torch": "2.13.0", "device": "cpu"}, "reason": "new finding", "mode": mode.name,
            "kind": f["kind"], "key": f.get("op") or f.get("module")}


def test_every_mode_with_issue_groups_declares_them() -> None:
    filed = _filed()
    assert {m.name for m, _ in filed} >= {"ops", "layers", "numerics", "memory", "compile"}
    for m, k in filed:
        assert k.issue_group in m.group_names, (m.name, k.kind)


@pytest.mark.parametrize("mode,kind", _filed(), ids=lambda x: getattr(x, "name", None) or getattr(x, "kind", ""))
def test_every_filed_kind_renders_an_issue(mode: ModeSpec, kind: Any) -> None:
    f = _finding(mode, kind)
    (g,) = group_entries({"entries": [_entry(mode, f)]}, layers=True)
    assert g.kind == kind.issue_group and issue_group(g.kind) is not None
    ctx = RenderContext(options=FilingOptions(), run_key="gh-1", run_url=None, artifacts_url=None, run_dir=None)
    body = render_issue(g, ctx)
    assert g.title.startswith("[deepview-ci] ") and len(g.title) > len("[deepview-ci] ")
    assert f"<!-- deepview-ci:fingerprint={g.fingerprint} -->" in body
    assert "Filed by deepview-ci" in body and f"`{f[kind.key]}`" in body
    assert render_comment(g, ctx, "recurrence").strip()


def test_a_memory_finding_says_what_was_measured_the_budget_and_the_repro() -> None:
    (mode,) = [m for m in modes() if m.name == "memory"]
    (kind,) = [k for k in mode.kinds if k.kind == "memory_regression"]
    f = _finding(mode, kind) | {"repro": {"path": "memory/repro/regression.py", "verified": True,
                                          "command": "python regression.py"}}
    (g,) = group_entries({"entries": [_entry(mode, f)]}, layers=True)
    body = render_issue(g, RenderContext(options=FilingOptions(), run_key="gh-1", run_url=None, artifacts_url=None,
                                         run_dir=None))
    assert "needs too much memory" in g.title
    assert "measured: compiled\\_bytes `3145728` (3.00 MiB)" in body and "budget: ratio `1.5`" in body
    assert "decode step 1" in body and "cells/tiny@sim-b/memory/repro/regression.py" in body
