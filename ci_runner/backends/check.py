"""The matrix's backends checked at load, before any cell runs: every mistake at once, each at its file:line.

What needs no import is checked here (`compile_options` keys, a sim backend's `backend_options`, options given to a
backend that takes none, a malformed `module:callable`); the rest (the `import` modules, a plugin's callable and its
factory's keywords, a compile name that is not one of torch's own, a device type torch does not know) once, in one
child process (`procs.isolate.supervise`): a plugin that crashes or hangs on import cannot crash or stall the run
(the child is replaced for the other backends, each backend's imports have `IMPORT_LIMIT_S`), and this process
stays free of torch (`deepview-ci expand` never imports it). A backend left unchecked that way is checked when its
cells run, as before, with a note.

A module that raises on import (a plugin that finds no device here) is not a mistake in the matrix: its cells
report it, as an environment error. `missing_ok` (for `expand`, which runs where the backends' packages may not be
installed, and `cell`, whose result should say it): a module that is not installed here is not a mistake either. In
both cases what the module would register is not checked.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import os
import pkgutil
import signal
import sys
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from dataclasses import dataclass
from typing import Any

from ..config import (BackendSpec, Matrix, MatrixProblems, SchemaProblem, load_matrix, parse_yaml, schema_error,
                      spec_from_json, spec_to_json)
from ..procs.isolate import Attempt, IsolatedResult, child_journal, supervise
from ..workloads.parallel import DEFAULT_PROCESS_GROUP, check_process_group
from ..fsutil import append_record, read_records

# torch.compile backend names torch registers itself (torch 2.1 to 2.13): accepted without starting a child
STOCK_COMPILERS = frozenset({
    "inductor", "aot_eager", "aot_eager_decomp_partition", "aot_eager_default_partitioner", "aot_ts", "cudagraphs",
    "eager", "eager_debug", "eager_noexcept", "pre_dispatch_eager", "ts", "openxla", "openxla_eval", "tvm", "onnxrt",
})
# device types torch knows without a plugin (c10's DeviceType names), plus the self-test device
STOCK_DEVICES = frozenset({"cpu", "cuda", "mps", "xpu", "meta", "hpu", "xla", "mtia", "ipu", "ve", "lazy", "vulkan",
                           "maia", "hip", "fpga", "mkldnn", "opengl", "opencl", "ideep", "simdev"})
COMPILE_KEYS = ("disable", "dynamic", "fullgraph", "mode", "options")  # torch.compile's keyword arguments
# the sim backends (`ci_runner/sim/__init__.py`, SIM_BACKENDS; tests/unit/test_backend_check.py keeps the two equal):
# name -> its options, None for the device-only `simdev`; kept here because importing ci_runner.sim imports torch
SIM_OPTIONS: Mapping[str, tuple[str, ...] | None] = {
    "sim-subset": ("allow", "extra_allow"), "sim-drift": ("op", "dtype"), "sim-crash": ("op",), "sim-abort": ("op",),
    "sim-segv": ("op",), "sim-hang": ("op", "seconds"), "sim-slow": ("seconds",),
    "sim-decode": ("op", "max_query_len"),
    "sim-kvdrift": ("dtype", "writes"), "sim-masknan": ("op",), "sim-long": ("max_tokens", "op"),
    "sim-reuse": ("outputs",), "sim-precision": ("matmul", "conv", "attention", "accumulate", "softmax", "norm",
                                                  "reduction", "elementwise", "kv_cache", "overflow",
                                                  "overflow_in"), "sim-memhog": ("instances", "copies"), "simdev": None,
    "sim-tp-drop": ("nth",), "sim-tp-dup": ("nth",), "sim-tp-shard": ("nth",),
}
SIMDEV_OPTIONS = ("allow", "extra_allow", "deny", "capacity_mb")
IMPORT_LIMIT_S = 20.0  # a backend whose imports take longer is left to its cells (a plugin waiting for a device)
STARTUP_S = 60.0  # the checking child's own start (torch's import) on a busy machine


@dataclass(frozen=True)
class Problem:
    """One mistake in `backends[index]`, at the key path `where` inside it."""

    index: int
    where: tuple[Any, ...]
    message: str
    hint: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "where": list(self.where), "message": self.message, "hint": self.hint}


def _hint(word: str, choices: Iterable[str], tail: str = "") -> str:
    names = sorted(set(choices))
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.6)
    return (f"did you mean {close[0]!r}? " if close else "") + f"known: {', '.join(names) or '(none)'}" + tail


def _unknown_keys(index: int, where: tuple[Any, ...], given: Mapping[str, Any], known: Sequence[str],
                  what: str, tail: str = "") -> list[Problem]:
    return [Problem(index, (*where, key), f"unknown {what} {key!r}", _hint(str(key), known, tail))
            for key in given if key not in known]


def static_problems(index: int, spec: BackendSpec) -> list[Problem]:
    """What is wrong with `spec` that needs no import."""
    out = _unknown_keys(index, ("compile_options",), spec.compile_options, COMPILE_KEYS, "compile_options key",
                        " (torch.compile's arguments)")
    out += [Problem(index, ("process_group",), message, hint) for message, hint in check_process_group(spec.process_group)]
    name, options = spec.compile, dict(spec.backend_options)
    on_simdev = spec.device.split(":")[0] == "simdev"
    if on_simdev:  # simdev's options: the backend_options of an eager backend, else backend_options.simdev
        sim_opts = options if name is None else (options.pop("simdev", None) or {})
        if isinstance(sim_opts, Mapping):
            where = ("backend_options",) if name is None else ("backend_options", "simdev")
            out += _unknown_keys(index, where, sim_opts, SIMDEV_OPTIONS, "simdev option")
        if name is None:
            options = {}
    if name is None:
        if options:
            out.append(Problem(index, ("backend_options",), "backend_options given to an eager backend (no `compile`)",
                               "remove them, or name the compiler that takes them under `compile`"))
    elif name in SIM_OPTIONS:
        known = SIM_OPTIONS[name]
        if known is None:
            out.append(Problem(index, ("compile",), f"{name!r} is a device, not a compiler",
                               f"write `device: {name}` (and no `compile:`) for an eager device backend"))
        else:
            out += _unknown_keys(index, ("backend_options",), options, known, f"{name} option")
    elif ":" in name:
        module, _, attr = name.partition(":")
        if not module or not attr:
            out.append(Problem(index, ("compile",), f"compile {name!r} is not 'module:callable'",
                               'e.g. compile: "my_pkg.backend:compile_fn"'))
    elif options:
        out.append(Problem(index, ("backend_options",), f"backend_options are not used by registered backend {name!r}",
                           "put torch.compile arguments under compile_options (e.g. options: {...} for inductor)"))
    return out


def needs_child(spec: BackendSpec) -> bool:
    """Can `spec`'s names only be checked by importing (its plugins, or torch's own list)?"""
    name = spec.compile
    if spec.imports or spec.device.split(":")[0] not in STOCK_DEVICES:
        return True
    if spec.process_group is not None and spec.process_group != DEFAULT_PROCESS_GROUP:
        return True  # the c10d backends torch knows here
    return name is not None and name not in SIM_OPTIONS and (":" in name or name not in STOCK_COMPILERS)


def check_backends(matrix: Matrix, backend_ids: Iterable[str] | None = None, *, missing_ok: bool = False) -> None:
    """Raise one `ConfigError` (exit 2) listing every mistake in the backends `backend_ids` (default: all) with
    its file:line and a did-you-mean; return when there is none."""
    wanted = set(backend_ids) if backend_ids is not None else None
    chosen = [(i, b) for i, b in enumerate(matrix.backends) if wanted is None or b.id in wanted]
    problems = backend_problems(matrix.path, chosen, missing_ok=missing_ok)
    if problems:
        raise schema_error(problems, str(matrix.path))


def load_checked(path: str | os.PathLike[str] | None, *, check: bool = True) -> Matrix:
    """`load_matrix` for the commands that check backends at load (`run`, `cell`, `expand`, `dump --backend`,
    `zoo probe|cells`): when the matrix's entries have mistakes (schema, options, phases), the mistakes of every
    backend that resolves despite them are added to the same error, so that one run shows them all. A module
    not installed here is not counted then (`missing_ok`): which backends the command would use is not known."""
    try:
        return load_matrix(path)
    except MatrixProblems as exc:
        more = backend_problems(Path(exc.source), exc.backends, missing_ok=True) if check and exc.backends else []
        if not more:
            raise
        raise schema_error(exc.problems + more, exc.source) from None


def backend_problems(source: Path, chosen: Sequence[tuple[int, BackendSpec]], *,
                     missing_ok: bool = False) -> list[SchemaProblem]:
    """Every mistake in the backend entries `chosen` ((index in `backends:`, spec)), placed in the file `source`;
    a note on stderr for each backend whose imports could not be checked."""
    problems = [p for i, b in chosen for p in static_problems(i, b)]
    flagged = {p.index for p in problems}
    deep = [(i, b) for i, b in chosen if i not in flagged and needs_child(b)]
    ids = {i: b.id for i, b in chosen}
    if deep:
        found, unchecked = _check_in_children(deep, missing_ok)
        problems += found
        for i, why in sorted(unchecked.items()):
            print(f"deepview-ci: note: backend {ids[i]!r} was not checked at load ({why}); "
                  "its cells will say what is wrong", file=sys.stderr)
    return _placed(source, ids, problems) if problems else []


def _placed(matrix_path: Path, ids: Mapping[int, str], problems: Sequence[Problem]) -> list[SchemaProblem]:
    source = str(matrix_path)
    try:
        _, positions = parse_yaml(matrix_path.read_text(encoding="utf-8"), source)
    except OSError:
        positions = None
    out = []
    for p in sorted(problems, key=lambda p: (p.index, p.where)):
        path = ("backends", p.index, *p.where)
        pos = positions.at(path, value=p.where[:1] in (("compile",), ("device",), ("import",), ("process_group",))) \
            if positions else None
        key_path = f"backends[{p.index}]" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in p.where)
        out.append(SchemaProblem(f"{source}:{pos[0]}:{pos[1]}" if pos else source, pos or (0, 0),
                                 f"{key_path} (backend {ids[p.index]!r})", p.message, p.hint))
    return out


def _check_in_children(deep: Sequence[tuple[int, BackendSpec]], missing_ok: bool) -> tuple[list[Problem], dict[int, str]]:
    """The import-time problems of `deep`, checked in one child (`check_in_child`); a child that crashes or hangs
    in a backend's import is replaced by one that checks the rest, and that backend is left unchecked."""
    with tempfile.TemporaryDirectory(prefix="deepview-check-") as tmp:
        records, journal = Path(tmp) / "checked.jsonl", Path(tmp) / "journal.log"
        unchecked: dict[int, str] = {}

        def checked() -> dict[str, Any]:
            return read_records(records, dict, lambda r: str(r["index"]))

        def next_attempt(_n: int) -> Attempt | None:
            done = checked()
            left = [(i, b) for i, b in deep if str(i) not in done and i not in unchecked]
            if not left:
                return None
            return Attempt(payload={"backends": [{"index": i, "spec": spec_to_json(b)} for i, b in left],
                                    "missing_ok": missing_ok, "out": str(records), "limit": IMPORT_LIMIT_S},
                           timeout=STARTUP_S + IMPORT_LIMIT_S * len(left))

        def on_crash(item: str | None, result: IsolatedResult) -> str | None:
            if item is None:  # it died before or after every backend (its own start): check no more
                return f"the check {result.describe()}"
            unchecked[int(item)] = f"the check {result.describe()} in its imports"
            return None

        run = supervise("ci_runner.backends.check:check_in_child", journal=journal, kind="backend",
                        next_attempt=next_attempt, on_crash=on_crash, max_restarts=len(deep))
        done = checked()
        for i, _ in deep:
            if str(i) not in done and i not in unchecked and run.stop_reason:
                unchecked[i] = run.stop_reason
        problems = [Problem(p["index"], tuple(p["where"]), p["message"], p.get("hint"))
                    for r in done.values() for p in r["problems"]]
        unchecked.update({int(k): r["unchecked"] for k, r in done.items() if r.get("unchecked")})
        return problems, unchecked


