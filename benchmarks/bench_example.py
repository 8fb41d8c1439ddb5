"""The bundled example end to end, as a new user runs it: `deepview-ci run --out DIR` (goal: ≤ 5 min on 2 cores).

Cold by default, as in a fresh clone: a fresh `--out` and fresh compile caches (`TORCHINDUCTOR_CACHE_DIR`: inductor's
FX-graph, AOTAutograd and C++ kernel caches and Dynamo's profile cache; `TRITON_CACHE_DIR`; `TORCH_HOME`), all in a
temporary folder. A warm inductor cache is what made one earlier measurement 249 s and another 433 s: the inductor
cell compiles its C++ kernels with the system compiler when the cache is cold. `--warm` keeps the user's caches.
Not made cold: the OS page cache (torch's shared libraries read from disk; dropping it needs root) and the installed
packages' bytecode (`pip install` writes it).

Prints the wall time and the CPU time of the whole process tree (the run and every worker it waited for), the
cores, `--jobs` and the load average, each cell's time (and how much of it came before its first mode) and each
mode's, and whether the results diff clean against `baselines/example.json`: the same cells, statuses and finding
fingerprints (`deepview-ci diff RESULTS --baseline baselines/example.json --fail-on change`).

    PYTHONPATH=. python benchmarks/bench_example.py [--jobs auto|N] [--out DIR] [--goal 300] [--warm] [--processes]

`--processes` also says where the CPU time went by process: every Python process of this package (the run, its
cell workers, each isolated child by its target) writes one line at exit (a `sitecustomize` put first on PYTHONPATH,
for this run only); what no line accounts for ran outside them: repro scripts (verified with PYTHONPATH removed) and
the compilers they start (inductor's g++).

Exit code: 0 when the run diffs clean and met the goal, 1 otherwise. It takes minutes: do not run it while the
machine is shared with other heavy work, or read its wall time with the load average it prints.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "baselines" / "example.json"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "ci_runner", *args]


COLD = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_HOME")


def _print_cells(results: dict[str, Any]) -> None:
    """Each cell's time inside its worker, what came before its first mode (backend setup: imports), each mode's
    time, and the sums per mode."""
    per_mode: dict[str, list[float]] = {}
    print(f"{'cell':<26} {'cell s':>7} {'setup s':>8}  modes (s)")
    for cell in sorted(results.get("cells", []), key=lambda c: -(c.get("duration_s") or 0.0)):
        modes = {m: float(r.get("duration_s") or 0.0) for m, r in (cell.get("modes") or {}).items()}
        for m, s in modes.items():
            per_mode.setdefault(m, []).append(s)
        total = float(cell.get("duration_s") or 0.0)
        words = "  ".join(f"{m} {s:.1f}" for m, s in modes.items())
        print(f"{cell['id']:<26} {total:7.1f} {total - sum(modes.values()):8.1f}  {words}")
    cells = results.get("cells", [])
    print(f"{'sum of cells':<26} {sum(float(c.get('duration_s') or 0.0) for c in cells):7.1f}  "
          + "  ".join(f"{m}: {sum(v):.1f} s in {len(v)} cells ({min(v):.0f}–{max(v):.0f})" for m, v in per_mode.items()))


TRACER = """\
import atexit, json, os, resource, sys
_LOG = os.environ.get("DEEPVIEW_BENCH_TRACE")
if _LOG:
    def _record():
        ru = resource.getrusage(resource.RUSAGE_SELF)
        rec = {"argv": sys.argv[:3], "cpu": ru.ru_utime + ru.ru_stime}
        paths = [a for a in sys.argv if a.endswith("payload.json")]
        try:
            rec["target"] = json.load(open(paths[0]))["target"] if paths else None
        except (OSError, ValueError, KeyError):
            rec["target"] = None
        with open(_LOG, "a") as fh:
            fh.write(json.dumps(rec) + "\\n")
    atexit.register(_record)
