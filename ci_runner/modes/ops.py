"""Mode `ops`: every operator the backend cannot handle, in one run, each with a verified repro script.

1. **Inventory** (`ci_runner.inventory`): the model's ops per overload and input signature, traced at the IR level
   the backend's compiler sees (`BackendSpec.ir`, default `aten`; eager devices always use the dispatcher level),
   from a meta-device model when the model source allows it (no weights, no device).
2. **Probing**: each distinct (op, signature) runs alone on the target, on synthetic inputs with the recorded
   shapes, dtypes and strides: a one-op function through `backend.compile` (compile backends) or the op called
   on device tensors (eager backends), and, when it runs, compared with CPU eager within the dtype's tolerance.
   Probes run in isolated child processes, many per child; each is journalled (`enter-probe`/`leave-probe`) and
   has its own timeout (`faulthandler`), so an abort, a segfault or a hang costs that probe only: the parent
   records it and starts a new child for the rest.
3. **Classification**: a compile-time failure (`BackendCompilerFailed`) or PyTorch's dispatcher error
   ("Could not run 'aten::X' with arguments from the 'Y' backend") → `unsupported_op`; any other failure, a
   hard fault or a hang → `op_error`; a result beyond tolerance → `op_mismatch`. The backend's own error text
   is kept. Failures that Dynamo raises before the backend is reached, or that CPU eager raises on the same
   synthetic inputs, say nothing about the backend: they are listed as probe errors, not findings.
4. **Findings and repros**: one finding per failing op overload (fingerprint `(kind, backend, op)`), listing
   every failing signature. Each gets a standalone script rendered from `templates/repro_op.py.j2` (torch and
   the backend's plugin only), run in a subprocess and marked `verified` only when it fails the same way.

Options (`options: {ops: {...}}` in the matrix), all optional:

========================= ======== ===========================================================================
option                    default  meaning
========================= ======== ===========================================================================
``ir``                    backend  override the IR level: ``dynamo`` | ``aten`` | ``core_aten`` | ``dispatch``
``probe_timeout``         30       seconds per probe (the first probe of a child also pays Dynamo's warm-up)
``batch_size``            256      probes per child process
``workers``               2        child processes probing at once, and repros verified at once (1 on one core)
``max_signatures_per_op`` 16       distinct signatures probed per op (the rest are listed, not probed)
``compare``               true     compare results with CPU eager
``tolerance``             table    per dtype ``[rtol, atol]``, e.g. ``{bfloat16: [0.05, 0.02]}``
``skip_ops``              []       fnmatch patterns of ops not to probe
``verify``                true     run each repro to verify it
``verify_timeout``        60       seconds per repro run
``probe``                 true     false: inventory only
``via``                   fx       ``fx``: probes hand the one-op FX graph straight to the backend's compiler
                                   function (3x faster); ``dynamo``: through ``torch.compile`` like the repros
========================= ======== ===========================================================================

Tolerances (relative, absolute): float64 (1e-7, 1e-7), float32 (1e-4, 1e-5), float16 (1e-2, 1e-3),
bfloat16 (5e-2, 1e-2); integers and bools exactly. `atol` scales with the largest reference magnitude (at least
1). Ops with random or uninitialised outputs (`rand*`, `*dropout*`, `bernoulli`, `empty*` …) are not compared.
"""

from __future__ import annotations

import concurrent.futures
import fnmatch
import inspect
import json
import os
import re
import sys
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch

from ..backends import plugin_pythonpath
from ..config import spec_to_json
from ..errors import DeepviewError
from ..fsutil import append_line, atomic_write_json
from ..isolate import Attempt, IsolatedResult, child_journal, supervise
from ..inventory import (
    Inventory,
    InventoryError,
    OpSignature,
    iter_tensor_specs,
    resolve_callable,
    take_inventory,
)
from ..options import OpsOptions
from ..options import parse as parse_options
from ..results import Finding, ModeResult, Repro, fingerprint
from ..tree import map_tensors

if TYPE_CHECKING:
    from ..config import BackendSpec
    from . import ModeContext

MODE = "ops"
# Outputs that are random or uninitialised: run, not compared.
NO_COMPARE = ("*rand*", "*dropout*", "*bernoulli*", "*multinomial*", "*normal*", "*uniform*", "*exponential*",
              "*poisson*", "*empty*", "*geometric*", "*cauchy*", "*log_normal*", "*random_*")
# Ops whose floating inputs must be positive to stay in their domain (log, sqrt, pow with fractional exponents …).
POSITIVE_INPUT_OPS = ("log", "log2", "log10", "log1p", "sqrt", "rsqrt", "pow", "reciprocal", "div", "lgamma",
                      "digamma", "polygamma", "xlogy", "_standard_gamma", "bernoulli", "multinomial", "erfinv",
                      "float_power", "true_divide", "divide", "special_*", "_weight_norm*")
KIND_OF_STATUS = {"unsupported": "unsupported_op", "error": "op_error", "crashed": "op_error",
                  "timeout": "op_error", "mismatch": "op_mismatch"}
SEVERITY = {"unsupported": 5, "crashed": 4, "timeout": 3, "error": 2, "mismatch": 1}
FAILED = tuple(KIND_OF_STATUS)
_CHILD_STARTUP_S = 60.0  # importing torch, the backend and Dynamo's first compile, on a loaded 2-core machine
_MIN_PROBES_PER_CHILD = 24
_CPU_FALLBACK_MAX_BYTES = 4 * 2**30  # a model whose meta trace fails is retried on CPU (real weights) up to this size
_MAX_PROBE_ROWS = 1000  # outcomes kept in ModeResult.data["probes"] (all of them are in ops/probes.json)

