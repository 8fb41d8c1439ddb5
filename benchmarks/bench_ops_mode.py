"""The whole `ops` mode on tiny Bamba × sim-subset, repros verified: wall time, phases, time per repro.

Runs one cell through the real pipeline (`deepview-ci run … --modes ops`, the cell in its own worker process) and
prints the mode's phases from its result: inventory, probing (isolated children), rendering and verifying the
repros (each run in a fresh process). Goal: ≤ 20 s for the mode and ≤ 1 s per repro. Wall time depends on what
else runs on the machine: the CPU time of the whole process tree and the load average are printed too.

    PYTHONPATH=. python benchmarks/bench_ops_mode.py [--backend sim-subset|simdev] [--workers 2] [--json]
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

MATRIX = """
version: 1
defaults:
  modes: [ops]
  timeout: 900
  inputs: {{batch: 1, seq_len: 16, samples: 1, seed: 0}}
  options: {{ops: {{workers: {workers}}}}}
models:
  - id: tiny-bamba
    config: bamba
    overrides: {{hidden_size: 64, intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4,
                num_key_value_heads: 2, vocab_size: 128, max_position_embeddings: 128, attn_layer_indices: [1],
                mamba_n_heads: 4, mamba_d_head: 32, mamba_d_state: 16, mamba_n_groups: 1, mamba_chunk_size: 16}}
backends:
  - {{id: sim-subset, compile: sim-subset, device: cpu}}
  - {{id: simdev, device: simdev}}
"""


def _children_cpu_s() -> float:
    """CPU seconds of finished child processes and their descendants (the CLI, its cell worker, probes, repros)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="sim-subset", choices=["sim-subset", "simdev"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        matrix = Path(tmp) / "matrix.yaml"
        matrix.write_text(MATRIX.format(workers=args.workers), encoding="utf-8")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        t0, c0 = time.perf_counter(), _children_cpu_s()
        load = os.getloadavg()[0]
        proc = subprocess.run([sys.executable, "-m", "ci_runner", "run", str(matrix), "--out", str(Path(tmp) / "out"),
                               "--modes", "ops", "--select", f"tiny-bamba@{args.backend}", "--force"],
                              cwd=root, env=env, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
        result = Path(tmp) / "out" / "cells" / f"tiny-bamba@{args.backend}" / "result.json"
        if not result.exists():
            print(proc.stdout + proc.stderr, file=sys.stderr)
            return 2
        mode = json.loads(result.read_text(encoding="utf-8"))["modes"]["ops"]
    timings = mode["data"].get("timings", {})
    findings = mode["findings"]
    verified = sum(1 for f in findings if f["repro"] and f["repro"]["verified"])
    n = max(1, len(findings))
    report = {
        "cell": f"tiny-bamba@{args.backend}", "status": mode["status"], "workers": args.workers,
        "mode_s": round(mode["duration_s"], 2), "cli_wall_s": round(wall, 2), "cli_cpu_s": round(cpu, 2),
        "load_avg_1m": round(load, 2), **timings,
        "probes": mode["data"]["probe_counts"].get("total"), "failing_ops": len(findings), "verified": verified,
        "verify_s_per_repro": round(timings.get("verify_s", 0.0) / n, 2),
        "verify_cpu_note": "each repro is a fresh python: import torch + torch.compile's first call",
        "goal": "mode <= 20 s, <= 1 s per repro", "ops": sorted(f["op"] for f in findings),
    }
    report["meets_goal"] = mode["duration_s"] <= 20.0 and report["verify_s_per_repro"] <= 1.0
    if args.json:
        print(json.dumps(report))
    else:
        width = max(len(k) for k in report)
        for k, v in report.items():
            print(f"{k:<{width}}  {v}")
    return 0 if verified == len(findings) else 1


if __name__ == "__main__":
    sys.exit(main())
