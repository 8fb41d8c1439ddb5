"""The committed baseline and the diff of a run against it.

**Baseline file** (``baseline.json``, made by ``deepview-ci baseline update``; schema
``schemas/baseline.schema.json``). Meant to be committed and reviewed in pull requests: cells sorted by
id, findings sorted by cell then fingerprint, one cell or finding per line, no timestamps, paths,
host names or messages, so two runs of the same matrix on two machines give the same bytes::

    {
      "schema_version": 1,
      "kind": "deepview-ci-baseline",
      "cells": [
        {"backend": "sim-subset", "id": "tiny-llama@sim-subset", "model": "tiny-llama", "modes": {"ops": "fail"}, "status": "fail"}
      ],
      "findings": [
        {"cell": "tiny-llama@sim-subset", "fingerprint": "…", "key": "aten.cumsum.default", "kind": "unsupported_op", "mode": "ops"}
      ]
    }

A cell or finding entry may carry ``"flaky": true``. People add it by hand (or `update_baseline`
adds it from reruns); `update_baseline` keeps it, and keeps a flaky finding's entry even in a run
where the finding did not show up.

**Flaky.** A cell is flaky when its baseline entry says so, or when the results record reruns that
disagree: ``cell.env["attempts"]`` is the list, in order, of the cell's attempts when the executor
reran it (the last one is the cell's own result). Each attempt is either its status string
(``"fail"``) or an object ``{"status": "fail", "fingerprints": ["…", …]}``. The cell is flaky when
two attempts have different statuses; a finding is flaky when attempts list fingerprints and it is
in some attempts' lists but not in all of them. In a flaky cell, findings that come or go are
``flaky``, not ``regressed`` or ``fixed``.

**Categories** (one entry per finding, keyed by cell and fingerprint, plus cell-level entries with
``fingerprint: null``):

- ``regressed``: a new fingerprint in a cell of the baseline; or a cell or mode whose status got
  worse (pass → crashed, layers pass → error) in a way its new findings do not explain (new
  findings explain a move to ``fail``, never an error, timeout or crash): a cell-level entry.
- ``fixed``: a baseline finding that is gone while its mode ran to a verdict (pass/fail); or a
  cell or mode whose status got better in a way its fixed findings do not explain.
- ``persisting``: in both. Also a baseline finding whose mode did not reach a verdict in this run
  (skipped, error, timeout, crash): it was not re-checked, so it is kept, with that reason, never
  counted as fixed.
- ``flaky``: see above.
- With ``diff --history DIR``, a finding the run history calls flaky (it came and went over the last nights
  with an unchanged environment; `history.trends`) is ``flaky`` too, with the flip count as its reason, and
  ``diff.json`` gets a ``drifting`` list: layers whose error rises night after night under the threshold.
- ``new_cell`` / ``missing_cell``: a cell only in the results (one cell entry plus one entry per
  finding, so issues can be filed for them) / only in the baseline (one cell entry).

``--fail-on regression`` fails on ``regressed``; ``change`` fails on anything but ``persisting``
and ``flaky`` (so a fixed finding forces a baseline update and the baseline cannot go stale);
``never`` does not fail.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence, TextIO

from ..errors import EXIT_FINDINGS, EXIT_OK, InputError, UsageError
from ..fsutil import atomic_write_chunks, atomic_write_text
from ..github.actions import AnnotationCap, in_actions
from ..log import append_step_summary
from ..report.summary import SUMMARY_LIMIT, code, md, truncate_markdown
from ..failures.failure import headline
from ..registry import kind_names
from .model import CELL_STATUSES, STATUS_SEVERITY, CellResult, Finding, Results, backend_commit, clean, load_results, read_json, validate

BASELINE_SCHEMA_VERSION = 1
DIFF_SCHEMA_VERSION = 1
BASELINE_KIND = "deepview-ci-baseline"
CATEGORIES: tuple[str, ...] = ("regressed", "fixed", "persisting", "flaky", "new_cell", "missing_cell")
POLICIES: tuple[str, ...] = ("regression", "change", "never")
BAD = frozenset({"fail", "error", "timeout", "crashed"})
VERDICT = frozenset({"pass", "fail"})  # a mode that reached one of these looked at everything it checks


# --------------------------------------------------------------------------- baseline model


@dataclass(frozen=True, kw_only=True)
class BaselineCell:
    id: str
    model: str
    backend: str
    status: str
    modes: Mapping[str, str]
    flaky: bool = False
    backend_commit: str | None = None  # the backend's source commit in the run it was taken from (env stamp)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "model": self.model, "backend": self.backend, "status": self.status,
                             "modes": dict(sorted(self.modes.items()))}
        if self.flaky:
            d["flaky"] = True
        if self.backend_commit:
            d["backend_commit"] = self.backend_commit
        return d


@dataclass(frozen=True, kw_only=True)
class BaselineFinding:
    cell: str
    fingerprint: str
    kind: str
    mode: str
    key: str
    flaky: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"cell": self.cell, "fingerprint": self.fingerprint, "kind": self.kind,
                             "mode": self.mode, "key": self.key}
        if self.flaky:
            d["flaky"] = True
        return d


@dataclass
class Baseline:
    cells: dict[str, BaselineCell] = field(default_factory=dict)
    findings: dict[tuple[str, str], BaselineFinding] = field(default_factory=dict)
    path: Path | None = None

    def cell_findings(self, cell_id: str) -> dict[str, BaselineFinding]:
        return {fp: f for (cid, fp), f in self.findings.items() if cid == cell_id}

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": BASELINE_SCHEMA_VERSION,
            "kind": BASELINE_KIND,
            "cells": [self.cells[k].to_dict() for k in sorted(self.cells)],
            "findings": [self.findings[k].to_dict() for k in sorted(self.findings)],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, path: Path | None = None) -> "Baseline":
        b = cls(path=path)
        where = str(path) if path else "baseline"
        for c in data.get("cells", []):
            if c["id"] in b.cells:
                raise InputError(f"{where}: cell {c['id']!r} is listed twice",
                                 hint="remove the duplicate entry, or regenerate with `deepview-ci baseline update`")
            b.cells[c["id"]] = BaselineCell(id=c["id"], model=c["model"], backend=c["backend"], status=c["status"],
                                            modes=dict(c.get("modes") or {}), flaky=bool(c.get("flaky", False)),
                                            backend_commit=c.get("backend_commit"))
        for f in data.get("findings", []):
            key = (f["cell"], f["fingerprint"])
            if key in b.findings:
                raise InputError(f"{where}: finding {f['fingerprint']} of cell {f['cell']!r} is listed twice",
                                 hint="remove the duplicate entry, or regenerate with `deepview-ci baseline update`")
            b.findings[key] = BaselineFinding(cell=f["cell"], fingerprint=f["fingerprint"], kind=f["kind"],
                                              mode=f["mode"], key=f.get("key", ""), flaky=bool(f.get("flaky", False)))
        return b




def finding_key(f: Finding) -> str:
    """What a reviewer recognises a finding by: its op, else its module."""
    return f.op or f.module or ""


def _attempts(cell: CellResult) -> list[tuple[str, set[str] | None]]:
    raw = cell.env.get("attempts") if isinstance(cell.env, Mapping) else None
    out: list[tuple[str, set[str] | None]] = []
    if not isinstance(raw, Sequence) or isinstance(raw, (str, bytes)):
        return out
    for a in raw:
        if isinstance(a, str):
            out.append((a, None))
        elif isinstance(a, Mapping) and isinstance(a.get("status"), str):
            fps = a.get("fingerprints")
            out.append((a["status"], {str(x) for x in fps} if isinstance(fps, Sequence) and not isinstance(fps, str) else None))
    return out


def cell_is_flaky(cell: CellResult) -> bool:
    """True when the cell's recorded reruns (``env["attempts"]``) disagree on the status."""
    return len({status for status, _ in _attempts(cell)}) > 1


