"""`simdev`: an eager out-of-tree device, registered through PrivateUse1 from Python.

It behaves like a real device plugin that is still missing kernels:

* `torch.utils.backend_registration._setup_privateuseone_for_python_backend(rename="simdev")` renames
  PrivateUse1 to `simdev` and installs dummy hooks, device guard and `torch.simdev` module; then a
  `torch.library.Library("aten", "IMPL")` registers Python kernels on the `PrivateUse1` key for a SUBSET of ATen
  ops. A simdev tensor is a storage-less PrivateUse1 tensor (`torch._C._acc.create_empty_tensor`) of class
  `SimdevTensor` holding a contiguous CPU tensor; each kernel runs the same ATen overload on the CPU data and wraps
  the result. Each supported op is therefore bit-identical to the same op on CPU. A whole model may still differ
  slightly from CPU eager where PyTorch picks another kernel for a non-CPU device: `scaled_dot_product_attention`
  takes the math path here (simdev has no fused attention) instead of CPU flash attention (~1e-7 on tiny Llama).
* `model.to("simdev")`, `tensor.to("simdev")`, `.cpu()` and `.item()` work (`_copy_from`, `empty_strided`,
  `_local_scalar_dense` …).
* An op without a simdev kernel fails with PyTorch's own dispatcher error. Measured with torch 2.13::

      NotImplementedError: Could not run 'aten::rsqrt.out' with arguments from the 'simdev' backend. This could be
      because the operator doesn't exist for this backend, ...

  The message names the RENAMED backend (`'simdev'`, not `'PrivateUse1'`). For structured (mostly pointwise) ops
  the functional overload falls through to PyTorch's generic kernel, which calls the `.out` overload, so the error
  names `aten::<op>.out` (e.g. `aten::rsqrt.out`, `aten::_softmax.out`); other ops are named as called.
* Mixing a simdev tensor with a non-scalar CPU tensor raises PyTorch's usual
  "Expected all tensors to be on the same device, but found at least two devices, simdev:0 and cpu!".

Options (`backend_options` of a `device: simdev` backend, or `register(**options)`):

* `allow`: the op set, replacing the default (overload names like `aten.add.Tensor`, packet names like `add`, or
  `"*"` for the whole catalogue);
* `extra_allow`: ops added to it (any ATen overload works: the generic kernel runs it on CPU);
* `capacity_mb`: the device's memory in MiB (2^20 bytes); an allocation past it raises `torch.OutOfMemoryError`
  (`simalloc.py`: the allocator and its statistics, kept for every simdev tensor with or without a capacity);
* `deny`: ops removed from it. By default `aten::rsqrt` and `aten::_softmax` are denied, so a tiny Llama moves to
  the device, embeds, and fails at its first RMSNorm with "Could not run 'aten::rsqrt.out' ...".

Limits: views of non-contiguous results are copies (writes through a transposed view do not reach its base);
no autograd kernels beyond what PyTorch derives; one registration per process, re-registering with other options
replaces the kernel set.
"""

from __future__ import annotations

import fnmatch
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import torch
import torch.utils.backend_registration
from torch.nn.attention import SDPBackend
from torch.utils._pytree import tree_map

from ..models.torchcompat import available, require
from . import simalloc

DEVICE = "simdev"

