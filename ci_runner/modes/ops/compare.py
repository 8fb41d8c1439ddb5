"""The contract-aware comparison of a probe's result with CPU eager, and which results have nothing to compare.

`compare` and its helpers (`SCRIPT_FUNCTIONS`) are self-contained (torch only): their source is copied into every op repro script
(`templates/repro_op.py.j2`), so a repro judges the values exactly as the probe did.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Iterable, Mapping, Sequence

import torch

# Outputs that are random or uninitialised: run, not compared.
NO_COMPARE = ("*rand*", "*dropout*", "*bernoulli*", "*multinomial*", "*normal*", "*uniform*", "*exponential*",
              "*poisson*", "*empty*", "*geometric*", "*cauchy*", "*log_normal*", "*random_*")


def index_contract(op, inputs, outputs, n):  # type: ignore[no-untyped-def]
    """For an op whose indices promise only to select the right values (see `compare`): (the output leaves that
    are such indices, the input they index, the dim or None for flat); else (empty set, None, None)."""
    parts = str(op or "").replace("torch.Tensor.", "aten.").replace("torch.", "aten.").split(".")
    name, overload = (parts[1] if len(parts) > 1 else ""), (parts[2] if len(parts) > 2 else "default")
    with_indices = {"sort": 1, "topk": 2, "kthvalue": 2, "mode": 1, "cummax": 1, "cummin": 1}
    dim_only = {"min": 1, "max": 1, "median": 1, "nanmedian": 1}
    arg_ops = {"argsort": 1, "argmax": 1, "argmin": 1}
    inputs = list(inputs or [])
    if not (inputs and isinstance(inputs[0], torch.Tensor) and (
            name in with_indices or name in arg_ops or (name in dim_only and overload == "dim"))):
        return set(), None, None
    pos = {**with_indices, **dim_only, **arg_ops}[name]
    x = inputs[0]
    dim = inputs[pos] if len(inputs) > pos and isinstance(inputs[pos], int) else (None if name in ("argmax", "argmin") else -1)
    produced = list(outputs) if outputs is not None else list(range(n))
    return {j for j, k in enumerate(produced) if (k == 0 if name in arg_ops else k == 1)}, x, dim


def compare_selected(i, e, a, x, dim):  # type: ignore[no-untyped-def]
    """Output `i` holds indices into `x` along `dim`: None when they select the same values as CPU eager's `e`."""
    a = a.detach().to("cpu")
    if tuple(a.shape) != tuple(e.shape):
        return f"output {i}: shape {tuple(a.shape)} instead of {tuple(e.shape)}"
    src, ei, ai = x, e.long(), a.long()
    if dim is None:
        src, ei, ai = x.reshape(-1), ei.reshape(-1), ai.reshape(-1)
        d = 0
    else:
        d = dim % max(x.dim(), 1)
        if ei.dim() < x.dim():  # keepdim=False reductions
            ei, ai = ei.unsqueeze(d), ai.unsqueeze(d)
    if bool(((ai < 0) | (ai >= max(src.shape[d] if src.dim() else 1, 1))).any()):
        return f"output {i}: indices out of range"
    picked_e, picked_a = torch.gather(src, d, ei), torch.gather(src, d, ai)
    if not torch.equal(picked_e, picked_a) and not bool((torch.isnan(picked_e) & torch.isnan(picked_a)).all()):
        bad = int((picked_e != picked_a).sum())
        return f"output {i}: the indices select other values than CPU eager's ({bad} of {e.numel()})"
    return None


def compare_leaf(i, e, a, rtol, atol):  # type: ignore[no-untyped-def]
    """Output `i`: None when `a` matches CPU eager's `e` within tolerance (see `compare`), else what differs."""
    if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
        return f"output {i}: {type(a).__name__} instead of {type(e).__name__}"
    if not isinstance(e, torch.Tensor):
        if isinstance(e, (bool, int, float)) and isinstance(a, (bool, int, float)):
            fe, fa = float(e), float(a)
            if not (fe != fe and fa != fa) and abs(fe - fa) > atol * max(1.0, abs(fe)) + rtol * abs(fe):
                return f"output {i}: {a!r} instead of {e!r}"
        return None
    a = a.detach().to("cpu")
    if tuple(a.shape) != tuple(e.shape):
        return f"output {i}: shape {tuple(a.shape)} instead of {tuple(e.shape)}"
    if a.dtype != e.dtype:
        return f"output {i}: dtype {a.dtype} instead of {e.dtype}"
    if torch.equal(a, e):  # the same values, no NaN: within any tolerance (the checks below would agree)
        return None
    if not (e.dtype.is_floating_point or e.dtype.is_complex):
        bad = int((a != e).sum())
        return f"output {i}: {bad} of {e.numel()} elements differ" if bad else None
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
        return None
    scale = max(1.0, float(ref.max()))
    bad = diff > atol * scale + rtol * ref
    if bool(bad.any()):
        return (f"output {i}: {int(bad.sum())} of {e.numel()} elements beyond rtol={rtol:g} atol={atol:g}, "
                f"max_abs={float(diff.max()):.4g}")
    return None


