"""`deepview-ci` command line: parses arguments, calls the library, maps errors to exit codes.

Thin on purpose: every command is a few lines over a library function that is tested on its own.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from .results import baseline
from . import errors
from .run.aggregate import aggregate, write_report_dir
from .backends import available_backends
from .backends.check import check_backends, load_checked
from .config import load_matrix
from .starter import LOCAL_MATRIX, local_matrix, write_starter
from .registry import mode_names
from .commits.bisect import Bisection, Request, bisect_targets, target_of_finding, target_of_repro, write_report
from .commits.pipeline import BISECT_NAME, bisect_regressions
from .commits.walk import Budget
from .engine.envinfo import base_stamp, env_report, format_env, tool_version
from .errors import ConfigError, DeepviewError, UsageError
from .run.resume import run_lock
from .run.execute import RunOptions, auto_jobs, available_cores, cell_dir, run_cells, run_worker, run_zoo_cells
from .fsutil import atomic_write_json, atomic_write_text, check_output
from .github.actions import set_output
from .github.issues import file_issues, load_diff
from .github.options import FilingOptions
from .github.client import ClientOptions
from .github.prcomment import post_pr_comment
from .history import commands as history_cli
from .log import Progress
from .matrix import ZooSplit, expand, expand_json, find_cell, select
from .modes.numerics.cache import cache_for
from .modes.numerics.thresholds import load_table
from .zoo import commands as zoo_cli
from .plan import check_output_size, collect_attempts, load_plan, parse_chunk_results, plan_outputs, read_setup_record
from .results.model import RESULT_NAME, CellResult, load_results, save_cell_result

if TYPE_CHECKING:
    from .config import Cell, Matrix

Handler = Callable[[argparse.Namespace], int]


def _modes_arg(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in mode_names()]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {', '.join(bad) or '(none)'}; choose from {', '.join(mode_names())}")
    return modes


def _whole_number(text: str, unit: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of {unit} (0 or more)")
    return value


def _minutes_arg(text: str) -> int:
    return _whole_number(text, "minutes")


def _count_arg(text: str) -> int:
    return _whole_number(text, "jobs")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}", hint=f"see `{self.prog} --help`")


# --------------------------------------------------------------------------- commands

_REPORT_OUTPUTS = {"results": "results", "junit": "junit", "summary": "summary", "html": "html"}


def _report_outputs(report_dir: Path, written: dict[str, Path]) -> None:
    """Step outputs for the composite action: the report folder and each report file."""
    set_output("report-dir", str(report_dir))
    for key, name in _REPORT_OUTPUTS.items():
        if key in written:
            set_output(name, str(written[key]))


def _default_matrix(given: str | None, *, say: bool) -> str | None:
    """MATRIX as given; with none, ./deepview.yaml when it exists (`deepview-ci init`), else None (the bundled
    example). `say`: one line on stderr naming the file chosen."""
    if given is not None:
        return given
    local = local_matrix()
    if say:
        print(f"deepview-ci: no MATRIX given: running ./{LOCAL_MATRIX}" if local else
              f"deepview-ci: no MATRIX given and no ./{LOCAL_MATRIX}: running the bundled example "
              "(`deepview-ci init` writes a starter matrix)", file=sys.stderr)
    return str(local) if local else None


def cmd_init(args: argparse.Namespace) -> int:
    path = write_starter(Path(args.path), force=args.force)
    print(f"wrote {path}: two tiny models x inductor and sim-subset; the phases, tensor parallelism, your own model "
          f"and your backend are shown commented out")
    print(f"  check it: deepview-ci expand {shlex.quote(str(args.path))}")
    print("  run it:   deepview-ci run" + ("" if Path(args.path) == Path(LOCAL_MATRIX) else f" {shlex.quote(str(args.path))}"))
    return errors.EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    matrix = load_checked(_default_matrix(args.matrix, say=True))
    cells = select(expand(matrix), args.select, args.skip)
    if not cells:
        raise UsageError(f"{matrix.path}: no cell matches --select/--skip", hint="list the cells with `deepview-ci cells MATRIX`")
    check_backends(matrix, {c.backend.id for c in cells})  # every backend mistake at once, before any cell runs
    layout = _layout_problems(cells)
    if layout:
        raise ConfigError(f"{matrix.path}: " + "\n  ".join(layout),
                          hint="choose a tp that divides them, or override the model's head counts (docs/parallel.md)")
    out = Path(args.out)
    with run_lock(out):  # one run at a time per --out: a second one refuses here (exit 7), before any line or file
        return _run_locked(args, matrix, cells, out)


def _layout_problems(cells: "Sequence[Cell]") -> list[str]:
    """Each tensor-parallel layout of `cells` that its model cannot take (heads or features not divisible by tp), as
    its ranks would refuse it, found before any cell runs; one line per (model, layout)."""
    if not any(c.parallel is not None for c in cells):
        return []
    from .workloads.tpplan import layout_problem  # deferred: torch and transformers, paid only by a matrix with TP cells

    seen: set[tuple[str, str]] = set()
    out = []
    for c in cells:
        if c.parallel is None or (c.model.id, json.dumps(c.parallel.key(), sort_keys=True)) in seen:
            continue
        seen.add((c.model.id, json.dumps(c.parallel.key(), sort_keys=True)))
        exc = layout_problem(c.model, c.inputs.seed, c.parallel.tp, dict(c.parallel.plan) or None)
        if exc is not None:
            out.append(f"cell {c.id} ({c.parallel.label()}): {exc.message}")
    return out


def _run_locked(args: argparse.Namespace, matrix: "Matrix", cells: "list[Cell]", out: Path) -> int:
    progress = Progress(len(cells))
    progress.info(f"deepview-ci: {len(cells)} cell(s) from {matrix.path} → {out}")
    cores = available_cores() if args.jobs == "auto" else None
    jobs = auto_jobs(cells, cores, args.modes) if cores else int(args.jobs)
    if cores:
        progress.info(f"deepview-ci: --jobs auto: up to {jobs} cell(s) at once on {cores} core(s)")
    run_opts = RunOptions(matrix_path=matrix.path, out_dir=out, jobs=jobs, cores=cores, force=args.force, modes=args.modes)
    try:
        results = run_cells([c for c in cells if not c.model.zoo], run_opts, progress)
        results += run_zoo_cells([c for c in cells if c.model.zoo], run_opts, progress)
    except KeyboardInterrupt:  # Ctrl-C: the report of the cells that finished, then exit 130 (main)
        finished = [p for p in (cell_dir(out, c.id) / RESULT_NAME for c in cells) if p.exists()]
        if finished:
            written = write_report_dir(aggregate(finished), out / "report", run_dir=out)
            progress.info(f"deepview-ci: interrupted; the report of the {len(finished)} finished cell(s) of "
                          f"{len(cells)}: {written.get('summary', out / 'report')}")
        raise
    report = aggregate([cell_dir(out, r.id) / RESULT_NAME for r in results],  # this run's cells, not stale ones
                       run_dirs=[out] if any(c.model.zoo for c in cells) else ())
    written = write_report_dir(report, out / "report", run_dir=out)
    _report_outputs(out / "report", written)
    counts = report.counts()
    progress.info(
        f"deepview-ci: {counts['pass']} pass, {counts['fail']} fail, {counts['error']} error, {counts['crashed']} crashed, "
        f"{counts['timeout']} timeout, {counts['skipped']} skipped"
        f"{', ' + str(counts['inconclusive']) + ' inconclusive' if counts.get('inconclusive') else ''}; "
        f"{counts['findings']} finding(s)"
    )
    for name, path in written.items():
        progress.info(f"  {name}: {path}")
    return _run_exit(results)


def _run_exit(results: Sequence[CellResult]) -> int:
    """0 when every cell passed (or was skipped); when every cell that did not never reached its backend, the
    code of why (`CellError.setup_exit_code`: 2 a layout its model cannot take, 4 a model or backend that did not
    load; the lower when both); else 1 (findings)."""
    bad = [r for r in results if r.status not in ("pass", "skipped")]
    codes = [r.error.setup_exit_code if r.status == "error" and r.error is not None else None for r in bad]
    if bad and None not in codes:
        return min(c for c in codes if c is not None)
    return errors.EXIT_FINDINGS if bad else errors.EXIT_OK


def cmd_cell(args: argparse.Namespace) -> int:
    matrix = load_checked(args.matrix)
    cell = find_cell(matrix, args.cell_id)
    if args.setup_failed:
        return _record_failed_setup(cell, Path(args.setup_failed), Path(args.out))
    check_backends(matrix, [cell.backend.id], missing_ok=True)  # a package not installed stays the cell's own error
    opts = RunOptions(matrix_path=matrix.path, out_dir=Path(args.out), force=args.force, modes=args.modes)
    with run_lock(opts.out_dir):  # one run at a time per --out, as `run`
        [result] = (run_zoo_cells if cell.model.zoo else run_cells)([cell], opts, Progress(1))  # zoo: small config
    return _run_exit([result])


def _record_failed_setup(cell: "Cell", folder: Path, out: Path) -> int:
    """Write the `error` result of a cell whose setup failed, from the folder the workflow's setup step wrote."""
    result = read_setup_record(folder, cell_id=cell.id, model=cell.model.id, backend=cell.backend.id, modes=cell.modes,
                               env=base_stamp())
    path = save_cell_result(result, cell_dir(out, cell.id) / RESULT_NAME)
    print(f"{cell.id}: error: {result.error.message.splitlines()[0] if result.error else ''}\n  result: {path}")
    return errors.EXIT_FINDINGS


