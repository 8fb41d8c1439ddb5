"""The `ops` mode's engine: one probe, the probing child and its parent side.

A probe runs one (op, input signature) alone on the target, on synthetic inputs with the recorded shapes, dtypes
and strides, and compares the result with CPU eager. Probes run in isolated children (`isolate.supervise`), many
per child (the child's loop is `grouptest.probe_groups`, which also compiles many probes as one graph); each is
journalled (`enter-probe`/`leave-probe`) and has its own timeout (`faulthandler`), so an abort, a segfault or a
hang costs that probe only. The synthetic inputs are `inputs`' (`make_tensor`); its drawing functions and
`op_compare.compare` are copied into the op repro scripts (`templates/repro_op.py.j2`), so a repro rebuilds and
judges the values exactly as the probe did. The parent leaves out (`not_run`) a probe whose inputs are over
`ops.max_probe_input_mb`, before any child allocates them. The comparison and its op contracts live in
`op_compare`; the compiler's words in `diagnostics`.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from ...backends import COULD_NOT_RUN_RE, CompileRecord, CompileWatch, groups_agree, named_op_from_error
from ...config import BackendSpec, spec_to_json
from ...failures.diagnostics import capture_fd2, compiler_words
from ...failures.failure import classify, error_text
from ...procs.isolate import Attempt, IsolatedResult, Journal, supervise
from ...procs.limits import HangLimits, dead_item, finite, item_limits
from ...workloads.emulate import emulate
from ...workloads.precision import PrecisionPolicy, convention
from .compare import compare, mismatch_metrics, no_compare_reason
from .inputs import build_tensors, copy_tensors, dynamic_marks, input_bytes
from .outcome import CPU_FAILS_TOO, OpOutcome, OpStatus
from ...engine.codec import decode_value, encode_arg, tensor_specs
from .signature import resolve_callable
from ...options import OpsOptions
from ...quoting import dotted, pyrepr
from ...models.tree import map_tensors

_MIN_PROBES_PER_CHILD = 24
GROUP_PREFIX = "g:"  # journal tag of a group of probes compiled as one graph (`grouptest`): g:<id>,<id>,…
TOGETHER_PREFIX = "together:"  # result row of a set that fails only together (`grouptest`)
_COMPILE_THREADS = "TORCHINDUCTOR_COMPILE_THREADS"
_CHILD_ENTRY = "ci_runner.modes.ops.grouptest:probe_groups"  # the probing child (group size 1: one probe at a time)


# --------------------------------------------------------------------------------------------- calls

def assemble(args: Any, kwargs: Any, tensors: Sequence[torch.Tensor], device: str) -> tuple[list[Any], dict[str, Any]]:
    """Arguments for the op: the encoded structure with `tensors` in place and devices set to `device`."""
    it = iter(tensors)
    return ([decode_value(a, it, device=device) for a in args],
            {k: decode_value(v, it, device=device) for k, v in kwargs.items()})


def op_expression(op: str) -> str:
    """Source that evaluates to the op in a repro: `torch.ops.aten.softplus.default`, `torch.nn.functional.silu`."""
    parts = op.split(".")
    source = f"torch.ops.{op}" if len(parts) == 3 and not op.startswith("torch.") else op
    try:
        return dotted(source)
    except ValueError:  # a custom op with an odd name: looked up by name, never pasted in as code
        head, *rest = source.split(".")
        expr = head if head.isidentifier() else f"__import__({pyrepr(head)})"
        for name in rest:
            expr = f"getattr({expr}, {pyrepr(name)})"
        return expr


def float_dtype(args: Any, kwargs: Any) -> str:
    """The lowest-precision floating dtype among the inputs (its tolerance applies), float32 when none."""
    order = ["bfloat16", "float16", "float32", "complex64", "float64", "complex128"]
    found = [s["dtype"] for s in tensor_specs([args, kwargs]) if s["dtype"] in order]
    if not found:
        for v in kwargs.values():
            if isinstance(v, dict) and "__dtype__" in v and v["__dtype__"] in order:
                found.append(v["__dtype__"])
    return min(found, key=order.index) if found else "float32"


# --------------------------------------------------------------------------------------------- probing (child side)

def packet_of(op: str) -> str:
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def invalid_probe_message(ref_exc: BaseException, message: str) -> str:
    """A probe error's message when CPU eager rejects the same synthetic inputs (`OpOutcome.is_finding` reads it)."""
    return f"{CPU_FAILS_TOO} ({type(ref_exc).__name__}: {error_text(ref_exc)[:300]}): {message}"


