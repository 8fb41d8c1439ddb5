"""Offline comparison of two dumps (`deepview-ci compare`), in the order of the dump-bisect discipline: inputs,
then the schema diff, then the per-layer table (see `dumps.py` for the format and the steps)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ...errors import UsageError
from ...results.model import clean
from .dumps import Dump, DumpInputsMismatch, dtype_name, tensor_bytes
from ...options import ThresholdOptions
from .metrics import SEVERITY_LEVELS, SEVERITY_SYMBOL, MetricsError, compare_tensors, cos_text, flag_for, public, severity
from .thresholds import LayerStats, ThresholdTable, exceeded

SEVERITY_RANK = {"exact": 0, "close": 1, "drift": 2, "diverged": 3, "broken": 4}
FAIL_ON = ("drift", "diverged", "broken", "never")


def inputs_check(ref: Dump, tgt: Dump) -> dict[str, Any]:
    """`{"status": "identical"|"equivalent", …}` when both dumps ran the same input; `DumpInputsMismatch` else."""
    if ref.input_hash and ref.input_hash == tgt.input_hash:
        return {"status": "identical", "hash": ref.input_hash}
    a, b = ref.inputs(), tgt.inputs()
    where = (f"reference {ref.folder} (sample {ref.manifest.get('sample', '?')}, inputs "
             f"{_short_inputs_spec(ref)}) vs target {tgt.folder} (sample {tgt.manifest.get('sample', '?')}, inputs "
             f"{_short_inputs_spec(tgt)})")
    hint = ("dump both sides with the same --sample and the same matrix inputs (seed, seq_len, batch, text); "
            "layers of different inputs cannot be compared")
    if set(a) != set(b):
        raise DumpInputsMismatch(f"inputs differ: different input tensors: only in reference {sorted(set(a) - set(b))}, "
                                 f"only in target {sorted(set(b) - set(a))}; {where}", hint=hint)
    if ref.input_kwargs() != tgt.input_kwargs():
        raise DumpInputsMismatch(f"inputs differ: non-tensor arguments {ref.input_kwargs()} vs {tgt.input_kwargs()}; "
                                 f"{where}", hint=hint)
    casts = []
    for name in sorted(a):
        x, y = a[name], b[name]
        if tuple(x.shape) != tuple(y.shape):
            raise DumpInputsMismatch(f"inputs differ: {name} has shape {list(x.shape)} in the reference and "
                                     f"{list(y.shape)} in the target; {where}", hint=hint)
        if x.dtype == y.dtype:
            if tensor_bytes(x) == tensor_bytes(y):
                continue
            raise DumpInputsMismatch(f"inputs differ: {name}: {_first_difference(x, y)}; {where}", hint=hint)
        if x.is_floating_point() and y.is_floating_point():
            lo = x.dtype if torch.finfo(x.dtype).bits < torch.finfo(y.dtype).bits else y.dtype
            if tensor_bytes(x.to(lo)) == tensor_bytes(y.to(lo)):
                casts.append(f"{name}: {dtype_name(x.dtype)} vs {dtype_name(y.dtype)}")
                continue
        raise DumpInputsMismatch(f"inputs differ: {name}: {dtype_name(x.dtype)} vs {dtype_name(y.dtype)}, "
                                 f"{_first_difference(x, y)}; {where}", hint=hint)
    if casts:
        return {"status": "equivalent", "note": "the same input at different precisions (equal after casting to the "
                                                "lower one): " + "; ".join(casts)}
    return {"status": "identical", "note": "hashes differ but every input tensor is byte-equal"}


def _short_inputs_spec(d: Dump) -> str:
    spec = d.manifest.get("inputs_spec") or {}
    return ", ".join(f"{k}={spec[k]}" for k in ("seed", "seq_len", "batch") if k in spec) or "?"


def _first_difference(x: torch.Tensor, y: torch.Tensor) -> str:
    xf = x.detach().reshape(-1)
    yf = y.detach().reshape(-1)
    if xf.dtype != yf.dtype:
        xf, yf = xf.to(torch.float64), yf.to(torch.float64)
    ne = (xf != yf) & ~(torch.isnan(xf) & torch.isnan(yf)) if xf.is_floating_point() else xf != yf
    idx = int(torch.nonzero(ne)[0]) if bool(ne.any()) else 0
    pos = list(torch.unravel_index(torch.tensor(idx), tuple(x.shape))) if x.dim() else []
    at = "[" + ", ".join(str(int(p)) for p in pos) + "]"
    return f"first difference at {at}: {xf[idx].item()} (reference) vs {yf[idx].item()} (target), " \
           f"{int(ne.sum())} of {xf.numel()} values differ"


@dataclass
class SchemaDiff:
    """Names, shapes and dtypes of two dumps' entries, before any number."""

    common: list[str] = field(default_factory=list)
    only_ref: list[str] = field(default_factory=list)
    only_target: list[str] = field(default_factory=list)
    shape_mismatch: list[dict[str, Any]] = field(default_factory=list)
    dtype_mismatch: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when names and shapes agree (dtype differences alone are compared numerically)."""
        return not (self.only_ref or self.only_target or self.shape_mismatch) and not \
            any(not d.get("comparable") for d in self.dtype_mismatch)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "common": len(self.common), "only_in_reference": self.only_ref,
                "only_in_target": self.only_target, "shape_mismatch": self.shape_mismatch,
                "dtype_mismatch": self.dtype_mismatch}


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def schema_diff(ref: Dump, tgt: Dump) -> SchemaDiff:
    d = SchemaDiff()
    for e in ref.entries:
        t = tgt.by_name.get(e.name)
        if t is None:
            d.only_ref.append(e.name)
            continue
        if e.shape != t.shape:
            d.shape_mismatch.append({"name": e.name, "reference": list(e.shape), "target": list(t.shape)})
            continue
        if e.dtype != t.dtype:
            d.dtype_mismatch.append({"name": e.name, "reference": e.dtype, "target": t.dtype,
                                     "comparable": _floating(e.dtype) and _floating(t.dtype)})
        d.common.append(e.name)
    d.only_target = [e.name for e in tgt.entries if e.name not in ref.by_name]
    return d


@dataclass
class Comparison:
    """The result of `compare_dumps`: inputs, schema diff, the per-layer rows and the verdict."""

    reference: dict[str, Any]
    target: dict[str, Any]
    inputs: dict[str, Any]
    schema: SchemaDiff
    rows: list[dict[str, Any]]
    first_divergent: str | None
    fail_on: str
    thresholds: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("flagged")]

    @property
    def ok(self) -> bool:
        return self.schema.ok and not self.flagged

    def to_json(self) -> dict[str, Any]:
        return clean({
            "reference": self.reference, "target": self.target, "inputs": self.inputs,
            "schema": self.schema.to_json(), "fail_on": self.fail_on, "thresholds": self.thresholds,
            "first_divergent": self.first_divergent, "ok": self.ok, "flagged": len(self.flagged),
            "warnings": self.warnings, "layers": self.rows,
        })


def derive_from_dumps(ref: Dump, second: Dump, options: ThresholdOptions | None = None) -> ThresholdTable:
    """Thresholds from two trusted references of the same input (e.g. cpu-fp32 and cpu-fp64 dumps): each layer's
    spread between them, times the margin, with the floors (`thresholds.threshold_from_stats`); one sample, so the
    numerics mode's own file (several samples) is the better gate when there is one. Closes `second`."""
    inputs_check(ref, second)
    layers: dict[str, LayerStats] = {}
    for name in schema_diff(ref, second).common:
        e, t = ref.by_name[name], second.by_name[name]
        try:
            m = compare_tensors(ref.tensor(e), second.tensor(t), where=name)
        except MetricsError:
            continue
        layers.setdefault(e.key, LayerStats(module_class=e.module_class, name=e.module)).add("cumulative", m)
    second.close()
    return ThresholdTable(layers=layers, options=options or ThresholdOptions(),
                          primary_dtype=str(ref.side.get("dtype") or "float32"),
                          key={"derived_from": [str(ref.folder), str(second.folder)]}, views=("cumulative",))


