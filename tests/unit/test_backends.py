"""Backend specs resolve to working compile/device adapters; unknown ones fail listing what is available."""

from __future__ import annotations

import os
from collections import namedtuple
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.backends import (
    Backend,
    available_backends,
    available_devices,
    resolve_backend,
    unsupported_op_from_error,
)
from ci_runner.config import BackendSpec, load_matrix_text
from ci_runner.errors import BackendError
from ci_runner.models.torchcompat import available, skip_reason
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT


def bspec(**kw: Any) -> BackendSpec:
    for key in ("env", "compile_options", "backend_options"):
        if key in kw:
            kw[key] = MappingProxyType(dict(kw[key]))
    if "imports" in kw:
        kw["imports"] = tuple(kw["imports"])
    return BackendSpec(id=kw.pop("id", "b"), **kw)


def f(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ x.T) + 1


X = torch.randn(4, 4)


pytestmark = [pytest.mark.oldtorch, pytest.mark.usefixtures("fresh_dynamo")]  # tests/conftest.py


def test_eager_backend_is_identity() -> None:
    b = resolve_backend(bspec())
    assert b.is_eager and b.compiler_backend() is None and b.kind == "eager"
    assert b.compile(f) is f
    assert b.to_device(X) is X or torch.equal(b.to_device(X), X)


@pytest.mark.parametrize("name", ["aot_eager", "inductor"])
def test_registered_names_pass_through_and_run(name: str) -> None:
    b = resolve_backend(bspec(compile=name, compile_options={"dynamic": False}))
    assert b.compiler_backend() == name and not b.is_eager and b.kind == "registered"
    out = b.compile(f)(X)
    torch.testing.assert_close(out, f(X))
    v = b.versions()
    assert v["torch"] == torch.__version__ and v["backend"] == name


def test_plugin_callable_is_the_backend_and_imports_come_first() -> None:
    from tests.fixtures import plugin_compiler

    plugin_compiler.GRAPHS.clear()
    b = resolve_backend(bspec(compile="tests.fixtures.plugin_compiler:backend", imports=["tests.fixtures.plugin_compiler"]))
    assert b.kind == "plugin" and b.compiler_backend() is plugin_compiler.backend
    torch.testing.assert_close(b.compile(f)(X), f(X))
    assert plugin_compiler.GRAPHS and plugin_compiler.GRAPHS[-1]["by"] == "backend"
    assert b.versions()["tests.fixtures.plugin_compiler"] == "9.8.7"


def test_plugin_with_backend_options_is_a_factory() -> None:
    from tests.fixtures import plugin_compiler

    plugin_compiler.GRAPHS.clear()
    b = resolve_backend(bspec(compile="tests.fixtures.plugin_compiler:make", backend_options={"tag": "t1", "scale": 2.0}))
    out = b.compile(f)(X)
    torch.testing.assert_close(out, 2 * f(X))
    assert plugin_compiler.GRAPHS[-1]["by"] == "t1"


def test_name_registered_by_an_imported_plugin_resolves() -> None:
    b = resolve_backend(bspec(compile="test-plugin", imports=["tests.fixtures.plugin_compiler"]))
    assert b.compiler_backend() == "test-plugin"
    torch.testing.assert_close(b.compile(f)(X), f(X))


def test_env_is_applied_before_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    monkeypatch.delenv("TEST_PLUGIN_FLAG", raising=False)
    monkeypatch.delitem(sys.modules, "tests.fixtures.plugin_compiler", raising=False)
    b = resolve_backend(bspec(env={"TEST_PLUGIN_FLAG": "on"}, imports=["tests.fixtures.plugin_compiler"]))
    assert os.environ["TEST_PLUGIN_FLAG"] == "on"
    assert importlib.import_module("tests.fixtures.plugin_compiler").IMPORT_ENV == "on"
    b.prepare()  # idempotent


def test_sim_backend_resolves_with_options() -> None:
    b = resolve_backend(bspec(compile="sim-subset", backend_options={"extra_allow": ["gelu"]}))
    assert b.kind == "sim" and callable(b.compiler_backend())
    torch.testing.assert_close(b.compile(f)(X), f(X))
    assert "deepview-ci" in b.versions()


