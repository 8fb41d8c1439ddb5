"""The one registry of modes and finding kinds: everything that lists modes or kinds derives from it.

A mode is registered once, as a `ModeSpec`: its name, its run function (``"module:function"``, imported only when
a cell runs the mode, so this module and everything that reads it import no torch), its options dataclass
(`options.py`), its run order, the finding kinds it emits (each with the field that names what failed, its report
section and its issue group) and the issue groups it owns. Derived from it:

- `config.py`: the modes a matrix may name, the default mode list (the modes with `default=True`), and the matrix schema's mode lists (`mode_schema`);
- `results/model.py`: the results schema's mode names and finding kinds;
- `report/view.py`: the mode order and the report's finding sections;
- `github/`: which findings are filed, under which group, and which mode's coverage closes a group's issue;
- `modes/__init__.py`: the run function of a mode.

The schema files in `ci_runner/schemas/` keep the built-in lists under ``$defs`` (for readers of the files); a test
checks that they equal what this registry generates, and a loaded schema always takes the registry's lists.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

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
class ModeSpec:
    """One mode. `order` sorts the run order; `issue_groups` are the groups whose issues a cell running this mode
    can close (a group's findings all come from this mode)."""

    name: str
    run: str
    options: type
    order: int
    kinds: tuple[KindSpec, ...]
    issue_groups: tuple[str, ...] = ()
    help: str = ""
    default: bool = True  # in the mode list of a matrix that names none (false: run only when named)


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
    return {g: m.name for m in modes() for g in m.issue_groups}


def group_order() -> dict[str, int]:
    """Issue group -> its place in a filing run (mode order, then declaration order)."""
    return {g: i for i, g in enumerate(g for m in modes() for g in m.issue_groups)}


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
    name="ops", run="ci_runner.modes.ops.mode:run", options=OpsOptions, order=10, issue_groups=("op",),
    help="every operator the model runs, probed alone on the backend",
    kinds=(KindSpec(kind=K.UNSUPPORTED_OP, key="op", section=SECTION_OPS, issue_group="op"),
           KindSpec(kind=K.OP_ERROR, key="op", section=SECTION_OPS, issue_group="op"),
           KindSpec(kind=K.OP_MISMATCH, key="op", section=SECTION_OPS, issue_group="op"),
           KindSpec(kind=K.PROBE_ERROR, key="op")),
))
register_mode(ModeSpec(
    name="layers", run="ci_runner.modes.layers.mode:run", options=LayersOptions, order=20,
    issue_groups=("culprit", "layer"),
    help="each submodule compiled alone: the smallest failing layers",
    kinds=(KindSpec(kind=K.LAYER_FAILURE, key="module", section=SECTION_LAYERS, issue_group="layer"),),
))
register_mode(ModeSpec(
    name="numerics", run="ci_runner.modes.numerics.mode:run", options=NumericsOptions, order=30,
    issue_groups=("divergence",),
    help="per-layer comparison of the backend with trusted references",
    kinds=(KindSpec(kind=K.DIVERGENCE, key="module", section=SECTION_DIVERGENT, issue_group="divergence"),
           KindSpec(kind=K.WEIGHTS_MISMATCH, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.BATCH_VARIANCE, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.OUTPUT_OVERWRITTEN, key="module", section=SECTION_OTHER)),
))
register_mode(ModeSpec(
    name="memory", run="ci_runner.modes.memory.mode:run", options=MemoryOptions, order=40,
    issue_groups=("memory",), default=False,
    help="per-layer, per-phase memory: predicted on meta tensors, measured on the device, compiled against eager",
    kinds=(KindSpec(kind=K.MEMORY_OOM, key="module", section=SECTION_OTHER, issue_group="memory"),
           KindSpec(kind=K.MEMORY_REGRESSION, key="module", section=SECTION_OTHER, issue_group="memory"),
           KindSpec(kind=K.MEMORY_OVER_BUDGET, key="module", section=SECTION_OTHER)),
))
register_mode(ModeSpec(
    name="compile", run="ci_runner.modes.compile.mode:run", options=CompileOptions, order=40, default=False,
    issue_groups=("graph_break",),
    help="graphs, graph breaks, recompiles, compile time and eager fallbacks per phase",
    kinds=(KindSpec(kind=K.GRAPH_BREAK, key="module", section=SECTION_OTHER, issue_group="graph_break"),
           KindSpec(kind=K.EAGER_FALLBACK, key="op", section=SECTION_OTHER),
           KindSpec(kind=K.COMPILE_AFTER_WARMUP, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.LENGTH_SWEEP_GRAPHS, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.RECOMPILE_LIMIT, key="module", section=SECTION_OTHER),
           KindSpec(kind=K.GRAPH_COUNT, key="module", section=SECTION_OTHER)),
))
del K
