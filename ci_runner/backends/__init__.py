"""Backends: a matrix backend spec resolved to a compile adapter and a device, and what is known about them.

- `spec`: `resolve_backend(spec) -> Backend` (the adapter every mode uses: `compile`, `compile_watched` (with
  its one `CompileWatch`), `compile_recorded`, `to_device`, `versions`), `resolution(spec)` (the one resolution order), `backend_recipe` (the same order
  written out for a standalone repro), `is_self_test`, `available_backends` / `available_devices`;
- `ran`: did the backend run the code (`CompileWatch`: `CompileRecord`, `DynamoCounters`, `FallbackWatch` read as one;
  `backend_ran`);
- `errortext`: the op a backend's error text names (`unsupported_op_from_error`, `named_op_from_error`);
- `vendor`: the small protocol for backend-specific knowledge (`VendorWatch`, `watch_for`), one module per vendor:
  `openvino` (its silent fallbacks and the recipe that makes its findings mean something), `iree` (its
  boilerplate error line).
"""

from __future__ import annotations

from .errortext import ATEN_NAME_RE, COULD_NOT_RUN_RE, UNSUPPORTED_RE, named_op_from_error, unsupported_op_from_error
from .vendor import boilerplate_lines, groups_agree
from .ran import CompileRecord, CompileWatch, DynamoCounters, FallbackWatch, backend_ran, not_ran_reason, ran_facts
from .spec import (
    Backend,
    BackendRecipe,
    Resolution,
    available_backends,
    available_devices,
    backend_recipe,
    is_self_test,
    plugin_pythonpath,
    registered_compile_backends,
    resolution,
    resolve_backend,
    simdev_options,
)

__all__ = [
    "boilerplate_lines", "groups_agree",
    "ATEN_NAME_RE", "COULD_NOT_RUN_RE", "UNSUPPORTED_RE", "named_op_from_error", "unsupported_op_from_error",
    "CompileRecord", "CompileWatch", "DynamoCounters", "FallbackWatch", "backend_ran", "not_ran_reason", "ran_facts",
    "Backend", "BackendRecipe", "Resolution", "available_backends", "available_devices", "backend_recipe",
    "is_self_test", "plugin_pythonpath", "registered_compile_backends", "resolution", "resolve_backend",
    "simdev_options",
]
