"""Per-layer divergence thresholds derived from data: the spread between two trusted references.

One tolerance for a whole model does not work: acceptable variation differs per layer and per model. So for every
module call the numerics mode measures how far a second trusted reference lands from the primary one (on CPU:
float64 against float32; with a GPU: CUDA against CPU) over several input samples, in both views (cumulative and
isolated, see `docs/numerics.md`), and holds every backend to

    threshold(metric) = max(floor, margin × percentile_p(reference-vs-reference metric over samples))

with, per metric:

=========== ===================================== ==================================================================
metric      test                                  floor
=========== ===================================== ==================================================================
rel         flagged when rel > threshold.rel      `rel_floor` (default 64 × eps of the primary dtype: 7.6e-6 in fp32)
mad         flagged when mad > threshold.mad      `mad_floor` × mean |reference output| (default = rel_floor)
cos         flagged when cos < threshold.cos      1 − cos is held to max(cos_floor, margin² × percentile(1 − cos)),
                                                  because 1 − cos grows like rel²/2 (default cos_floor = rel_floor²)
=========== ===================================== ==================================================================

Defaults (`ThresholdOptions`) and why, measured on the example matrix (tiny Llama, Granite, Bamba, Mixtral, ViT,
Llava, MiniLM with real weights; inductor and aot_eager on CPU, seeds 0-2, both views on every layer):

* `percentile` 99: with a handful of samples this is close to the worst sample, which is what a CI gate wants.
* `margin` 8: a target as accurate as float32 eager should land within about √2–2× the float32-vs-float64 spread
  of the float32 reference (triangle inequality). Measured: inductor's worst layer landed at 1.44× the spread in
  the cumulative view (MiniLM `encoder.layer.5.attention.self`) and 4.2× in the isolated view (ViT's GELU, where
  inductor uses its own erf); aot_eager runs the eager kernels and lands at 0. 8 leaves about 2× head-room over
  the worst real-compiler case, while the drift this mode exists for is two to three orders of magnitude larger
  (bfloat16 normalization: rel 1e-3–3e-3 against thresholds of 7.6e-6).
* floors: a layer where both references agree bit for bit (an embedding lookup, a pure container, an RMSNorm that
  upcasts to float32 inside a float64 model) would otherwise get a zero threshold and flag any re-association of
  a sum. 64 ulps of the primary dtype is far below any real drift and above reordering noise: with the tiny
  example models (spreads 1e-8–1e-7) nearly every threshold sits on this floor, and the worst real-compiler layer
  used 17 % of it (inductor on MiniLM; at most 7 % on the others).

The raw reference-vs-reference statistics are stored, not only the thresholds, so that changing `percentile`,
`margin` or the floors does not need a new derivation. The file is keyed by what changes the statistics (model
fingerprint, input spec, references, number of samples, method version, torch version) and reused when the key
matches; `load_or_derive` takes a file lock so that two cells of the same model derive once.

A file need not hold both views: the file's `views` (schema 2) lists those whose statistics it holds. The numerics
mode derives the isolated view's statistics only when the target's isolated view runs (`isolated: auto` runs it
only when the cumulative view flags something), and `add_views` then adds them to the same file. A schema-1 file
(always derived whole) holds the views its statistics show.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ...errors import InputError
from ...jsontext import parse_json
from ...fsutil import atomic_write_json, locked
from ...options import NUMERICS_VIEWS as VIEWS, ThresholdOptions
from ...results.model import clean, number

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)  # 1: no `views` (the views present in its statistics)
METHOD_VERSION = 1  # bump when the derivation (what is measured, how) changes: old files are then re-derived



def percentile(values: list[float], p: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of finite values; NaN/inf propagate as inf
    (`threshold_from_stats` passes the finite samples only: `finite_samples`)."""
    if not values:
        return 0.0
    if any(not math.isfinite(v) for v in values):
        return math.inf
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ------------------------------------------------------------------------------------------------ statistics

@dataclass
class LayerStats:
    """Reference-vs-reference measurements of one module call, one value per (sample, secondary reference)."""

    module_class: str
    name: str
    views: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # the precision policy's emulation against the primary, per view (empty under a float32 policy)
    policy: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def add(self, view: str, metrics: Mapping[str, Any], *, policy: bool = False) -> None:
        v = (self.policy if policy else self.views).setdefault(
            view, {"rel": [], "one_minus_cos": [], "mad": [], "ref_absmean": []})
        v["rel"].append(float(metrics["rel"]))
        v["one_minus_cos"].append(max(0.0, 1.0 - float(metrics["cos"])))
        v["mad"].append(float(metrics["mad"]))
        v["ref_absmean"].append(float(metrics.get("ref_absmean", 0.0)))


