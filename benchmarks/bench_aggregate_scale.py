"""Peak memory and time of `deepview-ci aggregate` and `deepview-ci diff` on a big run (goal: each < 1 GB peak RSS).

    python benchmarks/bench_aggregate_scale.py [--cells 1000] [--findings 50] [--out DIR] [--before REV]

Writes a run folder of `--cells` synthetic cell results (`cells/<id>/result.json`, the real format:
`tests/fixtures/results_factory.big_results`, saved with `save_cell_result`) and a baseline from a second,
slightly different run, then runs the real CLI in a child process, one per command:

    deepview-ci aggregate RUN --out RUN/report
    deepview-ci diff RUN/report/results.json --baseline BASELINE --fail-on never

and prints each command's peak RSS (the child's own `ru_maxrss`, from `os.wait4`) and wall seconds, and the size of
results.json. `--before REV` runs the same two commands with the `ci_runner` of git revision REV too (extracted
with `git archive` into a temp folder and put first on PYTHONPATH), on the same files, so one run prints before and
after side by side. Exit 1 when a command fails or (this checkout's) peak is over `--goal-mb`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ci_runner.results.baseline import make_baseline, dumps_baseline  # noqa: E402
from ci_runner.results.model import save_cell_result  # noqa: E402
from ci_runner.fsutil import atomic_write_text  # noqa: E402
from ci_runner.results.model import Finding  # noqa: E402
from tests.fixtures.results_factory import big_results, unsupported_op  # noqa: E402


TRACEBACK = "".join(
    f'  File "/usr/lib/python3.12/site-packages/torch/_dynamo/{name}.py", line {100 + 7 * i}, in {fn}\n'
    f"    {code}\n"
    for i, (name, fn, code) in enumerate([("eval_frame", "_fn", "return fn(*args, **kwargs)"),
                                          ("convert_frame", "__call__", "result = self._inner_convert(frame, cache_entry)"),
                                          ("output_graph", "call_user_compiler", "compiled_fn = compiler_fn(gm, inputs)"),
                                          ("backends/registry", "__call__", "return self.compiler_fn(gm, example_inputs)"),
                                          ("repro/after_dynamo", "wrapper", "compiled_gm = compiler_fn(gm, example_inputs)")] * 6))


def realistic(f: Finding, cell_index: int) -> None:
    """An ops finding as the ops mode writes one (modes/ops/mode._findings): the compiler's message (≤ 2000
    characters), its diagnostics, the exception chain, each probed signature's message and the traceback's tail."""
    if f.op is None:
        return
    dump = "".join(f"  %{k} = \"{f.op}\"(%arg{k}) : (tensor<1x32x64xf32>) -> tensor<1x32x64xf32> loc(#loc{k})\n"
                   for k in range(40))
    f.message = (f"BackendCompilerFailed: backend raised:\nerror: failed to legalize operation '{f.op}'\n" + dump)[:2000]
    words = [f"source.mlir:{k}:10: error: failed to legalize operation '{f.op}' (cell {cell_index})" + " note" * 60
             for k in range(6)]
    f.details.update({
        "traceback_tail": (TRACEBACK + f"NotImplementedError: operator {f.op} is not supported\n")[-3000:],
        "compiler_diagnostics": words,
        "exception_chain": [f"BackendCompilerFailed: {w}" for w in words],
        "signatures": [{**s, "message": f.message[:600]} for s in f.details.get("signatures", [])],
    })


def make_run(out: Path, n_cells: int, n_findings: int) -> tuple[Path, Path]:
    """The run folder (cells/<id>/result.json of run "b") and a baseline of run "a" with 5 % of findings changed."""
    run_dir, baseline = out / "run", out / "baseline.json"
    before = big_results(n_cells, n_findings, run="a")
    atomic_write_text(baseline, dumps_baseline(make_baseline(before)))
    del before
    now = big_results(n_cells, n_findings, run="b")
    for i, c in enumerate(now.cells):
        if i % 20 == 0:  # a new finding here (and so a fixed one): every diff category has work
            c.modes["ops"].findings[0] = unsupported_op(c.backend, f"aten.new_{i}.default", run="b")
        for f in c.findings:
            realistic(f, i)
        save_cell_result(c, run_dir / "cells" / c.id / "result.json")
    return run_dir, baseline


def source_of(rev: str, into: Path) -> Path:
    """`ci_runner/` as of git revision `rev`, extracted under `into`."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "ci_runner"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def measure(argv: list[str], pythonpath: Path) -> tuple[int, float, float]:
    """(exit code, peak RSS in MB, wall seconds) of `python -m ci_runner ARGV` with `pythonpath` first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    env.pop("GITHUB_STEP_SUMMARY", None)
    env.pop("GITHUB_OUTPUT", None)
    where = subprocess.run([sys.executable, "-c", "import ci_runner; print(ci_runner.__file__)"], env=env,
                           cwd=tempfile.gettempdir(), capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(pythonpath), f"the child would import {where}, not {pythonpath}"
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ci_runner", *argv], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=tempfile.gettempdir())  # not this checkout: `-m` puts cwd first
    assert proc.stderr is not None
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t
    if proc.returncode not in (0, 1):
        sys.stderr.write(err.decode("utf-8", "replace")[-2000:])
    return proc.returncode, usage.ru_maxrss / 1024, seconds  # ru_maxrss is in KiB on Linux


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", type=int, default=1000)
    ap.add_argument("--findings", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None,
                    help="keep the run folder here (default: a temp folder); a folder of an earlier run is reused")
    ap.add_argument("--before", metavar="REV", default=None, help="also measure the ci_runner of this git revision")
    ap.add_argument("--goal-mb", type=float, default=1000.0)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        t = time.perf_counter()
        run_dir, baseline = out / "run", out / "baseline.json"
        made = (run_dir / "cells").is_dir() and baseline.is_file() and (out / f".made-{args.cells}x{args.findings}").is_file()
        if made:  # `--out DIR` of an earlier run of the same size: its files are reused
            print(f"{args.cells} cells × {args.findings} findings reused: {run_dir}")
        else:
            run_dir, baseline = make_run(out, args.cells, args.findings)
            (out / f".made-{args.cells}x{args.findings}").touch()
            print(f"{args.cells} cells × {args.findings} findings written in {time.perf_counter() - t:.1f} s "
                  f"(not measured): {run_dir}")
        sources = [("after", ROOT)]  # this checkout
        if args.before:
            sources.insert(0, (f"before ({args.before})", source_of(args.before, Path(tmp) / "before")))
        worst = 0.0
        ok = True
        for label, src in sources:
            report = out / ("report-" + label.split()[0])
            for name, argv in (("aggregate", ["aggregate", str(run_dir), "--out", str(report)]),
                               ("diff", ["diff", str(report / "results.json"), "--baseline", str(baseline),
                                         "--fail-on", "never", "--out", str(report / "diff")])):
                code, peak, seconds = measure(argv, src)
                ok = ok and code == 0
                if label == "after":
                    worst = max(worst, peak)
                size = (report / "results.json").stat().st_size / 1e6 if (report / "results.json").exists() else 0
                print(f"{label:>20} {name:<9} exit {code}  peak RSS {peak:7.0f} MB  {seconds:6.1f} s"
                      + (f"  results.json {size:.0f} MB" if name == "aggregate" else ""))
        met = worst < args.goal_mb
        print(f"goal: each command < {args.goal_mb:.0f} MB peak: {'met' if met else 'MISSED'}")
        return 0 if ok and met else 1


if __name__ == "__main__":
    raise SystemExit(main())
