"""Slow compilers on busy runners (issue 44): the bundled example's decoder models on `sim-slow` (a correct backend whose
compile of each graph spends `--seconds` of CPU time) with two CPU-burning processes per core beside the run, against
the same models on `aot_eager` on a quiet machine. A slow compile must be a figure, never a finding: the findings
should be equal, with no hang and no timeout, under the documented default cell timeout (900 s) and the example's
modes and options. Beside them, in the busy run, a real hang (`sim-hang` on tiny-llama's attention, layers mode)
must still be found, measured as a hang, with a repro that stays stuck. Prints, per backend: findings, hangs
(timeout findings), timed-out cells, the wall time, and the compiles per mode and phase (`data.compiles`).

    PYTHONPATH=. python benchmarks/bench_slow.py [--seconds 20] [--modes ops,layers,numerics] [--timeout 900]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from ci_runner.config import DEFAULT_TIMEOUT_S

EXAMPLE = Path(__file__).resolve().parents[1] / "ci_runner" / "data" / "example.yaml"
DECODERS = ("tiny-llama", "tiny-granite", "tiny-bamba", "tiny-mixtral")


def _burn() -> None:
    while True:
        pass


def matrix(seconds: float, modes: list[str], timeout: int) -> dict[str, Any]:
    example = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    return {"version": 1,
            "defaults": {**example["defaults"], "modes": modes, "timeout": timeout},
            "references": example["references"],
            "models": [m for m in example["models"] if m["id"] in DECODERS],
            "backends": [{"id": "sim-slow", "compile": "sim-slow", "device": "cpu",
                          "backend_options": {"seconds": seconds}},
                         {"id": "aot", "compile": "aot_eager", "device": "cpu"},
                         {"id": "sim-hang", "compile": "sim-hang", "device": "cpu", "modes": ["layers"],
                          "backend_options": {"op": "attention"},
                          "options": {"layers": {"probe_timeout": 30}}}],  # each hang costs ~45 s, not ~150 s
            "exclude": [{"model": m, "backend": "sim-hang"} for m in DECODERS if m != "tiny-llama"]}


def run(matrix_path: Path, out: Path, backend: str, burners: int) -> tuple[float, dict[str, Any]]:
    """`deepview-ci run` of one backend's cells, with `burners` busy processes beside it; (wall s, results)."""
    procs = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(burners)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    try:
        subprocess.run([sys.executable, "-m", "ci_runner", "run", str(matrix_path), "--out", str(out),
                        *[a for b in backend.split(",") for a in ("--select", f"*@{b}")]], check=False,
                       stdout=subprocess.DEVNULL)
    finally:
        for p in procs:
            p.kill()
            p.join()
    wall = time.monotonic() - t0
    return wall, json.loads((out / "report" / "results.json").read_text(encoding="utf-8"))


def hang_facts(results: dict[str, Any]) -> list[str]:
    """The sim-hang cell's layers findings: kind, module, how the hang was measured, and the repro's verdict."""
    rows = []
    for cell in results["cells"]:
        if cell["backend"] != "sim-hang":
            continue
        for f in cell["modes"].get("layers", {}).get("findings", []):
            repro = f.get("repro") or {}
            rows.append(f"{f['kind']} {f.get('module')}: {(f.get('message') or '')[:160]} | repro verified="
                        f"{repro.get('verified')} ({(repro.get('note') or '')[:100]})")
    return rows


def facts(results: dict[str, Any]) -> dict[str, Any]:
    findings, hangs, timeouts, compiles = set(), 0, 0, {}
    for cell in results["cells"]:
        if cell["backend"] == "sim-hang":
            continue
        timeouts += cell["status"] == "timeout"
        for name, mode in cell["modes"].items():
            for f in mode["findings"]:
                findings.add((cell["model"], name, f["kind"], f.get("module") or f.get("op")))
                hangs += f.get("error_type") == "Timeout"
            for phase, fig in (mode.get("data", {}).get("compiles") or {}).items():
                key = f"{name}.{phase}"
                g, s = compiles.get(key, (0, 0.0))
                compiles[key] = (g + fig["graphs"], s + fig["compile_s"])
    return {"findings": findings, "hangs": hangs, "timeouts": timeouts, "compiles": compiles}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="sim-slow's CPU seconds per graph")
    ap.add_argument("--modes", default=",".join(yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))["defaults"]["modes"]))
    ap.add_argument("--timeout", type=int, default=int(DEFAULT_TIMEOUT_S), help="seconds per cell (the documented default)")
    ap.add_argument("--burners-per-core", type=int, default=2)
    ap.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder, removed)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-slow-") as tmp_dir:
        tmp = args.out or tmp_dir
        Path(tmp).mkdir(parents=True, exist_ok=True)
        path = Path(tmp) / "matrix.yaml"
        path.write_text(yaml.safe_dump(matrix(args.seconds, args.modes.split(","), args.timeout)), encoding="utf-8")
        burners = args.burners_per_core * (os.cpu_count() or 1)
        slow_wall, slow = run(path, Path(tmp) / "slow", "sim-slow,sim-hang", burners)
        quiet_wall, quiet = run(path, Path(tmp) / "quiet", "aot", 0)
    a, b = facts(slow), facts(quiet)
    print(f"sim-slow seconds={args.seconds:g}, {burners} CPU burners beside it; aot_eager quiet; modes {args.modes}")
    print(f"{'':28} {'sim-slow (busy)':>16} {'aot_eager (quiet)':>18}")
    print(f"{'findings':28} {len(a['findings']):>16} {len(b['findings']):>18}")
    print(f"{'findings equal':28} {str(a['findings'] == b['findings']):>16}")
    print(f"{'hangs (timeout findings)':28} {a['hangs']:>16} {b['hangs']:>18}")
    print(f"{'timed-out cells':28} {a['timeouts']:>16} {b['timeouts']:>18}")
    print(f"{'wall s':28} {slow_wall:>16.1f} {quiet_wall:>18.1f}")
    print("compiles per mode.phase (graphs, compile s), summed over the models:")
    for key in sorted(set(a["compiles"]) | set(b["compiles"])):
        ga, sa = a["compiles"].get(key, (0, 0.0))
        gb, sb = b["compiles"].get(key, (0, 0.0))
        print(f"  {key:26} {ga:>5} {sa:>9.1f}s {gb:>7} {sb:>9.1f}s")
    print("the real hang beside it (sim-hang, layers):")
    hang_rows = hang_facts(slow)
    for row in hang_rows or ["none found"]:
        print("  " + row)
    if a["findings"] != b["findings"]:
        print("only on sim-slow:", sorted(a["findings"] - b["findings"]))
        print("only on aot_eager:", sorted(b["findings"] - a["findings"]))
    hang_ok = any(r.startswith("layer_failure") and "verified=True" in r for r in hang_rows)
    return 0 if a["findings"] == b["findings"] and not a["hangs"] and not a["timeouts"] and hang_ok else 1


if __name__ == "__main__":
    sys.exit(main())
