"""The two views of a target (or a secondary reference) against a reference dump.

* **isolated** (`run_isolated_view`): every reference call re-run alone on the reference's inputs, its direct
  sub-calls stubbed with the reference's outputs for them, so its metrics measure its own ops only.
* **cumulative** (`run_cumulative_view`): the whole model's forward, every call's output compared as it comes
  (eager) or after the compiled graph returns (compiled, through `capture.OutputHooks`, watched: `watched.py`).

`derive_reference_stats` runs both for the secondary references to derive thresholds. The method is described
in `docs/numerics.md`.
"""

from __future__ import annotations

import copy
import math
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ...watch.capture import flatten_traceable
from ...engine.codec import Unstorable
from ...failures.failure import is_compile_stage
from ...workloads.emulate import Emulate, emulate
from ...workloads.rounding import round_to
from ...models.tree import map_tensors
from .capture import (
    CallMatcher,
    CallSink,
    CaptureError,
    CompareSink,
    ResultFn,
    call_signature,
    capture_layer_outputs,
    compare_call,
    compare_flat,
    compared_flat,
    dump_meta,
    make_record,
    record_reference,
)
from .metrics import MetricsError, compare_any_row_order, worst
from .settings import DTYPES, VIEWS
from .store import DumpReader, dump_matches
from .thresholds import LayerStats
from ...workloads.precision import PrecisionPolicy
from .watched import CAPTURE, NOT_RAN, CaptureRun, partial_reason, partial_sites, watched_capture

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


# the reference's stubbed sub-calls, in the reference's call order: (index among the call's sub-calls, module name,
# signature (`capture.call_signature`, None in a dump older than signatures), the reference's output)
_STUB_QUEUE: list[tuple[int, str, str | None, Any]] = []
_STUB_SEEN: list[tuple[tuple[str, torch.Tensor], ...]] = []  # what the module passed to each stubbed sub-call
_STUB_SERVED: list[int] = []  # which reference sub-call each stubbed call was matched with (its index)
_STUB_FORWARDS: dict[str, Callable[..., Any]] = {}
_MISSING = object()


def _stub_forward(name: str) -> Callable[..., Any]:
    """The stand-in for module `name`'s sub-calls in the isolated view (one function per name for the process,
    so that a compiled module's guards hold from one sample to the next): it records the inputs the module under
    test passes (its own ops may compute them) and returns the reference's output of the sub-call it IS: the
    first queued call of the same module with the same signature (`capture.call_signature`), not merely the next
    one, so calls made in another order than the reference's (ModernBERT's rotary embedding per layer type,
    whose order follows the hash seed) get their own outputs. Traceable by Dynamo (constants compared only)."""
    stub = _STUB_FORWARDS.get(name)
    if stub is None:
        def stub(*args: Any, **kwargs: Any) -> Any:
            acc: list[tuple[str, torch.Tensor]] = []
            flatten_traceable(args, "args", acc)
            flatten_traceable(kwargs, "kwargs", acc)
            _STUB_SEEN.append(tuple((k, t.clone()) for k, t in acc))  # copies: the module may change them later
            sig = call_signature(args, kwargs)
            pick = 0  # nothing the same: the next one, as the reference's order has it
            for i, queued in enumerate(_STUB_QUEUE):
                if queued[1] == name and (queued[2] is None or queued[2] == sig):
                    pick = i
                    break
            index, _name, _sig, out = _STUB_QUEUE.pop(pick)
            _STUB_SERVED.append(index)
            return out

        _STUB_FORWARDS[name] = stub
    return stub


class PathMismatch(Exception):
    """The module ran another code path than the reference's: it calls its sub-modules a different number of
    times, or with other input shapes. Its numbers are not comparable; the record says why (stage `paths`)."""


def _shapes(flat: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(t.shape) for k, t in flat}


