"""A year of nightlies in the run history (issue 20): size on disk, time to load, time to add one run.

    PYTHONPATH=. python benchmarks/bench_history.py [--runs 365] [--cells 200] [--findings 100] [--keep 90]

The nights are built from one realistic run (`results_factory.big_results`: 200 cells × 100 findings, a
48-layer numerics table per cell) with churn: each night about 2 % of the findings are replaced by new ones,
and every layer figure moves by a random ±3 % (so the stored figures do not repeat). Nights go into the
database the way `history add` folds them (one write transaction each); the old ones are then compacted
past ``--keep``. Targets: ≤ 50 MB, load ≤ 2 s, add ≤ 1 s on 2 cores.

``--branch`` (issue 34) pushes the same nights one by one with `history push` (the real code: fetch, repair,
record file, a compaction every 7th, one parentless commit, push with a lease) to a local bare repository, then
prints the branch's size next to the database's: before and after ``git gc``, and what a plain clone of the
branch fetches. Target: the branch after ``git gc`` at most 2× the database. The issue's measure of the old
linear branch (a full ``history.sqlite`` committed every 7th push) for 100 cells × 50 findings: database 9.4 MB,
branch 88 MiB after ``git gc``, 237 MiB before.

    PYTHONPATH=. python benchmarks/bench_history.py --branch --cells 100 --findings 50
"""

from __future__ import annotations

import argparse
import copy
import os
import datetime as dt
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ci_runner.history import db  # noqa: E402
from ci_runner.history.compact import compact  # noqa: E402
from ci_runner.history.records import RunMeta, record_of  # noqa: E402
from ci_runner.history.store import DB_NAME, add_run, load_history, size_on_disk  # noqa: E402
from ci_runner.history.trends import TrendOptions, compute  # noqa: E402
from ci_runner.results.rootcause import annotate  # noqa: E402
from tests.fixtures.results_factory import big_results  # noqa: E402


def night_record(base: dict[str, Any], night: int, rng: random.Random, start: dt.date) -> dict[str, Any]:
    rec = copy.copy(base)
    day = (start + dt.timedelta(days=night)).isoformat()
    rec["run"] = {**base["run"], "run_id": f"night-{night:03d}", "date": day, "generated_at": f"{day}T02:00:00Z"}
    findings = []
    for f in base["findings"]:
        if rng.random() < 0.02:
            f = [f[0], f"{rng.getrandbits(80):020x}", *f[2:]]
        findings.append(f)
    rec["findings"] = findings
    rec["layers"] = [[ci, names, thr, [[v * rng.uniform(0.97, 1.03) if isinstance(v, float) else v for v in row]
                                       for row in worst]] for ci, names, thr, worst in base["layers"]]
    rec["cells"] = [[*c[:4], round(c[4] * rng.uniform(0.9, 1.1), 3), *c[5:]] for c in base["cells"]]
    return rec


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _git(*args: str, cwd: Path) -> str:
    import subprocess

    env = {**os.environ, "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@b", "GIT_COMMITTER_NAME": "b",
           "GIT_COMMITTER_EMAIL": "b@b"}
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=env).stdout


