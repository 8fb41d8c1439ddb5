"""Cost of the decode phase: a cell with `phases: [prefill, {decode: {steps: 8}}]` against the same cell with
`phases: [prefill]`, side by side in one run (issue 32's goal: at most 2×).

Each variant is one `deepview-ci run` of a one-cell matrix (a tiny Llama of the bundled example × `--backend`, the
modes of `--modes`) in a fresh output folder, alternated `--repeat` times; the figures are the best wall time and
the CPU seconds of the run and its children (`getrusage(RUSAGE_CHILDREN)`), since a shared machine only adds time.
The single forward's work (every mode's default analysis) is in both; the difference is the phase work.

    PYTHONPATH=. python benchmarks/bench_phases.py [--backend aot_eager --modes ops,layers,numerics --repeat 2]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128}


def matrix(phases: list, backend: str, modes: list[str], seq_len: int) -> str:
    return yaml.safe_dump({
        "version": 1,
        "defaults": {"modes": modes, "timeout": 1800, "inputs": {"seq_len": seq_len, "samples": 1, "phases": phases}},
        "models": [{"id": "tiny-llama", "config": "llama", "overrides": LLAMA}],
        "backends": [{"id": "b", "compile": backend}],
    }, sort_keys=False)


def one_run(text: str, work: Path) -> tuple[float, float]:
    """Wall and CPU seconds (this process's children) of one `deepview-ci run`."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "m.yaml").write_text(text)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ci_runner", "run", str(work / "m.yaml"), "--out", str(work / "out"),
                           "--jobs", "1"], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--modes", default="ops,layers,numerics")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    modes = args.modes.split(",")
    variants = {"prefill": matrix(["prefill"], args.backend, modes, args.seq_len),
                f"prefill+{args.steps} decode": matrix(["prefill", {"decode": {"steps": args.steps}}], args.backend,
                                                       modes, args.seq_len)}
    best: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-phases-") as tmp:
        for _ in range(args.repeat):
            for name, text in variants.items():
                wall, cpu = one_run(text, Path(tmp) / name.replace(" ", "_").replace("+", "_"))
                w0, c0 = best.get(name, (float("inf"), float("inf")))
                best[name] = (min(w0, wall), min(c0, cpu))
    (wp, cp), (wd, cd) = best["prefill"], best[f"prefill+{args.steps} decode"]
    print(f"backend {args.backend}, modes {args.modes}, seq_len {args.seq_len}, best of {args.repeat}")
    for name, (wall, cpu) in best.items():
        print(f"  {name:<22} wall {wall:7.1f} s   cpu {cpu:7.1f} s")
    print(f"ratio decode/prefill: wall {wd / wp:.2f}x, cpu {cd / cp:.2f}x (goal <= 2x)")


if __name__ == "__main__":
    main()