COULD_NOT_RUN_RE = re.compile(r"Could not run '(?P<op>[\w:.]+)' with arguments from the '(?P<backend>[^']+)' backend")
UNSUPPORTED_RE = re.compile(r"unsupported operator (?P<op>[A-Za-z_][\w.]*\w)")
ATEN_NAME_RE = re.compile(r"\b(?P<op>(?:aten|prims)(?:::|\.)[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


# --------------------------------------------------------------------------------------------- synthetic inputs
# `make_tensor` and `compare` are self-contained (torch only): their source is copied into every repro script,
# so a repro rebuilds exactly the values the probe used and judges them the same way.

def make_tensor(shape, stride, dtype, low, high, seed):  # type: ignore[no-untyped-def]
    """A synthetic input with the recorded shape, stride and dtype; values uniform in [low, high) from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    t = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
    n = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(s > 0 for s in shape) else 0
    if n > 0:
        if dtype == torch.bool:
            flat = torch.randint(0, 2, (n,), generator=gen).bool()
        elif dtype.is_floating_point or dtype.is_complex:
            flat = (torch.rand(n, generator=gen, dtype=torch.float64) * (high - low) + low).to(dtype)
        else:
            flat = torch.randint(int(low), max(int(high), int(low) + 1), (n,), generator=gen).to(dtype)
        t.as_strided((n,), (1,)).copy_(flat)  # fills overlapping (stride 0) layouts too
    return t


def compare(expected, actual, rtol, atol):  # type: ignore[no-untyped-def]
    """None when `actual` matches `expected` (CPU eager) within tolerance, else what differs.

    Floats: |a - e| <= atol * max(1, max|e|) + rtol * |e| elementwise, NaN where CPU has NaN; ints and bools exact.
    """
    from torch.utils import _pytree as pytree

    exp_leaves, act_leaves = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    if len(exp_leaves) != len(act_leaves):
        return f"{len(act_leaves)} outputs instead of {len(exp_leaves)}"
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return f"output {i}: {type(a).__name__} instead of {type(e).__name__}"
        if not isinstance(e, torch.Tensor):
            if isinstance(e, (bool, int, float)) and isinstance(a, (bool, int, float)):
                fe, fa = float(e), float(a)
                if not (fe != fe and fa != fa) and abs(fe - fa) > atol * max(1.0, abs(fe)) + rtol * abs(fe):
                    return f"output {i}: {a!r} instead of {e!r}"
            continue
        a = a.detach().to("cpu")
        if tuple(a.shape) != tuple(e.shape):
            return f"output {i}: shape {tuple(a.shape)} instead of {tuple(e.shape)}"
        if a.dtype != e.dtype:
            return f"output {i}: dtype {a.dtype} instead of {e.dtype}"
        if not (e.dtype.is_floating_point or e.dtype.is_complex):
            bad = int((a != e).sum())
            if bad:
                return f"output {i}: {bad} of {e.numel()} elements differ"
            continue
        wide = torch.complex128 if e.dtype.is_complex else torch.float64
        ed, ad = e.to(wide), a.to(wide)
        nan_e, nan_a = torch.isnan(ed), torch.isnan(ad)
        if not torch.equal(nan_e, nan_a):
            return f"output {i}: NaN at {int((nan_e != nan_a).sum())} positions where CPU eager differs"
        finite = torch.isfinite(ed) & torch.isfinite(ad)
        if bool(((~finite) & (~nan_e) & (ed != ad)).any()):
            return f"output {i}: infinities differ from CPU eager"
        diff, ref = (ed - ad).abs()[finite], ed.abs()[finite]
        if diff.numel() == 0:
            continue
        scale = max(1.0, float(ref.max()))
        bad = diff > atol * scale + rtol * ref
        if bool(bad.any()):
            return (f"output {i}: {int(bad.sum())} of {e.numel()} elements beyond rtol={rtol:g} atol={atol:g}, "
                    f"max_abs={float(diff.max()):.4g}")
    return None


def mismatch_metrics(expected: Any, actual: Any) -> dict[str, Any]:
    """max_abs, max_rel, numel over the floating outputs (for a finding's `metrics`)."""
    from torch.utils import _pytree as pytree

    max_abs, max_rel, numel = 0.0, 0.0, 0
    for e, a in zip(pytree.tree_leaves(expected), pytree.tree_leaves(actual)):
        if not (isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor)) or e.shape != a.shape:
            continue
        if not (e.dtype.is_floating_point or e.dtype.is_complex):
            continue
        ed, ad = e.double() if not e.is_complex() else e, a.detach().cpu().to(e.dtype)
        ad = ad.double() if not ad.is_complex() else ad
        finite = torch.isfinite(ed) & torch.isfinite(ad)
        if not bool(finite.any()):
            continue
        d = (ed - ad).abs()[finite]
        max_abs = max(max_abs, float(d.max()))
        max_rel = max(max_rel, float((d / ed.abs()[finite].clamp_min(1e-12)).max()))
        numel += e.numel()
    return {"max_abs": max_abs, "max_rel": max_rel, "numel": numel}


def _matches(name: str, patterns: Iterable[str]) -> bool:
    packet = name.rsplit(".", 1)[0] if name.count(".") >= 2 else name
    bare = packet.split(".", 1)[-1]
    return any(fnmatch.fnmatchcase(c, p) for p in patterns for c in (name, packet, bare))


def with_ranges(op: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """The encoded call with a value range per tensor (`low`, `high`) that keeps the op in its domain.

    Integer tensors (indices, ids, masks) take values in [0, smallest dimension of the call's other tensors),
    at most 16: valid for embedding, gather, index, index_select … whichever dimension they index.
    """
    args, kwargs = json.loads(json.dumps(args)), json.loads(json.dumps(kwargs))
    specs = list(iter_tensor_specs([args, kwargs]))
    positive = _matches(op, POSITIVE_INPUT_OPS)
    for i, spec in enumerate(specs):
        dtype = spec["dtype"]
        if dtype == "bool":
            low, high = 0, 2
        elif dtype.startswith(("float", "bfloat", "complex")):
            low, high = (0.1, 1.1) if positive else (-1.0, 1.0)
        else:
            dims = [int(d) for j, other in enumerate(specs) if j != i for d in other["shape"] if int(d) > 0]
            bound = min(dims) if dims else 16
            low, high = 0, max(1, min(bound, 16))
        spec["low"], spec["high"] = low, high
    return args, kwargs


def probe_seed(key: str) -> int:
    return zlib.crc32(key.encode("utf-8")) & 0x7FFFFFFF


def _decode(enc: Any, tensors: Iterable[torch.Tensor], device: str) -> Any:
    """An encoded argument back to a value; tensors are taken from `tensors` in order."""
    it = tensors if isinstance(tensors, _TensorIter) else _TensorIter(tensors)

    def dec(v: Any) -> Any:
        if isinstance(v, dict):
            if "__tensor__" in v:
                return next(it)
            if "__dtype__" in v:
                return getattr(torch, v["__dtype__"])
            if "__device__" in v:
                return torch.device(device)
            if "__layout__" in v:
                return getattr(torch, v["__layout__"])
            if "__memory_format__" in v:
                return getattr(torch, v["__memory_format__"])
            if "__float__" in v:
                return float(v["__float__"])
            if "__slice__" in v:
                return slice(*(dec(x) for x in v["__slice__"]))
            if "__ellipsis__" in v:
                return Ellipsis
            if "__tuple__" in v:
                return tuple(dec(x) for x in v["__tuple__"])
            raise ValueError(f"cannot rebuild argument {v!r}")
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    return dec(enc)


class _TensorIter:
    def __init__(self, tensors: Iterable[torch.Tensor]) -> None:
        self._it = iter(tensors)

    def __iter__(self) -> "_TensorIter":
        return self

    def __next__(self) -> torch.Tensor:
        return next(self._it)


def build_tensors(args: Any, kwargs: Any, seed: int) -> list[torch.Tensor]:
    """The call's tensors on CPU, in argument order; tensor i is seeded with `seed + i`."""
    return [make_tensor(s["shape"], s["stride"], s["dtype"], s["low"], s["high"], seed + i)
            for i, s in enumerate(iter_tensor_specs([args, kwargs]))]


def assemble(args: Any, kwargs: Any, tensors: Sequence[torch.Tensor], device: str) -> tuple[list[Any], dict[str, Any]]:
    """Arguments for the op: the encoded structure with `tensors` in place and devices set to `device`."""
    it = _TensorIter(tensors)
    return [_decode(a, it, device) for a in args], {k: _decode(v, it, device) for k, v in kwargs.items()}


def call_source(args: Any, kwargs: Any) -> tuple[list[str], list[str], str]:
    """Python source for a repro: tensor-building lines, tensor names, and the call's argument list."""
    names: list[str] = []
    lines: list[str] = []

    def src(v: Any) -> str:
        if isinstance(v, dict):
            if "__tensor__" in v:
                s = v["__tensor__"]
                name = f"t{len(names)}"
                lines.append(f"{name} = make_tensor({list(s['shape'])!r}, {list(s['stride'])!r}, {s['dtype']!r}, "
                             f"{s['low']!r}, {s['high']!r}, SEED + {len(names)})")
                names.append(name)
                return name
            if "__dtype__" in v:
                return f"torch.{v['__dtype__']}"
            if "__device__" in v:
                return "torch.device(device)"
            if "__layout__" in v:
                return f"torch.{v['__layout__']}"
            if "__memory_format__" in v:
                return f"torch.{v['__memory_format__']}"
            if "__float__" in v:
                return f"float({v['__float__']!r})"
            if "__slice__" in v:
                return f"slice({', '.join(src(x) for x in v['__slice__'])})"
            if "__ellipsis__" in v:
                return "..."
            if "__tuple__" in v:
                items = [src(x) for x in v["__tuple__"]]
                return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
            raise ValueError(f"cannot write argument {v!r} as source")
        if isinstance(v, list):
            return "[" + ", ".join(src(x) for x in v) + "]"
        return repr(v)

    parts = [src(a) for a in args] + [f"{k}={src(v)}" for k, v in kwargs.items()]
    return lines, names, ", ".join(parts)


def op_expression(op: str) -> str:
    """Source that evaluates to the op in a repro: `torch.ops.aten.softplus.default`, `torch.nn.functional.silu`."""
    parts = op.split(".")
    if len(parts) == 3 and not op.startswith("torch."):
        return f"torch.ops.{op}"
    return op


def _float_dtype(args: Any, kwargs: Any) -> str:
    """The lowest-precision floating dtype among the inputs (its tolerance applies), float32 when none."""
    order = ["bfloat16", "float16", "float32", "complex64", "float64", "complex128"]
    found = [s["dtype"] for s in iter_tensor_specs([args, kwargs]) if s["dtype"] in order]
    if not found:
        for v in kwargs.values():
            if isinstance(v, dict) and "__dtype__" in v and v["__dtype__"] in order:
                found.append(v["__dtype__"])
    return min(found, key=order.index) if found else "float32"


# --------------------------------------------------------------------------------------------- probing (child side)

def parse_named_op(message: str) -> tuple[str | None, str | None]:
    """(op overload, the phrase naming it) from a backend's error text; (None, None) when none is named."""
    m = UNSUPPORTED_RE.search(message)
    if m:
        return m.group("op"), m.group(0)
    m = COULD_NOT_RUN_RE.search(message)
    if m:
        name = m.group("op").replace("::", ".")
        return (name if name.count(".") >= 2 else f"{name}.default"), m.group(0)
    m = ATEN_NAME_RE.search(message)
    if m:
        name = m.group("op").replace("::", ".")
        return (name if name.count(".") >= 2 else f"{name}.default"), m.group(0)
    return None, None


def packet_of(op: str) -> str:
    return op.rsplit(".", 1)[0] if op.count(".") >= 2 else op


def _exc_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


def classify_failure(exc: BaseException, *, eager: bool, ref_exc: BaseException | None) -> dict[str, Any]:
    """Status, stage, error type and message of a probe's failure on the target."""
    try:
        from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException
    except ImportError:  # pragma: no cover - torch without Dynamo
        BackendCompilerFailed = TorchDynamoException = ()  # type: ignore[assignment,misc]
    inner: BaseException = exc
    if BackendCompilerFailed and isinstance(exc, BackendCompilerFailed):
        inner = getattr(exc, "inner_exception", None) or exc
        status, stage = "unsupported", "compile"
    elif TorchDynamoException and isinstance(exc, TorchDynamoException):
        status, stage = "probe_error", "trace"  # Dynamo could not trace the one-op function: not the backend's verdict
    else:
        text = str(exc)
        unsupported = bool(COULD_NOT_RUN_RE.search(text)) or (eager and isinstance(exc, NotImplementedError))
        status, stage = ("unsupported" if unsupported else "error"), "run"
    message = _exc_text(inner)
    if ref_exc is not None and status == "error" and type(ref_exc) is type(inner):
        status = "probe_error"  # CPU eager rejects the same synthetic inputs: the probe is invalid, not the backend
        message = f"CPU eager fails too ({type(ref_exc).__name__}: {_exc_text(ref_exc)[:300]}): {message}"
    named, phrase = parse_named_op(message)
    return {"status": status, "stage": stage, "error_type": type(inner).__name__, "message": message[:4000],
            "named_op": named, "named_text": phrase}


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


def one_op_graph(op: Any, args: Any, kwargs: Any, n_tensors: int, device: str, ref_value: Any) -> torch.fx.GraphModule:
    """The FX graph Dynamo would build for `op(*args, **kwargs)`: placeholders for the tensors, one call, outputs
    flattened into a tuple (multi-output ops get `getitem` nodes, sized from the CPU result)."""
    import operator

    graph = torch.fx.Graph()
    placeholders = [graph.placeholder(f"arg{i}") for i in range(n_tensors)]
    a, k = assemble(args, kwargs, placeholders, device)
    node = graph.call_function(op, tuple(a), k)
    if isinstance(ref_value, torch.Tensor):
        outputs: tuple[Any, ...] = (node,)
        shape = "single"
    elif isinstance(ref_value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in ref_value):
        outputs = tuple(graph.call_function(operator.getitem, (node, i)) for i in range(len(ref_value)))
        shape = "tuple" if isinstance(ref_value, tuple) else "list"
    else:
        raise _NoGraph()  # scalars, None, nested or unknown outputs: let Dynamo build the graph
    graph.output(outputs)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    gm.meta["deepview_output"] = shape
    return gm


def _unpack(out: Any, gm: torch.fx.GraphModule) -> Any:
    shape = gm.meta.get("deepview_output")
    if shape == "single":
        return out[0]
    return tuple(out) if shape == "tuple" else list(out)


def run_probe(backend: Any, probe: Mapping[str, Any], *, compare_results: bool,
              tolerance: tuple[float, float], via: str = "fx") -> dict[str, Any]:
    """Run one probe on `backend` (compile or eager) and against CPU eager; the outcome as a JSON-able dict.

    `via="fx"` hands the one-op FX graph straight to the backend's compiler function (what torch.compile would
    hand it, without Dynamo's tracing: about 3x faster); `via="dynamo"` goes through `backend.compile(fn)`.
    The repro scripts always go through torch.compile, so verification cross-checks the fx path.
    """
    t0 = time.monotonic()
    out: dict[str, Any] = {"id": probe["id"], "op": probe["op"], "status": "pass", "stage": None,
                           "error_type": None, "message": "", "named_op": None, "named_text": None, "metrics": {}}

    def done(**kw: Any) -> dict[str, Any]:
        out.update(kw)
        out["seconds"] = round(time.monotonic() - t0, 4)
        return out

    args, kwargs, seed = probe["args"], probe["kwargs"], int(probe["seed"])
    try:
        op = resolve_callable(probe["op"])
    except Exception as exc:
        return done(status="probe_error", stage="trace", error_type=type(exc).__name__, message=str(exc)[:2000])
    eager = bool(getattr(backend, "is_eager", False))
    device = str(getattr(backend, "device", "cpu"))

    ref_value: Any = None
    ref_exc: BaseException | None = None
    try:
        ref_args, ref_kwargs = assemble(args, kwargs, build_tensors(args, kwargs, seed), "cpu")
        ref_value = op(*ref_args, **ref_kwargs)
    except Exception as exc:
        ref_exc = exc

    try:
        tensors = [backend.to_device(t) for t in build_tensors(args, kwargs, seed)]
    except Exception as exc:
        info = classify_failure(exc, eager=True, ref_exc=None)
        info["message"] = f"moving the inputs to {device} failed: {info['message']}"[:4000]
        return done(**info)

    compiler = None if eager or via != "fx" else _fx_compiler(backend)
    graph = None
    if compiler is not None:
        try:
            graph = one_op_graph(op, args, kwargs, len(tensors), device, ref_value if ref_exc is None else None)
        except _NoGraph:
            graph = None
    try:
        if eager:
            a, k = assemble(args, kwargs, tensors, device)
            value = op(*a, **k)
        elif graph is not None:
            try:
                compiled = compiler(graph, list(tensors))
            except Exception as exc:  # the backend's compiler refused the one-op graph
                info = classify_failure(exc, eager=False, ref_exc=None)
                info.update(status="unsupported", stage="compile")
                if ref_exc is not None:  # CPU eager rejects these inputs too: an invalid probe, not a verdict
                    info.update(status="probe_error", message=f"CPU eager fails too ({type(ref_exc).__name__}: "
                                f"{_exc_text(ref_exc)[:300]}): {info['message']}"[:4000])
                return done(**info)
            value = _unpack(compiled(*tensors), graph)
        else:
            torch._dynamo.reset()  # a fresh cache: no recompile limit, no reuse between probes

            def fn(*ts: torch.Tensor) -> Any:
                a, k = assemble(args, kwargs, ts, device)
                return op(*a, **k)

            value = backend.compile(fn)(*tensors)
        value = map_tensors(lambda t: t.detach().to("cpu"), value)
    except Exception as exc:
        return done(**classify_failure(exc, eager=eager, ref_exc=ref_exc))

    if ref_exc is not None:
        return done(compare=f"skipped: CPU eager failed ({type(ref_exc).__name__})")
    if not compare_results or _matches(probe["op"], NO_COMPARE):
        return done(compare="skipped")
    rtol, atol = tolerance
    problem = compare(ref_value, value, rtol, atol)
    if problem is None:
        return done(compare="ok")
    return done(status="mismatch", stage="compare", error_type="OpMismatch", compare="mismatch",
                message=f"{probe['op']} differs from CPU eager: {problem}",
                metrics=mismatch_metrics(ref_value, value))


def probe_batch(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Isolated-child entry (`run_isolated`): rebuild the backend, run each probe, append each outcome to a file.

    Each probe is journalled (`enter-probe`/`leave-probe`) and guarded by `faulthandler`, which ends the process
    when one probe outlives `probe_timeout` (the parent sees "Timeout" in stderr and moves on).
    """
    import faulthandler

    from ..backends import resolve_backend
    from ..config import BackendSpec, spec_from_json

    backend = resolve_backend(spec_from_json(BackendSpec, payload["backend"]))
    backend.prepare()
    results = payload["results"]
    timeout = float(payload["probe_timeout"])
    compare_results = bool(payload.get("compare", True))
    count = 0
    for probe in payload["probes"]:
        child_journal("enter-probe", probe["id"])
        faulthandler.dump_traceback_later(timeout, exit=True)
        try:
            outcome = run_probe(backend, probe, compare_results=compare_results, tolerance=tuple(probe["tolerance"]),
                                via=str(payload.get("via", "fx")))
        finally:
            faulthandler.cancel_dump_traceback_later()
        append_line(results, json.dumps(outcome, default=str))
        child_journal("leave-probe", probe["id"])
        count += 1
    return {"probed": count}


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
        self.setup_error: str | None = None

    def _next_attempt(self) -> int:
        with self._lock:
            self._attempt += 1
            return self._attempt

    def run(self, probes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        # a child costs a Python + torch + backend start-up: only split when each gets a fair share of probes
        workers = max(1, min(self.opts.workers, len(probes) // _MIN_PROBES_PER_CHILD))
        shards = [_Shard(i, probes[i::workers]) for i in range(workers)]
        results: dict[str, dict[str, Any]] = {}
        if workers == 1:
            results.update(self._run_shard(shards[0]))
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
                for part in pool.map(self._run_shard, shards):
                    results.update(part)
        return results

    def _run_shard(self, shard: _Shard) -> dict[str, dict[str, Any]]:
        """The shard's probes in children (`isolate.supervise`): a child that dies costs the probe it was in."""
        pending = list(shard.probes)
        results: dict[str, dict[str, Any]] = {}
        env = {str(k): str(v) for k, v in self.spec.env.items()}
        journal_path = self.work_dir / f"journal-{shard.index:03d}.log"
        journal_path.unlink(missing_ok=True)
        batch: list[dict[str, Any]] = []
        results_path = self.work_dir / "probes.jsonl"
        tag = ""

        def next_attempt(_n: int) -> Attempt | str | None:
            nonlocal batch, results_path, tag
            if not pending:
                return None
            budget = self.remaining() - 5.0
            if budget < min(self.opts.probe_timeout, 10.0):
                for p in pending:
                    results[p["id"]] = _not_run(p, "the cell's time ran out before this probe")
                return "the cell's time ran out"
            batch = pending[: self.opts.batch_size]
            attempt = self._next_attempt()
            results_path = self.work_dir / f"probes-{attempt:03d}.jsonl"
            payload = {"backend": spec_to_json(self.spec), "probes": batch, "results": str(results_path),
                       "probe_timeout": self.opts.probe_timeout, "compare": self.opts.compare, "via": self.opts.via}
            tag = f"{attempt}:{batch[0]['id']}..{batch[-1]['id']}"
            if self.journal:
                self.journal("enter-probe-batch", tag)
            return Attempt(payload=payload, timeout=min(budget, self.opts.probe_timeout * len(batch) + _CHILD_STARTUP_S))

        def collect() -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
            nonlocal pending
            if self.journal:
                self.journal("leave-probe-batch", tag)
            done = _read_outcomes(results_path)
            results.update(done)
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
                    results[p["id"]] = _not_run(p, f"probe process failed before probing: {self.setup_error}")
                return "the probe process failed before probing"
            culprit = next((p for p in left if p["id"] == open_id), left[0])
            results[culprit["id"]] = _crash_outcome(culprit, res, self.opts.probe_timeout)
            pending = [p for p in left if p is not culprit] + pending
            return None

        supervise("ci_runner.modes.ops:probe_batch", journal=journal_path, kind="probe", next_attempt=next_attempt,
                  on_ok=on_ok, on_crash=on_crash, env=env)
        return results


def _not_run(probe: Mapping[str, Any], why: str) -> dict[str, Any]:
    return {"id": probe["id"], "op": probe["op"], "status": "not_run", "stage": None, "error_type": None,
            "message": why, "named_op": None, "named_text": None, "metrics": {}, "seconds": 0.0}


def _read_outcomes(path: Path) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return out
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        out[row["id"]] = row
    return out


_FAULTHANDLER_RE = re.compile(r"^(Timeout \(|Thread 0x|Current thread 0x|Fatal Python error|  File \"|Extension modules:|\s*$)")


def _backend_lines(stderr_tail: str) -> str:
    """The backend's own last words from a child's stderr, without faulthandler's thread dumps."""
    lines = [ln for ln in stderr_tail.splitlines() if not _FAULTHANDLER_RE.match(ln)]
    return "\n".join(lines[-6:]).strip()


def _crash_outcome(probe: Mapping[str, Any], res: Any, probe_timeout: float) -> dict[str, Any]:
    tail = res.stderr_tail or ""
    if res.status == "timeout" or "Timeout (" in tail:
        status, error_type = "timeout", "Timeout"
        message = f"the probe did not finish within {probe_timeout:g}s"
    elif res.signal:
        status, error_type = "crashed", res.signal
        message = f"the process died by {res.signal}"
    else:
        status, error_type = "crashed", f"exit {res.exit_code}"
        message = f"the process exited with code {res.exit_code} during the probe"
    words = _backend_lines(tail)
    if words:
        message += ": " + words
    named, phrase = parse_named_op(words)
    return {"id": probe["id"], "op": probe["op"], "status": status, "stage": "run", "error_type": error_type,
            "message": message[:4000], "named_op": named, "named_text": phrase, "metrics": {},
            "seconds": probe_timeout if status == "timeout" else None}


# --------------------------------------------------------------------------------------------- repro scripts

@dataclass(frozen=True, kw_only=True)
class BackendRecipe:
    """How a standalone script rebuilds the backend: imports, setup lines, the torch.compile backend expression."""

    imports: tuple[str, ...]
    setup: tuple[str, ...]
    backend_expr: str | None  # None for eager devices
    device: str
    env: Mapping[str, str]
    compile_options: Mapping[str, Any]
    pythonpath: tuple[str, ...]  # folders the script needs on PYTHONPATH (plugins not installed as packages)


def backend_recipe(spec: "BackendSpec") -> BackendRecipe:
    imports: list[str] = list(spec.imports)
    setup: list[str] = []
    expr: str | None = None
    options = dict(spec.backend_options)
    if spec.device.split(":")[0] == "simdev":  # backends.py: simdev's options sit under `simdev` when compiling
        sim_options = options if spec.compile is None else dict(options.get("simdev") or {})
        imports.append("ci_runner.sim.simdev")
        setup.append(f"ci_runner.sim.simdev.register_from_options({sim_options!r})  # registers the simdev device")
    if spec.compile is not None:
        from ..sim import is_sim

        if is_sim(spec.compile):
            imports.append("ci_runner.sim")
            setup.append(f"BACKEND = ci_runner.sim.make_backend({spec.compile!r}, {options!r})")
        elif ":" in spec.compile:
            module, _, attr = spec.compile.partition(":")
            imports.append(module)
            target = f"{module}.{attr}"
            setup.append(f"BACKEND = {target}(**{options!r})" if options else f"BACKEND = {target}")
        else:
            setup.append(f"BACKEND = {spec.compile!r}")
        expr = "BACKEND"
    imports = list(dict.fromkeys(imports))
    return BackendRecipe(imports=tuple(imports), setup=tuple(setup), backend_expr=expr, device=spec.device,
                         env=dict(spec.env), compile_options=dict(spec.compile_options),
                         pythonpath=tuple(plugin_pythonpath(imports)))


def render_repro(*, op: str, kind: str, stage: str, error_type: str | None, message: str,
                 signature: OpSignature, probe: Mapping[str, Any], recipe: BackendRecipe, backend_id: str,
                 model_id: str, ir: str, env_stamp: Mapping[str, Any], tolerance: tuple[float, float],
                 compare_results: bool, command: str, crash: bool) -> str:
    """The repro script's text (see `templates/repro_op.py.j2`)."""
    from ..repro import render_template

    tensor_lines, tensor_names, call_args = call_source(probe["args"], probe["kwargs"])
    site = signature.sites[0] if signature.sites else None
    backend_versions = env_stamp.get("backend") or {}
    return render_template(
        "repro_op.py.j2",
        op=signature.op, kind=kind, stage=stage, error_type=error_type or "", message=message.splitlines()[0][:300] if message else "",
        model_id=model_id, calls=signature.count, module=(site.module or "(the model itself)") if site else "?",
        module_class=site.module_class if site else "?", source=(site.source if site else None) or "unknown",
        signature=signature.describe()[:400], backend_id=backend_id, ir=ir,
        torch_version=env_stamp.get("torch") or torch.__version__, transformers_version=env_stamp.get("transformers") or "?",
        python_version=env_stamp.get("python") or sys.version.split()[0],
        backend_versions=", ".join(f"{k} {v}" for k, v in sorted(dict(backend_versions).items())) or "-",
        device=recipe.device, eager=recipe.backend_expr is None, env=dict(recipe.env), imports=list(recipe.imports),
        setup=list(recipe.setup), backend_expr=recipe.backend_expr or "None", compile_options=dict(recipe.compile_options),
        op_expr=op_expression(signature.op), seed=int(probe["seed"]), compare=compare_results and kind == "op_mismatch",
        rtol=tolerance[0], atol=tolerance[1], make_tensor_source=_plain_source(make_tensor),
        compare_source=_plain_source(compare), tensor_lines=tensor_lines, tensor_names=tensor_names,
        call_args=call_args, command=command, crash=crash,
    )


# --------------------------------------------------------------------------------------------- the mode

def _plain_source(fn: Callable[..., Any]) -> str:
    """A function's source for a standalone script, without this package's type-checker comments.

    Read once, at import: `inspect` reads the file on disk, which may have changed under a long-running process.
    """
    source = _SOURCES.get(fn.__name__)
    if source is None:
        source = _SOURCES[fn.__name__] = re.sub(r"  # type: ignore\[[^\]]*\]", "", inspect.getsource(fn))
    return source


_SOURCES: dict[str, str] = {}
_plain_source(make_tensor)
_plain_source(compare)


def choose_level(spec: "BackendSpec", is_eager: bool, override: str | None) -> str:
    """The IR level to inventory: the mode option, else `dispatch` for eager devices, else the spec's `ir`."""
    if override:
        return override
    if is_eager:
        return "dispatch"
    return spec.ir or "aten"


def build_probes(inventory: Inventory, opts: OpsOptions) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Probe specs for the inventory's signatures (in first-call order), and the signatures left out, with why."""
    probes: list[dict[str, Any]] = []
    left_out: list[dict[str, Any]] = []
    per_op: dict[str, int] = {}
    for sig in inventory.signatures:
        reason = None
        if opts.skip_ops and _matches(sig.op, opts.skip_ops):
            reason = "skipped by options.ops.skip_ops"
        elif not sig.probeable:
            reason = "an argument cannot be rebuilt synthetically"
        elif per_op.get(sig.op, 0) >= opts.max_signatures_per_op:
            reason = f"more than max_signatures_per_op={opts.max_signatures_per_op} signatures"
        if reason:
            left_out.append({"op": sig.op, "signature": sig.describe()[:300], "reason": reason})
            continue
        per_op[sig.op] = per_op.get(sig.op, 0) + 1
        args, kwargs = with_ranges(sig.op, sig.args, sig.kwargs)
        probes.append({"id": f"p{len(probes):04d}", "op": sig.op, "key": sig.key, "args": args, "kwargs": kwargs,
                       "seed": probe_seed(sig.key), "tolerance": list(opts.tolerance_for(_float_dtype(args, kwargs)))})
    return probes, left_out


@dataclass
class _Failure:
    op: str  # the op the finding is about
    signature: OpSignature
    probe: dict[str, Any]
    outcome: dict[str, Any]


def attributed_op(probe_op: str, outcome: Mapping[str, Any]) -> str:
    """The op a failure is about: always the op the model calls (the probed one), which is what blocks the model.

    The backend may name another operator (simdev's `_safe_softmax` fails in its fallback to `aten::_softmax.out`,
    a structured op in its `.out` overload); that name stays in the finding's `details["named_op"]` and in the
    text a verified repro must reproduce.
    """
    return probe_op


def _expectation(outcome: Mapping[str, Any], op: str) -> dict[str, Any]:
    """What a verified repro must print: the backend's phrase naming the op, and the error type."""
    status = outcome["status"]
    if status in ("crashed", "timeout"):
        return {"expect_text": [], "expect_error_type": None, "expect_signal": True}
    if status == "mismatch":
        return {"expect_text": ["OpMismatch", op], "expect_error_type": None, "expect_signal": False}
    phrase = outcome.get("named_text")
    if phrase:
        text = [phrase]
    else:
        first = (outcome.get("message") or "").strip().splitlines()
        text = [re.sub(r"0x[0-9a-fA-F]+", "", first[0])[:80].strip()] if first else []
        text = [t for t in text if t]
    return {"expect_text": text, "expect_error_type": outcome.get("error_type"), "expect_signal": False}


def run(ctx: "ModeContext") -> ModeResult:
    """Mode `ops` (see the module docstring)."""
    t_start = time.monotonic()
    opts: OpsOptions = parse_options(MODE, ctx.options(MODE), where=f"cell {ctx.cell.id}: options.ops")
    spec = ctx.cell.backend
    backend = ctx.backend
    level = choose_level(spec, backend.is_eager, opts.ir)
    ops_dir = ctx.artifact_dir(MODE)
    ctx.journal("enter-phase", "ops.inventory")
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    try:
        inventory = _take_inventory(ctx, level)
    except InventoryError as exc:
        ctx.journal("leave-phase", "ops.inventory")
        return ModeResult(status="error", reason=str(exc), duration_s=time.monotonic() - t_start,
                          data={"ir": level})
    ctx.journal("leave-phase", "ops.inventory")
    atomic_write_json(ops_dir / "inventory.json", inventory.to_dict())
    timings["inventory_s"] = round(time.monotonic() - t0, 3)
    data: dict[str, Any] = {"ir": level, "inventory": inventory.summary(), "timings": timings}
    if not opts.probe:
        return ModeResult(status="pass", duration_s=time.monotonic() - t_start, data=data,
                          reason="inventory only (options.ops.probe is false)")

    probes, left_out = build_probes(inventory, opts)
    by_key = {s.key: s for s in inventory.signatures}
    runner = ProbeRunner(backend_spec=spec, work_dir=ops_dir / "work", opts=opts, remaining=ctx.remaining,
                         journal=ctx.journal)
    t_probe = time.monotonic()
    outcomes = runner.run(probes) if probes else {}
    probe_seconds = time.monotonic() - t_probe
    timings["probe_s"] = round(probe_seconds, 3)
    _cleanup(ops_dir / "work")

    rows = []
    failures: dict[str, list[_Failure]] = {}
    for p in probes:
        o = outcomes.get(p["id"]) or _not_run(p, "no outcome recorded")
        sig = by_key[p["key"]]
        rows.append({"id": p["id"], "op": p["op"], "signature": sig.describe()[:300], "status": o["status"],
                     "stage": o.get("stage"), "error_type": o.get("error_type"), "seconds": o.get("seconds"),
                     "message": (o.get("message") or "")[:500], "compare": o.get("compare")})
        if o["status"] in FAILED:
            op = attributed_op(p["op"], o)
            failures.setdefault(op, []).append(_Failure(op=op, signature=sig, probe=p, outcome=o))
    atomic_write_json(ops_dir / "probes.json", {"probes": rows, "left_out": left_out})

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    # bounded: passing probes as one line each (op, signature, seconds); the full table is in ops/probes.json
    data["probes"] = [r if r["status"] != "pass" else {k: r[k] for k in ("id", "op", "signature", "status", "seconds")}
                      for r in rows[:_MAX_PROBE_ROWS]]
    data["probe_counts"] = {**counts, "total": len(rows), "left_out": len(left_out), "seconds": round(probe_seconds, 3)}
    if len(rows) > _MAX_PROBE_ROWS:
        data["probes_truncated"] = True
    if left_out:
        data["left_out"] = left_out[:200]
    if runner.setup_error:
        data["probe_setup_error"] = runner.setup_error

    t0 = time.monotonic()
    findings = _findings(ctx, failures, inventory, level, opts, ops_dir)
    timings["render_s"] = round(time.monotonic() - t0, 3)
    t0 = time.monotonic()
    _verify_all(ctx, findings, opts)
    timings["verify_s"] = round(time.monotonic() - t0, 3)
    data["repros"] = {"total": len(findings), "verified": sum(1 for f, _ in findings if f.repro and f.repro.verified)}
    result_findings = [f for f, _ in findings]
    status = "fail" if result_findings else "pass"
    reason = None
    if runner.setup_error and not result_findings:
        status, reason = "error", f"the probe process could not set up the backend: {runner.setup_error}"
    elif counts.get("not_run"):
        reason = f"{counts['not_run']} probe(s) not run (time ran out or the probe process failed)"
    return ModeResult(status=status, findings=result_findings, reason=reason, data=data,
                      duration_s=time.monotonic() - t_start)


def _take_inventory(ctx: "ModeContext", level: str) -> Inventory:
    """From a meta-device model (no weights) when the model source can build one, else from the CPU model."""
    device = ctx.backend.device
    errors: list[str] = []
    _model_bytes = 0
    for meta in (True, False):
        if not meta and _model_bytes > _CPU_FALLBACK_MAX_BYTES:
            errors.append(f"not retried with real weights on CPU: the model needs {_model_bytes / 2**30:.1f} GiB")
            break
        try:
            loaded = ctx.model(meta=meta)
            kwargs = ctx.inputs(loaded, sample=0, device="cpu")
        except DeepviewError:
            raise
        except Exception as exc:
            errors.append(f"building the {'meta' if meta else 'CPU'} model failed: {type(exc).__name__}: {exc}")
            continue
        if meta:
            _model_bytes = sum(t.numel() * t.element_size() for t in loaded.module.parameters())
        try:
            inv = take_inventory(loaded.module, (), kwargs, level=level, device=device)
        except InventoryError as exc:
            errors.append(exc.message)
            continue
        if errors:
            inv.notes[:0] = errors
        if not meta:
            inv.notes.append("traced from the CPU model (the meta-device trace failed)")
        return inv
    raise InventoryError("; ".join(errors), hint="fix the trace error at that source line, or choose another `ir` "
                         "level for this backend (options.ops.ir)")


def _cleanup(work: Path) -> None:
    import shutil

    shutil.rmtree(work, ignore_errors=True)


def _findings(ctx: "ModeContext", failures: Mapping[str, list[_Failure]], inventory: Inventory, level: str,
              opts: OpsOptions, ops_dir: Path) -> list[tuple[Finding, dict[str, Any]]]:
    """One finding per failing op (its most severe failure), each with a rendered repro, not yet verified."""
    from ..repro import safe_filename, write_script

    spec = ctx.cell.backend
    recipe = backend_recipe(spec)
    out: list[tuple[Finding, dict[str, Any]]] = []
    for op in sorted(failures, key=lambda o: min(f.probe["id"] for f in failures[o])):
        items = failures[op]
        lead = max(items, key=lambda f: (SEVERITY[f.outcome["status"]], -int(f.probe["id"][1:])))
        status = lead.outcome["status"]
        kind = KIND_OF_STATUS[status]
        site = next((s for f in items for s in f.signature.sites), None)
        modules: dict[str, None] = {}
        for f in items:
            for s in f.signature.sites:
                modules.setdefault(s.module, None)
        signatures = [{
            "signature": f.signature.describe()[:400], "probed_op": f.probe["op"], "count": f.signature.count,
            "status": f.outcome["status"], "stage": f.outcome.get("stage"), "error_type": f.outcome.get("error_type"),
            "message": (f.outcome.get("message") or "")[:600], "metrics": f.outcome.get("metrics") or {},
            "sites": [s.to_dict() for s in f.signature.sites[:4]],
        } for f in items]
        message = lead.outcome.get("message") or ""
        error_type = lead.outcome.get("error_type")
        file_name = f"repro_{safe_filename(op)}.py"
        script = ops_dir / file_name
        command = f"python {file_name}"
        if recipe.pythonpath:
            command = f"PYTHONPATH={os.pathsep.join(recipe.pythonpath)} {command}"
        text = render_repro(op=op, kind=kind, stage=lead.outcome.get("stage") or "run", error_type=error_type,
                            message=message, signature=lead.signature, probe=lead.probe, recipe=recipe,
                            backend_id=spec.id, model_id=ctx.cell.model.id, ir=level, env_stamp=ctx.env,
                            tolerance=tuple(lead.probe["tolerance"]), compare_results=opts.compare,
                            command=command, crash=status in ("crashed", "timeout"))
        write_script(script, text)
        metrics = dict(lead.outcome.get("metrics") or {})
        threshold = {"rtol": lead.probe["tolerance"][0], "atol": lead.probe["tolerance"][1]} if kind == "op_mismatch" else {}
        finding = Finding(
            kind=kind, stage=lead.outcome.get("stage") or "run",
            message=(f"{error_type}: {message}" if error_type and not message.startswith(str(error_type)) else message)[:2000],
            fingerprint=fingerprint(kind, spec.id, op), op=op,
            module=site.module if site else None, module_class=site.module_class if site else None,
            error_type=error_type, metrics=metrics, threshold=threshold,
            repro=Repro(path=f"{MODE}/{file_name}", verified=False, command=command, note="not verified"),
            details={"signatures": signatures, "signature_count": len(items), "calls": sum(f.signature.count for f in items),
                     "modules": list(modules)[:20], "module_count": len(modules),
                     "source": site.source if site else None, "ir": level,
                     "named_op": lead.outcome.get("named_op"), "probed_op": lead.probe["op"]},
        )
        out.append((finding, {"script": script, "recipe": recipe, **_expectation(lead.outcome, op),
                              "status": status, "error_type": error_type,
                              "named_text": lead.outcome.get("named_text")}))
    return out


def _same_fault(how: Mapping[str, Any], exit_code: int | None, output: str, note: str) -> tuple[bool, str]:
    """A hard fault reproduces only as the same fault: the same signal (or a hang), naming the same op if it did."""
    import signal

    error_type = str(how.get("error_type") or "")
    if how["status"] == "timeout":
        if exit_code is not None:
            return False, f"expected a hang, but the repro exited with {exit_code}"
    elif error_type.startswith("SIG"):
        want = getattr(signal, error_type, None)
        if want is None or exit_code != -int(want):
            return False, f"expected death by {error_type}, got exit code {exit_code}"
    phrase = how.get("named_text")
    if phrase and phrase not in output:
        return False, f"failed differently: output lacks {phrase!r}"
    return True, note


def _verify_all(ctx: "ModeContext", findings: list[tuple[Finding, dict[str, Any]]], opts: OpsOptions) -> None:
    """Run each repro in a fresh process; `verified` when it fails with the same error type and op text."""
    from ..repro import verify_script

    if not findings:
        return
    if not opts.verify:
        for f, _ in findings:
            assert f.repro is not None
            f.repro.note = "not verified (options.ops.verify is false)"
        return

    def one(item: tuple[Finding, dict[str, Any]]) -> None:
        finding, how = item
        assert finding.repro is not None
        timeout = opts.verify_timeout
        if how["status"] == "timeout":
            timeout = min(opts.verify_timeout, opts.probe_timeout)
        if ctx.remaining() < timeout + 5:
            finding.repro.note = "not verified: the cell's time ran out"
            return
        env = {str(k): str(v) for k, v in how["recipe"].env.items()}
        if how["recipe"].pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(how["recipe"].pythonpath)
        v = verify_script(how["script"], expect_text=how["expect_text"], expect_error_type=how["expect_error_type"],
                          timeout=timeout, env=env, expect_signal=how["expect_signal"])
        verified, note = v.verified, v.note
        if verified and how["expect_signal"]:
            verified, note = _same_fault(how, v.exit_code, v.output_tail, note)
        finding.repro.verified = verified
        finding.repro.note = note
        finding.details["repro_output_tail"] = v.output_tail[-1500:]

    workers = max(1, min(opts.workers, len(findings)))
    if workers == 1:
        for item in findings:
            one(item)
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(one, findings))