def flaky_fingerprints(cell: CellResult) -> set[str]:
    """Fingerprints present in some of the cell's recorded attempts but not in all of them."""
    sets = [fps for _, fps in _attempts(cell) if fps is not None]
    if len(sets) < 2:
        return set()
    return set().union(*sets) - set.intersection(*sets)


def make_baseline(results: Results) -> dict[str, Any]:
    """The baseline for `results`, as the dict written to disk (stable, reviewable, no timestamps)."""
    return _baseline_of(results).to_dict()


def _baseline_of(results: Results) -> Baseline:
    b = Baseline()
    for c in results.cells:
        b.cells[c.id] = BaselineCell(id=c.id, model=c.model, backend=c.backend, status=c.status,
                                     modes={m: r.status for m, r in c.modes.items()}, flaky=cell_is_flaky(c),
                                     backend_commit=backend_commit(c.env))
        shaky = flaky_fingerprints(c)
        for mname, mode in c.modes.items():
            for f in mode.findings:
                key = (c.id, f.fingerprint)
                if key not in b.findings:
                    b.findings[key] = BaselineFinding(cell=c.id, fingerprint=f.fingerprint, kind=f.kind, mode=mname,
                                                      key=finding_key(f), flaky=f.fingerprint in shaky)
    return b


def dumps_baseline(data: Mapping[str, Any]) -> str:
    """JSON with one cell or finding per line: reviewable diffs, stable bytes."""
    def one(obj: Any) -> str:
        return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(", ", ": "))

    lines = ["{", f'  "schema_version": {one(data["schema_version"])},', f'  "kind": {one(data["kind"])},']
    for name, last in (("cells", False), ("findings", True)):
        items = list(data.get(name, []))
        lines.append(f'  "{name}": [')
        lines += [f"    {one(x)}{',' if i < len(items) - 1 else ''}" for i, x in enumerate(items)]
        lines.append("  ]" if last else "  ],")
    lines.append("}")
    return "\n".join(lines) + "\n"


