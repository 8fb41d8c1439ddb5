"""The probing child's helpers that know nothing of the search: the backend error's traceback, and which submodule
an eager device was running when it raised."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch

from ...watch.capture import ModuleCapture


def root_traceback(exc: BaseException, inner: BaseException, *, frames: int = 40, limit: int = 6000) -> str:
    """The traceback of the error the backend raised (`inner`), its innermost `frames` frames: where it was
    raised, which `rootcause.raised_in` reads; then the last line of the wrapper Dynamo raised, if any."""
    text = "".join(traceback.format_exception(type(inner), inner, inner.__traceback__, limit=-frames, chain=False))
    if inner is not exc:
        text += f"\n(raised to the caller as {type(exc).__name__})\n"
    return text[-limit:]


class ExecutingTracker:
    """Eager devices: name the innermost submodule that was running when the forward raised."""

    def __init__(self, module: torch.nn.Module, prefix: str) -> None:
        self.module = module
        self.prefix = prefix
        self.failed_in: str | None = None
        self._cap: Any = None

    def _post(self, info: Any, args: Any, kwargs: Any, output: Any) -> None:
        # forward hooks with always_call run while the exception unwinds: the first one is the innermost
        if self.failed_in is None and sys.exc_info()[1] is not None:
            self.failed_in = ".".join(p for p in (self.prefix, info.name) if p)

    def __enter__(self) -> "ExecutingTracker":
        self.failed_in = None
        self._cap = ModuleCapture(self.module, post=self._post)
        self._cap.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._cap.close()
