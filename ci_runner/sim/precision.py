"""`sim-precision`: a backend that computes each op class in a chosen dtype, following a precision policy or
breaking it in one documented way (the self-test of `workloads/precision.py`).

Its options name the dtype of each class; the defaults are a correct bf16 accelerator (the mixed-precision
convention: matmul-class inputs rounded to bfloat16, float32 accumulation, everything else float32):

| options | reproduces |
|---|---|
| `{}` | a correct bf16 backend (the convention): must pass under a `bfloat16` policy |
| `{softmax: bfloat16}` | softmax computed in bf16 |
| `{norm: bfloat16}` | norms (and RMSNorm's rsqrt) computed in bf16 |
| `{accumulate: bfloat16}` | matmuls accumulated in bf16 (a running sum rounded after every term) |
| `{kv_cache: float8_e4m3fn}` | the KV cache written in fp8 (per-tensor scale) |
| `{matmul: float16, overflow: 0.05, overflow_in: mlp.down_proj}` | an fp16 matmul whose outputs saturate in one layer: an output above `overflow` in magnitude becomes ±inf, as an fp16 output register past its range would (the threshold is low so tiny models reach it; `overflow_in` limits it to the matmuls of modules whose path contains that text) |

Ops run with PyTorch's CPU kernels on rounded inputs, so a graph the backend accepts runs everywhere.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_map

from ..workloads.rounding import MATMUL_LIKE, op_class, round_to, rounded_inputs, rounded_outputs
from .compilers import aot_backend, call_nodes

CLASSES = ("matmul", "conv", "attention", "accumulate", "softmax", "norm", "reduction", "elementwise", "kv_cache")
_SEQUENTIAL = frozenset({"mm", "addmm", "bmm", "baddbmm"})


def _bf16_accumulated_mm(a: torch.Tensor, b: torch.Tensor, dtype: str) -> torch.Tensor:
    """a @ b with the running sum over K rounded to `dtype` after every term (batched over leading dims)."""
    acc = torch.zeros(*a.shape[:-1], b.shape[-1], dtype=a.dtype)
    for k in range(a.shape[-1]):
        acc = round_to(acc + a[..., k:k + 1] * b[..., k:k + 1, :], dtype)
    return acc


def _attention_low_softmax(args: list[Any], kwargs: dict[str, Any], dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused CPU attention (`_scaled_dot_product_flash_attention_for_cpu`: q, k, v, dropout_p, is_causal, *,
    attn_mask, scale) with its softmax computed in `dtype`: (output, logsumexp)."""
    q, k, v = args[0], args[1], args[2]
    is_causal = bool(args[4]) if len(args) > 4 else bool(kwargs.get("is_causal", False))
    mask, scale = kwargs.get("attn_mask"), kwargs.get("scale")
    if k.shape[-3] != q.shape[-3]:  # grouped-query attention: each k/v head serves several q heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = round_to(torch.softmax(round_to(s, dtype), dim=-1), dtype)
    out = (p @ v).transpose(-3, -2).contiguous().transpose(-3, -2)  # the fused op's layout: (B, L, H, E) in memory
    return out, torch.logsumexp(s, dim=-1)


class _Node:
    """One graph node run the way the options say."""

    def __init__(self, op: Any, cls: str, opts: dict[str, Any]) -> None:
        self.op, self.cls, self.opts = op, cls, opts
        self.__name__ = f"sim_precision_{getattr(op, '__name__', 'op')}"
        self.__qualname__ = self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dt = self.opts.get(self.cls, "float32")
        args, kwargs = rounded_inputs(self.cls, dt, self.__name__, args, kwargs)
        if self.cls == "kv_cache":
            return self.op(*args, **kwargs)
        if self.cls == "attention" and self.opts.get("softmax", "float32") != "float32":
            return _attention_low_softmax(args, kwargs, self.opts["softmax"])
        acc = self.opts.get("accumulate", "float32")
        name = getattr(self.op, "__name__", "").split(".")[0]
        if self.cls == "matmul" and acc != "float32" and name in _SEQUENTIAL:
            out = self._accumulated(name, args, acc)
        else:
            out = self.op(*args, **kwargs)
        out = rounded_outputs(self.cls, dt, out)
        limit = self.opts.get("overflow")
        if limit and self.cls in MATMUL_LIKE:
            out = tree_map(lambda x: torch.where(x.abs() > float(limit), x.sign() * torch.inf, x)
                           if isinstance(x, torch.Tensor) and x.is_floating_point() else x, out)
        return out

    def _accumulated(self, name: str, args: list[Any], acc: str) -> torch.Tensor:
        if name in ("mm", "bmm"):
            return _bf16_accumulated_mm(args[0], args[1], acc)
        bias, a, b = args[0], args[1], args[2]  # addmm / baddbmm: bias + a @ b
        return round_to(bias + _bf16_accumulated_mm(a, b, acc), acc)


def make_precision(*, matmul: str = "bfloat16", conv: str | None = None, attention: str | None = None,
                   accumulate: str = "float32", softmax: str = "float32", norm: str = "float32",
                   reduction: str = "float32", elementwise: str = "float32", kv_cache: str = "float32",
                   overflow: float | None = None, overflow_in: str | None = None) -> Any:
    """sim-precision (see the module docstring): every class's dtype, matmul's by default for conv and attention."""
    opts: dict[str, Any] = {"matmul": matmul, "conv": conv or matmul, "attention": attention or matmul,
                            "accumulate": accumulate, "softmax": softmax, "norm": norm, "reduction": reduction,
                            "elementwise": elementwise, "kv_cache": kv_cache, "overflow": overflow,
                            "overflow_in": overflow_in}
    for key, value in opts.items():
        if key not in ("overflow", "overflow_in") and value not in ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"):
            raise ValueError(f"sim-precision: {key}={value!r} is not a dtype (float32, bfloat16, float16, "
                             f"float8_e4m3fn, float8_e5m2)")

    def fw(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        changed = False
        for node in call_nodes(gm):
            cls = op_class(node.target)
            if cls == "elementwise" and "rsqrt" in str(getattr(node.target, "__name__", "")) and norm != "float32":
                cls = "norm"  # RMSNorm's rsqrt: the norm a decomposed RMSNorm computes
            overflows = bool(overflow) and cls == "matmul" and (overflow_in is None or any(
                overflow_in in str(path) for path, _cls in (node.meta.get("nn_module_stack") or {}).values()))
            if cls is not None and (opts.get(cls, "float32") != "float32" or overflows
                                    or (cls == "attention" and softmax != "float32")):
                node.target = _Node(node.target, cls, {**opts, "overflow": overflow if overflows else None})
                changed = True
        if changed:
            gm.recompile()
        return gm.forward

    return aot_backend(fw, "sim_precision")


__all__ = ["CLASSES", "make_precision"]
