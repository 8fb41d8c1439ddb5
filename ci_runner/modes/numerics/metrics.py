"""Per-tensor comparison metrics, computed in float64, that never lie about what they saw.

`compare_tensors(ref, tgt)` returns, for a reference tensor and the target's tensor of the same shape:

========== ====================================================================================================
key        meaning
========== ====================================================================================================
rel        relative error ‖tgt − ref‖₂ / ‖ref‖₂ (the most sensitive of the five when values span large ranges)
cos        cosine similarity of the flattened tensors, clamped to [−1, 1] (never above 1, unlike fp32 cosines)
mad        mean absolute difference
max_abs    maximum absolute difference
sqnr_db    signal-to-quantization-noise ratio 10·log10(‖ref‖² / ‖tgt − ref‖²) = −20·log10(rel); +inf when equal
========== ====================================================================================================

plus bookkeeping: `numel`, `ref_absmean` (the mean |ref|, the scale floors are measured against), and the
non-finite counts `nonfinite_ref`, `nonfinite_tgt`, `nonfinite_mismatch`.

Edge cases, each decided once here:

* Shapes must match exactly: a mismatch raises `MetricsError`, a broadcast never happens.
* NaN/±Inf are reported, not hidden. Positions where both sides hold the same non-finite value (the same NaN/Inf
  pattern, e.g. an attention mask full of −inf) count as equal and are left out of the numeric metrics; each
  position where the two sides disagree about finiteness counts in `nonfinite_mismatch` and makes `rel`, `mad` and
  `max_abs` +inf, `sqnr_db` −inf (so any threshold test flags it); `cos` is then computed on the positions finite
  on both sides.
* All-zero tensors: equal zeros give rel 0, cos 1, sqnr +inf; a zero reference against a non-zero target gives
  rel +inf and cos 0; a non-zero reference against a zero target gives rel 1 and cos 0.
* Empty tensors compare as identical.
* Squares that would overflow or underflow (float64 inputs beyond 1e154, subnormals near 1e-308) are avoided by
  scaling both vectors by their largest magnitude first.
* Integer and bool tensors are compared as float64; complex tensors as their (real, imag) pairs.

Severity (`severity()`) is a fixed, data-independent reading for humans, after the dump-bisect method: rel is
trusted over cos when the two disagree. Pass/fail in the numerics mode uses data-derived thresholds instead
(`thresholds.py`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import torch

from ...watch.capture import iter_tensors
from ...errors import DeepviewError

METRIC_KEYS: tuple[str, ...] = ("rel", "cos", "mad", "max_abs", "sqnr_db")

# Severity levels, best first. Each level is reached while BOTH cos ≥ cos_min and rel ≤ rel_max hold.
SEVERITY_LEVELS: tuple[tuple[str, float, float], ...] = (
    # name,      cos_min,  rel_max
    ("close",    0.99999,  1e-4),   # ✓ numerical noise
    ("drift",    0.999,    1e-2),   # ? drift worth watching (a single step should stay above cos 0.999)
    ("diverged", 0.99,     1e-1),   # ✗ the dump-bisect rule: cos < 0.99 or rel > 10 % is where a bug lives
)
SEVERITY_ORDER: tuple[str, ...] = ("exact", "close", "drift", "diverged", "broken")
SEVERITY_SYMBOL: Mapping[str, str] = {"exact": "=", "close": "✓", "drift": "?", "diverged": "✗", "broken": "✗✗"}


class MetricsError(DeepviewError):
    """Two tensors cannot be compared (different shapes or structures)."""


def _as_float64(t: torch.Tensor) -> torch.Tensor:
    return _flat(t).to(torch.float64)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` on CPU as one flat vector (complex as its (real, imag) pairs), in its own dtype."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    return t.reshape(-1)


# Elements per float64 block. No full float64 copy is made, and every op on a block (at most 4 × CHUNK elements)
# stays under torch's grain size, 32768, so none is split across threads: on a busy machine a parallel op waits
# for a thread the scheduler has not run, spinning (measured on the 0.5B logits, 4.9M elements, at load 8:
# 8000 → 44 CPU ms; 8192, where 4 × CHUNK reaches the grain size → 1120 CPU ms; the earlier whole-tensor code 300)
CHUNK = 8000


def compare_tensors(ref: torch.Tensor, tgt: torch.Tensor, *, where: str = "") -> dict[str, Any]:
    """Metrics of `tgt` against the reference `ref` (see the module docstring); never mutates its inputs."""
    if not isinstance(ref, torch.Tensor) or not isinstance(tgt, torch.Tensor):
        raise MetricsError(f"{where or 'compare_tensors'}: expected two tensors, got "
                           f"{type(ref).__name__} and {type(tgt).__name__}")
    if tuple(ref.shape) != tuple(tgt.shape):
        raise MetricsError(
            f"{where or 'compare_tensors'}: shape mismatch: reference {list(ref.shape)} vs target {list(tgt.shape)}",
            hint="the target computed a differently shaped tensor; compare the layer's structure, not its numbers",
        )
    if ref.is_complex() != tgt.is_complex():
        raise MetricsError(f"{where or 'compare_tensors'}: one tensor is complex and the other is not "
                           f"({ref.dtype} vs {tgt.dtype})")
    numel = int(ref.numel())
    if ref.dtype == tgt.dtype and ref.device == tgt.device and torch.equal(ref, tgt):  # no NaN (NaN != NaN)
        absmean = _absmean(_flat(ref)) if numel else 0.0
        return {"rel": 0.0, "cos": 1.0, "mad": 0.0, "max_abs": 0.0, "sqnr_db": math.inf, "ref_absmean": absmean,
                "numel": numel, "nonfinite_ref": 0, "nonfinite_tgt": 0, "nonfinite_mismatch": 0}
    out = _finite_metrics(_flat(ref), _flat(tgt))
    if out is not None:
        out.update(numel=numel, nonfinite_ref=0, nonfinite_tgt=0, nonfinite_mismatch=0)
        return out
    a = _as_float64(ref)
    b = _as_float64(tgt)
    fa = torch.isfinite(a)
    fb = torch.isfinite(b)
    nonfinite_ref = int(numel - int(fa.sum()))
    nonfinite_tgt = int(numel - int(fb.sum()))
    both = fa & fb
    # the same non-finite value on both sides (NaN with NaN, +inf with +inf) is agreement
    same_nonfinite = (~fa) & (~fb) & ((torch.isnan(a) & torch.isnan(b)) | (a == b))
    mismatch = int(numel - int(both.sum()) - int(same_nonfinite.sum()))
    out = _finite_metrics(a[both], b[both])
    assert out is not None
    out.update(numel=numel, nonfinite_ref=nonfinite_ref, nonfinite_tgt=nonfinite_tgt, nonfinite_mismatch=mismatch)
    if mismatch:
        out.update(rel=math.inf, mad=math.inf, max_abs=math.inf, sqnr_db=-math.inf)
    return out


def _absmean(a: torch.Tensor) -> float:
    """Mean |a| of a flat vector, summed in float64 block by block."""
    total = torch.zeros((), dtype=torch.float64)
    buf = torch.empty(min(CHUNK, a.numel()), dtype=torch.float64)
    for i in range(0, a.numel(), CHUNK):
        k = min(CHUNK, a.numel() - i)
        total += buf[:k].copy_(a[i:i + k]).abs_().sum()
    return float(total) / a.numel()


def _sums(a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> tuple[list[float], list[float], list[float]]:
    """Over flat vectors `a`, `b` (any real dtype) and `d = b − a`, all in float64 and divided by `scale`, block by
    block: (max |·| of a, b, d; sum |·| of a, b, d; a·a, b·b, d·d, a·b). Products are summed elementwise, not by
    BLAS: a float64 `dot`/`matmul` waits for BLAS threads that a busy machine does not schedule (10 ms a block)."""
    n = a.numel()
    k0 = min(CHUNK, n)
    m_buf = torch.empty(3, k0, dtype=torch.float64)
    p_buf = torch.empty(4, k0, dtype=torch.float64)
    mx = torch.zeros(3, dtype=torch.float64)
    sm = torch.zeros(3, dtype=torch.float64)
    dots = torch.zeros(4, dtype=torch.float64)
    for i in range(0, n, CHUNK):
        k = min(CHUNK, n - i)
        m, p = m_buf[:, :k], p_buf[:, :k]
        m[0].copy_(a[i:i + k])
        m[1].copy_(b[i:i + k])
        torch.sub(m[1], m[0], out=m[2])
        if scale != 1.0:
            m.div_(scale)
        torch.mul(m, m, out=p[:3])
        torch.mul(m[0], m[1], out=p[3])
        dots.add_(p.sum(dim=1))
        absm = torch.abs(m, out=p[:3])
        torch.maximum(mx, absm.amax(dim=1), out=mx)  # NaN propagates: a non-finite input is seen
        sm.add_(absm.sum(dim=1))
    return mx.tolist(), sm.tolist(), dots.tolist()


def _finite_metrics(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any] | None:
    """rel/cos/mad/max_abs/sqnr of flat vectors `b` (target) against `a` (reference), computed in float64; None if
    either holds a non-finite value. All sums come from one pass over blocks (`_sums`): the products a·a, b·b,
    d·d, a·b of d = b − a and the |·| reductions; when squares would overflow or underflow, the vectors are scaled
    by their largest magnitude and the products summed again."""
    n = a.numel()
    if n == 0:
        return {"rel": 0.0, "cos": 1.0, "mad": 0.0, "max_abs": 0.0, "sqnr_db": math.inf, "ref_absmean": 0.0}
    (amax, bmax, dmax), (asum, _bsum, dsum), (aa, bb, dd, ab) = _sums(a, b)
    if not (math.isfinite(amax) and math.isfinite(bmax)):
        return None
    scale = max(amax, bmax)
    if scale == 0.0:  # both all zeros
        return {"rel": 0.0, "cos": 1.0, "mad": 0.0, "max_abs": 0.0, "sqnr_db": math.inf, "ref_absmean": 0.0}
    ok = all(math.isfinite(v) for v in (aa, bb, dd, ab)) and not (
        (aa == 0.0 and amax > 0.0) or (bb == 0.0 and bmax > 0.0) or (dd == 0.0 and dmax > 0.0))
    if not ok:  # squares overflowed or underflowed: ratios from the scaled vectors
        aa, bb, dd, ab = _sums(a, b, scale)[2]
    na, nb, nd = math.sqrt(aa), math.sqrt(bb), math.sqrt(dd)
    if dmax == 0.0:
        nd = 0.0
    rel = (math.inf if nd > 0.0 else 0.0) if na == 0.0 else nd / na
    if nd == 0.0:
        cos = 1.0  # identical: exactly 1, not 1 - ulp
    elif na == 0.0 or nb == 0.0:
        cos = 0.0
    else:
        cos = max(-1.0, min(1.0, ab / (na * nb)))
    if nd == 0.0:
        sqnr = math.inf
    elif na == 0.0:
        sqnr = -math.inf
    else:
        sqnr = 20.0 * math.log10(na / nd)
    return {"rel": rel, "cos": cos, "mad": dsum / n, "max_abs": dmax, "sqnr_db": sqnr, "ref_absmean": asum / n}


def compare_outputs(ref: Any, tgt: Any, *, where: str = "") -> dict[str, dict[str, Any]]:
    """Metrics per tensor of two nested outputs (tensors, tuples, dicts, ModelOutput; caches skipped).

    Keys are the tensors' sub-names (`""` for a bare tensor, `"0"`, `"logits"`, `"0.1"`…). A tensor present on one
    side only raises `MetricsError`: a structural difference is not a numerical one.
    """
    r = dict(iter_tensors(ref))
    t = dict(iter_tensors(tgt))
    if r.keys() != t.keys():
        only_r = sorted(set(r) - set(t))
        only_t = sorted(set(t) - set(r))
        raise MetricsError(f"{where or 'compare_outputs'}: output structure differs: only in reference "
                           f"{only_r[:5]}, only in target {only_t[:5]}")
    return {k: compare_tensors(r[k], t[k], where=f"{where}[{k}]" if where else k) for k in r}


def worst(per_tensor: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One metrics dict for a layer with several output tensors: the worst value of each metric (of the metrics
    every item has)."""
    items = list(per_tensor)
    if not items:
        return {"rel": 0.0, "cos": 1.0, "mad": 0.0, "max_abs": 0.0, "sqnr_db": math.inf}
    out: dict[str, Any] = {}
    for key, high_is_bad in (("rel", True), ("cos", False), ("mad", True), ("max_abs", True), ("sqnr_db", False)):
        if all(key in m for m in items):
            out[key] = _worst_of((m[key] for m in items), high_is_bad=high_is_bad)
    for extra in ("nonfinite_ref", "nonfinite_tgt", "nonfinite_mismatch", "numel"):
        if any(extra in m for m in items):
            out[extra] = sum(int(m.get(extra, 0)) for m in items)
    if any("ref_absmean" in m for m in items):
        out["ref_absmean"] = max(float(m.get("ref_absmean", 0.0)) for m in items)
    return out