@pytest.mark.parametrize(
    ("spec", "message", "hint"),
    [
        (bspec(compile="inductr"), "unknown torch.compile backend 'inductr'", "did you mean 'inductor'?"),
        (bspec(compile="sim-subst"), "unknown torch.compile backend 'sim-subst'", "did you mean 'sim-subset'?"),
        (bspec(compile="nope"), "unknown torch.compile backend 'nope'", "sim-crash"),
        (bspec(compile="simdev"), "'simdev' is a device, not a compiler", "device: simdev"),
        (bspec(device="npu"), "unknown device 'npu'", "available: cpu"),
        (bspec(device="cuda"), "device 'cuda' is not available", "runs-on"),
        (bspec(compile="no_such_plugin_pkg.backend:fn"), "module not found (no_such_plugin_pkg)", "install the plugin"),
        (bspec(compile="tests.fixtures.plugin_compiler:bakend"), "has no attribute 'bakend'", "did you mean 'backend'?"),
        (bspec(compile="tests.fixtures.plugin_compiler:NOT_CALLABLE"), "is not callable", None),
        (bspec(compile="tests.fixtures.plugin_compiler:make", backend_options={"colour": 1}),
         "make(**backend_options) raised TypeError", "factory"),
        (bspec(compile="sim-subset", backend_options={"alow": ["mm"]}), "unknown option 'alow' (did you mean 'allow'?)", None),
        (bspec(compile="inductor", compile_options={"fulgraph": True}), "unknown compile_options key 'fulgraph'", "fullgraph"),
        (bspec(compile="inductor", backend_options={"x": 1}), "backend_options are not used", "compile_options"),
        (bspec(imports=["no_such_plugin_pkg"]), "import 'no_such_plugin_pkg': module not found", None),
        (bspec(device="simdev", backend_options={"allow": ["not_an_op_xyz.default"]}), "cannot set up device simdev", None),
    ],
)
def test_bad_backend_spec_fails_listing_what_is_available(spec: BackendSpec, message: str, hint: str | None) -> None:
    if spec.device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if spec.device == "simdev" and not available("simdev"):
        pytest.skip(skip_reason("simdev"))  # before torch 2.10 simdev cannot be set up at all (TorchTooOldError)
    with pytest.raises(BackendError) as info:
        resolve_backend(spec)
    err = info.value
    assert message in err.message, err.message
    assert err.message.startswith(f"backend {spec.id!r}")
    if hint:
        assert err.hint and hint in err.hint, err.hint
    assert err.exit_code == 4


def test_plugin_that_fails_on_import_is_a_backend_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setenv("DEEPVIEW_TEST_FAULT", "raise")
    monkeypatch.delitem(sys.modules, "tests.fixtures.faults", raising=False)
    with pytest.raises(BackendError, match="importing 'tests.fixtures.faults' failed: RuntimeError: plugin failed"):
        resolve_backend(bspec(imports=["tests.fixtures.faults"]))


def test_to_device_moves_nested_structures() -> None:
    b = Backend(bspec(device="meta"))
    P = namedtuple("P", "a b")
    out = b.to_device({"x": X, "l": [X, (X, 3)], "p": P(X, "s"), "m": torch.nn.Linear(2, 2)})
    assert out["x"].device.type == "meta" and out["l"][0].device.type == "meta"
    assert out["l"][1][0].device.type == "meta" and out["l"][1][1] == 3
    assert isinstance(out["p"], P) and out["p"].a.device.type == "meta" and out["p"].b == "s"
    assert out["m"].weight.device.type == "meta"


def test_available_backends_lists_compilers_sims_and_devices() -> None:
    rows = available_backends()
    by_name = {r["name"]: r for r in rows}
    for name in ("inductor", "aot_eager"):
        assert by_name[name]["kind"] == "torch.compile"
    for name in ("sim-subset", "sim-drift", "sim-crash", "sim-abort", "sim-segv", "sim-hang", "sim-decode", "sim-kvdrift",
                 "sim-masknan", "sim-long", "sim-reuse"):
        assert by_name[name]["kind"] == "sim" and by_name[name]["description"]
    assert by_name["simdev"]["kind"] == "sim device"
    assert by_name["cpu"]["kind"] == "device"
    assert all(set(r) == {"name", "kind", "description"} for r in rows)
    assert not any(r["name"].endswith("TESTING_ONLY") for r in rows)
    assert "cpu" in available_devices()