def cmd_thresholds_key(args: argparse.Namespace) -> int:
    matrix = load_matrix(args.matrix)
    cells = [find_cell(matrix, args.cell)] if args.cell else select(expand(matrix), args.select, args.skip)
    return _thresholds_outputs(cells, Path(args.out))


def cmd_thresholds_key_of(args: argparse.Namespace) -> int:
    """The thresholds cache of what `deepview-ci run|cell ARGS` would run (the composite action's automatic cache):
    ARGS is the action's `args` input, split with shlex and parsed by that command's own parser; the folders are
    absolute (actions/cache reads paths from the workspace, the command runs in `working-directory`). Any other
    command, or one without the numerics mode, caches nothing."""
    inner = build_parser().parse_args([args.of, *shlex.split(args.args)]) if args.of in ("run", "cell") else None
    if inner is None or (inner.modes is not None and "numerics" not in inner.modes):
        return _thresholds_outputs([], Path("."))
    matrix = load_matrix(inner.matrix if args.of == "cell" else _default_matrix(inner.matrix, say=False))
    cells = [find_cell(matrix, inner.cell_id)] if args.of == "cell" else select(expand(matrix), inner.select, inner.skip)
    return _thresholds_outputs(cells, Path(inner.out), absolute=True)


def _thresholds_outputs(cells: Sequence["Cell"], out: Path, *, absolute: bool = False) -> int:
    cache = cache_for(cells, out)
    print(json.dumps(cache.to_json(), indent=1))
    set_output("thresholds-key", cache.key)
    set_output("thresholds-dir", "\n".join(str(f.absolute() if absolute else f) for f in cache.folders))
    return errors.EXIT_OK


