"""CPU-vs-CUDA reference thresholds, and the numerics mode's time on CUDA against CPU (needs a CUDA machine).

    python benchmarks/gpu_references.py --out DIR [--models tiny-llama,tiny-vit]

Runs the numerics mode of the bundled example's models twice, side by side in one process tree:
- `fp64`: references cpu/float32 (primary) and cpu/float64: the thresholds a CPU-only machine derives;
- `cuda`: references cpu/float32 (primary) and cuda/float32: the thresholds the dump-bisect method derives
  when a GPU is there (CPU vs CUDA);
each against inductor on CUDA as the target. It prints, per model, how the per-layer `rel`
and `1 − cos` thresholds of the two reference pairs compare (median and max ratio cuda/fp64), the findings
each pair gives on each target, and the wall time of each cell (derivation included), so that the CPU-only
defaults can be checked against what a real accelerator's reference deviation is.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "ci_runner" / "data" / "example.yaml"


def matrix(models: list[dict], second_ref: dict) -> dict:
    return {
        "version": 1,
        "defaults": {"modes": ["numerics"], "timeout": 900, "inputs": {"batch": 1, "seq_len": 16, "samples": 4, "seed": 0}},
        "references": [{"id": "cpu-fp32", "device": "cpu", "dtype": "float32"}, second_ref],
        "models": models,
        "backends": [
            {"id": "inductor-cuda", "compile": "inductor", "device": "cuda"},
        ],
    }


def thresholds(run: Path) -> dict[str, dict[str, dict[str, float]]]:
    """model id -> layer call key -> {rel, one_minus_cos} (cumulative view)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for f in sorted((run / "thresholds").glob("*.json")):
        data = json.loads(f.read_text())
        model = f.name.rsplit("-", 1)[0]
        table = out.setdefault(model, {})
        for key, entry in data.get("layers", {}).items():
            thr = entry.get("thresholds", {}).get("cumulative")
            if thr:
                table[key] = {"rel": float(thr["rel"]), "one_minus_cos": 1.0 - float(thr["cos"])}
    return out


def cells(run: Path) -> dict[str, dict]:
    res = json.loads((run / "report" / "results.json").read_text())
    return {c["id"]: c for c in res["cells"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--models", default="tiny-llama,tiny-vit")
    ap.add_argument("--jobs", default="2")
    args = ap.parse_args()
    import torch  # deferred: only to say what ran where

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs one", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; "
          f"cudnn.allow_tf32={torch.backends.cudnn.allow_tf32} matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}")
    wanted = args.models.split(",")
    models = [m for m in yaml.safe_load(EXAMPLE.read_text())["models"] if m["id"] in wanted]
    pairs = {"fp64": {"id": "cpu-fp64", "device": "cpu", "dtype": "float64"},
             "cuda": {"id": "cuda-fp32", "device": "cuda", "dtype": "float32"}}
    runs: dict[str, Path] = {}
    for name, ref in pairs.items():
        run = args.out / name
        run.mkdir(parents=True, exist_ok=True)
        m = run / "matrix.yaml"
        m.write_text(yaml.safe_dump(matrix(models, ref), sort_keys=False))
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "ci_runner", "run", str(m), "--out", str(run), "--jobs", args.jobs],
                           capture_output=True, text=True)
        print(f"[{name}] run exit {p.returncode} in {time.perf_counter() - t0:.1f} s wall")
        if p.returncode not in (0, 1):
            print(p.stdout[-3000:], p.stderr[-3000:])
        runs[name] = run
    thr = {k: thresholds(v) for k, v in runs.items()}
    for model in sorted(thr["fp64"]):
        a, b = thr["fp64"][model], thr["cuda"].get(model, {})
        common = [k for k in a if k in b]
        for metric in ("rel", "one_minus_cos"):
            ratios = [b[k][metric] / a[k][metric] for k in common if a[k][metric] > 0]
            if ratios:
                print(f"{model}: {metric} threshold cuda/fp64 over {len(ratios)} layers: median {statistics.median(ratios):.3g}, "
                      f"min {min(ratios):.3g}, max {max(ratios):.3g}")
        worst = sorted(common, key=lambda k: b[k]["rel"], reverse=True)[:3]
        for k in worst:
            print(f"  {k}: rel fp64 {a[k]['rel']:.2e} cuda {b[k]['rel']:.2e}; 1-cos fp64 {a[k]['one_minus_cos']:.1e} "
                  f"cuda {b[k]['one_minus_cos']:.1e}")
    for name, run in runs.items():
        for cid, c in sorted(cells(run).items()):
            num = c.get("modes", {}).get("numerics", {})
            print(f"[{name}] {cid}: {c['status']} in {c.get('duration_s', 0):.1f} s; "
                  f"{len(num.get('findings', []))} finding(s); {num.get('reason') or num.get('summary') or ''}"[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())
