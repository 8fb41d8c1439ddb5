"""A precision policy on the CPU: its emulation (the reference a policy-following backend is held to) and its
detection (what a backend computes each op class in). The policy itself is `workloads/precision.py`.

**Emulation.** `emulate(policy)` is a `TorchDispatchMode`: every ATen op of a class the policy runs below float32
gets its floating inputs rounded to that dtype (fp8 with a per-tensor scale, amax → the format's max) and is then
computed in the tensors' own dtype, so matmuls keep float32 accumulation; a float32 class is left alone. For the
classes that are not matmul-like (`softmax`, `norm`, `elementwise`, `reduction`) a low dtype also rounds the
output, as a kernel that computes in that dtype would; `kv_cache` rounds what is written into a cache
(`index_copy_`, `index_put_`: StaticCache's writes); `accumulate` below float32 rounds the matmul's output (an
approximation: the accumulator's own rounding is finer-grained than that). A policy with a low `storage` (a model
loaded in bfloat16 or float16) also rounds every op's result to that dtype, as eager runs such a model: each
kernel computes wider inside and stores its result in the model's dtype.

**Detection.** `measure(backend)` compiles one small function on the backend (a matmul, a softmax, a layer norm
and an exp side by side), runs it on inputs whose low mantissa bits tell the formats apart, and names for each
class the dtype whose emulation lands closest to the backend's result (`float32` when it matches float32 to a few
ulps). `detect_child` runs it in an isolated child (a backend may crash or hang), `resolve_policy` once per backend
per run (cached under the run folder, with a lock).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterator, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..backends import resolve_backend
from ..config import BackendSpec, spec_from_json, spec_to_json
from ..fsutil import atomic_write_json, locked
from .precision import DTYPES, FLOAT32_CLASSES, PrecisionPolicy, detected_policy
from ..procs.isolate import run_isolated
from .rounding import MATMUL_LIKE, OPS_BY_CLASS, TORCH_DTYPES, op_class, round_to, rounded_inputs, rounded_outputs

class Emulate(TorchDispatchMode):
    """The policy's rounding on CPU eager (see the module docstring)."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        super().__init__()
        self.policy = policy
        self.rounded: dict[str, int] = {}  # op class -> calls rounded (what the emulation touched)
        self.active = True

    @contextlib.contextmanager
    def switched(self, active: bool) -> Iterator[None]:
        """Rounding on or off for the block: the reference's own reads and the metrics' arithmetic around an
        emulated forward (a dump read under the mode would be rounded too) run with it off."""
        before, self.active = self.active, active
        try:
            yield
        finally:
            self.active = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.active:
            return func(*args, **kwargs)
        cls = op_class(func)
        dt = self.policy.dtype(cls) if cls else "float32"
        if cls is None or dt == "float32":
            return self._stored(func(*args, **kwargs), func)
        self.rounded[cls] = self.rounded.get(cls, 0) + 1
        args, kwargs = rounded_inputs(cls, dt, func.__name__, args, kwargs)
        out = rounded_outputs(cls, dt, func(*args, **kwargs))
        acc = self.policy.dtype("accumulate")
        if cls in MATMUL_LIKE and acc != "float32":
            out = tree_map(lambda x: round_to(x, acc) if isinstance(x, torch.Tensor) else x, out)
        return self._stored(out, func)

    def _stored(self, out: Any, func: Any) -> Any:
        """`out` as a model in the storage dtype keeps it: every op's result rounded, an in-place op's target
        rounded where it lies; a view aliases a tensor already rounded. Inputs are never touched (rounding one
        would copy it, and an in-place op or a view of it would then miss the original): what enters the model
        (its inputs, a stubbed call's output) is rounded by the caller, and the weights by `load_model`. float64
        tensors (the metrics' arithmetic) are never rounded."""
        store = self.policy.storage
        if store == "float32" or func.is_view:
            return out
        self.rounded["storage"] = self.rounded.get("storage", 0) + 1
        if _in_place(func):
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype.itemsize == 4:
                    t.copy_(round_to(t, store))
            return out
        return tree_map(lambda x: round_to(x, store) if isinstance(x, torch.Tensor) else x, out)


