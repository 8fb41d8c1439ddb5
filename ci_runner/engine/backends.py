"""Backend specs → a ready-to-use `Backend`: compile adapter, device adapter, versions.

A matrix backend (`backends:` in the matrix, `config.BackendSpec`) is resolved in this order:

1. `env` is applied to `os.environ` (plugins may read it when imported);
2. the `import` list is imported (plugins may register torch.compile backends or a PrivateUse1 device);
3. the device is set up: `simdev` registers the self-test device (`ci_runner.sim.simdev.register()`); others must
   be a device type torch knows after the imports (`cpu`, `cuda`, a renamed PrivateUse1 device, …) and available;
4. `compile` is resolved:
   * absent: eager on the device;
   * a sim name (`sim-subset`, `sim-drift`, …): built by `ci_runner.sim.make_backend(name, backend_options)`;
   * `module:callable`: imported; if `backend_options` is non-empty the callable is a FACTORY and
     `callable(**backend_options)` returns the backend, otherwise the callable IS the backend;
   * any other string: a registered torch.compile backend name (`inductor`, `aot_eager`, whatever
     `torch._dynamo.list_backends(exclude_tags=())` lists after the imports), passed through as the string.

`backend_options` go to the compile backend when there is one; for an eager `device: simdev` backend they configure
simdev (`allow`/`extra_allow`/`deny`); with both, simdev's options sit under `backend_options.simdev`
(`simdev_options`).
Every failure is a `BackendError` that lists what is available.

The other facts about backends live here too, so that every mode and every repro agrees on them:
`backend_recipe` (how a standalone script rebuilds the backend), and the error-text patterns that name an
unsupported op (`UNSUPPORTED_RE`, `COULD_NOT_RUN_RE`, `ATEN_NAME_RE`; `unsupported_op_from_error`,
`named_op_from_error`).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import logging
import os
import re
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ..config import BackendSpec
from .envinfo import tool_version
from ..errors import BackendError
from .torchcompat import available, skip_reason

# `unsupported operator aten.softplus.default` (the sims' and many vendor compilers' wording)
UNSUPPORTED_RE = re.compile(r"unsupported operator (?P<op>[A-Za-z_](?:[\w.]*\w)?)")
# PyTorch's dispatcher error for an eager device without the kernel (simdev, real PrivateUse1 plugins)
COULD_NOT_RUN_RE = re.compile(r"Could not run '(?P<op>[\w:.]+)' with arguments from the '(?P<backend>[^']+)' backend")
# any ATen/prims name in an error text (`aten::softplus`, `aten.rsqrt.default`): the last resort
ATEN_NAME_RE = re.compile(r"\b(?P<op>(?:aten|prims)(?:::|\.)[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")

# Short descriptions of the usual torch.compile backends, for `deepview-ci env`.
_KNOWN_DESCRIPTIONS: Mapping[str, str] = {
    "inductor": "TorchInductor: PyTorch's default compiler (C++/OpenMP on CPU, Triton on GPU)",
    "aot_eager": "AOTAutograd tracing, then the eager ATen kernels (no codegen): a tracing-only baseline",
    "eager": "Dynamo capture, then the captured graph runs eagerly",
    "aot_eager_decomp_partition": "aot_eager with inductor's decompositions and partitioner",
    "cudagraphs": "CUDA graphs over AOTAutograd (CUDA only)",
    "tvm": "Apache TVM (needs tvm installed)",
    "openxla": "PyTorch/XLA (needs torch_xla)",
    "onnxrt": "ONNX Runtime (needs onnxruntime)",
}

_COMPILE_KEYS = frozenset({"fullgraph", "dynamic", "mode", "options", "disable"})  # torch.compile kwargs


def _torch() -> Any:
    import torch  # deferred: `deepview-ci expand` and the report commands never need torch

    return torch


def registered_compile_backends() -> list[str]:
    """torch.compile backend names registered in this process (built-ins and plugins already imported)."""
    from torch._dynamo import list_backends  # deferred: torch

    return sorted(n for n in set(list_backends(exclude_tags=())) if not n.endswith("_TESTING_ONLY"))


def _all_dynamo_names() -> set[str]:
    from torch._dynamo import list_backends  # deferred: torch

    return set(list_backends(exclude_tags=()))


def _choices(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.7)
    listed = ", ".join(choices) or "(none)"
    return (f"did you mean {close[0]!r}? " if close else "") + f"available: {listed}"


def available_devices() -> list[str]:
    """Device types usable here: cpu, cuda when available, the current PrivateUse1 device, and simdev."""
    torch = _torch()
    out = ["cpu"]
    if torch.cuda.is_available():
        out.append("cuda")
    for name in ("xpu", "mps", "mtia"):
        mod = getattr(torch, name, None)
        try:
            if mod is not None and mod.is_available():
                out.append(name)
        except Exception:
            pass
    priv = torch._C._get_privateuse1_backend_name()
    if priv != "privateuseone" and priv not in out:
        out.append(priv)
    if "simdev" not in out and priv == "privateuseone" and available("simdev"):
        out.append("simdev")
    return out


class Backend:
    """A resolved backend, ready to use. Construct with `resolve_backend(spec)`."""

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec
        self.device: str = spec.device
        self.is_eager: bool = spec.compile is None
        self.kind: str = "eager" if spec.compile is None else ("sim" if _is_sim(spec.compile) else
                                                               "plugin" if ":" in spec.compile else "registered")
        self._prepared = False
        self._compiler: Callable[..., Any] | str | None = None
        self._imported: dict[str, Any] = {}

    def __repr__(self) -> str:
        return f"Backend(id={self.spec.id!r}, compile={self.spec.compile!r}, device={self.device!r})"

    @property
    def ir(self) -> str:
        """What the compiler sees: `dynamo`, `aten` (after aot_autograd) or `core_aten` (the spec's `ir`)."""
        return self.spec.ir

    # ------------------------------------------------------------------------------------------ setup

    def prepare(self) -> None:
        """Apply `env`, import the plugins, register devices, resolve the compiler. Idempotent."""
        if self._prepared:
            return
        for key, value in self.spec.env.items():
            os.environ[key] = value
        for name in self.spec.imports:
            self._imported[name] = self._import(name, "import")
        self._setup_device()
        self._compiler = self._resolve_compiler()
        self._prepared = True

    def _import(self, name: str, what: str) -> Any:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            raise BackendError(f"backend {self.spec.id!r}: {what} {name!r}: module not found ({exc.name})",
                               hint="install the plugin package into this environment, or fix the module name") from None
        except Exception as exc:
            raise BackendError(f"backend {self.spec.id!r}: importing {name!r} failed: {type(exc).__name__}: {exc}",
                               hint="the plugin itself failed to import; run `python -c 'import "
                                    f"{name}'` to see the full error") from None

    def _setup_device(self) -> None:
        torch = _torch()
        dev_type = self.device.split(":")[0]
        if dev_type == "simdev":
            from ..sim import simdev  # deferred: imports torch

            try:
                simdev.register_from_options(simdev_options(self.spec))
            except (RuntimeError, ValueError) as exc:
                raise BackendError(f"backend {self.spec.id!r}: cannot set up device simdev: {exc}",
                                   hint="check backend_options (allow/extra_allow/deny); simdev needs PrivateUse1 "
                                        "to itself in the process") from None
            return
        try:
            torch.device(self.device)
        except RuntimeError:
            raise BackendError(f"backend {self.spec.id!r}: unknown device {self.device!r}",
                               hint=_choices(dev_type, available_devices()) +
                               "; a PrivateUse1 plugin must be listed under `import:` to register its device") from None
        if dev_type in ("cpu", "meta"):
            return
        mod = getattr(torch, dev_type, None)
        is_available = getattr(mod, "is_available", None)
        try:
            ok = bool(is_available()) if callable(is_available) else True
        except Exception:
            ok = False
        if not ok:
            raise BackendError(f"backend {self.spec.id!r}: device {self.device!r} is not available on this machine",
                               hint=f"available: {', '.join(available_devices())}; run this backend on a runner "
                                    f"with the device (`runs-on`)")

    def _resolve_compiler(self) -> Callable[..., Any] | str | None:
        name = self.spec.compile
        if name is None:
            return None
        bad = sorted(set(self.spec.compile_options) - _COMPILE_KEYS)
        if bad:
            raise BackendError(f"backend {self.spec.id!r}: unknown compile_options key {bad[0]!r}",
                               hint=_choices(bad[0], sorted(_COMPILE_KEYS)) + " (torch.compile's arguments)")
        options = dict(self.spec.backend_options)
        if _is_sim(name):
            from .. import sim  # deferred: imports torch

            try:
                return sim.make_backend(name, options)
            except (ValueError, TypeError) as exc:
                raise BackendError(f"backend {self.spec.id!r}: {exc}",
                                   hint="see the sim backends' options in ci_runner/sim/__init__.py (README)") from None
        if ":" in name:
            return self._plugin_compiler(name, options)
        registered = registered_compile_backends()
        if name not in registered and name not in _all_dynamo_names():
            sims = [n for n, i in _sim_registry().items() if i.factory is not None]
            raise BackendError(f"backend {self.spec.id!r}: unknown torch.compile backend {name!r}",
                               hint=_choices(name, registered + sims) +
                               "; or give a plugin as 'module:callable' (with its package under `import:`)")
        if options:
            raise BackendError(f"backend {self.spec.id!r}: backend_options are not used by registered backend {name!r}",
                               hint="put torch.compile arguments under compile_options (e.g. options: {...} for inductor)")
        return name

    def _plugin_compiler(self, target: str, options: dict[str, Any]) -> Callable[..., Any]:
        module_name, _, attr = target.partition(":")
        if not module_name or not attr:
            raise BackendError(f"backend {self.spec.id!r}: compile {target!r} is not 'module:callable'",
                               hint="e.g. compile: \"my_pkg.backend:compile_fn\"")
        module = self._import(module_name, "compile")
        self._imported.setdefault(module_name, module)
        obj: Any = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
                raise BackendError(f"backend {self.spec.id!r}: {module_name!r} has no attribute {attr!r}",
                                   hint=_choices(part, names))
            obj = getattr(obj, part)
        if not callable(obj):
            raise BackendError(f"backend {self.spec.id!r}: {target!r} is not callable")
        if not options:
            return obj
        try:
            backend = obj(**options)
        except Exception as exc:
            raise BackendError(f"backend {self.spec.id!r}: {target}(**backend_options) raised {type(exc).__name__}: {exc}",
                               hint="with backend_options, the callable is a factory called with them as keyword "
                                    "arguments and must return the torch.compile backend") from None
        if not callable(backend):
            raise BackendError(f"backend {self.spec.id!r}: {target}(**backend_options) returned {type(backend).__name__}, "
                               f"not a torch.compile backend", hint="return a callable (gm, example_inputs) -> callable")
        return backend

    # ------------------------------------------------------------------------------------------ use

    def compiler_backend(self) -> Callable[..., Any] | str | None:
        """What torch.compile receives as `backend=` (None when eager)."""
        self.prepare()
        return self._compiler

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`torch.compile(fn, backend=…, **compile_options)`; `fn` itself when eager."""
        self.prepare()
        if self._compiler is None:
            return fn
        return _torch().compile(fn, backend=self._compiler, **dict(self.spec.compile_options))

    def compile_recorded(self, fn: Callable[..., Any]) -> tuple[Callable[..., Any], "CompileRecord | None"]:
        """`compile(fn)` with the backend wrapped in a `CompileRecord` (graphs it was given, nodes, executions);
        the record is None when eager. The wrapper keeps the backend's name, so error texts read the same."""
        self.prepare()
        if self._compiler is None:
            return fn, None
        torch = _torch()
        options = dict(self.spec.compile_options)
        inner: Any = self._compiler
        if inner == "inductor":  # torch.compile special-cases the name: build what it would build
            inner = torch._TorchCompileInductorWrapper(options.pop("mode", None), options.pop("options", None),
                                                       options.get("dynamic"))
        name = self._compiler if isinstance(self._compiler, str) else getattr(self._compiler, "__name__", "backend")
        record = CompileRecord(inner, str(name))
        return torch.compile(fn, backend=record, **options), record

    def to_device(self, obj: Any) -> Any:
        """Move a module, tensor or nested dict/list/tuple of them to the backend's device."""
        from .tree import map_tensors

        self.prepare()
        return map_tensors(lambda x: x.to(self.device), obj, modules=True)

    def versions(self) -> dict[str, str]:
        """Versions for the env stamp: torch, the compile backend and every plugin module."""
        torch = _torch()
        out: dict[str, str] = {"torch": torch.__version__, "backend": self.spec.compile or f"eager:{self.device}"}
        if _is_sim(self.spec.compile) or self.device.startswith("simdev"):
            out["deepview-ci"] = tool_version()
        if self.spec.compile == "inductor":
            try:
                import triton  # type: ignore[import-not-found]  # deferred: optional, heavy

                out["triton"] = str(triton.__version__)
            except Exception:
                pass
        if self.device.startswith("cuda") and torch.version.cuda:
            out["cuda"] = str(torch.version.cuda)
        mods = dict(self._imported)
        for name, mod in mods.items():
            v = _module_version(name, mod)
            if v:
                out[name] = v
        return out


def _module_version(name: str, mod: Any) -> str | None:
    v = getattr(mod, "__version__", None)
    if isinstance(v, str):
        return v
    top = name.split(".")[0]
    for dist in metadata.packages_distributions().get(top, []) or [top]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _sim_registry() -> Mapping[str, Any]:
    from ..sim import SIM_BACKENDS  # deferred: ci_runner.sim imports torch; loading a matrix must not

    return SIM_BACKENDS


def _is_sim(name: str | None) -> bool:
    return name is not None and name in _sim_registry()


def resolve_backend(spec: BackendSpec) -> Backend:
    """A prepared `Backend` for `spec` (env applied, plugins imported, device set up, compiler resolved).

    Raises `BackendError` naming what is available when the compiler, device or plugin is unknown.
    """
    if spec.compile is not None and spec.compile in _sim_registry() and _sim_registry()[spec.compile].factory is None:
        raise BackendError(f"backend {spec.id!r}: {spec.compile!r} is a device, not a compiler",
                           hint=f"write `device: {spec.compile}` (and no `compile:`) for an eager device backend")
    backend = Backend(spec)
    backend.prepare()
    return backend


def available_backends() -> list[dict[str, str]]:
    """Every backend this installation can run: torch.compile names, the sims, devices (for `deepview-ci env`)."""
    out: list[dict[str, str]] = []
    for name in registered_compile_backends():
        out.append({"name": name, "kind": "torch.compile",
                    "description": _KNOWN_DESCRIPTIONS.get(name, "registered torch.compile backend")})
    for name, info in _sim_registry().items():
        unusable = f" (unavailable here: {skip_reason('simdev')})" if name == "simdev" and not available("simdev") else ""
        out.append({"name": name, "kind": "sim" if info.factory is not None else "sim device",
                    "description": f"self-test: {info.reproduces}{unusable}"})
    for dev in available_devices():
        if dev == "simdev":
            continue  # listed with the sims
        out.append({"name": dev, "kind": "device", "description": _device_description(dev)})
    return out


def _device_description(dev: str) -> str:
    torch = _torch()
    if dev == "cpu":
        return f"CPU, {torch.get_num_threads()} threads"
    if dev == "cuda":
        try:
            return ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        except Exception:
            return "CUDA"
    return "PrivateUse1 device registered by a plugin" if dev == torch._C._get_privateuse1_backend_name() else dev


# --------------------------------------------------------------------------- did the backend run?
# A `pass` means something only when the backend compiled and executed the code. Three generic sources of
# evidence, and one per backend that falls back silently:
# * `CompileRecord`: a wrapper around the torch.compile backend; the graphs it was given (node counts) and how
#   often each compiled callable ran;
# * `DynamoCounters`: `torch._dynamo.utils.counters` diffed around a call: frames total vs ok (an error Dynamo
#   suppressed, a skipped frame), graph breaks (code between graphs runs in eager), aot_autograd not_ok;
# * `FallbackWatch`: the backend's own fallbacks (OpenVINO: see `OPENVINO_FACTS`).

class CompileRecord:
    """A torch.compile backend that forwards to `inner` and records each graph it is given and its executions."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.__name__ = name  # torch.compile's errors say backend='<name>'
        self.graphs: list[dict[str, Any]] = []  # {"nodes": call nodes, "calls": executions}

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._dynamo.backends.registry import lookup_backend  # deferred: imports torch

        rec = {"nodes": sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")),
               "calls": 0}
        self.graphs.append(rec)
        compiled = lookup_backend(self.inner)(gm, example_inputs, **kwargs)
        if not callable(compiled):
            return compiled

        def run(*args: Any) -> Any:
            out = compiled(*args)
            rec["calls"] += 1
            return out

        if getattr(compiled, "_boxed_call", False):  # aot_autograd's calling convention: Dynamo passes a list
            run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def summary(self) -> dict[str, int]:
        return {"graphs": len(self.graphs), "nodes": sum(g["nodes"] for g in self.graphs),
                "graphs_executed": sum(1 for g in self.graphs if g["calls"] > 0)}

    def not_ran(self) -> str | None:
        """Why the backend did not run the code (None when every graph it was given executed)."""
        if not self.graphs:
            return "the backend was given no graph (Dynamo ran everything in eager)"
        idle = sum(1 for g in self.graphs if g["calls"] == 0)
        if idle:
            return f"{idle} of {len(self.graphs)} compiled graph(s) never executed"
        return None


class DynamoCounters:
    """`with DynamoCounters() as c:` … `c.fallback()`: what Dynamo ran in eager instead of the backend."""

    def __enter__(self) -> "DynamoCounters":
        self.before = self._snapshot()
        self.after = self.before
        return self

    def __exit__(self, *exc: object) -> None:
        self.after = self._snapshot()

    @staticmethod
    def _snapshot() -> dict[str, dict[str, int]]:
        from torch._dynamo.utils import counters  # deferred: imports torch

        return {k: {kk: int(vv) for kk, vv in v.items()} for k, v in counters.items()}

    def delta(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for cat, now in self.after.items():
            old = self.before.get(cat, {})
            d = {k: v - old.get(k, 0) for k, v in now.items() if v - old.get(k, 0)}
            if d:
                out[cat] = d
        return out

    def fallback(self, expected_break: str = "") -> str | None:
        """Why code ran in eager instead of the backend (None: it did not); graph breaks whose reason contains
        `expected_break` (when given) are intended and not counted."""
        d = self.delta()
        frames = d.get("frames", {})
        if frames.get("total", 0) > frames.get("ok", 0):
            return (f"Dynamo fell back to eager for {frames['total'] - frames.get('ok', 0)} frame(s) "
                    f"(an error it suppressed, or a skipped frame)")
        breaks = {k: v for k, v in d.get("graph_break", {}).items() if not (expected_break and expected_break in k)}
        if breaks:
            return f"{sum(breaks.values())} graph break(s): {', '.join(list(breaks)[:2])}"[:300]
        if d.get("aot_autograd", {}).get("not_ok"):
            return "aot_autograd failed on a graph (it ran in eager)"
        return None


def ran_facts(record: CompileRecord | None, counters: DynamoCounters, watch: FallbackWatch) -> dict[str, Any]:
    """What the backend compiled and executed for one probe (the row's `ran`; `backend_ran` sums these)."""
    out: dict[str, Any] = dict(record.summary()) if record is not None else {}
    d = counters.delta()
    if d.get("graph_break"):
        out["graph_breaks"] = sum(d["graph_break"].values())
    frames = d.get("frames", {})
    if frames.get("total", 0) > frames.get("ok", 0):
        out["frames_in_eager"] = frames["total"] - frames.get("ok", 0)
    out.update(watch.facts())
    return out


def not_ran_reason(record: CompileRecord | None, counters: DynamoCounters, watch: FallbackWatch, *,
                   expected_break: str = "") -> str | None:
    """Why a compile that raised nothing did not run on the backend (None: it did): no graph given or executed,
    Dynamo fell back to eager or broke the graph (except the breaks `expected_break` names), the backend's own
    silent fallback."""
    return ((record.not_ran() if record is not None else None) or counters.fallback(expected_break)
            or watch.reason())


def backend_ran(rows: list[Mapping[str, Any]], *, compiles: bool) -> dict[str, Any]:
    """What the backend compiled and executed over all probes of a mode (`ModeResult.data["backend_ran"]`): rows
    with `status` and `ran` (`CompileRecord.summary` plus `DynamoCounters` / `FallbackWatch` facts); ops probes or
    layers module probes."""
    if not compiles:
        return {"eager": True, "probes": len(rows)}
    total: dict[str, Any] = {"probes_compiled": 0, "probes_executed": 0, "graphs": 0, "nodes": 0,
                             "graphs_executed": 0, "inconclusive": 0}
    for r in rows:
        ran = r.get("ran") or {}
        total["probes_compiled"] += 1 if ran.get("graphs") else 0
        total["probes_executed"] += 1 if ran.get("graphs_executed") else 0
        for key in ("graphs", "nodes", "graphs_executed", "graph_breaks", "frames_in_eager", "openvino_partitions",
                    "openvino_executions", "perm_fallback"):
            if ran.get(key):
                total[key] = total.get(key, 0) + int(ran[key])
        total["inconclusive"] += 1 if r["status"] == "inconclusive" else 0
        if ran.get("eager_ops"):  # ops the backend's partitioner left to PyTorch eager
            total["eager_ops"] = sorted(set(total.get("eager_ops") or ()) | set(ran["eager_ops"]))
    return total


# OpenVINO's torch.compile backend (`openvino`, from the `openvino` package) falls back silently, logging at DEBUG
# only: (1) any exception in its compiler hands the graph to Inductor ("Failed in OpenVINO execution");
# (2) a failure at run time switches that partition to PyTorch eager for good (`perm_fallback`, "Falling back to
# native PyTorch"); (3) its partitioner leaves unsupported ops, and any single-node partition unless
# `options: {testing: true}`, in eager. Its default (non-aot) path re-traces the graph with make_fx inside
# Dynamo, which breaks Dynamo's guard building (`sources must not be empty for symbol sN`); `aot_autograd: true`
# avoids it. On CPUs with bf16 support it computes in bf16 unless `config: {INFERENCE_PRECISION_HINT: f32}`.
# The recipe that makes its findings mean something (README, "Backend recipes"):
OPENVINO_RECIPE: Mapping[str, Any] = {"options": {"aot_autograd": True, "testing": True,
                                                  "config": {"INFERENCE_PRECISION_HINT": "f32"}}}
_OV = "openvino.frontend.pytorch.torchdynamo"


class FallbackWatch:
    """Backend-specific evidence that a compile ran elsewhere than on the backend; `with FallbackWatch(name):`,
    then `reason()` (None: no fallback seen) and `facts()`. Generic backends have none."""

    def __init__(self, compile_name: str | None) -> None:
        self.name = compile_name
        self.messages: list[str] = []
        self._handler: Any = None
        self._saved: list[tuple[Any, int, bool]] = []
        self._facts: dict[str, Any] = {}

    def __enter__(self) -> "FallbackWatch":
        if self.name != "openvino":
            return self
        try:
            execute = importlib.import_module(f"{_OV}.execute")
        except ImportError:
            return self
        execute.clear_caches()
        watch = self

        class _Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                watch.messages.append(record.getMessage()[:400])

        self._handler = _Keep(logging.DEBUG)
        for name in (f"{_OV}.backend", f"{_OV}.execute"):
            lg = logging.getLogger(name)
            self._saved.append((lg, lg.level, lg.propagate))
            lg.setLevel(logging.DEBUG)
            lg.propagate = False
            lg.addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handler is None:
            return
        for lg, level, propagate in self._saved:
            lg.removeHandler(self._handler)
            lg.setLevel(level)
            lg.propagate = propagate
        execute = importlib.import_module(f"{_OV}.execute")
        mods = [m for gm in execute.partitioned_modules.values() for m in gm.modules()
                if isinstance(m, execute.OpenVINOGraphModule)]
        self._facts = {"openvino_partitions": len(mods), "perm_fallback": sum(bool(m.perm_fallback) for m in mods),
                       "openvino_executions": sum(m.startswith("OpenVINO graph execution successful")
                                                  for m in self.messages)}
        eager = {str(n.target) if hasattr(n.target, "_schema") else getattr(n.target, "__name__", str(n.target))
                 for gm in execute.partitioned_modules.values() for n in gm.graph.nodes if n.op == "call_function"}
        self._facts.update({"eager_ops": sorted(eager - {"getitem"})} if mods and eager - {"getitem"} else {})
        self._handler = None

    def facts(self) -> dict[str, Any]:
        return dict(self._facts)

    def reason(self) -> str | None:
        if self.name != "openvino" or not self._facts:
            return None
        failed = [m for m in self.messages if m.startswith("Failed in OpenVINO execution")]
        if failed:
            return "OpenVINO failed and handed the graph to Inductor: " + failed[0]
        eager = [m for m in self.messages if "Falling back to native PyTorch" in m]
        if self._facts["perm_fallback"] or eager:
            return "OpenVINO's execution failed and the graph ran in PyTorch eager: " + (eager or ["(no message)"])[0]
        if self._facts["openvino_partitions"] == 0 or self._facts["openvino_executions"] == 0:
            return ("OpenVINO ran no partition: it leaves unsupported ops and single-node graphs in PyTorch eager "
                    "(compile_options: {options: {testing: true}} makes it compile single nodes)")
        return None


# --------------------------------------------------------------------------- backend facts

def simdev_options(spec: BackendSpec) -> Mapping[str, Any]:
    """simdev's options: all of `backend_options` for an eager simdev backend, `backend_options.simdev` when the
    backend also compiles (the rest then goes to the compiler)."""
    opts = spec.backend_options
    if spec.compile is None:
        return opts
    nested = opts.get("simdev", {})
    return nested if isinstance(nested, Mapping) else {}


@dataclass(frozen=True, kw_only=True)
class BackendRecipe:
    """How a standalone script rebuilds a backend: imports, setup lines, the torch.compile backend expression."""

    kind: str  # eager | sim | plugin | registered (as `Backend.kind`)
    name: str | None  # the matrix's `compile` (None when eager)
    module: str | None  # plugin: the module of `module:callable`
    attr: str | None  # plugin: the callable's (dotted) name in it
    options: Mapping[str, Any]  # backend_options
    simdev_options: Mapping[str, Any] | None  # None unless the device is simdev
    imports: tuple[str, ...]
    setup: tuple[str, ...]  # Python lines run after the imports; they bind BACKEND when compiling
    backend_expr: str | None  # None for eager devices
    device: str
    env: Mapping[str, str]
    compile_options: Mapping[str, Any]
    pythonpath: tuple[str, ...]  # folders the script needs on PYTHONPATH (plugins not installed as packages)


def backend_recipe(spec: BackendSpec) -> BackendRecipe:
    """The recipe for `spec`; the same resolution order as `Backend.prepare` (imports, simdev, compiler)."""
    imports: list[str] = list(spec.imports)
    setup: list[str] = []
    expr: str | None = None
    options = dict(spec.backend_options)
    kind, module, attr = "eager", None, None
    sim_opts: dict[str, Any] | None = None
    if spec.device.split(":")[0] == "simdev":
        sim_opts = dict(simdev_options(spec))
        imports.append("ci_runner.sim.simdev")
        setup.append(f"ci_runner.sim.simdev.register_from_options({sim_opts!r})  # registers the simdev device")
    if spec.compile is not None:
        if _is_sim(spec.compile):
            kind = "sim"
            imports.append("ci_runner.sim")
            setup.append(f"BACKEND = ci_runner.sim.make_backend({spec.compile!r}, {options!r})")
        elif ":" in spec.compile:
            kind = "plugin"
            module, _, attr = spec.compile.partition(":")
            imports.append(module)
            target = f"{module}.{attr}"
            setup.append(f"BACKEND = {target}(**{options!r})" if options else f"BACKEND = {target}")
        else:
            kind = "registered"
            setup.append(f"BACKEND = {spec.compile!r}")
        expr = "BACKEND"
    imports = list(dict.fromkeys(imports))
    return BackendRecipe(kind=kind, name=spec.compile, module=module, attr=attr, options=options,
                         simdev_options=sim_opts, imports=tuple(imports), setup=tuple(setup), backend_expr=expr,
                         device=spec.device, env=dict(spec.env), compile_options=dict(spec.compile_options),
                         pythonpath=tuple(plugin_pythonpath(imports)))


def unsupported_op_from_error(text: str) -> str | None:
    """The overload (`aten.rsqrt.out`) an error text says is unsupported (the sims' `unsupported operator X` or
    PyTorch's `Could not run 'aten::X'` format), else None."""
    m = UNSUPPORTED_RE.search(text)
    if m:
        return m.group("op")
    m = COULD_NOT_RUN_RE.search(text)
    if m:
        return _overload(m.group("op"))
    return None


def named_op_from_error(text: str) -> tuple[str | None, str | None]:
    """(op overload, the phrase naming it) from a backend's error text, also from any ATen name in it;
    (None, None) when none is named."""
    for pattern in (UNSUPPORTED_RE, COULD_NOT_RUN_RE, ATEN_NAME_RE):
        m = pattern.search(text)
        if m:
            op = m.group("op")
            return (op if pattern is UNSUPPORTED_RE else _overload(op)), m.group(0)
    return None, None


def _overload(name: str) -> str:
    name = name.replace("::", ".")
    return name if name.count(".") >= 2 else f"{name}.default"


def plugin_pythonpath(modules: Iterable[str]) -> list[str]:
    """Folders to put on PYTHONPATH so `modules` import in a fresh interpreter (none for installed ones).

    Repro scripts and probe children run in clean processes; a plugin that lives in the user's checkout
    (not installed) needs its root folder passed along."""
    installed = {str(Path(p).resolve()) for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")) if p}
    roots: list[str] = []
    for mod in modules:
        try:
            spec = importlib.util.find_spec(mod.split(".")[0])
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        locations = list(spec.submodule_search_locations or []) or ([spec.origin] if spec.origin else [])
        for loc in locations:
            if loc in (None, "built-in", "frozen"):
                continue
            root = str(Path(loc).resolve().parent)  # a package folder's parent, or a module file's folder
            if root not in installed and root not in roots:
                roots.append(root)
            break
    return roots