def _worst_of(values: Iterable[Any], *, high_is_bad: bool) -> float:
    """Max (or min) of metric values where NaN, if present, is the worst (plain `max` would drop it by order)."""
    vals = [float(v) for v in values]
    if any(math.isnan(v) for v in vals):
        return math.nan
    return max(vals) if high_is_bad else min(vals)


def _level(cos: float, rel: float) -> int:
    if math.isnan(cos) or math.isnan(rel):
        return len(SEVERITY_LEVELS)
    for i, (_name, cos_min, rel_max) in enumerate(SEVERITY_LEVELS):
        if cos >= cos_min and rel <= rel_max:
            return i
    return len(SEVERITY_LEVELS)


def severity(metrics: Mapping[str, Any]) -> str:
    """`exact`, `close`, `drift`, `diverged` or `broken` (non-finite disagreement or worse than `diverged`)."""
    if int(metrics.get("nonfinite_mismatch", 0) or 0):
        return "broken"
    max_abs = float(metrics.get("max_abs", math.nan))
    if max_abs == 0.0:
        return "exact"
    lvl = _level(float(metrics.get("cos", math.nan)), float(metrics.get("rel", math.nan)))
    if lvl >= len(SEVERITY_LEVELS):
        return "broken"
    return SEVERITY_LEVELS[lvl][0]


