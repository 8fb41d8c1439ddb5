"""What the nights say together: since when a finding fails, flaky versus drifting, burn-downs, times.

Policies (`TrendOptions`, defaults documented in docs/history.md):

- **flaky**: a finding that came and went at least ``flaky_flips`` times (default 2) over the last
  ``flaky_window`` nights (default 10) its cell ran, while the cell's environment stamp stayed the same. A
  flaky finding is reported as `flaky`, never `regressed`, and files no issue.
- **drifting**: a layer figure (rel, 1 − cos or mad; the worst of both views) that rose on each of the last
  ``drift_nights`` nights (default 5; a dip within the 0.3 % storage step counts as flat) with a log-linear
  slope of at least ``drift_min_slope`` per night (default 3 %), while still under its threshold. It is a
  warning before the layer crosses; the estimate of nights left assumes the same slope.
- **since**: a finding's current streak: the first night of the unbroken run of nights up to now that
  show it, how many nights that is (a compacted week counts its nights), and the environment it first
  failed in (backend version, and the run's commit).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..registry import mode_hooks
from ..results.baseline import BAD
from .store import History, RunRow

FIGURE_NAMES = ("rel", "1 − cos", "mad")
QUANT_STEP = 2.0 ** (1 / 256) - 1  # the database's storage step (relative)


@dataclass(frozen=True, kw_only=True)
class TrendOptions:
    flaky_window: int = 10
    flaky_flips: int = 2
    drift_nights: int = 5
    drift_min_slope: float = 0.03
    max_points: int = 120  # nights drawn in charts and burn-downs (the newest)
    chart_cells: int = 16  # cells with a per-layer chart
    chart_layers: int = 3  # worst layers per chart
    figure_change: float = 0.2  # a named figure with a fraction (seconds) moved when it changes by more than this


@dataclass(frozen=True, kw_only=True)
class Since:
    cell: str
    fingerprint: str
    kind: str
    key: str
    date: str  # first night of the current streak
    nights: int
    first_at: str  # backend version / commit of that night
    first_seen: str  # first night ever
    last_seen: str

    def words(self) -> str:
        at = f", first at {self.first_at}" if self.first_at else ""
        return f"failing since {self.date} ({self.nights} night{'s' if self.nights != 1 else ''}{at})"


@dataclass(frozen=True, kw_only=True)
class Flaky:
    cell: str
    fingerprint: str
    kind: str
    key: str
    flips: int
    window: int
    present: bool


@dataclass(frozen=True, kw_only=True)
class FigureMove:
    """A cell's named figure (a mode's `data.figures`: graphs per phase, peak bytes, compile seconds…) that changed
    from the night before by more than `TrendOptions.figure_change` (any change for a count)."""

    cell: str
    name: str
    before: float
    now: float

    def to_dict(self) -> dict[str, Any]:
        return {"cell": self.cell, "name": self.name, "before": self.before, "now": self.now, "trend": self.words()}

    def words(self) -> str:
        change = f" ({(self.now - self.before) / abs(self.before) * 100:+.0f}%)" if self.before else ""
        return f"{self.name}: {self.before:.6g} → {self.now:.6g}{change}"


@dataclass(frozen=True, kw_only=True)
class Drifting:
    cell: str
    layer: str
    figure: str
    slope: float  # relative rise per night (0.1 = +10 %)
    value: float
    threshold: float | None
    nights: int
    crosses_in: int | None  # nights until the threshold at this slope

    def to_dict(self) -> dict[str, Any]:
        return {"cell": self.cell, "layer": self.layer, "figure": self.figure, "slope": round(self.slope, 6),
                "value": self.value, "threshold": self.threshold, "nights": self.nights, "crosses_in": self.crosses_in,
                "trend": self.words()}

    def words(self) -> str:
        thr = f" of threshold {self.threshold:.3g}" if self.threshold else ""
        eta = f"; crosses in ~{self.crosses_in} nights" if self.crosses_in is not None else ""
        return (f"drifting: {self.figure} rising {self.slope * 100:+.1f}%/night over {self.nights} nights "
                f"(now {self.value:.3g}{thr}{eta})")


@dataclass(frozen=True, kw_only=True)
class Burndown:
    backend: str
    unsupported: list[int]  # distinct unsupported ops, one point per night
    blocked: list[int]  # models with a failing cell on this backend


@dataclass(frozen=True, kw_only=True)
class LayerTrend:
    cell: str
    figure: str
    layers: list[tuple[str, list[float | None], float | None]]  # name, value per night (None: not measured), threshold


@dataclass
class Trends:
    dates: list[str] = field(default_factory=list)  # the charted nights, oldest first
    nights: int = 0  # nights in the whole history
    since: dict[tuple[str, str], Since] = field(default_factory=dict)
    flaky: list[Flaky] = field(default_factory=list)
    drifting: list[Drifting] = field(default_factory=list)
    burndown: list[Burndown] = field(default_factory=list)
    cell_times: dict[str, list[float | None]] = field(default_factory=dict)
    layer_trends: list[LayerTrend] = field(default_factory=list)
    gone: list[Since] = field(default_factory=list)  # findings seen before and not in the newest night
    figures: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)  # cell → name → per night
    moved: list[FigureMove] = field(default_factory=list)  # figures that changed since the night before
    modes: dict[str, Any] = field(default_factory=dict)  # mode → its history figures (registry.ModeHooks)

    def flaky_map(self) -> dict[tuple[str, str], str]:
        """(cell, fingerprint) → why it is flaky, for `baseline.diff(history_flaky=…)`."""
        return {(f.cell, f.fingerprint): f"flaky: came and went {f.flips} times in the last {f.window} nights "
                                         "with the same environment (history)" for f in self.flaky}


def env_label(env: Mapping[str, Any], commit: str = "") -> str:
    """A short name of the compiler a night ran: backend versions, else torch; plus the run's commit."""
    parts: list[str] = []
    b = env.get("backend")
    if isinstance(b, Mapping) and b:
        parts += [f"{k} {v}" for k, v in sorted(b.items())]
    elif env.get("backend_version"):
        parts.append(f"{b or 'backend'} {env['backend_version']}")
    for key in ("backend_commit", "compiler_commit"):
        if env.get(key):
            parts.append(f"{key.split('_')[0]} commit {str(env[key])[:10]}")
    if not parts and env.get("torch"):
        parts.append(f"torch {env['torch']}")
    if commit:
        parts.append(f"commit {commit[:7]}")
    return ", ".join(parts)


