"""The rounding a precision policy implies, at the ATen level (torch only): which class an op belongs to and
what rounding a tensor to a policy's dtype means (fp8 with a per-tensor scale). Shared by the policy's emulation
(`workloads/emulate.py`) and the self-test backend that follows or breaks a policy (`sim/precision.py`)."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch
from torch.utils._pytree import tree_map

# ATen op base names per class (the names a dispatch mode sees on the CPU: linear and matmul decompose to these).
OPS_BY_CLASS: Mapping[str, frozenset[str]] = {
    "matmul": frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "mv", "addmv", "dot", "vdot", "linear",
                         "_grouped_mm", "einsum"}),
    "conv": frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
                       "conv_transpose2d", "conv_transpose3d", "mkldnn_convolution"}),
    "attention": frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
                            "_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention",
                            "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention"}),
    "softmax": frozenset({"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"}),
    "norm": frozenset({"native_layer_norm", "layer_norm", "native_group_norm", "group_norm", "native_batch_norm",
                       "_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "rms_norm",
                       "_fused_rms_norm"}),
    "reduction": frozenset({"sum", "mean", "var", "std", "var_mean", "std_mean", "cumsum", "prod", "logsumexp",
                            "norm", "linalg_vector_norm"}),
    "elementwise": frozenset({"exp", "log", "pow", "rsqrt", "sqrt", "tanh", "sigmoid", "erf", "gelu", "silu",
                              "exp2", "log1p", "expm1", "reciprocal", "softplus", "sin", "cos"}),
    "kv_cache": frozenset({"index_copy_", "index_copy", "index_put_", "index_put"}),
}
_CLASS_OF: dict[str, str] = {name: cls for cls, names in OPS_BY_CLASS.items() for name in names}
MATMUL_LIKE = ("matmul", "conv", "attention")
TORCH_DTYPES: Mapping[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def op_class(op: Any) -> str | None:
    """The policy class of an ATen op (`torch.ops.aten.mm.default`, or its name `aten.mm.default`), or None."""
    name = str(getattr(op, "__name__", op))
    parts = name.split(".")
    base = parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]
    return _CLASS_OF.get(base)


def round_to(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """`t` rounded to `dtype` and back (fp8: scaled per tensor so that its amax lands on the format's max)."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or dtype == "float32" or t.dtype == torch.float64:
        return t
    low = TORCH_DTYPES[dtype]
    if t.dtype.itemsize <= low.itemsize and not dtype.startswith("float8"):
        return t
    if dtype.startswith("float8"):
        amax = float(t.detach().abs().amax()) if t.numel() else 0.0
        if not math.isfinite(amax) or amax == 0.0:
            return t
        scale = amax / float(torch.finfo(low).max)
        return ((t / scale).to(low).to(t.dtype)) * scale
    return t.to(low).to(t.dtype)


def rounded_inputs(op_class: str, dtype: str, name: str, args: Sequence[Any],
                   kwargs: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """An op's inputs as its class computed in `dtype` sees them: every floating input rounded, except for a KV-cache
    write (`index_copy*`, `index_put*`, named by `name`), which rounds only the values written, never the cache or
    the indices."""
    if op_class == "kv_cache":
        args = list(args)
        pos = 3 if "index_copy" in name else 2
        if len(args) > pos and isinstance(args[pos], torch.Tensor):
            args[pos] = round_to(args[pos], dtype)
        return args, dict(kwargs)
    down = (lambda x: round_to(x, dtype) if isinstance(x, torch.Tensor) else x)
    return tree_map(down, list(args)), tree_map(down, dict(kwargs))


def rounded_outputs(op_class: str, dtype: str, out: Any) -> Any:
    """An op's result as its class computed in `dtype` leaves it: the matmul-like classes accumulate in float32 and
    a cache write returns what it wrote, so only the other classes round their outputs too."""
    if op_class in MATMUL_LIKE or op_class == "kv_cache":
        return out
    return tree_map(lambda x: round_to(x, dtype) if isinstance(x, torch.Tensor) else x, out)


__all__ = ["MATMUL_LIKE", "OPS_BY_CLASS", "TORCH_DTYPES", "op_class", "round_to", "rounded_inputs",
           "rounded_outputs"]
