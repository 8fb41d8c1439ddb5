"""Issue 43 on real compilers: OpenVINO at bf16 and inductor on bf16 models, over the bundled example's models.

    python benchmarks/bench_precision_real.py [--out DIR] [--models tiny-llama,minilm] [--skip-run]

Builds one matrix from the bundled example's seven models (`ci_runner/data/example.yaml`), with `precision: auto`
(the default) everywhere:

- `ov-bf16`: OpenVINO with `INFERENCE_PRECISION_HINT: bf16`: its default on a CPU with avx512_bf16/AMX, forced here
  so that any CPU computes what such a CPU computes (OpenVINO emulates bf16 where the CPU lacks it), ops and
  numerics modes;
- `ov-f32`: the docs' f32 recipe (docs/backends.md), ops and numerics modes: the control;
- `inductor` on each model loaded in bfloat16 (`dtype: bfloat16` on the model), numerics mode.

Then prints per cell the detected policy and the findings, and the findings of `ov-bf16` that `ov-f32` does not
have on the same model (by kind and module/op): the ones bf16 could have caused. The goal: none, `bfloat16` detected
for `ov-bf16` and `float32` for `ov-f32`; and inductor on the bf16 models with 0 findings.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

import yaml

OV = {"aot_autograd": True, "testing": True}


def matrix(models: list[str] | None) -> dict:
    example = yaml.safe_load(resources.files("ci_runner").joinpath("data/example.yaml").read_text(encoding="utf-8"))
    base = [m for m in example["models"] if not models or m["id"] in models]
    low = [{**m, "id": f"{m['id']}-bf16", "dtype": "bfloat16"} for m in base]
    return {
        "version": 1,
        "defaults": {"modes": ["ops", "numerics"], "timeout": 1500, "inputs": example["defaults"]["inputs"],
                     "options": {"ops": {"workers": 1}}},
        "references": example["references"],
        "models": base + low,
        "backends": [
            {"id": "ov-bf16", "compile": "openvino", "device": "cpu",
             "compile_options": {"options": {**OV, "config": {"INFERENCE_PRECISION_HINT": "bf16"}}}},
            {"id": "ov-f32", "compile": "openvino", "device": "cpu",
             "compile_options": {"options": {**OV, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}},
            {"id": "inductor", "compile": "inductor", "device": "cpu", "modes": ["numerics"]},
        ],
        "exclude": [{"model": m["id"], "backend": "inductor"} for m in base]
        + [{"model": m["id"], "backend": b} for m in low for b in ("ov-bf16", "ov-f32")],
    }


def where(f: dict) -> str:
    return f"{f.get('kind')}:{f.get('op') or f.get('module') or ''}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--models", default="")
    ap.add_argument("--skip-run", action="store_true", help="only print the table of an earlier --out")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-precision-real-"))
    if not args.skip_run:
        out.mkdir(parents=True, exist_ok=True)
        path = out / "matrix.yaml"
        path.write_text(yaml.safe_dump(matrix([m for m in args.models.split(",") if m])), encoding="utf-8")
        subprocess.run([sys.executable, "-m", "ci_runner", "run", str(path), "--out", str(out / "run"), "--jobs", "1"],
                       check=False)
    results = json.loads((out / "run" / "report" / "results.json").read_text(encoding="utf-8"))
    cells = {(c["model"]["id"] if isinstance(c.get("model"), dict) else c["id"].split("@")[0],
              c["id"].split("@")[1]): c for c in results["cells"]}
    print("| cell | mode | status | detected policy | findings |")
    print("|---|---|---|---|---|")
    for (model, backend), c in sorted(cells.items()):
        for name, m in c.get("modes", {}).items():
            policy = (m.get("data") or {}).get("precision", {}).get("policy", "")
            print(f"| {model}@{backend} | {name} | {m.get('status')} | {policy} | {len(m.get('findings') or [])} |")
    print("\nov-bf16 findings that ov-f32 does not have on the same model (what bf16 could have caused):")
    extra = 0
    for (model, backend), c in sorted(cells.items()):
        if backend != "ov-bf16" or (model, "ov-f32") not in cells:
            continue
        control = cells[(model, "ov-f32")]
        for name, m in c.get("modes", {}).items():
            seen = {where(f) for f in (control.get("modes", {}).get(name, {}).get("findings") or [])}
            for f in m.get("findings") or []:
                if where(f) not in seen:
                    extra += 1
                    print(f"  {model} {name}: {f.get('message', '')[:240]}")
    print(f"  {extra} finding(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