def finite_samples(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def threshold_from_stats(stats: Mapping[str, list[float]], opts: ThresholdOptions, primary_dtype: str,
                         policy: Mapping[str, list[float]] | None = None) -> dict[str, float]:
    """{"rel", "cos", "mad"} for one layer and view: margin × percentile, with floors; with `policy` (the
    precision policy's emulated spread), at least `policy_margin` × its percentile (1 − cos: the margin squared).

    Non-finite reference spread (issue 45: GPT-OSS's attention sinks, where the two references disagree about which
    values are finite) bounds nothing: the percentile is taken over the samples where the spread is finite (none:
    the floors), and the threshold says in how many samples it was not (``ref_nonfinite``). The target is still
    held to the primary reference, which a target that disagrees with it about finiteness exceeds (rel = inf)."""
    rel_floor, mad_floor, cos_floor = opts.floors(primary_dtype)
    p, m = opts.percentile, opts.margin
    absmean = finite_samples(stats.get("ref_absmean", []))
    scale = percentile(sorted(absmean), 50.0) if absmean else 0.0
    rel = max(rel_floor, m * percentile(finite_samples(stats.get("rel", [])), p))
    mad = max(mad_floor * scale, m * percentile(finite_samples(stats.get("mad", [])), p))
    one_minus_cos = max(cos_floor, m * m * percentile(finite_samples(stats.get("one_minus_cos", [])), p))
    if policy:
        q = opts.policy_margin
        rel = max(rel, q * percentile(finite_samples(policy.get("rel", [])), p))
        mad = max(mad, q * percentile(finite_samples(policy.get("mad", [])), p))
        one_minus_cos = max(one_minus_cos, q * q * percentile(finite_samples(policy.get("one_minus_cos", [])), p))
    out = {"rel": rel, "cos": 1.0 - min(2.0, one_minus_cos), "mad": mad}
    bad = sum(1 for i in range(max((len(v) for v in stats.values()), default=0))
              if any(i < len(v) and not math.isfinite(v[i]) for k, v in stats.items() if k != "ref_absmean"))
    if bad:
        out["ref_nonfinite"] = bad  # samples whose reference-vs-reference spread was not finite
    return out


def exceeded(metrics: Mapping[str, Any], threshold: Mapping[str, Any]) -> list[str]:
    """The metrics of `metrics` over their threshold (rel/mad above, cos below); NaN always counts as over."""
    out = []
    for key, above in (("rel", True), ("cos", False), ("mad", True)):
        if key not in threshold or key not in metrics:
            continue
        v = float(metrics[key])
        t = float(threshold[key])
        if math.isnan(v) or (v > t if above else v < t):
            out.append(key)
    return out


# ------------------------------------------------------------------------------------------------ the table

@dataclass
class ThresholdTable:
    """Thresholds per module call key (`name` or `name#k`) and view, recomputed from stored statistics."""

    layers: dict[str, LayerStats]
    options: ThresholdOptions
    primary_dtype: str
    key: dict[str, Any]
    path: Path | None = None
    reused: bool = False  # loaded from an existing file rather than derived now
    derive_seconds: float | None = None
    views: tuple[str, ...] = VIEWS  # the views whose statistics were derived (the others fall back)
    _cache: dict[tuple[str, str], dict[str, float]] = field(default_factory=dict, repr=False)

    def get(self, call_key: str, view: str) -> tuple[dict[str, float], str]:
        """(threshold, source): source `derived`, or `fallback` when this call was never measured (the loosest
        threshold of the same module class, else of the view)."""
        ck = (call_key, view)
        if ck in self._cache:
            return self._cache[ck], "derived"
        layer = self.layers.get(call_key)
        if layer is not None and view in layer.views:
            thr = threshold_from_stats(layer.views[view], self.options, self.primary_dtype, layer.policy.get(view))
            self._cache[ck] = thr
            return thr, "derived"
        return self._fallback(call_key, view), "fallback"

    def _fallback(self, call_key: str, view: str) -> dict[str, float]:
        cls = None
        base = call_key.split("#", 1)[0]
        for k, layer in self.layers.items():
            if k.split("#", 1)[0] == base:
                cls = layer.module_class
        pool = [k for k, layer in self.layers.items() if view in layer.views and (cls is None or layer.module_class == cls)]
        if not pool:
            pool = [k for k, layer in self.layers.items() if view in layer.views]
        if not pool:
            rel_floor, _mad, cos_floor = self.options.floors(self.primary_dtype)
            return {"rel": rel_floor, "cos": 1.0 - cos_floor, "mad": math.inf}
        thrs = [self.get(k, view)[0] for k in pool]
        return {"rel": max(t["rel"] for t in thrs), "cos": min(t["cos"] for t in thrs), "mad": max(t["mad"] for t in thrs)}

    def to_json(self) -> dict[str, Any]:
        """The file's content, strict JSON: a non-finite statistic is written as "inf", "-inf" or "nan"
        (`results.model.clean`), which `from_json` reads back as the float (`number`)."""
        layers = {}
        for k, layer in self.layers.items():
            layers[k] = {
                "name": layer.name, "module_class": layer.module_class, "stats": layer.views,
                "thresholds": {v: threshold_from_stats(layer.views[v], self.options, self.primary_dtype,
                                                       layer.policy.get(v)) for v in layer.views},
            }
            if layer.policy:
                layers[k]["policy_stats"] = layer.policy
        return {
            "schema_version": SCHEMA_VERSION,
            "method_version": METHOD_VERSION,
            "key": self.key,
            "key_hash": key_hash(self.key),
            "primary_dtype": self.primary_dtype,
            "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "derive_seconds": self.derive_seconds,
            "views": list(self.views),
            "options": self.options.as_dict(),  # what the stored "thresholds" were computed with (informative)
            "layers": clean(layers),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], options: ThresholdOptions, *, path: Path | None = None) -> "ThresholdTable":
        layers = {}
        for k, entry in (data.get("layers") or {}).items():
            views = {v: {m: [_read_number(x) for x in vals] for m, vals in s.items()} for v, s in entry["stats"].items()}
            policy = {v: {m: [_read_number(x) for x in vals] for m, vals in s.items()}
                      for v, s in (entry.get("policy_stats") or {}).items()}
            layers[k] = LayerStats(module_class=entry.get("module_class", ""), name=entry.get("name", k), views=views,
                                   policy=policy)
        derived = data.get("views")
        if derived is None:  # schema 1: derived whole, in the views its statistics hold (all when it holds none)
            present = {v for layer in layers.values() for v in layer.views}
            derived = [v for v in VIEWS if v in present] if present else list(VIEWS)
        return cls(layers=layers, options=options, primary_dtype=data.get("primary_dtype", "float32"),
                   key=dict(data.get("key") or {}), path=path, reused=True, derive_seconds=data.get("derive_seconds"),
                   views=tuple(v for v in VIEWS if v in derived))

    def merge(self, layers: Mapping[str, LayerStats], views: Sequence[str]) -> None:
        """Add the statistics of `views` (derived later, `add_views`) to the table."""
        for k, extra in layers.items():
            own = self.layers.setdefault(k, LayerStats(module_class=extra.module_class, name=extra.name))
            own.views.update({v: s for v, s in extra.views.items() if v in views})
            own.policy.update({v: s for v, s in extra.policy.items() if v in views})
        self.views = tuple(v for v in VIEWS if v in self.views or v in views)
        self._cache.clear()