def cmd_worker(args: argparse.Namespace) -> int:
    return run_worker(matrix=Path(args.matrix), cell_id=args.cell, out_dir=Path(args.out), modes=args.modes.split(","),
                      budget=float(args.budget))


def cmd_expand(args: argparse.Namespace) -> int:
    if args.list:
        return cmd_cells(args)
    matrix = load_checked(args.matrix)
    cells = select(expand(matrix), args.select, args.skip)
    check_backends(matrix, {c.backend.id for c in cells}, missing_ok=True)  # the plan job lacks the backends' packages
    max_jobs = args.max_jobs if args.max_jobs is not None else matrix.max_jobs
    doc = expand_json(cells, max_jobs=max_jobs, chunk_size=args.chunk_size, fork_pr=args.fork_pr,
                      setup_minutes=args.setup_minutes, margin_minutes=args.margin_minutes,
                      zoo_split=ZooSplit(inventory=args.zoo_inventory_shards, probe=args.zoo_probe_shards))
    outputs = plan_outputs(doc)
    check_output_size(outputs)  # before anything is written: GitHub would fail the job past 1 MB of outputs
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        atomic_write_text(Path(args.out), text + "\n")
    for name, value in outputs.items():
        set_output(name, value)
    return 0


def cmd_cells(args: argparse.Namespace) -> int:
    """One cell id per line (MODEL@BACKEND), what `run --select` and `cell` take."""
    matrix = load_matrix(_default_matrix(args.matrix, say=False))
    for cell in select(expand(matrix), args.select, args.skip):
        print(cell.id)
    return 0


def cmd_aggregate(args: argparse.Namespace) -> int:
    paths = [Path(p) for p in args.dirs]
    plan = load_plan(Path(args.plan)) if args.plan else None
    results = aggregate(paths, plan=plan, chunk_results=parse_chunk_results(args.chunk_results))
    run_dir = Path(args.run_dir) if args.run_dir else (paths[0] if len(paths) == 1 and paths[0].is_dir() else None)
    trends = history_cli.trends_for(args, results)
    written = write_report_dir(results, Path(args.out), run_dir=run_dir, trends=trends)
    _report_outputs(Path(args.out), written)
    c = results.counts()
    missing = sum(1 for cell in results.cells if cell.error is not None and cell.error.type == "no_result")
    set_output("no-result", str(missing))  # planned cells whose job left nothing: the run is partial
    print(f"aggregated {c['total']} cell(s), {c['findings']} finding(s)" + (f", {missing} without a result" if missing else ""))
    for name, path in written.items():
        print(f"  {name}: {path}")
    if args.fail_on_findings and any(cell.status not in ("pass", "skipped") for cell in results.cells):
        return errors.EXIT_FINDINGS
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    warned: list[str] = []

    def warn(message: str) -> None:  # a cell passed over or unreadable: said, never dropped (the step goes on)
        warned.append(message)
        print(f"deepview-ci: warning: {message}", file=sys.stderr)

    attempts = collect_attempts(Path(args.artifacts), Path(args.out), warn=warn)
    reruns = sum(1 for a in attempts.values() if a > 1)
    print(f"collected {len(attempts)} cell(s) from {args.artifacts} into {args.out}"
          + (f", {reruns} of them from a re-run (the newest attempt kept)" if reruns else "")
          + (f"; {len(warned)} warning(s) above" if warned else ""))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    results_path = Path(args.results)
    results = load_results(results_path)
    base = baseline.load_baseline(Path(args.baseline))
    trends = history_cli.trends_for(args, results)
    d = baseline.diff(results, base, results_path=results_path, baseline_path=Path(args.baseline),
                      run_dir=Path(args.run_dir) if args.run_dir else None, policy=args.fail_on,
                      history_flaky=trends.flaky_map() if trends else None,
                      drifting=[x.to_dict() for x in trends.drifting] if trends else ())
    out_dir = Path(args.out) if args.out else results_path.parent
    json_path, md_path = baseline.write_diff(d, out_dir)
    baseline.annotate_regressions(d)

    set_output("diff", str(json_path))
    for category, n in d.counts().items():
        set_output(category.replace("_", "-"), str(n))
    code = d.exit_code(args.fail_on)
    n = d.counts()
    print(f"diff against {args.baseline}: " + ", ".join(f"{n[c]} {c.replace('_', ' ')}" for c in baseline.CATEGORIES))
    print(f"--fail-on {args.fail_on}: {'fails (exit 1)' if code else 'passes'}")
    print(f"written: {md_path} (the tables, with repros), {json_path}")
    return code


def cmd_baseline_update(args: argparse.Namespace) -> int:
    path = baseline.update_baseline(Path(args.results), Path(args.out))
    print(f"baseline written: {path}")
    return 0


def cmd_baseline_missing(args: argparse.Namespace) -> int:
    raise UsageError("baseline: missing subcommand", hint="use `deepview-ci baseline update RESULTS --out BASELINE` or "
                     "`deepview-ci baseline propose --history DIR --baseline FILE --out FILE`")


