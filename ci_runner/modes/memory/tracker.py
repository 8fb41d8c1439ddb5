"""Module hooks over a meter: each module call's live bytes at entry, its peak and its bytes at exit.

One meter has one resettable peak, so nested calls share it through a stack: entering a module folds the peak so
far into the caller's frame and resets it; leaving folds the callee's peak back into the caller. A call that raises
(an out-of-memory) leaves its frames on the stack, innermost last: `open_frames()` names where it died.
The hooks (`watch.hooks.ModuleHooks`) are removed on exit, always (the `torch.utils.module_tracker` discipline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...watch.hooks import ModuleHooks
from .meters import Meter

__all__ = ["Frame", "ModuleTracker", "tracked_modules", "layer_names"]


@dataclass
class Frame:
    module: str
    module_class: str
    entry: int
    peak: int
    args: Any = field(default=None, repr=False)  # (args, kwargs) of a layer's call, kept for an OOM repro


def layer_names(root: torch.nn.Module) -> set[str]:
    """The repeated layers: every direct child of an `nn.ModuleList` (a decoder layer, an expert)."""
    out = set()
    for name, mod in root.named_modules():
        if isinstance(mod, torch.nn.ModuleList):
            out |= {f"{name}.{child}" if name else child for child, _ in mod.named_children()}
    return out


def tracked_modules(root: torch.nn.Module, max_depth: int) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose calls get rows: the root ("") and every module at most `max_depth` names deep."""
    return [(n, m) for n, m in root.named_modules() if not n or n.count(".") + 1 <= max_depth]


class ModuleTracker:
    """Hooks on `modules`; `rows` gets one dict per finished call: module, class, entry, peak, exit bytes."""

    def __init__(self, meter: Meter, modules: list[tuple[str, torch.nn.Module]], *, keep_args: set[str] | None = None,
                 on_enter: Callable[[str], None] | None = None, on_leave: Callable[[str], None] | None = None) -> None:
        self.meter = meter
        self.modules = modules
        self.keep_args = keep_args or set()
        self.on_enter = on_enter  # called as a layer (a `keep_args` module) is entered and left
        self.on_leave = on_leave
        self.stack: list[Frame] = []
        self.rows: list[dict[str, Any]] = []
        self.last_layer: Frame | None = None
        self._hooks: ModuleHooks | None = None

    def __enter__(self) -> "ModuleTracker":
        self._hooks = ModuleHooks(self.modules, pre=self._pre, post=self._post)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is not None:
            self._hooks.remove()

    def reset(self) -> None:
        """Forget the frames of a call that raised (its open layers are left, for the journal)."""
        for frame in reversed(self.stack):
            if frame.args is not None and self.on_leave is not None:
                self.on_leave(frame.module)
        self.stack.clear()

    def _pre(self, name: str) -> Callable[..., None]:
        def pre(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.stack:
                self.stack[-1].peak = max(self.stack[-1].peak, self.meter.peak())
            self.meter.reset_peak()
            cur = self.meter.current()
            frame = Frame(name, type(mod).__name__, cur, cur, (args, kwargs) if name in self.keep_args else None)
            self.stack.append(frame)
            if frame.args is not None:
                self.last_layer = frame
                if self.on_enter is not None:
                    self.on_enter(name)
        return pre

    def _post(self, name: str) -> Callable[..., None]:
        def post(mod: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not self.stack or self.stack[-1].module != name:
                return  # a call that started before the hooks
            frame = self.stack.pop()
            frame.peak = max(frame.peak, self.meter.peak())
            if frame.args is not None and self.on_leave is not None:
                self.on_leave(name)
            frame.args = None
            if self.stack:
                self.stack[-1].peak = max(self.stack[-1].peak, frame.peak)
            self.rows.append({"module": name, "module_class": frame.module_class, "entry_bytes": frame.entry,
                              "peak_bytes": frame.peak, "exit_bytes": self.meter.current()})
        return post

    def open_frames(self) -> list[Frame]:
        """The calls still open (innermost last): after an exception, where it was raised."""
        for frame in self.stack:
            frame.peak = max(frame.peak, self.meter.peak())
        return list(self.stack)
