"""The operator inventory of a model: every op overload it calls, per input signature, with its owner.

An *inventory* lists, for one IR level, each distinct (op, signature) the model's forward uses: the op's
qualified name, the recorded arguments (tensors as shape / dtype / stride, scalars as values, devices and dtypes
by name), how often it is called and where (owning module, module class, source line). It is built from tracing
alone, so a meta-device model (no weights, no accelerator) is enough.

The IR level is what the backend's compiler sees (`BackendSpec.ir`); each is traced differently:

============ ====================================================================================================
level        how it is traced and what it contains
============ ====================================================================================================
``aten``     default. What `aot_autograd` hands a torch.compile backend, captured exactly that way:
             `torch.compile(model, backend=aot_autograd(fw_compiler=<recorder>))` on a fake copy of the model on
             the backend's host device kind (cpu/cuda; meta for any other device), inside its FakeTensorMode: no
             memory, the device's own kernel choices (attention), one graph per graph break. Falls back to
             `torch.export.export(strict=False)` + `run_decompositions` with only the CompositeImplicitAutograd
             decompositions, which gives nearly the same graph (measured: the same op set on tiny Bamba; it differs
             where Python and Dynamo trace differently, e.g. tensor unpacking → `unbind` instead of `select`).
``core_aten`` `torch.export.export(strict=False)` on the fake copy, lowered with the default Core ATen table
             (`run_decompositions()`).
``dynamo``   `torch.compile` with a recording backend: the FX graphs of torch-level calls (`torch.nn.functional.*`,
             `torch.Tensor.*` methods, `operator.*`) that a plain (non-aot) backend receives; one per graph break.
``dispatch`` a `TorchDispatchMode` over an eager forward of the meta model: the ATen ops an *eager* device's
             kernels receive (after CompositeImplicitAutograd decomposition, not functionalized: in-place ops
             and views as called). Used for eager backends (no `compile`), whatever `ir` says.
============ ====================================================================================================

Export-only bookkeeping nodes (`aten._assert_tensor_metadata` and friends) are left out: no backend sees them.
This module walks the graphs; the record it builds (encoded arguments, `OpSignature`, `Inventory`) is `op_signature`.
"""

from __future__ import annotations

import copy
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ...watch.capture import ModuleCapture
from ...watch.hooks import aten_recording
from ...errors import DeepviewError
from ...engine.codec import encode_arg, tensor_specs
from .signature import CallSite, Inventory, OpSignature, signature_key
from .tracefail import (PACKAGE_DIR, error_summary, fake_tensor_error, model_code_error, short_path,
                        transformers_checks_off, where_failed)
from ...models.torchcompat import require
from ...models.load import model_module_stack, module_names, normalize_module_path, resolve_module_name

LEVELS: tuple[str, ...] = ("dynamo", "aten", "core_aten", "dispatch")
MAX_SITES = 8  # call sites kept per signature
SKIP_OPS: frozenset[str] = frozenset({
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten._assert_async.default",
    "aten._assert_async.msg",
    "aten._functional_assert_async.msg",
    "aten._functional_assert_scalar.default",
    "aten.sym_constrain_range.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._functional_sym_constrain_range.default",
    "aten._functional_sym_constrain_range_for_size.default",
    "aten.sym_size.int",
    "aten.sym_stride.int",
    "aten.sym_numel.default",
    "aten.sym_storage_offset.default",
})
# Runtime checks and `.item()` in a graph: `torch._check_tensor_all` (transformers' `torch_compilable_check`, e.g.
# Llava's image-token count) and the scalar it reads. Under torch.compile's default Dynamo config
# (capture_scalar_outputs=False) they run in eager at a graph break, so a compiler is never handed them: a one-op
# probe would be a false alarm (tiny Llava on IREE: `aten._is_all_true` "failed to legalize", while the whole model
# compiles and runs on IREE). Left out of the graph-level inventories only; an eager device does run them.
EAGER_AT_GRAPH_BREAK: frozenset[str] = frozenset({
    "aten._is_all_true.default",
    "aten._is_any_true.default",
    "aten._local_scalar_dense.default",
})

