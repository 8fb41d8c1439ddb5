"""The issue-38 architectures on both real compilers: each cell of `benchmarks/truth_archs.yaml` (parallel-block,
ALiBi, pure SSM, hybrid SSM + MoE + attention, shifted-window, depthwise-conv and encoder-decoder tiny models on
IREE `turbine_cpu` and OpenVINO, ops + layers + numerics) run by `deepview-ci run`, one cell at a time with a wall
limit, and one row per cell and mode: status, findings and reason. Too big for the suite (1.5-8 min a cell on 2
cores); run it when the capture, the watches or the grouping of causes change, and check every finding and every
pass by hand with plain torch.compile:

    PYTHONPATH=. python benchmarks/bench_truth_archs.py [--matrix benchmarks/truth_archs45.yaml] [--select 'tiny-bloom@*']
        [--timeout 1500] [--out DIR]

`benchmarks/truth_archs45.yaml` holds issue 45's eight architectures (the decoders with the users' workloads and the
compile mode).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MATRIX = Path(__file__).with_name("truth_archs.yaml")


def _cells(matrix: Path, select: str) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "ci_runner", "cells", str(matrix)], capture_output=True, text=True,
                         check=True).stdout.split()
    import fnmatch  # deferred: only here

    return [c for c in out if fnmatch.fnmatch(c, select)]


def _rows(results: Path) -> list[str]:
    rows = []
    for cell in json.loads(results.read_text(encoding="utf-8"))["cells"]:
        for mode, r in cell["modes"].items():
            found = "; ".join(f"{f['kind']} {f.get('module') or ''} {f.get('op') or ''}".strip()
                              for f in r.get("findings", []))
            rows.append(f"{cell['id']:<24} {mode:<9} {r['status']:<13} {found[:120]}  {(r.get('reason') or '')[:160]}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--matrix", default=str(MATRIX), help="the matrix (default: the issue-38 architectures)")
    ap.add_argument("--select", default="*", help="cells to run (glob over MODEL@BACKEND)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="wall limit per cell, seconds")
    ap.add_argument("--out", default=None, help="output folder (default: a new temporary one)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="truth-archs-"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path.cwd()), os.environ.get("PYTHONPATH")]))}
    for cell in _cells(Path(args.matrix), args.select):
        t0 = time.monotonic()
        try:
            subprocess.run([sys.executable, "-m", "ci_runner", "run", args.matrix, "--select", cell, "--out",
                            str(out / cell)], env=env, timeout=args.timeout, capture_output=True, check=False)
        except subprocess.TimeoutExpired:
            print(f"{cell:<24} TIMEOUT after {args.timeout:.0f} s")
            continue
        results = out / cell / "report" / "results.json"
        rows = _rows(results) if results.is_file() else [f"{cell:<24} no results.json"]
        print("\n".join(rows) + f"\n{'':<24} ({time.monotonic() - t0:.0f} s)", flush=True)
    print(f"results under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
