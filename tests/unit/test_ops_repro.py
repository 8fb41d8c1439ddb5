"""Repro scripts for failing ops: golden text of the template, and the scripts really reproduce (or pass once fixed).

Regenerate the golden files after an intended template change with `DEEPVIEW_UPDATE_GOLDEN=1 pytest tests/unit/test_ops_repro.py`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.config import BackendSpec
from ci_runner.modes.ops.mode import render_repro
from ci_runner.modes.ops.inputs import with_ranges
from ci_runner.engine.codec import encode_arg
from ci_runner.modes.ops.signature import CallSite, OpSignature, signature_key
from ci_runner.engine.repro import template_backend, verify_script, write_script
from tests.fixtures.paths import ROOT

GOLDEN = ROOT / "tests" / "fixtures" / "golden" / "ops"
ENV_STAMP = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "python": "3.11.7",
             "backend": {"backend": "sim-subset", "deepview-ci": "0.1.0"}}


def _signature(op: str, *args: Any, **kwargs: Any) -> tuple[OpSignature, dict[str, Any]]:
    enc_args, enc_kwargs = [encode_arg(a) for a in args], {k: encode_arg(v) for k, v in kwargs.items()}
    sig = OpSignature(op=op, args=enc_args, kwargs=enc_kwargs, key=signature_key(op, enc_args, enc_kwargs), count=2,
                      sites=[CallSite(module="model.layers.0.mamba", module_class="BambaMixer",
                                      source="transformers/models/bamba/modeling_bamba.py:489 in mamba2_chunk_scan")])
    a, k = with_ranges(op, enc_args, enc_kwargs)
    return sig, {"id": "p0007", "op": op, "args": a, "kwargs": k, "seed": 4242, "tolerance": [1e-4, 1e-5]}


def _render(spec: BackendSpec, op: str, *args: Any, kind: str = "unsupported_op", stage: str = "compile",
            error_type: str = "SimCompilerError", message: str = "", **kwargs: Any) -> str:
    sig, probe = _signature(op, *args, **kwargs)
    return render_repro(op=op, kind=kind, stage=stage, error_type=error_type, message=message, signature=sig,
                        probe=probe, backend=template_backend(spec), backend_id=spec.id, model_id="tiny-bamba",
                        ir="aten", env_stamp=ENV_STAMP, tolerance=(1e-4, 1e-5), compare_results=True,
                        command="python repro.py", crash=False)


SUBSET = BackendSpec(id="sim-subset", compile="sim-subset")
CASES = {
    "subset_softplus.py": lambda: _render(
        SUBSET, "aten.softplus.default", torch.empty(1, 16, 4, 32).transpose(1, 2),
        message="[sim-subset] unsupported operator aten.softplus.default in node softplus: no lowering"),
    "simdev_rsqrt.py": lambda: _render(
        BackendSpec(id="simdev", device="simdev"), "aten.rsqrt.default", torch.empty(2, 3), kind="unsupported_op",
        stage="run", error_type="NotImplementedError",
        message="Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend."),
    "plugin_mismatch_where.py": lambda: _render(
        BackendSpec(id="vendor", compile="tests.fixtures.plugin_ops_vendor:make", imports=("tests.fixtures",),
                    env=MappingProxyType({"NPU_VISIBLE": "0"}), backend_options=MappingProxyType({"deny": ["tril"]}),
                    compile_options=MappingProxyType({"dynamic": False})),
        "aten.where.self", torch.empty(4, dtype=torch.bool), torch.empty(4), torch.empty(4), kind="op_mismatch",
        stage="compare", error_type="OpMismatch", message="aten.where.self differs from CPU eager: output 0: ..."),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_template_golden(name: str) -> None:
    text = CASES[name]()
    ast.parse(text)  # valid Python
    path = GOLDEN / name
    if os.environ.get("DEEPVIEW_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"missing golden file {path}; run with DEEPVIEW_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8")


def test_repro_imports_only_torch_and_the_plugin() -> None:
    tree = ast.parse(CASES["plugin_mismatch_where.py"]())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    outside_torch = {m for m in imported if m != "torch" and not m.startswith("torch.")}
    assert outside_torch == {"os", "sys", "traceback", "importlib", "tests.fixtures"}
    assert "import_module('tests.fixtures.plugin_ops_vendor'), 'make')" in CASES["plugin_mismatch_where.py"]()
    assert "ci_runner" not in CASES["plugin_mismatch_where.py"]()


def _env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT)}


@pytest.mark.slow
def test_repro_fails_while_broken_and_passes_once_fixed(tmp_path: Path) -> None:
    """The same script, against a backend that lacks softplus (exit 1, verified) and one that has it (exit 0)."""
    broken = write_script(tmp_path / "broken" / "repro.py", CASES["subset_softplus.py"]())
    v = verify_script(broken, expect_text=["unsupported operator aten.softplus.default"],
                      expect_error_type="SimCompilerError", timeout=120, env=_env())
    assert v.verified and v.exit_code == 1, v
    assert "REPRO FAILED (compile): SimCompilerError: [sim-subset] unsupported operator aten.softplus.default" in v.output_tail
    fixed_spec = BackendSpec(id="sim-subset", compile="sim-subset",
                             backend_options=MappingProxyType({"extra_allow": ["softplus"]}))
    fixed = write_script(tmp_path / "fixed" / "repro.py", _render(fixed_spec, "aten.softplus.default",
                                                                  torch.empty(1, 16, 4, 32).transpose(1, 2)))
    proc = subprocess.run([sys.executable, str(fixed)], env={**os.environ, **_env()}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "REPRO PASSED: aten.softplus.default works on sim-subset" in proc.stdout


@pytest.mark.slow
def test_simdev_repro_reproduces_the_dispatcher_error(tmp_path: Path) -> None:
    script = write_script(tmp_path / "repro.py", CASES["simdev_rsqrt.py"]())
    v = verify_script(script, expect_text=["Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend"],
                      expect_error_type="NotImplementedError", timeout=120, env=_env())
    assert v.verified, v
    assert "REPRO FAILED (run): NotImplementedError" in v.output_tail


def test_any_backend_text_keeps_the_script_valid() -> None:
    nasty = 'bad """ quote \\N{oops} \\x9 and {braces} %s\nsecond line\r\nthird'
    text = _render(SUBSET, "aten.softplus.default", torch.empty(3), message=nasty, error_type='Err"""\\')
    ast.parse(text)
    assert '# Found:    Err"""\\: bad """ quote \\N{oops}' in text  # verbatim, inside a comment
    assert "\nsecond line" not in text