def night_groups(runs: Sequence[RunRow]) -> list[list[RunRow]]:
    """The runs as nights, oldest first: the runs of one date together (split workflows), a week row alone."""
    groups: list[list[RunRow]] = []
    for r in runs:
        if groups and r.kind == "run" and groups[-1][-1].kind == "run" and groups[-1][-1].date == r.date:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _newest_of_cells(h: History, night: Sequence[RunRow]) -> dict[str, int]:
    """cell → the seq of the night's newest run that ran it."""
    return {cell: r.seq for r in night for cell in h.cell_runs.get(r.seq, {})}


def tonight(h: History) -> list[RunRow]:
    """The newest night's runs, oldest first: the newest run, and the others of its date (split workflows each
    with part of the matrix; a check after the nightly). A cell's newest run of the night is what it did."""
    last = h.runs[-1]
    return [r for r in h.runs if r.kind == "run" and r.date == last.date] if last.kind == "run" else [last]


def night_counts(runs: Sequence[RunRow]) -> list[int]:
    """Nights from run i to the newest (and 0 after the last): a week row counts its nights, and runs of one date
    count once (split workflows writing one history, each with part of the matrix)."""
    tail = [0] * (len(runs) + 1)
    for i in range(len(runs) - 1, -1, -1):
        r = runs[i]
        same = r.kind == "run" and i + 1 < len(runs) and runs[i + 1].kind == "run" and runs[i + 1].date == r.date
        tail[i] = tail[i + 1] + (0 if same else r.nights)
    return tail