def probe_failure(exc: BaseException, *, eager: bool, ref_exc: BaseException | None) -> dict[str, Any]:
    """Status, stage, error type, message and traceback of a probe's failure on the target (`failure.classify`):
    the backend's compiler refusing the graph is `unsupported`; Dynamo failing to trace the one-op function is a
    `probe_error` (not the backend's verdict); else `unsupported` when the error says the op has no kernel."""
    failed = classify(exc)
    if failed.stage == "trace":
        status = "probe_error"
    elif isinstance(exc, _backend_compiler_failed()):
        status = "unsupported"
    else:
        unsupported = bool(COULD_NOT_RUN_RE.search(str(exc))) or (eager and isinstance(exc, NotImplementedError))
        status = "unsupported" if unsupported else "error"
    message = failed.message
    if ref_exc is not None and status == "error" and type(ref_exc).__name__ == failed.error_type:
        status = "probe_error"  # CPU eager rejects the same synthetic inputs: the probe is invalid, not the backend
        message = invalid_probe_message(ref_exc, message)
    named, phrase = named_op_from_error(message)
    return {"status": status, "stage": failed.stage, "error_type": failed.error_type, "message": message[:4000],
            "named_op": named, "named_text": phrase, "traceback": failed.traceback}


def _backend_compiler_failed() -> tuple[type[BaseException], ...]:
    try:
        from torch._dynamo.exc import BackendCompilerFailed
    except ImportError:  # pragma: no cover - torch without Dynamo
        return ()
    return (BackendCompilerFailed,)


class _NoGraph(Exception):
    pass


def _fx_compiler(backend: Any) -> Callable[..., Any] | None:
    """The backend's torch.compile compiler function, when probes may hand it graphs directly."""
    spec = getattr(backend, "spec", None)
    if spec is not None and set(getattr(spec, "compile_options", {}) or {}) - {"dynamic", "fullgraph"}:
        return None  # options (mode=…, options=…) only torch.compile applies: go through it
    get = getattr(backend, "compiler_backend", None)
    compiler = get() if callable(get) else None
    if isinstance(compiler, str):
        compiler = torch._dynamo.lookup_backend(compiler)
    return compiler if callable(compiler) else None


def select_outputs(value: Any, outputs: Sequence[int] | None) -> Any:
    """The op's outputs the model's graph uses: all when `outputs` is None, one index → that value itself."""
    if outputs is None or not isinstance(value, (tuple, list)):
        return value
    if len(outputs) == 1:
        return value[outputs[0]]
    return tuple(value[i] for i in outputs)


def one_op_graph(op: Any, args: Any, kwargs: Any, n_tensors: int, device: str, ref_value: Any,
                 outputs: Sequence[int] | None = None) -> torch.fx.GraphModule:
    """The FX graph Dynamo would build for `op(*args, **kwargs)`: placeholders for the tensors, one call, outputs
    flattened into a tuple (multi-output ops get `getitem` nodes for the outputs used, sized from the CPU result,
    which is already `select_outputs`-ed)."""
    import operator

    graph = torch.fx.Graph()
    placeholders = [graph.placeholder(f"arg{i}") for i in range(n_tensors)]
    a, k = assemble(args, kwargs, placeholders, device)
    node = graph.call_function(op, tuple(a), k)
    if outputs is not None and len(outputs) == 1 and isinstance(ref_value, torch.Tensor):
        outs: tuple[Any, ...] = (graph.call_function(operator.getitem, (node, outputs[0])),)
        shape = "single"
    elif isinstance(ref_value, torch.Tensor):
        outs = (node,)
        shape = "single"
    elif isinstance(ref_value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in ref_value):
        indices = list(outputs) if outputs is not None else list(range(len(ref_value)))
        outs = tuple(graph.call_function(operator.getitem, (node, i)) for i in indices)
        shape = "tuple" if isinstance(ref_value, tuple) else "list"
    else:
        raise _NoGraph()  # scalars, None, nested or unknown outputs: let Dynamo build the graph
    graph.output(outs)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gm.meta["deepview_output"] = shape
    return gm


def _unpack(out: Any, gm: torch.fx.GraphModule) -> Any:
    shape = gm.meta.get("deepview_output")
    if shape == "single":
        return out[0]
    return tuple(out) if shape == "tuple" else list(out)


