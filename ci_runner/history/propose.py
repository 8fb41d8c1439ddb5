"""Expected results that keep themselves current: baseline updates proposed from the history.

Rules (``fixed_nights`` N, default 3, counts nights, newest last; runs of one date are one night, each cell's
newest run of it counting):

- a baseline finding absent on each of the last N nights, while its cell ran and its mode reached a verdict
  (pass or fail) each night, is removed (a finding marked ``flaky`` in the baseline is kept);
- a baseline cell whose status was the same better one on each of the last N nights gets that status and
  its modes' statuses;
- a cell not in the baseline that passed on each of the last N nights is added.

A regression never changes the baseline: no finding is added and no status gets worse. The proposal is a
new baseline file plus a Markdown summary of what changed and why; nothing is written when there is
nothing to propose.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..fsutil import atomic_write_text
from ..results.baseline import VERDICT, Baseline, BaselineCell, dumps_baseline
from ..results.model import STATUS_SEVERITY
from .store import History, RunRow
from .trends import night_groups


@dataclass(frozen=True, kw_only=True)
class ProposeOptions:
    fixed_nights: int = 3


@dataclass(frozen=True, kw_only=True)
class Change:
    what: str  # remove finding | update cell | add cell
    cell: str
    detail: str
    reason: str


@dataclass
class Proposal:
    baseline: Baseline
    changes: list[Change] = field(default_factory=list)
    nights: list[RunRow] = field(default_factory=list)

    def markdown(self) -> str:
        if not self.changes:
            return "Nothing to propose: the baseline matches the last nights.\n"
        span = f"{self.nights[0].date} … {self.nights[-1].date}" if self.nights else ""
        out = [f"### Baseline update proposed from the run history ({len(self.changes)} change(s))", "",
               f"Based on the last {len(self.nights)} nights ({span}). A regression never updates the baseline.", "",
               "| change | cell | what | why |", "|---|---|---|---|"]
        out += [f"| {c.what} | `{c.cell}` | {c.detail} | {c.reason} |" for c in self.changes]
        return "\n".join(out) + "\n"


def propose(h: History, base: Baseline, opts: ProposeOptions | None = None) -> Proposal:
    """The baseline `base` brought up to date with the history's last nights (see the module docstring)."""
    opts = opts or ProposeOptions()
    groups = night_groups([r for r in h.runs if r.kind == "run"])[-opts.fixed_nights:]
    recent = [g[-1] for g in groups]  # one row a night (runs of one date: split workflows)
    owners = [{cell: r.seq for r in g for cell in h.cell_runs.get(r.seq, {})} for g in groups]  # a cell's newest run

    def each_night(cell: str) -> list[Any]:
        return [h.cell_runs[own[cell]][cell] if cell in own else None for own in owners]

    new = Baseline(cells=dict(base.cells), findings=dict(base.findings), path=base.path)
    prop = Proposal(baseline=new, nights=recent)
    if len(recent) < opts.fixed_nights or opts.fixed_nights < 1:
        return prop
    ids = {(f.cell, f.fingerprint): fid for fid, f in h.findings.items()}
    last_seen = {fid: r.date for r in h.runs for fid in h.present.get(r.seq, ())}
    for key, bf in sorted(base.findings.items()):
        if bf.flaky:
            continue
        runs = each_night(bf.cell)
        if any(cr is None or cr.modes.get(bf.mode) not in VERDICT for cr in runs):
            continue  # not re-checked every night
        fid = ids.get(key)
        if fid is not None and any(fid in h.present.get(own[bf.cell], ()) for own in owners):
            continue
        del new.findings[key]
        seen = f"last seen {last_seen[fid]}" if fid is not None and fid in last_seen else "not seen in the history"
        prop.changes.append(Change(what="remove finding", cell=bf.cell, detail=f"{bf.kind} `{bf.key}`",
                                   reason=f"fixed for {len(recent)} nights in a row ({seen})"))
    newest = {cell: h.cell_runs[seq][cell] for cell, seq in owners[-1].items()}
    for cell, cr in sorted(newest.items()):
        runs = each_night(cell)
        if any(x is None or x.status != cr.status for x in runs):
            continue
        bc = base.cells.get(cell)
        model, backend = h.cells[cell]
        if bc is None and cr.status == "pass":
            new.cells[cell] = BaselineCell(id=cell, model=model, backend=backend, status="pass", modes=dict(cr.modes))
            prop.changes.append(Change(what="add cell", cell=cell, detail="pass",
                                       reason=f"a new cell passing for {len(recent)} nights"))
        elif bc is not None and cr.status != "skipped" and \
                STATUS_SEVERITY.get(cr.status, 3) < STATUS_SEVERITY.get(bc.status, 3) and not bc.flaky:
            modes = {m: s for m, s in cr.modes.items()
                     if STATUS_SEVERITY.get(s, 3) <= STATUS_SEVERITY.get(bc.modes.get(m, s), 3)}
            new.cells[cell] = replace(bc, status=cr.status, modes={**bc.modes, **modes})
            prop.changes.append(Change(what="update cell", cell=cell, detail=f"{bc.status} → {cr.status}",
                                       reason=f"{cr.status} on each of the last {len(recent)} nights"))
    return prop


def write_proposal(prop: Proposal, out: Path, summary: Path | None = None) -> tuple[Path, Path]:
    """The proposed baseline at `out` and its summary (default: next to it, ``<name>.md``)."""
    out = Path(out)
    summary = Path(summary) if summary else out.with_name(out.stem + ".md")
    return atomic_write_text(out, dumps_baseline(prop.baseline.to_dict())), atomic_write_text(summary, prop.markdown())