def compare_dumps(ref: Dump, tgt: Dump, *, thresholds: ThresholdTable | None = None,
                  fail_on: str = "diverged") -> Comparison:
    """Inputs first (`DumpInputsMismatch` when they differ), then the schema diff, then every common entry.

    An entry is flagged when its severity reaches `fail_on` (`drift`, `diverged`, `broken`; `never` flags
    nothing) or, with `thresholds`, when it exceeds its layer's threshold (cumulative view). Tensors are read one
    pair at a time.
    """
    if fail_on not in FAIL_ON:
        raise UsageError(f"fail-on {fail_on!r} is not one of {', '.join(FAIL_ON)}", hint="e.g. diverged")
    inputs = inputs_check(ref, tgt)
    schema = schema_diff(ref, tgt)
    warnings = []
    fa = (ref.manifest.get("model") or {}).get("fingerprint")
    fb = (tgt.manifest.get("model") or {}).get("fingerprint")
    if fa != fb:
        diff_keys = sorted(k for k in set(fa or {}) | set(fb or {}) if (fa or {}).get(k) != (fb or {}).get(k))
        warnings.append(f"the model fingerprints differ ({', '.join(diff_keys) or 'model'}): the two sides may not "
                        f"run the same weights")
    for label, dump in (("target", tgt), ("reference", ref)):
        ran = dump.side.get("ran") or {}
        if ran.get("not_ran"):
            warnings.append(f"inconclusive: the {label} dump's backend did not run the model ({ran['not_ran'][:300]}): "
                            f"its layers are PyTorch's, nothing here tests the backend")
        elif ran.get("capture") == "no-hooks":
            warnings.append(f"the {label} dump's backend ran the model only without hooks: its output alone was dumped")
    rows = []
    first = None
    limit = SEVERITY_RANK.get(fail_on, 99)
    dtype_diff = {d["name"]: d for d in schema.dtype_mismatch}
    for name in schema.common:
        e, t = ref.by_name[name], tgt.by_name[name]
        row: dict[str, Any] = {"name": name, "module": e.module, "module_class": e.module_class, "order": e.order,
                               "shape": list(e.shape), "dtype": e.dtype}
        if name in dtype_diff:
            row["dtype_target"] = t.dtype
            if not dtype_diff[name]["comparable"]:
                row["error"] = f"dtype {e.dtype} vs {t.dtype}: not comparable"
                rows.append(row)
                continue
        try:
            m = compare_tensors(ref.tensor(e), tgt.tensor(t), where=name)
        except MetricsError as exc:
            row["error"] = exc.message
            rows.append(row)
            continue
        row["metrics"] = public(m)
        row["severity"] = severity(m)
        row["flag"] = flag_for(m)
        flagged = SEVERITY_RANK[row["severity"]] >= limit
        if thresholds is not None:
            thr, source = thresholds.get(e.key, "cumulative")
            over = exceeded(m, thr)
            row["threshold"] = thr
            row["threshold_source"] = source
            row["exceeded"] = over
            flagged = bool(over) or (fail_on != "never" and row["severity"] == "broken")
        row["flagged"] = flagged
        if flagged and first is None:
            first = name
        rows.append(row)
    ref.close()
    tgt.close()
    return Comparison(reference={"folder": str(ref.folder), "label": ref.label(), "side": ref.side,
                                 "model": {"id": (ref.manifest.get("model") or {}).get("id")},
                                 "env": ref.manifest.get("env"), "sample": ref.manifest.get("sample")},
                      target={"folder": str(tgt.folder), "label": tgt.label(), "side": tgt.side,
                              "env": tgt.manifest.get("env"), "sample": tgt.manifest.get("sample")},
                      inputs=inputs, schema=schema, rows=rows, first_divergent=first, fail_on=fail_on,
                      thresholds=(str(thresholds.path) if thresholds.path else "derived from "
                                  + " and ".join(thresholds.key.get("derived_from") or ["two references"]))
                      if thresholds is not None else None,
                      warnings=warnings)


