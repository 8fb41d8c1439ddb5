"""The self-test torch.compile backends: real `aot_autograd` backends that fail on purpose, deterministically.

Each one is built by `make_<name>(**options)` and returns what `torch.compile(backend=...)` takes. They all see the
graph after `aot_autograd` (ATen overloads such as `aten.rsqrt.default`, inference graphs under `no_grad`), run it
with the eager ATen kernels (like `aot_eager`), and differ in the one thing they do wrong:

* `sim-subset` raises `SimCompilerError` at COMPILE time on the first op outside its allowlist;
* `sim-drift` computes the chosen ops in reduced precision;
* `sim-crash` / `sim-abort` / `sim-segv` / `sim-hang` compile fine and fault at RUN time, when the chosen op runs;
* `sim-slow` is correct and slow to compile: each graph costs `seconds` of busy CPU time.

Op selectors (`allow`, `extra_allow`, `op`) are lists of patterns matched with `fnmatch` against an op's overload
name (`aten.rsqrt.default`), packet name (`aten.rsqrt`) and, for `aten`, the bare names (`rsqrt`, `rsqrt.default`),
or one of the aliases `attention` and `norm` (see ATTENTION_OPS, NORM_OPS).
"""

from __future__ import annotations

import ctypes
import fnmatch
import operator
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

# What the attention of the tiny Llama/Granite/Mixtral/Bamba/ViT/MiniLM models lowers to under aot_autograd on CPU
# (transformers' default `sdpa` attention): aten._scaled_dot_product_flash_attention_for_cpu.default. The other
# members cover CUDA and the math path.
ATTENTION_OPS: tuple[str, ...] = (
    "aten._scaled_dot_product_flash_attention_for_cpu.*",
    "aten._scaled_dot_product_flash_attention.*",
    "aten._scaled_dot_product_efficient_attention.*",
    "aten._scaled_dot_product_cudnn_attention.*",
    "aten._scaled_dot_product_fused_attention_overrideable.*",
    "aten._scaled_dot_product_attention_math.*",
    "aten.scaled_dot_product_attention.*",
    # SDPA's math path inlined before the compiler sees it (only SDPA calls `_safe_softmax`): torch 2.7 lowers a
    # lone Llama attention layer (GQA, explicit mask) to it on CPU, where torch 2.13 takes the flash kernel.
    "aten._safe_softmax.*",
)
# RMSNorm (Llama, Granite, Mixtral, Bamba) computes `x * rsqrt(mean(x²) + eps)`; LayerNorm (ViT, BERT) lowers to
# native_layer_norm; torch's own nn.RMSNorm may lower to _fused_rms_norm.
NORM_OPS: tuple[str, ...] = (
    "aten.rsqrt.default",
    "aten.native_layer_norm.default",
    "aten._fused_rms_norm.default",
)
ALIASES: Mapping[str, tuple[str, ...]] = {"attention": ATTENTION_OPS, "norm": NORM_OPS}

# The default sim-subset allowlist: what a transformer-only accelerator compiler supports. Packet names in `aten`.
# Linear algebra, pointwise arithmetic and activations, norms, softmax and fused attention, reductions, embedding
# and indexing, shape/memory ops, comparisons. NOT in it (so models using them fail): convolution,
# constant_pad_nd, softplus, exp, log, cumsum, topk, sort, histc, index_put, scatter, masked_scatter, floor_divide,
# remainder and any non-aten custom op. With the example models and inputs: Llama, Granite and MiniLM compile; ViT
# and the Llava vision tower stop at `aten.convolution.default`, Mixtral at its router's `aten.topk.default`, Bamba
# in its mamba mixer. (Called WITHOUT an attention mask, transformers' mask code adds `aten.cumsum.default`, so even
# Llama stops there; build_inputs always passes a mask.)
TRANSFORMER_OPS: tuple[str, ...] = (
    # linear algebra
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "t", "dot",
    # pointwise
    "add", "sub", "rsub", "mul", "div", "neg", "pow", "sqrt", "rsqrt", "reciprocal", "abs", "clamp", "clamp_min",
    "clamp_max", "minimum", "maximum", "where", "masked_fill", "sin", "cos", "tanh", "sigmoid", "silu", "gelu",
    "relu", "erf",
    # norms, softmax, attention
    "_softmax", "softmax", "_safe_softmax", "_log_softmax", "native_layer_norm", "layer_norm", "_fused_rms_norm",
    "rms_norm", "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
    # reductions
    "sum", "mean", "amax", "amin", "max", "min", "argmax", "var", "std",
    # embedding and indexing
    "embedding", "index", "index_select", "gather", "slice", "select", "narrow",
    # shape and memory
    "view", "_unsafe_view", "reshape", "_reshape_alias", "expand", "permute", "transpose", "unsqueeze", "squeeze",
    "cat", "stack", "split", "split_with_sizes", "unbind", "chunk", "clone", "contiguous", "alias", "detach",
    "copy", "copy_", "_to_copy", "to", "lift_fresh_copy", "empty", "empty_like", "empty_strided", "zeros",
    "zeros_like", "ones", "ones_like", "full", "full_like", "new_ones", "new_zeros", "new_empty", "new_full",
    "scalar_tensor", "arange", "fill", "fill_", "zero_", "tril", "triu", "native_dropout", "dropout",
    # comparison and logic
    "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or",
    "bitwise_not", "isinf", "isnan", "isneginf", "isposinf",
    # symbolic shapes and runtime asserts (no kernels)
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "_assert_scalar", "_assert_tensor_metadata",
)