_ID = re.compile(r"[^@\s]+@[^@\s]+")
_FP = re.compile(r"[0-9a-f]{8,64}")
_COMMIT = re.compile(r"[0-9a-f]{7,64}")
_CELL_REQ, _CELL_KEYS = {"id", "model", "backend", "status", "modes"}, {"id", "model", "backend", "status", "modes", "flaky",
                                                                                  "backend_commit"}
_FIND_REQ, _FIND_KEYS = {"cell", "fingerprint", "kind", "mode"}, {"cell", "fingerprint", "kind", "mode", "key", "flaky"}


def _surely_valid(data: Any) -> bool:
    """A fast check at least as strict as baseline.schema.json: True means the schema accepts it.

    jsonschema takes seconds on a baseline of 20 000 findings; this takes milliseconds. When it
    says False, the caller runs the schema for the exact message."""
    if type(data) is not dict or set(data) != {"schema_version", "kind", "cells", "findings"}:
        return False
    if type(data["schema_version"]) is not int or data["schema_version"] != BASELINE_SCHEMA_VERSION:
        return False
    cells, findings = data["cells"], data["findings"]
    if data["kind"] != BASELINE_KIND or type(cells) is not list or type(findings) is not list:
        return False
    statuses = set(CELL_STATUSES)
    for c in cells:
        if type(c) is not dict or not _CELL_REQ <= c.keys() <= _CELL_KEYS:
            return False
        if not (type(c["id"]) is str and _ID.fullmatch(c["id"]) and type(c["model"]) is str and c["model"]
                and type(c["backend"]) is str and c["backend"] and type(c["status"]) is str and c["status"] in statuses
                and type(c["modes"]) is dict and type(c.get("flaky", False)) is bool
                and _COMMIT.fullmatch(str(c.get("backend_commit", "0000000")))):
            return False
        if not all(type(v) is str and v in statuses for v in c["modes"].values()):
            return False
    kinds = set(kind_names())
    for f in findings:
        if type(f) is not dict or not _FIND_REQ <= f.keys() <= _FIND_KEYS:
            return False
        if not (type(f["cell"]) is str and _ID.fullmatch(f["cell"]) and type(f["fingerprint"]) is str
                and _FP.fullmatch(f["fingerprint"]) and type(f["kind"]) is str and f["kind"] in kinds
                and type(f["mode"]) is str and f["mode"] and type(f.get("key", "")) is str
                and type(f.get("flaky", False)) is bool):
            return False
    return True


