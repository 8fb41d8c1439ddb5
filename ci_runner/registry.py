"""The one registry of modes and finding kinds: everything that lists modes or kinds derives from it.

A mode is registered once, as a `ModeSpec`: its name, its run function (``"module:function"``, imported only when
a cell runs the mode, so this module and everything that reads it import no torch), its options dataclass
(`options.py`), its run order, the finding kinds it emits (each with the field that names what failed, its report
section and its issue group), the issue groups it owns (`IssueGroup`: template, title, grouping), and its report and
history hooks (`ModeSpec.report`: ``"module:attribute"`` of a `ModeHooks` object, imported when a report is written).
Derived from it:

- `config.py`: the modes a matrix may name, the default mode list (the modes with `default=True`), and the matrix schema's mode lists (`mode_schema`);
- `results/model.py`: the results schema's mode names and finding kinds;
- `report/view.py`: the mode order and the report's finding sections;
- `report/summary.py`, `report/html.py`, `report/junit.py`: each mode's own summary section, per-cell HTML
  (charts, tables) and JUnit properties (`ModeHooks`), in mode order; no report module names a mode;
- `history/trends.py` and the reports' history sections: each mode's history figures (`ModeHooks.history_*`);
- `github/`: which findings are filed, under which group (its key, title, template), and which mode's coverage
  closes a group's issue;
- `modes/__init__.py`: the run function of a mode;
- `procs/ranks.py`: the tasks of a tensor-parallel cell's one launch of ranks (`ModeSpec.rank_task`, `rank_payload`).

The schema files in `ci_runner/schemas/` keep the built-in lists under ``$defs`` (for readers of the files); a test
checks that they equal what this registry generates, and a loaded schema always takes the registry's lists.
"""

from __future__ import annotations

import copy
import difflib
import importlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, Sequence

from .errors import OptionError
from .options import CompileOptions, LayersOptions, MemoryOptions, NumericsOptions, OpsOptions, build, option_keys


class FindingKind(str, Enum):
    """The built-in finding kinds (a plug-in mode may declare more, as plain strings, in its `ModeSpec`)."""

    UNSUPPORTED_OP = "unsupported_op"
    OP_ERROR = "op_error"
    OP_MISMATCH = "op_mismatch"
    PROBE_ERROR = "probe_error"
    LAYER_FAILURE = "layer_failure"
    DIVERGENCE = "divergence"
    WEIGHTS_MISMATCH = "weights_mismatch"
    BATCH_VARIANCE = "batch_variance"
    OUTPUT_OVERWRITTEN = "output_overwritten"
    MEMORY_OOM = "memory_oom"
    MEMORY_OVER_BUDGET = "memory_over_budget"
    MEMORY_REGRESSION = "memory_regression"
    GRAPH_BREAK = "graph_break"
    EAGER_FALLBACK = "eager_fallback"
    COMPILE_AFTER_WARMUP = "compile_after_warmup"
    LENGTH_SWEEP_GRAPHS = "length_sweep_graphs"
    RECOMPILE_LIMIT = "recompile_limit"
    GRAPH_COUNT = "graph_count"

    __str__ = str.__str__  # f"{kind}" is the value on every Python version
    __hash__ = str.__hash__  # "divergence" in {FindingKind.DIVERGENCE}: a kind read from JSON is a plain str


# Report sections (report/view.py): where a kind's findings are listed besides their cell.
SECTION_OPS, SECTION_LAYERS, SECTION_DIVERGENT, SECTION_OTHER = "ops", "layers", "divergent", "other"


@dataclass(frozen=True, kw_only=True)
class KindSpec:
    """One finding kind: `key` is the finding field naming what failed (`op` or `module`: the baseline key, the
    issue key); `section` the report section (None: only under its cell); `issue_group` the issue group its
    findings are filed under (None: never filed)."""

    kind: str
    key: str
    section: str | None = None
    issue_group: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", self.kind.value if isinstance(self.kind, Enum) else str(self.kind))


