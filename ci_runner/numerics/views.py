"""The two views of a target (or a secondary reference) against a reference dump.

* **isolated** (`run_isolated_view`): every reference call re-run alone on the reference's inputs, its direct
  sub-calls stubbed with the reference's outputs for them, so its metrics measure its own ops only.
* **cumulative** (`run_cumulative_view`): the whole model's forward, every call's output compared as it comes
  (eager) or after the compiled graph returns (compiled, through `capture.OutputHooks`).

`derive_reference_stats` runs both for the secondary references to derive thresholds. The method is described
in `docs/numerics.md`.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..engine.capture import OutputHooks, flatten_traceable
from ..engine.codec import Unstorable
from ..engine.failure import is_compile_stage
from ..engine.tree import map_tensors
from .capture import (
    CaptureError,
    CompareSink,
    ResultFn,
    capture_compiled_outputs,
    capture_layer_outputs,
    compare_call,
    compare_flat,
    compared_flat,
    compile_for_capture,
    dump_meta,
    make_record,
    record_reference,
)
from .metrics import MetricsError, compare_tensors, worst
from .settings import DTYPES, VIEWS
from .store import DumpReader
from .thresholds import LayerStats

def cast_tree(obj: Any, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Any:
    """Floating tensors to `dtype`, every tensor to `device`, through tuples/lists/dicts/ModelOutput."""
    dev = torch.device(device) if device is not None else None

    def cast(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        if dev is not None and t.device != dev:
            t = t.to(dev)
        return t

    return map_tensors(cast, obj)


_STUB_QUEUE: list[Any] = []  # the reference's outputs of the stubbed sub-calls, in call order
_STUB_SEEN: list[tuple[tuple[str, torch.Tensor], ...]] = []  # what the module passed to each stubbed sub-call
_MISSING = object()


def _stub_forward(*args: Any, **kwargs: Any) -> Any:
    """Stands in for a sub-call in the isolated view: records the inputs the module under test passes to it (its
    own ops may compute them) and returns the reference's output for that sub-call. Traceable by Dynamo."""
    acc: list[tuple[str, torch.Tensor]] = []
    flatten_traceable(args, "args", acc)
    flatten_traceable(kwargs, "kwargs", acc)
    _STUB_SEEN.append(tuple(acc))
    return _STUB_QUEUE.pop(0)


def _subcall_input_metrics(reader: DumpReader, kids: Sequence[Mapping[str, Any]],
                           seen: Sequence[tuple[tuple[str, torch.Tensor], ...]]) -> list[tuple[str, dict[str, Any]]]:
    """Metrics of what the module passed to each stubbed sub-call against what the reference passed."""
    out = []
    for kid, passed in zip(kids, seen):
        try:
            ref_args, ref_kwargs = reader.inputs(kid)
        except Unstorable:
            continue
        acc: list[tuple[str, torch.Tensor]] = []
        flatten_traceable(ref_args, "args", acc)
        flatten_traceable(ref_kwargs, "kwargs", acc)
        ref = dict(acc)
        tgt = dict(passed)
        common = [k for k in ref if k in tgt and ref[k].shape == tgt[k].shape]
        if common:
            out.append((kid["key"], worst(compare_tensors(ref[k], tgt[k]) for k in common)))
    return out


def _install_stubs(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, Any]]:
    saved = []
    for m in {id(m): m for m in modules}.values():
        saved.append((m, m.__dict__.get("forward", _MISSING)))
        m.forward = _stub_forward  # type: ignore[method-assign]
    return saved


def _remove_stubs(saved: list[tuple[nn.Module, Any]]) -> None:
    for m, prev in saved:
        if prev is _MISSING:
            m.__dict__.pop("forward", None)
        else:
            m.forward = prev  # type: ignore[method-assign]