# Ops simdev implements (overload names, `aten.` omitted). Chosen to run the tiny example transformers (Llama,
# Granite, Mixtral, Bamba, ViT, Llava, MiniLM) in eager mode, once `rsqrt` and `_softmax` are allowed.
CATALOGUE: tuple[str, ...] = (
    # memory, factories, conversion
    "empty.memory_format", "empty_strided", "empty_like", "zeros_like", "ones_like", "full_like", "zeros",
    "ones", "full", "scalar_tensor", "arange", "arange.start", "arange.start_step", "clone", "fill_.Scalar",
    "fill_.Tensor", "zero_", "detach", "alias", "lift_fresh", "masked_fill_.Scalar",
    "masked_fill.Scalar", "masked_fill.Tensor", "masked_fill_.Tensor", "resolve_conj", "resolve_neg",
    # views and shape
    "view", "_unsafe_view", "_reshape_alias", "as_strided", "expand", "transpose.int", "t", "permute",
    "unsqueeze", "squeeze", "squeeze.dim", "squeeze.dims", "slice.Tensor", "select.int", "split.Tensor",
    "split_with_sizes", "unbind.int", "narrow", "cat", "stack", "repeat", "flip", "roll", "tril", "triu",
    "diagonal", "unfold", "view_as_real", "view_as_complex", "_unsafe_index.Tensor",
    # indexing
    "embedding", "index_select", "index.Tensor", "gather", "scatter.src", "scatter_add", "index_put",
    "index_put_", "index_add", "masked_scatter", "where.self", "where.ScalarOther", "where.ScalarSelf", "topk",
    "sort", "argsort", "histc", "one_hot", "nonzero",
    # arithmetic
    "add.Tensor", "add.Scalar", "add_.Tensor", "sub.Tensor", "sub.Scalar", "rsub.Scalar", "rsub.Tensor",
    "mul.Tensor", "mul.Scalar", "mul_.Tensor", "mul_.Scalar", "div.Tensor", "div.Scalar", "div.Tensor_mode",
    "div_.Tensor", "floor_divide", "remainder.Scalar", "remainder.Tensor", "neg", "abs", "pow.Tensor_Scalar",
    "pow.Tensor_Tensor", "pow.Scalar", "sqrt", "rsqrt", "exp", "log", "log1p", "expm1", "reciprocal", "sign",
    "clamp", "clamp.Tensor", "clamp_min", "clamp_max", "minimum", "maximum", "sin", "cos", "tanh", "sigmoid",
    "erf", "softplus", "silu", "gelu", "relu", "_softmax", "_safe_softmax", "_log_softmax", "cumsum", "cumprod",
    # reductions
    "sum", "sum.dim_IntList", "mean", "mean.dim", "amax", "amin", "max", "max.dim", "min", "min.dim",
    "argmax", "argmin", "var.correction", "std.correction", "prod", "any", "any.dim", "all", "all.dim",
    "linalg_vector_norm",
    # comparison and logic
    "eq.Tensor", "eq.Scalar", "ne.Tensor", "ne.Scalar", "lt.Tensor", "lt.Scalar", "le.Tensor", "le.Scalar",
    "gt.Tensor", "gt.Scalar", "ge.Tensor", "ge.Scalar", "logical_and", "logical_or", "logical_not",
    "bitwise_and.Tensor", "bitwise_or.Tensor", "bitwise_not", "isinf", "isnan", "isfinite", "isneginf", "isposinf", "logical_xor", "bitwise_xor.Tensor", "bitwise_and.Scalar",
    # linear algebra and NN
    "mm", "addmm", "bmm", "baddbmm", "dot", "native_layer_norm", "convolution", "constant_pad_nd",
    "_fused_sdp_choice", "native_dropout", "_grouped_mm",
)
# Denied unless named in `allow`/`extra_allow` (naming `_softmax` also re-enables `_safe_softmax`, which
# `scaled_dot_product_attention`'s math path calls).
DEFAULT_DENY: Mapping[str, tuple[str, ...]] = {"rsqrt": ("rsqrt",), "_softmax": ("_softmax", "_safe_softmax")}

_lock = threading.RLock()
_state: dict[str, Any] = {"setup": False, "lib": None, "ops": frozenset()}


class SimdevTensor(torch.Tensor):
    """A simdev tensor: PrivateUse1 metadata outside, a contiguous CPU tensor (`_raw`) inside."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # no subclass re-wrapping of results
    _raw: torch.Tensor

    def __repr__(self) -> str:  # printing must not need device kernels
        return f"SimdevTensor(device='{DEVICE}:0', {self._raw!r})"

    __str__ = __repr__


def _wrap(raw: torch.Tensor, view: bool = False) -> SimdevTensor:
    raw = raw.contiguous()
    # counted (and refused over the capacity) before the device tensor exists; a view op's result is a view on a
    # real device, so the copy simdev makes of a non-contiguous view is not counted (simalloc.py)
    simalloc.admit(raw, count=not view)
    t = torch._C._acc.create_empty_tensor(list(raw.shape), raw.dtype)
    t.__class__ = SimdevTensor
    t._raw = raw
    return t  # type: ignore[return-value]


def _raw_of(t: torch.Tensor) -> torch.Tensor:
    raw = getattr(t, "_raw", None)
    if raw is None:  # a PrivateUse1 tensor made by a composite kernel we did not intercept
        raise RuntimeError(f"[simdev] internal: tensor of shape {tuple(t.shape)} has no data (made outside simdev)")
    return raw


def _is_device_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE


def _check_same_device(args: Iterable[Any]) -> None:
    for x in args:
        if isinstance(x, torch.Tensor) and x.device.type != DEVICE and x.dim() > 0:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"{DEVICE}:0 and {x.device}!"
            )


def _fake_internal(args: Iterable[Any]) -> bool:
    """Is this call a FakeTensor's own construction over a simdev tensor (every tensor argument a data-less meta
    tensor that carries simdev's dispatch keys)?"""
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(x.device.type == "meta" and getattr(x, "_raw", None) is None for x in tensors)