@dataclass(frozen=True, kw_only=True)
class IssueGroup:
    """How the issues of one issue group are keyed, titled and written (`github/render.py` reads only this).

    - `template`: the issue body's Jinja template, a file name in ``ci_runner/templates/`` or in the mode's own
      `ModeSpec.templates` folder; it gets ``group`` (the group view), ``markers``, ``links``, ``options``, ``meta``
      and may import ``issue_macros.md.j2``. The default is a generic body (entries, messages, repro, environment).
    - `title`: a format string over the group's key tuple, ``key[0]`` the group, ``key[1]`` the backend, then what
      `key` returned (by default the value of the kind's `KindSpec.key` field); `title_hook` (``"module:function"``,
      ``(key) -> str``) instead when a format string cannot say it.
    - `what`: the footer's "one issue per …".
    - `fields`: names of the group view taken from the key (``{"op": 2}``: ``group.op`` is ``key[2]``).
    - `key`: ``"module:function"``, ``(backend, model, finding, value) -> tuple | None``: the group key of a finding
      (it may name another group of the same mode, as the layers mode's culprit issues do); None: ``(name, backend,
      value)`` where the finding has a value.
    - `always`: filed without `file-issues --layers` (the op group); other groups only with it.
    - `culprit_repro`: the issue shows the culprit's own repro (`details.culprit.repro`) before the finding's.
    """

    name: str
    template: str = "issue_generic.md.j2"
    title: str = "[deepview-ci] {key[0]}: {key[2]} fails on {key[1]}"
    title_hook: str | None = None
    what: str = ""
    fields: Mapping[str, int] = field(default_factory=dict)
    key: str | None = None
    always: bool = False
    culprit_repro: bool = False

    def __post_init__(self) -> None:
        if not self.what:
            object.__setattr__(self, "what", f"{self.name} finding and backend")
        object.__setattr__(self, "fields", dict(self.fields))

    def title_of(self, key: Sequence[str]) -> str:
        if self.title_hook:
            return str(load_ref(self.title_hook)(tuple(key)))
        return self.title.format(key=tuple(key))

    def key_of(self, backend: str, model: str, finding: Mapping[str, Any], value: Any) -> tuple[str, ...] | None:
        if self.key:
            out = load_ref(self.key)(backend, model, finding, value)
            return tuple(str(k) for k in out) if out is not None else None
        return (self.name, backend, str(value)) if value else None


class ModeHooks:
    """What a mode adds to the reports and the history, besides its findings (which every report lists already).

    A mode's `ModeSpec.report` names an object with any of these methods (``"module:attribute"``; this base class
    gives the empty defaults, a hook object need not derive from it). Reports and history call them in mode order
    and never name a mode: they read `CellResult`s and the history's figures only, never torch.

    - `summary_section(cells, *, max_rows)`: a whole Markdown section of summary.md (``### …``), "" for none;
      placed after the cells × modes table.
    - `html_charts(cell)` / `html_tables(cell)`: HTML of one cell's block in report.html (charts first, then
      tables; "" for none).
    - `junit_properties(cell)`: ``(name, value)`` properties of the cell's testsuite in junit.xml.
    - `history_figures(figures, nights)`: this mode's trend data from the history's named figures (cell → ``mode.
      name`` → one value per night, `history/trends.py`); falsy: nothing to show. Kept in `Trends.modes[mode]`.
    - `history_summary(data)` / `history_html(data, dates)`: that data in summary.md's and report.html's history
      sections.
    - `artifacts(cell)`: ``(label, path)`` of the files the mode left in the cell folder for another tool (a trace,
      a graph overlay), the path relative to the cell folder as repro paths are: report.html links them in the
      cell's block.
    """

    def summary_section(self, cells: Sequence[Any], *, max_rows: int) -> str:
        return ""

    def html_charts(self, cell: Any) -> str:
        return ""

    def html_tables(self, cell: Any) -> str:
        return ""

    def junit_properties(self, cell: Any) -> list[tuple[str, str]]:
        return []

    def history_figures(self, figures: Mapping[str, Mapping[str, Sequence[float | None]]], nights: int) -> Any:
        return None

    def history_summary(self, data: Any) -> str:
        return ""

    def history_html(self, data: Any, dates: Sequence[str]) -> str:
        return ""

    def artifacts(self, cell: Any) -> list[tuple[str, str]]:
        return []


_DEFAULT_HOOKS = ModeHooks()