class InventoryError(DeepviewError):
    """The model could not be traced at any level: the message carries the trace error and where it happened."""


# --------------------------------------------------------------------------------------------- graph nodes

def used_outputs(node: torch.fx.Node) -> list[int] | None:
    """The output indices of a multi-output node that its graph reads (`getitem` users); None when the value is
    used whole (or is a single tensor). Dead outputs are not part of what the model asks of the backend: IREE, for
    one, compiles attention returning output 0 but not its logsumexp."""
    import operator

    val = node.meta.get("val", node.meta.get("example_value"))
    if not isinstance(val, (tuple, list)):
        return None
    idx: set[int] = set()
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int):
            idx.add(int(user.args[1]))
        else:
            return None
    return sorted(idx)


def op_imports(op: Any) -> tuple[str, ...]:
    """The module that registered a custom (non-aten/prims) op, which a fresh process must import before the op
    resolves: `transformers.integrations.moe` for `transformers::grouped_mm_fallback`. Empty for built-in ops."""
    if not isinstance(op, torch._ops.OpOverload):
        return ()
    ns = op.namespace
    if ns in ("aten", "prims", "prim", "quantized", "_quantized", "rngprims"):
        return ()
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # pragma: no cover - torch without custom ops
        return ()
    opdef = OPDEFS.get(f"{ns}::{op._opname}")
    init = getattr(opdef, "_init_fn", None)
    module = getattr(init, "__module__", None)
    if isinstance(module, str) and module and module != "__main__":
        return (module,)
    return ()


# --------------------------------------------------------------------------------------------- building

class _Builder:
    """Accumulates calls into distinct signatures."""

    def __init__(self) -> None:
        self.by_key: dict[str, OpSignature] = {}
        self.total = 0

    def add(self, op: str, args: list[Any], kwargs: dict[str, Any], site: CallSite, *,
            outputs: list[int] | None = None, imports: tuple[str, ...] = ()) -> None:
        key = signature_key(op, args, kwargs, outputs)
        sig = self.by_key.get(key)
        if sig is None:
            sig = self.by_key[key] = OpSignature(op=op, args=args, kwargs=kwargs, key=key, order=self.total,
                                                 outputs=outputs, imports=imports)
        sig.count += 1
        self.total += 1
        if site not in sig.sites:
            sig.site_count += 1
            if len(sig.sites) < MAX_SITES:
                sig.sites.append(site)

    def build(self, **kw: Any) -> Inventory:
        sigs = sorted(self.by_key.values(), key=lambda s: s.order)
        return Inventory(signatures=sigs, total_calls=self.total, **kw)


# --------------------------------------------------------------------------------------------- helpers

_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)')


def source_from_stack_trace(stack_trace: str | None) -> str | None:
    """`file.py:123 in fn` of the innermost frame of an FX node's `stack_trace`."""
    if not stack_trace:
        return None
    frames = _FRAME_RE.findall(stack_trace)
    if not frames:
        return None
    torch_dir = str(Path(torch.__file__).parent)
    outside = [f for f in frames if not f[0].startswith(torch_dir)]
    path, line, fn = (outside or frames)[-1]  # the model's own line, not torch.nn's
    return f"{short_path(path)}:{line} in {fn.strip()}"


def _class_name(cls: Any) -> str:
    if isinstance(cls, type):
        return cls.__name__
    return str(cls).rsplit(".", 1)[-1].rstrip("'>")


def site_from_node(node: torch.fx.Node, root_class: str) -> CallSite:
    stack = model_module_stack(node.meta)
    module, module_class = "", root_class
    if stack:
        path, cls = stack[-1]
        module, module_class = normalize_module_path(path), _class_name(cls)
        if module == "":
            module_class = root_class
    return CallSite(module=module, module_class=module_class, source=source_from_stack_trace(node.meta.get("stack_trace")))


