"""`deepview-ci history …` and `baseline propose`: thin handlers over the history library, plus the
``--history DIR`` options that `aggregate` and `diff` share."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..errors import UsageError
from ..github.actions import annotate
from ..github.client import ClientOptions
from ..results.baseline import load_baseline
from ..results.model import Results, load_results
from .compact import DEFAULT_KEEP, compact, export_csv
from .gitpush import PushOptions, push_run
from .propose import ProposeOptions, propose, write_proposal
from .pullrequest import open_pr
from .records import RunMeta, check_date, run_meta
from .store import add_run, load_history, load_history_or_fresh, size_on_disk
from .trends import TrendOptions, Trends, compute, night_counts

Handler = Callable[[argparse.Namespace], int]


def add_trend_options(sp: argparse.ArgumentParser) -> None:
    """``--history DIR`` and the flaky/drifting policies (defaults: `TrendOptions`)."""
    d = TrendOptions()
    sp.add_argument("--history", default=None, metavar="DIR",
                    help="run history folder (`deepview-ci history add`): read, never written here")
    sp.add_argument("--flaky-window", type=int, default=d.flaky_window, metavar="N",
                    help=f"nights looked at for flaky findings (default {d.flaky_window})")
    sp.add_argument("--flaky-flips", type=int, default=d.flaky_flips, metavar="N",
                    help=f"flips in that window that make a finding flaky (default {d.flaky_flips})")
    sp.add_argument("--drift-nights", type=int, default=d.drift_nights, metavar="N",
                    help=f"nights a layer figure must rise in a row to be drifting (default {d.drift_nights})")
    sp.add_argument("--drift-min-slope", type=float, default=d.drift_min_slope, metavar="X",
                    help=f"least rise per night to call it drifting (default {d.drift_min_slope}: +3 %%/night)")


def trend_options(args: argparse.Namespace) -> TrendOptions:
    for name in ("flaky_window", "flaky_flips", "drift_nights"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return TrendOptions(flaky_window=args.flaky_window, flaky_flips=args.flaky_flips, drift_nights=args.drift_nights,
                        drift_min_slope=args.drift_min_slope)


def trends_for(args: argparse.Namespace, results: Results) -> Trends | None:
    """The trends of `--history DIR` with `results` as the newest night (unless the history holds it)."""
    if not getattr(args, "history", None):
        return None
    meta = run_meta(results, run_id=None, date=None, env=os.environ)  # a re-run replaces its earlier attempt
    if not Path(args.history).exists():
        print(f"deepview-ci: no history at {args.history} yet; trends start with this run", file=sys.stderr)
    opts = trend_options(args)
    h = load_history_or_fresh(Path(args.history), current=results, current_meta=meta, window=opts.max_points,
                              warn=_warn_history)
    try:
        return compute(h, opts)
    finally:
        h.close()


def _warn_history(message: str) -> None:
    """A history set aside: said on stderr, and as a workflow warning on Actions."""
    print(f"deepview-ci: warning: {message}", file=sys.stderr)
    if os.environ.get("GITHUB_ACTIONS") == "true":
        annotate("warning", message + " (the next `history push` repairs the branch)", title="deepview-ci history")


def cmd_history_add(args: argparse.Namespace) -> int:
    results = load_results(Path(args.results))
    meta = run_meta(results, run_id=args.run_id, date=args.date, env=os.environ)
    if args.trigger:
        meta = RunMeta(**{**meta.to_dict(), "trigger": args.trigger})
    if args.commit:
        meta = RunMeta(**{**meta.to_dict(), "commit": args.commit})
    path, new = add_run(Path(args.store), results, meta, source=str(args.results), warn=_warn_history)
    print(f"history: {'added' if new else 'already holds'} run {meta.run_id} ({meta.date}) → {args.store}"
          f" ({size_on_disk(Path(args.store)) / 1e6:.2f} MB)")
    return 0


def cmd_history_show(args: argparse.Namespace) -> int:
    h = load_history(Path(args.store), warn=_warn_history)
    try:
        print(f"{len(h.runs)} run(s), {night_counts(h.runs)[0]} night(s), {len(h.cells)} cell(s), "
              f"{len(h.findings)} distinct finding(s); {size_on_disk(Path(args.store)) / 1e6:.2f} MB on disk")
        for r in h.runs:
            cells = h.cell_runs.get(r.seq, {})
            bad = sum(1 for c in cells.values() if c.status not in ("pass", "skipped"))
            extra = f" ({r.nights} nights)" if r.kind != "run" else ""
            print(f"  {r.run_id}  {r.date}  {r.kind}{extra}  {r.trigger or '-'}  {r.commit[:10] or '-'}  "
                  f"{len(cells)} cells, {bad} failing, {len(h.present.get(r.seq, ()))} findings")
    finally:
        h.close()
    return 0


def cmd_history_export(args: argparse.Namespace) -> int:
    h = load_history(Path(args.store), warn=_warn_history)
    try:
        written = export_csv(h, Path(args.out))
    finally:
        h.close()
    for name, path in written.items():
        print(f"  {name}: {path}")
    return 0


def cmd_history_compact(args: argparse.Namespace) -> int:
    if args.keep < 1:
        raise UsageError(f"--keep must be at least 1, got {args.keep}")
    folded, weeks = compact(Path(args.store), keep=args.keep)
    print(f"history: {folded} run(s) past the newest {args.keep} folded into {weeks} week(s); "
          f"{size_on_disk(Path(args.store)) / 1e6:.2f} MB on disk")
    return 0


def cmd_history_push(args: argparse.Namespace) -> int:
    results = load_results(Path(args.results))
    meta = run_meta(results, run_id=args.run_id, date=args.date, env=os.environ)
    opts = PushOptions(remote=args.remote, branch=args.branch, repo_dir=Path(args.repo), retries=args.retries,
                       compact_every=args.compact_every, keep=args.keep)
    report = push_run(results, meta, opts)
    print(report)
    if "; set aside (" in report:
        _warn_history(report.split("; set aside ", 1)[1].split(";")[0].split(" →")[0])
    return 0


def cmd_baseline_propose(args: argparse.Namespace) -> int:
    if args.fixed_nights < 1:
        raise UsageError(f"--fixed-nights must be at least 1, got {args.fixed_nights}")
    base = load_baseline(Path(args.baseline))
    h = load_history(Path(args.history))
    try:
        prop = propose(h, base, ProposeOptions(fixed_nights=args.fixed_nights))
    finally:
        h.close()
    if not prop.changes:
        print(f"baseline propose: nothing to propose ({args.baseline} matches the last {args.fixed_nights} nights)")
        return 0
    out, summary = write_proposal(prop, Path(args.out), Path(args.summary) if args.summary else None)
    print(prop.markdown())
    print(f"proposed baseline: {out}\nsummary: {summary}")
    if args.pr:
        print(open_pr(args, out, prop.markdown(), os.environ, ClientOptions(min_write_interval=args.min_interval)))
    return 0


def register(add: Callable[..., argparse.ArgumentParser], parser_class: type) -> None:
    """The `history` command and its subcommands."""
    sp = add("history", _missing, "Keep the run history: add runs, list, export, compact, push to a branch.")
    hs = sp.add_subparsers(dest="history_command", metavar="SUBCOMMAND", parser_class=parser_class)

    def store(p: argparse.ArgumentParser) -> None:
        p.add_argument("--store", required=True, metavar="DIR", help="the history folder (history.sqlite + runs/)")

    p = hs.add_parser("add", help="Add one run's results.json to the history.")
    p.set_defaults(handler=cmd_history_add)
    p.add_argument("results", metavar="RESULTS.json", help="results.json of the run (from `run` or `aggregate`)")
    store(p)
    _run_identity(p)
    p.add_argument("--trigger", default=None, help="what started the run (default: GITHUB_EVENT_NAME, else local)")
    p.add_argument("--commit", default=None, help="the commit the run tested (default: GITHUB_SHA)")
    p = hs.add_parser("show", help="List the runs of the history by id.")
    p.set_defaults(handler=cmd_history_show)
    store(p)
    p = hs.add_parser("export", help="Write the history as CSV files (runs, cells, findings, layers).")
    p.set_defaults(handler=cmd_history_export)
    store(p)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for runs.csv, cells.csv, findings.csv, layers.csv")
    p = hs.add_parser("compact", help="Fold runs past the newest --keep into weekly summaries.")
    p.set_defaults(handler=cmd_history_compact)
    store(p)
    p.add_argument("--keep", type=int, default=DEFAULT_KEEP, help=f"nightly runs kept in full (default {DEFAULT_KEEP})")
    p = hs.add_parser("push", help="Add this run to the history on a git branch, and push it (retries, never forces).")
    p.set_defaults(handler=cmd_history_push)
    p.add_argument("results", metavar="RESULTS.json", help="results.json of the run to add to the branch's history")
    _run_identity(p)
    p.add_argument("--branch", default="deepview-history", help="branch holding the history (default deepview-history)")
    p.add_argument("--remote", default="origin", help="remote to fetch from and push to (default origin)")
    p.add_argument("--repo", default=".", help="a clone of the repository (default: the current folder)")
    p.add_argument("--retries", type=int, default=5, help="tries when another run pushed first (default 5)")
    p.add_argument("--compact-every", type=int, default=7, metavar="N",
                   help="fold the branch's run files into history.sqlite once N are pending (default 7)")
    p.add_argument("--keep", type=int, default=DEFAULT_KEEP, help=f"nightly runs kept in full (default {DEFAULT_KEEP})")


def register_propose(bsub: Any) -> None:
    """`baseline propose` under the existing `baseline` command."""
    p = bsub.add_parser("propose", help="Propose a baseline update from the run history.")
    p.set_defaults(handler=cmd_baseline_propose)
    p.add_argument("--history", required=True, metavar="DIR", help="the history folder")
    p.add_argument("--baseline", required=True, metavar="FILE", help="the committed baseline")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the proposed baseline")
    p.add_argument("--summary", default=None, metavar="FILE", help="where to write the summary (default: OUT's name .md)")
    p.add_argument("--fixed-nights", type=int, default=ProposeOptions().fixed_nights, metavar="N",
                   help=f"nights a finding must be gone, or a new cell pass (default {ProposeOptions().fixed_nights})")
    p.add_argument("--pr", action="store_true", help="open or update one pull request with the proposal (GitHub API)")
    p.add_argument("--repo", default=None, metavar="OWNER/NAME", help="with --pr: the repository (default GITHUB_REPOSITORY)")
    p.add_argument("--path", default=None, metavar="PATH", help="with --pr: the baseline's path in the repository (default --baseline)")
    p.add_argument("--base", default=None, help="with --pr: the branch to propose into (default: the repository's default)")
    p.add_argument("--pr-branch", default="deepview-ci/baseline-update", help="with --pr: the proposal's branch")
    p.add_argument("--min-interval", type=float, default=1.0, help="with --pr: seconds between writes (GitHub: ≥ 1)")


def _run_identity(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-id", default=None, metavar="ID",
                   help="the run's id (default: GITHUB_RUN_ID-GITHUB_RUN_ATTEMPT, else a hash of the results)")
    p.add_argument("--date", default=None, type=_date_arg, metavar="YYYY-MM-DD",
                   help="the night the run belongs to (default: the results' generated_at date)")


def _date_arg(text: str) -> str:
    try:
        return check_date(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None


def _missing(args: argparse.Namespace) -> int:
    raise UsageError("history: missing subcommand", hint="use `deepview-ci history add|show|export|compact|push`")
