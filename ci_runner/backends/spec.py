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

That order is written once, in `resolution(spec)`: `Backend.prepare` carries it out in this process and
`backend_recipe` writes it out for a standalone script (a repro), so the two cannot drift apart.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ..config import BackendSpec
from ..engine.envinfo import tool_version
from ..models.torchcompat import available, skip_reason
from ..errors import BackendError
from ..quoting import dotted
from .ran import CompileRecord, CompileWatch

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
        self.resolution = resolution(spec)
        self.kind: str = self.resolution.kind
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
        r = self.resolution  # its steps, in its order
        for key, value in r.env.items():
            os.environ[key] = value
        for name in r.imports:
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
        if self.resolution.simdev is not None:
            from ..sim import simdev  # deferred: imports torch

            try:
                simdev.register_from_options(self.resolution.simdev)
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
        r = self.resolution
        name = self.spec.compile
        if name is None:
            return None
        bad = sorted(set(self.spec.compile_options) - _COMPILE_KEYS)
        if bad:
            raise BackendError(f"backend {self.spec.id!r}: unknown compile_options key {bad[0]!r}",
                               hint=_choices(bad[0], sorted(_COMPILE_KEYS)) + " (torch.compile's arguments)")
        options = dict(r.options)
        if r.kind == "sim":
            from .. import sim  # deferred: imports torch

            try:
                return sim.make_backend(name, options)
            except (ValueError, TypeError) as exc:
                raise BackendError(f"backend {self.spec.id!r}: {exc}",
                                   hint="see the sim backends' options in ci_runner/sim/__init__.py (docs/backends.md)") from None
        if r.kind == "plugin":
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
        """`torch.compile(fn, backend=…, **compile_options)`; `fn` itself when eager. Through a `CompileRecord`, as
        `compile_recorded`: every graph the backend compiles is counted (`watch/compiles.py`). Unwatched: a run
        whose result says the backend ran it compiles with `compile_watched`."""
        return self.compile_recorded(fn)[0]

    def compile_watched(self, fn: Callable[..., Any], *, dynamic: bool | None = None, keep_modules: bool = False,
                        join: CompileWatch | None = None) -> tuple[Callable[..., Any], CompileWatch]:
        """`compile_recorded(fn, dynamic=…, keep_modules=…)` and ONE watch of it (`backends.ran.CompileWatch`: the
        record, Dynamo's counters and the backend's own fallback watch, read as one by `watch.not_ran(...)`); use
        `with watch:` around the calls. When eager, `fn` itself and a watch without a record (nothing was given
        to compile). `join`: an earlier compile's watch that this compile's record joins (several compiled
        callables run under one watch, e.g. each layer of a model); it is the watch returned."""
        compiled, record = self.compile_recorded(fn, dynamic=dynamic, keep_modules=keep_modules)
        watch = join if join is not None else CompileWatch(self.spec.compile)
        if record is not None:
            watch.records.append(record)
        return compiled, watch

    def compile_recorded(self, fn: Callable[..., Any], *, dynamic: bool | None = None,
                         keep_modules: bool = False) -> tuple[Callable[..., Any], "CompileRecord | None"]:
        """`compile(fn)` with the backend wrapped in a `CompileRecord` (graphs it was given, nodes, executions);
        the record is None when eager. The wrapper keeps the backend's name, so error texts read the same.
        `dynamic` overrides `compile_options.dynamic`; `keep_modules` keeps each GraphModule given."""
        self.prepare()
        if self._compiler is None:
            return fn, None
        torch = _torch()
        options = dict(self.spec.compile_options)
        if dynamic is not None:
            options["dynamic"] = dynamic
        inner: Any = self._compiler
        if inner == "inductor":  # torch.compile special-cases the name: build what it would build
            inner = torch._TorchCompileInductorWrapper(options.pop("mode", None), options.pop("options", None),
                                                       options.get("dynamic"))
        name = self._compiler if isinstance(self._compiler, str) else getattr(self._compiler, "__name__", "backend")
        record = CompileRecord(inner, str(name))
        record.keep_modules = keep_modules
        return torch.compile(fn, backend=record, **options), record

    def to_device(self, obj: Any) -> Any:
        """Move a module, tensor or nested dict/list/tuple of them to the backend's device."""
        from ..models.tree import map_tensors  # deferred: imports torch

        self.prepare()
        return map_tensors(lambda x: x.to(self.device), obj, modules=True)

    def versions(self) -> dict[str, str]:
        """Versions for the env stamp: torch, the compile backend and every plugin module."""
        torch = _torch()
        out: dict[str, str] = {"torch": torch.__version__, "backend": self.spec.compile or f"eager:{self.device}"}
        if self.resolution.self_test:
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