def _subcall_input_metrics(reader: DumpReader, kids: Sequence[Mapping[str, Any]],
                           seen: Sequence[tuple[tuple[str, torch.Tensor], ...]]) -> list[tuple[str, dict[str, Any]]]:
    """Metrics of what the module passed to each stubbed sub-call against what the reference passed.

    The calls are checked, not assumed, to match: as many as the reference's, each with the same input tensors
    and shapes; `PathMismatch` otherwise (the stubs would hand one path's outputs to another path's calls)."""
    if len(seen) != len(kids):
        raise PathMismatch(f"the module made {len(seen)} sub-module call(s) where the reference made {len(kids)}")
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
        common = [k for k in ref if k in tgt]  # an input on one side only (a mask materialized when compiling,
        differ = {k: (tuple(tgt[k].shape), tuple(ref[k].shape))  # None eagerly) is no other path by itself
                  for k in common if tuple(ref[k].shape) != tuple(tgt[k].shape)}
        if differ or (ref and not common):
            raise PathMismatch(f"it passes {kid['key'] or '(root)'} inputs of other shapes than the reference's "
                               f"(target, reference: {differ or (sorted(tgt), sorted(ref))})")
        each = {k: compare_any_row_order(ref[k], tgt[k]) for k in common}
        moved = [k for k, m in each.items() if m.get("reordered")]
        if moved:
            raise PathMismatch(f"it passes {kid['key'] or '(root)'} the reference's rows in another order ({moved[0]}; "
                               f"e.g. an unstable sort of routed tokens): the reference's outputs cannot stand in "
                               f"for that sub-call")
        if each:
            out.append((kid["key"], worst(each.values())))
    return out


def _install_stubs(modules: Iterable[tuple[str, nn.Module]]) -> list[tuple[nn.Module, Any]]:
    saved = []
    for name, m in {id(m): (n, m) for n, m in modules}.values():
        saved.append((m, m.__dict__.get("forward", _MISSING)))
        m.forward = _stub_forward(name)  # type: ignore[method-assign]
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
    module) on the reference's inputs, its direct sub-calls stubbed with the reference's outputs for them. It is
    one piece: the stubs, the deadline, the journal and the record of a call share that call's state.

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
        queue = [(i, k["name"], k.get("sig"), cast(reader.output(k))) for i, k in enumerate(kids)]
        if journal:
            journal("enter-module", prefix + call["key"])
        saved = _install_stubs(zip([k["name"] for k in kids], kid_modules))  # type: ignore[arg-type]
        _STUB_QUEUE[:] = queue
        _STUB_SEEN.clear()
        _STUB_SERVED.clear()
        stage = "compile"
        try:
            fn = runner(call["name"], module)
            stage = "run"
            with torch.no_grad():
                out = fn(*args, **kwargs)
            seen = list(_STUB_SEEN)
            served = [kids[i] for i in _STUB_SERVED]  # the reference sub-call each one was matched with
            _STUB_SEEN.clear()
            _STUB_SERVED.clear()
            stage = "compare"
            metrics = compare_call(reader, call, out)
            del out
            via = None
            for kid_key, m in _subcall_input_metrics(reader, served if len(served) == len(seen) else kids, seen):
                if float(m["rel"]) > float(metrics["rel"]) or math.isnan(float(m["rel"])):
                    via = kid_key
                metrics = {**worst([metrics, m]), **({"structure": metrics["structure"]} if "structure" in metrics else {})}
            rec = make_record("isolated", call, metrics=metrics)
            if len(served) == len(kids) and served != kids:  # matched by what they are (`_stub_forward`)
                rec["calls_matched"] = "by signature: its sub-calls came in another order than the reference's"
            if via is not None:
                rec["via"] = via  # the worst difference is in what this module passes to that sub-call
        except PathMismatch as exc:
            rec = make_record("isolated", call, error=f"not comparable: {exc}", stage="paths")
        except MetricsError as exc:
            rec = make_record("isolated", call, error=exc.message, stage="compare")
        except Exception as exc:
            if stage == "run" and len(_STUB_SEEN) > len(kids):  # a sub-call beyond the reference's: no stub left
                rec = make_record("isolated", call, stage="paths", error="not comparable: the module made more "
                                  f"sub-module calls than the reference's {len(kids)}")
            else:
                rec = make_record("isolated", call, error=short_error(exc),
                                  stage="compile" if is_compile_stage(exc) else stage)
        finally:
            _STUB_QUEUE.clear()
            _STUB_SEEN.clear()
            _STUB_SERVED.clear()
            _remove_stubs(saved)
        if journal:
            journal("leave-module", prefix + call["key"])
        on_result(rec)