def load_baseline(path: Path) -> Baseline:
    """Read and validate a baseline file; `InputError` (exit 3) when missing, corrupt or of another schema."""
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{p}: is a folder, not a baseline file", hint="give the path of baseline.json")
    data = read_json(p, what="baseline")
    if not isinstance(data, dict) or data.get("kind") != BASELINE_KIND:
        raise InputError(f"{p}: not a deepview-ci baseline (no \"kind\": \"{BASELINE_KIND}\")",
                         hint="a baseline is made by `deepview-ci baseline update RESULTS --out BASELINE`; "
                              "did you pass results.json or diff.json?")
    if data.get("schema_version") != BASELINE_SCHEMA_VERSION:
        raise InputError(f"{p}: baseline schema_version {data.get('schema_version')!r} is not {BASELINE_SCHEMA_VERSION}",
                         hint="regenerate it with `deepview-ci baseline update` from this version")
    if not _surely_valid(data):
        validate(data, "baseline.schema.json", source=str(p))
    return Baseline.from_dict(data, path=p)


def update_baseline(results_path: Path, out: Path) -> Path:
    """Write the baseline for the results at `results_path` to `out`, keeping the flaky marks of the
    baseline already there (a corrupt one is an `InputError`: delete it to start afresh)."""
    results = load_results(results_path)
    new = _baseline_of(results)
    out = Path(out)
    if out.exists():
        prior = load_baseline(out)
        for cid, pc in prior.cells.items():
            if pc.flaky and cid in new.cells and not new.cells[cid].flaky:
                c = new.cells[cid]
                new.cells[cid] = BaselineCell(id=c.id, model=c.model, backend=c.backend, status=c.status,
                                              modes=c.modes, flaky=True)
        for key, pf in prior.findings.items():
            if not pf.flaky or pf.cell not in new.cells:
                continue
            nf = new.findings.get(key)
            new.findings[key] = BaselineFinding(cell=pf.cell, fingerprint=pf.fingerprint, kind=pf.kind, mode=pf.mode,
                                                key=(nf.key if nf else pf.key), flaky=True)
    return atomic_write_text(out, dumps_baseline(new.to_dict()))


# --------------------------------------------------------------------------- diff


@dataclass
class DiffEntry:
    category: str
    cell: str
    model: str
    backend: str
    fingerprint: str | None
    finding: dict[str, Any] | None
    status: str | None
    baseline_status: str | None
    artifacts_dir: str | None
    env: dict[str, Any]
    reason: str
    mode: str | None = None
    kind: str | None = None
    key: str | None = None

    def title(self) -> str:
        """One phrase: ``unsupported_op aten.cumsum.default``, or the cell status change."""
        if self.fingerprint is None:
            return f"cell {self.baseline_status or '—'} → {self.status or '—'}"
        f = self.finding or {}
        where = (f"{f['phase']} step {f['step']}" if f.get("step") is not None else f["phase"]) if f.get("phase") else ""
        where = ", ".join(w for w in (where, f.get("parallel") or "") if w)  # a tensor-parallel layout: `tp2`
        return f"{self.kind or 'finding'} {self.key}{f' [{where}]' if where else ''}".strip()

    def sort_key(self) -> tuple[int, str, str]:
        return (CATEGORIES.index(self.category), self.cell, self.fingerprint or "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "category": self.category, "cell": self.cell, "model": self.model, "backend": self.backend,
            "fingerprint": self.fingerprint, "finding": self.finding, "status": self.status,
            "baseline_status": self.baseline_status, "artifacts_dir": self.artifacts_dir, "env": self.env,
            "reason": self.reason, "mode": self.mode, "kind": self.kind, "key": self.key,
        }


