"""The known signatures of tensor-parallel bugs, measured on one module output against the single-rank reference.

`signature_facts` measures, in float64 on rank 0 (`ref`: the single-rank output; `tgt`: the sharded output,
gathered; `parts`: every rank's own copy of an output each rank should hold whole):

* `norm_ratio` ‖tgt‖/‖ref‖ and `scale` (the least-squares factor s in tgt ≈ s·ref) with `scaled_rel`, the rel error
  left after it;
* `ranks_equal` (the ranks' copies agree) and `sum_rel`, the rel error of the ranks' copies summed against `ref`;
* `permuted_rel`: the rel error after matching each last-dim column of `tgt` to its nearest column of `ref`,
  when that matching is a permutation other than the identity.

`classify` names the signature from these facts (`SIGNATURES`). What each bug gives, measured with tiny Llama
(hidden 32, 4 heads, tp 2, random weights; `tests/integration/test_parallel.py`, docs/parallel.md):

* a missing all-reduce leaves each rank its partial sum: the ranks disagree and their sum is the reference
  (sum_rel ~1e-7); against the reference, cos ≈ 0.7 and norm ratio ≈ 0.7 (1/√tp when the partials are
  independent, not 1/tp);
* a duplicated all-reduce multiplies the output by tp: cos = 1, norm ratio = tp, scaled_rel ~1e-7 (the cosine
  does not see it at all: only the norm does);
* a wrong shard layout of a colwise projection permutes its output features: cos is low, but every column
  matches a reference column (permuted_rel ~1e-7).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

EXACT = 1e-4  # an algebraic relation holds when the rel error left is below this (float32 re-association: ~1e-7)
SIGNATURES: Mapping[str, str] = {
    "reduce_missing": "an all-reduce is missing: each rank kept its partial sum (the ranks' outputs differ and "
                      "sum to the reference)",
    "reduce_duplicated": "an all-reduce is duplicated: the output is tp × the reference (cosine 1, norm ratio tp)",
    "shard_layout": "the wrong shard direction/layout: the output's features are the reference's, permuted",
    "scaled": "the output is the reference times a constant (not tp)",
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(b))
    num = float(torch.linalg.vector_norm(a - b))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _permuted_rel(ref: torch.Tensor, tgt: torch.Tensor) -> float | None:
    """Rel error after matching tgt's last-dim columns to ref's nearest ones, when that is a non-identity
    permutation; None otherwise (or too many columns to match)."""
    if ref.dim() < 1 or ref.shape[-1] < 2 or ref.shape[-1] > 4096:
        return None
    r = ref.reshape(-1, ref.shape[-1]).T
    t = tgt.reshape(-1, tgt.shape[-1]).T
    match = torch.cdist(t, r).argmin(dim=1)
    if len(set(match.tolist())) != match.numel() or bool((match == torch.arange(match.numel())).all()):
        return None
    return _rel(t, r[match])


def signature_facts(ref: torch.Tensor | None, tgt: torch.Tensor, parts: Sequence[torch.Tensor] | None) -> dict[str, Any]:
    """The facts of the module docstring for one output tensor (empty when there is no comparable reference)."""
    if ref is None or tuple(ref.shape) != tuple(tgt.shape) or not ref.is_floating_point():
        return {}
    a = ref.detach().to(torch.float64)
    b = tgt.detach().to(torch.float64)
    na = float(torch.linalg.vector_norm(a))
    dot = float((a * b).sum())
    scale = dot / (na * na) if na > 0 else 0.0
    facts: dict[str, Any] = {"norm_ratio": float(torch.linalg.vector_norm(b)) / na if na > 0 else math.inf,
                             "scale": scale, "scaled_rel": _rel(b, scale * a) if na > 0 else math.inf}
    if parts is not None and len(parts) > 1:
        p = [x.detach().to(torch.float64) for x in parts]
        facts["ranks_equal"] = all(torch.equal(p[0], x) for x in p[1:])
        facts["sum_rel"] = _rel(sum(p[1:], p[0]), a)
    perm = _permuted_rel(a, b)
    if perm is not None:
        facts["permuted_rel"] = perm
    return facts


def classify(facts: Mapping[str, Any], tp: int) -> str | None:
    """The signature name of `SIGNATURES` the facts show, or None (a plain divergence)."""
    if facts.get("ranks_equal") is False and float(facts.get("sum_rel", math.inf)) < EXACT:
        return "reduce_missing"
    if float(facts.get("scaled_rel", math.inf)) < EXACT and abs(float(facts.get("scale", 1.0)) - 1.0) > 1e-3:
        return "reduce_duplicated" if abs(float(facts["scale"]) - tp) < 1e-3 * tp else "scaled"
    if float(facts.get("permuted_rel", math.inf)) < EXACT:
        return "shard_layout"
    return None