def compare(expected, actual, rtol, atol, op=None, inputs=None, outputs=None):  # type: ignore[no-untyped-def]
    """None when `actual` matches `expected` (CPU eager) within tolerance, else what differs.

    Floats: |a - e| <= atol * max(1, max|e|) + rtol * |e| elementwise, NaN where CPU has NaN; ints and bools exact.
    Op contracts (`op`, its CPU `inputs` and the op `outputs` returned, None = all): the indices of sort, topk,
    kthvalue, mode, cummax/cummin, min/max/median.dim and argsort/argmax/argmin promise only to select the right
    values; with ties any valid order is right, so they are checked by the values they select from the input.
    """
    from torch.utils import _pytree as pytree

    exp_leaves, act_leaves = pytree.tree_leaves(expected), pytree.tree_leaves(actual)
    if len(exp_leaves) != len(act_leaves):
        return f"{len(act_leaves)} outputs instead of {len(exp_leaves)}"
    index_leaves, x, dim = index_contract(op, inputs, outputs, len(exp_leaves))
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves)):
        if i in index_leaves and isinstance(e, torch.Tensor) and isinstance(a, torch.Tensor):
            problem = compare_selected(i, e, a, x, dim)
        else:
            problem = compare_leaf(i, e, a, rtol, atol)
        if problem is not None:
            return problem
    return None


# The functions a repro script holds (their source is pasted in this order): `compare` and what it calls.
SCRIPT_FUNCTIONS = (index_contract, compare_selected, compare_leaf, compare)


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


# Ops that write through indices: when an index repeats, which write wins is unspecified.
_ORDERED_WRITES = {"scatter": 2, "scatter_": 2, "index_copy": 2, "index_copy_": 2, "index_put": 1, "index_put_": 1,
                   "_unsafe_index_put": 1, "_index_put_impl_": 1}


def no_compare_reason(op: str, inputs: Sequence[Any], kwargs: Mapping[str, Any]) -> str | None:
    """Why this call's result has nothing deterministic to compare with CPU eager (None: compare it).

    Random or uninitialised outputs (`NO_COMPARE`); writes through repeated indices (scatter without a reduce,
    index_copy, index_put without accumulate), where the surviving write is unspecified."""
    if matches_any(op, NO_COMPARE):
        return "no deterministic result (random or uninitialised output)"
    parts = op.split(".")
    name = parts[1] if len(parts) == 3 and not op.startswith("torch.") else parts[-1]
    pos = _ORDERED_WRITES.get(name)
    if pos is None or len(inputs) <= pos or kwargs.get("reduce") or "reduce" in op:
        return None
    if name.startswith(("index_put", "_unsafe_index_put", "_index_put_impl")):
        accumulate = inputs[3] if len(inputs) > 3 else kwargs.get("accumulate", False)
        idx = [t for t in (inputs[pos] or []) if isinstance(t, torch.Tensor)]
        # a bool mask selects each place once: its True places, one index tensor per dimension it covers
        idx = [c for t in idx for c in (t.nonzero().unbind(1) if t.dtype == torch.bool else (t,))]
        if accumulate or not idx:
            return None
        try:
            flat = torch.stack([t.long().reshape(-1) for t in torch.broadcast_tensors(*idx)], dim=1)
        except RuntimeError:
            return None
        repeated = flat.shape[0] != torch.unique(flat, dim=0).shape[0]
    else:
        index, dim = inputs[pos], inputs[1]
        if not isinstance(index, torch.Tensor) or not isinstance(dim, int) or index.numel() < 2:
            return None
        if index.dim() == 0:
            return None
        srt = index.sort(dim=dim % index.dim()).values
        repeated = bool((srt.narrow(dim % index.dim(), 1, srt.shape[dim % index.dim()] - 1) ==
                         srt.narrow(dim % index.dim(), 0, srt.shape[dim % index.dim()] - 1)).any())
    if repeated:
        return "writes through repeated indices: which write survives is unspecified"
    return None


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    packet = name.rsplit(".", 1)[0] if name.count(".") >= 2 else name
    bare = packet.split(".", 1)[-1]
    return any(fnmatch.fnmatchcase(c, p) for p in patterns for c in (name, packet, bare))