def since_table(h: History, max_gone: int = 300) -> tuple[dict[tuple[str, str], Since], list[Since]]:
    """The current streak of every finding in the newest night, and the findings gone from it (the most
    recently seen first). Read from the database's first/last-seen and streak columns: no walk over the nights."""
    if not h.runs:
        return {}, []
    dates = [r.date for r in h.runs]
    tail = night_counts(h.runs)  # nights from run i to the newest
    runs_tonight = tonight(h)
    newest_run = {cell: r.seq for r in runs_tonight for cell in h.cell_runs.get(r.seq, {})}  # the later run wins
    now = frozenset(fid for r in runs_tonight for fid in h.present.get(r.seq, frozenset())
                    if fid in h.findings and newest_run.get(h.findings[fid].cell, r.seq) == r.seq)
    out: dict[tuple[str, str], Since] = {}
    labels: dict[tuple[int | None, str], str] = {}
    for fid in now:
        f = h.findings[fid]  # seen tonight: always loaded
        i = min(bisect_left(dates, f.streak_from or f.first_seen), len(dates) - 1)
        j = i  # the first run of that night that ran the cell (split workflows: not always the night's first)
        while j + 1 < len(h.runs) and h.runs[j + 1].date == h.runs[i].date and f.cell not in h.cell_runs.get(h.runs[j].seq, {}):
            j += 1
        run = h.runs[j]
        cr = h.cell_runs.get(run.seq, {}).get(f.cell)
        lk = (cr.env if cr else None, run.commit)
        if lk not in labels:
            labels[lk] = env_label(h.envs.get(cr.env, {}) if cr else {}, run.commit)
        out[(f.cell, f.fingerprint)] = Since(
            cell=f.cell, fingerprint=f.fingerprint, kind=f.kind, key=f.key, date=run.date, nights=tail[i],
            first_at=labels[lk], first_seen=f.first_seen, last_seen=f.last_seen)
    gone = heapq.nlargest(max_gone, (f for fid, f in h.findings.items() if fid not in now and f.last_seen),
                          key=lambda f: (f.last_seen, f.cell, f.key))
    return out, [Since(cell=f.cell, fingerprint=f.fingerprint, kind=f.kind, key=f.key, date=f.first_seen, nights=0,
                       first_at="", first_seen=f.first_seen, last_seen=f.last_seen) for f in gone]


def flaky_findings(h: History, opts: TrendOptions) -> list[Flaky]:
    """Findings that came and went over the last nights while their cell's environment did not change."""
    recent = [r for g in night_groups([r for r in h.runs if r.kind == "run"])[-opts.flaky_window:] for r in g]
    sets = [h.present.get(r.seq, frozenset()) for r in recent]
    if not sets:
        return []
    candidates = frozenset().union(*sets) - frozenset.intersection(*sets)  # present every night: no flip
    by_cell: dict[str, list[int]] = {}
    for fid in candidates:
        if fid in h.findings:
            by_cell.setdefault(h.findings[fid].cell, []).append(fid)
    out: list[Flaky] = []
    for cell, fids in by_cell.items():
        ran = {r.date: i for i, r in enumerate(recent) if cell in h.cell_runs.get(r.seq, {})}  # a night's later run
        nights = sorted(ran.values())
        if len({h.cell_runs[recent[i].seq][cell].env for i in nights}) > 1:
            continue  # the compiler changed: a change, not a flake
        for fid in fids:
            seq = [fid in sets[i] for i in nights]
            flips = sum(a != b for a, b in zip(seq, seq[1:]))
            if flips >= opts.flaky_flips:
                f = h.findings[fid]
                out.append(Flaky(cell=f.cell, fingerprint=f.fingerprint, kind=f.kind, key=f.key, flips=flips,
                                 window=len(nights), present=bool(seq and seq[-1])))
    return sorted(out, key=lambda x: (x.cell, x.key, x.fingerprint))


def _slope(values: Sequence[float]) -> float:
    """Least-squares slope of ln(value) per night."""
    ys = [math.log(v) for v in values]
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / den if den else 0.0