@dataclass(frozen=True, kw_only=True)
class ModeSpec:
    """One mode. `order` sorts the run order; `issue_groups` are the groups whose issues a cell running this mode
    can close (a group's findings all come from this mode): `IssueGroup`s, or bare names for the default grouping
    and generic issue body. `report`: ``"module:attribute"`` of its `ModeHooks` (report sections, history
    figures); `templates`: a package whose ``templates/`` folder holds its issue templates (None: ci_runner's);
    `layer_table`: its ``data.layers`` rows (name, cumulative, isolated, threshold, flagged_*) and ``data.verdict`` are
    the cell's per-layer comparison: report.html charts it, the summary and JUnit show its verdict, the history
    tracks its drift (`report/view.py`, `history/records.py`)."""

    name: str
    run: str
    options: type
    order: int
    kinds: tuple[KindSpec, ...]
    issue_groups: tuple[IssueGroup, ...] = ()
    help: str = ""
    default: bool = True  # in the mode list of a matrix that names none (false: run only when named)
    report: str | None = None
    templates: str | None = None
    layer_table: bool = False  # its `data.layers` is the per-layer comparison table and `data.verdict` its verdict
    # ``"module:function"``: (cell) -> str | None, said at the cell's start when the mode's limits cannot fit the
    # cell's timeout (`run/cellrun.py`: one console line and `CellResult.notes`)
    fit: str | None = None
    # tensor parallelism (a cell with `parallel: {tp: N}`): ``"module:function"`` called in each rank of the cell's one
    # launch with (payload, mesh) (`procs/ranks.rank_tasks`); the mode takes rank 0's value with
    # `ModeContext.ranks().take(name)` (`procs/ranks.py`)
    rank_task: str | None = None
    # ``"module:function"``: (ModeContext) -> the mode's own part of the ranks' payload (its task gets it added to the
    # launch's model, inputs and layout)
    rank_payload: str | None = None

    def __post_init__(self) -> None:
        groups = tuple(g if isinstance(g, IssueGroup) else IssueGroup(name=str(g)) for g in self.issue_groups)
        object.__setattr__(self, "issue_groups", groups)

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.issue_groups)

    def hooks(self) -> Any:
        """The mode's report and history hooks (`ModeHooks`; the empty defaults when it declares none)."""
        return load_ref(self.report) if self.report else _DEFAULT_HOOKS


_MODES: dict[str, ModeSpec] = {}


def register_mode(spec: ModeSpec) -> ModeSpec:
    """Add (or replace) a mode. Its kinds must not belong to another mode."""
    for other in _MODES.values():
        clash = {k.kind for k in spec.kinds} & {k.kind for k in other.kinds} if other.name != spec.name else set()
        if clash:
            raise ValueError(f"mode {spec.name!r}: finding kind(s) {sorted(clash)} already belong to mode {other.name!r}")
    _MODES[spec.name] = spec
    return spec


def unregister_mode(name: str) -> None:
    _MODES.pop(name, None)


def modes() -> tuple[ModeSpec, ...]:
    """Every registered mode, in run order."""
    return tuple(sorted(_MODES.values(), key=lambda m: (m.order, m.name)))


def mode_names() -> tuple[str, ...]:
    return tuple(m.name for m in modes())


def default_mode_names() -> tuple[str, ...]:
    """The modes a matrix without `modes:` runs."""
    return tuple(m.name for m in modes() if m.default)


def mode_spec(name: str) -> ModeSpec | None:
    return _MODES.get(name)


def kind_specs() -> dict[str, KindSpec]:
    """Every finding kind, in mode order then declaration order."""
    return {k.kind: k for m in modes() for k in m.kinds}


def kind_names() -> tuple[str, ...]:
    return tuple(kind_specs())


def kind_spec(kind: str) -> KindSpec | None:
    return kind_specs().get(str(kind))


def kinds_in(section: str) -> frozenset[str]:
    """The finding kinds listed in a report section."""
    return frozenset(k.kind for k in kind_specs().values() if k.section == section)


def kinds_filed_as(group: str) -> frozenset[str]:
    """The finding kinds filed under an issue group."""
    return frozenset(k.kind for k in kind_specs().values() if k.issue_group == group)


