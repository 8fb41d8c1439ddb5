"""The matrix file: YAML + JSON Schema → frozen, resolved dataclasses. Defaults live here only.

Every problem is one `ConfigError` that names the file, the line and column, the key path and
the fix; unknown keys get a "did you mean" suggestion.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from importlib.resources import as_file, files
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import jsonschema
import yaml

from .errors import ConfigError, OptionError
from .workloads.parallel import ParallelSpec, check_parallel, parse_parallel
from .workloads.phases import Phase, check_phases, parse_phases
from .workloads.precision import PrecisionPolicy, check_precision, parse_precision
from .registry import default_mode_names, mode_names, parse_options
from .results.model import schema

DEFAULT_TIMEOUT_S = 900.0
DEFAULT_MAX_JOBS = 1024  # expand refuses more cells than this unless raised in `defaults.max_jobs`
# The labels of GitHub's standard hosted images, exactly (a self-hosted runner labelled `ubuntu-gpu` is not one)
HOSTED_LABEL = re.compile(r"^(ubuntu-(latest|\d\d\.04)(-arm)?|windows-(latest|\d{4}|11-arm)"
                          r"|macos-(latest|\d\d)(-large|-xlarge|-intel)?)$")


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    batch: int = 1
    seq_len: int = 32
    samples: int = 4
    seed: int = 0
    image_size: int | None = None
    text: tuple[str, ...] = ()
    phases: tuple[Any, ...] = ()  # the raw `phases` list (ci_runner/workloads/phases.py); empty: the single forward

    def merged(self, override: Mapping[str, Any] | None) -> "InputSpec":
        if not override:
            return self
        kw = dict(override)
        if "text" in kw:
            kw["text"] = tuple(kw["text"])
        if "phases" in kw:
            kw["phases"] = tuple(kw["phases"] or ())
        return replace(self, **kw)

    def key(self) -> dict[str, Any]:
        key = {"batch": self.batch, "seq_len": self.seq_len, "samples": self.samples, "seed": self.seed,
               "image_size": self.image_size, "text": list(self.text)}
        if self.phases:  # only when set: keys (thresholds, caches) of matrices without phases stay as they were
            key["phases"] = [dict(p) if isinstance(p, Mapping) else p for p in self.phases]
        return key

    def workload(self) -> tuple["Phase", ...]:
        """The resolved phases (empty: the single unpadded forward)."""
        return parse_phases(self.phases, seq_len=self.seq_len)


@dataclass(frozen=True, kw_only=True)
class Reference:
    id: str
    device: str = "cpu"
    dtype: str = "float32"


DEFAULT_REFERENCES: tuple[Reference, ...] = (
    Reference(id="cpu-fp32", device="cpu", dtype="float32"),
    Reference(id="cpu-fp64", device="cpu", dtype="float64"),
)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    id: str
    config: str | None = None
    overrides: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    path: str | None = None  # absolute, resolved against the matrix file's folder
    hub: str | None = None
    revision: str | None = None
    factory: str | None = None
    task: str = "auto"
    dtype: str = "float32"
    trust_remote_code: bool = False
    zoo: str | None = None  # "transformers": one architecture of a zoo entry (`config` is its model_type)
    zoo_entry: str | None = None  # the id of the zoo entry it came from

    @property
    def source(self) -> str:
        if self.zoo:
            return f"zoo:{self.zoo}/{self.config}"
        if self.config:
            return f"config:{self.config}"
        if self.path:
            return f"path:{self.path}"
        if self.hub:
            return f"hub:{self.hub}@{self.revision or 'main'}"
        return f"factory:{self.factory}"


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    id: str
    compile: str | None = None  # None: eager on `device`
    imports: tuple[str, ...] = ()
    device: str = "cpu"
    env: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    compile_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    backend_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    ir: str = "aten"  # what the backend's compiler sees: dynamo (torch-level), aten (after aot_autograd), core_aten
    runs_on: tuple[str, ...] = ("ubuntu-latest",)
    # how the backend's GitHub job is set up; none of these is used by a local run
    python: str | None = None  # an existing interpreter that holds torch and the backend
    container: Mapping[str, Any] | None = None  # {image, options, env} of the job container
    setup: tuple[str, ...] = ()  # shell commands run before the cell
    artifacts: tuple[str, ...] = ()  # artifacts of an earlier job, downloaded before `setup`
    source: Mapping[str, Any] | None = None  # {repo (absolute), setup, python?, max_steps?, …}: what bisect-commits walks
    # the c10d backend its device's ranks join under tensor parallelism (ci_runner/workloads/parallel.py); None: gloo on CPU
    process_group: str | None = None
    # the dtype each op class computes in (ci_runner/workloads/precision.py); default `auto`: measured per cell
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)

    @property
    def self_hosted(self) -> bool:
        """True unless every `runs-on` label names a standard GitHub-hosted image (ubuntu-24.04, windows-latest, …)."""
        return not all(HOSTED_LABEL.match(label) for label in self.runs_on)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One model × backend job, with everything resolved."""

    id: str
    model: ModelSpec
    backend: BackendSpec
    modes: tuple[str, ...]
    timeout: float
    inputs: InputSpec
    references: tuple[Reference, ...]
    options: Mapping[str, Mapping[str, Any]]  # per-mode options, model and backend merged over defaults
    parallel: ParallelSpec | None = None  # the tensor-parallel layout (ci_runner/workloads/parallel.py); None: one rank


