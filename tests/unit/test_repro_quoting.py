"""Every repro template rendered with hostile names and messages: the script still compiles, its syntax tree is the
one a benign name gives (no value became code), and it stays one line per line; the quoting functions alone."""

from __future__ import annotations

import ast
import copy
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ci_runner.engine.repro import render_template, run_command
from ci_runner.quoting import comment, dotted, identifier, pyrepr, shell_command, shell_quote

TEMPLATES = sorted(p.name for p in (Path(__file__).resolve().parents[2] / "ci_runner" / "templates").glob("*.py.j2")
                   if not p.name.startswith("_"))

PWN = 'x",getattr(__import__("os"),"system")("touch PWNED"),"'
HOSTILE = [
    PWN,
    "x';import os;os.system('touch PWNED');'",
    'a\\\nimport os\nos.system("touch PWNED")\n#',
    "nul\x00byte", "lone \ud800 surrogate", "\udfff", "{{ 7*7 }}{% raw %}", '"""', "'''", "# -*- coding: latin-1 -*-",
    "line\u2028import os\u2029sep", "cr\rimport os", "ff\x0cvt\x0b", "\x1b[31mred", "bidi \u202e txt", "back\\slash\\",
    "{x}{{y}}", "\\N{BULLET}", "\t tab", "\x85nel", "é 漢字 🙂", "",
]

# as `engine.repro.template_backend` makes it: all a repro writes of the backend (`_repro_backend.py.j2`)
_BENIGN_BACKEND = {"kind": "registered", "name": "aot_eager", "module": None, "attr": None, "options": {"o": "v"},
                   "compile_options": {"dynamic": False}, "env": {"FLAG": "1"}, "imports": ["tests.fixtures"],
                   "plugin_modules": ["tests.fixtures"], "device": "cpu", "simdev": {"deny": ["mm"]}}
_COMMON: dict[str, Any] = dict(
    module="blk.attn", qualified_name="blk.attn", module_class="Attn", model_id="m", model_source="config:llama",
    backend_id="b", stage="run", error_type="RuntimeError", message="boom", status="fail", torch_version="2.13",
    versions={"acme": "1.0"}, backend=_BENIGN_BACKEND, call={"args": [], "kwargs": {}}, run_it="python repro.py",
)
_SOURCE = {"kind": "factory", "factory": "pkg.mod:build", "seed": 0, "overrides": {"width": 8}, "dtype": "float32"}
# code the tool writes itself (op templates), and values that pick a template's branch: never replaced
_CODE = {"op_expr", "setup", "tensor_lines", "make_tensor_source", "compare_source", "call_args", "positional_args",
         "failure_source", "tensor_names", "check", "kind", "imports", "op_imports", "dtype"}