def _num(v: Any, fmt: str) -> str:
    width = "".join(c for c in fmt.split(".")[0] if c.isdigit())
    try:
        x = float(v)
    except (TypeError, ValueError):
        text = "n/a"
    else:
        text = str(x) if math.isnan(x) or math.isinf(x) else format(x, fmt)
    return text.rjust(int(width)) if width else text


def _one_minus(cos: Any) -> Any:
    try:
        return 1.0 - float(cos)
    except (TypeError, ValueError):
        return cos


def format_comparison(cmp: Comparison, *, max_list: int = 20) -> str:
    """The comparison as text: inputs, schema diff, the per-layer table, the verdict."""
    lines = [f"reference: {cmp.reference['folder']} ({cmp.reference['label']})",
             f"target:    {cmp.target['folder']} ({cmp.target['label']})"]
    note = f" ({cmp.inputs['note']})" if cmp.inputs.get("note") else ""
    lines.append(f"inputs: {cmp.inputs['status']}{note}")
    for w in cmp.warnings:
        lines.append(f"warning: {w}")
    s = cmp.schema
    lines.append(f"schema: {'ok' if s.ok else 'DIFFERS'}: {len(s.common)} common, {len(s.only_ref)} only in reference, "
                 f"{len(s.only_target)} only in target, {len(s.shape_mismatch)} shape mismatch(es), "
                 f"{len(s.dtype_mismatch)} dtype difference(s)")

    def listing(title: str, items: Sequence[Any]) -> None:
        if not items:
            return
        lines.append(f"  {title}:")
        for it in items[:max_list]:
            lines.append(f"    {it}")
        if len(items) > max_list:
            lines.append(f"    … {len(items) - max_list} more")

    listing("only in reference", s.only_ref)
    listing("only in target", s.only_target)
    listing("shape mismatch", [f"{d['name']}: {d['reference']} vs {d['target']}" for d in s.shape_mismatch])
    dtypes = sorted({(d["reference"], d["target"]) for d in s.dtype_mismatch})
    if dtypes:
        lines.append("  dtype differences (compared in float64): " +
                     ", ".join(f"{a} vs {b} on {sum(1 for d in s.dtype_mismatch if (d['reference'], d['target']) == (a, b))}"
                               for a, b in dtypes))
    width = max([len(r["name"]) for r in cmp.rows] + [5])
    width = min(width, 72)
    head = f"{'layer':<{width}}  {'shape':<16} {'rel':>9} {'1 − cos':>9} {'max_abs':>9} {'sqnr_db':>8}  flag"
    if cmp.thresholds:
        head += "  over threshold"
    lines.append(head)
    for r in cmp.rows:
        name = r["name"] if len(r["name"]) <= width else "…" + r["name"][-(width - 1):]
        shape = "x".join(str(x) for x in r["shape"]) or "scalar"
        if "error" in r:
            lines.append(f"{name:<{width}}  {shape:<16} {r['error']}")
            continue
        m = r["metrics"]
        line = (f"{name:<{width}}  {shape:<16} {_num(m['rel'], '9.2e')} {_num(_one_minus(m['cos']), '9.2e')} "
                f"{_num(m['max_abs'], '9.2e')} {_num(m['sqnr_db'], '8.1f')}  {r['flag']:<4}")
        if cmp.thresholds:
            line += "  " + (",".join(r.get("exceeded") or []) or "-")
        lines.append(line)
    if cmp.first_divergent:
        r = next(x for x in cmp.rows if x["name"] == cmp.first_divergent)
        m = r["metrics"]
        lines.append(f"first divergent layer: {r['name']} ({r['module_class']}): rel {_num(m['rel'], '.2e')}, "
                     f"{cos_text(m['cos'])} ({r['severity']}); {len(cmp.flagged)} entr"
                     f"{'y' if len(cmp.flagged) == 1 else 'ies'} flagged")
    else:
        lines.append(f"no layer flagged (fail-on {cmp.fail_on}{', with thresholds' if cmp.thresholds else ''})")
    lines += legend(cmp)
    return "\n".join(lines)