def drifting_layers(h: History, opts: TrendOptions, cells: Sequence[str],
                    nights: Sequence[Sequence[RunRow]] | None = None) -> tuple[list[Drifting], list[LayerTrend]]:
    """Layer figures rising steadily under their threshold (read from the last nights only); and the worst
    layers' series for the charts (cells with drifting layers first)."""
    drifting: list[Drifting] = []
    recent = [r for g in night_groups([r for r in h.runs if r.kind == "run"])[-(opts.drift_nights + 1):] for r in g]
    figures = h.figures_at(recent) if recent else {}
    for cell in cells:
        by_night = {s[0].date: s for s in figures.get(cell) or []}  # a night's later run wins (split workflows)
        series = [by_night[d] for d in sorted(by_night)]
        if not series:
            continue
        names, thr = series[-1][1], series[-1][2]
        same = [s for s in series if s[1] == names]
        for li, name in enumerate(names):
            for k, figure in enumerate(FIGURE_NAMES):
                d = _drift(cell, name, figure, [s[3][3 * li + k] for s in same], thr[3 * li + k], opts)
                if d is not None:
                    drifting.append(d)
    nights = nights if nights is not None else night_groups(h.runs)[-opts.max_points:]
    seqs = {r.seq: i for i, g in enumerate(nights) for r in g}  # a night's later run overwrites its point
    shown = sorted((c for c in cells if c in figures), key=lambda c: (not any(d.cell == c for d in drifting), c))
    charts = [_chart(cell, [s for s in h.layer_series(cell) if s[0].seq in seqs], seqs, opts)
              for cell in shown[:opts.chart_cells]]
    return drifting, charts


def _drift(cell: str, layer: str, figure: str, vals: list[float | None], threshold: float | None,
           opts: TrendOptions) -> Drifting | None:
    if len(vals) < opts.drift_nights + 1 or any(v is None or not math.isfinite(v) or v <= 0 for v in vals):
        return None
    xs = [float(v) for v in vals if v is not None]
    if any(b < a * (1 - QUANT_STEP) for a, b in zip(xs, xs[1:])) or sum(b > a for a, b in zip(xs, xs[1:])) < len(xs) - 2:
        return None
    slope = math.exp(_slope(xs)) - 1
    if slope < opts.drift_min_slope:
        return None
    if threshold is not None and math.isfinite(threshold) and xs[-1] >= threshold:
        return None  # crossed: it is a divergence finding now
    eta = None
    if threshold and math.isfinite(threshold) and threshold > 0:
        eta = math.ceil(math.log(threshold / xs[-1]) / math.log1p(slope))
    return Drifting(cell=cell, layer=layer, figure=figure, slope=slope, value=xs[-1], threshold=threshold,
                    nights=len(xs) - 1, crosses_in=eta)


def _chart(cell: str, series: list[Any], seqs: Mapping[int, int], opts: TrendOptions) -> LayerTrend:
    names, thr, last = series[-1][1], series[-1][2], series[-1][3]

    def ratio(i: int) -> float:
        v, t = last[3 * i], thr[3 * i]
        if v is None or not math.isfinite(v):
            return math.inf
        return v / t if t else v

    worst = sorted(range(len(names)), key=ratio, reverse=True)[:opts.chart_layers]
    layers = []
    for i in worst:
        vals: list[float | None] = [None] * (max(seqs.values()) + 1 if seqs else 0)
        for run, nm, _, fig in series:
            if nm == names:
                vals[seqs[run.seq]] = fig[3 * i]
        layers.append((names[i], vals, thr[3 * i]))
    return LayerTrend(cell=cell, figure="rel", layers=layers)