_CONTEXTS: dict[str, dict[str, Any]] = {
    "repro_layer.py.j2": {},
    "repro_layer_source.py.j2": {"source": _SOURCE},
    "repro_culprit.py.j2": {"culprit_what": "aten.add", "layer": "blk", "level": "aten", "node_lines": ["add = x + y"]},
    "repro_layer_tp.py.j2": {"layout": "tp2", "world": 2, "ranks": [0, 1], "plan": {"": "colwise"}, "source": _SOURCE,
                             "factory_module": "pkg.mod", "timeout": 60.0},
    "repro_numerics_tp.py.j2": {"layout": "tp2", "world": 2, "plan": {"": "colwise"}, "source": _SOURCE,
                                "factory_module": "pkg.mod", "sample": 0, "timeout": 60.0,
                                "threshold": {"rel": 1e-3, "cos": 0.999, "mad": 1e-4}},
    "repro_collective.py.j2": {"op": "_c10d_functional.all_reduce.default", "namespace": "_c10d_functional",
                               "op_name": "all_reduce", "overload": "default", "shape": [2, 3], "dtype": "float32",
                               "call_args": ["sum"], "world": 2, "layout": "tp2", "script": "repro.py"},
    "repro_compile.py.j2": {"check": "graph_break", "phase": "prefill", "source": "model.py:12", "limit": 8,
                            "allowed": 1, "expect": "aten.add", "warmup": 1, "calls": [], "cache": None,
                            "minimal": None,
                            "model": {"kind": "factory", "module": "pkg.mod", "function": "build", "seed": 0,
                                      "overrides": {}}},
    "repro_phase.py.j2": {"phase": "decode", "failing": "decode", "calls": [], "cache": None,
                          "config_class": "LlamaConfig", "model_class": "LlamaForCausalLM", "use_cache": True},
    "repro_symbolic.py.j2": {"op": "torch.sym_max", "phase": "decode", "file_name": "python repro_sym.py"},
    "repro_memory.py.j2": {"kind": "oom", "title": "out of memory", "model": "m", "phase": "prefill", "step": None,
                           "source": _SOURCE, "command": "python repro.py",
                           "capacity": 1000, "live_at_entry": 10, "ratio": 1.5},
    "repro_numerics.py.j2": {"source": _SOURCE, "ref_dtype": "float32", "target_dtype": "bfloat16", "via": "o_proj",
                             "via_call": 0, "threshold_rel": 1e-3, "threshold_cos": 0.999, "command": "python repro.py"},
    "repro_numerics_phase.py.j2": {"source": _SOURCE, "call": None, "phase": "decode (2 steps)",
                                   "call_label": "decode step 1", "module_call": 1, "kv": [0, "keys"],
                                   "calls": [{"label": "prefill", "tensors": {"input_ids": "0.input_ids"}}],
                                   "cache": {"kind": "static", "max_len": 12, "kwarg": "cache"}, "use_cache": True,
                                   "real": [[True, False]], "ref_dtype": "float32", "target_dtype": "bfloat16",
                                   "threshold_rel": 1e-3, "threshold_cos": None, "command": "python repro.py",
                                   "overwritten": {"call": "decode step 1", "after": "decode step 2"}},
    "repro_op.py.j2": {"op": "aten.add.Tensor", "kind": "op_error", "calls": 1, "source": "model.py:3",
                       "signature": "add(Tensor, Tensor)", "ir": "aten", "python_version": "3.12",
                       "transformers_version": "5", "backend_versions": "-", "outputs": None,
                       "positional_args": "t0, t1", "op_imports": ["torchvision"],
                       "op_expr": "torch.ops.aten.add.Tensor", "seed": 0, "compare": True, "rtol": 1e-5,
                       "atol": 1e-6, "make_tensor_source": "def make_tensor(*a):\n    return a",
                       "compare_source": "def compare(a, b):\n    return True", "tensor_lines": ["t0 = 1", "t1 = 2"],
                       "tensor_names": ["t0", "t1"], "call_args": "t0, t1", "command": "python repro.py",
                       "crash": False, "dynamic_marks": [(0, 1)]},
}


def _context(name: str) -> dict[str, Any]:
    return copy.deepcopy({**_COMMON, **_CONTEXTS[name]})


_CODE_IN = {"repro_symbolic.py.j2": {"op"}}  # a `torch.sym_*` function called by name (refused below when odd)


def _poison(value: Any, text: str, code: frozenset[str] = frozenset()) -> Any:
    """`value` with every string in it (not the keys of a mapping, nor code) replaced by `text`."""
    if isinstance(value, str):
        return text
    if isinstance(value, dict):
        return {k: v if k in _CODE | code else _poison(v, text) for k, v in value.items()}
    if isinstance(value, list):
        return [_poison(v, text) for v in value]
    return value


def _shape(src: str) -> list[str]:
    """The script's syntax tree as node types, every constant alike (what a value may change)."""
    return [type(n).__name__ for n in ast.walk(ast.parse(src)) if not isinstance(n, (ast.Constant,))]


def test_every_repro_template_has_a_context() -> None:
    assert set(TEMPLATES) == set(_CONTEXTS)