def cmd_file_issues(args: argparse.Namespace) -> int:
    options = FilingOptions.from_args(args)
    report = file_issues(Path(args.diff), repo=args.repo, dry_run=Path(args.dry_run) if args.dry_run else None,
                         run_dir=Path(args.run_dir) if args.run_dir else None, artifacts_url=args.artifacts_url,
                         options=options, env=os.environ, bisect=Path(args.bisect) if args.bisect else None)
    print(report.summary())
    return report.exit_code


def cmd_pr_comment(args: argparse.Namespace) -> int:
    options = ClientOptions(min_write_interval=args.min_interval, max_wait=args.max_wait)
    report = post_pr_comment(Path(args.diff), repo=args.repo, env=os.environ, pr=args.pr,
                             results=Path(args.results) if args.results else None, artifacts_url=args.artifacts_url,
                             key=args.key, dry_run=args.dry_run, client_options=options)
    if args.dry_run:
        sys.stdout.write(report.body)
    print(report.line(), file=sys.stderr if args.dry_run else sys.stdout)
    return errors.EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    """`deepview-ci compare REF TARGET [--json PATH] [--thresholds FILE] [--fail-on drift|diverged|broken|never]`.

    Exit 0 when inputs, schema and every layer agree; 1 when the schema differs or a layer is flagged; 3 when a
    dump is unreadable or the inputs differ (no layer is compared then)."""
    from .modes.numerics.compare import compare_dumps, format_comparison  # deferred: torch
    from .modes.numerics.dumps import load_dump  # deferred: torch

    from .modes.numerics.compare import derive_from_dumps  # deferred: torch

    if getattr(args, "thresholds", None) and getattr(args, "derive", None):
        raise UsageError("compare: give --thresholds FILE or --derive SECOND_REF_DUMP, not both")
    table = load_table(Path(args.thresholds)) if getattr(args, "thresholds", None) else None
    ref = load_dump(args.ref_dump)
    if getattr(args, "derive", None):
        table = derive_from_dumps(ref, load_dump(args.derive))
    tgt = load_dump(args.target_dump)
    cmp = compare_dumps(ref, tgt, thresholds=table, fail_on=getattr(args, "fail_on", None) or "diverged")
    print(format_comparison(cmp))
    if getattr(args, "json", None):
        path = atomic_write_json(Path(args.json), cmp.to_json())
        print(f"comparison written: {path}")
    return errors.EXIT_OK if cmp.ok else errors.EXIT_FINDINGS


def cmd_dump(args: argparse.Namespace) -> int:
    """`deepview-ci dump --matrix M --model ID [--backend ID] [--reference ID] [--sample N] --out DIR [--chunk-mb X]`."""
    from .modes.numerics.dumps import dump_entry  # deferred: torch

    matrix = load_checked(getattr(args, "matrix", None), check=bool(getattr(args, "backend", None)))
    if getattr(args, "backend", None):
        check_backends(matrix, [matrix.backend(args.backend).id])
    out = Path(args.out)
    try:
        path = dump_entry(matrix, args.model, out, backend_id=getattr(args, "backend", None),
                          reference_id=getattr(args, "reference", None), sample=int(getattr(args, "sample", 0) or 0),
                          chunk_mb=float(getattr(args, "chunk_mb", None) or 64.0))
    except DeepviewError:
        raise
    except Exception as exc:  # the model or backend failed while running: say where, keep the exit code meaningful
        raise errors.ExecutionError(f"dump of {args.model!r} failed: {type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0] if str(exc) else ''}",
                                    hint="run the `layers` mode on this cell to find the failing module") from exc
    m = json.loads(path.read_text(encoding="utf-8"))
    print(f"dumped {len(m['entries'])} tensors of {m['calls']} module calls ({m['bytes'] / 1e6:.1f} MB, "
          f"{m['seconds']:.1f} s) → {out}")
    print(f"  side: {m['side']['role']} {m['side']['id']} on {m['side']['device']} {m['side']['dtype']} "
          f"({m['side']['capture']}); input sha256 {m['input']['hash'][:16]}…")
    return 0


def cmd_bisect_commits(args: argparse.Namespace) -> int:
    """`deepview-ci bisect-commits --repo DIR --good REF --bad REF --setup CMD… --python PY (--repro PATH | --finding R:FP)…`."""
    targets = [target_of_repro(Path(p)) for p in args.repro or ()] + [target_of_finding(s) for s in args.finding or ()]
    if not targets:
        raise UsageError("bisect-commits needs --repro PATH or --finding RESULTS.json:FINGERPRINT")
    budget = Budget(max_steps=args.max_steps, step_timeout=args.step_timeout, total_timeout=args.total_timeout)
    kw = {"cache": Path(args.cache)} if args.cache else {}
    found = bisect_targets(Request(repo=Path(args.repo), good=args.good, bad=args.bad, setup=tuple(args.setup or ()),
                                   python=args.python, budget=budget, **kw), targets)
    for b in found:
        reuse = " (reused)" if b.reused else ""
        print(f"{b.line()}{reuse}  [{b.signature}: {len(b.findings)} finding(s), {b.repro_runs} repro run(s)]")
    if args.out:
        write_report(Path(args.out), found)
    return errors.EXIT_OK if all(b.first_bad for b in found) else errors.EXIT_FINDINGS


