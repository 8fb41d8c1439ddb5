"""Aggregate + diff time for a big run: 200 cells × 100 findings (goal: ≤ 5 s together).

    python benchmarks/bench_report_diff.py [--cells 200] [--findings 100] [--out DIR]

"aggregate" is what `deepview-ci aggregate` does after merging the cells: write results.json and
the three reports (junit.xml, summary.md, report.html). "diff" is `deepview-ci diff`: load
results.json and the baseline, classify, write diff.json and diff.md. The baseline is made from a
second run of the same matrix on "another machine", with 5 % of the findings changed, so every
category has work to do.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ci_runner.results.baseline import diff, load_baseline, update_baseline, write_diff  # noqa: E402
from ci_runner.report import write_reports  # noqa: E402
from ci_runner.results.model import load_results, save_results  # noqa: E402
from tests.fixtures.results_factory import big_results, unsupported_op  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=200)
    ap.add_argument("--findings", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--goal", type=float, default=5.0, help="seconds for aggregate + diff")
    ap.add_argument("--cpu", action="store_true", help="measure CPU time instead of wall time")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        t = time.perf_counter()
        before = big_results(args.cells, args.findings, run="a")
        now = big_results(args.cells, args.findings, run="b")
        for i, c in enumerate(now.cells):
            if i % 20 == 0:  # 5 %: a new finding here, a fixed one there
                ops = c.modes["ops"]
                ops.findings[0] = unsupported_op(c.backend, f"aten.new_{i}.default", run="b")
        build_s = time.perf_counter() - t
        n_findings = sum(len(c.findings) for c in now.cells)

        base_results = save_results(before, out / "before" / "results.json")
        baseline = update_baseline(base_results, out / "baseline.json")

        clock = time.perf_counter
        if args.cpu:  # CPU time of this process: steadier than wall time on a busy machine
            clock = time.process_time
        t0 = clock()
        results_path = save_results(now, out / "run" / "report" / "results.json")
        t1 = clock()
        paths = write_reports(now, out / "run" / "report", run_dir=out / "run", env={})
        t2 = clock()
        loaded = load_results(results_path)
        t3 = clock()
        d = diff(loaded, load_baseline(baseline), results_path=results_path, baseline_path=baseline, run_dir=out / "run")
        write_diff(d, out / "run" / "report", env={})
        t4 = clock()

        save_s, reports_s, load_s, diff_s = t1 - t0, t2 - t1, t3 - t2, t4 - t3
        agg, dif = save_s + reports_s, load_s + diff_s
        sizes = {k: p.stat().st_size for k, p in paths.items()}
        sizes["results"] = results_path.stat().st_size
        print(f"cells: {args.cells}  findings: {n_findings}  (synthetic build {build_s:.2f} s, not timed; "
              f"{'CPU' if args.cpu else 'wall'} seconds)")
        print(f"aggregate: {agg:.2f} s = results.json write {save_s:.2f} s + reports (junit, summary, html) {reports_s:.2f} s")
        print(f"diff:      {dif:.2f} s = results.json load+validate {load_s:.2f} s + baseline load, classify, diff.json/md {diff_s:.2f} s")
        print(f"total: {agg + dif:.2f} s  (goal ≤ {args.goal:.1f} s: {'met' if agg + dif <= args.goal else 'MISSED'}); "
              f"reports + diff alone: {reports_s + diff_s:.2f} s")
        print("sizes: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))
        print("diff counts: " + ", ".join(f"{k} {v}" for k, v in d.counts().items()))
        return 0 if agg + dif <= args.goal else 1


if __name__ == "__main__":
    raise SystemExit(main())