def short_error(exc: BaseException, limit: int = 400) -> str:
    """`Type: first line` of an exception; a first line that only announces the cause (Dynamo's `backend='x'
    raised:`) is followed by the next line, which holds it."""
    lines = [ln.strip() for ln in f"{type(exc).__name__}: {exc}".splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    if text.endswith(":") and len(lines) > 1:
        text += " " + lines[1]
    return text[:limit]


def run_isolated_view(modules: Mapping[str, nn.Module], reader: DumpReader,
                      runner: Callable[[str, nn.Module], Callable[..., Any]], on_result: ResultFn, *,
                      cast: Callable[[Any], Any] = lambda x: x, skip: Iterable[str] = (),
                      journal: Callable[[str, str], None] | None = None, prefix: str = "",
                      deadline: float | None = None) -> None:
    """Each reference call re-run alone: `runner(name, module)` (the target's compiled module, or a reference
    module) on the reference's inputs, its direct sub-calls stubbed with the reference's outputs for them.

    The call's metrics are the worst of its output and of the inputs it passes to its stubbed sub-calls (an own
    op whose result only feeds a sub-call, e.g. a rotary embedding applied before a projection, shows there; the
    record's `via` then names that sub-call).

    `cast` moves/casts inputs and stubbed outputs (to the target's device, to a reference's dtype). Calls whose
    inputs could not be stored, or that fail to compile or run, become error records; the rest metric records.
    """
    skipped = set(skip)
    for call in reader.calls:
        if call["key"] in skipped:
            continue
        if deadline is not None and time.monotonic() > deadline:
            on_result(make_record("isolated", call, error="not run: out of time", stage="timeout"))
            continue
        module = modules.get(call["name"])
        if module is None:
            on_result(make_record("isolated", call, error=f"module {call['name']!r} not found in the model", stage="compare"))
            continue
        try:
            args, kwargs = reader.inputs(call)
        except Unstorable as exc:
            on_result(make_record("isolated", call, error=f"not run: {exc}", stage="capture"))
            continue
        kids = reader.children(call)
        kid_modules = [modules.get(k["name"]) for k in kids]
        if any(m is None for m in kid_modules):
            on_result(make_record("isolated", call, error="a sub-module was not found in the model", stage="compare"))
            continue
        args, kwargs = cast(args), cast(kwargs)
        queue = [cast(reader.output(k)) for k in kids]
        if journal:
            journal("enter-module", prefix + call["key"])
        saved = _install_stubs(kid_modules)  # type: ignore[arg-type]
        _STUB_QUEUE[:] = queue
        _STUB_SEEN.clear()
        stage = "compile"
        try:
            fn = runner(call["name"], module)
            stage = "run"
            with torch.no_grad():
                out = fn(*args, **kwargs)
            left = len(_STUB_QUEUE)
            seen = list(_STUB_SEEN)
            _STUB_SEEN.clear()
            stage = "compare"
            metrics = compare_call(reader, call, out)
            del out
            via = None
            for kid_key, m in _subcall_input_metrics(reader, kids, seen):
                if float(m["rel"]) > float(metrics["rel"]) or math.isnan(float(m["rel"])):
                    via = kid_key
                metrics = {**worst([metrics, m]), **({"structure": metrics["structure"]} if "structure" in metrics else {})}
            rec = make_record("isolated", call, metrics=metrics)
            if via is not None:
                rec["via"] = via  # the worst difference is in what this module passes to that sub-call
            if left:
                rec["note"] = f"{left} stubbed sub-call(s) not consumed"
        except MetricsError as exc:
            rec = make_record("isolated", call, error=exc.message, stage="compare")
        except Exception as exc:
            rec = make_record("isolated", call, error=short_error(exc), stage="compile" if is_compile_stage(exc) else stage)
        finally:
            _STUB_QUEUE.clear()
            _STUB_SEEN.clear()
            _remove_stubs(saved)
        if journal:
            journal("leave-module", prefix + call["key"])
        on_result(rec)



def run_cumulative_view(module: nn.Module, backend: Any, readers: Sequence[DumpReader], skip: Iterable[str], emit: ResultFn,
                to_dev: Callable[[Any], Any], journal: Callable[[str, str], None] | None) -> None:
    eager = bool(getattr(backend, "is_eager", False))
    skipped = set(skip)
    appender = None if eager else OutputHooks(module)
    fn = None
    try:
        for s, reader in enumerate(readers):
            if f"cumulative:{s}" in skipped:
                continue
            root = reader.root()
            args, kwargs = reader.inputs(root)
            args, kwargs = to_dev(args), to_dev(kwargs)
            tag = f"cumulative:{s}"
            if journal:
                journal("enter-module", tag)
            t0 = time.monotonic()
            try:
                if eager:
                    sink = CompareSink(reader, lambda r, s=s: emit({**r, "sample": s}), journal=journal, prefix=tag + ":")
                    capture_layer_outputs(module, args, kwargs, sink)
                    seen = sink.seen
                else:
                    assert appender is not None
                    if fn is None:
                        fn = compile_for_capture(backend)
                    _out, records = capture_compiled_outputs(module, fn, args, kwargs, appender)
                    if not records and reader.calls:
                        raise CaptureError("the compiled model ran but none of the capture hooks did")
                    seen = set()
                    records.reverse()
                    while records:
                        key, out = records.pop()  # drop each output once compared
                        call = reader.by_key.get(key)
                        if call is None:
                            continue
                        seen.add(key)
                        flat = compared_flat(out)
                        try:
                            emit({**make_record("cumulative", call, metrics=compare_flat(reader, call, flat)), "sample": s})
                        except MetricsError as exc:
                            emit({**make_record("cumulative", call, error=exc.message, stage="compare"), "sample": s})
                        del out, flat
                missing = [c["key"] for c in reader.calls if c["key"] not in seen]
                emit({"view": "cumulative", "sample": s, "status": "ok", "unobserved": missing[:50],
                      "unobserved_count": len(missing), "seconds": round(time.monotonic() - t0, 4)})
            except Exception as exc:
                emit({"view": "cumulative", "sample": s, "status": "error", "error": short_error(exc, 2000),
                      "stage": "compile" if is_compile_stage(exc) else "run"})
            if journal:
                journal("leave-module", tag)
    finally:
        if appender is not None:
            appender.remove()



def derive_reference_stats(primary: nn.Module, primary_ref: Any, secondaries: Sequence[tuple[Any, nn.Module]],
                           sample_inputs: Callable[[int], Mapping[str, Any]], samples: int, dump_root: Path, *,
                           keep: Iterable[int] = (), chunk_mb: float = 64.0,
                           views: Sequence[str] = VIEWS, dump_key: str | None = None) -> dict[str, LayerStats]:
    """Reference-vs-reference statistics per call key: each secondary reference (a `config.Reference` and its
    module) against the primary's dump, in both views, over `samples` inputs. Dumps of samples in `keep` stay on
    disk (the target is compared against them, `dump_key` marks them as made for these thresholds); the others are
    deleted once measured."""
    stats: dict[str, LayerStats] = {}
    keep = set(keep)
    for s in range(samples):
        folder = dump_root / f"sample-{s}"
        record_reference(primary, sample_inputs(s), folder, chunk_mb=chunk_mb, meta=dump_meta(primary_ref, s, key=dump_key))
        reader = DumpReader(folder)
        for ref, module in secondaries:
            dt = DTYPES.get(ref.dtype)

            def cast(x: Any, dt: torch.dtype | None = dt, dev: str = ref.device) -> Any:
                return cast_tree(x, dtype=dt, device=dev)

            def add(rec: dict[str, Any]) -> None:
                if "metrics" not in rec:
                    return
                call = reader.by_key[rec["key"]]
                layer = stats.setdefault(rec["key"], LayerStats(module_class=call["module_class"], name=call["name"]))
                layer.add(rec["view"], rec["metrics"])

            if "cumulative" in views:
                args, kwargs = reader.inputs(reader.root())
                capture_layer_outputs(module, cast(args), cast(kwargs), CompareSink(reader, add))
            if "isolated" in views:
                run_isolated_view(dict(module.named_modules()), reader, lambda _n, m: m, add, cast=cast)
        reader.close()
        if s not in keep:
            shutil.rmtree(folder, ignore_errors=True)
    return stats


def runnable_reference(module: nn.Module, dtype: str) -> list[str]:
    """Adjust a reference model so that it can run in `dtype`; returns what was changed (for the notes).

    transformers' MoE experts default to `torch._grouped_mm`, which has no float64 kernel: a float64 reference of a
    Mixtral-style model switches to the `eager` experts (a loop over experts, the same math).
    """
    changed = []
    config = getattr(module, "config", None)
    if dtype == "float64" and config is not None and getattr(config, "_experts_implementation", None) not in (None, "eager"):
        try:
            config._experts_implementation = "eager"
            changed.append("experts_implementation=eager (grouped_mm has no float64 kernel)")
        except (AttributeError, ValueError, TypeError):
            pass
    return changed