def cmd_bisect_regressions(args: argparse.Namespace) -> int:
    """`deepview-ci bisect-regressions DIFF --matrix M --baseline B [--run-dir D] [--out FILE]`: always exit 0 on good input."""
    diff_path = Path(args.diff)
    diff = load_diff(diff_path)
    base = baseline.load_baseline(Path(args.baseline))
    run_dir = Path(args.run_dir or diff.get("run_dir") or diff_path.parent)
    if not run_dir.is_absolute() and not run_dir.exists():
        run_dir = diff_path.parent / run_dir
    out = Path(args.out) if args.out else diff_path.parent / BISECT_NAME
    report = bisect_regressions(diff, load_matrix(args.matrix), base.cells, run_dir=run_dir, out=out,
                                cache=Path(args.cache) if args.cache else None)
    for b in report["bisections"]:
        print(f"{b['backend']}: {Bisection.from_dict(b).line()}  [{len(b['findings'])} finding(s)]")
    for note in report["notes"]:
        print(f"note: {note}")
    print(f"bisections written: {out}")
    return errors.EXIT_OK


def cmd_env(args: argparse.Namespace) -> int:
    report = env_report(available_backends)
    print(json.dumps(report, indent=2, default=str) if args.json else format_env(report))
    return 0


# --------------------------------------------------------------------------- parser

def _jobs_arg(text: str) -> str | int:
    if text == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number or 'auto'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _bisect_parsers(add: Callable[..., argparse.ArgumentParser]) -> None:
    """`bisect-commits` and `bisect-regressions` (issue 22)."""
    sp = add("bisect-commits", cmd_bisect_commits, "Find the backend commit that broke a finding's repro (git bisect).")
    sp.add_argument("--repo", required=True, metavar="DIR", help="the backend's source repository (a local git checkout; never modified)")
    sp.add_argument("--good", required=True, metavar="REF", help="a commit where the repro passes")
    sp.add_argument("--bad", required=True, metavar="REF", help="a commit where it fails")
    sp.add_argument("--setup", action="append", metavar="CMD",
                    help="shell command that builds and installs the backend at a commit (repeatable); runs in a scratch "
                         "clone with PY's folder first on PATH; $DEEPVIEW_BISECT_PREFIX is a per-commit, cached install folder")
    sp.add_argument("--python", required=True, metavar="PY", help="the interpreter setup installs into and the repro runs with")
    sp.add_argument("--repro", action="append", metavar="PATH", help="a repro script inside a run folder (repeatable)")
    sp.add_argument("--finding", action="append", metavar="RESULTS.json:FINGERPRINT", help="a finding with a repro (repeatable)")
    sp.add_argument("--out", default=None, metavar="FILE", help="write first_bad and every step's log as JSON")
    sp.add_argument("--max-steps", type=int, default=30, help="most commits tried per bisection (default 30)")
    sp.add_argument("--step-timeout", type=float, default=600.0, help="seconds for each setup command and repro run (default 600)")
    sp.add_argument("--total-timeout", type=float, default=3600.0, help="seconds per bisection (default 3600)")
    sp.add_argument("--cache", default=None, metavar="DIR", help="setup results and answers kept across runs (default ~/.cache/deepview-ci/bisect)")

    sp = add("bisect-regressions", cmd_bisect_regressions,
             "Bisect each regressed finding between the baseline's and this run's backend commits (matrix `source`).")
    sp.add_argument("diff", help="diff.json written by `deepview-ci diff`")
    sp.add_argument("--matrix", required=True, help="the matrix: backends with a `source` are bisected")
    sp.add_argument("--baseline", required=True, help="the baseline the diff was made against (its cells' backend_commit)")
    sp.add_argument("--run-dir", default=None, help="run folder holding cells/<id>/… (default: the diff's)")
    sp.add_argument("--out", default=None, help="bisect.json to write (default: next to DIFF, where file-issues reads it)")
    sp.add_argument("--cache", default=None, metavar="DIR", help="setup results and answers kept across runs")


def _add_expand(sp: argparse.ArgumentParser, selection: Callable[[argparse.ArgumentParser], None]) -> None:
    sp.add_argument("matrix", help="matrix YAML file")
    selection(sp)
    sp.add_argument("--max-jobs", type=int, default=None, help="fail past this many cells (default: defaults.max_jobs)")
    sp.add_argument("--chunk-size", type=int, default=256, help="jobs per GitHub matrix chunk (≤ 256)")
    sp.add_argument("--out", default=None, metavar="PLAN_JSON", help="also write the printed plan here (for `aggregate --plan`)")
    sp.add_argument("--list", action="store_true", help="print only the cell ids, one a line (as `deepview-ci cells`)")
    sp.add_argument("--fork-pr", action="store_true",
                    help="plan for a pull request from a fork: cells on self-hosted runners are skipped, with the reason")
    sp.add_argument("--setup-minutes", type=_minutes_arg, default=30, metavar="MIN",
                    help="a cell job's time before its cell starts (container pull, checkout, setup, installing "
                         "deepview-ci); the job's limit is this + the cell's timeout + --margin-minutes (default 30)")
    sp.add_argument("--margin-minutes", type=_minutes_arg, default=5, metavar="MIN",
                    help="time left in a cell job after its cell step, for the upload (default 5)")
    sp.add_argument("--zoo-inventory-shards", type=_count_arg, default=0, metavar="N",
                    help="zoo inventory jobs (default 0: one per 25 architectures, at most 256)")
    sp.add_argument("--zoo-probe-shards", type=_count_arg, default=0, metavar="N",
                    help="zoo probe jobs per backend (default 0: from the zoo's size, at most 256 in all)")


AddCommand = Callable[..., argparse.ArgumentParser]  # (name, handler, help text or None for an unlisted command)