@dataclass(frozen=True, kw_only=True)
class Resolution:
    """The one resolution order of a backend spec, as data: `Backend.prepare` carries it out, `backend_recipe`
    writes it out for a standalone script. Steps: `env`, `imports`, the device (`simdev` registered with these
    options when not None; otherwise a device torch knows), then the compiler by `kind`."""

    env: Mapping[str, str]
    imports: tuple[str, ...]  # the spec's `import:` list, imported in order
    simdev: Mapping[str, Any] | None  # simdev's options when the device is simdev, else None
    kind: str  # how `compile` resolves: eager (none) | sim | plugin (`module:callable`) | registered (a name)
    module: str | None  # plugin: the module of `module:callable`
    attr: str | None  # plugin: the callable's (dotted) name in it
    options: Mapping[str, Any]  # backend_options (the compiler's, or simdev's when eager on simdev)

    @property
    def self_test(self) -> bool:
        """A self-test backend (a sim compiler or the simdev device): the one answer every mode uses."""
        return self.kind == "sim" or self.simdev is not None


def resolution(spec: BackendSpec) -> Resolution:
    """How `spec` resolves (see the module docstring); imports nothing but `ci_runner.sim` for a sim name."""
    name = spec.compile
    kind, module, attr = "eager", None, None
    if name is not None:
        if name in _sim_registry():
            kind = "sim"
        elif ":" in name:
            kind = "plugin"
            module, _, attr = name.partition(":")
        else:
            kind = "registered"
    on_simdev = spec.device.split(":")[0] == "simdev"
    options = dict(spec.backend_options)
    if on_simdev and name is not None:
        options.pop("simdev", None)  # simdev's own (`simdev_options`), not the compiler's
    return Resolution(env=dict(spec.env), imports=tuple(spec.imports),
                      simdev=dict(simdev_options(spec)) if on_simdev else None, kind=kind, module=module, attr=attr,
                      options=options)


def is_self_test(spec: BackendSpec) -> bool:
    """Does `spec` name a self-test backend (a sim compiler, or eager/compiled on simdev)?"""
    return resolution(spec).self_test


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
    """What a standalone script needs to rebuild a backend (`engine.repro.template_backend` writes it through
    `templates/_repro_backend.py.j2`): its kind and what that kind needs, the modules to import, the device."""

    kind: str  # eager | sim | plugin | registered (as `Backend.kind`)
    name: str | None  # the matrix's `compile` (None when eager)
    module: str | None  # plugin: the module of `module:callable`
    attr: str | None  # plugin: the callable's (dotted) name in it
    options: Mapping[str, Any]  # backend_options
    simdev_options: Mapping[str, Any] | None  # None unless the device is simdev
    imports: tuple[str, ...]
    device: str
    env: Mapping[str, str]
    compile_options: Mapping[str, Any]
    pythonpath: tuple[str, ...]  # folders the script needs on PYTHONPATH (plugins not installed as packages)


def backend_recipe(spec: BackendSpec) -> BackendRecipe:
    """The recipe for `spec`: its `resolution`, with the modules a script imports (the backend's, simdev's, the sims',
    a plugin's own) and the folders they need on PYTHONPATH."""
    r = resolution(spec)
    imports: list[str] = list(r.imports)
    if r.simdev is not None:
        imports.append("ci_runner.sim.simdev")
    if r.kind == "sim":
        imports.append("ci_runner.sim")
    elif r.kind == "plugin":
        imports.append(dotted(r.module))
    imports = list(dict.fromkeys(imports))
    return BackendRecipe(kind=r.kind, name=spec.compile, module=r.module, attr=r.attr, options=dict(r.options),
                         simdev_options=dict(r.simdev) if r.simdev is not None else None, imports=tuple(imports),
                         device=spec.device, env=dict(spec.env), compile_options=dict(spec.compile_options),
                         pythonpath=tuple(plugin_pythonpath(imports)))


def plugin_pythonpath(modules: Iterable[str]) -> list[str]:
    """Folders to put on PYTHONPATH so `modules` import in a fresh interpreter (none for installed ones).

    Repro scripts and probe children run in clean processes; a plugin that lives in the user's checkout
    (not installed) needs its root folder passed along. Not needed: a module in a site folder, one an installed
    finder maps (an editable install: its folder is not on `sys.path`), and deepview-ci itself when it is installed
    (whoever runs a repro has the tool)."""
    installed = {str(Path(p).resolve()) for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")) if p}
    on_path = {str(Path(p or ".").resolve()) for p in sys.path}
    roots: list[str] = []
    for mod in modules:
        if mod.split(".")[0] == "ci_runner" and _tool_installed():
            continue
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
            if root not in installed and root in on_path and root not in roots:
                roots.append(root)
            break
    return roots


def _tool_installed() -> bool:
    try:
        metadata.distribution("deepview-ci")
    except metadata.PackageNotFoundError:
        return False
    return True