def _node_value(meta_key: str) -> Callable[[Any], Any]:
    def get(v: Any) -> Any:
        return v.meta.get(meta_key, v.meta.get("val")) if isinstance(v, torch.fx.Node) else v
    return get


def _encode_node_args(node: torch.fx.Node, meta_key: str) -> tuple[list[Any], dict[str, Any]]:
    """Encode a node's args; nodes become their recorded values (tensors → specs, SymInts → ints)."""
    resolve = _node_value(meta_key)

    def enc(v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return encode_arg(resolve(v))
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            items = [enc(x) for x in v]
            return {"__tuple__": items} if isinstance(v, tuple) and meta_key == "example_value" else items
        if isinstance(v, dict):
            return {"__opaque__": "dict"}
        return encode_arg(v)

    return [enc(a) for a in node.args], {k: enc(v) for k, v in node.kwargs.items()}


def _graph_modules(gm: torch.fx.GraphModule) -> Iterator[torch.fx.GraphModule]:
    """The graph module and the subgraphs of higher-order ops (cond, wrap…), each once."""
    seen: set[int] = set()
    for mod in gm.modules():
        if isinstance(mod, torch.fx.GraphModule) and id(mod) not in seen:
            seen.add(id(mod))
            yield mod


def _is_aten_like(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload)


def add_aten_graph(builder: _Builder, gm: torch.fx.GraphModule, root_class: str, notes: list[str]) -> None:
    """Record every OpOverload call of `gm` (and its subgraphs) into `builder`."""
    skipped_hops: set[str] = set()
    for sub in _graph_modules(gm):
        for node in sub.graph.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if not _is_aten_like(target):
                if isinstance(target, torch._ops.HigherOrderOperator):
                    skipped_hops.add(str(target.name()))
                continue
            name = str(target)
            if name in SKIP_OPS or name in EAGER_AT_GRAPH_BREAK:
                continue
            args, kwargs = _encode_node_args(node, "val")
            builder.add(name, args, kwargs, site_from_node(node, root_class), outputs=used_outputs(node),
                        imports=op_imports(target))
    if skipped_hops:
        notes.append("higher-order ops not probed (their bodies are): " + ", ".join(sorted(skipped_hops)))


# --------------------------------------------------------------------------------------------- model prep

def _is_meta_model(model: nn.Module) -> bool:
    return any(t.is_meta for t in _module_tensors(model))


def _module_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()


def _host_device(device: str) -> str:
    """The device to fake for tracing: cpu or cuda keep their kernels' choices, any other device traces on meta."""
    kind = (device or "cpu").split(":", 1)[0]
    return kind if kind in ("cpu", "cuda") else "meta"


def _fake_model_and_inputs(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                           device: str, mode: Any = None) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A copy of a meta `model` with fake tensors on `device` (no memory), and fake inputs on it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    clone = copy.deepcopy(model)

    def fake_input(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=device)
        if isinstance(v, (list, tuple)):
            return type(v)(fake_input(x) for x in v)
        if isinstance(v, dict):
            return {k: fake_input(x) for k, x in v.items()}
        return v

    with mode:
        for mod in clone.modules():  # swap in fake tensors by hand: `to_empty` cannot swap meta → meta
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    fake = torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=p.dtype, device=device)
                    mod._parameters[name] = nn.Parameter(fake, requires_grad=p.requires_grad)
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = torch.empty_strided(tuple(b.shape), tuple(b.stride()), dtype=b.dtype, device=device)
        fargs = fake_input(args)
        fkwargs = fake_input(kwargs)
    return clone, fargs, fkwargs