"""


def _process_kind(rec: dict[str, Any]) -> str:
    argv = " ".join(str(a) for a in rec.get("argv") or [])
    if rec.get("target"):
        return f"child {rec['target'].split('.')[-1]}"
    for word, kind in (("_worker", "cell worker"), (" run ", "run (parent)"), (" diff ", "diff")):
        if word in f" {argv} ":
            return kind
    return "other python"


def _print_processes(trace: Path, total_cpu: float) -> None:
    """CPU seconds and counts per kind of process, and what no traced process accounts for."""
    rows: dict[str, list[float]] = {}
    for line in trace.read_text().splitlines() if trace.is_file() else []:
        rec = json.loads(line)
        rows.setdefault(_process_kind(rec), []).append(float(rec["cpu"]))
    traced = sum(sum(v) for v in rows.values())
    print(f"{'processes':<34} {'n':>4} {'CPU s':>8} {'per process':>12}")
    for kind, cpus in sorted(rows.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind:<34} {len(cpus):4d} {sum(cpus):8.1f} {sum(cpus) / len(cpus):12.2f}")
    print(f"{'not traced (repro scripts, g++)':<34} {'':>4} {total_cpu - traced:8.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="auto", help="passed to `deepview-ci run --jobs` (default auto)")
    ap.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--goal", type=float, default=300.0, help="seconds of wall time (default 300)")
    ap.add_argument("--warm", action="store_true", help="keep the user's compile caches (default: fresh, cold ones)")
    ap.add_argument("--processes", action="store_true", help="also print CPU seconds per kind of process")
    args = ap.parse_args()

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="deepview-example-") as tmp:
        out = args.out or Path(tmp) / "out"
        if args.out is not None and out.exists():
            shutil.rmtree(out)  # a fresh --out: nothing resumed, no thresholds cached from an earlier run
        if not args.warm:
            env.update({name: str(Path(tmp) / "cache" / name.lower()) for name in COLD})
        trace = Path(tmp) / "processes.jsonl"
        if args.processes:
            (Path(tmp) / "tracer").mkdir()
            (Path(tmp) / "tracer" / "sitecustomize.py").write_text(TRACER)
            env["PYTHONPATH"] = os.pathsep.join((str(Path(tmp) / "tracer"), env["PYTHONPATH"]))
            env["DEEPVIEW_BENCH_TRACE"] = str(trace)
        print(f"caches: {'the user’s (warm)' if args.warm else 'fresh (cold): ' + ', '.join(COLD)}")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        run = subprocess.run(_cli("run", "--out", str(out), "--jobs", str(args.jobs), "--force"), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        print(f"example run: exit {run.returncode} (1 expected: the self-test backends fail on purpose)")
        print(f"wall time: {wall:.1f} s  (goal ≤ {args.goal:.0f} s: {'met' if wall <= args.goal else 'MISSED'})")
        print(f"CPU time:  {cpu:.1f} s  (the run and all its workers)  cores: {cores}  --jobs {args.jobs}  "
              f"load average at start: {load:.2f}, at the end: {os.getloadavg()[0]:.2f}")
        for line in run.stdout.splitlines():
            if line.startswith("deepview-ci: ") and ("--jobs auto" in line or " pass, " in line):
                print("  " + line)
        results = out / "report" / "results.json"
        if run.returncode not in (0, 1) or not results.is_file():
            print(run.stdout[-4000:])
            print("results: MISSING (the run failed)")
            return 1
        _print_cells(json.loads(results.read_text()))
        if args.processes:
            _print_processes(trace, cpu)
        diff = subprocess.run(_cli("diff", str(results), "--baseline", str(BASELINE), "--fail-on", "change",
                                   "--out", str(out / "diff")), env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        counts = {}
        diff_json = out / "diff" / "diff.json"
        if diff_json.is_file():
            counts = json.loads(diff_json.read_text()).get("counts", {})
        clean = diff.returncode == 0
        print(f"against {BASELINE.relative_to(ROOT)}: {'clean (same cells, statuses, fingerprints)' if clean else 'CHANGED'}"
              + (f"  {counts}" if counts else ""))
        if not clean:
            print(diff.stdout[-4000:])
        return 0 if clean and wall <= args.goal else 1


if __name__ == "__main__":
    sys.exit(main())