def _in_place(func: Any) -> bool:
    """An ATen op that writes into its first argument (`add_`, `index_copy_`) or an `out=` overload."""
    name = func.__name__.split(".")
    return name[0].endswith("_") or (len(name) > 1 and name[1].startswith("out"))


@contextlib.contextmanager
def emulate(policy: PrecisionPolicy) -> Iterator[Emulate]:
    """Run the block's eager ops under the policy (a no-op for an all-float32 policy)."""
    mode = Emulate(policy)
    if policy.is_float32:
        yield mode
        return
    with mode:
        yield mode


# ----------------------------------------------------------------------------------------------------- detection

DETECTED_CLASSES = ("matmul", "softmax", "norm", "elementwise")


def _probe_fn(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, z: torch.Tensor, g: torch.Tensor,
              b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.mm(x, w), torch.softmax(y, dim=-1), torch.nn.functional.layer_norm(z, (z.shape[-1],), g, b),
            torch.exp(y))


def _probe_inputs() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(32, 256, generator=gen)
    w = torch.randn(256, 32, generator=gen) / 16
    y = torch.randn(16, 64, generator=gen) * 2
    z = torch.randn(16, 64, generator=gen) * 3 + 1
    g = 1 + torch.randn(64, generator=gen) / 4
    b = torch.randn(64, generator=gen) / 4
    return x, w, y, z, g, b


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.detach().to("cpu", torch.float64), b.detach().to("cpu", torch.float64)
    den = float(b64.norm()) or 1.0
    return float((a64 - b64).norm()) / den