@pytest.mark.parametrize("name", TEMPLATES)
def test_hostile_values_never_become_code(name: str) -> None:
    benign = render_template(name, **_context(name))
    compile(benign, name, "exec")
    shape, lines = _shape(benign), len(benign.splitlines())
    for text in HOSTILE:
        ctx = _poison(_context(name), text, frozenset(_CODE_IN.get(name, ())))
        src = render_template(name, **ctx)
        src.encode("utf-8")  # writable: no lone surrogate left
        assert "\x00" not in src
        compile(src, name, "exec")
        assert _shape(src) == shape, (name, text)
        assert len(src.splitlines()) == lines, (name, text)  # no value broke a comment line (U+2028, CR, NEL…)
        assert "coding:" not in "\n".join(src.splitlines()[:2]), (name, text)


@pytest.mark.parametrize("name", TEMPLATES)
def test_hostile_env_and_option_names_stay_strings(name: str) -> None:
    """The backend's env and its (compile) options' keys: dict keys the poisoning above leaves alone."""
    ctx, benign = _context(name), _context(name)
    ctx["backend"].update(env={PWN: PWN}, compile_options={PWN: 1}, options={PWN: PWN})
    benign["backend"].update(env={"A": "B"}, compile_options={"A": 1}, options={"A": "B"})
    assert _shape(render_template(name, **ctx)) == _shape(render_template(name, **benign))


@pytest.mark.parametrize("name, field", [("repro_op.py.j2", "imports"), ("repro_op.py.j2", "op_imports"),
                                         ("repro_memory.py.j2", "imports"), ("repro_symbolic.py.j2", "op"),
                                         ("repro_layer.py.j2", "imports"), ("repro_compile.py.j2", "imports")])
def test_names_pasted_as_code_are_refused(name: str, field: str) -> None:
    """A plugin module, an op's module or a symbolic function that is no Python name is refused, never written."""
    ctx = _context(name)
    if field == "imports":
        ctx["backend"]["imports"] = [PWN]
    else:
        ctx[field] = [PWN] if field == "op_imports" else PWN
    with pytest.raises(ValueError):
        render_template(name, **ctx)


def test_op_expression_of_an_odd_op_name_is_a_lookup() -> None:
    from ci_runner.modes.ops.probe import op_expression

    assert op_expression("aten.add.Tensor") == "torch.ops.aten.add.Tensor"
    assert op_expression("torch.nn.functional.silu") == "torch.nn.functional.silu"
    tree = ast.parse(op_expression(f"ns.{PWN}.default"), mode="eval")
    assert {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} == {"getattr", "torch"}
    assert {type(n).__name__ for n in ast.walk(tree)} <= {"Expression", "Call", "Name", "Load", "Constant"}


@pytest.mark.parametrize("value", [None, True, 0, -3, 1.5, float("nan"), float("inf"), float("-inf"), "", PWN,
                                   "\ud800", b"\x00'", [1, ("a",)], {"k": {"n": [None]}}, set(), {2, 1}, ()])
def test_pyrepr_is_a_literal_of_the_value(value: Any) -> None:
    back = eval(pyrepr(value), {"__builtins__": {"float": float, "set": set}})  # noqa: S307 (the literal's check)
    if isinstance(value, float) and math.isnan(value):
        assert math.isnan(back)
    else:
        assert back == value and type(back) is type(value)


def test_pyrepr_refuses_what_has_no_literal() -> None:
    with pytest.raises(TypeError):
        pyrepr(object())


def test_comment_is_one_printable_line() -> None:
    for text in HOSTILE:
        out = comment(text)
        assert out.isprintable() or out == "", repr(out)
        assert len(("# " + out).splitlines()) <= 1
        out.encode("utf-8")
    assert comment("plain text: a.b(c)") == "plain text: a.b(c)"


def test_dotted_and_identifier() -> None:
    assert dotted("pkg.mod_1") == "pkg.mod_1"
    assert identifier("dynamic") == "dynamic"
    for bad in ("", "a..b", "1a", "a.b;c", "import", "a b", PWN):
        with pytest.raises(ValueError):
            dotted(bad)
    with pytest.raises(ValueError):
        identifier("a.b")