def mode_of_group() -> dict[str, str]:
    """Issue group -> the mode whose findings it holds."""
    return {g.name: m.name for m in modes() for g in m.issue_groups}


def group_order() -> dict[str, int]:
    """Issue group -> its place in a filing run (mode order, then declaration order)."""
    return {g: i for i, g in enumerate(g.name for m in modes() for g in m.issue_groups)}


def issue_group(name: str) -> IssueGroup | None:
    """The declared issue group `name` (None: no registered mode owns it)."""
    return next((g for m in modes() for g in m.issue_groups if g.name == name), None)


def layer_table_modes() -> tuple[str, ...]:
    """The modes whose results carry the per-layer comparison table (`ModeSpec.layer_table`), in mode order."""
    return tuple(m.name for m in modes() if m.layer_table)


def template_packages() -> tuple[str, ...]:
    """The packages whose ``templates/`` folders hold the registered modes' own templates, in mode order."""
    return tuple(dict.fromkeys(m.templates for m in modes() if m.templates))


def mode_hooks() -> tuple[tuple[str, Any], ...]:
    """``(mode name, hooks)`` of every mode that declares report or history hooks, in mode order."""
    return tuple((m.name, m.hooks()) for m in modes() if m.report)


_REFS: dict[str, Any] = {}


def load_ref(ref: str) -> Any:
    """The object a ``"module:attribute"`` string names (imported once; the registry itself imports nothing)."""
    if ref not in _REFS:
        module, _, attr = ref.partition(":")
        if not module or not attr:
            raise ValueError(f"{ref!r}: expected 'module:attribute'")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        _REFS[ref] = obj
    return _REFS[ref]


# --------------------------------------------------------------------------- options

def options_class(mode: str) -> type:
    spec = _MODES.get(mode)
    if spec is None:
        close = difflib.get_close_matches(str(mode), list(_MODES), n=1)
        raise OptionError(f"options: unknown mode {mode!r}",
                          hint=(f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(mode_names())}",
                          key=str(mode))
    return spec.options


def known_keys(mode: str) -> list[str]:
    return option_keys(options_class(mode))


def parse_options(mode: str, mapping: Mapping[str, Any] | None, where: str | None = None) -> Any:
    """The typed options of `mode` from `mapping` (`options.<mode>` as written); `OptionError` on a bad key or value."""
    return build(options_class(mode), mapping, where or f"options.{mode}", example=f"{mode}: {{...}}")


# --------------------------------------------------------------------------- schemas

