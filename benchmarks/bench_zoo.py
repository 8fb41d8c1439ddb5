"""Zoo scan cost and coverage (issue 21): the op inventory of every architecture of the installed transformers.

Runs the scan's inventory side (`ci_runner.zoo.scan.scan_inventories`: small configs on `meta`, many models per
child, `--jobs` children) over the selected architectures and prints, side by side:

* wall time and CPU seconds of the whole inventory, per architecture, and the whole zoo's time on 2 quiet cores
  estimated from them (target: every architecture ≤ 20 min on 2 cores);
* CPU seconds per stage, summed over the architectures (the records' `cpu_s`): config shrink, model build on
  meta, inputs, the fake copy, Dynamo's bytecode trace (with guards), aot_autograd, our graph walk, the rest of
  the trace; the children's start (imports) is the CPU total less those;
* N of M scanned, and the left-out reasons grouped (stage + error);
* coverage of the causal-LM and image-classification architectures (target ≥ 80 %);
* distinct (op, signature) vs (model, signature) pairs: the deduplication factor (`modes.ops.store.merge_inventories`);
* per family: scanned / all.

Records land in `--out` (reused by a second run: `--fresh` starts over). `uptime` load is printed: on a shared
machine the wall time is an upper bound (CPU seconds are not). `--compare DIR` checks that this run's records
have the same inventories as DIR's (another run's `--out`, e.g. of the code before a speed change): the same
signatures and call sites per architecture, the same architectures scanned.

    PYTHONPATH=. python benchmarks/bench_zoo.py [--select 'llama,bert,vit*'] [--jobs 2] [--out /tmp/zoo-bench]
        [--compare /tmp/zoo-bench-before]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
from collections import Counter
from pathlib import Path

from ci_runner.modes.ops.signature import Inventory
from ci_runner.results.model import read_json
from ci_runner.modes.ops.store import merge_inventories
from ci_runner.zoo.catalog import catalog, expand_selection
from ci_runner.zoo.report import group_reasons
from ci_runner.zoo.catalog import model_types
from ci_runner.zoo.scan import ScanOptions, record_path, scan_inventories

TIMING_KEYS = ("duration_s",)  # inventory fields that measure the run, not the model


def comparable(record: dict) -> dict:
    """A record's content: the inventory without its timing, or the left-out stage."""
    if "inventory" not in record:
        return {"left_out": record["left_out"]["stage"]}
    inv = {k: v for k, v in record["inventory"].items() if k not in TIMING_KEYS}
    return {"shrink": record.get("shrink"), "inventory": inv}


def compare(records: dict, other: Path) -> list[str]:
    """Architectures whose record differs from `other`'s (another run's records folder)."""
    diffs = []
    for t, rec in records.items():
        path = record_path(other, t)
        if not path.exists():
            diffs.append(f"{t}: no record in {other}")
        elif comparable(rec) != comparable(read_json(path, what="zoo scan record")):
            diffs.append(f"{t}: differs")
    return diffs