def _to_meta(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.to("meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_to_meta(x) for x in v)
    if isinstance(v, dict):
        return {k: _to_meta(x) for k, x in v.items()}
    return v


# --------------------------------------------------------------------------------------------- tracers

def trace_export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, level: str,
                 device: str = "cpu") -> Inventory:
    """`aten` / `core_aten` via torch.export on a fake copy of the model (see the module docstring)."""
    t0 = time.monotonic()
    host = _host_device(device)
    root_class = type(model).__name__
    if _is_meta_model(model) and host != "meta":
        model, args, kwargs = _fake_model_and_inputs(model, args, kwargs, host)
    elif _is_meta_model(model):
        args, kwargs = _to_meta(args), _to_meta(kwargs)
    else:
        host = next((t.device.type for t in _module_tensors(model)), "cpu")
    with torch.no_grad():
        ep = torch.export.export(model, tuple(args), dict(kwargs), strict=False)
    if level == "core_aten":
        ep = ep.run_decompositions()
    else:
        ep = ep.run_decompositions(cia_decompositions())
    builder = _Builder()
    notes: list[str] = []
    add_aten_graph(builder, ep.graph_module, root_class, notes)
    return builder.build(level=level, method="export", device=host, notes=notes, duration_s=time.monotonic() - t0)


def cia_decompositions() -> Any:
    """The decomposition table holding only the CompositeImplicitAutograd ops (what aot_autograd applies)."""
    require("cia_ops")
    from torch._export.utils import _collect_all_valid_cia_ops
    from torch.export import default_decompositions

    table = default_decompositions()
    cia = _collect_all_valid_cia_ops()
    for op in list(table.keys()):
        if op not in cia:
            table.pop(op)
    return table


def _traceable(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], device: str
               ) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any], str, Any]:
    """(model, args, kwargs, host device, mode to trace in). A meta model becomes a fake copy on `device`'s host
    kind: fake tensors, not bare meta ones, because models skip data-dependent checks (`.item()`) on fake tensors,
    and the forward runs inside the fake mode so that factories (arange …) make fake tensors too."""
    if not _is_meta_model(model):
        return model, args, kwargs, next((t.device.type for t in _module_tensors(model)), "cpu"), _null_context()
    from torch._subclasses.fake_tensor import FakeTensorMode

    host = _host_device(device)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, args, kwargs = _fake_model_and_inputs(model, args, kwargs, host, fake_mode)
    return model, args, kwargs, host, fake_mode


def trace_aot(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, device: str = "cpu",
              timings: dict[str, float] | None = None) -> Inventory:
    """`aten` through torch.compile + aot_autograd with a recording compiler: exactly what an aot backend gets.

    One graph per graph break. A meta model runs as a fake copy on `device`'s host kind (inside its fake mode),
    so device-dependent choices (the attention kernel) are those of that device, with no memory used. `timings`,
    when given, gets the CPU seconds of the fake copy, Dynamo's bytecode trace (with its guards), aot_autograd
    (with the recording compiler) and our graph walk.
    """
    t0, c0 = time.monotonic(), time.process_time()
    root_class = type(model).__name__
    model, args, kwargs, host, fake_mode = _traceable(model, args, kwargs, device)
    aot_cpu = [0.0]  # aot_autograd's CPU time, booked apart from Dynamo's
    with aten_recording(model, cpu_seconds=aot_cpu, dynamic=False) as (compiled, graphs):
        c1 = time.process_time()
        try:
            with torch.no_grad(), fake_mode:
                compiled(*args, **kwargs)
        finally:
            c2 = time.process_time()
    builder = _Builder()
    notes: list[str] = []
    for gm in graphs:
        add_aten_graph(builder, gm, root_class, notes)
    if timings is not None:
        timings.update(fake_copy=c1 - c0, dynamo=c2 - c1 - aot_cpu[0], aot=aot_cpu[0], walk=time.process_time() - c2)
    if len(graphs) > 1:
        notes.append(f"{len(graphs)} graphs (graph breaks)")
    return builder.build(level="aten", method="aot", device=host, graphs=len(graphs), notes=notes,
                         duration_s=time.monotonic() - t0)


class _null_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _leaves(v: Any) -> list[Any]:
    if isinstance(v, (list, tuple)):
        return [y for x in v for y in _leaves(x)]
    if isinstance(v, dict):
        return [y for x in v.values() for y in _leaves(x)]
    return [v]