# Every option that names a path the command writes: "dir" (a folder, created) or "file". `main` checks each one
# before the command starts, so an unwritable path is one line and exit 5, not a traceback after minutes of work
# (tests/integration/test_cli_outputs.py walks the parser and fails on an output-like option missing here).
OUTPUT_PATHS: dict[str, dict[str, str]] = {
    "init": {"path": "file"}, "run": {"out": "dir"}, "expand": {"out": "file"}, "cell": {"out": "dir"},
    "zoo inventory": {"out": "dir"}, "zoo merge": {"out": "dir"}, "zoo probe": {"out": "dir"}, "zoo cells": {"out": "dir"},
    "_worker": {"out": "dir"}, "aggregate": {"out": "dir"}, "collect": {"out": "dir"}, "diff": {"out": "dir"},
    "baseline update": {"out": "file"}, "baseline propose": {"out": "file", "summary": "file"},
    "history add": {"store": "dir"}, "history export": {"out": "dir"}, "history compact": {"store": "dir"},
    "file-issues": {"dry_run": "dir"}, "dump": {"out": "dir"}, "compare": {"json": "file"},
    "bisect-commits": {"out": "file", "cache": "dir"}, "bisect-regressions": {"out": "file", "cache": "dir"},
}


def _subparsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> "list[tuple[tuple[str, ...], argparse.ArgumentParser, str | None]]":
    """Every (sub)command below `parser`: its name path, its parser and its one-line help."""
    found = []
    for action in parser._actions:  # argparse has no public walk
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sp in action.choices.items():
                found.append(((*path, name), sp, helps.get(name)))
                found += _subparsers(sp, (*path, name))
    return found


def _finish(parser: argparse.ArgumentParser) -> None:
    """Each command's `--help` starts with its one-line description, and carries its output paths (`OUTPUT_PATHS`)."""
    for path, sp, help_text in _subparsers(parser):
        if sp.description is None and help_text:
            sp.description = help_text
        outputs = OUTPUT_PATHS.get(" ".join(path))
        if outputs:
            sp.set_defaults(output_paths=outputs)