def _candidate(cls: str, dtype: str, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """CPU eager of the probe's `cls` output with that class computed in `dtype` (the convention's emulation)."""
    classes = {c: "float32" for c in DETECTED_CLASSES}
    classes[cls] = dtype
    policy = PrecisionPolicy(spelled="table", classes=MappingProxyType(classes))
    with emulate(policy):
        out = _probe_fn(*inputs)
    return out[DETECTED_CLASSES.index(cls)]


def classify(outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Per class: the dtype whose emulation is closest to the backend's output, with every candidate's distance.
    Float32 wins when the output is within 64 ulps (rel 4e-6) of CPU float32: a different summation order is
    not a lower precision."""
    ref = _probe_fn(*inputs)
    found: dict[str, Any] = {}
    for i, cls in enumerate(DETECTED_CLASSES):
        got = outputs[i]
        if not bool(torch.isfinite(got.detach().to("cpu")).all()):
            found[cls] = {"dtype": "unknown", "why": "non-finite output", "rel_to_float32": None}
            continue
        rel32 = _rel(got, ref[i])
        candidates = {d: _candidate(cls, d, inputs) for d in DTYPES if d != "float32"}
        dists = {d: _rel(got, c) for d, c in candidates.items()}
        if rel32 <= 4e-6:
            pick = "float32"
        else:
            pick = min(dists, key=lambda d: dists[d])
            # an error that no low dtype explains (far from every candidate) is not a precision
            if dists[pick] > 1.5 * _rel(candidates[pick], ref[i]):
                pick = "unknown"
        found[cls] = {"dtype": pick, "rel_to_float32": rel32, "distance": {k: float(f"{v:.3g}") for k, v in dists.items()}}
    return found


def measure(backend: Any) -> dict[str, Any]:
    """Compile and run the probe function on `backend` (its device), classify each class (`classify`)."""
    inputs = _probe_inputs()
    fn = backend.compile(_probe_fn)
    outs = fn(*[backend.to_device(t) for t in inputs])
    return {"classes": classify(tuple(o.to("cpu") for o in outs), inputs)}


def detect_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Child entry: the measurement of the backend in `payload["spec"]`."""
    backend = resolve_backend(spec_from_json(BackendSpec, payload["spec"]))
    return measure(backend)


CACHE_ENV = "DEEPVIEW_PRECISION_CACHE"


def cache_folder() -> Path:
    """Where measurements are kept across runs: `$DEEPVIEW_PRECISION_CACHE`, else
    `$XDG_CACHE_HOME/deepview-ci/precision` (`~/.cache/...`). A measurement is keyed by the backend's spec and the
    versions of torch and of the backend's packages, so a new compiler release is measured again."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "deepview-ci" / "precision"


def _dist_versions(spec: BackendSpec) -> dict[str, str]:
    """Versions of the distributions that provide the backend's compiler and plugins (what a new release changes)."""
    from importlib import metadata

    names = {str(spec.compile or "").split(":")[0].split(".")[0], *(m.split(".")[0] for m in spec.imports)}
    names |= {"openvino"} if spec.compile == "openvino" else set()
    names |= {"iree-turbine", "iree-base-compiler"} if str(spec.compile).startswith("turbine") else set()
    out: dict[str, str] = {}
    for name in sorted(n for n in names if n):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _detect_key(spec: BackendSpec) -> str:
    data = {k: v for k, v in spec_to_json(spec).items()
            if k not in ("id", "runs_on", "setup", "artifacts", "container", "source", "precision")}
    return hashlib.sha256(json.dumps([data, torch.__version__, _dist_versions(spec), METHOD_VERSION], sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]


METHOD_VERSION = 1  # bump when the probe or its classification changes: cached measurements are then re-made


def resolve_policy(spec: BackendSpec, folder: Path | None = None, *,
                   timeout: float = 180.0) -> tuple[PrecisionPolicy, dict[str, Any]]:
    """The cell's policy and the `data.precision` record: the declared policy as it is, or for `auto` the one
    the probes measured (once per backend configuration, kept in `folder`, default `cache_folder()`). A
    measurement that cannot finish (the backend fails or hangs on the probe) leaves float32, saying why."""
    declared = spec.precision
    if not declared.auto:
        return declared, {"declared": declared.spelled, "policy": declared.label(), "classes": dict(declared.classes)}
    folder = folder or cache_folder()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', str(spec.compile or spec.device))[:40]}-{_detect_key(spec)}.json"
    with locked(path.with_name(path.name + ".lock")):
        measured: dict[str, Any] | None = None
        if path.exists():
            try:
                measured = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                measured = None
        if measured is None:
            res = run_isolated("ci_runner.workloads.emulate:detect_child", {"spec": spec_to_json(spec)}, timeout=timeout)
            measured = res.value if res.ok and isinstance(res.value, dict) else \
                {"classes": {}, "error": f"the precision probe {res.describe()}"[:500]}
            if res.status != "timeout":  # a busy machine's timeout is not the backend's answer: tried again
                atomic_write_json(path, measured)
    per_class = {c: v.get("dtype", "unknown") for c, v in (measured.get("classes") or {}).items()}
    policy = detected_policy("auto", per_class)
    record: dict[str, Any] = {"declared": "auto", "policy": policy.label(), "classes": dict(policy.classes),
                              "detected": measured.get("classes") or {}}
    if measured.get("error"):
        record["note"] = f"{measured['error']}: float32 assumed"
    off = [f"{c} measured in {d}" for c, d in per_class.items() if c in FLOAT32_CLASSES and d not in ("float32", "unknown")]
    if off:
        record["outside_convention"] = off
        record["note"] = ("; ".join(off) + ": the convention keeps these classes in float32, so the modes judge "
                          "them in float32 (a finding, not a policy)")
    return policy, record


__all__ = ["DETECTED_CLASSES", "Emulate", "OPS_BY_CLASS", "TORCH_DTYPES", "classify", "detect_child", "emulate",
           "measure", "op_class", "resolve_policy", "round_to"]