def _name_counts(keys: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for key in keys:
        name = key.partition("#")[0]
        out[name] = out.get(name, 0) + 1
    return out


def calls_differ(reader: DumpReader, counts: Mapping[str, int]) -> dict[str, str]:
    """The modules the run called another number of times than the reference (`{name: why}`): their calls cannot
    be matched one to one (a loop over experts against one grouped call), so none of them is compared."""
    ref = _name_counts(c["key"] for c in reader.calls)
    return {name: f"called {counts.get(name, 0)} time(s) in this run, {n} in the reference (another code path)"
            for name, n in ref.items() if counts.get(name, 0) not in (0, n)}


def run_cumulative_view(module: nn.Module, backend: Any, readers: Sequence[DumpReader], skip: Iterable[str], emit: ResultFn,
                to_dev: Callable[[Any], Any], journal: Callable[[str, str], None] | None) -> None:
    """Every call's output in the whole model's forward against `readers` (one per sample): compared as it returns
    (eager backends) or from a watched compiled capture (`watched.watched_capture`: did the backend run it, and in
    which way the outputs were captured; a fresh compile per sample)."""
    eager = bool(getattr(backend, "is_eager", False))
    skipped = set(skip)
    mutated = set().union(*(r.mutated_names() for r in readers)) if readers else set()
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
                differ = calls_differ(reader, sink.counts)  # checked after: the records were emitted live
                capture: dict[str, Any] = {}
            else:
                run = watched_capture(module, backend, args, kwargs, mutated)
                capture = run.status()
                seen, differ = _compare_compiled(reader, run, lambda r, s=s: emit({**r, "sample": s}))
            for c in reader.calls:  # a module called another number of times: which call is which is unknown
                if c["name"] in differ:
                    seen.add(c["key"])
                    emit({**make_record("cumulative", c, error=f"not comparable: {differ[c['name']]}",
                                        stage="paths"), "sample": s})
            missing = [c["key"] for c in reader.calls if c["key"] not in seen]
            emit({"view": "cumulative", "sample": s, "status": "ok", "unobserved": missing[:50],
                  "unobserved_count": len(missing), "seconds": round(time.monotonic() - t0, 4), **capture})
        except Exception as exc:
            emit({"view": "cumulative", "sample": s, "status": "error", "error": short_error(exc, 2000),
                  "stage": "compile" if is_compile_stage(exc) else "run"})
        if journal:
            journal("leave-module", tag)


def _compare_compiled(reader: DumpReader, run: CaptureRun, emit: ResultFn) -> tuple[set[str], dict[str, str]]:
    """The records of a watched compiled capture against the reference: (keys seen, modules whose call counts
    differ). A capture the backend did not run is no comparison: every call is `not_ran`. Calls the capture's way
    cannot hold (`no-hooks`: all but the root; `hooks-reference`: outputs changed in place later) are `capture`.
    A module whose own code calls an op the backend's partitioner left to PyTorch (`watched.partial_sites`) is
    `not_ran` (its ancestors are compared: the rest of their code ran on the backend; `data.capture` lists them)."""
    if run.not_ran is not None:
        for c in reader.calls:
            emit(make_record("cumulative", c, error=f"the backend did not run it ({run.way}): {run.not_ran}"[:600],
                             stage=NOT_RAN))
        return {c["key"] for c in reader.calls}, {}
    records = run.records
    if not records and reader.calls:
        raise CaptureError("the compiled model ran but none of the capture hooks did")
    seen: set[str] = set()
    differ = {} if run.way == "no-hooks" else calls_differ(reader, _name_counts(k for k, _ in records))
    if run.way == "no-hooks":
        why = "; ".join(t["not_ran"] for t in run.tried)[:400]
        for c in reader.calls[1:] if reader.calls and reader.calls[0]["key"] == "" else reader.calls:
            seen.add(c["key"])
            emit(make_record("cumulative", c, stage=CAPTURE, error=f"not compared in this view: with capture hooks "
                             f"the backend did not run the model ({why}); it ran without them, so only the model's "
                             f"output is compared here and its layers in the isolated view"))
    partial = {w: op for op, where in partial_sites(run.facts).items() for w in where}  # module -> op left eager
    # which reference call each one is: by module and signature (`capture.CallMatcher`), not by order alone
    matcher = CallMatcher(reader.calls)
    records.reverse()
    while records:
        key, out = records.pop()  # drop each output once compared
        name, sig = run.signatures.get(key, (key.partition("#")[0], None))
        ref_key = matcher.key(name, key, sig)
        call = reader.by_key.get(ref_key) if ref_key is not None else None
        if call is None or call["name"] in differ:
            continue
        seen.add(call["key"])
        if call["name"] in partial:  # its own code ran in part on PyTorch: not a pass of the backend
            emit(make_record("cumulative", call, stage=NOT_RAN, error=partial_reason(partial[call["name"]], run.backend)))
            continue
        if key in run.unheld:
            emit(make_record("cumulative", call, stage=CAPTURE, error="not compared in this view: changed in place "
                             "after its hook, and the backend does not run the model when it is copied there"))
            continue
        flat = compared_flat(out)
        try:
            emit(make_record("cumulative", call, metrics=compare_flat(reader, call, flat)))
        except MetricsError as exc:
            emit(make_record("cumulative", call, error=exc.message, stage="compare"))
        del out, flat
    return seen, differ



def derive_reference_stats(primary: nn.Module, primary_ref: Any, secondaries: Sequence[tuple[Any, nn.Module]],
                           sample_inputs: Callable[[int], Mapping[str, Any]], samples: int, dump_root: Path, *,
                           keep: Iterable[int] = (), chunk_mb: float = 64.0,
                           views: Sequence[str] = VIEWS, dump_key: str | None = None,
                           timings: dict[str, float] | None = None,
                           policy: PrecisionPolicy | None = None) -> dict[str, LayerStats]:
    """Reference-vs-reference statistics per call key: each secondary reference (a `config.Reference` and its
    module) against the primary's dump, in both views, over `samples` inputs. Dumps of samples in `keep` stay on
    disk (the target is compared against them, `dump_key` marks them as made for these thresholds); the others are
    deleted once measured. A dump already on disk for `dump_key` (the samples kept by a derivation of the other
    view, `thresholds.add_views`) is read, not recorded again. `timings` (when given) gets the seconds of each step:
    `derive_record_s` (the primary's passes with their dumps), `derive_cumulative_s` and `derive_isolated_s` (the
    secondaries' views, comparisons included). A `policy` below float32 (`workloads/precision.py`) adds its
    emulation on the primary itself (`workloads/emulate.emulate`) as one more run in both views, kept apart
    (`LayerStats.policy`): the spread the backend's declared precision explains."""
    stats: dict[str, LayerStats] = {}
    keep = set(keep)
    spent = timings if timings is not None else {}
    for step in ("derive_record_s", "derive_cumulative_s", "derive_isolated_s"):
        spent.setdefault(step, 0.0)
    for s in range(samples):
        folder = dump_root / f"sample-{s}"
        t0 = time.monotonic()
        if dump_key is None or not dump_matches(folder, dump_key):
            record_reference(primary, sample_inputs(s), folder, chunk_mb=chunk_mb,
                             meta=dump_meta(primary_ref, s, key=dump_key))
        reader = DumpReader(folder)
        spent["derive_record_s"] += time.monotonic() - t0
        # (module, dtype, device, the policy it runs under): the secondaries as they are (float32: no rounding),
        # then a policy below float32 emulated on the primary itself
        runs: list[tuple[nn.Module, torch.dtype | None, str, PrecisionPolicy]] = [
            (module, DTYPES.get(ref.dtype), ref.device, PrecisionPolicy()) for ref, module in secondaries]
        if policy is not None and not policy.is_float32:
            runs.append((primary, None, primary_ref.device, policy))
        for module, dt, dev, run_policy in runs:
            emulated = not run_policy.is_float32

            def cast(x: Any, dt: torch.dtype | None = dt, dev: str = dev, store: str = run_policy.storage) -> Any:
                x = cast_tree(x, dtype=dt, device=dev)  # a model stored in bf16/fp16 receives its inputs so:
                return x if store == "float32" else map_tensors(lambda t: round_to(t, store), x)

            def add(rec: dict[str, Any], emulated: bool = emulated) -> None:
                if "metrics" not in rec:
                    return
                call = reader.by_key[rec["key"]]
                layer = stats.setdefault(rec["key"], LayerStats(module_class=call["module_class"], name=call["name"]))
                layer.add(rec["view"], rec["metrics"], policy=emulated)

            t0 = time.monotonic()
            with emulate(run_policy) as mode, mode.switched(False):  # (a float32 policy: nothing is rounded)
                # the emulation rounds only the model's own ops: reading the dump and the metrics run with it off
                if "cumulative" in views:
                    args, kwargs = reader.inputs(reader.root())
                    taken: list[dict[str, Any]] = []
                    sink = CompareSink(reader, taken.append)
                    with mode.switched(True):
                        capture_layer_outputs(module, cast(args), cast(kwargs), _Unrounded(sink, mode))
                    differ = calls_differ(reader, sink.counts)  # another path: no statistics from its calls
                    for rec in taken:
                        if reader.by_key[rec["key"]]["name"] not in differ:
                            add(rec)
                t1 = time.monotonic()
                if "isolated" in views:
                    run_isolated_view(dict(module.named_modules()), reader,
                                      lambda _n, m: _rounded_call(m, mode), add, cast=cast)
            spent["derive_cumulative_s"] += t1 - t0
            spent["derive_isolated_s"] += time.monotonic() - t1
        reader.close()
        if s not in keep:
            shutil.rmtree(folder, ignore_errors=True)
    return stats


def _rounded_call(module: nn.Module, mode: Emulate) -> Callable[..., Any]:
    """`module`'s call with the emulation's rounding on (the isolated view of an emulated reference)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with mode.switched(True):
            return module(*args, **kwargs)
    return call


class _Unrounded(CallSink):
    """A sink whose comparisons run with the emulation's rounding off (they read the reference's dump)."""

    def __init__(self, inner: CallSink, mode: Emulate) -> None:
        self.inner, self.mode = inner, mode

    def enter(self, meta: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with self.mode.switched(False):
            self.inner.enter(meta, args, kwargs)

    def exit(self, meta: Any, output: Any) -> None:
        with self.mode.switched(False):
            self.inner.exit(meta, output)


def cast_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A copy of `module` whose floating parameters and buffers are cast to `dtype`, as `module.to(dtype)` casts
    them, without a full copy in the original dtype first (tied tensors stay tied). For a float32 config model this
    is exactly the model `load_model` builds in `dtype` (it builds in float32 and casts), in a fraction of the
    time: no second build from the config."""
    memo: dict[int, Any] = {}
    for t in list(module.parameters()) + [b for b in module.buffers() if b is not None]:
        if id(t) in memo or not t.is_floating_point():
            continue
        data = t.detach().to(dtype)
        memo[id(t)] = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
    return copy.deepcopy(module, memo)


