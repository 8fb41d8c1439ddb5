"""What the compile mode costs in a cell that also runs ops, layers and numerics: its signals read from the layers
mode's compiled run of each phase (`compile.reuse: true`, the default) against the mode compiling every phase again
(`reuse: false`, what it did before). Both cells run at once (one run each, side by side, under the same load):
process wall and CPU seconds of `deepview-ci run` (its cell worker and repro children included), the compile mode's
own seconds from results.json, and whether its figures (graphs, breaks, recompiles, per-call graphs, findings) are
the same either way.

    PYTHONPATH=. python benchmarks/bench_compile_reuse.py [--backend aot_eager] [--out DIR]
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
from typing import Any

import yaml

LLAMA = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64}
TIMING = ("compile_s", "seconds", "run_by", "trace")  # trace: each run's own records


def matrix(backend: str, reuse: bool) -> dict[str, Any]:
    return {"version": 1, "defaults": {
        "modes": ["ops", "layers", "numerics", "compile"],
        "inputs": {"seq_len": 8, "samples": 1, "phases": [{"decode": {"steps": 2}}, {"long": {"seq_len": [8, 12, 16]}}]},
        "options": {"compile": {"reuse": reuse}}},
        "models": [{"id": "llama", "config": "llama", "overrides": LLAMA}],
        "backends": [{"id": "b", "compile": backend}]}


def start(out: Path, backend: str, reuse: bool) -> tuple[subprocess.Popen[bytes], float]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "matrix.yaml").write_text(yaml.safe_dump(matrix(backend, reuse), sort_keys=False))
    cmd = [sys.executable, "-m", "ci_runner", "run", str(out / "matrix.yaml"), "--out", str(out / "run"),
           "--jobs", "1"]
    log = open(out / "log.txt", "wb")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)), time.monotonic()


def plain(phases: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, row in phases.items():
        r = {k: v for k, v in row.items() if k not in TIMING}
        r["per_call"] = [{k: v for k, v in c.items() if k != "compile_s"} for c in row.get("per_call", [])]
        out[name] = r
    return out


def compile_mode(out: Path) -> dict[str, Any]:
    res = json.loads((out / "run" / "report" / "results.json").read_text())
    cell = res["cells"][0]
    return {"modes": {m: round(r.get("duration_s") or 0.0, 1) for m, r in cell["modes"].items()},
            "compile": cell["modes"]["compile"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(args.out or tempfile.mkdtemp(prefix="compile-reuse-"))
    procs = {name: start(work / name, args.backend, reuse) for name, reuse in (("own", False), ("reuse", True))}
    rows: dict[str, Any] = {}
    by_pid = {proc.pid: name for name, (proc, _) in procs.items()}
    while len(rows) < len(procs):  # whichever ends first: its wall time is its own
        pid, status, usage = os.wait4(-1, 0)
        if pid not in by_pid:
            continue
        name = by_pid[pid]
        proc, t0 = procs[name]
        proc.returncode = os.waitstatus_to_exitcode(status)
        rows[name] = {"wall": time.monotonic() - t0, "cpu": usage.ru_utime + usage.ru_stime, "rc": proc.returncode}
    for name in rows:
        rows[name].update(compile_mode(work / name))
    rows = {name: rows[name] for name in procs}
    print(f"{'compile.reuse':<14} {'rc':>3} {'wall s':>7} {'CPU s':>7}  per mode (s)")
    for name, r in rows.items():
        print(f"{name:<14} {r['rc']:>3} {r['wall']:>7.1f} {r['cpu']:>7.1f}  {r['modes']}")
    a, b = rows["own"]["compile"], rows["reuse"]["compile"]
    same = plain(a["data"]["phases"]) == plain(b["data"]["phases"]) and \
        sorted(f["fingerprint"] for f in a["findings"]) == sorted(f["fingerprint"] for f in b["findings"])
    print("run_by per phase:", {p: r.get("run_by") for p, r in b["data"]["phases"].items()})
    print("figures and findings the same either way:", same)
    print("folder:", work)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