def burndowns(h: History, opts: TrendOptions, nights: Sequence[Sequence[RunRow]] | None = None) -> list[Burndown]:
    """Per backend and night: distinct unsupported ops, and models with a failing cell. The op counts follow
    the findings that came and went from one night to the next (a few), not every finding every night. A night
    of several runs (split workflows) is each cell's newest run of it."""
    nights = nights if nights is not None else night_groups(h.runs)[-opts.max_points:]
    unsupported = {fid: (h.cells[f.cell][1], f.op) for fid, f in h.findings.items() if f.kind == "unsupported_op" and f.op}
    ufids = frozenset(unsupported)
    backends = sorted({b for _, b in h.cells.values()})
    out = {b: Burndown(backend=b, unsupported=[], blocked=[]) for b in backends}
    holders: Counter[tuple[str, str]] = Counter()  # (backend, op) → findings of it present tonight
    distinct: Counter[str] = Counter()  # backend → ops with at least one
    prev: frozenset[int] = frozenset()
    for night in nights:
        owner = _newest_of_cells(h, night)
        if len(night) == 1:
            cur = h.present.get(night[0].seq, frozenset()) & ufids
        else:
            cur = frozenset(fid for r in night for fid in h.present.get(r.seq, frozenset()) & ufids
                            if owner.get(h.findings[fid].cell, r.seq) == r.seq)
        for fid in cur - prev:
            holders[unsupported[fid]] += 1
            if holders[unsupported[fid]] == 1:
                distinct[unsupported[fid][0]] += 1
        for fid in prev - cur:
            holders[unsupported[fid]] -= 1
            if holders[unsupported[fid]] == 0:
                distinct[unsupported[fid][0]] -= 1
        prev = cur
        blocked: dict[str, set[str]] = {b: set() for b in backends}
        for cell, seq in owner.items():
            cr = h.cell_runs[seq][cell]
            if cr.status in BAD:
                model, b = h.cells[cell]
                blocked[b].add(model)
        for b in backends:
            out[b].unsupported.append(distinct[b])
            out[b].blocked.append(len(blocked[b]))
    return [out[b] for b in backends]


def compute(h: History, opts: TrendOptions | None = None) -> Trends:
    """Every trend of the history; the newest night is the run being reported."""
    opts = opts or TrendOptions()
    t = Trends(nights=night_counts(h.runs)[0])
    if not h.runs:
        return t
    nights = night_groups(h.runs)[-opts.max_points:]  # the charts draw one point a night
    t.dates = [g[-1].date for g in nights]
    t.since, t.gone = since_table(h)
    t.flaky = flaky_findings(h, opts)
    newest = {cell: cr for r in tonight(h) for cell, cr in h.cell_runs.get(r.seq, {}).items()}
    t.drifting, t.layer_trends = drifting_layers(h, opts, sorted(newest), nights)
    t.burndown = burndowns(h, opts, nights)
    owners = [_newest_of_cells(h, g) for g in nights]
    for cell in sorted(newest):
        t.cell_times[cell] = [cr.duration_s if cell in own and (cr := h.cell_runs[own[cell]].get(cell)) else None
                              for own in owners]
    t.figures = h.named_figures(owners, sorted(newest))
    t.moved = figure_moves(t.figures, opts.figure_change)
    t.modes = mode_figures(t.figures, len(t.dates))
    return t


def mode_figures(figures: Mapping[str, Mapping[str, Sequence[float | None]]], nights: int) -> dict[str, Any]:
    """Each mode's trend data from the named figures (`registry.ModeHooks.history_figures`), in mode order; a mode
    with nothing to show is left out."""
    out = {}
    for mode, hooks in mode_hooks():
        data = hooks.history_figures(figures, nights)
        if data:
            out[mode] = data
    return out


def figure_moves(figures: Mapping[str, Mapping[str, Sequence[float | None]]], change: float) -> list[FigureMove]:
    """The figures whose newest night differs from the last earlier night that had them: by any amount for a whole
    number (graphs, breaks, recompiles, bytes), by more than `change` (relative) otherwise (seconds)."""
    out = []
    for cell, named in sorted(figures.items()):
        for name, vals in sorted(named.items()):
            now = vals[-1] if vals else None
            before = next((v for v in reversed(vals[:-1]) if v is not None), None)
            if now is None or before is None or now == before:
                continue
            whole = float(now).is_integer() and float(before).is_integer()
            if whole or abs(now - before) > change * max(abs(before), 1e-12):
                out.append(FigureMove(cell=cell, name=name, before=before, now=now))
    return out