def flag_for(metrics: Mapping[str, Any]) -> str:
    """The severity as a one-glyph flag for tables: = ✓ ? ✗ ✗✗."""
    return SEVERITY_SYMBOL[severity(metrics)]


def public(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Only the five contract keys (`METRIC_KEYS`) of a metrics dict, for report tables."""
    return {k: metrics[k] for k in METRIC_KEYS if k in metrics}


def cos_text(cos: Any) -> str:
    """A cosine as `1 − cos 3.02e-07` (readable where cos itself prints as 1.000000)."""
    try:
        x = float(cos)
    except (TypeError, ValueError):
        return "1 − cos n/a"
    if math.isnan(x):
        return "1 − cos NaN"
    return f"1 − cos {1.0 - x:.2e}"


REORDER_FROM = 1e-3  # an error this large (rel) is checked for being the same rows in another order
REORDER_GAIN = 100.0  # … and is taken as a row order only when reordering shrinks it this much


def reorder_rows(ref: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor | None:
    """`tgt` (float64) with its rows (dim 0) put in `ref`'s order, both sorted by a fixed random projection of
    each row; None for tensors without several rows, or with non-finite values."""
    if ref.dim() < 2 or ref.shape[0] < 2 or tuple(ref.shape) != tuple(tgt.shape) or ref.is_complex() \
            or tgt.is_complex() or not (ref.is_floating_point() and tgt.is_floating_point()):
        return None
    n = ref.shape[0]
    a = ref.detach().to("cpu", torch.float64).reshape(n, -1)
    b = tgt.detach().to("cpu", torch.float64).reshape(n, -1)
    if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
        return None
    v = torch.randn(a.shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ia, ib = torch.argsort(a @ v), torch.argsort(b @ v)
    out = torch.empty_like(b)
    out[ia] = b[ib]
    return out.reshape(tgt.shape)


def compare_any_row_order(ref: torch.Tensor, tgt: torch.Tensor, *, where: str = "") -> dict[str, Any]:
    """`compare_tensors`, but a target holding the reference's rows in another order (an unstable sort of routed
    tokens: MoE experts group their rows by expert, and ties may come out in any order) is compared row by row
    in the reference's order, with `"reordered": True` in the metrics. A tensor whose error reordering does not
    shrink `REORDER_GAIN`-fold is compared as it is."""
    m = compare_tensors(ref, tgt, where=where)
    rel = float(m["rel"])
    if not (rel >= REORDER_FROM) or math.isinf(rel):
        return m
    moved = reorder_rows(ref, tgt)
    if moved is None:
        return m
    r = compare_tensors(ref, moved, where=where)
    if float(r["rel"]) * REORDER_GAIN <= rel:
        return {**r, "reordered": True}
    return m