# --------------------------------------------------------------------------- in the child

class _TooLong(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise `_TooLong` in this (main) thread after `seconds`: a plugin whose import waits (a device, the network)."""
    def expire(_signum: int, _frame: Any) -> None:
        raise _TooLong()

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)

def check_in_child(payload: Mapping[str, Any]) -> None:
    """The import-time checks of each backend (`supervise` target): one record per backend appended to
    `payload["out"]`, each backend's work journalled (`enter-backend`), each within `payload["limit"]` seconds."""
    import torch  # noqa: F401 - before the limits: its own import is not a plugin's

    for item in payload["backends"]:
        spec = spec_from_json(BackendSpec, item["spec"])
        saved = dict(os.environ)
        os.environ.update(spec.env)
        child_journal("enter-backend", str(item["index"]))
        record: dict[str, Any] = {"index": item["index"], "problems": []}
        try:
            with _time_limit(float(payload["limit"])):
                record["problems"] = [p.to_json() for p in _deep_problems(item["index"], spec,
                                                                          missing_ok=bool(payload.get("missing_ok")))]
        except _TooLong:
            record["unchecked"] = f"its imports took over {payload['limit']:g} s"
        finally:
            os.environ.clear()
            os.environ.update(saved)
        append_record(payload["out"], record)
        child_journal("leave-backend", str(item["index"]))


def _top_modules() -> list[str]:
    return sorted({m.name for m in pkgutil.iter_modules()} | set(sys.builtin_module_names))


def _import(index: int, where: tuple[Any, ...], name: str, missing_ok: bool) -> tuple[Any, Problem | None, bool]:
    """(module, problem, unchecked): the module, or the problem importing it; `unchecked` when it could not be
    imported (what it would register is then not checked)."""
    try:
        return importlib.import_module(name), None, False
    except ModuleNotFoundError as exc:
        if missing_ok:
            return None, None, True
        top = name.split(".")[0]
        close = difflib.get_close_matches(top, _top_modules(), n=1, cutoff=0.6) if exc.name == top else []
        hint = (f"did you mean {close[0]!r}? " if close else "") + "install the plugin's package here, or fix the name"
        return None, Problem(index, where, f"module {name!r} not found ({exc.name})", hint), True
    except _TooLong:  # the backend's time is up: its other imports would wait the same way
        raise
    except BaseException:  # a plugin that raises (even SystemExit) on import, e.g. no device on this machine:
        return None, None, True  # not a mistake in the matrix; its cells report it (environment error)


def _deep_problems(index: int, spec: BackendSpec, *, missing_ok: bool) -> list[Problem]:
    out: list[Problem] = []
    missing = False
    for j, name in enumerate(spec.imports):
        _, problem, gone = _import(index, ("import", j), name, missing_ok)
        missing |= gone
        out += [problem] if problem else []
    import torch  # the plugins are imported: now the names they registered are known

    dev_type = spec.device.split(":")[0]
    if dev_type not in STOCK_DEVICES and not missing:
        try:
            torch.device(spec.device)
        except RuntimeError:
            out.append(Problem(index, ("device",), f"unknown device {spec.device!r}",
                               _hint(dev_type, STOCK_DEVICES - {"simdev"} | {torch._C._get_privateuse1_backend_name()},
                                     "; a PrivateUse1 plugin must be listed under `import:` to register its device")))
    if spec.process_group is not None and not missing:
        out += _process_group_problems(index, spec.process_group)
    name = spec.compile
    if name is None or name in SIM_OPTIONS:
        return out
    if ":" in name:
        return out + _plugin_problems(index, spec, missing_ok)
    from torch._dynamo import list_backends

    names = set(list_backends(exclude_tags=()))
    if name not in names and not missing:
        shown = set(list_backends()) | (STOCK_COMPILERS & names) | {n for n, o in SIM_OPTIONS.items() if o is not None}
        out.append(Problem(index, ("compile",), f"unknown torch.compile backend {name!r}",
                           _hint(name, shown, "; or give a plugin as 'module:callable' (its package under `import:`)")))
    return out


def _plugin_problems(index: int, spec: BackendSpec, missing_ok: bool) -> list[Problem]:
    module_name, _, attr = str(spec.compile).partition(":")
    module, problem, _ = _import(index, ("compile",), module_name, missing_ok)
    if module is None:
        return [problem] if problem else []
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
            return [Problem(index, ("compile",), f"{module_name!r} has no attribute {attr!r}", _hint(part, names))]
        obj = getattr(obj, part)
    if not callable(obj):
        return [Problem(index, ("compile",), f"{spec.compile!r} is not callable", "name the backend function or its factory")]
    if not spec.backend_options:
        return []
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    known = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return _unknown_keys(index, ("backend_options",), spec.backend_options, known, "option",
                         f" (the keywords of the factory {spec.compile})")


def c10d_backends() -> list[str]:
    """The c10d backend names torch knows in this process (its own and those plugins registered)."""
    import torch.distributed as dist  # deferred: after the plugins' imports

    return sorted(n for n in dist.Backend.backend_list if n != "undefined")


def _process_group_problems(index: int, name: str) -> list[Problem]:
    """A declared process group c10d does not know once the backend's plugins are imported (one the plugin knows
    but cannot start here, e.g. nccl without a GPU, is the cells' to report)."""
    if name.lower() in c10d_backends():
        return []
    return [Problem(index, ("process_group",), f"unknown c10d backend {name!r} (process_group)",
                    _hint(name.lower(), c10d_backends(), "; a device's plugin registers its own with "
                          "torch.distributed.Backend.register_backend: list its module under `import:`"))]
