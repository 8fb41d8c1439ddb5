"""Zoo probing throughput (issue 21): probes/s on a stable slice of a zoo scan's merged signatures, before vs after.

Takes the first `--sample` signatures of each backend's merged list (`<merged>/<backend>.json`, what `deepview-ci zoo
merge` writes) and probes them into a fresh probe store as the zoo's probe phase does
(`modes.ops.store.probe_signatures`: claims, `ProbeRunner` children, group testing), once per `--jobs` value
(probing children at once, `options.ops.workers`) and per source tree: this checkout, and with `--before DIR` a
checkout of the code to compare with (each run is a child process with `PYTHONPATH=<tree>`, under `nice`).
Runs alternate between the trees, so load changes hit both alike. Printed side by side:

* wall seconds and probes/s; the probing children's CPU seconds (what 2 quiet cores would spend) and the group
  compiles' share (the outcomes' own `seconds`);
* the projected whole-zoo probing time on 2 quiet cores: signatures × CPU seconds per probe / 2 (14,558 aot_eager
  signatures; inductor 17,675 uncapped, 3,798 at one signature per op);
* whether every signature's status is identical across all runs of a backend (before and after, any --jobs).

Each run gets its own inductor cache folder (`TORCHINDUCTOR_CACHE_DIR`), set up before the clock starts (the
vector-ISA checks every later child finds done), so no run reuses another's kernels.

    PYTHONPATH=. python benchmarks/bench_zoo_probes.py --merged /tmp/zoo-acc/zoo/merged --sample 400 \\
        --backends aot_eager --jobs 1,2 [--before /tmp/pr-base] [--json out.json]
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
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ZOO_COUNTS = {"aot_eager": {"uncapped": 14558}, "inductor": {"uncapped": 17675, "capped": 3798},
              "sim-subset": {"capped": 3798}}


def child(spec_path: str) -> int:
    """One run (in a child, on the tree in PYTHONPATH): probe the sample into a fresh store, write the numbers."""
    job = json.loads(Path(spec_path).read_text())
    from ci_runner.config import BackendSpec
    from ci_runner.modes.ops.signature import OpSignature
    from ci_runner.modes.ops.store import probe_signatures
    from ci_runner.registry import parse_options

    doc = json.loads(Path(job["merged"]).read_text())
    sigs = [OpSignature.from_dict(s) for s in doc["signatures"][: job["sample"]]]
    spec = BackendSpec(id=job["backend"], compile=job["backend"])
    opts = parse_options("ops", {"workers": job["jobs"], **job["ops"]})
    stats: dict[str, Any] = {}
    if job["backend"] == "inductor":  # a fresh cache (no kernel of an earlier run), set up as any run's is
        _warm_inductor()
    t0, r0 = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    out = probe_signatures(spec, sigs, store_dir=Path(job["store"]), opts=opts, stats=stats)
    wall, r1 = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(job["result"]).write_text(json.dumps({
        "n": len(sigs), "wall_s": wall, "cpu_s": (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime),
        "probe_s": sum(o.seconds or 0.0 for o in out.values()),
        "status": {k: o.status.value for k, o in out.items()}, "stats": {k: stats.get(k) for k in ("probed", "reused")},
        "not_passing": [f"{s.describe()[:100]}: {out[s.key].status.value}: {(out[s.key].message or '')[:160]}"
                        for s in sigs if out[s.key].status.value != "pass"][:5],
    }))
    return 0


def _warm_inductor() -> None:
    """Inductor's one-time setup in the run's fresh cache folder (its vector-ISA checks and precompiled header,
    which every later child of a machine finds done), before the clock starts."""
    import torch

    torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.ones(4))


def run_one(tree: Path, backend: str, merged: Path, sample: int, jobs: int, ops: dict[str, Any], tmp: Path,
            nice: int) -> dict[str, Any]:
    name = f"{backend}-{tree.name}-{jobs}"
    store = tmp / f"store-{name}"
    shutil.rmtree(store, ignore_errors=True)
    job = {"backend": backend, "merged": str(merged), "sample": sample, "jobs": jobs, "ops": ops,
           "store": str(store), "result": str(tmp / f"{name}.json")}
    spec = tmp / f"{name}-job.json"
    spec.write_text(json.dumps(job))
    env = {**os.environ, "PYTHONPATH": str(tree), "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{name}")}
    cmd = ["nice", "-n", str(nice), sys.executable, str(Path(__file__).resolve()), "--child", str(spec)]
    subprocess.run(cmd, env=env, check=True, cwd=tree)
    res = json.loads(Path(job["result"]).read_text())
    shutil.rmtree(store, ignore_errors=True)
    return res


def project(backend: str, cpu_per_probe: float) -> str:
    counts = ZOO_COUNTS.get(backend, {})
    return ", ".join(f"{k} {n}: {n * cpu_per_probe / 2 / 60:.0f} min" for k, n in counts.items()) or "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--merged", default="/tmp/zoo-acc/zoo/merged", help="folder of <backend>.json merged lists")
    ap.add_argument("--sample", type=int, default=400, help="the first N signatures of each list")
    ap.add_argument("--backends", default="aot_eager")
    ap.add_argument("--jobs", default="1,2", help="probing children at once (comma list)")
    ap.add_argument("--before", default=None, metavar="DIR", help="a source tree of the code to compare with")
    ap.add_argument("--ops", default="{}", help="ops options for every run, JSON (e.g. '{\"group_size\": 64}')")
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--json", default=None, metavar="PATH", help="write every run's numbers here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    trees = ([Path(args.before).resolve()] if args.before else []) + [ROOT]
    ops = json.loads(args.ops)
    report: dict[str, Any] = {"sample": args.sample, "load": os.getloadavg(), "runs": []}
    identical = True
    with tempfile.TemporaryDirectory(prefix="bench-zoo-probes-") as tmp:
        for backend in args.backends.split(","):
            merged = Path(args.merged) / f"{backend}.json"
            statuses = []
            for i, jobs in enumerate(int(j) for j in args.jobs.split(",")):
                for tree in trees if i % 2 == 0 else trees[::-1]:  # alternate the order: load hits both alike
                    label = "before" if args.before and tree != ROOT else "after"
                    r = run_one(tree, backend, merged, args.sample, jobs, ops, Path(tmp), args.nice)
                    statuses.append(r["status"])
                    per = r["cpu_s"] / r["n"]
                    print(f"[{backend}] {label:6s} jobs={jobs}: {r['n']} signatures in {r['wall_s']:.0f} s wall = "
                          f"{r['n'] / r['wall_s']:.2f} probes/s (load {os.getloadavg()[0]:.1f}); children CPU "
                          f"{r['cpu_s']:.0f} s = {per * 1000:.0f} ms/probe (group compiles {r['probe_s']:.0f} s); "
                          f"2 quiet cores: {2 / per:.1f} probes/s, whole zoo {project(backend, per)}; "
                          f"{dict(Counter(r['status'].values()))}", flush=True)
                    for line in r.get("not_passing", []):
                        print(f"    not passing: {line}")
                    report["runs"].append({"backend": backend, "tree": label, "jobs": jobs,
                                           **{k: v for k, v in r.items() if k not in ("status", "not_passing")}})
            same = all(s == statuses[0] for s in statuses)
            differ = sorted(k for s in statuses for k in s if s[k] != statuses[0].get(k))
            identical &= same
            print(f"[{backend}] identical statuses per signature across {len(statuses)} runs: {same} "
                  f"{differ[:5] if differ else ''}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