def run_probe(backend: Any, probe: Mapping[str, Any], *, compare_results: bool,
              tolerance: tuple[float, float], via: str = "dynamo") -> dict[str, Any]:
    """Run one probe on `backend` (compile or eager) and against CPU eager; the outcome as a JSON-able dict.

    `via="dynamo"` (default) goes through `torch.compile` as the user's code does; `via="fx"` hands the one-op FX
    graph straight to the backend's compiler function (faster, but it skips Dynamo and what fails there).
    The probe returns only the op outputs the model's graph uses (`probe["outputs"]`). A compile backend's run
    counts only when it compiled and executed the op (its `CompileWatch`: `Backend.compile_watched`); else
    the outcome is `inconclusive`. What the compiler wrote to fd 2 and the exception chain are kept, reduced to
    the lines that name the op or the failing pass (`diagnostics`).
    Steps: resolve the op, run it on CPU eager (the reference), move the inputs, run it on the target
    (`_run_on_target`), classify a failure (`_target_failure`), check the backend ran it, compare (`_judge`).
    """
    t0 = time.monotonic()
    out: dict[str, Any] = {"id": probe["id"], "op": probe["op"], "status": "pass", "stage": None,
                           "error_type": None, "message": "", "named_op": None, "named_text": None, "metrics": {}}

    def done(**kw: Any) -> dict[str, Any]:
        out.update(kw)
        out["seconds"] = round(time.monotonic() - t0, 4)
        return out

    op = resolve_op(probe)
    if isinstance(op, dict):
        return done(**op)
    eager = bool(getattr(backend, "is_eager", False))
    device = str(getattr(backend, "device", "cpu"))
    built = probe_inputs(probe)
    ref = reference(op, probe, reference_inputs(op, built) if built is not None else None)
    try:
        tensors = [backend.to_device(t) for t in (built if built is not None else
                                                  build_tensors(probe["args"], probe["kwargs"], int(probe["seed"])))]
    except Exception as exc:
        info = probe_failure(exc, eager=True, ref_exc=None)
        info["message"] = f"moving the inputs to {device} failed: {info['message']}"[:4000]
        return done(**info)
    compile_name = getattr(getattr(backend, "spec", None), "compile", None)
    run = _TargetRun(watch=CompileWatch(None if eager else compile_name))  # the compile paths' records join it
    if not eager and via == "fx" and not dynamic_marks(probe["args"], probe["kwargs"]):  # a dynamic dim needs Dynamo
        _fx_path(backend, op, probe, tensors, ref, run, device=device)
    try:
        value = _run_on_target(backend, op, probe, tensors, run, eager=eager, device=device)
    except Exception as exc:
        info = _target_failure(exc, run, eager=eager, ref_exc=ref.exc, op_name=probe["op"])
        return done(**info, ran=run.watch.ran())
    ran = run.watch.ran()
    if not eager:
        why = run.watch.not_ran()
        if why:
            return done(status="inconclusive", stage="run", error_type=None, ran=ran,
                        message=f"{probe['op']} did not run on the backend: {why}"[:2000])
    return done(**judge(probe, ref, value, compare_results=compare_results, tolerance=tolerance), ran=ran)


def probe_inputs(probe: Mapping[str, Any]) -> list[torch.Tensor] | None:
    """The probe's inputs, built once for its reference (`reference_inputs`) and its run; None when building raises (the
    reference and the run then raise it again, each where it is reported)."""
    try:
        return build_tensors(probe["args"], probe["kwargs"], int(probe["seed"]))
    except Exception:
        return None


def resolve_op(probe: Mapping[str, Any]) -> Any:
    """The op's callable, after importing the modules that register it; a `probe_error` outcome when it fails."""
    for module in probe.get("imports") or ():
        try:
            importlib.import_module(module)
        except Exception as exc:
            return {"status": "probe_error", "stage": "trace", "error_type": type(exc).__name__,
                    "message": f"importing {module} (which registers {probe['op']}) failed: {exc}"[:2000]}
    try:
        return resolve_callable(probe["op"])
    except Exception as exc:
        hint = "" if probe.get("imports") else " (no module that registers it was recorded)"
        return {"status": "probe_error", "stage": "trace", "error_type": type(exc).__name__,
                "message": f"cannot resolve {probe['op']}{hint}: {exc}"[:2000]}


