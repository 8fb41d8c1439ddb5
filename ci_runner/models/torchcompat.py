"""Which private or newer torch APIs this torch has: one probe per feature, and the torch release it needs.

deepview-ci supports torch ≥ `OLDEST_TORCH` (docs/torch.md). A feature built on an API that is private or
newer than that is probed here before use; when its probe fails, `require` raises `TorchTooOldError` ("… needs
torch ≥ X"), which a cell reports as `skipped` with that reason, never as an ImportError or AttributeError.
Dynamo's config keys are renamed rather than refused (`dynamo_config`).

Probes are `hasattr`/`find_spec` checks (cheap, no cache), so a test can stand in an absent feature by replacing its
entry in `FEATURES` (`monkeypatch.setitem(FEATURES, key, replace(FEATURES[key], probe=lambda: False))`).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import TorchTooOldError

OLDEST_TORCH = "2.7"


def _has(module: str, *attrs: str) -> bool:
    """Whether `module` imports and has every one of `attrs` (a dotted attribute walks down)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
        obj: Any = importlib.import_module(module)
    except ImportError:
        return False
    for attr in attrs:
        cur = obj
        for part in attr.split("."):
            if not hasattr(cur, part):
                return False
            cur = getattr(cur, part)
    return True


@dataclass(frozen=True)
class Feature:
    """A torch API a deepview-ci feature is built on."""

    what: str  # the deepview-ci feature, as the skipped reason names it
    api: str  # the torch API it probes
    needs: str  # the first torch release that has it
    probe: Callable[[], bool]


FEATURES: dict[str, Feature] = {
    # torch 2.10 added the Python device guard and hooks (pytorch#157859; 2.8.0 and 2.9.0 wheels lack them): before,
    # a PrivateUse1 device cannot be registered from Python alone.
    "simdev": Feature(
        "simdev (a PrivateUse1 device registered from Python)",
        "torch.utils.backend_registration._setup_privateuseone_for_python_backend, torch._C._acc", "2.10",
        lambda: _has("torch.utils.backend_registration", "_setup_privateuseone_for_python_backend")
        and _has("torch._C", "_acc.create_empty_tensor")),
    "compiler_bisector": Feature(
        "the compiler bisect (numerics bisect_method: compiler)", "torch._inductor.compiler_bisector", "2.6",
        lambda: _has("torch._inductor.compiler_bisector", "CompilerBisector.do_bisect",
                     "CompilerBisector.get_backend", "CompilerBisector.get_subsystem")),
    "cia_ops": Feature(
        "the ops inventory by torch.export (method: export)", "torch._export.utils._collect_all_valid_cia_ops", "2.6",
        lambda: _has("torch._export.utils", "_collect_all_valid_cia_ops")),
    # 2.7 renamed Dynamo's cache_size_limit family to recompile_limit (the old names stay as aliases).
    "recompile_limit": Feature(
        "Dynamo's recompile_limit config keys", "torch._dynamo.config.recompile_limit", "2.7",
        lambda: _has("torch._dynamo.config", "recompile_limit")),
}

# Dynamo config keys under their names before torch 2.7.
_DYNAMO_OLD_NAMES: Mapping[str, str] = {
    "recompile_limit": "cache_size_limit",
    "accumulated_recompile_limit": "accumulated_cache_size_limit",
    "fail_on_recompile_limit_hit": "fail_on_cache_limit_hit",
}


def torch_version() -> str:
    import torch  # deferred: the report commands never import torch

    return str(torch.__version__)


def available(key: str) -> bool:
    """Whether this torch has feature `key` (a key of `FEATURES`)."""
    return FEATURES[key].probe()


def skip_reason(key: str) -> str:
    """The text a skipped result carries for feature `key`: "<what> needs torch ≥ X (installed: torch Y)"."""
    f = FEATURES[key]
    return f"{f.what} needs torch \u2265 {f.needs} (installed: torch {torch_version()}; missing: {f.api})"


def require(key: str) -> None:
    """Raise `TorchTooOldError` when this torch lacks feature `key`."""
    if not available(key):
        f = FEATURES[key]
        raise TorchTooOldError(skip_reason(key), needs=f.needs)


def dynamo_config(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` for `torch._dynamo.config.patch(**…)` under the key names this torch knows."""
    if available("recompile_limit"):
        return dict(settings)
    return {_DYNAMO_OLD_NAMES.get(k, k): v for k, v in settings.items()}


__all__ = ["FEATURES", "OLDEST_TORCH", "Feature", "available", "dynamo_config", "require", "skip_reason",
           "torch_version"]