def legend(cmp: Comparison) -> list[str]:
    """What each flag means, and (without thresholds) how a layer gets its own threshold."""
    bands = {name: f"cos ≥ {cos_min:g}, rel ≤ {rel_max:g}" for name, cos_min, rel_max in SEVERITY_LEVELS}
    meaning = {"exact": "bit-identical", "close": f"noise ({bands['close']})", "drift": f"drift ({bands['drift']})",
               "diverged": f"diverged ({bands['diverged']})", "broken": "broken (worse, or NaN/Inf where the other side is finite)"}
    out = ["flags: " + " · ".join(f"{SEVERITY_SYMBOL[k]} {v}" for k, v in meaning.items())]
    if cmp.thresholds:
        out.append(f"over threshold: the metrics past this layer's own threshold ({cmp.thresholds}); a layer is "
                   "flagged when any is, or when it is broken")
        return out
    model = (cmp.reference.get("model") or {}).get("id") or "MODEL"
    out += [f"note: no thresholds, so a layer is flagged only from the fixed bands (--fail-on {cmp.fail_on}); "
            "drift below them passes. To hold each layer to its own threshold, either",
            f"  --thresholds OUT/thresholds/{model}-<key>.json  (written by the numerics mode of the model's cell: "
            f"`deepview-ci run MATRIX --select '{model}@*' --modes numerics --out OUT`), or",
            "  --derive SECOND_REF_DUMP  (from the spread between REF_DUMP and a dump of a second trusted reference "
            f"of the same input: `deepview-ci dump --model {model} --reference cpu-fp64 --out DIR`)"]
    return out




__all__ = ["Comparison", "FAIL_ON", "SchemaDiff", "compare_dumps", "format_comparison", "inputs_check", "schema_diff"]