def _read_number(x: Any) -> float:
    """A stored statistic: a number, or "inf"/"-inf"/"nan" as `to_json` writes a non-finite one (None: nan)."""
    value = number(x)
    return math.nan if value is None else value


# ------------------------------------------------------------------------------------------------ key and file

def threshold_key(*, model_fingerprint: Mapping[str, Any], inputs: Mapping[str, Any],
                  references: list[Mapping[str, Any]], samples: int,
                  precision: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What the stored statistics depend on. Options that only post-process them (margin, percentile, floors) are
    not part of it. `precision` (the policy's classes below float32) only when there are any: a float32 policy's
    key is the key thresholds always had."""
    import torch  # deferred: reading/writing threshold files needs no torch

    extra = {"precision": dict(precision)} if precision else {}
    return {**extra,
        "model": json.loads(json.dumps(dict(model_fingerprint), sort_keys=True, default=str)),
        "inputs": json.loads(json.dumps(dict(inputs), sort_keys=True, default=str)),
        "references": [dict(r) for r in references],
        "samples": int(samples),
        "method_version": METHOD_VERSION,
        "torch": torch.__version__.split("+")[0],
    }


def key_hash(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "model"


def threshold_path(folder: Path, model_id: str, key: Mapping[str, Any]) -> Path:
    """`<folder>/<model-id>-<key-hash>.json`."""
    return Path(folder) / f"{_safe(model_id)}-{key_hash(key)}.json"


def read_table(path: Path, key: Mapping[str, Any], options: ThresholdOptions) -> tuple[ThresholdTable | None, str | None]:
    """The stored table when `path` holds one for exactly `key`; else (None, why not)."""
    if not path.exists():
        return None, "no thresholds file yet"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        return None, f"unreadable thresholds file ({exc}); re-derived"
    if not isinstance(data, dict) or data.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        return None, f"thresholds file schema {data.get('schema_version') if isinstance(data, dict) else '?'} is not {SCHEMA_VERSION}; re-derived"
    if data.get("key") != json.loads(json.dumps(dict(key))):
        return None, "thresholds file key differs; re-derived"
    try:
        return ThresholdTable.from_json(data, options, path=path), None
    except (KeyError, TypeError, ValueError) as exc:
        return None, f"malformed thresholds file ({exc}); re-derived"


def load_or_derive(path: Path, key: Mapping[str, Any], options: ThresholdOptions, primary_dtype: str,
                   derive: Callable[[], dict[str, LayerStats]], *,
                   views: Sequence[str] = VIEWS) -> tuple[ThresholdTable, str]:
    """Reuse the thresholds at `path` when its key matches, else call `derive()` (the statistics of `views`) and
    store the result atomically. A reused file may hold fewer views than `views`: `add_views` adds them.

    Holds an exclusive `fcntl.flock` on `<path>.lock` throughout, so parallel cells of the same model wait for the
    first one's derivation instead of repeating it. Returns the table and a note saying what happened.
    """
    with locked(path.with_name(path.name + ".lock")):
        table, why = read_table(path, key, options)
        if table is not None:
            return table, f"reused {path.name}"
        t0 = time.monotonic()
        layers = derive()
        table = ThresholdTable(layers=layers, options=options, primary_dtype=primary_dtype, key=dict(key), path=path,
                               reused=False, derive_seconds=round(time.monotonic() - t0, 3),
                               views=tuple(v for v in VIEWS if v in views))
        atomic_write_json(path, table.to_json())
        return table, f"derived ({why})"


def add_views(table: ThresholdTable, views: Sequence[str], derive: Callable[[], dict[str, LayerStats]]) -> str:
    """Give `table` the statistics of `views` it lacks: from its file when another cell added them meanwhile,
    else from `derive()` (the statistics of those views), stored back into the file. Same lock as
    `load_or_derive`. Returns a note saying what happened."""
    missing = [v for v in views if v not in table.views]
    if not missing:
        return ""
    if table.path is None:
        table.merge(derive(), missing)
        return f"{', '.join(missing)} view derived"
    with locked(table.path.with_name(table.path.name + ".lock")):
        stored, _why = read_table(table.path, table.key, table.options)
        if stored is not None and all(v in stored.views for v in missing):
            table.merge(stored.layers, missing)
            return f"{', '.join(missing)} view reused from {table.path.name}"
        t0 = time.monotonic()
        table.merge(derive(), missing)
        table.derive_seconds = round((table.derive_seconds or 0.0) + time.monotonic() - t0, 3)
        if stored is not None:  # keep what another cell added meanwhile
            table.merge(stored.layers, [v for v in stored.views if v not in table.views])
        atomic_write_json(table.path, table.to_json())
        return f"{', '.join(missing)} view derived"


def load_table(path: Path, options: ThresholdOptions | None = None) -> ThresholdTable:
    """Read a thresholds file whatever its key (for offline comparison); `InputError` when it cannot be read."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise InputError(f"{path}: thresholds file not found", hint="run the numerics mode once to derive it") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot read thresholds file: {exc}", hint="delete it; it is re-derived") from None
    data = parse_json(raw, source=str(path), what="thresholds file")
    if not isinstance(data, dict) or data.get("schema_version") not in READABLE_SCHEMA_VERSIONS:
        raise InputError(f"{path}: thresholds schema_version is not one of {READABLE_SCHEMA_VERSIONS}",
                         hint="re-derive it with this version of deepview-ci")
    return ThresholdTable.from_json(data, options or ThresholdOptions(), path=Path(path))


__all__ = [
    "METHOD_VERSION", "READABLE_SCHEMA_VERSIONS", "SCHEMA_VERSION", "VIEWS", "LayerStats", "ThresholdOptions",
    "ThresholdTable", "add_views", "exceeded",
    "key_hash", "load_or_derive", "load_table", "percentile", "read_table", "threshold_from_stats", "threshold_key",
    "threshold_path",
]
