"""Compiled against eager, layer by layer, on the same device: which layer needs more memory compiled.

Each repeated layer (`tracker.layer_names`: a decoder layer, an expert) gets its `forward` compiled alone by the
backend, as `torch.compile(layer.forward)`; the hooks that read the meter stay outside the compiled code. The whole
workload runs once to compile (not metered), then metered, with the same hooks in place (hooks added later would
fail the compiled code's guards and recompile it under the meter); eager runs the same calls. A layer's figure is its
working bytes: the peak of its call above the bytes live when the call began. On CPU the meter is the
`DispatchMeter` (ATen allocations), elsewhere the device's allocator.

The layers are compiled watched, under one watch (`Backend.compile_watched(join=…)`), entered around each phase's
compiled runs: a layer the backend did not run (no graph given or executed, Dynamo's fallback to eager, the backend's
own silent fallback; graph breaks not counted, the graphs around one still run on the backend) measured PyTorch's
memory, not the compiled code's. Its rows say so (`status: inconclusive`, `not_ran`) and are never a regression.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Any, Callable

import torch

from ...backends.ran import CompileWatch
from ...config import InputSpec
from ...watch.hooks import ModuleHooks
from ...models.load import LoadedModel
from ...workloads.phases import Phase
from .meters import DispatchMeter, Meter, NullMeter, device_meter
from .runs import MeteredRun, calls_of, metered_run, phase_name, tracked_layers
from .tracker import ModuleTracker, layer_names

__all__ = ["compiled_meter", "compare_compiled", "capture_layer_args"]


def compiled_meter(device: str) -> Callable[[], Meter] | None:
    """A factory of fresh meters for the comparison on `device`, or None when nothing can measure there."""
    if device.split(":")[0] == "cpu":
        return DispatchMeter
    meter = device_meter(device)
    return (lambda: meter) if meter is not None else None


def _compiled_copy(module: torch.nn.Module,
                   backend: Any) -> tuple[torch.nn.Module, CompileWatch | None, dict[str, int]]:
    """A copy on the backend's device with each layer's forward compiled, the watch they share (None: no layer)
    and each layer's compile in it (its record's index)."""
    out = backend.to_device(copy.deepcopy(module))
    watch: CompileWatch | None = None
    index: dict[str, int] = {}
    for name in sorted(layer_names(out)):
        layer = out.get_submodule(name)
        layer.forward, watch = backend.compile_watched(layer.forward, join=watch)
        if watch.records:
            index[name] = len(watch.records) - 1
    return out, watch, index


def _not_ran(rows: list[dict[str, Any]], watch: CompileWatch, index: dict[str, int]) -> str | None:
    """Mark the rows of the layers the backend did not run (`status: inconclusive`, `not_ran`); the first reason."""
    why: dict[str, str | None] = {}
    for r in rows:
        if r["module"] not in why:
            why[r["module"]] = watch.not_ran(breaks=False, of=index.get(r["module"]))
        if why[r["module"]]:
            r.update(status="inconclusive", not_ran=why[r["module"]])
    return next((w for w in why.values() if w), None)


def compare_compiled(loaded: LoadedModel, inputs: InputSpec, phases: list[Phase | None], backend: Any,
                     new_meter: Callable[[], Meter]) -> dict[str, tuple[list[dict[str, Any]], str | None, str | None]]:
    """Per phase: per (call, layer) eager and compiled working bytes and their ratio (a row of a layer the backend
    did not run marked `inconclusive`), an error in words or None, and why the backend did not run (some of) the
    layers or None. One eager copy and one compiled copy serve every phase, as a user compiles once and runs each
    workload."""
    import torch._dynamo  # deferred: Dynamo takes seconds to import

    device = backend.device
    out: dict[str, tuple[list[dict[str, Any]], str | None, str | None]] = {}
    eager_mod = backend.to_device(copy.deepcopy(loaded.module))
    eager = {phase_name(p): metered_run(eager_mod, loaded, inputs, p, device, new_meter(), only_layers=True)
             for p in phases}
    del eager_mod
    torch._dynamo.reset()
    comp_mod, watch, index = _compiled_copy(loaded.module, backend)
    layers = layer_names(comp_mod)
    with ModuleTracker(NullMeter(), tracked_layers(comp_mod, layers), keep_args=layers) as tracker:
        for p in phases:
            name, e = phase_name(p), eager[phase_name(p)]
            if e.error or e.oom:
                out[name] = [], f"eager: {e.error or e.oom['message']}", None  # type: ignore[index]
                continue
            with watch if watch is not None else nullcontext():
                warm = metered_run(comp_mod, loaded, inputs, p, device, NullMeter(), tracker=tracker)
                c = warm if warm.error else metered_run(comp_mod, loaded, inputs, p, device, new_meter(),
                                                        tracker=tracker)
            if c.error or c.oom:
                out[name] = [], f"compiled: {c.error or c.oom['message']}", None  # type: ignore[index]
                continue
            rows = _pair(e, c, layers)
            out[name] = rows, None, _not_ran(rows, watch, index) if watch is not None else None
    return out


def _pair(eager: MeteredRun, compiled: MeteredRun, layers: set[str]) -> list[dict[str, Any]]:
    comp = {(r["call"], r["module"]): r for r in compiled.rows}
    rows = []
    for e in eager.rows:
        c = comp.get((e["call"], e["module"]))
        if c is None or e["module"] not in layers:
            continue
        ew, cw = e["peak_bytes"] - e["entry_bytes"], c["peak_bytes"] - c["entry_bytes"]
        rows.append({"module": e["module"], "module_class": e["module_class"], "call": e["call"], "step": e["step"],
                     "eager_bytes": ew, "compiled_bytes": cw, "ratio": cw / ew if ew else None})
    return rows


def capture_layer_args(loaded: LoadedModel, inputs: InputSpec, phase: Phase | None, layer: str,
                       call_label: str) -> Any:
    """(args, kwargs) of `layer`'s first call during the workload's call `call_label`, run eagerly on CPU (copies)."""
    current = {"label": None}
    got: list[Any] = []
    sub = loaded.module.get_submodule(layer)

    def pre(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if current["label"] == call_label and not got:
            got.append(copy.deepcopy((args, kwargs)))

    tokens: list[torch.Tensor] = []
    with ModuleHooks([(layer, sub)], pre=lambda _name: pre), torch.no_grad():
        for call in calls_of(loaded, inputs, phase, "cpu", lambda step: tokens[step - 1]):
            current["label"] = call.label
            out = loaded.module(**call.kwargs)
            logits = getattr(out, "logits", None)
            if logits is not None:
                tokens.append(logits[:, -1:].argmax(-1))
            if got:
                break
    return got[0] if got else None
