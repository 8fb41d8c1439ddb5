"""One metered run of a workload: the phase's calls (or the single forward), each module call's bytes, the KV
cache after each call, and where an out-of-memory struck.

The same function predicts (a model on `meta`, a `DispatchMeter`) and measures (the model on its device, the
device's allocator meter), so the two can differ only by what the device really does. Tokens for the next decode
step are the greedy ones of the run itself (on `meta` they are meta tensors: shapes are all that matters).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .. import FORWARD
from ...config import InputSpec
from ...models.load import LoadedModel, build_inputs
from ...workloads.calls import Call, cache_kwarg, logits_of, phase_calls
from ...workloads.phases import Phase
from .meters import DispatchMeter, Meter
from .tracker import Frame, ModuleTracker, layer_names, tracked_modules

__all__ = ["MeteredRun", "metered_run", "tracked_layers", "calls_of", "cache_tensors", "module_bytes", "phase_name"]


@dataclass
class MeteredRun:
    """What `metered_run` saw. `rows`: one per module call (with `call`, `step`); `calls`: one per call; `oom`: the
    out-of-memory (module, step, bytes by category) or None; `error`: another failure, in words."""

    phase: str
    meter: str
    start_bytes: int = 0
    calls: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    oom: dict[str, Any] | None = None
    error: str | None = None
    oom_frames: list[Frame] = field(default_factory=list, repr=False)


def phase_name(phase: Phase | None) -> str:
    return phase.name if phase is not None else FORWARD


def calls_of(loaded: LoadedModel, inputs: InputSpec, phase: Phase | None, device: str,
             next_token: Callable[[int], torch.Tensor]) -> Iterator[Call]:
    """The calls of `phase` (None: the single forward on the cell's first input sample)."""
    if phase is None:
        yield Call(FORWARD, None, FORWARD, build_inputs(loaded, inputs, sample=0, device=device))
    else:
        yield from phase_calls(loaded, inputs, phase, device, next_token)


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a KV cache holds (transformers' cache layers: keys, values, and a hybrid's states; an
    encoder-decoder's `EncoderDecoderCache`: its self-attention and cross-attention caches')."""
    parts = [getattr(cache, k, None) for k in ("self_attention_cache", "cross_attention_cache")]
    if any(p is not None for p in parts):
        return [t for p in parts if p is not None for t in cache_tensors(p)]
    out: list[torch.Tensor] = []
    for layer in getattr(cache, "layers", None) or []:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                out.append(value)
            elif isinstance(value, (list, tuple)):
                out += [v for v in value if isinstance(v, torch.Tensor)]
    return out


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    """The bytes of `tensors`, each tensor once (a tied weight is one object): numel × element size, the same on
    every device (a device tensor's storage object may say nothing of its size)."""
    seen = {id(t): t.numel() * t.element_size() for t in tensors}
    return sum(seen.values())


def module_bytes(module: torch.nn.Module) -> tuple[int, int]:
    """(parameter bytes, buffer bytes) of `module`, each storage once (tied weights count once)."""
    return (_unique_bytes(list(module.parameters())),
            _unique_bytes([b for b in module.buffers() if b is not None]))


def _categories(meter: Meter, module: torch.nn.Module, cache: Any) -> dict[str, int]:
    """The bytes held now, by category: parameters, buffers, KV cache, activations (everything else)."""
    params, buffers = module_bytes(module)
    kv = _unique_bytes(cache_tensors(cache)) if cache is not None else 0
    live = meter.live()
    if live:
        def held(ts: list[torch.Tensor]) -> set[int]:
            return {k for k in (meter.key(t) for t in ts) if k is not None and k in live}
        p = held(list(module.parameters()))
        b = held([x for x in module.buffers() if x is not None]) - p
        c = held(cache_tensors(cache)) - p - b if cache is not None else set()
        params, buffers, kv = (sum(live[k] for k in s) for s in (p, b, c))
    total = meter.current()
    return {"parameters": params, "buffers": buffers, "kv_cache": kv,
            "activations": max(0, total - params - buffers - kv), "total": total}


def metered_run(module: torch.nn.Module, loaded: LoadedModel, inputs: InputSpec, phase: Phase | None, device: str,
                meter: Meter, *, max_depth: int = 4, only_layers: bool = False,
                fn: Callable[..., Any] | None = None, tracker: ModuleTracker | None = None,
                journal: Callable[[str, str], None] | None = None) -> MeteredRun:
    """Run the workload once through `fn` (default `module`) under `meter`, rows for the tracked modules (the root
    and modules up to `max_depth` deep; with `only_layers`, the root and the repeated layers only). A `tracker`
    whose hooks are already in place is used as it is (its meter replaced): a compiled module's guards then see
    the same hooks in every run. `journal(event, name)` is told each layer's entry and exit (`enter-module`,
    `leave-module`, the name with its call): a process killed in a layer leaves it open in the cell's crash journal."""
    layers = layer_names(module)
    current = {"call": ""}
    if tracker is None:
        tracker = ModuleTracker(meter, tracked_layers(module, layers) if only_layers else
                                tracked_modules(module, max_depth), keep_args=layers)
        hooks: Any = tracker
    else:
        tracker.meter = meter
        hooks = contextlib.nullcontext(tracker)
    if journal is not None:
        where = phase_name(phase)
        tracker.on_enter = lambda name: journal("enter-module", f"{name} [{where}, {current['call']}]")
        tracker.on_leave = lambda name: journal("leave-module", f"{name} [{where}, {current['call']}]")
    run = MeteredRun(phase=phase_name(phase), meter=meter.name)
    tokens: list[torch.Tensor] = []
    key = cache_kwarg(module) or "past_key_values"
    if isinstance(meter, DispatchMeter):
        meter.seed([*module.parameters(), *(b for b in module.buffers() if b is not None)])
    run.start_bytes = meter.current()
    with torch.no_grad(), meter.activate(), hooks:
        for call in calls_of(loaded, inputs, phase, device, lambda step: tokens[step - 1]):
            current["call"] = call.label
            if not _one_call(run, tracker, fn or module, module, call, key, meter, tokens):
                break
    return run


def tracked_layers(module: torch.nn.Module, layers: set[str]) -> list[tuple[str, torch.nn.Module]]:
    """The root and the repeated layers."""
    return [(n, m) for n, m in module.named_modules() if not n or n in layers]


def _one_call(run: MeteredRun, tracker: ModuleTracker, fn: Callable[..., Any], module: torch.nn.Module, call: Call,
              key: str, meter: Meter, tokens: list[torch.Tensor]) -> bool:
    cache = call.kwargs.get(key)
    before = len(tracker.rows)
    try:
        out = fn(**call.kwargs)
    except torch.OutOfMemoryError as exc:
        frames = tracker.open_frames()
        inner = frames[-1] if frames else None
        layer = next((f for f in reversed(frames) if f.args is not None), None)
        run.oom = {"call": call.label, "step": call.step, "module": inner.module if inner else "",
                   "module_class": inner.module_class if inner else "", "layer": layer.module if layer else None,
                   "layer_entry_bytes": layer.entry if layer else None, "message": str(exc).splitlines()[0],
                   "stack": [f.module for f in frames], "by_category": _categories(meter, module, cache)}
        run.oom_frames = frames
        tracker.reset()
        return False
    except Exception as exc:  # the device or backend failed otherwise: reported, not a memory figure  # noqa: BLE001
        run.error = f"{call.label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        tracker.reset()
        return False
    logits = logits_of(out)
    if logits is not None and call.phase in ("prefill", "decode"):
        tokens.append(logits[:, -1:].argmax(-1))
    del out, logits
    root = next((r for r in reversed(tracker.rows[before:]) if r["module"] == ""), None)
    kv = _unique_bytes(cache_tensors(cache)) if cache is not None else 0
    run.calls.append({"call": call.label, "step": call.step, "kv_bytes": kv,
                      "peak_bytes": root["peak_bytes"] if root else None,
                      "entry_bytes": root["entry_bytes"] if root else None})
    for row in tracker.rows[before:]:
        run.rows.append({"call": call.label, "step": call.step, **row})
    return True
