"""Meters: the live and peak bytes of one device, read the same way whether predicted or measured.

- `DispatchMeter`: a `TorchDispatchMode` that counts every distinct storage an operator returns, from the first
  time it is seen until it dies (a weakref finalizer), with the model's parameters and buffers counted from the
  start. On `meta` tensors it is the prediction (no weights, no device); on CPU it measures what ATen allocates
  through the dispatcher (eager, and backends whose compiled code runs ATen ops, e.g. `aot_eager` and the sims; not
  the buffers a C++ kernel allocates itself, as inductor's do).
- `SimdevMeter`: the self-test device's allocator (`ci_runner/sim/simalloc.py`).
- `CudaMeter`: `torch.cuda`'s (or `torch.xpu`'s) allocator statistics; `AcceleratorMeter`: `torch.accelerator`'s, for
  another accelerator whose allocator reports them. Code paths only: no GPU here.

Each meter knows the storage key of a tensor (`key`) and what it holds now (`live`), so an out-of-memory moment
can be split by category (parameters, buffers, KV cache, the rest).
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["Meter", "DispatchMeter", "SimdevMeter", "CudaMeter", "AcceleratorMeter", "NullMeter", "device_meter"]


class Meter:
    """Live/peak bytes of one device; `activate()` is the context the run goes under (a no-op by default)."""

    name = "meter"

    def current(self) -> int:
        raise NotImplementedError

    def peak(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def key(self, t: torch.Tensor) -> int | None:
        """The storage key of `t` as `live()` names it, or None when this meter cannot tell."""
        return None

    def live(self) -> dict[int, int]:
        """Storage key -> bytes held now (empty when the meter only has totals)."""
        return {}

    def activate(self) -> Any:
        import contextlib  # deferred: only the default needs it

        return contextlib.nullcontext()


SHADOW = "deepview_shadow"  # the attribute holding a meta tensor's CPU value (see `DispatchMeter`)
_SCALAR_OPS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"})


def _to_cpu_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: (torch.device("cpu") if k == "device" and v is not None else v) for k, v in kwargs.items()}


def _grouped_mm_any_dtype(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """`_grouped_mm` on meta: its meta kernel takes bfloat16 only (CUDA's rule), the CPU kernel any float. The shapes
    are the same in every dtype: computed in bfloat16, the result takes the inputs' dtype (one storage, counted)."""
    dtype = args[0].dtype
    cast = tree_map(lambda x: x.to(torch.bfloat16) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                    (args, kwargs))
    out = func(*cast[0], **cast[1])
    return out.to(dtype) if out.dtype != dtype else out


# ops whose meta kernel is stricter than the devices': run on meta another way, with the same output shape
_META_FIXES: dict[str, Callable[..., Any]] = {"aten::_grouped_mm": _grouped_mm_any_dtype}


class DispatchMeter(TorchDispatchMode, Meter):
    """Counts storages returned by operators (see the module text); `seed` counts tensors made before the run.

    On `meta` a model cannot answer a data-dependent question (`.item()`, `bool(mask.all())`, which transformers asks
    of the attention mask). With `shadow_numel` > 0 every small meta tensor computed from the workload's inputs alone
    (token ids, masks, positions: never weights) also gets its CPU value, and such a question is answered from it.
    A question about a tensor without a value raises a clear error."""

    name = "dispatch"

    def __init__(self, *, shadow_numel: int = 0) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self._cur = 0
        self._peak = 0
        self.shadow_numel = shadow_numel

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """True: Dynamo still runs compiled code while this mode is active (it would otherwise fall back to eager
        and the compiled figures would be eager's); a compile under the meter is avoided by a warm-up run."""
        return True

    def _shadow_of(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type == "meta":
            return getattr(x, SHADOW, None)
        return x

    def _shadowed(self, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
        """Attach CPU values to `out` when every tensor input has one and the result is small."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or any(t.device.type != "meta" or t.numel() > self.shadow_numel for t in outs):
            return
        flat = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if any(self._shadow_of(x) is None for x in flat):
            return
        s_args, s_kwargs = tree_map(self._shadow_of, (args, kwargs))
        try:
            values = func(*s_args, **_to_cpu_kwargs(s_kwargs))
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return  # no value: a later question about it raises the meta error
        for t, v in zip(outs, [v for v in tree_leaves(values) if isinstance(v, torch.Tensor)]):
            setattr(t, SHADOW, v)

    def _answer(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        metas = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.device.type == "meta"]
        if any(self._shadow_of(x) is None for x in metas):
            raise RuntimeError(f"prediction on meta: {func} needs a value the meta model does not have (a value "
                               "computed from the weights)")
        s_args, s_kwargs = tree_map(self._shadow_of, (args, kwargs))
        return func(*s_args, **s_kwargs)

    def _release(self, k: int) -> None:
        n = self._live.pop(k, None)
        if n is not None:
            self._cur -= n

    def add(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass, a sparse layout)
            return
        k = id(st)
        if k in self._live:
            return
        n = int(st.nbytes())
        self._live[k] = n
        self._cur += n
        self._peak = max(self._peak, self._cur)
        weakref.finalize(st, self._release, k)

    def seed(self, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            self.add(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.shadow_numel and func._schema.name in _SCALAR_OPS and \
                any(isinstance(x, torch.Tensor) and x.device.type == "meta" for x in tree_leaves(args)):
            return self._answer(func, args, kwargs)
        fix = _META_FIXES.get(func._schema.name)
        on_meta = fix is not None and any(isinstance(x, torch.Tensor) and x.device.type == "meta"
                                          for x in tree_leaves(args))
        out = fix(func, args, kwargs) if on_meta else func(*args, **kwargs)  # type: ignore[misc]
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.add(t)
        if self.shadow_numel:
            self._shadowed(func, args, kwargs, out)
        return out

    def current(self) -> int:
        return self._cur

    def peak(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        self._peak = self._cur

    def key(self, t: torch.Tensor) -> int | None:
        return id(t.untyped_storage())

    def live(self) -> dict[int, int]:
        return dict(self._live)

    def activate(self) -> Any:
        return self


class SimdevMeter(Meter):
    """The simdev allocator's statistics."""

    name = "simdev allocator"

    def __init__(self) -> None:
        from ...sim import simalloc  # deferred: the sim package imports torch's device registration

        self._a = simalloc

    def current(self) -> int:
        return self._a.memory_allocated()

    def peak(self) -> int:
        return self._a.max_memory_allocated()

    def reset_peak(self) -> None:
        self._a.reset_peak_memory_stats()

    def key(self, t: torch.Tensor) -> int | None:
        raw = getattr(t, "_raw", None)
        return self._a.storage_key(raw) if isinstance(raw, torch.Tensor) else None

    def live(self) -> dict[int, int]:
        return self._a.live_storages()


class CudaMeter(Meter):
    """`torch.cuda` / `torch.xpu` allocator statistics of one device (no per-storage view: `live` is empty)."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self._m = getattr(torch, self.device.type)
        self.name = f"{self.device.type} allocator"

    def current(self) -> int:
        return int(self._m.memory_allocated(self.device))

    def peak(self) -> int:
        return int(self._m.max_memory_allocated(self.device))

    def reset_peak(self) -> None:
        self._m.reset_peak_memory_stats(self.device)


class AcceleratorMeter(Meter):
    """`torch.accelerator`'s allocator statistics (the current accelerator: a PrivateUse1 plugin's device whose
    allocator reports them). Code path only: no such device here."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.index = self.device.index if self.device.index is not None else torch.accelerator.current_device_index()
        self.name = f"torch.accelerator ({self.device.type})"

    def current(self) -> int:
        return int(torch.accelerator.memory_allocated(self.index))

    def peak(self) -> int:
        return int(torch.accelerator.max_memory_allocated(self.index))

    def reset_peak(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.index)


def _accelerator_meter(device: str) -> Meter | None:
    acc = getattr(torch, "accelerator", None)
    if acc is None or not hasattr(acc, "max_memory_allocated") or not acc.is_available():
        return None
    current = acc.current_accelerator()
    if current is None or current.type != device.split(":")[0]:
        return None
    meter = AcceleratorMeter(device)
    try:
        meter.current()
    except (RuntimeError, NotImplementedError, TypeError):  # a device whose allocator keeps no statistics
        return None
    return meter


def device_meter(device: str) -> Meter | None:
    """The allocator meter of `device`, or None when it exposes no statistics (CPU, a plugin without them)."""
    kind = device.split(":")[0]
    if kind == "simdev":
        return SimdevMeter()
    if kind == "cpu":
        return None
    if kind in ("cuda", "xpu"):
        mod = getattr(torch, kind, None)
        if mod is not None and mod.is_available() and hasattr(mod, "max_memory_allocated"):
            return CudaMeter(device)
    return _accelerator_meter(device)


class NullMeter(Meter):
    """Reads nothing: a run whose figures are not wanted (a compiled model's warm-up)."""

    name = "none"

    def current(self) -> int:
        return 0

    def peak(self) -> int:
        return 0

    def reset_peak(self) -> None:
        return None


# --------------------------------------------------------------------------- what the host has left

MEM_AVAILABLE_ENV = "DEEPVIEW_CI_TEST_MEM_AVAILABLE_MB"  # tests only: the MiB `available_bytes` reports instead


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host memory a new measurement can use: `MemAvailable` of /proc/meminfo (None where it cannot be read). For
    tests only, `DEEPVIEW_CI_TEST_MEM_AVAILABLE_MB` replaces it."""
    fake = os.environ.get(MEM_AVAILABLE_ENV)
    if fake:
        return int(float(fake) * 2**20)
    try:
        with open(meminfo, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def host_memory_device(device: str) -> bool:
    """Whether `device`'s tensors live in host memory (the CPU, simdev's wrapped CPU tensors)."""
    return device.split(":")[0] in ("cpu", "simdev")