@dataclass
class Diff:
    entries: list[DiffEntry] = field(default_factory=list)
    results_path: str | None = None
    baseline_path: str | None = None
    run_dir: str | None = None
    policy: str = "regression"
    drifting: list[dict[str, Any]] = field(default_factory=list)  # from the run history: layers rising under threshold

    def counts(self) -> dict[str, int]:
        out = {c: 0 for c in CATEGORIES}
        for e in self.entries:
            out[e.category] += 1
        return out

    def by_category(self, category: str) -> list[DiffEntry]:
        return [e for e in self.entries if e.category == category]

    def exit_code(self, fail_on: str) -> int:
        """0, or 1 (`EXIT_FINDINGS`) when the entries break the `fail_on` policy."""
        check_policy(fail_on)
        n = self.counts()
        if fail_on == "never":
            return EXIT_OK
        if fail_on == "regression":
            return EXIT_FINDINGS if n["regressed"] else EXIT_OK
        changed = n["regressed"] + n["fixed"] + n["new_cell"] + n["missing_cell"]
        return EXIT_FINDINGS if changed else EXIT_OK

    def to_dict(self, *, entries: bool = True) -> dict[str, Any]:
        """diff.json as a dict; `entries=False`: with an empty entry list (`diff_chunks` writes them one at a time)."""
        return {
            "schema_version": DIFF_SCHEMA_VERSION,
            "policy": self.policy,
            "results": self.results_path,
            "baseline": self.baseline_path,
            "run_dir": self.run_dir,
            "counts": self.counts(),
            **({"drifting": self.drifting} if self.drifting else {}),
            "entries": [e.to_dict() for e in self.entries] if entries else [],
        }


def check_policy(fail_on: str) -> str:
    if fail_on not in POLICIES:
        raise UsageError(f"--fail-on {fail_on!r} is not one of {', '.join(POLICIES)}",
                         hint="use `regression` for PR checks, `change` to keep the baseline current, `never` to report only")
    return fail_on


def _worse(new: str | None, old: str | None) -> bool:
    """`new` is a failure status worse than `old` (skipped/absent count as 'did not run')."""
    if new not in BAD:
        return False
    return old not in BAD or STATUS_SEVERITY[new] > STATUS_SEVERITY[old]


def _better(new: str | None, old: str | None) -> bool:
    if old not in BAD:
        return False
    return new == "pass" or (new in BAD and STATUS_SEVERITY[new] < STATUS_SEVERITY[old])


def _str(p: Any) -> str | None:
    return None if p is None else str(p)


@dataclass
class _DiffBuilder:
    """The diff being built, and one cleaned copy of each cell's env (shared by its entries)."""

    d: Diff
    envs: dict[str, dict[str, Any]] = field(default_factory=dict)
    history_flaky: dict[tuple[str, str], str] = field(default_factory=dict)  # (cell, fingerprint) → why

    def entry(self, category: str, c: CellResult | None, bc: BaselineCell | None, reason: str, *,
              fp: str | None = None, f: Finding | None = None, mode: str | None = None,
              kind: str | None = None, key: str | None = None) -> None:
        src = c or bc
        assert src is not None
        if category == "flaky" and fp is not None and (src.id, fp) in self.history_flaky:
            reason = self.history_flaky[(src.id, fp)]
        self.d.entries.append(DiffEntry(
            category=category, cell=src.id, model=src.model, backend=src.backend, fingerprint=fp,
            finding=f.to_dict() if f is not None else None,
            status=c.status if c else None, baseline_status=bc.status if bc else None,
            artifacts_dir=c.artifacts_dir if c else None, env=self.envs[src.id] if c else {},
            reason=reason, mode=mode, kind=kind if kind is not None else (f.kind if f else None),
            key=key if key is not None else (finding_key(f) if f else None),
        ))