def apply_to_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a schema whose ``$defs`` mode lists and finding kinds are this registry's.

    ``mode_name`` (an enum of mode names), ``mode_options`` (an object with one property per mode) and
    ``finding_kind`` (an enum of kinds) are replaced where the schema defines them; the rest of the schema refers to
    them by ``$ref``, so one replacement reaches every place."""
    out = copy.deepcopy(dict(schema))
    defs = out.get("$defs", {})
    if "mode_name" in defs:
        defs["mode_name"] = {**defs["mode_name"], "enum": list(mode_names())}
    if "mode_options" in defs:
        defs["mode_options"] = {**defs["mode_options"], "properties": {n: {"type": "object"} for n in mode_names()}}
    if "finding_kind" in defs:
        defs["finding_kind"] = {**defs["finding_kind"], "enum": list(kind_names())}
    return out


# --------------------------------------------------------------------------- the built-in modes

K = FindingKind
register_mode(ModeSpec(
    name="ops", run="ci_runner.modes.ops.mode:run", options=OpsOptions, order=10,
    rank_task="ci_runner.modes.ops.tpops:rank_task", rank_payload="ci_runner.modes.ops.parallel:rank_part",
    issue_groups=(IssueGroup(name="op", template="issue_op.md.j2", title="[deepview-ci] {key[2]} fails on {key[1]}",
                             what="operator and backend", fields={"op": 2}, always=True),),
    help="every operator the model runs, probed alone on the backend",
    kinds=(KindSpec(kind=K.UNSUPPORTED_OP, key="op", section=SECTION_OPS, issue_group="op"),
           KindSpec(kind=K.OP_ERROR, key="op", section=SECTION_OPS, issue_group="op"),
           KindSpec(kind=K.OP_MISMATCH, key="op", section=SECTION_OPS, issue_group="op"),
           KindSpec(kind=K.PROBE_ERROR, key="op")),
))
register_mode(ModeSpec(
    name="layers", run="ci_runner.modes.layers.mode:run", options=LayersOptions, order=20,
    rank_task="ci_runner.modes.layers.tpsearch:rank_task", rank_payload="ci_runner.modes.layers.parallel:rank_part",
    issue_groups=(IssueGroup(name="culprit", template="issue_culprit.md.j2",
                             title="[deepview-ci] {key[2]} fails on {key[1]} inside model layers",
                             what="operator (found inside failing layers) and backend", fields={"op": 2},
                             culprit_repro=True),
                  IssueGroup(name="layer", template="issue_layer.md.j2",
                             title="[deepview-ci] {key[3]} of {key[2]} fails on {key[1]}",
                             what="failing submodule, model and backend", fields={"model": 2, "module": 3},
                             key="ci_runner.modes.layers.issues:group_key")),
    help="each submodule compiled alone: the smallest failing layers", fit="ci_runner.modes.layers.fit:fit",
    kinds=(KindSpec(kind=K.LAYER_FAILURE, key="module", section=SECTION_LAYERS, issue_group="layer"),),
))
register_mode(ModeSpec(
    name="numerics", run="ci_runner.modes.numerics.mode:run", options=NumericsOptions, order=30,
    rank_task="ci_runner.modes.numerics.tprank:rank_task", rank_payload="ci_runner.modes.numerics.parallel:rank_part",
    issue_groups=(IssueGroup(name="divergence", template="issue_divergence.md.j2",
                             title="[deepview-ci] {key[2]} layers diverge on {key[1]}",
                             what="layer class and backend", fields={"pattern": 2},
                             key="ci_runner.modes.numerics.issues:group_key"),),
    report="ci_runner.modes.numerics.report:HOOKS", layer_table=True,
    help="per-layer comparison of the backend with trusted references",
    kinds=(KindSpec(kind=K.DIVERGENCE, key="module", section=SECTION_DIVERGENT, issue_group="divergence"),
           KindSpec(kind=K.WEIGHTS_MISMATCH, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.BATCH_VARIANCE, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.OUTPUT_OVERWRITTEN, key="module", section=SECTION_OTHER)),
))
register_mode(ModeSpec(
    name="memory", run="ci_runner.modes.memory.mode:run", options=MemoryOptions, order=40, default=False,
    issue_groups=(IssueGroup(name="memory", template="issue_memory.md.j2",
                             title="[deepview-ci] {key[2]} needs too much memory on {key[1]}",
                             what="layer (or model) and backend whose memory failed", fields={"module": 2}),),
    report="ci_runner.modes.memory.report:HOOKS",
    help="per-layer, per-phase memory: predicted on meta tensors, measured on the device, compiled against eager",
    kinds=(KindSpec(kind=K.MEMORY_OOM, key="module", section=SECTION_OTHER, issue_group="memory"),
           KindSpec(kind=K.MEMORY_REGRESSION, key="module", section=SECTION_OTHER, issue_group="memory"),
           KindSpec(kind=K.MEMORY_OVER_BUDGET, key="module", section=SECTION_OTHER)),
))
register_mode(ModeSpec(
    name="compile", run="ci_runner.modes.compile.mode:run", options=CompileOptions, order=40, default=False,
    issue_groups=(IssueGroup(name="graph_break", template="issue_graph_break.md.j2",
                             what="graph-break source line and backend", fields={"source": 2}),),
    report="ci_runner.modes.compile.report:HOOKS",
    help="graphs, graph breaks, recompiles, compile time and eager fallbacks per phase",
    kinds=(KindSpec(kind=K.GRAPH_BREAK, key="module", section=SECTION_OTHER, issue_group="graph_break"),
           KindSpec(kind=K.EAGER_FALLBACK, key="op", section=SECTION_OTHER),
           KindSpec(kind=K.COMPILE_AFTER_WARMUP, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.LENGTH_SWEEP_GRAPHS, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.RECOMPILE_LIMIT, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.GRAPH_COUNT, key="module", section=SECTION_OTHER)),
))
del K
