"""Issue 47: each mechanism once. "Did the backend run it" is one watch (`backends.ran.CompileWatch`, from
`Backend.compile_watched`), forward hooks are registered in one module (`watch/hooks.py`, `ModuleHooks`) and so is
the ATen-graph recording compile (`aot_autograd(fw_compiler=…)`: `watch.hooks.aten_recording`). Read from the
source (AST): a call that builds one of these anywhere else is a second copy of the mechanism."""

from __future__ import annotations

import ast
from pathlib import Path

import ci_runner

PACKAGE = Path(ci_runner.__file__).parent

# what is built where: the callee's name -> the modules (relative to the package) allowed to call it
ONLY_IN = {
    "FallbackWatch": {"backends/ran.py"},
    "DynamoCounters": {"backends/ran.py"},
    "register_forward_hook": {"watch/hooks.py"},
    "register_forward_pre_hook": {"watch/hooks.py"},
    "aot_autograd": {"watch/hooks.py", "sim/compilers.py"},  # the sims are aot_autograd backends themselves
    "compile_recorded": {"backends/spec.py"},  # the modes compile watched (`compile_watched`) or plain (`compile`)
}


def _callee(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def calls_outside_their_module(package: Path = PACKAGE) -> list[str]:
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Call) and (name := _callee(node)) in ONLY_IN and rel not in ONLY_IN[name]:
                out.append(f"{rel}:{node.lineno}: {name}(…)")
    return out


def test_watches_hooks_and_the_aten_recording_are_each_built_in_one_module() -> None:
    assert calls_outside_their_module() == []


def test_the_check_sees_a_second_copy(tmp_path: Path) -> None:
    """The scan is not vacuous: a module that registers a hook or builds a watch of its own is named."""
    (tmp_path / "watch").mkdir()
    (tmp_path / "watch" / "hooks.py").write_text("m.register_forward_hook(f)\n", encoding="utf-8")
    (tmp_path / "other.py").write_text("x = 1\nm.register_forward_pre_hook(f, with_kwargs=True)\n"
                                       "with FallbackWatch(name) as w:\n    pass\n", encoding="utf-8")
    assert calls_outside_their_module(tmp_path) == ["other.py:2: register_forward_pre_hook(…)", "other.py:3: FallbackWatch(…)"]
