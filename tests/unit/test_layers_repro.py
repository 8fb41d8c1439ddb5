"""Layer repro scripts: rendered for every backend kind, valid Python, and runnable on a real exported module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ci_runner.config import BackendSpec
from ci_runner.engine.codec import TensorStore, decode_call
from ci_runner.modes.layers.search import encode_call
from ci_runner.backends import plugin_pythonpath
from ci_runner.modes.layers.mode import _plugin_modules, template_backend
from ci_runner.engine.repro import render_template, write_script
from tests.fixtures.paths import ROOT



def _ctx(spec: BackendSpec, call: dict[str, Any], **extra: Any) -> dict[str, Any]:
    ctx: dict[str, Any] = dict(
        module="blk.attn", qualified_name="blk.attn", module_class="Attn", model_id="m", model_source="config:llama",
        backend_id=spec.id, stage="run", error_type="RuntimeError", message='boom """ \\x \nsecond line', status="fail",
        torch_version=torch.__version__, versions={}, backend=template_backend(spec), call=call)
    ctx.update(extra)
    return ctx


SPECS = [
    BackendSpec(id="reg", compile="aot_eager"),
    BackendSpec(id="sim", compile="sim-crash", backend_options={"op": "attention"}),
    BackendSpec(id="plug", compile="tests.fixtures.plugin_layers_pair:pair_backend", imports=("tests.fixtures",),
                env={"VENDOR_FLAG": "1"}, compile_options={"dynamic": False}),
    BackendSpec(id="dev", device="simdev", backend_options={"extra_allow": ["rsqrt"]}),
]


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_templates_render_valid_python_for_every_backend_kind(spec: BackendSpec) -> None:
    call = encode_call((torch.ones(2),), {"flag": None}, TensorStore())
    source = {"kind": "transformers", "model_class": "LlamaForCausalLM", "config_class": "LlamaConfig",
              "attn_implementation": "sdpa"}
    for name, extra in (("repro_layer.py.j2", {}), ("repro_layer_source.py.j2", {"source": source})):
        text = render_template(name, **_ctx(spec, call, **extra))
        assert text.startswith("#!/usr/bin/env python3\n")
        compile(text, name, "exec")
        assert "ci_runner" not in text or spec.id in ("sim", "dev")  # deepview-ci only when it is the plugin
        assert "# Found:    fail at run: RuntimeError: boom" in text  # the message stays in its comment line
    factory = {"kind": "factory", "factory": "pkg.mod:build", "seed": 0, "overrides": {"width": 8}, "dtype": "float32"}
    compile(render_template("repro_layer_source.py.j2", **_ctx(spec, call, source=factory)), "f", "exec")


def test_repro_decoder_rebuilds_what_the_codec_does() -> None:
    """The decoder pasted into every layer repro (`_repro_layer_common.py.j2`, standalone: torch only) reads the
    wire format as `codec.decode_call` does, for every value the layers mode stores (its strict policy)."""
    import ast

    x = torch.arange(6.0).reshape(2, 3)
    store = TensorStore()
    call = encode_call((x.t(), 2, -1.5, float("inf"), None, "s", True, [x, (x[0],)]),
                       {"dtype": torch.bfloat16, "dev": torch.device("cpu"), "size": torch.Size([3]), "e": Ellipsis,
                        "layout": torch.strided, "fmt": torch.channels_last, "d": {"k": [1, x]}}, store)
    text = render_template("repro_layer.py.j2", **_ctx(SPECS[0], call))
    rebuild = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == "rebuild")
    scope: dict[str, Any] = {"torch": torch}
    exec(compile(ast.Module(body=[rebuild], type_ignores=[]), "repro.py", "exec"), scope)  # noqa: S102
    got = (scope["rebuild"](call["args"], store.tensors), scope["rebuild"](call["kwargs"], store.tensors))
    want = decode_call(call, store.tensors)
    assert torch.equal(got[0][0], want[0][0]) and got[0][0].stride() == want[0][0].stride() == (1, 3)
    assert got[0][1:7] == want[0][1:7] and torch.equal(got[0][7][1][0], x[0])
    assert {k: v for k, v in got[1].items() if k != "d"} == {k: v for k, v in want[1].items() if k != "d"}
    assert got[1]["d"]["k"][0] == 1 and torch.equal(got[1]["d"]["k"][1], x)


def test_backend_recipes_and_plugin_paths() -> None:
    assert template_backend(SPECS[0])["kind"] == "registered"
    sim = template_backend(SPECS[1])
    assert (sim["kind"], sim["name"], sim["options"]) == ("sim", "sim-crash", {"op": "attention"})
    plug = template_backend(SPECS[2])
    assert (plug["kind"], plug["module"], plug["attr"]) == ("callable", "tests.fixtures.plugin_layers_pair", "pair_backend")
    assert template_backend(SPECS[3])["kind"] == "eager"
    both = BackendSpec(id="both", compile="aot_eager", device="simdev")  # a compiler on the sim device
    assert template_backend(both)["kind"] == "registered" and _plugin_modules(both) == ["ci_runner"]
    assert _plugin_modules(SPECS[2]) == ["tests.fixtures", "tests.fixtures.plugin_layers_pair"]
    assert _plugin_modules(SPECS[3]) == ["ci_runner"]
    # all a repro writes of the backend comes from this one dict (`_repro_backend.py.j2`)
    assert (plug["env"], plug["imports"], plug["plugin_modules"], plug["device"], plug["simdev"],
            plug["compile_options"]) == ({"VENDOR_FLAG": "1"}, ["tests.fixtures"], _plugin_modules(SPECS[2]), "cpu",
                                         None, {"dynamic": False})
    dev = template_backend(SPECS[3])
    assert (dev["device"], dev["simdev"]) == ("simdev", {"extra_allow": ["rsqrt"]})
    assert template_backend(SPECS[2], compile_options={})["compile_options"] == {}  # a repro's own, e.g. no `dynamic`
    # the checkout's root holds `tests` and `ci_runner`; torch lives in site-packages and is left out
    assert plugin_pythonpath(["tests.fixtures", "ci_runner", "torch"]) == [str(ROOT)]


@pytest.mark.slow
def test_exported_module_repro_runs_alone_and_exits_by_verdict(tmp_path: Path) -> None:
    """A real .pt2 + inputs + script, run in a clean process: 1 while the backend fails, 0 with a working one."""
    from tests.fixtures.plugin_layers_models import Attn

    mod = Attn(8).eval()
    x = torch.randn(1, 2, 4, 8)
    store = TensorStore()
    call = encode_call((x.transpose(2, 3).transpose(2, 3),), {"scale": 0.5}, store)
    store.save(tmp_path / "inputs.safetensors")
    ep = torch.export.export(mod, (x,), {"scale": 0.5}, strict=False)
    torch.export.save(ep, str(tmp_path / "module.pt2"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    for compile_spec, want in (("tests.fixtures.plugin_layers_fault:raise_backend", 1), ("aot_eager", 0)):
        spec = BackendSpec(id="b", compile=compile_spec)
        write_script(tmp_path / "repro.py", render_template("repro_layer.py.j2", **_ctx(spec, call)))
        proc = subprocess.run([sys.executable, "repro.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == want, proc.stdout + proc.stderr
        if want:
            assert "REPRO FAILED: blk.attn: RuntimeError: [fault-plugin]" in proc.stderr
        else:
            assert "REPRO PASSED" in proc.stdout
