"""What a tensor-parallel cell costs against its single-rank cell, and whether TP 2 of the example's decoders is
clean on real compilers: the numerics mode on each model × backend twice in one run, once on one rank
(`parallel: null`) and once with `parallel: {tp: 2}` (which runs the single-rank comparison too, then the sharded
model on 2 gloo ranks). Prints per pair: both cells' status and seconds, the ratio (target: ≤ 3×), and the TP
findings. Exit 1 when a TP cell has a finding or a ratio is over 3.

    PYTHONPATH=. python benchmarks/bench_parallel.py [--backends aot_eager,inductor] [--models tiny-llama,tiny-granite]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from ci_runner.config import load_matrix

OPENVINO_RECIPE = {"options": {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}
TARGET_RATIO = 3.0


def matrix(models: list[str], backends: list[str]) -> dict:
    example = load_matrix(None).raw
    entries = [dict(m) for m in example["models"] if m["id"] in models]
    rows = []
    for b in backends:
        base = {"compile": b, "device": "cpu", **({"compile_options": OPENVINO_RECIPE} if b == "openvino" else {})}
        rows += [{"id": f"{b}-1rank", **base, "parallel": None}, {"id": f"{b}-tp2", **base, "parallel": {"tp": 2}}]
    return {"version": 1, "defaults": {"modes": ["numerics"], "timeout": 1800, "inputs": example["defaults"]["inputs"]},
            "models": entries, "backends": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="aot_eager")
    ap.add_argument("--models", default="tiny-llama")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    path = work / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix(args.models.split(","), args.backends.split(",")), sort_keys=False))
    subprocess.run([sys.executable, "-m", "ci_runner", "run", str(path), "--out", str(work / "out"), "--jobs", "1"],
                   check=False)
    cells = {c["id"]: c for c in json.loads((work / "out" / "report" / "results.json").read_text())["cells"]}
    bad = 0
    for model in args.models.split(","):
        for b in args.backends.split(","):
            one, tp = cells[f"{model}@{b}-1rank"], cells[f"{model}@{b}-tp2"]
            num = tp["modes"]["numerics"]
            found = [f for f in num["findings"] if f.get("parallel")]
            ratio = tp["duration_s"] / max(one["duration_s"], 1e-9)
            bad += bool(found) or ratio > TARGET_RATIO
            print(f"{model} {b}: 1 rank {one['status']} {one['duration_s']:.1f}s | tp2 {tp['status']} "
                  f"{tp['duration_s']:.1f}s (TP part {num['data'].get('parallel', {}).get('seconds')}s) | "
                  f"ratio {ratio:.2f}x | TP findings {len(found)}")
            for f in found:
                print(f"    {f['kind']} {f.get('op') or f.get('module')}: {f['message'][:300]}")
    print(f"results: {work / 'out' / 'report'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