@dataclass(frozen=True, kw_only=True)
class Matrix:
    path: Path
    version: int
    modes: tuple[str, ...]
    timeout: float
    inputs: InputSpec
    options: Mapping[str, Mapping[str, Any]]
    max_jobs: int
    references: tuple[Reference, ...]
    models: tuple[ModelSpec, ...]
    backends: tuple[BackendSpec, ...]
    exclude: tuple[Mapping[str, str], ...] = ()
    include: tuple[Mapping[str, str], ...] = ()
    raw: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}), repr=False, compare=False)

    def model(self, model_id: str) -> ModelSpec:
        for m in self.models:
            if m.id == model_id:
                return m
        raise ConfigError(f"{self.path}: no model with id {model_id!r}", hint=choices_hint(model_id, [m.id for m in self.models]))

    def backend(self, backend_id: str) -> BackendSpec:
        for b in self.backends:
            if b.id == backend_id:
                return b
        raise ConfigError(f"{self.path}: no backend with id {backend_id!r}", hint=choices_hint(backend_id, [b.id for b in self.backends]))


# --------------------------------------------------------------------------- YAML with positions

class _Positions:
    """Maps key paths to (line, column), 1-based, from the composed YAML node tree."""

    def __init__(self) -> None:
        self.key_marks: dict[tuple[Any, ...], tuple[int, int]] = {}
        self.value_marks: dict[tuple[Any, ...], tuple[int, int]] = {}

    def walk(self, node: yaml.Node, path: tuple[Any, ...], source: str) -> None:
        self.value_marks[path] = (node.start_mark.line + 1, node.start_mark.column + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value
                line = key_node.start_mark.line + 1
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != "tag:yaml.org,2002:str":
                    raise ConfigError(
                        f"{source}:{line}:{key_node.start_mark.column + 1}: key {key!r} at "
                        f"{_fmt_path(path) or 'top level'} is not read as a string by YAML",
                        hint=f'quote it: "{key}"',
                    )
                if key in seen:
                    raise ConfigError(
                        f"{source}:{line}:{key_node.start_mark.column + 1}: duplicate key {key!r} "
                        f"at {_fmt_path(path) or 'top level'} (first at line {seen[key]})",
                        hint="remove one of the two entries",
                    )
                seen[key] = line
                self.key_marks[path + (key,)] = (line, key_node.start_mark.column + 1)
                self.walk(value_node, path + (key,), source)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self.walk(item, path + (i,), source)

    def at(self, path: tuple[Any, ...], *, value: bool = False) -> tuple[int, int] | None:
        """Position of the key at `path` (or of its value), else of the nearest enclosing entry."""
        if value and path in self.value_marks:
            return self.value_marks[path]
        for p in (path, *(path[:i] for i in range(len(path) - 1, -1, -1))):
            if p in self.key_marks:
                return self.key_marks[p]
            if p in self.value_marks:
                return self.value_marks[p]
        return None


def _fmt_path(path: tuple[Any, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def choices_hint(word: str, choices: list[str]) -> str:
    """`did you mean 'x'? known: …` for a word that is not among `choices`."""
    close = difflib.get_close_matches(word, choices, n=1)
    listed = ", ".join(sorted(choices)) or "(none)"
    if close:
        return f"did you mean {close[0]!r}? known: {listed}"
    return f"known: {listed}"


# bounds on a matrix's YAML, checked on the composed node graph before anything walks or builds it: an alias
# bomb (a few lines that expand to billions of nodes), a recursive alias or nesting 100,000 deep is refused fast
MAX_YAML_CHARS = 4 * 2**20  # the bundled example is 5 kB; PyYAML reads about 1 MB/s
MAX_YAML_NODES = 100_000  # nodes once every alias is expanded (the bundled example has about 300)
MAX_YAML_DEPTH = 200


def yaml_bounds_problem(root: yaml.Node, *, max_nodes: int = MAX_YAML_NODES, max_depth: int = MAX_YAML_DEPTH) -> str | None:
    """Why the document under `root` is refused (too many nodes with aliases expanded, too deep, or an alias
    inside itself); None when it is within bounds. Iterative, and linear in the composed graph."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if isinstance(node, yaml.ScalarNode):
            size[key], height[key] = 1, 1
            continue
        children: list[yaml.Node] = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode)
                                     else list(node.value))
        if done:
            open_nodes.discard(key)
            size[key] = min(1 + sum(size[id(c)] for c in children), max_nodes + 1)
            height[key] = 1 + max((height[id(c)] for c in children), default=0)
            if size[key] > max_nodes:
                return f"more than {max_nodes:,} values once its aliases are expanded (an alias bomb?)"
            if height[key] > max_depth:
                return f"nested more than {max_depth} levels deep"
            continue
        if key in size:
            continue
        if key in open_nodes:
            return "an alias refers to a node that contains it (a recursive structure)"
        if len(open_nodes) > max_depth:
            return f"nested more than {max_depth} levels deep"
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)
    return None


class _TooDeep(yaml.YAMLError):
    """Nesting past `MAX_YAML_DEPTH` or more than `MAX_YAML_NODES` nodes, met while scanning or composing (before
    Python's recursion limit is, and before the composing takes long)."""


class BoundedLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses nesting past `MAX_YAML_DEPTH` as it reads: in flow style (``[[[…``) when the
    scanner opens the level (its simple-key bookkeeping is quadratic in the flow depth), in block style when the
    composer does. The expanded size of aliases is checked on the composed graph (`yaml_bounds_problem`)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0
        self._composed = 0

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # noqa: N803 (PyYAML's name)
        if self.flow_level >= MAX_YAML_DEPTH:
            raise _TooDeep(f"nested more than {MAX_YAML_DEPTH} levels deep")
        super().fetch_flow_collection_start(TokenClass)  # type: ignore[misc]

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise _TooDeep(f"nested more than {MAX_YAML_DEPTH} levels deep")
            self._composed += 1
            if self._composed > MAX_YAML_NODES:
                raise _TooDeep(f"more than {MAX_YAML_NODES:,} values")
            return super().compose_node(parent, index)  # type: ignore[misc]
        finally:
            self._depth -= 1


def parse_yaml(text: str, source: str) -> tuple[Any, _Positions]:
    """`yaml.safe_load` semantics, plus positions and duplicate-key detection; bounded (`yaml_bounds_problem`)."""
    positions = _Positions()
    if len(text) > MAX_YAML_CHARS:
        raise ConfigError(f"{source}: matrix refused: larger than {MAX_YAML_CHARS // 2**20} MiB",
                          hint="a matrix is a few kilobytes: check that this is the right file")
    try:
        loader = BoundedLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None, positions
            problem = yaml_bounds_problem(node)
            if problem is not None:
                raise ConfigError(f"{source}: matrix refused: {problem}",
                                  hint="write the matrix out plainly: anchors and aliases for a few shared values only")
            positions.walk(node, (), source)
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except _TooDeep as exc:
        raise ConfigError(f"{source}: matrix refused: {exc}",
                          hint=f"a matrix needs a few levels and a few hundred values; keep it under {MAX_YAML_DEPTH} "
                               f"levels and {MAX_YAML_NODES:,} values") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"{where}: invalid YAML: {problem}", hint="fix the YAML syntax at that position") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}", hint="fix the YAML syntax") from None
    except RecursionError:
        raise ConfigError(f"{source}: matrix refused: nested too deep to read",
                          hint=f"a matrix needs a few levels; keep it under {MAX_YAML_DEPTH}") from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. timestamps out of range
        raise ConfigError(f"{source}: invalid YAML value: {exc}", hint="quote the value as a string") from None
    return data, positions


# --------------------------------------------------------------------------- schema errors

MAX_SCHEMA_ERRORS = 10  # problems listed at once; the rest are counted


@dataclass(frozen=True)
class SchemaProblem:
    """One schema error, placed in the file: ``where`` is ``file:line:col``."""

    where: str
    pos: tuple[int, int]
    key_path: str
    message: str
    hint: str | None = None
    explains_missing: bool = False  # an unknown key that looks like a missing required one

    def text(self) -> str:
        return f"{self.where}: {self.key_path}: {self.message}" if self.key_path else f"{self.where}: {self.message}"


def _place(path: tuple[Any, ...], positions: _Positions, source: str, *, value: bool) -> tuple[str, tuple[int, int]]:
    pos = positions.at(path, value=value)
    return (f"{source}:{pos[0]}:{pos[1]}" if pos else source), (pos or (0, 0))


_VALUE_CHECKS = ("enum", "const", "type", "pattern", "minimum", "maximum", "exclusiveMinimum", "minItems", "uniqueItems")


def _schema_problems(err: Any, positions: _Positions, source: str) -> list[SchemaProblem]:
    """The problems one jsonschema error stands for (an object with two unknown keys is two)."""
    path = tuple(err.absolute_path)
    hint: str | None = None
    message = err.message
    if err.validator == "additionalProperties":
        allowed = sorted((err.schema.get("properties") or {}).keys())
        instance = err.instance if isinstance(err.instance, dict) else {}
        unknown = [k for k in instance if k not in allowed]
        out = []
        for i, key in enumerate(unknown):  # "did you mean" for the first few: thousands of keys stay fast
            where, pos = _place(path + (key,), positions, source, value=False)
            out.append(SchemaProblem(where, pos, _fmt_path(path + (key,)) or "(top level)", f"unknown key {key!r}",
                                     choices_hint(str(key), allowed) if i < 5 * MAX_SCHEMA_ERRORS else None))
        if out:
            return out
    elif err.validator == "oneOf" and path and len(path) >= 2 and path[0] == "models":
        message = "a model needs exactly one source: one of `config`, `path`, `hub`, `factory` or `zoo`"
        hint = "keep one source key for this model"
    elif err.validator == "const":
        hint = f"use {err.validator_value!r}"
    elif err.validator == "enum":
        hint = choices_hint(str(err.instance), [str(o) for o in err.validator_value])
    elif err.validator == "required":
        hint = "add the missing key"
    elif err.validator == "pattern":
        hint = f"the value must match {err.validator_value}"
    elif err.validator == "type":
        hint = f"use a value of type {err.validator_value}"
    where, pos = _place(path, positions, source, value=err.validator in _VALUE_CHECKS)
    return [SchemaProblem(where, pos, _fmt_path(path) or "(top level)", message, hint)]


def _missing_key(err: Any) -> str | None:
    if err.validator != "required":
        return None
    m = re.match(r"^'(.+)' is a required property$", err.message)
    return m.group(1) if m else None


def schema_problems(errors: list[Any], positions: _Positions, source: str) -> list[SchemaProblem]:
    """Every schema error of a document, placed and ordered: an unknown key that explains a missing
    required key first (with its "did you mean"; the "required" error is folded into it), then by
    position in the file."""
    leaves = [jsonschema.exceptions.best_match([e]) for e in errors]
    missing: dict[tuple[Any, ...], set[str]] = {}
    for e in leaves:
        key = _missing_key(e)
        if key is not None:
            missing.setdefault(tuple(e.absolute_path), set()).add(key)
    pairs: list[tuple[SchemaProblem, Any]] = []
    explained: set[tuple[tuple[Any, ...], str]] = set()
    for e in leaves:
        here = sorted(missing.get(tuple(e.absolute_path), set())) if e.validator == "additionalProperties" else []
        for prob in _schema_problems(e, positions, source):
            unknown = prob.message[len("unknown key "):][1:-1] if prob.message.startswith("unknown key ") else ""
            close = difflib.get_close_matches(unknown, here, n=1) if unknown and here else []
            if close:
                explained.add((tuple(e.absolute_path), close[0]))
                prob = SchemaProblem(prob.where, prob.pos, prob.key_path, prob.message,
                                     f"did you mean {close[0]!r}? ({close[0]!r} is required)", True)
            pairs.append((prob, e))
    kept = [p for p, e in pairs if (tuple(e.absolute_path), _missing_key(e)) not in explained]
    seen: set[str] = set()
    unique: list[SchemaProblem] = []
    for p in sorted(kept, key=lambda p: (not p.explains_missing, p.pos, p.key_path, p.message)):
        if p.text() not in seen:
            seen.add(p.text())
            unique.append(p)
    return unique


def schema_error(problems: list[SchemaProblem], source: str) -> ConfigError:
    """One ConfigError listing up to `MAX_SCHEMA_ERRORS` problems, each with its place and fix."""
    if len(problems) == 1:
        p = problems[0]
        return ConfigError(p.text(), hint=p.hint)
    shown = problems[:MAX_SCHEMA_ERRORS]
    lines = [f"{source}: {len(problems)} problems in the matrix:"]
    for p in shown:
        lines.append(f"  {p.text()}" + (f"\n    hint: {p.hint}" if p.hint else ""))
    if len(problems) > len(shown):
        lines.append(f"  … and {len(problems) - len(shown)} more (fix these and run again)")
    return ConfigError("\n".join(lines))


class MatrixProblems(ConfigError):
    """Every mistake found in the matrix's entries at once (schema, `options`, `inputs.phases`), as one error.

    `problems`: each placed; `backends`: (index, spec) of the backend entries that resolve despite them, so that
    `backends.check.load_checked` can add the backends' own mistakes to the same list."""

    def __init__(self, problems: list[SchemaProblem], source: str, backends: tuple[tuple[int, "BackendSpec"], ...]) -> None:
        err = schema_error(problems, source)
        super().__init__(err.message, hint=err.hint)
        self.problems = list(problems)
        self.source = source
        self.backends = backends


# --------------------------------------------------------------------------- load

def load_matrix(path: str | os.PathLike[str] | None = None) -> Matrix:
    """Load and validate a matrix file; `None` loads the bundled example."""
    if path is None:
        with as_file(files("ci_runner") / "data" / "example.yaml") as p:
            return _load(Path(p), Path(p).read_text(encoding="utf-8"))
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{p}: matrix file not found", hint="give the path to a matrix YAML file, or none for the bundled example") from None
    except IsADirectoryError:
        raise ConfigError(f"{p}: is a folder, not a matrix file", hint="give the path to a matrix YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{p}: not UTF-8 text", hint="save the matrix as UTF-8 YAML") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read matrix file: {exc.strerror}") from None
    return _load(p.resolve(), text)


def load_matrix_text(text: str, *, path: str = "<matrix>") -> Matrix:
    return _load(Path(path), text)


def _load(path: Path, text: str) -> Matrix:
    source = str(path)
    data, positions = parse_yaml(text, source)
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source}:1:1: the matrix must be a mapping with `version`, `models` and `backends`",
            hint="start from the bundled example, ci_runner/data/example.yaml",
        )
    validator = jsonschema.Draft202012Validator(schema("matrix.schema.json"))
    errors = list(validator.iter_errors(data))
    problems = schema_problems(errors, positions, source) if errors else []
    rejected = [tuple(e.absolute_path) for e in errors]  # what the schema rejected: the later checks skip it
    problems += _check_options(data, positions, source, rejected)
    problems += _check_workloads(data, positions, source, rejected)
    problems += _duplicate_ids(data, positions, source)
    problems += _non_finite(data, positions, source)
    if problems:
        raise MatrixProblems(problems, source, _backend_specs(data, path.parent, errors))
    return _resolve(path, data, positions)


def _inside(path: tuple[Any, ...], rejected: list[tuple[Any, ...]]) -> bool:
    """Does the schema reject something at or below `path`?"""
    return any(r[:len(path)] == path for r in rejected)


def _entries(data: dict[str, Any], kind: str) -> list[tuple[int, dict[str, Any]]]:
    """The `models` / `backends` entries that are mappings, with their index (the schema rejects the others)."""
    items = data.get(kind)
    return [(i, item) for i, item in enumerate(items) if isinstance(item, dict)] if isinstance(items, list) else []


def _backend_specs(data: dict[str, Any], base: Path, errors: list[Any]) -> tuple[tuple[int, BackendSpec], ...]:
    """The backend entries the schema found nothing wrong with (an unknown key beside them aside), as specs."""
    def broken(i: int) -> bool:
        for e in errors:
            at = tuple(e.absolute_path)
            if at[:2] == ("backends", i) and not (len(at) == 2 and e.validator == "additionalProperties"):
                return True
        return False

    return tuple((i, _backend_spec(b, base)) for i, b in _entries(data, "backends") if not broken(i))


def _duplicate_ids(data: dict[str, Any], positions: _Positions, source: str) -> list[SchemaProblem]:
    """A model or backend id used twice, each repeat placed (listed with the other problems of the matrix)."""
    problems: list[SchemaProblem] = []
    for what in ("models", "backends"):
        seen: set[str] = set()
        for i, item in _entries(data, what):
            ident = item.get("id")
            if not isinstance(ident, str):
                continue
            if ident in seen:
                pos = positions.at((what, i, "id")) or (0, 0)
                problems.append(SchemaProblem(f"{source}:{pos[0]}:{pos[1]}", pos, f"{what}[{i}].id",
                                              f"duplicate id {ident!r}", "ids must be unique"))
            seen.add(ident)
    return problems


def _non_finite(data: Any, positions: _Positions, source: str) -> list[SchemaProblem]:
    """Every `.nan` / `.inf` in the matrix, placed: YAML reads them as floats that the schema's bounds let through
    (``timeout: .nan``), and no setting means them."""
    problems: list[SchemaProblem] = []
    stack: list[tuple[tuple[Any, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            where, pos = _place(path, positions, source, value=True)
            problems.append(SchemaProblem(where, pos, _fmt_path(path) or "(top level)", f"{value} is not a finite number",
                                          "use a finite number"))
        elif isinstance(value, dict):
            stack.extend((path + (k,), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((path + (i,), v) for i, v in enumerate(value))
    return sorted(problems, key=lambda p: p.pos)


def _unique(items: list[dict[str, Any]], what: str, source: str, positions: _Positions) -> None:
    seen: set[str] = set()
    for i, item in enumerate(items):
        if item["id"] in seen:
            pos = positions.at((what, i, "id")) or (0, 0)
            raise ConfigError(f"{source}:{pos[0]}:{pos[1]}: {what}[{i}].id: duplicate id {item['id']!r}", hint="ids must be unique")
        seen.add(item["id"])


def _blocks(data: dict[str, Any], where: tuple[str, ...]) -> list[tuple[tuple[Any, ...], Any]]:
    """(key path, value) of `defaults.<where>` and each model's and backend's `<where>`, where the path leads
    through mappings."""
    out: list[tuple[tuple[Any, ...], Any]] = []
    roots = [(("defaults",), data.get("defaults"))]
    roots += [((kind, i), item) for kind in ("models", "backends") for i, item in _entries(data, kind)]
    for path, node in roots:
        for key in where:
            node = node.get(key) if isinstance(node, dict) else None
        out.append((path + where, node))
    return out


def _check_workloads(data: dict[str, Any], positions: _Positions, source: str,
                     rejected: list[tuple[Any, ...]]) -> list[SchemaProblem]:
    """The problems of every workload spelling (ci_runner/workloads/): `inputs.phases` (unknown phases or options,
    each at its item), `parallel` and a backend's `precision` (each at its key); a value the schema rejected is
    left to the schema's message."""
    blocks: list[tuple[tuple[Any, ...], Any, Callable[[Any], list[tuple[tuple[Any, ...], str, str]]], bool]] = []
    blocks += [(path, raw, lambda r: [((i,), m, h) for i, m, h in check_phases(r)], False)
               for path, raw in _blocks(data, ("inputs", "phases")) if isinstance(raw, list)]
    blocks += [(path, raw, check_parallel, True) for path, raw in _blocks(data, ("parallel",)) if raw is not None]
    blocks += [(("backends", i, "precision"), b["precision"], check_precision, True)
               for i, b in _entries(data, "backends") if "precision" in b]
    problems: list[SchemaProblem] = []
    for path, raw, check, at_value in blocks:
        if _inside(path, rejected):
            continue
        for sub, message, hint in check(raw):
            pos = positions.at(path + sub, value=at_value) or positions.at(path) or (0, 0)
            problems.append(SchemaProblem(f"{source}:{pos[0]}:{pos[1]}", pos, _fmt_path(path + sub), message, hint))
    return problems


def cell_parallel(defaults: Mapping[str, Any], model: Mapping[str, Any], backend: Mapping[str, Any]) -> ParallelSpec | None:
    """A cell's layout: the backend's `parallel`, else the model's, else the defaults' (the most specific wins
    whole; `parallel: null` there turns it off)."""
    for raw in (backend, model, defaults):
        if "parallel" in raw:
            return parse_parallel(raw["parallel"])
    return None


def _check_options(data: dict[str, Any], positions: _Positions, source: str,
                   rejected: list[tuple[Any, ...]]) -> list[SchemaProblem]:
    """The problems of every `options.<mode>` of defaults, models and backends that does not parse
    (`ci_runner/options.py`): the offending key of each block; a block the schema rejected is left to it."""
    problems: list[SchemaProblem] = []
    for path, block in _blocks(data, ("options",)):
        if not isinstance(block, dict):
            continue
        for mode, opts in block.items():
            if mode not in mode_names() or _inside(path + (mode,), rejected):
                continue
            try:
                parse_options(mode, opts, where=_fmt_path(path + (mode,)))
            except OptionError as exc:
                at = path + (mode, exc.key) if exc.key is not None and exc.key in (opts or {}) else path + (mode,)
                known_key = "unknown option" in exc.message
                pos = positions.at(at, value=not known_key) or (0, 0)
                problems.append(SchemaProblem(f"{source}:{pos[0]}:{pos[1]}", pos, "", exc.message, exc.hint))
    return problems


def _resolve(path: Path, data: dict[str, Any], positions: _Positions) -> Matrix:
    source = str(path)
    base = path.parent
    defaults = data.get("defaults") or {}
    _unique(data["models"], "models", source, positions)
    _unique(data["backends"], "backends", source, positions)

    models = _model_specs(data["models"], base, positions, source)

    backends = []
    for i, b in enumerate(data["backends"]):
        if b.get("container") and not b.get("python"):
            pos = positions.at(("backends", i, "container")) or (0, 0)
            raise ConfigError(
                f"{source}:{pos[0]}:{pos[1]}: backends[{i}].container: a backend that runs in a container needs `python`",
                hint="name the image's interpreter that holds torch, e.g. `python: python3`",
            )
        backends.append(_backend_spec(b, base))

    model_ids = [m.id for m in models]
    backend_ids = [b.id for b in backends]
    for key in ("exclude", "include"):
        for i, sel in enumerate(data.get(key) or []):
            for field_name, ids in (("model", model_ids), ("backend", backend_ids)):
                pattern = sel.get(field_name)
                if pattern is not None and not any(fnmatch.fnmatchcase(x, pattern) for x in ids):
                    pos = positions.at((key, i, field_name)) or (0, 0)
                    raise ConfigError(
                        f"{source}:{pos[0]}:{pos[1]}: {key}[{i}].{field_name}: {pattern!r} matches no {field_name}",
                        hint=choices_hint(pattern, ids),
                    )

    refs = tuple(Reference(**r) for r in data["references"]) if data.get("references") else DEFAULT_REFERENCES
    return Matrix(
        path=path,
        version=data["version"],
        modes=tuple(defaults.get("modes", default_mode_names())),
        timeout=float(defaults.get("timeout", DEFAULT_TIMEOUT_S)),
        inputs=InputSpec().merged(defaults.get("inputs")),
        options=MappingProxyType({k: MappingProxyType(dict(v)) for k, v in (defaults.get("options") or {}).items()}),
        max_jobs=int(defaults.get("max_jobs", DEFAULT_MAX_JOBS)),
        references=refs,
        models=tuple(models),
        backends=tuple(backends),
        exclude=tuple(MappingProxyType(dict(s)) for s in data.get("exclude") or ()),
        include=tuple(MappingProxyType(dict(s)) for s in data.get("include") or ()),
        raw=MappingProxyType(data),
    )


def _backend_spec(b: Mapping[str, Any], base: Path) -> BackendSpec:
    """One `backends:` entry (valid by the schema) as a spec."""
    runs_on = b.get("runs-on", "ubuntu-latest")
    return BackendSpec(
        id=b["id"],
        compile=b.get("compile"),
        imports=tuple(b.get("import") or ()),
        device=b.get("device", "cpu"),
        env=MappingProxyType({k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in (b.get("env") or {}).items()}),
        compile_options=MappingProxyType(dict(b.get("compile_options") or {})),
        backend_options=MappingProxyType(dict(b.get("backend_options") or {})),
        ir=b.get("ir", "aten"),
        runs_on=(runs_on,) if isinstance(runs_on, str) else tuple(runs_on),
        python=b.get("python"),
        container=_container(b.get("container")),
        setup=tuple(b.get("setup") or ()),
        artifacts=tuple(b.get("artifacts") or ()),
        source=_source(b.get("source"), base),
        process_group=b.get("process_group"),
        precision=parse_precision(b.get("precision")),
    )


def _model_specs(raw: list[dict[str, Any]], base: Path, positions: _Positions, source: str) -> list[ModelSpec]:
    """The `models:` entries as specs, zoo entries expanded (one per architecture)."""
    models: list[ModelSpec] = []
    for i, m in enumerate(raw):
        if "zoo" in m or "select" in m or "exclude" in m:
            models.extend(_zoo_models(m, i, positions, source))
            continue
        kw = {k: v for k, v in m.items() if k in ("id", "config", "hub", "revision", "factory", "task", "dtype", "trust_remote_code")}
        if "path" in m:
            if m["path"].startswith("pkg:"):  # a folder inside an installed package, resolved by models.py
                kw["path"] = m["path"]
            else:
                p = Path(os.path.expanduser(m["path"]))
                kw["path"] = str(p if p.is_absolute() else (base / p).resolve())
        kw["overrides"] = MappingProxyType(dict(m.get("overrides") or {}))
        models.append(ModelSpec(**kw))
    _unique_models(models, raw, positions, source)
    return models


def _zoo_models(m: Mapping[str, Any], i: int, positions: _Positions, source: str) -> list[ModelSpec]:
    """A `zoo:` entry → one model per selected architecture of the installed transformers, named by model_type."""
    from .zoo.catalog import expand_selection  # deferred: lists transformers' config types

    def place(key: str, j: int) -> str:
        pos = positions.at(("models", i, key, j), value=True) or positions.at(("models", i, key)) or (0, 0)
        return f"{source}:{pos[0]}:{pos[1]}: models[{i}].{key}[{j}]"

    if "zoo" not in m:
        pos = positions.at(("models", i, "select" if "select" in m else "exclude")) or (0, 0)
        raise ConfigError(f"{source}:{pos[0]}:{pos[1]}: models[{i}]: `select` / `exclude` belong to a zoo entry",
                          hint="add `zoo: transformers` to this model, or remove select/exclude")
    types = expand_selection(list(m.get("select") or ()), list(m.get("exclude") or ()), place=place)
    keep = {k: m[k] for k in ("dtype", "trust_remote_code") if k in m}
    return [ModelSpec(id=t, config=t, zoo=m["zoo"], zoo_entry=m["id"], **keep) for t in types]


def _unique_models(models: list[ModelSpec], raw: list[Mapping[str, Any]], positions: _Positions, source: str) -> None:
    """An architecture of a zoo entry may not share its id with another model."""
    seen: dict[str, ModelSpec] = {}
    for spec in models:
        other = seen.setdefault(spec.id, spec)
        if other is not spec:
            entry = next(i for i, r in enumerate(raw) if r["id"] in (spec.zoo_entry or spec.id, other.zoo_entry))
            pos = positions.at(("models", entry, "id")) or (0, 0)
            raise ConfigError(f"{source}:{pos[0]}:{pos[1]}: models: {spec.id!r} is both a model and an architecture "
                              f"of zoo entry {(spec.zoo_entry or other.zoo_entry)!r}",
                              hint=f"add {spec.id!r} to the zoo entry's `exclude`, or rename the other model")


def _container(value: Any) -> Mapping[str, Any] | None:
    """The job container as GitHub's `container:` mapping: {image, options, env}, env values as strings."""
    if value is None:
        return None
    if isinstance(value, str):
        value = {"image": value}
    env = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in (value.get("env") or {}).items()}
    return MappingProxyType({"image": value["image"], "options": value.get("options", ""), "env": MappingProxyType(env)})


def _source(value: Any, base: Path) -> Mapping[str, Any] | None:
    """A backend's `source`, its repo made absolute against the matrix file's folder."""
    if not value:
        return None
    repo = Path(os.path.expanduser(value["repo"]))
    return MappingProxyType({**value, "repo": str(repo if repo.is_absolute() else (base / repo).resolve()),
                             "setup": tuple(value["setup"])})


def raw_entry(matrix: Matrix, kind: str, entry_id: str) -> Mapping[str, Any]:
    """The matrix entry as written (for per-entry modes/timeout/inputs/options)."""
    for item in matrix.raw.get(kind, ()):
        if item.get("id") == entry_id:
            return item
    return {}


# --------------------------------------------------------------------------- specs across processes

def plain_json(value: Any) -> Any:
    """`value` as plain JSON data: mappings (read-only ones too) as dicts with string keys, tuples as lists, a typed
    sub-spec (PrecisionPolicy) as its `to_json()`."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, Mapping):
        return {str(k): plain_json(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(x) for x in value]
    return value


def spec_to_json(spec: Any) -> dict[str, Any]:
    """A frozen spec dataclass (ModelSpec, BackendSpec, InputSpec, …) as plain JSON, for a child process."""
    return {f.name: plain_json(getattr(spec, f.name)) for f in fields(spec)}


def spec_from_json(cls: type, data: Mapping[str, Any]) -> Any:
    """Inverse of `spec_to_json`: lists back to tuples, mappings to read-only mappings; unknown keys ignored."""
    kw: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in data:
            continue
        v = data[f.name]
        factory = f.default_factory if f.default_factory is not MISSING else None
        if isinstance(factory, type) and hasattr(factory, "from_json"):  # a typed sub-spec (PrecisionPolicy)
            v = factory.from_json(v)
        elif isinstance(v, list):
            v = tuple(v)
        elif isinstance(v, dict):
            v = MappingProxyType(dict(v))
        kw[f.name] = v
    return cls(**kw)
