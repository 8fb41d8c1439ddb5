"""What a tensor-parallel cell costs against its single-rank cell, and whether TP 2 of the example's decoders is
clean on real compilers: the numerics mode on each model × backend twice, once on one rank (`parallel: null`) and
once with `parallel: {tp: 2}` (which runs the single-rank comparison too, with the sharded model on 2 gloo ranks
beside it). Each cell is a `deepview-ci run --select` of its own, one after the other, with its own output folder
(no thresholds cache shared between the two) and its own empty inductor cache (both cells compile cold; with one
cache the TP cell's single-rank part would reuse the single-rank cell's C++ builds). Prints per pair: both cells'
status, seconds and CPU seconds (the run and every child), the load average when each ended, the TP part's seconds and what the cell waited for it, the
ratio (target: ≤ 3×) and the TP findings. Exit 1 when a TP cell has a finding or a ratio is over 3.

    PYTHONPATH=. python benchmarks/bench_parallel.py [--backends aot_eager,inductor] [--models tiny-llama,tiny-granite]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def run_cell(path: Path, cell: str, work: Path) -> tuple[dict, str]:
    """One cell in a `deepview-ci run` of its own (own output folder, own empty inductor cache); (its result, the
    load average when it ended)."""
    out = work / cell.replace("@", "_")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor-cache")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "ci_runner", "run", str(path), "--out", str(out), "--jobs", "1",
                    "--select", cell], check=False, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run, its worker and every child they waited for
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    cells = json.loads((out / "report" / "results.json").read_text())["cells"]
    found = next(c for c in cells if c["id"] == cell)
    return {**found, "cpu_s": cpu}, "{:.0f} CPU s, load {:.1f}, {:.1f}, {:.1f}".format(cpu, *os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="aot_eager")
    ap.add_argument("--models", default="tiny-llama")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    path = work / "matrix.yaml"
    path.write_text(yaml.safe_dump(matrix(args.models.split(","), args.backends.split(",")), sort_keys=False))
    bad = 0
    lines = []
    for model in args.models.split(","):
        for b in args.backends.split(","):
            one, load1 = run_cell(path, f"{model}@{b}-1rank", work)
            tp, load2 = run_cell(path, f"{model}@{b}-tp2", work)
            num = tp["modes"]["numerics"]
            found = [f for f in num["findings"] if f.get("parallel")]
            par = num["data"].get("parallel", {})
            ratio = tp["duration_s"] / max(one["duration_s"], 1e-9)
            bad += bool(found) or ratio > TARGET_RATIO
            lines.append(f"{model} {b}: 1 rank {one['status']} {one['duration_s']:.1f}s ({load1}) | tp2 {tp['status']} "
                         f"{tp['duration_s']:.1f}s ({load2}; TP part {par.get('seconds')}s, waited for "
                         f"{par.get('waited_s')}s, TP {par.get('status')}) | ratio {ratio:.2f}x "
                         f"(CPU {tp['cpu_s'] / max(one['cpu_s'], 1e-9):.2f}x) | TP findings {len(found)}")
            lines += [f"    {f['kind']} {f.get('op') or f.get('module')}: {f['message'][:300]}" for f in found]
            print(lines[-1 - len(found)], flush=True)
    print("\n".join(lines))
    print(f"results: {work}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