def diff(
    results: Results,
    baseline: Baseline,
    *,
    results_path: Path | str | None = None,
    baseline_path: Path | str | None = None,
    run_dir: Path | str | None = None,
    policy: str = "regression",
    history_flaky: Mapping[tuple[str, str], str] | None = None,
    drifting: Sequence[Mapping[str, Any]] = (),
) -> Diff:
    """Classify every finding and cell of `results` against `baseline` (see the module docstring).

    `history_flaky` ((cell, fingerprint) → why, from the run history) makes those findings `flaky` whether
    they came or went; `drifting` (layers rising under their threshold) is carried into ``diff.json``."""
    check_policy(policy)
    b = _DiffBuilder(Diff(results_path=_str(results_path), baseline_path=_str(baseline_path or baseline.path),
                          run_dir=_str(run_dir), policy=policy, drifting=[dict(x) for x in drifting]),
                     history_flaky=dict(history_flaky or {}))
    by_cell: dict[str, dict[str, BaselineFinding]] = {}
    for (cid, fp), bf in baseline.findings.items():
        by_cell.setdefault(cid, {})[fp] = bf
    seen: set[str] = set()
    for c in results.cells:
        if c.id in seen:
            continue
        seen.add(c.id)
        b.envs[c.id] = clean(c.env)
        found: dict[str, tuple[str, Finding]] = {}
        for mname, mode in c.modes.items():
            for f in mode.findings:
                found.setdefault(f.fingerprint, (mname, f))
        bc = baseline.cells.get(c.id)
        if bc is None:
            b.entry("new_cell", c, None, f"cell not in the baseline ({c.status}, {len(found)} finding(s))")
            for fp, (mname, f) in sorted(found.items()):
                b.entry("new_cell", c, None, "finding in a cell not in the baseline", fp=fp, f=f, mode=mname)
            continue
        _diff_cell(b, c, bc, found, by_cell.get(c.id, {}))
    for cid, bc in sorted(baseline.cells.items()):
        if cid not in seen:
            n = len(by_cell.get(cid, {}))
            b.entry("missing_cell", None, bc, f"cell in the baseline ({bc.status}, {n} finding(s)) but not in the results")
    b.d.entries.sort(key=DiffEntry.sort_key)
    return b.d


def _diff_cell(b: _DiffBuilder, c: CellResult, bc: BaselineCell, found: dict[str, tuple[str, Finding]],
               base: dict[str, BaselineFinding]) -> None:
    """A cell the baseline has: its findings present and gone, then status changes no finding explains."""
    cell_flaky = bc.flaky or cell_is_flaky(c)
    shaky = flaky_fingerprints(c) | {fp for fp, bf in base.items() if bf.flaky} | \
        {fp for cid, fp in b.history_flaky if cid == c.id}
    regressed_modes: set[str] = set()
    fixed_modes: set[str] = set()
    for fp, (mname, f) in sorted(found.items()):
        if fp in base:
            if fp in shaky:
                b.entry("flaky", c, bc, "present; marked flaky", fp=fp, f=f, mode=mname)
            else:
                b.entry("persisting", c, bc, "in the baseline", fp=fp, f=f, mode=mname)
        elif cell_flaky or fp in shaky:
            b.entry("flaky", c, bc, "new finding in a cell whose reruns disagree" if cell_flaky else
                    "new finding that not every rerun shows", fp=fp, f=f, mode=mname)
        else:
            was = bc.modes.get(mname)
            why = "new finding" + (f" (mode {mname} was {was} in the baseline)" if was not in VERDICT and was else "")
            b.entry("regressed", c, bc, why, fp=fp, f=f, mode=mname)
            regressed_modes.add(mname)
    for fp, bf in sorted(base.items()):
        if fp in found:
            continue
        now = c.modes[bf.mode].status if bf.mode in c.modes else None
        if now not in VERDICT:
            b.entry("persisting", c, bc, f"not re-checked: mode {bf.mode} {'did not run' if now is None else now} in this run",
                    fp=fp, mode=bf.mode, kind=bf.kind, key=bf.key)
        elif cell_flaky or fp in shaky:
            b.entry("flaky", c, bc, "gone this run; marked flaky", fp=fp, mode=bf.mode, kind=bf.kind, key=bf.key)
        else:
            b.entry("fixed", c, bc, "finding gone", fp=fp, mode=bf.mode, kind=bf.kind, key=bf.key)
            fixed_modes.add(bf.mode)
    _diff_status(b, c, bc, cell_flaky=cell_flaky, regressed_modes=regressed_modes, fixed_modes=fixed_modes)