def runnable_reference(module: nn.Module, dtype: str) -> list[str]:
    """Adjust a reference model so that it can run in `dtype` on the same code path as the other runs; returns
    what was changed (for the notes).

    transformers' MoE experts default to `torch._grouped_mm`, which has no float64 kernel. A float64 reference keeps
    the grouped-mm path (one call of the activation over all routed rows, as the float32 reference and a compiled
    target make) and computes its grouped matmul with transformers' own fallback kernel (`_float64_grouped_mm`).
    Switching it to the `eager` experts instead (a loop over experts) would call the activation once per expert:
    calls that cannot be matched with the other runs' (the numerics then say "not comparable", see
    `calls_differ`). That switch is the last resort, for a transformers without the fallback.
    """
    changed: list[str] = []
    config = getattr(module, "config", None)
    impl = getattr(config, "_experts_implementation", None) if config is not None else None
    if dtype != "float64" or impl in (None, "eager"):
        return changed
    if impl == "grouped_mm" and _float64_grouped_mm():
        return ["grouped_mm experts compute float64 with transformers' fallback kernel (same path, no float64 kernel)"]
    try:
        config._experts_implementation = "eager"
        changed.append("experts_implementation=eager (grouped_mm has no float64 kernel)")
    except (AttributeError, ValueError, TypeError):
        pass
    return changed


def _float64_grouped_mm() -> bool:
    """Make transformers' grouped-mm experts use its own fallback kernel for float64 weights (where
    `torch._grouped_mm` raises "Expected mat_a to be Float32, BFloat16 or Float16"); other dtypes are untouched.
    Installed once per process; False when this transformers has no such dispatch."""
    try:
        from transformers.integrations import moe
    except ImportError:
        return False
    check = getattr(moe, "_can_use_grouped_mm", None)
    if check is None or not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
        return False
    if getattr(check, "_deepview_float64", False):
        return True

    def can_use(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        return weight.dtype != torch.float64 and check(input, weight, offs)

    can_use._deepview_float64 = True  # type: ignore[attr-defined]
    moe._can_use_grouped_mm = can_use
    return True