def dynamo_op_name(node: torch.fx.Node) -> str | None:
    """An importable name for a Dynamo-level call: `torch.nn.functional.silu`, `torch.Tensor.view`, `operator.add`."""
    if node.op == "call_method":
        return f"torch.Tensor.{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target}.default"
    module = getattr(target, "__module__", None)
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if module is None and qual is not None:
        # builtins of C modules (torch._C._nn.linear …) have no __module__; find them in torch's namespaces
        for prefix, namespace in (("torch._C._nn", torch._C._nn), ("torch._C._fft", torch._C._fft),
                                  ("torch._C._linalg", torch._C._linalg), ("torch._C._special", torch._C._special),
                                  ("torch", torch)):
            if getattr(namespace, qual, None) is target:
                return f"{prefix}.{qual}"
        return None
    if module in ("_operator",):
        module = "operator"
    if qual is not None and qual.startswith("_VariableFunctionsClass."):  # torch.arange, torch.cat …
        module, qual = "torch", qual.split(".", 1)[1]
    if module is None or qual is None or "<" in qual:
        return None
    return f"{module}.{qual}"


def trace_dynamo(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Inventory:
    """`dynamo`: the torch-level FX graphs a plain torch.compile backend receives (meta model, recording backend)."""
    t0 = time.monotonic()
    root_class = type(model).__name__
    if not _is_meta_model(model):
        model = copy.deepcopy(model).to("meta")
    args, kwargs = _to_meta(args), _to_meta(kwargs)
    graphs: list[torch.fx.GraphModule] = []

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        with torch.no_grad():
            torch.compile(model, backend=record, dynamic=False)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    builder = _Builder()
    notes: list[str] = []
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op not in ("call_function", "call_method"):
                continue
            name = dynamo_op_name(node)
            if name is None:
                continue
            args_enc, kwargs_enc = _encode_node_args(node, "example_value")
            out = node.meta.get("example_value")
            touches_tensor = any(True for _ in tensor_specs([args_enc, kwargs_enc])) or any(
                isinstance(x, torch.Tensor) for x in _leaves(out))
            if not touches_tensor:  # grad-mode switches, python arithmetic on sizes …
                continue
            builder.add(name, args_enc, kwargs_enc, site_from_node(node, root_class))
    if len(graphs) > 1:
        notes.append(f"{len(graphs)} graphs (graph breaks)")
    return builder.build(level="dynamo", method="dynamo", device="meta", graphs=len(graphs), notes=notes,
                         duration_s=time.monotonic() - t0)


def trace_dispatch(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, device: str = "meta") -> Inventory:
    """`dispatch`: the ATen ops an eager device receives, from a TorchDispatchMode over a fake forward.

    A meta model runs as fake tensors on `device`'s host kind (meta for out-of-tree devices, whose attention
    falls back to the math path as on such devices); a real model runs as it is.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    t0 = time.monotonic()
    root_class = type(model).__name__
    model, args, kwargs, device, fake_mode = _traceable(model, args, kwargs, device)
    builder = _Builder()
    stack: list[tuple[str, str]] = []
    skip_dirs = (str(Path(torch.__file__).parent), PACKAGE_DIR)

    def src() -> str | None:
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if not fn.startswith(skip_dirs) and not fn.endswith("contextlib.py"):
                return f"{short_path(fn)}:{f.f_lineno} in {f.f_code.co_name}"
            f = f.f_back  # type: ignore[assignment]
        return None

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, a: tuple[Any, ...] = (), kw: dict[str, Any] | None = None) -> Any:
            kw = kw or {}
            out = func(*a, **kw)
            name = str(func)
            if name not in SKIP_OPS and not name.startswith("prim."):
                module, cls = stack[-1] if stack else ("", root_class)
                builder.add(name, [encode_arg(x) for x in a], {k: encode_arg(v) for k, v in kw.items()},
                            CallSite(module=module, module_class=cls if module else root_class, source=src()),
                            imports=op_imports(func))
            return out

    def pre(info: Any, a: Any, kw: Any) -> None:
        stack.append((info.name, info.module_class))

    def post(info: Any, a: Any, kw: Any, out: Any) -> None:
        if stack:
            stack.pop()

    with torch.no_grad(), fake_mode, ModuleCapture(model, pre=pre, post=post), Recorder():
        model(*args, **kwargs)
    return builder.build(level="dispatch", method="dispatch", device=device, duration_s=time.monotonic() - t0)


def take_inventory(model: nn.Module, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                   level: str = "aten", device: str = "cpu", timings: dict[str, float] | None = None) -> Inventory:
    """The inventory of `model(*args, **kwargs)` at `level`, for a backend whose tensors live on `device`.

    Tries the level's primary tracer, then its fallbacks (recorded in `Inventory.notes`); raises
    `InventoryError` naming each tracer's error and the source line it came from when none works. `timings`
    gets the aot capture's CPU seconds per part (`trace_aot`).
    """
    if level not in LEVELS:
        raise InventoryError(f"unknown IR level {level!r}", hint=f"use one of: {', '.join(LEVELS)}")
    args_t, kwargs_d = tuple(args), dict(kwargs or {})
    attempts: list[tuple[str, Callable[[], Inventory]]]
    if level == "aten":
        attempts = [("dynamo+aot_autograd capture",
                     lambda: trace_aot(model, args_t, kwargs_d, device=device, timings=timings)),
                    ("torch.export", lambda: trace_export(model, args_t, kwargs_d, level=level, device=device))]
    elif level == "core_aten":
        attempts = [("torch.export", lambda: trace_export(model, args_t, kwargs_d, level=level, device=device))]
    elif level == "dynamo":
        attempts = [("dynamo capture", lambda: trace_dynamo(model, args_t, kwargs_d))]
    else:
        attempts = [("dispatch trace", lambda: trace_dispatch(model, args_t, kwargs_d, device=device))]
    failures: list[str] = []
    for what, fn in attempts:
        try:
            with transformers_checks_off():
                inv = fn()
        except Exception as exc:  # any tracer failure is data for the next attempt and for the report
            failures.append(f"{what} failed at {where_failed(exc)}: {type(exc).__name__}: {error_summary(exc)}")
            if model_code_error(exc):
                failures.append("no other tracer tried: it runs the same model code with the same inputs")
                break
            if fake_tensor_error(exc):
                failures.append("no other tracer tried: it runs the same code on the same fake tensors")
                break
            continue
        inv.notes[:0] = [f"fallback after: {f}" for f in failures]
        resolve_sites(inv, model)
        return inv
    raise InventoryError(
        f"the model could not be traced for its op inventory (level {level}): " + "; ".join(failures),
        hint="fix the trace error at that source line, or choose another `ir` level for this backend",
    )


def resolve_sites(inv: Inventory, model: nn.Module) -> None:
    """Make every call site's module a name `model.get_submodule` resolves (`models.resolve_module_name`): no
    tracer prefixes (`L.args.0.`), and the full path for a frame that started inside a nested model."""
    names = module_names(model)
    memo: dict[tuple[str, str], str] = {}
    for sig in inv.signatures:
        fixed = []
        for site in sig.sites:
            key = (site.module, site.module_class)
            if key not in memo:
                memo[key] = site.module if not site.module else (
                    resolve_module_name(site.module, names, site.module_class) or site.module)
            fixed.append(site if memo[key] == site.module else replace(site, module=memo[key]))
        sig.sites = fixed



__all__ = [
    "LEVELS", "InventoryError", "take_inventory", "trace_export", "trace_aot", "trace_dynamo", "trace_dispatch",
    "cia_decompositions", "used_outputs", "op_imports",
]


# --------------------------------------------------------------------------------------------- graphs of a workload

def inventory_of_graphs(graphs: Sequence[torch.fx.GraphModule], root_class: str, **build: Any) -> Inventory:
    """The ATen inventory of graphs a backend was given (e.g. every call of a phase, `modes/ops/phases.py`)."""
    builder = _Builder()
    notes: list[str] = []
    for gm in graphs:
        add_aten_graph(builder, gm, root_class, notes)
    return builder.build(notes=notes, graphs=len(graphs), **build)