def reference_inputs(op: Any, built: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs the CPU reference runs on: the probe's own when the op's schema says it writes none of its
    arguments (the run on the target then gets them unchanged, and a probe holds its inputs once), else a copy."""
    schema = getattr(op, "_schema", None)  # an OpOverload's; other callables: copied
    if schema is None or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return copy_tensors(built)
    return built


@dataclass
class Reference:
    """The op on CPU eager: its (selected) outputs and inputs, or the exception it raised."""

    value: Any = None
    exc: BaseException | None = None
    inputs: list[Any] = field(default_factory=list)


def reference(op: Any, probe: Mapping[str, Any], tensors: Sequence[torch.Tensor] | None = None) -> Reference:
    """The op on CPU eager, on `tensors` (the probe's inputs, which it may modify) or freshly built ones."""
    ref = Reference()
    args, kwargs = probe["args"], probe["kwargs"]
    try:
        built = list(tensors) if tensors is not None else build_tensors(args, kwargs, int(probe["seed"]))
        ref_args, ref_kwargs = assemble(args, kwargs, built, "cpu")
        ref.inputs = list(ref_args)
        ref.value = select_outputs(op(*ref_args, **ref_kwargs), probe.get("outputs"))
    except Exception as exc:
        ref.exc = exc
    return ref


@dataclass
class _TargetRun:
    """What one run on the target left behind, also when it raised: the evidence that the backend ran it and
    what the compiler wrote to fd 2."""

    watch: CompileWatch  # a compile path's `CompileRecord` joins it (`record`)
    err: list[str] = field(default_factory=lambda: [""])
    compiler: Any = None  # the fx path: the backend's compiler function …
    graph: Any = None  # … and the one-op graph handed to it (None: go through torch.compile)


def _fx_path(backend: Any, op: Any, probe: Mapping[str, Any], tensors: list[Any], ref: Reference, run: _TargetRun,
             *, device: str) -> None:
    """`via="fx"`: the backend's compiler function and the one-op graph for it, when the backend and the op's
    outputs allow one (else the probe goes through torch.compile)."""
    run.compiler = _fx_compiler(backend)
    if run.compiler is not None:
        try:
            run.graph = one_op_graph(op, probe["args"], probe["kwargs"], len(tensors), device,
                                     ref.value if ref.exc is None else None, probe.get("outputs"))
        except _NoGraph:
            run.graph = None


def _run_on_target(backend: Any, op: Any, probe: Mapping[str, Any], tensors: list[Any], run: _TargetRun, *,
                   eager: bool, device: str) -> Any:
    """The op on the backend by one of three paths, outputs moved to CPU: eager on its device; the one-op FX graph
    handed to its compiler function (`run.graph`, the fx path); `torch.compile` (Dynamo)."""
    args, kwargs, outputs = probe["args"], probe["kwargs"], probe.get("outputs")
    graph = run.graph
    compile_name = getattr(getattr(backend, "spec", None), "compile", None)
    with capture_fd2() as run.err, run.watch:
        if eager:
            a, k = assemble(args, kwargs, tensors, device)
            value = select_outputs(op(*a, **k), outputs)
        elif graph is not None:
            record = CompileRecord(run.compiler, str(compile_name))  # the compiler function itself, no Dynamo
            run.watch.records.append(record)
            try:
                compiled = record(graph, list(tensors))
            except Exception as exc:  # the backend's compiler refused the one-op graph
                raise _CompilerRefused(exc) from exc
            value = _unpack(compiled(*tensors), graph)
        else:
            torch._dynamo.reset()  # a fresh cache: no recompile limit, no reuse between probes

            def fn(*ts: torch.Tensor) -> Any:
                a, k = assemble(args, kwargs, ts, device)
                return select_outputs(op(*a, **k), outputs)

            watched = getattr(backend, "compile_watched", None)  # a `backends.Backend`; else plain compile
            compiled_fn = watched(fn, join=run.watch)[0] if callable(watched) else backend.compile(fn)
            for i, dim in dynamic_marks(args, kwargs):  # the dims the phase's graph had symbolic stay symbolic
                torch._dynamo.maybe_mark_dynamic(tensors[i], dim)
            value = compiled_fn(*tensors)
        return map_tensors(lambda t: t.detach().to("cpu"), value)


class NotRunOnBackend(Exception):
    """A compile backend was given the call but did not run it (`CompileWatch.not_ran`: a fallback to eager)."""


def _live_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of a live argument in the order `decode_value` consumes them (nested lists and tuples in order)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _live_tensors(v)]
    return []


def run_call(backend: Any, op: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """One live call of `op` (a model's own tensors, on CPU) computed on `backend` by the probe's own path
    (`_run_on_target` via Dynamo, or on the eager device), all outputs moved to CPU. Raises what the backend raises,
    and `NotRunOnBackend` when a compile backend did not run it. Used by `reach` to inject the op into a forward."""
    probe = {"id": "call", "op": str(op), "args": [encode_arg(a) for a in args],
             "kwargs": {k: encode_arg(v) for k, v in kwargs.items()}, "outputs": None}
    eager = bool(getattr(backend, "is_eager", False))
    device = str(getattr(backend, "device", "cpu"))
    live = [t for a in args for t in _live_tensors(a)] + [t for v in kwargs.values() for t in _live_tensors(v)]
    tensors = [backend.to_device(t) for t in live]
    compile_name = getattr(getattr(backend, "spec", None), "compile", None)
    run = _TargetRun(watch=CompileWatch(None if eager else compile_name))
    value = _run_on_target(backend, op, probe, tensors, run, eager=eager, device=device)
    why = None if eager else run.watch.not_ran()
    if why:
        raise NotRunOnBackend(f"{op} did not run on the backend: {why}")
    return value


def _target_failure(exc: BaseException, run: _TargetRun, *, eager: bool, ref_exc: BaseException | None,
                    op_name: str) -> dict[str, Any]:
    """The outcome fields of a run on the target that raised, with the compiler's own words."""
    refused = isinstance(exc, _CompilerRefused)
    inner = exc.__cause__ if refused and exc.__cause__ is not None else exc
    info = probe_failure(inner, eager=eager, ref_exc=ref_exc)
    if refused:
        info.update(status="unsupported", stage="compile")
        if ref_exc is not None:  # CPU eager rejects these inputs too: an invalid probe, not a verdict
            info.update(status="probe_error", message=invalid_probe_message(ref_exc, info["message"])[:4000])
    elif info["status"] == "probe_error" and ref_exc is None and run.watch.record is not None and run.watch.record.graphs:
        info.update(status="error", stage="compile")  # Dynamo failed after the backend had the graph
    words, chain = compiler_words(run.err[0], inner, info["message"], op_name)
    if words:
        info["message"] = (info["message"] + "\n" + "\n".join(words))[:4000]
        if not info.get("named_text"):
            info["named_op"], info["named_text"] = named_op_from_error("\n".join(words))
    info["diagnostics"] = {"compiler": words, "exception_chain": chain}
    return info


def judge(probe: Mapping[str, Any], ref: Reference, value: Any, *, compare_results: bool,
           tolerance: tuple[float, float]) -> dict[str, Any]:
    """The comparison with CPU eager: ok, skipped (with why) or a mismatch with its metrics."""
    op_name = probe["op"]
    if ref.exc is not None:
        return {"compare": f"skipped: CPU eager failed ({type(ref.exc).__name__})"}
    reason = (no_compare_reason(op_name, ref.inputs, probe["kwargs"]) if compare_results
              else "options.ops.compare is false")
    if reason:
        return {"compare": f"skipped: {reason}"}
    rtol, atol = tolerance
    policy = policy_tolerance(probe, ref, atol) if probe.get("precision") else None
    if policy is not None:
        atol = policy["atol"]
    problem = compare(ref.value, value, rtol, atol, op_name, ref.inputs, probe.get("outputs"))
    if problem is None:
        return {"compare": "ok"}
    metrics = mismatch_metrics(ref.value, value)
    if policy is not None:
        metrics.update(tolerance=[rtol, atol], policy=policy)
    where = f"CPU eager under the {policy['policy']} policy" if policy is not None else "CPU eager"
    return {"status": "mismatch", "stage": "compare", "error_type": "OpMismatch", "compare": "mismatch",
            "message": f"{op_name} differs from {where}: {problem}", "metrics": metrics}


POLICY_MARGIN = 3.0  # the op's emulated spread times this is what a policy allows (as the numerics' policy_margin)


def policy_tolerance(probe: Mapping[str, Any], ref: Reference, atol: float) -> dict[str, Any] | None:
    """The op's tolerance under the probe's precision policy: the largest difference between CPU eager and the
    same op under the policy's emulation (`workloads/emulate.emulate`), relative to max(1, max|eager|), times
    `POLICY_MARGIN`, when it exceeds the dtype's `atol`. An op the policy keeps in float32 (a softmax under a bf16
    policy) has no spread, so its dtype tolerance stands. None when nothing widens it."""
    op = resolve_op(probe)
    if isinstance(op, dict) or not isinstance(ref.value, (torch.Tensor, list, tuple)):
        return None
    classes = {**convention("float32"), **dict(probe["precision"])}
    policy = PrecisionPolicy(spelled="table", classes=MappingProxyType(classes))
    try:
        built = build_tensors(probe["args"], probe["kwargs"], int(probe["seed"]))
        args, kwargs = assemble(probe["args"], probe["kwargs"], built, "cpu")
        with emulate(policy) as mode:
            emu = select_outputs(op(*args, **kwargs), probe.get("outputs"))
    except Exception:
        return None
    if not mode.rounded:
        return None
    worst = 0.0
    for e, m in zip(pytree.tree_leaves(ref.value), pytree.tree_leaves(emu)):
        if isinstance(e, torch.Tensor) and isinstance(m, torch.Tensor) and e.is_floating_point() and e.shape == m.shape:
            ed, md = e.detach().double(), m.detach().double()
            finite = torch.isfinite(ed) & torch.isfinite(md)
            if bool(finite.any()):
                scale = max(1.0, float(ed[finite].abs().max()))
                worst = max(worst, float((ed - md).abs()[finite].max()) / scale)
    widened = POLICY_MARGIN * worst
    if widened <= atol:
        return None
    return {"policy": policy.label(), "atol": widened, "emulated_max_abs": worst, "rounded": dict(mode.rounded)}


class _CompilerRefused(Exception):
    """The backend's compiler function raised on the one-op graph (the fx path)."""


# --------------------------------------------------------------------------------------------- probing (parent side)

@dataclass
class _Shard:
    index: int
    probes: list[dict[str, Any]]


class ProbeRunner:
    """Runs probes in isolated child processes, restarting after a crash or a hang with the remaining ones."""

    def __init__(self, *, backend_spec: "BackendSpec", work_dir: Path, opts: OpsOptions,
                 remaining: Callable[[], float], journal: Callable[[str, str], None] | None = None) -> None:
        self.spec = backend_spec
        self.work_dir = work_dir
        self.opts = opts
        self.remaining = remaining
        self.journal = journal
        self._attempt = 0
        self._lock = threading.Lock()
        self._env: dict[str, str] = {}
        self.setup_error: str | None = None

    def _next_attempt(self) -> int:
        with self._lock:
            self._attempt += 1
            return self._attempt

    def run(self, probes: list[dict[str, Any]]) -> dict[str, OpOutcome]:
        """Outcome per probe id; a probe in a set that fails only together carries `fails_together`; a probe whose
        inputs are over `ops.max_probe_input_mb` is `not_run` here (`too_big`), without a child."""
        results: dict[str, OpOutcome] = {}
        for p in probes:
            why = too_big(p, self.opts.max_probe_input_mb)
            if why:
                results[p["id"]] = not_run_outcome(p, why)
        probes = [p for p in probes if p["id"] not in results]
        if not probes:
            return results
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # a child costs a Python + torch + backend start-up: only split when each gets a fair share of probes
        workers = max(1, min(self.opts.workers, len(probes) // _MIN_PROBES_PER_CHILD))
        self._env = probe_child_env(self.spec.env, workers)
        shards = [_Shard(i, probes[i::workers]) for i in range(workers)]
        together: dict[str, dict[str, Any]] = {}
        if workers == 1:
            parts = [self._run_shard(shards[0])]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                parts = list(pool.map(self._run_shard, shards))
        for outcomes, rows in parts:
            results.update(outcomes)
            together.update(rows)
        return _attach_together(results, together)

    def _run_shard(self, shard: _Shard) -> tuple[dict[str, OpOutcome], dict[str, dict[str, Any]]]:
        """The shard's probes in children (`isolate.supervise`): a child that dies costs the probe it was in."""
        pending = list(shard.probes)
        results: dict[str, OpOutcome] = {}
        together: dict[str, dict[str, Any]] = {}  # the `together:` rows (`grouptest`), by id
        env = self._env
        journal_path = self.work_dir / f"journal-{shard.index:03d}.log"
        journal_path.unlink(missing_ok=True)
        batch: list[dict[str, Any]] = []
        results_path = self.work_dir / "probes.jsonl"
        limits_path = self.work_dir / f"limits-{shard.index:03d}.jsonl"  # each probe's limit and why (`ChildLimits`)
        limits_path.unlink(missing_ok=True)
        limits = HangLimits.of(self.opts.probe_timeout, self.opts.hang)
        tag = ""

        def next_attempt(_n: int) -> Attempt | str | None:
            nonlocal batch, results_path, tag
            if not pending:
                return None
            budget = self.remaining() - 5.0
            if budget < min(self.opts.probe_timeout, 10.0):
                for p in pending:
                    results[p["id"]] = not_run_outcome(p, "the cell's time ran out before this probe")
                return "the cell's time ran out"
            batch = pending[: self.opts.batch_size]
            attempt = self._next_attempt()
            results_path = self.work_dir / f"probes-{attempt:03d}.jsonl"
            payload = {"backend": spec_to_json(self.spec), "probes": batch, "results": str(results_path),
                       "limits": limits.to_json(), "limits_file": str(limits_path),
                       "deadline_wall": time.time() + finite(budget) - 2.0, "measured_s": _measured_s(results),
                       "compare": self.opts.compare, "via": self.opts.via,
                       "group_size": group_size(self.opts, self.spec),
                       "max_probe_input_mb": self.opts.max_probe_input_mb}
            tag = f"{attempt}:{batch[0]['id']}..{batch[-1]['id']}"
            if self.journal:
                self.journal("enter-probe-batch", tag)
            # past probe_timeout a probe is a hang only when it makes no progress (the watch); a busy one runs on to
            # its second limit (the child's own watchdog), or to the cell's time
            return Attempt(payload=payload, timeout=finite(budget),
                           watch=limits.watch(journal_path, "probe", since=Journal(journal_path).size()))

        def collect() -> tuple[dict[str, OpOutcome], list[dict[str, Any]]]:
            nonlocal pending
            if self.journal:
                self.journal("leave-probe-batch", tag)
            done, rows = _read_outcomes(results_path)
            results.update(done)
            together.update(rows)
            left = [p for p in batch if p["id"] not in done]
            pending = pending[len(batch):]
            return done, left

        def on_ok(res: IsolatedResult) -> str | None:
            return on_crash(None, res)  # a child that returned without an outcome for each of its probes

        def on_crash(open_id: str | None, res: IsolatedResult) -> str | None:
            nonlocal pending
            done, left = collect()
            if not left:
                return None
            if res.status == "error" and not done:
                # the child failed before its first probe: the backend cannot even be set up there
                self.setup_error = f"{res.error_type}: {res.message}".strip()
                for p in left + pending:
                    results[p["id"]] = not_run_outcome(p, f"probe process failed before probing: {self.setup_error}")
                return "the probe process failed before probing"
            members = set(open_id[len(GROUP_PREFIX):].split(",")) if (open_id or "").startswith(GROUP_PREFIX) else set()
            if members:  # a group crashed or hung: its members go alone
                cap = 1  # probed alone: a crash or a hang then costs one probe, as without groups
                pending = [{**p, "group_cap": cap} if p["id"] in members else p for p in left] + pending
                return None
            culprit = next((p for p in left if p["id"] == open_id), left[0])
            record = item_limits(limits_path).get(open_id or "")
            results[culprit["id"]] = _crash_outcome(culprit, res, limits, record)
            pending = [p for p in left if p is not culprit] + pending
            return None

        supervise(_CHILD_ENTRY, journal=journal_path, kind="probe", next_attempt=next_attempt,
                  on_ok=on_ok, on_crash=on_crash, env=env)
        return results, together


def probe_child_env(spec_env: Mapping[str, Any], workers: int) -> dict[str, str]:
    """The probing children's environment: the backend's `env`, and inductor's compile threads set to the cores
    each child has (`TORCHINDUCTOR_COMPILE_THREADS`, unless the backend or this process sets it). A child compiles
    one group at a time and `workers` children share the cores: with one core each, inductor compiles in the
    child (the same code) instead of starting a pool of compile processes per child, each importing torch."""
    env = {str(k): str(v) for k, v in spec_env.items()}
    if _COMPILE_THREADS not in env and _COMPILE_THREADS not in os.environ:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - not Linux
            cores = os.cpu_count() or 1
        env[_COMPILE_THREADS] = str(max(1, cores // max(1, workers)))
    return env


def _attach_together(results: dict[str, OpOutcome], together: Mapping[str, Mapping[str, Any]]
                     ) -> dict[str, OpOutcome]:
    """The probe outcomes, each `together:` row (`grouptest`) copied onto its members as `fails_together`."""
    for row in together.values():
        for pid in row.get("members") or ():
            if pid in results:
                results[pid].fails_together = {"ops": list(row.get("ops") or ()), "message": row.get("message")}
    return results


def grouped(opts: OpsOptions, spec: BackendSpec) -> bool:
    """Whether this backend's probes are group-tested: `ops.group_testing` true/false, or `auto` (the default):
    grouped unless the backend's vendor module says grouped and one-op verdicts differ (`backends.groups_agree`)."""
    if isinstance(opts.group_testing, bool):
        return opts.group_testing
    return groups_agree(spec.compile)


def group_size(opts: OpsOptions, spec: BackendSpec) -> int:
    return opts.group_size if grouped(opts, spec) else 1


def too_big(probe: Mapping[str, Any], limit_mb: float) -> str | None:
    """Why a probe is not run (its inputs are over `ops.max_probe_input_mb`; 0: no limit), or None."""
    size = input_bytes(probe["args"], probe["kwargs"])
    if not limit_mb or size <= limit_mb * 2**20:
        return None
    return (f"not probed: its inputs take {size / 2**20:,.0f} MB, over ops.max_probe_input_mb = {limit_mb:g} (an op "
            f"that writes its inputs holds them twice: the CPU reference runs on a copy); to probe it, raise "
            f"ops.max_probe_input_mb (0: no limit)")


def not_run_outcome(probe: Mapping[str, Any], why: str) -> OpOutcome:
    return OpOutcome(id=probe["id"], op=probe["op"], status=OpStatus.NOT_RUN, message=why, seconds=0.0)


def _read_outcomes(path: Path) -> tuple[dict[str, OpOutcome], dict[str, dict[str, Any]]]:
    """A child's results file: the outcomes by probe id, and its `together:` rows (`grouptest`) by id."""
    out: dict[str, OpOutcome] = {}
    together: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return out, together
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        if str(row["id"]).startswith(TOGETHER_PREFIX):
            together[row["id"]] = row
        else:
            out[row["id"]] = OpOutcome.from_row(row)
    return out, together


_FAULTHANDLER_RE = re.compile(r"^(Timeout \(|Thread 0x|Current thread 0x|Fatal Python error|  File \"|Extension modules:|\s*$)")


def _backend_lines(stderr_tail: str) -> str:
    """The backend's own last words from a child's stderr, without faulthandler's thread dumps."""
    lines = [ln for ln in stderr_tail.splitlines() if not _FAULTHANDLER_RE.match(ln)]
    return "\n".join(lines[-6:]).strip()


# a frame of faulthandler's dump (`  File "x.py", line 12 in fn`: no comma before "in", unlike a traceback's)
_DUMP_FRAME_RE = re.compile(r'", line \d+ in ')


def _watchdog_fired(res: Any, tail: str) -> bool:
    """The probe's own timer (faulthandler, `grouptest`) ended the child: it dumps every thread and exits 1. With
    many threads (inductor's compile workers) the tail has lost the dump's "Timeout (" header, never its frames; a
    fatal signal's dump ends in that signal instead."""
    return "Timeout (" in tail or (not res.signal and res.exit_code == 1 and bool(_DUMP_FRAME_RE.search(tail)))


def _measured_s(results: Mapping[str, OpOutcome]) -> list[float]:
    """The compile-and-run seconds this cell measured so far (a group's whole time, from its members' shares): what
    a fresh child's second limit derives from (`procs/limits.py`)."""
    return [o.seconds * (o.group or 1) for o in results.values()
            if o.seconds and o.status not in (OpStatus.TIMEOUT, OpStatus.CRASHED, OpStatus.NOT_RUN)]


def _crash_outcome(probe: Mapping[str, Any], res: Any, limits: HangLimits,
                   record: Mapping[str, Any] | None) -> OpOutcome:
    """The outcome of the probe a child died in: a measured hang (`procs/limits.dead_item`: no progress past
    probe_timeout, or still busy past the second limit), no verdict when the cell's time cut it short while busy (a
    slow compile is not a finding), or a crash."""
    tail = res.stderr_tail or ""
    dead = dead_item(res, timed_out=res.status == "timeout" or _watchdog_fired(res, tail), limits=limits,
                     record=record)
    if dead is not None and dead.verdict == "unfinished":
        return not_run_outcome(probe, f"the probe {dead.words}")
    if dead is not None:
        status, error_type = OpStatus.TIMEOUT, "Timeout"
        message = f"the probe {dead.words}"
    elif res.signal:
        status, error_type = OpStatus.CRASHED, res.signal
        message = f"the process died by {res.signal}"
    else:
        status, error_type = OpStatus.CRASHED, f"exit {res.exit_code}"
        message = f"the process exited with code {res.exit_code} during the probe"
    words = _backend_lines(tail)
    if words:
        message += ": " + words
    named, phrase = named_op_from_error(words)
    return OpOutcome(id=probe["id"], op=probe["op"], status=status, stage="run", error_type=error_type,
                     message=message[:4000], named_op=named, named_text=phrase,
                     seconds=dead.seconds if dead is not None else None)