def bench_branch(args: argparse.Namespace, base: dict[str, Any], rng: random.Random, start: dt.date, root: Path) -> None:
    from ci_runner.history.gitpush import PushOptions, push_record

    bare, clone = root / "origin.git", root / "clone"
    _git("init", "-q", "--bare", str(bare), cwd=root)
    _git("clone", "-q", str(bare), str(clone), cwd=root)
    _git("commit", "-q", "--allow-empty", "-m", "init", cwd=clone)
    _git("push", "-q", "origin", "HEAD:main", cwd=clone)
    opts = PushOptions(repo_dir=clone, keep=args.keep)
    t0 = time.perf_counter()
    for night in range(args.runs):
        rec = night_record(base, night, rng, start)
        push_record(rec, RunMeta(**rec["run"]), opts)
        if (night + 1) % 50 == 0:
            print(f"  … {night + 1} nights pushed, {time.perf_counter() - t0:.0f} s", flush=True)
    took = time.perf_counter() - t0
    before_gc = _du(bare / "objects")
    _git("gc", "-q", "--prune=now", cwd=bare)
    after_gc = _du(bare / "objects")
    fresh = root / "fresh"
    _git("clone", "-q", "--no-local", "--branch", "deepview-history", str(bare), str(fresh), cwd=root)
    dbsize = (fresh / DB_NAME).stat().st_size
    commits = len(_git("rev-list", "deepview-history", cwd=bare).split())
    pending = len(list((fresh / "runs").glob("*.json.gz")))
    print(f"history branch after {args.runs} pushes of {args.cells} cells × {args.findings} findings "
          f"({took:.0f} s, {took / args.runs:.2f} s a push)")
    print(f"  history.sqlite on the branch:          {dbsize / 2**20:7.1f} MiB  (+ {pending} run file(s) pending, "
          f"{_du(fresh / 'runs') / 2**20:.1f} MiB)")
    print(f"  branch objects before git gc:          {before_gc / 2**20:7.1f} MiB")
    print(f"  branch objects after git gc:           {after_gc / 2**20:7.1f} MiB  "
          f"({after_gc / dbsize:.2f}× the database; target ≤ 2×; {commits} commit(s) on the branch)")
    print(f"  a plain clone of the branch (.git):    {_du(fresh / '.git') / 2**20:7.1f} MiB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=365)
    ap.add_argument("--cells", type=int, default=200)
    ap.add_argument("--findings", type=int, default=100)
    ap.add_argument("--keep", type=int, default=90)
    ap.add_argument("--branch", action="store_true", help="push the nights to a git branch and measure it (issue 34)")
    args = ap.parse_args()
    results = big_results(args.cells, args.findings)
    for c in results.cells:
        annotate(c.findings)  # aggregate puts each finding's root-cause signature in, as in a real results.json
    rng = random.Random(0)
    start = dt.date(2031, 1, 1)
    base = record_of(results, RunMeta(run_id="base", date="2031-01-01"))
    root = Path(tempfile.mkdtemp(prefix="bench-history-"))
    store = root / "history"
    store.mkdir()
    if args.branch:
        try:
            bench_branch(args, base, rng, start, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return 0
    try:
        t0 = time.perf_counter()
        conn = db.open_for_write(store / DB_NAME)
        for night in range(args.runs):
            db.fold(conn, [(Path("-"), night_record(base, night, rng, start))])
        conn.close()
        build = time.perf_counter() - t0
        full = size_on_disk(store)
        t0 = time.perf_counter()
        folded, weeks = compact(store, keep=args.keep)
        t_compact = time.perf_counter() - t0
        size = size_on_disk(store)
        t0, c0 = time.perf_counter(), time.process_time()
        h = load_history(store, window=TrendOptions().max_points)  # what `aggregate --history` loads
        load, c_load = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        trends = compute(h)
        t_trends, c_trends = time.perf_counter() - t0, time.process_time() - c0
        h.close()
        t0, c0 = time.perf_counter(), time.process_time()
        load_history(store).close()  # everything (what `history export` loads)
        t_all, c_all = time.perf_counter() - t0, time.process_time() - c0
        day = (start + dt.timedelta(days=args.runs)).isoformat()
        results.generated_at = f"{day}T02:00:00Z"
        t0, c0 = time.perf_counter(), time.process_time()
        add_run(store, results, RunMeta(run_id="tonight", date=day))
        add, c_add = time.perf_counter() - t0, time.process_time() - c0
        n = args.cells * args.findings
        print(f"history of {args.runs} nightly runs × {args.cells} cells × {args.findings} findings ({n} per night), "
              f"built in {build:.0f} s")
        print(f"  size on disk, every run in full:            {full / 1e6:7.1f} MB")
        print(f"  size on disk, compacted past {args.keep} nights:    {size / 1e6:7.1f} MB   (target ≤ 50 MB; "
              f"{folded} runs → {weeks} weeks in {t_compact:.1f} s)")
        print("  times: wall clock, and CPU seconds of this (single-threaded) process, i.e. the wall time on an idle core")
        print(f"  load for the reports (all runs, findings of the charted nights): {load:6.2f} s wall, {c_load:5.2f} s CPU"
              "  (target ≤ 2 s)")
        print(f"  load everything (export):                  {t_all:6.2f} s wall, {c_all:5.2f} s CPU")
        print(f"  trends (since, flaky, drifting, burn-down): {t_trends:6.2f} s wall, {c_trends:5.2f} s CPU  "
              f"({len(trends.since)} findings, {len(trends.dates)} nights charted)")
        print(f"  add one run (record file + fold):           {add:6.2f} s wall, {c_add:5.2f} s CPU  (target ≤ 1 s)")
        print(f"  load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
