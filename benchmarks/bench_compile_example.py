"""Is the compile mode stable over the bundled example? Issue 33's done-when 4: aot_eager and inductor over the
bundled example's models with `compile` in their modes, run twice; the compile figures that are signals (graphs,
graph breaks, recompiles, eager fallbacks, eager after the limit, per-call graphs: everything but compile seconds)
must be equal between the runs, the findings the same, and the bundled example's own findings unchanged.

The matrix is `ci_runner/data/example.yaml` with one backend added, `aot_eager` (modes `[compile]`, every model),
inductor's modes `[numerics, compile]` (the example's one cell, tiny-llama@inductor) and a backend `inductor-c`
(inductor, modes `[compile]`) over every other model (the example keeps them off inductor; `--inductor-models`
keeps it shorter). Run 1 is the whole matrix (the
self-test cells too); run 2 only the aot_eager and inductor cells. Then:

- `deepview-ci diff` of run 1 against `baselines/example.json`: the example's own cells must be unchanged (0
  regressed, 0 fixed outside the compile mode; the new cells are `new_cell`, the compile mode's findings in
  tiny-llama@inductor would be `regressed`: listed);
- a baseline made from run 1 (`deepview-ci baseline update`), run 2 diffed against it: 0 regressed, 0 fixed;
- `data.phases` of every compile cell, run 1 vs run 2, all keys but timing: equal.

    PYTHONPATH=. python benchmarks/bench_compile_example.py --out DIR [--jobs auto] [--inductor-models all|GLOB]

Exit 0 when all three hold. It takes many minutes (inductor compiles C++ per model).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "ci_runner" / "data" / "example.yaml"
BASELINE = ROOT / "baselines" / "example.json"
TIMING = ("compile_s", "seconds", "trace")  # trace: each run's own records (its size differs)
COMPILE_CELLS = ("*@aot_eager", "*@inductor", "*@inductor-c")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ci_runner", *args]


def matrix(inductor_models: str) -> dict[str, Any]:
    """The example with aot_eager added and inductor running `compile` over the chosen models."""
    m = yaml.safe_load(EXAMPLE.read_text())
    for b in m["backends"]:
        if b["id"] == "inductor":
            b["modes"] = ["numerics", "compile"]  # the example's tiny-llama@inductor cell, compile added
    m["backends"] += [{"id": "aot_eager", "compile": "aot_eager", "device": "cpu", "modes": ["compile"]},
                      {"id": "inductor-c", "compile": "inductor", "device": "cpu", "modes": ["compile"]}]
    ids = [md["id"] for md in m["models"]]
    m["exclude"] += [{"model": mid, "backend": "inductor-c"} for mid in ids
                     if mid == "tiny-llama" or not (inductor_models == "all" or fnmatch.fnmatch(mid, inductor_models))]
    return m


def _run(mat: Path, out: Path, jobs: str, select: tuple[str, ...]) -> float:
    sel = [a for s in select for a in ("--select", s)]
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "wb") as log:
        subprocess.run(_cli("run", str(mat), "--out", str(out), "--jobs", jobs, "--force", *sel),
                       stdout=log, stderr=subprocess.STDOUT, check=False)
    return time.perf_counter() - t0


def plain(row: dict[str, Any]) -> dict[str, Any]:
    """A phase row without its timing (compile seconds are a measurement, not a signal)."""
    r = {k: v for k, v in row.items() if k not in TIMING}
    r["per_call"] = [{k: v for k, v in c.items() if k not in TIMING} for c in row.get("per_call", [])]
    return r


def phases(results: Path) -> dict[str, Any]:
    res = json.loads(results.read_text())
    out = {}
    for cell in res["cells"]:
        mode = (cell.get("modes") or {}).get("compile")
        if mode:
            out[cell["id"]] = {p: plain(r) for p, r in ((mode.get("data") or {}).get("phases") or {}).items()}
    return out


def diff(results: Path, baseline: Path, out: Path) -> dict[str, Any]:
    subprocess.run(_cli("diff", str(results), "--baseline", str(baseline), "--fail-on", "never", "--out", str(out)),
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, check=False)
    return json.loads((out / "diff.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", default="auto")
    ap.add_argument("--inductor-models", default="all", help="models inductor runs `compile` over (glob; default all)")
    ap.add_argument("--compare-only", action="store_true", help="keep run 1 and run 2 where they exist: compare only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    mat = args.out / "matrix.yaml"
    m = matrix(args.inductor_models)
    mat.write_text(yaml.safe_dump(m, sort_keys=False))
    for name, select in (("run1", ()), ("run2", COMPILE_CELLS)):
        res = args.out / name / "report" / "results.json"
        if args.compare_only and res.is_file():
            continue
        wall = _run(mat, args.out / name, args.jobs, select)
        print(f"{name}: {wall:.0f} s wall")
    r1, r2 = (args.out / n / "report" / "results.json" for n in ("run1", "run2"))
    d0 = diff(r1, BASELINE, args.out / "diff_example")
    entries = d0.get("entries", [])
    other = [e for e in entries if e.get("category") in ("regressed", "fixed") and e.get("mode") != "compile"]
    comp = [e for e in entries if e.get("category") in ("regressed", "fixed") and e.get("mode") == "compile"]
    print(f"run 1 vs {BASELINE.relative_to(ROOT)}: {d0.get('counts')}")
    print(f"  regressed/fixed outside the compile mode: {len(other)}")
    for e in other + comp:
        print(f"  {e.get('category')} {e.get('cell')} {e.get('mode')} {e.get('kind')} {e.get('key')}: {e.get('reason')}")
    base1 = args.out / "baseline_run1.json"
    subprocess.run(_cli("baseline", "update", str(r1), "--out", str(base1)), check=True,
                   stdout=subprocess.DEVNULL)
    d1 = diff(r2, base1, args.out / "diff_runs")
    n = d1.get("counts", {})
    print(f"run 2 vs run 1's baseline: {n}")
    p1, p2 = phases(r1), phases(r2)
    unequal = sorted(c for c in set(p1) | set(p2) if p1.get(c) != p2.get(c))
    print(f"compile cells: {len(p1)} in run 1, {len(p2)} in run 2; data.phases unequal (timing aside): {unequal or 'none'}")
    for c in unequal:
        print(f"  {c}:\n    run 1 {json.dumps(p1.get(c))[:1500]}\n    run 2 {json.dumps(p2.get(c))[:1500]}")
    for c in sorted(p1):
        for ph, row in p1[c].items():
            print(f"  {c:<24} {ph:<8} graphs {row.get('graphs')} breaks {len(row.get('graph_breaks') or [])} "
                  f"recompiles {len(row.get('recompiles') or [])} fallbacks {len(row.get('eager_fallbacks') or [])} "
                  f"after_limit {row.get('eager_after_limit')} run_by {row.get('run_by')}")
    ok = not other and not n.get("regressed") and not n.get("fixed") and not unequal
    print("stable: yes" if ok else "stable: NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
