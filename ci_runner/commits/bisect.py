"""`deepview-ci bisect-commits`: which commit of the backend's own history broke a finding's repro.

A target is a finding with its verified repro (`--finding RESULTS.json:FINGERPRINT`, or `--repro PATH` inside a
run folder, which names its finding). Targets that share a root-cause signature (`rootcause.signature`) are
bisected once: the first one walks the history, the others reuse its answer, also across invocations (the answer
is kept in the cache, keyed by good, bad, setup and signature). The walk (`walk.walk`) runs in a scratch clone
(`scratch.scratch_clone`), never in the user's checkout, which is checked unchanged at the end.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import ExecutionError, InputError, UsageError
from ..fsutil import atomic_write_json
from ..results.model import CellResult, Finding, load_cell_result, load_results
from .scratch import RepoState, candidates, check_repo, commit_info, resolve, scratch_clone
from .steps import Expectation, Setup, Step, run_step
from .walk import Budget, WalkResult, walk


@dataclass(frozen=True, kw_only=True)
class Target:
    finding: Finding
    repro: Path
    label: str  # cell id and fingerprint, for the log


@dataclass(frozen=True, kw_only=True)
class Request:
    repo: Path
    good: str
    bad: str
    setup: tuple[str, ...]
    python: str
    budget: Budget = field(default_factory=Budget)
    cache: Path = field(default_factory=lambda: default_cache())


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepview-ci" / "bisect"


def find_python(python: str) -> str:
    """`--python` as an absolute path (a name is looked up on PATH; a venv's symlink is kept, not resolved)."""
    found = shutil.which(python) if os.sep not in python else (python if os.access(python, os.X_OK) else None)
    if not found:
        raise UsageError(f"--python {python}: no such interpreter", hint="give the interpreter the backend is installed into")
    return os.path.abspath(found)


# ---------------------------------------------------------------------------- targets

def _cell_folder(results_path: Path, cell: CellResult) -> Path:
    if results_path.name == "result.json":
        return results_path.parent
    rel = cell.artifacts_dir or f"cells/{cell.id}"
    for base in (results_path.parent, *results_path.parent.parents):
        if (base / rel).is_dir():
            return base / rel
    raise InputError(f"{results_path}: the folder of cell {cell.id} ({rel}) is not next to it",
                     hint="keep results.json inside its run folder, or pass a cell's result.json")


def _cells(path: Path) -> list[CellResult]:
    if not path.is_file():
        raise InputError(f"{path}: no such results file", hint="give results.json of a run, or a cell's result.json")
    if path.name == "result.json":
        return [load_cell_result(path)]
    return list(load_results(path).cells)


def target_of_finding(spec: str) -> Target:
    """`RESULTS.json:FINGERPRINT` → the finding and its repro script."""
    path_text, sep, fp = spec.rpartition(":")
    if not sep or not fp:
        raise UsageError(f"--finding {spec}: expected RESULTS.json:FINGERPRINT", hint="e.g. out/report/results.json:7388174f93")
    path = Path(path_text)
    for cell in _cells(path):
        for mode in cell.modes.values():
            for f in mode.findings:
                if f.fingerprint.startswith(fp):
                    return _target(path, cell, f)
    raise InputError(f"{path}: no finding with fingerprint {fp}", hint="fingerprints are in results.json and the issue titles")


def _target(path: Path, cell: CellResult, f: Finding) -> Target:
    return target_in_cell(f, _cell_folder(path, cell), cell.id)


def target_in_cell(f: Finding, folder: Path, cell_id: str) -> Target:
    """Finding `f` of the cell in `folder` with its repro: the culprit's (the failing op(s) alone) when verified."""
    if f.repro is None:
        raise InputError(f"finding {f.fingerprint} of {cell_id} has no repro", hint="only ops and layers findings have repros")
    script = folder / f.repro.path
    culprit = f.details.get("culprit") if isinstance(f.details.get("culprit"), dict) else None
    if culprit and isinstance(culprit.get("repro"), dict) and culprit["repro"].get("verified"):
        script = folder / culprit["repro"]["path"]
    if not script.is_file():
        raise InputError(f"{script}: the repro of finding {f.fingerprint} is missing", hint="bisect from the run folder that made it")
    return Target(finding=f, repro=script, label=f"{cell_id} {f.fingerprint}")


def target_of_repro(repro: Path) -> Target:
    """A repro script inside a run folder → the finding it reproduces (its cell's result.json names it)."""
    repro = repro.resolve()
    if not repro.is_file():
        raise UsageError(f"--repro {repro}: no such file", hint="give a repro script from a run folder (cells/<id>/…)")
    for folder in repro.parents:
        result = folder / "result.json"
        if result.is_file():
            cell = load_cell_result(result)
            for mode in cell.modes.values():
                for f in mode.findings:
                    culprit = f.details.get("culprit") if isinstance(f.details.get("culprit"), dict) else {}
                    paths = [f.repro.path if f.repro else None, (culprit.get("repro") or {}).get("path")]
                    if any(p and (folder / p).resolve() == repro for p in paths):
                        return Target(finding=f, repro=repro, label=f"{cell.id} {f.fingerprint}")
            break
    raise InputError(f"--repro {repro}: no finding of its run names this script",
                     hint="give a repro from a run folder (its cell's result.json says what failure it reproduces)")


# ---------------------------------------------------------------------------- one bisection

@dataclass(kw_only=True)
class Bisection:
    """The answer for one root-cause signature, and the targets it covers."""

    signature: str
    good: str
    bad: str
    first_bad: dict[str, str] | None
    range: list[dict[str, str]]  # the commits that may be first bad (one when exact)
    steps: list[dict[str, Any]]
    stopped: str
    findings: list[str] = field(default_factory=list)
    reused: bool = False

    @property
    def repro_runs(self) -> int:
        return sum(1 for s in self.steps if s.get("repro_ran"))

    def to_dict(self) -> dict[str, Any]:
        return {"signature": self.signature, "good": self.good, "bad": self.bad, "first_bad": self.first_bad,
                "range": self.range, "stopped": self.stopped, "findings": self.findings, "reused": self.reused,
                "repro_runs": self.repro_runs, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Bisection":
        return cls(signature=d["signature"], good=d["good"], bad=d["bad"], first_bad=d.get("first_bad"),
                   range=list(d.get("range") or []), steps=list(d.get("steps") or []), stopped=d.get("stopped", ""),
                   findings=list(d.get("findings") or []), reused=bool(d.get("reused")))

    def line(self) -> str:
        """The one line `bisect-commits` prints."""
        if self.first_bad:
            return f"first bad commit: {self.first_bad['commit']} {self.first_bad['subject']}"
        shown = ", ".join(f"{c['commit'][:12]} {c['subject']}" for c in self.range[:8])
        why = f" ({self.stopped})" if self.stopped else ""
        return f"first bad commit is one of {len(self.range)}{why}: {shown}"


def _memo_path(cache: Path, good: str, bad: str, sig: str) -> Path:
    return cache / "bisections" / f"{good[:16]}-{bad[:16]}-{sig}.json"


def _walk_one(req: Request, setup: Setup, tree: Path, target: Target, good: str, bad: str) -> Bisection:
    commits = candidates(req.repo, good, bad)
    expect = Expectation.of(target.finding)
    steps: list[Step] = []

    def classify(index: int) -> Any:
        step = run_step(setup, tree, commits[index], target.repro, expect)
        steps.append(step)
        return step.verdict

    result: WalkResult = walk(len(commits), classify, req.budget)
    last = len(commits) - 1
    if result.first_bad == last and last not in result.tried:  # every other commit was good: is the bad ref bad?
        verdict = classify(last)
        if verdict != "bad":
            result = WalkResult(first_bad=None, low=result.low, high=last, tried=result.tried + [last],
                                stopped=f"the bad ref does not fail like the finding (its step: {verdict})")
    low, high = result.range
    in_range = [commit_info(req.repo, c).to_dict() for c in commits[low:high + 1]]
    first = commit_info(req.repo, commits[result.first_bad]).to_dict() if result.first_bad is not None else None
    return Bisection(signature=expect.signature, good=good, bad=bad, first_bad=first, range=in_range,
                     steps=[s.to_dict() for s in steps], stopped=result.stopped, findings=[target.label])


def bisect_targets(req: Request, targets: Sequence[Target]) -> list[Bisection]:
    """Bisect each distinct root-cause signature of `targets` once (or reuse a cached answer); the user's repository is
    checked unchanged afterwards, also when interrupted."""
    repo = check_repo(req.repo)
    req = Request(repo=repo, good=req.good, bad=req.bad, setup=req.setup, python=find_python(req.python),
                  budget=req.budget, cache=req.cache.resolve())  # setup runs elsewhere: no relative paths
    good, bad = resolve(repo, req.good), resolve(repo, req.bad)
    setup = Setup(commands=req.setup, python=req.python, cache=req.cache / Setup.key(req.setup, req.python),
                  timeout=req.budget.step_timeout)
    before = RepoState.of(repo)
    groups: dict[str, Bisection] = {}
    try:
        with scratch_clone(repo) as tree:
            for target in targets:
                sig = Expectation.of(target.finding).signature
                if sig in groups:
                    groups[sig].findings.append(target.label)
                    continue
                memo = _memo_path(setup.cache, good, bad, sig)
                if memo.is_file():
                    groups[sig] = Bisection.from_dict(json.loads(memo.read_text(encoding="utf-8")))
                    groups[sig].reused, groups[sig].findings = True, [target.label]
                    continue
                groups[sig] = _walk_one(req, setup, tree, target, good, bad)
                if not groups[sig].stopped.startswith("the "):  # a budget's partial answer is not kept
                    atomic_write_json(memo, groups[sig].to_dict())
    finally:
        after = RepoState.of(repo)
        if after != before:  # never expected: the walk only touches its scratch clone
            raise ExecutionError(f"{repo}: the repository changed during the bisection ({before} → {after})")
    return list(groups.values())


def write_report(path: Path, bisections: Sequence[Bisection]) -> Path:
    """`--out`: the first signature's `first_bad` and `steps` at the top, every signature under `bisections`."""
    head = bisections[0]
    return atomic_write_json(path, {"first_bad": head.first_bad, "range": head.range, "stopped": head.stopped,
                                    "steps": head.steps, "bisections": [b.to_dict() for b in bisections]})

