"""The numerics hooks, on top of the one hook mechanism (`ci_runner/watch/capture.py`).

Eager passes (`capture_layer_outputs`) feed a `CallSink` every module call with its place in the call tree: the
reference pass records them (`RecordingSink` into a `store.DumpWriter`), an eager target compares them as they
return (`CompareSink`). Compiled passes (`capture_compiled_outputs`, run watched by `watched.py`) use the
traceable `capture.OutputHooks`, so the outputs compared are the backend's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ...watch.capture import (CallInfo, FlatOutput, ModuleCapture, OutputHooks, VersionWatch, call_key, call_signature,
                              iter_tensors)
from ...engine.codec import Unstorable, encode_call, encode_value
from ...errors import DeepviewError
from .metrics import MetricsError, compare_any_row_order, worst
from .store import DumpReader, DumpWriter


@dataclass(frozen=True, kw_only=True)
class CallMeta:
    """One module call: `key` is `name` for the first call of a module, `name#k` for its k-th later call."""

    idx: int  # start order among all calls of the pass
    key: str
    name: str
    module_class: str
    call_index: int
    parent: int | None  # idx of the calling module's call
    depth: int


# ------------------------------------------------------------------------------ calls matched by what they are

class CallMatcher:
    """Which reference call a run's call is: the k-th call of module `name` with signature `sig` (`call_signature`)
    is the reference's k-th call of `name` with that signature, whatever the order of the module's calls with
    other signatures. With `parents` (a run that knows each call's caller: the eager capture), the caller's matched
    reference call is part of what a call is: the calls inside a parent call made in another order follow it.
    Only where order can mislead: a module is matched by what its calls are when the reference's calls of it, or of
    a module it sits in, differ in signature; every other module (one call, or calls that differ only in their
    tensors' values, as a decoder's layers) keeps its index, so a signature that differs between the reference and a
    compiled run for reasons of its own (a cache object's type) never leaves a layer unmatched.
    A reference without signatures (a dump older than them), or a call whose signature is not known, is matched by
    its index, as before. `key` returns None for a call the reference has no counterpart of."""

    def __init__(self, calls: Iterable[Mapping[str, Any]], *, parents: bool = False) -> None:
        calls = list(calls)
        self.parents = parents
        self.by_id: dict[tuple[str, str | None, str], list[str]] = {}
        self.signed = True
        for c in calls:
            if c.get("sig") is None:
                self.signed = False
            parent = c.get("parent")
            parent_key = calls[parent]["key"] if parents and isinstance(parent, int) and parent < len(calls) else None
            self.by_id.setdefault((c["name"], parent_key, str(c.get("sig"))), []).append(c["key"])
        sigs: dict[str, set[str]] = {}
        for c in calls:
            sigs.setdefault(c["name"], set()).add(str(c.get("sig")))
        self.varied = {name for name, found in sigs.items() if len(found) > 1}
        self.seen: dict[tuple[str, str | None, str], int] = {}

    def by_identity(self, name: str) -> bool:
        """Whether module `name`'s calls are matched by what they are: its reference calls, or those of a module
        it sits in, differ in signature."""
        return any(name == v or v == "" or name.startswith(v + ".") for v in self.varied)

    def key(self, name: str, index_key: str, sig: str | None, parent_key: str | None = None) -> str | None:
        if not self.signed or sig is None or not self.by_identity(name):
            return index_key
        ident = (name, parent_key if self.parents else None, sig)
        k = self.seen.get(ident, 0)
        self.seen[ident] = k + 1
        keys = self.by_id.get(ident, [])
        return keys[k] if k < len(keys) else None


def match_calls(reference: Iterable[Mapping[str, Any]], run: Iterable[tuple[str, str, str | None]]) -> dict[str, str | None]:
    """`{run key: reference key}` for a run's calls `(key, name, signature)` in call order (`CallMatcher`)."""
    matcher = CallMatcher(reference)
    return {key: matcher.key(name, key, sig) for key, name, sig in run}


class CallSink:
    """What `capture_layer_outputs` feeds: `enter` before a module runs, `exit` with its output."""

    def enter(self, meta: CallMeta, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # noqa: B027
        pass

    def exit(self, meta: CallMeta, output: Any) -> None:  # noqa: B027
        pass


class _Tracker:
    """Turns ModuleCapture callbacks into CallMeta with the caller's call (a stack of open calls)."""

    def __init__(self, sink: CallSink) -> None:
        self.sink = sink
        self.stack: list[CallMeta] = []
        self.n = 0
        self.errors: list[tuple[str, BaseException]] = []

    def pre(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        meta = CallMeta(idx=self.n, key=call_key(info.name, info.call_index), name=info.name,
                        module_class=info.module_class, call_index=info.call_index,
                        parent=self.stack[-1].idx if self.stack else None, depth=info.depth)
        self.n += 1
        self.stack.append(meta)
        self.sink.enter(meta, args, kwargs)

    def post(self, info: CallInfo, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        meta = self.stack.pop() if self.stack else None
        if meta is not None:
            self.sink.exit(meta, output)


def capture_layer_outputs(module: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], sink: CallSink) -> Any:
    """Run `module(*args, **kwargs)` eagerly under no_grad with hooks on every submodule, feeding `sink`.

    Returns the model's output. Sink errors are collected (`CaptureError` after the run), never break the forward.
    """
    tracker = _Tracker(sink)
    with torch.no_grad(), ModuleCapture(module, pre=tracker.pre, post=tracker.post) as cap:
        out = module(*args, **kwargs)
    if cap.errors:
        name, exc = cap.errors[0]
        raise CaptureError(f"while observing module {name or '(root)'}: {type(exc).__name__}: {exc}") from exc
    return out


class CaptureError(DeepviewError):
    """A hook of the numerics capture failed (writing a dump, comparing a layer)."""


class RecordingSink(CallSink):
    """Streams every call's inputs and output into a `DumpWriter` (copies made at the hook).

    `finish()` after the forward marks the calls whose output the model changed in place later
    (`"mutated_later": true` in the index): a compiled target copies those at its hook (`OutputHooks(clone=…)`)."""

    def __init__(self, writer: DumpWriter) -> None:
        self.writer = writer
        self.done = 0
        self.watch = VersionWatch()

    def enter(self, meta: CallMeta, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rec: dict[str, Any] = {"idx": meta.idx, "key": meta.key, "name": meta.name, "module_class": meta.module_class,
                               "call_index": meta.call_index, "parent": meta.parent, "depth": meta.depth,
                               "sig": call_signature(args, kwargs)}  # what the call is (`CallMatcher`)
        self.watch.check()
        try:
            rec["inputs"] = encode_call(args, kwargs, self.writer.put)
        except Unstorable as exc:
            rec["inputs"] = None
            rec["inputs_error"] = f"an input cannot be stored: {exc}"
        self.writer.calls.append(rec)
        assert len(self.writer.calls) == meta.idx + 1

    def exit(self, meta: CallMeta, output: Any) -> None:
        self.watch.check()
        rec = self.writer.calls[meta.idx]
        rec["output"] = encode_value(output, self.writer.put, opaque=True)
        tensors = compared_tensors(output)
        rec["compare"] = {sub: self.writer.put(t) for sub, t in tensors.items()}
        rec["done"] = self.done
        self.done += 1
        self.watch.watch(str(meta.idx), tensors.values())

    def finish(self) -> int:
        """Mark the calls whose output was changed in place after their hook; returns how many."""
        moved = self.watch.moved()
        for idx in moved:
            self.writer.calls[int(idx)]["mutated_later"] = True
        return len(moved)


def dump_meta(ref: Any, sample: int, *, key: str | None = None) -> dict[str, Any]:
    """What a reference dump records about itself: sample, reference, torch, and `key` (the thresholds key hash it
    was recorded for: a dump is only reused for the same key)."""
    meta = {"sample": sample, "reference": {"id": getattr(ref, "id", "?"), "device": getattr(ref, "device", "cpu"),
                                            "dtype": getattr(ref, "dtype", "float32")},
            "torch": torch.__version__}
    if key is not None:
        meta["key"] = key
    return meta


def record_reference(module: nn.Module, kwargs: Mapping[str, Any], folder: Path, *, chunk_mb: float = 64.0,
                     meta: Mapping[str, Any] | None = None) -> Path:
    """The reference pass: `module(**kwargs)` with every call's inputs and output streamed to `folder`."""
    writer = DumpWriter(folder, chunk_bytes=int(chunk_mb * (1 << 20)), meta=meta)
    sink = RecordingSink(writer)
    capture_layer_outputs(module, (), kwargs, sink)
    sink.finish()
    return writer.close()


def compare_call(reader: DumpReader, call: Mapping[str, Any], output: Any) -> dict[str, Any]:
    """Worst-of metrics of a module's output against the reference's, over the tensors both sides have.

    A tensor present on one side only (an auxiliary output such as collected `hidden_states`, which an isolated
    run does not collect) is listed under `structure`, not compared; no common tensor at all, or a shape
    mismatch, raises `MetricsError`.
    """
    return compare_flat(reader, call, compared_tensors(output))


def compare_flat(reader: DumpReader, call: Mapping[str, Any], tgt: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`compare_call` on an output already flattened to {sub-name: tensor} (see `compared_tensors`)."""
    ref = reader.ref_tensors(call)
    common = [k for k in ref if k in tgt]
    if not common:
        raise MetricsError(f"{call['key'] or '(root)'}: output structure differs: reference {sorted(ref)[:5]} "
                           f"vs target {sorted(tgt)[:5]}")
    each = [compare_any_row_order(ref[k], tgt[k], where=f"{call['key'] or '(root)'}[{k}]") for k in common]
    out = worst(each)
    if any(m.get("reordered") for m in each):
        out["reordered"] = True  # the same rows in another order (see `compare_any_row_order`)
    if len(common) != len(ref) or len(common) != len(tgt):
        out["structure"] = {"only_reference": sorted(set(ref) - set(tgt))[:10],
                            "only_target": sorted(set(tgt) - set(ref))[:10]}
    return out


ResultFn = Callable[[dict[str, Any]], None]  # one comparison record, see make_record()


def make_record(view: str, call: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None,
            error: str | None = None, stage: str | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"view": view, "key": call["key"]}
    if metrics is not None:
        rec["metrics"] = dict(metrics)
    if error is not None:
        rec["error"] = error
        rec["stage"] = stage or "run"
    return rec


class CompareSink(CallSink):
    """Cumulative view, eager: each call's output is compared against the reference's when the call returns."""

    def __init__(self, reader: DumpReader, on_result: ResultFn, *, journal: Callable[[str, str], None] | None = None,
                 prefix: str = "") -> None:
        self.reader = reader
        self.on_result = on_result
        self.journal = journal
        self.prefix = prefix
        self.seen: set[str] = set()
        self.counts: dict[str, int] = {}  # calls per module name in this run
        self.matcher = CallMatcher(reader.calls, parents=True)
        self.matched: dict[int, str | None] = {}  # this run's call (idx) -> the reference call it is
        self.moved: dict[str, str] = {}  # this run's call key -> the reference's, where they differ

    def enter(self, meta: CallMeta, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.journal:
            self.journal("enter-module", self.prefix + meta.key)
        parent = self.matched.get(meta.parent) if meta.parent is not None else None
        ref_key = self.matcher.key(meta.name, meta.key, call_signature(args, kwargs), parent)
        self.matched[meta.idx] = ref_key
        if ref_key is not None and ref_key != meta.key:
            self.moved[meta.key] = ref_key

    def exit(self, meta: CallMeta, output: Any) -> None:
        if self.journal:
            self.journal("leave-module", self.prefix + meta.key)
        self.counts[meta.name] = self.counts.get(meta.name, 0) + 1
        ref_key = self.matched.pop(meta.idx, meta.key)
        call = self.reader.by_key.get(ref_key) if ref_key is not None else None
        if call is None:
            return
        self.seen.add(call["key"])
        if output is None and call["compare"]:  # post hooks run with always_call: the forward raised in here
            self.on_result(make_record("cumulative", call, error="no output: the forward raised inside this module",
                                   stage="run"))
            return
        try:
            self.on_result(make_record("cumulative", call, metrics=compare_call(self.reader, call, output)))
        except MetricsError as exc:
            self.on_result(make_record("cumulative", call, error=exc.message, stage="compare"))


def _capture_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What the cumulative view compiles: the model's call, in a frame of its own. Dynamo caches compiled code per
    code object and, by default, does not guard on hooks; compiling `module` itself could reuse a graph this
    process compiled earlier WITHOUT the capture hooks (the hooks would then silently not run)."""
    return module(*args, **kwargs)


def compile_for_capture(backend: Any) -> Callable[..., Any]:
    """`backend.compile` of the cumulative view's entry point; call it as `fn(module, args, kwargs)`."""
    return backend.compile(_capture_forward)


def capture_compiled_outputs(module: nn.Module, fn: Callable[..., Any], args: Sequence[Any],
                             kwargs: Mapping[str, Any], hooks: OutputHooks) -> tuple[Any, list[tuple[str, FlatOutput]]]:
    """Run `fn = compile_for_capture(backend)` on `module` with `hooks` on its submodules; returns
    (output, [(key, flat output)]).

    The hooks only append to a list, which Dynamo traces into the graph (no graph break): the outputs are the
    backend's own. Keys count each module's completions, so the k-th call of a module is `name#k`.
    """
    hooks.take()
    with torch.no_grad(), torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        out = fn(module, tuple(args), dict(kwargs))
    return out, hooks.take()


def compared_flat(flat: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The floating tensors of a flat output (all of them when none is floating): the tensors that are compared."""
    d = dict(flat)
    return {k: t for k, t in d.items() if t.is_floating_point() or t.is_complex()} or d


def compared_tensors(output: Any) -> dict[str, torch.Tensor]:
    """The compared tensors of a module output (`compared_flat` of its tensors)."""
    return compared_flat(iter_tensors(output))


def run_eager_with_outputs(module: nn.Module, kwargs: Mapping[str, Any]) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """`module(**kwargs)` eagerly under no_grad with every submodule's compared output tensors, like
    `watched.watched_outputs` (its compiled twin); every output is copied at its hook (eagerly, a copy only outlives the original:
    the hook's reference kept that alive anyway)."""
    with OutputHooks(module, clone=True) as hooks, torch.no_grad():
        module(**kwargs)
        keyed = hooks.take()
    return [(key, compared_flat(flat)) for key, flat in keyed]