def _diff_status(b: _DiffBuilder, c: CellResult, bc: BaselineCell, *, cell_flaky: bool, regressed_modes: set[str],
                 fixed_modes: set[str]) -> None:
    """Status changes that no finding explains: new findings explain a move to "fail", never an error, timeout or
    crash (and the reverse)."""
    modes = sorted(set(c.modes) | set(bc.modes))
    worse = [m for m in modes if _worse(c.modes[m].status if m in c.modes else None, bc.modes.get(m))]
    better = [m for m in modes if _better(c.modes[m].status if m in c.modes else None, bc.modes.get(m))]
    mode_now = {m: (c.modes[m].status if m in c.modes else None) for m in modes}
    unexplained_worse = [m for m in worse if not (mode_now[m] == "fail" and m in regressed_modes)]
    unexplained_better = [m for m in better if not (bc.modes.get(m) == "fail" and m in fixed_modes)]
    cell_worse = _worse(c.status, bc.status) and not (c.status == "fail" and regressed_modes)
    cell_better = _better(c.status, bc.status) and not (bc.status == "fail" and fixed_modes)

    def change(ms: list[str]) -> str:
        parts = [] if c.status == bc.status else [f"status {bc.status} → {c.status}"]
        parts += [f"mode {m}: {bc.modes.get(m, 'not run')} → {c.modes[m].status if m in c.modes else 'not run'}" for m in ms]
        return "; ".join(parts) or f"status {bc.status} → {c.status}"

    if unexplained_worse or cell_worse:
        b.entry("flaky" if cell_flaky else "regressed", c, bc,
                change(unexplained_worse) + ("; reruns disagree" if cell_flaky else ""))
    elif unexplained_better or cell_better:
        b.entry("flaky" if cell_flaky else "fixed", c, bc,
                change(unexplained_better) + ("; reruns disagree" if cell_flaky else ""))


# --------------------------------------------------------------------------- outputs


def render_diff_markdown(d: Diff, *, max_rows: int = 200) -> str:
    """The diff as a Markdown section for the step summary / PR comment (capped like the summary)."""
    n = d.counts()
    fails = d.exit_code(d.policy) != EXIT_OK
    head = "🔴" if n["regressed"] else ("🟡" if fails else "🟢")
    out = [f"### {head} Baseline diff: {n['regressed']} regressed, {n['fixed']} fixed",
           "",
           " · ".join(f"{n[c]} {c.replace('_', ' ')}" for c in CATEGORIES)
           + f" · policy `--fail-on {d.policy}`: **{'fails' if fails else 'passes'}**",
           ""]

    def table(entries: list[DiffEntry], title: str, folded: bool = False) -> None:
        if not entries:
            return
        if folded:
            out.extend([f"<details><summary>{title} ({len(entries)})</summary>", ""])
        else:
            out.extend([f"#### {title} ({len(entries)})", ""])
        out.extend(["| cell | what | reason | repro |", "|---|---|---|---|"])
        for e in entries[:max_rows]:
            repro = ""
            if e.finding and e.finding.get("repro"):
                r = e.finding["repro"]
                path = f"{e.artifacts_dir}/{r.get('path')}" if e.artifacts_dir else r.get("path")
                repro = code(path) + (" ✔" if r.get("verified") else "")
            msg = ""
            if e.finding and e.finding.get("message"):
                msg = ": " + md(headline(e.finding["message"]), 160)
            out.append(f"| {code(e.cell)} | {md(e.title())}{msg} | {md(e.reason)} | {repro} |")
        if len(entries) > max_rows:
            out.extend(["", f"… and {len(entries) - max_rows} more (see `diff.json`)."])
        out.append("")
        if folded:
            out.extend(["</details>", ""])

    table(d.by_category("regressed"), "🔴 Regressed")
    table(d.by_category("fixed"), "🟢 Fixed")
    table(d.by_category("new_cell"), "🆕 New cells")
    table(d.by_category("missing_cell"), "❔ Missing cells")
    table(d.by_category("flaky"), "🎲 Flaky", folded=True)
    if d.drifting:
        out.extend([f"#### 📈 Drifting ({len(d.drifting)}): rising night after night, still under the threshold", "",
                    "| cell | layer | trend |", "|---|---|---|"])
        out.extend(f"| {code(x.get('cell'))} | {code(x.get('layer'))} | {md(x.get('trend'))} |" for x in d.drifting[:max_rows])
        out.append("")
    table(d.by_category("persisting"), "Persisting", folded=True)
    if n["fixed"] and d.policy != "change":
        out.extend(["Fixed findings: refresh the baseline with `deepview-ci baseline update RESULTS --out BASELINE`.", ""])
    return truncate_markdown("\n".join(out) + "\n", SUMMARY_LIMIT,
                             pointer="the full diff is `diff.json` next to this file")


