"""Constants shared by the numerics modules, and the cell context the toolbox runs in."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from ...options import NUMERICS_VIEWS
from ...models.torchcompat import dynamo_config

VIEWS: tuple[str, ...] = NUMERICS_VIEWS
DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
}
# Dynamo settings while the target runs: many module instances share one code object (Linear.forward, …), and
# hitting the recompile limit must fail loudly rather than fall back to eager (which would hide the backend).
# Every module is compiled for its own static shapes, as a whole-model compile does: without that, the second
# Linear of another shape recompiles Linear.forward with symbolic sizes (automatic dynamic shapes), another code
# path than the model's own compile and one some backends cannot run (IREE passes the sizes as plain ints:
# "'int' object has no attribute 'data'" on every later Linear of tiny Qwen2-MoE).
DYNAMO_SETTINGS: Mapping[str, Any] = {
    "recompile_limit": 1024,
    "accumulated_recompile_limit": 1 << 16,
    "fail_on_recompile_limit_hit": True,
    "automatic_dynamic_shapes": False,
}


def dynamo_settings() -> dict[str, Any]:
    """DYNAMO_SETTINGS under the key names this torch's Dynamo config knows (for `config.patch(**…)`). Under
    Dynamo's `suppress_errors` (TORCHDYNAMO_SUPPRESS_ERRORS=1) Dynamo refuses `fail_on_recompile_limit_hit`: it is
    left out, and a frame over the limit runs in eager, which the watches see (`watched.py`)."""
    settings = dict(DYNAMO_SETTINGS)
    if torch._dynamo.config.suppress_errors:
        settings.pop("fail_on_recompile_limit_hit")
    return dynamo_config(settings)


class CellContext(Protocol):
    """What the numerics package uses of a mode's context (`ci_runner.modes.ModeContext` provides it)."""

    cell: Any
    backend: Any
    cell_dir: Path

    def remaining(self) -> float: ...

    def model(self, **kw: Any) -> Any: ...

    def inputs(self, loaded: Any, **kw: Any) -> dict[str, Any]: ...