def stage_cpu(records: dict) -> dict[str, float]:
    total: Counter = Counter()
    for r in records.values():
        total.update(r.get("cpu_s") or {})
    return {k: round(v, 1) for k, v in total.most_common()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--select", default="", help="comma-separated model_types or globs (default: all)")
    ap.add_argument("--exclude", default="")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=180.0, help="per-model limit, seconds")
    ap.add_argument("--level", default="aten")
    ap.add_argument("--out", default="/tmp/deepview-zoo-bench")
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    ap.add_argument("--compare", default="", help="another run's --out: check the inventories are identical")
    args = ap.parse_args()
    out = Path(args.out)
    if args.fresh:
        shutil.rmtree(out, ignore_errors=True)
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    types = expand_selection(split(args.select), split(args.exclude), place=lambda key, i: f"--{key}[{i}]")
    t0 = time.monotonic()
    entries = {z.model_type: z for z in catalog(types)}
    t_cat = time.monotonic() - t0
    info = {t: {"family": z.family, "task": z.task, "class": z.class_name} for t, z in entries.items()}
    t1 = time.monotonic()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    records = scan_inventories(types, ScanOptions(out_dir=out, level=args.level, jobs=args.jobs,
                                                  per_model_timeout=args.timeout), info)
    t_scan = time.monotonic() - t1
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    scanned = {t: r for t, r in records.items() if "inventory" in r}
    merged = merge_inventories({t: Inventory.from_dict(r["inventory"]) for t, r in scanned.items()})
    op_sets = {t: {s["op"] for s in r["inventory"]["signatures"]} for t, r in scanned.items()}
    op_pairs, ops = sum(len(v) for v in op_sets.values()), set().union(*op_sets.values()) if op_sets else set()
    cover = {}
    for task in ("causal-lm", "image-classification"):
        have = [t for t, z in entries.items() if z.task == task]
        cover[task] = [sum(1 for t in have if t in scanned), len(have)]
    fams = Counter(z.family for z in entries.values())
    fam_scanned = Counter(entries[t].family for t in scanned)
    figures = {
        "architectures": len(types), "scanned": len(scanned), "catalog_s": round(t_cat, 1),
        "inventory_s": round(t_scan, 1), "inventory_cpu_s": round(cpu_s, 1),
        "on_2_quiet_cores_s": round(cpu_s / 2, 1), "jobs": args.jobs, "load": os.getloadavg(),
        "per_scanned_model_s": round(t_scan / max(1, len(scanned)), 2),
        "pairs": merged.pairs, "distinct": len(merged.signatures), "dedup_factor": round(merged.factor, 2),
        "op_pairs": op_pairs, "distinct_ops": len(ops),
        "coverage": cover, "families": {f: [fam_scanned.get(f, 0), n] for f, n in sorted(fams.items())},
        "left_out": group_reasons({t: r["left_out"] for t, r in records.items() if "left_out" in r}),
        "shrink": dict(Counter(r.get("shrink") for r in scanned.values())),
        "stage_cpu_s": stage_cpu(records), "cpu_per_architecture_s": round(cpu_s / max(1, len(types)), 2),
        "whole_zoo_on_2_cores_min": round(cpu_s / max(1, len(types)) * len(model_types()) / 120, 1),
        "whole_zoo_types": len(model_types()),
    }
    print(f"zoo inventory: {len(scanned)} of {len(types)} architectures scanned in {t_scan:.0f} s "
          f"({args.jobs} jobs; catalog {t_cat:.0f} s; load {figures['load'][0]:.1f}); CPU {cpu_s:.0f} s "
          f"= {cpu_s / 120:.1f} min on 2 quiet cores")
    print(f"CPU per architecture {figures['cpu_per_architecture_s']} s -> the whole zoo ({figures['whole_zoo_types']}) "
          f"~{figures['whole_zoo_on_2_cores_min']} min on 2 quiet cores")
    stages = figures["stage_cpu_s"]
    print(f"CPU per stage (s): {stages}; children's start and the rest: {cpu_s - sum(stages.values()):.0f}")
    print(f"signatures: {merged.pairs} (model, signature) pairs -> {len(merged.signatures)} distinct "
          f"(dedup factor {merged.factor:.1f})")
    print(f"ops: {op_pairs} (model, op) pairs -> {len(ops)} distinct ops (factor {op_pairs / max(1, len(ops)):.1f})")
    for task, (n, m) in cover.items():
        print(f"coverage {task}: {n} of {m} ({100 * n / max(1, m):.0f} %)")
    for fam, (n, m) in figures["families"].items():
        print(f"  {fam:16s} {n:4d} of {m:4d}")
    print("left out, grouped:")
    for g in figures["left_out"][:40]:
        print(f"  {len(g['models']):4d}  {g['stage']:8s} {g['reason'][:110]}  e.g. {', '.join(g['models'][:4])}")
    if args.compare:
        diffs = compare(records, Path(args.compare))
        figures["compare"] = {"with": args.compare, "architectures": len(records), "differ": diffs}
        print(f"inventories vs {args.compare}: {len(records) - len(diffs)} of {len(records)} identical"
              + "".join(f"\n  {d}" for d in diffs))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