def _fake_kernel(op: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A FakeTensor over a simdev tensor (Dynamo's tracing, DTensor's sharding propagation) is built by
    `Tensor._make_subclass(..., device_for_backend_keys=simdev)`, which detaches a meta tensor carrying simdev's
    keys: the dispatcher sends that `aten::detach` here. A device written in C++ answers with its composite kernel
    and no Python object; a Python kernel's result has one, and the constructor accepts it only when it is a
    FakeTensor (else "the raw Tensor object is already associated to a python object of type Tensor"). So: the
    composite (else the meta) kernel, its result typed FakeTensor for the constructor to adopt. Measured, torch
    2.13: without this, any torch.compile on simdev and any DTensor on a simdev mesh fail with "Expected all
    tensors to be on the same device, but found at least two devices, simdev:0 and meta!"."""
    from torch._subclasses.fake_tensor import FakeTensor  # deferred: only when something is traced on simdev

    name = op.name()
    key = (torch._C.DispatchKey.CompositeExplicitAutograd
           if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd") else torch._C.DispatchKey.Meta)
    out = op._op_dk(key, *args, **kwargs)
    if isinstance(out, torch.Tensor) and type(out) is torch.Tensor:
        out.__class__ = FakeTensor
    return out


def _kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    schema = op._schema
    first = schema.arguments[0] if schema.arguments else None
    inplace = bool(first is not None and first.alias_info is not None and first.alias_info.is_write)
    view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        flat_in = [*args, *kwargs.values()]
        nested = [y for x in flat_in if isinstance(x, (list, tuple)) for y in x]
        if _fake_internal([*flat_in, *nested]):
            return _fake_kernel(op, args, kwargs)
        _check_same_device([*flat_in, *nested])
        if "device" in kwargs and kwargs["device"] is not None:
            kwargs["device"] = torch.device("cpu")
        unwrap = lambda x: _raw_of(x) if _is_device_tensor(x) else x  # noqa: E731
        out = op(*tree_map(unwrap, list(args)), **tree_map(unwrap, kwargs))
        if inplace:
            return args[0]
        return tree_map(lambda r: _wrap(r, view) if isinstance(r, torch.Tensor) else r, out)

    kernel.__name__ = f"simdev_{op._schema.name.split('::')[-1]}_{op._overloadname}"
    return kernel


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    data = _raw_of(src) if _is_device_tensor(src) else src
    if _is_device_tensor(dst):
        raw = getattr(dst, "_raw", None)
        if raw is None:  # a fresh `empty_strided` from a composite kernel
            dst.__class__ = SimdevTensor
            fresh = torch.empty(tuple(dst.shape), dtype=dst.dtype)
            simalloc.admit(fresh)
            dst._raw = fresh  # type: ignore[attr-defined]
            raw = dst._raw  # type: ignore[attr-defined]
        raw.copy_(data)
    else:
        dst.copy_(data)
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    if _is_device_tensor(dst):
        raise RuntimeError("[simdev] resizing copy into a simdev tensor is not supported")
    dst.resize_(src.shape)
    return _copy_from(src, dst)


def _local_scalar_dense(t: torch.Tensor) -> Any:
    return _raw_of(t).item()


def _fused_sdp_choice(*args: Any, **kwargs: Any) -> int:
    """simdev has no fused attention: `scaled_dot_product_attention` takes PyTorch's math path (bmm, _softmax…)."""
    return int(SDPBackend.MATH.value)


def _histc(self: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    """Integer inputs as an accelerator allows them (the CPU kernel only takes floats)."""
    raw = _raw_of(self)
    out = torch.histc(raw if raw.is_floating_point() else raw.double(), bins=bins, min=min, max=max)
    return _wrap(out.to(raw.dtype))


_SPECIAL: dict[str, Callable[..., Any]] = {"_fused_sdp_choice": _fused_sdp_choice, "histc": _histc}


def _overload(name: str) -> torch._ops.OpOverload | None:
    packet, _, overload = name.removeprefix("aten.").removeprefix("aten::").partition(".")
    pkt = getattr(torch.ops.aten, packet, None)
    if pkt is None:
        return None
    return getattr(pkt, overload or "default", None)


def _normalise(name: str) -> str:
    name = name.removeprefix("aten::").removeprefix("aten.")
    return name[: -len(".default")] if name.endswith(".default") else name


def _matches(name: str, patterns: Iterable[str]) -> bool:
    packet = name.partition(".")[0]
    for p in patterns:
        p = _normalise(p)
        if fnmatch.fnmatchcase(name, p) or ("." not in p and fnmatch.fnmatchcase(packet, p)):
            return True
    return False


def _resolve(patterns: Iterable[str], catalogue: list[str]) -> list[str]:
    out: list[str] = []
    for p in patterns:
        n = _normalise(p)
        matched = [c for c in catalogue if _matches(c, [n])]
        if matched:
            out += [m for m in matched if m not in out]
        elif "*" not in n:  # an ATen op outside the catalogue: the generic kernel runs it on CPU
            if _overload(n) is None:
                raise ValueError(f"simdev: {p!r} is not an ATen operator overload")
            if n not in out:
                out.append(n)
    return out


def op_set(
    allow: Iterable[str] | None = None, extra_allow: Iterable[str] = (), deny: Iterable[str] | None = None
) -> frozenset[str]:
    """The overloads (without `aten.`) simdev registers for these options; ValueError for an unknown op name."""
    catalogue = list(CATALOGUE)
    allow = None if allow is None else list(allow)
    extra_allow = list(extra_allow)
    chosen = list(catalogue) if allow is None else _resolve(allow, catalogue)
    chosen += [n for n in _resolve(extra_allow, catalogue) if n not in chosen]
    if deny is None:  # an op named in allow/extra_allow overrides the DEFAULT deny list (not an explicit one)
        named = {_normalise(a).partition(".")[0] for a in [*(allow or ()), *extra_allow] if "*" not in a}
        denied = [d for key, group in DEFAULT_DENY.items() if key not in named for d in group]
    else:
        denied = list(deny)
    return frozenset(n for n in chosen if not _matches(n, denied))


def supported() -> bool:
    """Whether this torch can set up simdev (torch ≥ 2.10)."""
    return available("simdev")


def is_registered() -> bool:
    return bool(_state["setup"])


def registered_ops() -> frozenset[str]:
    """The overloads that currently have a simdev kernel (`aten.` omitted)."""
    return frozenset(_state["ops"])


def register(
    allow: Iterable[str] | None = None,
    extra_allow: Iterable[str] = (),
    deny: Iterable[str] | None = None,
) -> frozenset[str]:
    """Set up the `simdev` device (idempotent) and (re)register its kernels; returns the op set.

    Raises RuntimeError if PrivateUse1 is already taken by another backend name in this process, ValueError
    for an op name that is not an ATen overload, and TorchTooOldError on a torch that cannot register a device
    from Python (before 2.10: `ci_runner.models.torchcompat`).
    """
    require("simdev")
    ops = op_set(allow, extra_allow, deny)
    with _lock:
        current = torch._C._get_privateuse1_backend_name()
        if not _state["setup"]:
            if current not in ("privateuseone", DEVICE):
                raise RuntimeError(
                    f"PrivateUse1 is already registered as {current!r} in this process; simdev needs it"
                )
            if current != DEVICE:
                torch.utils.backend_registration._setup_privateuseone_for_python_backend(rename=DEVICE)
            # AOTAutograd's first-call check of custom ops' aliasing (a lint) defers to any tensor subclass it does not
            # know, so every op of a compiled graph on simdev's tensors (a Python subclass) failed with "Multiple
            # dispatch failed for 'aten.mul.Tensor'; all __torch_dispatch__ handlers returned NotImplemented"
            import torch._functorch.config as functorch_config  # deferred: as torch.compile's own

            functorch_config.check_custom_op_aliasing = False
            _state["setup"] = True
        if _state["lib"] is not None and _state["ops"] == ops:
            return ops
        resolved: list[tuple[str, torch._ops.OpOverload]] = []
        for name in sorted(ops):
            overload = _overload(name)
            if overload is None:
                raise ValueError(f"simdev: {name!r} is not an ATen operator overload")
            resolved.append((name, overload))
        if _state["lib"] is not None:
            _state["lib"]._destroy()
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        lib.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        lib.impl("_local_scalar_dense", _local_scalar_dense, "PrivateUse1")
        for name, overload in resolved:
            lib.impl(name, _SPECIAL.get(name) or _kernel(overload), "PrivateUse1")
        _state["lib"] = lib
        _state["ops"] = ops
        return ops


def register_from_options(options: Mapping[str, Any]) -> frozenset[str]:
    """`register()` from a backend's `backend_options` (`allow`, `extra_allow`, `deny`, `capacity_mb`)."""
    unknown = set(options) - {"allow", "extra_allow", "deny", "capacity_mb"}
    if unknown:
        raise ValueError(f"simdev: unknown option(s) {sorted(unknown)}; known: allow, extra_allow, deny, capacity_mb")
    cap = options.get("capacity_mb")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
        raise ValueError(f"simdev: capacity_mb {cap!r} is not a positive number of MiB")
    simalloc.set_capacity(None if cap is None else int(float(cap) * 2**20))
    allow = options.get("allow")
    if isinstance(allow, str):
        allow = [allow]
    extra = options.get("extra_allow") or ()
    deny = options.get("deny")
    return register(
        allow=allow, extra_allow=[extra] if isinstance(extra, str) else extra,
        deny=[deny] if isinstance(deny, str) else deny,
    )