class SimCompilerError(RuntimeError):
    """The sims' compile-time error (sim-subset, sim-decode, sim-long), shaped like a vendor compiler's lowering failure.

    When it blames an op, the message contains `unsupported operator <overload>` (see `backends.UNSUPPORTED_RE`) so
    the op can be parsed out of Dynamo's wrapping `BackendCompilerFailed`; `op=None` (sim-long refusing a graph
    input) names no op: `[backend] <reason> (node <node>)`.
    """

    def __init__(self, op: str | None, node: str, backend: str = "sim-subset", reason: str | None = None) -> None:
        why = reason or "no lowering for this operator (lowering/op_registry.cpp:88)"
        if op is None:
            super().__init__(f"[{backend}] {why} (node {node})")
        else:
            super().__init__(f"[{backend}] unsupported operator {op} in node {node}: {why}")
        self.op = op
        self.node = node
        self.backend = backend


# ----------------------------------------------------------------------------------------- op names and matching

def op_name(target: Any) -> str:
    """`aten.rsqrt.default` for an OpOverload; a readable name for anything else an FX node may call."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target}.default"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module and module not in ("builtins", "_operator", "operator") else str(name)


def _candidates(name: str) -> list[str]:
    parts = name.split(".")
    out = [name]
    if len(parts) >= 3:
        out.append(".".join(parts[:-1]))  # packet: aten.rsqrt
        if parts[0] == "aten":
            out += [".".join(parts[1:]), ".".join(parts[1:-1])]  # rsqrt.default, rsqrt
    return out


def expand_patterns(patterns: str | Iterable[str] | None) -> tuple[str, ...]:
    """Patterns with aliases (`attention`, `norm`) expanded; a single string counts as one pattern."""
    if patterns is None:
        return ()
    if isinstance(patterns, str):
        patterns = [patterns]
    out: list[str] = []
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise ValueError(f"op patterns must be non-empty strings, got {p!r}")
        out.extend(ALIASES.get(p, (p,)))
    return tuple(out)


def op_matches(name: str, patterns: Sequence[str]) -> bool:
    """Whether the op `name` (overload name) matches one of `patterns` (already alias-expanded)."""
    cands = _candidates(name)
    return any(fnmatch.fnmatchcase(c, p) for p in patterns for c in cands)


_ALWAYS_ALLOWED = (operator.getitem,)


def call_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's op calls (`getitem` left out)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target not in _ALWAYS_ALLOWED]


def aot_backend(fw_compiler: Callable[[torch.fx.GraphModule, Sequence[Any]], Callable[..., Any]], name: str) -> Any:
    """An `aot_autograd` backend named `name` whose forward graphs `fw_compiler(gm, example_inputs)` turns into the
    function that runs them (every sim: the ATen graph, run with the eager kernels)."""
    from functorch.compile import make_boxed_func  # deferred: importing Dynamo/functorch takes seconds
    from torch._dynamo.backends.common import aot_autograd  # deferred: as above

    def compiler(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        fn = fw_compiler(gm, example_inputs)
        return make_boxed_func(fn)

    backend = aot_autograd(fw_compiler=compiler)
    backend.__name__ = name  # what Dynamo prints in `backend='…' raised`
    return backend


# ----------------------------------------------------------------------------------------- sim-subset

def make_subset(*, allow: Iterable[str] | None = None, extra_allow: Iterable[str] = ()) -> Any:
    """sim-subset: a compiler that supports only an op allowlist (default TRANSFORMER_OPS)."""
    patterns = expand_patterns(TRANSFORMER_OPS if allow is None else allow) + expand_patterns(extra_allow)

    def fw(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        for node in call_nodes(gm):
            name = op_name(node.target)
            if not op_matches(name, patterns):
                raise SimCompilerError(name, node.name)
        return gm.forward

    return aot_backend(fw, "sim_subset")


# ----------------------------------------------------------------------------------------- sim-drift

class _Reduced:
    """Runs `op` with its floating inputs cast to `dtype`, results cast back to the original dtype."""

    def __init__(self, op: Any, dtype: torch.dtype) -> None:
        self.op = op
        self.dtype = dtype
        self.__name__ = f"sim_drift_{getattr(op, '__name__', 'op')}"
        self.__qualname__ = self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        orig: list[torch.dtype] = []

        def down(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                orig.append(x.dtype)
                return x.to(self.dtype)
            return x

        out = self.op(*tree_map(down, list(args)), **tree_map(down, kwargs))
        back = orig[0] if orig else None
        if back is None:
            return out
        return tree_map(lambda r: r.to(back) if isinstance(r, torch.Tensor) and r.is_floating_point() else r, out)


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
           "fp16": torch.float16, "float32": torch.float32}


def parse_dtype(value: Any) -> torch.dtype:
    """A dtype option (`bfloat16`, `float16`, `torch.float16`, a torch.dtype) as a torch.dtype; ValueError else."""
    if isinstance(value, torch.dtype):
        return value
    key = str(value).removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"dtype {value!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[key]


def make_drift(*, op: str | Iterable[str] = "norm", dtype: str = "bfloat16") -> Any:
    """sim-drift: the chosen ops (default `norm`) computed in reduced precision (default bfloat16)."""
    patterns = expand_patterns(op)
    low = parse_dtype(dtype)

    def fw(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        changed = False
        for node in call_nodes(gm):
            if op_matches(op_name(node.target), patterns):
                node.target = _Reduced(node.target, low)
                changed = True
        if changed:
            gm.recompile()
        return gm.forward

    return aot_backend(fw, "sim_drift")


# ----------------------------------------------------------------------------------------- run-time faults

CRASH_MESSAGE = "Assertion `layout.is_contiguous()` failed at lowering/attention.cpp:214"


class _Fault:
    """Replaces one graph node: when it runs, fails the way `kind` says."""

    def __init__(self, kind: str, op: str, node: str, seconds: float | None) -> None:
        self.kind = kind
        self.op = op
        self.node = node
        self.seconds = seconds
        self.__name__ = f"sim_{kind}_{node}"
        self.__qualname__ = self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        where = f"while executing {self.op} (node {self.node})"
        if self.kind == "crash":
            raise RuntimeError(f"[sim-crash] {CRASH_MESSAGE}: {where}")
        if self.kind == "abort":
            sys.stderr.write(
                "terminate called after throwing an instance of 'std::runtime_error'\n"
                f"  what():  [sim-abort] device runtime lost {where}\n"
            )
            sys.stderr.flush()
            os.abort()
        if self.kind == "segv":
            sys.stderr.write(f"[sim-segv] reading address 0x0 {where}\n")
            sys.stderr.flush()
            ctypes.string_at(0)  # a real SIGSEGV
        if self.kind == "hang":
            sys.stderr.write(f"[sim-hang] waiting for a device fence that never signals, {where}\n")
            sys.stderr.flush()
            end = None if self.seconds is None else time.monotonic() + self.seconds
            while end is None or time.monotonic() < end:
                time.sleep(0.05 if end is not None else 0.5)
            raise RuntimeError(f"[sim-hang] device fence timed out after {self.seconds}s {where}")
        raise AssertionError(self.kind)


def make_fault(kind: str, *, op: str | Iterable[str] = "attention", seconds: float | None = None) -> Any:
    """sim-crash/abort/segv/hang: compile fine; fault at run time when an op matching `op` runs."""
    if kind not in ("crash", "abort", "segv", "hang"):
        raise ValueError(f"unknown fault kind {kind!r}")
    if seconds is not None and kind != "hang":
        raise ValueError("`seconds` is an option of sim-hang only")
    patterns = expand_patterns(op)

    def fw(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        changed = False
        for node in call_nodes(gm):
            name = op_name(node.target)
            if op_matches(name, patterns):
                node.target = _Fault(kind, name, node.name, seconds)
                changed = True
        if changed:
            gm.recompile()
        return gm.forward

    return aot_backend(fw, f"sim_{kind}")


# ----------------------------------------------------------------------------------------- sim-slow

def busy_cpu(seconds: float) -> float:
    """Spin on this thread until it has used `seconds` of CPU time (not wall time: on a loaded machine it takes
    longer, as a real compiler's fixed work does); returns the wall seconds it took."""
    t0, c0 = time.monotonic(), time.thread_time()
    x = 0
    while time.thread_time() - c0 < seconds:
        for i in range(2000):
            x ^= i
    return time.monotonic() - t0


def make_slow(*, seconds: float = 20.0) -> Any:
    """sim-slow: a correct backend (the graph runs with the eager ATen kernels, like `aot_eager`) whose compile of
    each graph spends `seconds` of busy CPU time first, as a slow compiler on a busy runner does."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds < 0:
        raise ValueError(f"sim-slow: `seconds` must be a number >= 0, got {seconds!r}")

    def fw(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        busy_cpu(float(seconds))
        return gm.forward

    return aot_backend(fw, "sim_slow")
