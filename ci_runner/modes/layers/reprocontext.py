"""What every layers repro template needs of the backend: how to build it, and which plugin modules it imports."""

from __future__ import annotations

from typing import Any

from ...backends import backend_recipe, is_self_test


def plugin_modules(spec: Any) -> list[str]:
    mods = list(spec.imports)
    if spec.compile and ":" in spec.compile:
        mods.append(spec.compile.split(":", 1)[0])
    if is_self_test(spec):
        mods.append("ci_runner")
    return list(dict.fromkeys(mods))


def template_backend(spec: Any) -> dict[str, Any]:
    """How the layer repro template gets the backend (`backends.backend_recipe`, as the template names it):
    kind eager | sim | callable | registered, plus what that kind needs."""
    r = backend_recipe(spec)
    kind = "callable" if r.kind == "plugin" else r.kind
    return {"kind": kind, "name": r.name if kind in ("sim", "registered") else None, "module": r.module,
            "attr": r.attr, "options": dict(r.options), "compile_options": dict(r.compile_options)}