def _diff_chunks(head: Mapping[str, Any], entries: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    def one(obj: Any) -> str:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False)

    yield "{\n"
    for k, v in head.items():
        yield f"  {one(k)}: {one(v)},\n"
    yield '  "entries": ['
    sep = "\n    "
    for e in entries:
        yield sep + one(e)
        sep = ",\n    "
    yield "\n  ]\n}\n"


def dumps_diff(data: Mapping[str, Any]) -> str:
    """diff.json with one entry per line: readable, greppable, and written by the C JSON encoder."""
    return "".join(_diff_chunks({k: v for k, v in data.items() if k != "entries"}, data.get("entries", [])))


def diff_chunks(d: Diff) -> Iterator[str]:
    """`dumps_diff(d.to_dict())` piece by piece: each entry's dict is made, written and dropped (a big run's diff.json
    is as big as its results.json)."""
    head = {k: v for k, v in d.to_dict(entries=False).items() if k != "entries"}
    return _diff_chunks(head, (e.to_dict() for e in d.entries))


def write_diff(d: Diff, out_dir: Path, *, env: Mapping[str, str] | None = None) -> tuple[Path, Path]:
    """Write ``diff.json`` and ``diff.md`` into `out_dir` atomically; append the Markdown to
    ``GITHUB_STEP_SUMMARY`` when it is set (within the 1 MiB cap)."""
    out_dir = Path(out_dir)
    text = render_diff_markdown(d)
    j = atomic_write_chunks(out_dir / "diff.json", diff_chunks(d))
    m = atomic_write_text(out_dir / "diff.md", text)
    append_step_summary(text, env=env, pointer="the full diff is `diff.json` in the run's artifacts")
    return j, m


def annotate_regressions(d: Diff, *, env: Mapping[str, str] | None = None, stream: TextIO | None = None,
                         cap: Any = None) -> int:
    """``::error`` annotations for the regressions under ``GITHUB_ACTIONS=true``, within GitHub's caps
    (10 errors per step, 50 per job); the last free slot says how many more there are. Returns the
    number of annotations written."""
    if not in_actions(env):
        return 0
    regs = d.by_category("regressed")
    if not regs:
        return 0
    cap = cap or AnnotationCap.from_env(env)
    written = 0
    for i, e in enumerate(regs):
        left = cap.remaining("error")
        if left <= 0:
            break
        rest = len(regs) - i
        if left == 1 and rest > 1:
            msg = (f"{rest} more regressions against the baseline (of {len(regs)}): "
                   "see the step summary and diff.json")
            if cap.annotate("error", msg, title="deepview-ci: more regressions", stream=stream):
                written += 1
            break
        msg = f"{e.title()} — {e.reason}"
        if e.finding and e.finding.get("message"):
            msg += f"\n{headline(e.finding['message'], 500)}"
        if e.finding and e.finding.get("repro"):
            msg += f"\nrepro: {(e.artifacts_dir + '/') if e.artifacts_dir else ''}{e.finding['repro'].get('path')}"
        if cap.annotate("error", msg, title=f"deepview-ci regression in {e.cell}", stream=stream):
            written += 1
    return written