def test_printed_commands_are_shell_quoted(tmp_path: Path) -> None:
    assert shell_command(["python", "repro.py"]) == "python repro.py"
    assert shell_command(["python", "a b;rm -rf x.py"], {"PYTHONPATH": "../p q"}) == \
        "PYTHONPATH='../p q' python 'a b;rm -rf x.py'"
    assert shell_quote("$(touch PWNED)") == "'$(touch PWNED)'"
    assert run_command("r $x.py", tmp_path, [str(tmp_path / "pl`x`")]) == "PYTHONPATH='pl`x`' python 'r $x.py'"


@pytest.mark.slow
def test_a_hostile_module_name_runs_nothing_end_to_end(tmp_path: Path) -> None:
    """The issue's case: a submodule named to run `touch PWNED`, its layer repro run to its verdict."""
    import torch

    from ci_runner.config import BackendSpec
    from ci_runner.engine.codec import TensorStore
    from ci_runner.engine.repro import write_script
    from ci_runner.engine.repro import template_backend
    from ci_runner.modes.layers.search import encode_call
    from tests.fixtures.paths import ROOT
    from tests.fixtures.plugin_layers_models import Attn

    x = torch.randn(1, 2, 4, 8)
    store = TensorStore()
    call = encode_call((x,), {"scale": 0.5}, store)
    store.save(tmp_path / "inputs.safetensors")
    ep = torch.export.export(Attn(8).eval(), (x,), {"scale": 0.5}, strict=False)
    torch.export.save(ep, str(tmp_path / "module.pt2"))
    spec = BackendSpec(id="b", compile="tests.fixtures.plugin_layers_fault:raise_backend")
    ctx = {**_COMMON, "module": PWN, "message": PWN, "model_id": PWN, "backend": template_backend(spec), "call": call}
    write_script(tmp_path / "repro.py", render_template("repro_layer.py.j2", **ctx))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "repro.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"REPRO FAILED: {PWN}: RuntimeError" in proc.stderr
    assert not (tmp_path / "PWNED").exists()


def test_no_repro_unpickles() -> None:
    """Every artifact a repro loads is safetensors or `torch.load(weights_only=True)` (issue 46: the memory repro
    used to unpickle its layer)."""
    from pathlib import Path

    import ci_runner

    root = Path(ci_runner.__file__).parent
    for path in [*root.rglob("*.j2"), *root.rglob("*.py")]:
        text = path.read_text(encoding="utf-8")
        assert "weights_only=False" not in text, path
        for line in (ln for ln in text.splitlines() if "torch.load(" in ln):
            assert "weights_only=True" in line, (path, line)
        assert "pickle.load" not in text, path


_BACKEND_WORDS = ("os.environ.setdefault", "torch.compile(", "def get_backend", "def compiled", "register_from_options",
                  "# backend plugin", "COMPILE_OPTIONS =", "DEVICE =")


@pytest.mark.parametrize("name", TEMPLATES)
def test_every_repro_writes_the_backend_one_way(name: str) -> None:
    """The backend (its callable or name, compile options, env, imports, device, simdev) is written by the one
    partial `_repro_backend.py.j2` from `template_backend`'s dict: no repro template writes any of it itself, and
    each rendered script holds the partial's pieces once."""
    folder = Path(__file__).resolve().parents[2] / "ci_runner" / "templates"
    own = (folder / name).read_text(encoding="utf-8")
    assert not [w for w in _BACKEND_WORDS if w in own], name
    assert "_repro_backend.py.j2" in own or "_repro_layer_common.py.j2" in own
    common = (folder / "_repro_layer_common.py.j2").read_text(encoding="utf-8")
    assert not [w for w in _BACKEND_WORDS if w in common]
    src = render_template(name, **_context(name))
    for piece in ("def get_backend():", "def compiled(fn):", "torch.compile(", "COMPILE_OPTIONS = {'dynamic': False}",
                  "DEVICE = 'cpu'", "os.environ.setdefault('FLAG', '1')"):
        assert src.count(piece) == 1, (name, piece)
    if name not in ("repro_collective.py.j2", "repro_layer_tp.py.j2", "repro_numerics_tp.py.j2"):  # their ranks
        # import IMPORTS themselves
        assert src.count("import tests.fixtures  # backend plugin") == 1
        assert src.count("_simdev.register_from_options({'deny': ['mm']})") == 1
