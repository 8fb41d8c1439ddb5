"""Ops probes: deduplication across models, per-probe cost vs a bare torch.compile, group testing vs one compile per probe.

Side by side, in one run, on the bundled example's models (`ci_runner/data/example.yaml`, `--models` picks some):

1. **Deduplication**: (model, signature) pairs vs distinct signatures after `merge_inventories` (aten level).
2. **Per-probe cost** (issue 24): for the first `--cost-n` distinct signatures, in this one warm process, the time of
   `probe.run_probe` (reference on CPU eager, inputs, Dynamo reset, compile through `CompileRecord`, counters,
   comparison) vs a bare `torch._dynamo.reset(); torch.compile(one_op_fn, backend=B)(*inputs)` of the same op on
   the same inputs; and the probing child's whole cost per probe (`ProbeRunner`, one child: process, imports,
   backend setup).
3. **Group testing**: every distinct signature probed one compile per probe (`group_testing: false`) and with group
   testing, in isolated children as the ops mode does: compiles (single probes + group compiles, from the child's
   journal), wall time, and whether every signature's status is identical.

    PYTHONPATH=. python benchmarks/bench_probes.py [--backends sim-subset,inductor] [--models tiny-llama,tiny-vit]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any


FINDING_STATUSES = ("unsupported", "error", "crashed", "timeout", "mismatch")  # `mode.KIND_OF_STATUS`, probe errors aside


def _inventories(model_ids: list[str]) -> dict[str, Any]:
    from ci_runner.config import load_matrix
    from ci_runner.models.load import build_inputs, load_model
    from ci_runner.modes.ops.inventory import take_inventory

    matrix = load_matrix(None)
    models = {m.id: m for m in matrix.models}
    out = {}
    for mid in model_ids:
        loaded = load_model(models[mid], seed=0, meta=True)
        kwargs = build_inputs(loaded, _inputs_of(matrix, mid), sample=0, device="cpu")
        out[mid] = take_inventory(loaded.module, (), kwargs, level="aten", device="cpu")
    return out


def _inputs_of(matrix: Any, model_id: str) -> Any:
    from ci_runner.matrix import expand

    return next(c.inputs for c in expand(matrix) if c.model.id == model_id)


def _bare_compile_s(backend: Any, probe: dict[str, Any]) -> float:
    """`torch.compile` of the one-op function alone, from a reset Dynamo, compiled and run once (or failing)."""
    import torch

    from ci_runner.modes.ops.inputs import build_tensors
    from ci_runner.modes.ops.probe import assemble, resolve_op, select_outputs

    op = resolve_op(probe)
    tensors = build_tensors(probe["args"], probe["kwargs"], int(probe["seed"]))

    def fn(*ts: Any) -> Any:
        a, k = assemble(probe["args"], probe["kwargs"], ts, "cpu")
        return select_outputs(op(*a, **k), probe.get("outputs"))

    t0 = time.perf_counter()
    torch._dynamo.reset()
    try:
        backend.compile(fn)(*tensors)  # torch.compile(fn, backend=<the spec's compiler>)
    except Exception:  # an op the backend refuses costs its compile too
        pass
    return time.perf_counter() - t0


def per_probe_cost(spec: Any, probes: list[dict[str, Any]], opts: Any, work: Path) -> dict[str, Any]:
    from ci_runner.backends import resolve_backend
    from ci_runner.modes.ops.probe import ProbeRunner, run_probe

    backend = resolve_backend(spec)
    backend.prepare()
    run_probe(backend, probes[0], compare_results=True, tolerance=tuple(probes[0]["tolerance"]))  # warm-up
    _bare_compile_s(backend, probes[0])
    probe_s, bare_s = [], []
    for p in probes:  # alternate, so load changes hit both alike
        t0 = time.perf_counter()
        run_probe(backend, p, compare_results=True, tolerance=tuple(p["tolerance"]))
        probe_s.append(time.perf_counter() - t0)
        bare_s.append(_bare_compile_s(backend, p))
    single = _replace(opts, group_testing=False)
    t0 = time.perf_counter()
    ProbeRunner(backend_spec=spec, work_dir=work / "cost", opts=single, remaining=lambda: 3600.0).run(probes)
    child_s = (time.perf_counter() - t0) / len(probes)
    return {"n": len(probes), "probe_median_s": statistics.median(probe_s), "bare_median_s": statistics.median(bare_s),
            "probe_total_s": sum(probe_s), "bare_total_s": sum(bare_s), "child_per_probe_s": child_s}


def _replace(opts: Any, **kw: Any) -> Any:
    from dataclasses import replace

    return replace(opts, **kw)


def _compiles(work: Path, outcomes: dict[str, Any]) -> int:
    """Group compiles (journal tags `g:…`) plus single probes (outcomes decided alone)."""
    groups = 0
    for journal in work.glob("journal-*.log"):
        groups += sum(1 for line in journal.read_text().splitlines() if line.split("\t")[-1].startswith("g:")
                      and "enter-probe" in line)
    singles = sum(1 for o in outcomes.values() if not o.group)
    return groups + singles


def group_vs_single(spec: Any, probes: list[dict[str, Any]], opts: Any, work: Path) -> dict[str, Any]:
    from ci_runner.modes.ops.probe import ProbeRunner

    rows = {}
    for name, on in (("single", False), ("group", True)):
        w = work / f"{spec.id}-{name}"
        t0 = time.perf_counter()
        out = ProbeRunner(backend_spec=spec, work_dir=w, opts=_replace(opts, group_testing=on, workers=1),
                          remaining=lambda: 3600.0).run(probes)
        rows[name] = {"wall_s": time.perf_counter() - t0, "compiles": _compiles(w, out),
                      "status": {p["key"]: out[p["id"]].status.value for p in probes},
                      "together": sum(1 for o in out.values() if o.fails_together)}
    s, g = rows["single"], rows["group"]
    differ = [k for k in s["status"] if s["status"][k] != g["status"][k]]
    failing = sum(1 for v in s["status"].values() if v != "pass")
    findings = [{k for k, v in r["status"].items() if v in FINDING_STATUSES} for r in (s, g)]
    return {"backend": spec.id, "signatures": len(probes), "failing": failing,
            "counts": {name: dict(Counter(r["status"].values())) for name, r in rows.items()},
            "same_findings": findings[0] == findings[1],
            "single_compiles": s["compiles"], "group_compiles": g["compiles"],
            "compile_ratio": s["compiles"] / max(1, g["compiles"]), "single_wall_s": s["wall_s"],
            "group_wall_s": g["wall_s"], "wall_ratio": s["wall_s"] / max(1e-9, g["wall_s"]),
            "identical": not differ, "differ": differ[:5], "fails_together": g["together"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="sim-subset,inductor")
    ap.add_argument("--models", default="tiny-llama,tiny-granite,tiny-mixtral,tiny-vit,tiny-bamba,tiny-llava")
    ap.add_argument("--cost-n", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from ci_runner.config import BackendSpec
    from ci_runner.modes.ops.store import merge_inventories, probe_spec
    from ci_runner.registry import parse_options

    t0 = time.perf_counter()
    invs = _inventories(args.models.split(","))
    inv_s = time.perf_counter() - t0
    merged = merge_inventories(invs)
    opts = parse_options("ops", {"workers": 1})
    probes = [probe_spec(s, opts, f"s{i:05d}") for i, s in enumerate(merged.signatures) if s.probeable]
    report: dict[str, Any] = {"models": list(invs), "inventory_s": inv_s, "pairs": merged.pairs,
                              "distinct": len(merged.signatures), "dedup_factor": merged.factor, "backends": []}
    print(f"inventory of {len(invs)} models: {inv_s:.1f}s; (model, signature) pairs {merged.pairs} -> distinct "
          f"{len(merged.signatures)} (deduplication {merged.factor:.2f}x); probeable {len(probes)}")
    with tempfile.TemporaryDirectory(prefix="bench-probes-") as tmp:
        for bid in args.backends.split(","):
            spec = BackendSpec(id=bid, compile=bid)
            cost = per_probe_cost(spec, probes[: args.cost_n], opts, Path(tmp) / bid)
            print(f"[{bid}] per probe over {cost['n']}: run_probe {cost['probe_median_s'] * 1000:.0f} ms vs bare "
                  f"torch.compile {cost['bare_median_s'] * 1000:.0f} ms (median; ratio "
                  f"{cost['probe_median_s'] / cost['bare_median_s']:.2f}x); whole child per probe "
                  f"{cost['child_per_probe_s'] * 1000:.0f} ms")
            row = group_vs_single(spec, probes, opts, Path(tmp))
            print(f"[{bid}] {row['signatures']} signatures, {row['failing']} not passing: compiles one per probe "
                  f"{row['single_compiles']} vs group testing {row['group_compiles']} ({row['compile_ratio']:.1f}x "
                  f"fewer); wall {row['single_wall_s']:.0f}s vs {row['group_wall_s']:.0f}s "
                  f"({row['wall_ratio']:.1f}x); identical statuses: {row['identical']} {row['differ'] or ''}; "
                  f"fails-only-together sets: {row['fails_together']}")
            print(f"[{bid}] statuses one per probe {row['counts']['single']} vs group {row['counts']['group']}; "
                  f"same failing signatures (findings): {row['same_findings']}")
            report["backends"].append({**row, "cost": cost})
    if args.json:
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