def test_matrix_backend_entries_resolve() -> None:
    m = load_matrix_text(matrix_text(models=[{"id": "m", "config": "llama"}], backends=[
        {"id": "a", "compile": "aot_eager", "compile_options": {"fullgraph": True}},
        {"id": "s", "compile": "sim-drift", "backend_options": {"op": ["rsqrt"], "dtype": "float16"}},
        {"id": "p", "compile": "tests.fixtures.plugin_compiler:make", "backend_options": {"tag": "m"},
         "env": {"X_FLAG": 1}}]))
    for spec in m.backends:
        b = resolve_backend(spec)
        torch.testing.assert_close(b.compile(f)(X), f(X), atol=1e-2, rtol=1e-2)


def test_unsupported_op_parser_reads_both_formats() -> None:
    assert unsupported_op_from_error(
        "BackendCompilerFailed: backend='sim_subset' raised:\nSimCompilerError: [sim-subset] unsupported operator "
        "aten.softplus.default in node softplus_1: no lowering") == "aten.softplus.default"
    assert unsupported_op_from_error(
        "Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend. This could be") == "aten.rsqrt.out"
    assert unsupported_op_from_error(
        "Could not run 'aten::empty_strided' with arguments from the 'npu' backend.") == "aten.empty_strided.default"
    assert unsupported_op_from_error("RuntimeError: shapes do not match") is None


def test_nightly_matrix_backends_resolve() -> None:
    from pathlib import Path

    from ci_runner.config import load_matrix

    nightly = load_matrix(ROOT / "matrix" / "nightly.yaml")
    simdev_ok = available("simdev")  # before torch 2.10 simdev cannot be set up (its cells are skipped)
    kinds = {resolve_backend(spec).kind for spec in nightly.backends if simdev_ok or spec.device != "simdev"}
    assert kinds == ({"registered", "sim", "eager"} if simdev_ok else {"registered", "sim"})


def test_one_resolution_order_drives_the_adapter_the_recipe_and_the_self_test_answer() -> None:
    """`resolution(spec)` is written once: `Backend.kind`, `backend_recipe` and `is_self_test` all read it."""
    from ci_runner.backends import backend_recipe, is_self_test, resolution

    cases = {
        "eager": (bspec(), False),
        "sim": (bspec(compile="sim-subset"), True),
        "plugin": (bspec(compile="tests.fixtures.plugin_ops_vendor:make"), False),
        "registered": (bspec(compile="aot_eager"), False),
    }
    for kind, (spec, self_test) in cases.items():
        r = resolution(spec)
        assert r.kind == kind and backend_recipe(spec).kind == kind, kind
        assert is_self_test(spec) is self_test and r.self_test is self_test, kind
    on_simdev = bspec(device="simdev", backend_options={"deny": ["rsqrt"]})
    assert resolution(on_simdev).simdev == {"deny": ["rsqrt"]} and is_self_test(on_simdev)
    recipe = backend_recipe(on_simdev)
    assert recipe.imports[-1] == "ci_runner.sim.simdev" and recipe.simdev_options == {"deny": ["rsqrt"]}
    plugin = resolution(bspec(compile="pkg.mod:make"))
    assert (plugin.module, plugin.attr) == ("pkg.mod", "make")


def test_vendor_knowledge_lives_in_its_module_and_generic_backends_have_none() -> None:
    from ci_runner.backends import FallbackWatch, backend_ran, openvino
    from ci_runner.backends.vendor import watch_for

    with FallbackWatch("inductor") as w:
        pass
    assert w.facts() == {} and w.reason() is None
    assert watch_for("inductor") is None and isinstance(watch_for(openvino.NAME), openvino.Watch)
    rows = [{"status": "pass", "ran": {"graphs": 1, "openvino_partitions": 2}}]
    assert backend_ran(rows, compiles=True)["openvino_partitions"] == 2