def check_outputs(args: argparse.Namespace) -> None:
    """Raise `OutputError` (exit 5) for the first output path of the command that cannot be written."""
    for dest, kind in (getattr(args, "output_paths", None) or {}).items():
        value = getattr(args, dest, None)
        if value:
            check_output(value, "dir" if kind == "dir" else "file", what="--" + dest.replace("_", "-"))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="deepview-ci", description="Run PyTorch models × accelerator backends as CI: missing operators, "
                "failing layers and numerical divergence, with repros, reports and regression diffs.")
    p.add_argument("--version", action="version", version=f"deepview-ci {tool_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    def add(name: str, handler: Handler, help_text: str | None, **kw: object) -> argparse.ArgumentParser:
        if help_text is None:
            sp = sub.add_parser(name, **kw)  # type: ignore[arg-type]
        else:
            sp = sub.add_parser(name, help=help_text, description=help_text, **kw)  # type: ignore[arg-type]
        sp.set_defaults(handler=handler)
        return sp

    _run_commands(add)
    _report_commands(add)
    _dump_commands(add)
    _finish(p)
    return p


def _selection(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--select", action="append", default=[], metavar="GLOB", help="only cells whose id matches (repeatable)")
    sp.add_argument("--skip", action="append", default=[], metavar="GLOB", help="drop cells whose id matches (repeatable)")


def _run_commands(add: AddCommand) -> None:
    """run, expand, cell and the internal _worker."""
    sp = add("init", cmd_init, "Write a commented starter matrix (deepview.yaml) to edit; `run` then picks it up.")
    sp.add_argument("path", nargs="?", default=LOCAL_MATRIX, metavar="PATH", help=f"file to write (default: {LOCAL_MATRIX})")
    sp.add_argument("--force", action="store_true", help="overwrite PATH if it exists")

    sp = add("run", cmd_run, "Run the whole matrix locally and write the report.")
    sp.add_argument("matrix", nargs="?", default=None,
                    help=f"matrix YAML (default: ./{LOCAL_MATRIX} when it exists, else the bundled example)")
    sp.add_argument("--out", default="out", help="output folder (default: out)")
    _selection(sp)
    sp.add_argument("--modes", type=_modes_arg, default=None, help=f"comma list of {','.join(mode_names())} (default: the matrix's)")
    sp.add_argument("--jobs", type=_jobs_arg, default="auto", metavar="N|auto",
                    help="cells run in parallel; auto (the default) shares the machine's cores: a cell takes as many "
                         "cores as its modes use (the ops mode's probe workers, options.ops.workers; else 1), so "
                         "cores / workers cells run at once, at least 1")
    sp.add_argument("--force", action="store_true", help="rerun cells that already finished")

    _add_expand(add("expand", cmd_expand, "Print the GitHub plan JSON (and write GITHUB_OUTPUT when set)."), _selection)

    sp = add("cells", cmd_cells, "List the matrix's cell ids (MODEL@BACKEND), one a line: what --select and `cell` take.")
    sp.add_argument("matrix", nargs="?", default=None,
                    help=f"matrix YAML (default: ./{LOCAL_MATRIX} when it exists, else the bundled example)")
    _selection(sp)

    sp = add("cell", cmd_cell, "Run one cell (what a CI job runs).")
    sp.add_argument("cell_id", metavar="CELL_ID", help="the cell to run, MODEL@BACKEND (see `deepview-ci cells MATRIX`)")
    sp.add_argument("--matrix", required=True, help="matrix YAML file")
    sp.add_argument("--out", required=True, help="output folder; the cell writes cells/CELL_ID/ in it")
    sp.add_argument("--modes", type=_modes_arg, default=None, help=f"comma list of {','.join(mode_names())} (default: the cell's)")
    sp.add_argument("--force", action="store_true", help="rerun the cell even if it already finished")
    sp.add_argument("--setup-failed", default=None, metavar="DIR",
                    help="do not run the cell: record it as `error` because its setup failed; DIR holds command.txt, "
                         "output.log and exit-code (the reusable workflow's setup step writes them)")

    sp = add("thresholds-key", cmd_thresholds_key, "Print the numerics thresholds' folder(s) and cache key (and write "
             "GITHUB_OUTPUT when set): the key changes with the model, inputs, references, torch and method.")
    sp.add_argument("matrix", help="matrix YAML file")
    sp.add_argument("--out", required=True, help="the run's output folder (thresholds default to OUT/thresholds)")
    sp.add_argument("--cell", default=None, metavar="CELL_ID", help="one cell (what a cell job runs)")
    _selection(sp)

    sp = add("_thresholds-key-of", cmd_thresholds_key_of, None)  # internal: the composite action's cache step
    sp.add_argument("of", metavar="COMMAND")
    sp.add_argument("args", metavar="ARGS", help="its arguments as one string (the action's `args`), split with shlex")

    zoo_cli.register(add, _Parser, _selection)

    sp = add("_worker", cmd_worker, None)  # internal: no help, so it is not listed
    sp.add_argument("--matrix", required=True)
    sp.add_argument("--cell", required=True)
    sp.add_argument("--out", required=True)
    sp.add_argument("--modes", required=True)
    sp.add_argument("--budget", required=True)


def _report_commands(add: AddCommand) -> None:
    """aggregate, diff, baseline update and file-issues."""
    sp = add("aggregate", cmd_aggregate, "Merge cell results into results.json, junit.xml, summary.md, report.html.")
    sp.add_argument("dirs", nargs="+", metavar="DIR", help="folders (or result.json files) holding the cells' results")
    sp.add_argument("--out", required=True, metavar="REPORT_DIR", help="folder for results.json and the reports")
    sp.add_argument("--run-dir", default=None, help="folder the cells' artifact paths are relative to")
    sp.add_argument("--fail-on-findings", action="store_true", help="exit 1 when any cell did not pass")
    sp.add_argument("--plan", default=None, metavar="PLAN_JSON",
                    help="the plan `expand --out` wrote: a planned cell with no result becomes an `error` cell")
    sp.add_argument("--chunk-results", default=None, metavar="N=RESULT,…",
                    help="each chunk job's conclusion (e.g. 0=success,1=cancelled, or *=failure for all), quoted in "
                         "cells with no result")
    history_cli.add_trend_options(sp)

    sp = add("collect", cmd_collect, "Copy each cell's newest attempt from downloaded artifacts into a run folder.")
    sp.add_argument("artifacts", metavar="ARTIFACTS_DIR", help="one folder per downloaded cell artifact (NAME-attempt-N)")
    sp.add_argument("--out", required=True, metavar="RUN_DIR", help="the run folder: cells/<id>/ of each newest attempt")

    sp = add("diff", cmd_diff, "Diff results against a baseline; exit code per --fail-on.")
    sp.add_argument("results", help="results.json of the run")
    sp.add_argument("--baseline", required=True, help="the committed baseline JSON")
    sp.add_argument("--fail-on", choices=("regression", "change", "never"), default="regression",
                    help="exit 1 on regressions (default), on any change, or never")
    sp.add_argument("--out", default=None, help="folder for diff.json and diff.md (default: next to RESULTS)")
    sp.add_argument("--run-dir", default=None, help="run folder holding cells/<id>/… (repro paths in the diff are relative to it)")
    history_cli.add_trend_options(sp)

    sp = add("baseline", cmd_baseline_missing, "Manage the committed baseline.")
    bsub = sp.add_subparsers(dest="baseline_command", metavar="SUBCOMMAND", parser_class=_Parser)
    bu = bsub.add_parser("update", help="Write a baseline from results.json.")
    bu.set_defaults(handler=cmd_baseline_update)
    bu.add_argument("results", help="results.json to take the baseline from")
    bu.add_argument("--out", required=True, help="baseline JSON file to write")
    history_cli.register_propose(bsub)
    history_cli.register(add, _Parser)

    sp = add("file-issues", cmd_file_issues, "File, comment on, reopen or close GitHub issues for a diff.")
    sp.add_argument("diff", help="diff.json written by `deepview-ci diff`")
    sp.add_argument("--repo", required=True, help="OWNER/NAME")
    sp.add_argument("--dry-run", default=None, metavar="DIR", help="write the drafts to DIR, call no API")
    sp.add_argument("--run-dir", default=None, help="run folder holding cells/<id>/… (for repro scripts)")
    sp.add_argument("--artifacts-url", default=None, help="link to the run's artifacts, for truncated repros")
    sp.add_argument("--label", default="deepview-ci", help="label on every issue this tool files (default: deepview-ci)")
    sp.add_argument("--opt-out-label", default="deepview-ci:ignore",
                    help="issues with this label are never commented on, reopened or closed (default: deepview-ci:ignore)")
    sp.add_argument("--close-fixed", action=argparse.BooleanOptionalAction, default=True,
                    help="close the issues of fixed findings (default: yes)")
    sp.add_argument("--layers", action="store_true", help="also file issues for failing submodules and divergent layer classes")
    sp.add_argument("--min-interval", type=float, default=1.0, help="seconds between writes (GitHub: ≥ 1)")
    sp.add_argument("--max-wait", type=float, default=300.0, help="longest rate-limit wait before keeping a draft")
    sp.add_argument("--artifact-days", dest="artifact_days", type=int, default=None, metavar="N",
                    help="how long the run's artifacts are kept (the workflow's retention-days), said where an issue "
                         "names the artifact holding a full repro")
    sp.add_argument("--max-new-issues", dest="max_new", type=int, default=30, metavar="N",
                    help="new issues one run may create; the rest are kept as drafts and said (default 30)")
    sp.add_argument("--write-budget", type=int, default=400, metavar="N",
                    help="content-creating requests (issues, comments, state changes) an hour: this run's plus the issues "
                         "with the label created in the hour before it; GitHub allows 500 an hour; the rest are kept "
                         "as drafts and said (default 400)")
    sp.add_argument("--bisect", default=None, metavar="FILE",
                    help="bisections from `bisect-regressions` to quote in the issues (default: bisect.json next to DIFF)")

    _pr_comment_parser(add)


def _pr_comment_parser(add: AddCommand) -> None:
    sp = add("pr-comment", cmd_pr_comment, "Create or update the pull request's one deepview-ci comment from a diff.")
    sp.add_argument("diff", help="diff.json written by `deepview-ci diff`")
    sp.add_argument("--repo", required=True, help="OWNER/NAME")
    sp.add_argument("--pr", type=int, default=None, metavar="N",
                    help="the pull request (default: the one of the `pull_request` event, GITHUB_EVENT_PATH)")
    sp.add_argument("--results", default=None, metavar="RESULTS",
                    help="results.json of the run, for the cell counts (default: the one the diff names)")
    sp.add_argument("--artifacts-url", default=None, help="link to the run's artifacts (default: the run's page)")
    sp.add_argument("--key", default=None, metavar="NAME",
                    help="one comment per NAME (several matrices on one pull request); default: one comment")
    sp.add_argument("--dry-run", action="store_true", help="print the comment's body, call no API")
    sp.add_argument("--min-interval", type=float, default=1.0, help="seconds between writes (GitHub: ≥ 1)")
    sp.add_argument("--max-wait", type=float, default=300.0, help="longest rate-limit wait before giving up")


def _dump_commands(add: AddCommand) -> None:
    """dump, compare and env."""
    sp = add("dump", cmd_dump, "Dump per-layer outputs of one model on one device/backend (safetensors + manifest).")
    sp.add_argument("--matrix", default=None, help="matrix YAML the model and backend come from (default: the bundled example)")
    sp.add_argument("--model", required=True, help="model id from the matrix")
    sp.add_argument("--backend", default=None, help="backend id from the matrix (default: eager CPU reference)")
    sp.add_argument("--reference", default=None, help="reference id from the matrix")
    sp.add_argument("--sample", type=int, default=0, help="which input sample to run (default 0)")
    sp.add_argument("--out", required=True, help="folder for the dump (safetensors chunks and manifest)")
    sp.add_argument("--chunk-mb", type=float, default=64.0, help="size of each safetensors chunk (bounds memory)")

    sp = add("compare", cmd_compare, "Compare two per-layer dumps offline (inputs, schema, then numbers).")
    sp.add_argument("ref_dump", metavar="REF_DUMP", help="the reference's dump folder")
    sp.add_argument("target_dump", metavar="TARGET_DUMP", help="the dump folder to compare with it")
    sp.add_argument("--json", default=None, help="also write the comparison as JSON here")
    sp.add_argument("--thresholds", default=None, metavar="FILE",
                    help="numerics thresholds file (OUT/thresholds/MODEL-KEY.json, written by the numerics mode of the "
                         "model's cell): hold each layer to its own threshold; without it or --derive, only the "
                         "fixed bands flag")
    sp.add_argument("--derive", default=None, metavar="SECOND_REF_DUMP",
                    help="derive each layer's threshold from the spread between REF_DUMP and this dump of a second "
                         "trusted reference of the same input (e.g. `dump --reference cpu-fp64`)")
    sp.add_argument("--fail-on", choices=("drift", "diverged", "broken", "never"), default="diverged",
                    help="exit 1 from this severity on (default: diverged)")

    _bisect_parsers(add)

    sp = add("env", cmd_env, "Versions, devices and available backends, for a bug report.")
    sp.add_argument("--json", action="store_true", help="print JSON instead of text")


def _printable_streams() -> None:
    """A message with a lone surrogate (a compiler's bad byte) is printed escaped, never a UnicodeEncodeError."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def main(argv: Sequence[str] | None = None) -> int:
    _printable_streams()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        handler: Handler | None = getattr(args, "handler", None)
        if handler is None:
            parser.print_help(sys.stderr)
            return errors.EXIT_USAGE
        check_outputs(args)
        return handler(args)
    except DeepviewError as exc:
        return errors.report_error(exc)
    except BrokenPipeError:
        return errors.EXIT_OK
    except OSError as exc:  # a file error no library call turned into a DeepviewError: still one line and exit 5
        if exc.filename is None:
            raise
        return errors.report_error(errors.ExecutionError(f"{exc.filename}: {exc.strerror or type(exc).__name__}",
                                                         hint="check that path: its permissions, its file system"))
    except KeyboardInterrupt:
        print("deepview-ci: interrupted; finished cells are kept, rerun to resume", file=sys.stderr)
        return errors.EXIT_INTERRUPTED

