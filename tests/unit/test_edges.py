"""A broken module of this package is an error, never a silently missing feature; the backend facts in one place."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import MappingProxyType

import pytest

import ci_runner.run.aggregate as aggregate
import ci_runner.github.issues as issues
from ci_runner.backends import (
    backend_recipe,
    named_op_from_error,
    simdev_options,
    unsupported_op_from_error,
)
from ci_runner.config import BackendSpec
from ci_runner.engine.envinfo import env_report
from ci_runner.results.model import Results


@pytest.mark.parametrize(("module", "broken"), [
    (aggregate, "ci_runner.report"),
    (issues, "ci_runner.github.actions"),
])
def test_a_broken_module_of_the_package_fails_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                     module: object, broken: str) -> None:
    """Before: aggregate wrote results.json and silently no report; issues skipped the step outputs."""
    monkeypatch.setitem(sys.modules, broken, None)  # what a failing import of that module looks like
    try:
        with pytest.raises(ImportError):
            importlib.reload(module)  # type: ignore[arg-type]
            if module is aggregate:
                aggregate.write_report_dir(Results(cells=[]), tmp_path)
            else:
                issues._publish(issues.FilingReport(repo="o/r"), {"GITHUB_OUTPUT": str(tmp_path / "o")}, "")
    finally:
        monkeypatch.undo()
        importlib.reload(module)  # type: ignore[arg-type]


def test_write_report_dir_writes_every_report(tmp_path: Path) -> None:
    written = aggregate.write_report_dir(Results(cells=[], tool_version="t"), tmp_path)
    assert {"results", "junit", "summary", "html"} <= set(written)
    assert all(p.is_file() for p in written.values())


def test_env_report_says_why_the_backends_are_unavailable() -> None:
    """Before: any ImportError (a broken torch, or a bug in the package) became 'unavailable in this installation'."""

    def broken() -> list[dict[str, str]]:
        raise ImportError("cannot import name 'list_backends' from 'torch._dynamo'")

    report = env_report(broken)
    assert report["backends"].startswith("unavailable: ImportError: cannot import name 'list_backends'")
    assert env_report(lambda: [{"name": "x", "kind": "y"}])["backends"] == [{"name": "x", "kind": "y"}]


def _spec(**kw: object) -> BackendSpec:
    kw.setdefault("id", "b")
    for key in ("backend_options", "compile_options", "env"):
        kw[key] = MappingProxyType(dict(kw.get(key) or {}))  # type: ignore[call-overload]
    return BackendSpec(**kw)  # type: ignore[arg-type]


def test_simdev_options_rule() -> None:
    assert simdev_options(_spec(device="simdev", backend_options={"deny": ["rsqrt"]})) == {"deny": ["rsqrt"]}
    both = _spec(device="simdev", compile="sim-subset", backend_options={"allow": ["mm"], "simdev": {"deny": ["mm"]}})
    assert simdev_options(both) == {"deny": ["mm"]}
    assert simdev_options(_spec(device="simdev", compile="sim-subset", backend_options={"simdev": 3})) == {}


def test_backend_recipe_per_kind() -> None:
    r = backend_recipe(_spec(compile="inductor"))
    assert (r.kind, r.name, r.imports, r.simdev_options) == ("registered", "inductor", (), None)
    r = backend_recipe(_spec(device="simdev", compile="sim-subset",
                             backend_options={"allow": ["mm"], "simdev": {"deny": ["mm"]}}))
    assert r.kind == "sim" and r.simdev_options == {"deny": ["mm"]}
    assert r.imports == ("ci_runner.sim.simdev", "ci_runner.sim")
    r = backend_recipe(_spec(compile="tests.fixtures.plugin_compiler:backend", imports=("tests.fixtures",)))
    assert (r.kind, r.module, r.attr) == ("plugin", "tests.fixtures.plugin_compiler", "backend")
    assert r.imports == ("tests.fixtures", "tests.fixtures.plugin_compiler")
    r = backend_recipe(_spec(device="simdev"))
    assert r.kind == "eager" and r.name is None and r.simdev_options == {}


def test_error_text_patterns() -> None:
    assert unsupported_op_from_error("[sim-subset] unsupported operator aten.softplus.default. in node") == \
        "aten.softplus.default"
    assert unsupported_op_from_error("Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend") == \
        "aten.rsqrt.out"
    assert unsupported_op_from_error("Could not run 'aten::rsqrt' with arguments from the 'simdev' backend") == \
        "aten.rsqrt.default"
    assert named_op_from_error("NPU lowering failed: no kernel for 'aten::softplus' (op 1)") == \
        ("aten.softplus.default", "aten::softplus")
    assert named_op_from_error("device lost") == (None, None)
