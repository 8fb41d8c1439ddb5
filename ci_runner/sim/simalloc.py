"""`simdev`'s allocator: what the self-test device holds, with a capacity and statistics like a real card's.

Every simdev tensor keeps its data in a CPU tensor; the allocator counts each distinct CPU storage once (views share
it), from the moment a simdev tensor wraps it until the storage dies (a weakref finalizer), so its figures are the
device's live bytes exactly as a caching-free allocator would see them. Statistics follow `torch.cuda`'s names:
`memory_allocated`, `max_memory_allocated`, `reset_peak_memory_stats`, `memory_stats`. With a capacity (the
backend option `capacity_mb`, or `set_capacity`), an allocation that would cross it raises `torch.OutOfMemoryError`
worded like CUDA's: ``simdev out of memory. Tried to allocate 1.50 MiB (device capacity 4.00 MiB; 3.20 MiB
already allocated)``, and nothing is allocated.

Views: simdev copies the data of a non-contiguous view (see `simdev.py`) where a real device makes a view; the
allocator counts such a copy as 0 bytes (the result of an op whose schema returns an alias), so its figures are
those of a device with real views. Everything else simdev holds is counted.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

__all__ = ["admit", "set_capacity", "capacity", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats",
           "memory_stats", "live_storages", "storage_key"]

_lock = threading.RLock()
_live: dict[int, int] = {}  # id of the CPU storage -> its bytes
_stats: dict[str, Any] = {"current": 0, "peak": 0, "capacity": None, "allocations": 0, "ooms": 0}


def storage_key(raw: torch.Tensor) -> int:
    """The allocator's key of a CPU tensor's storage (the storage object's id: one per storage, kept alive by it)."""
    return id(raw.untyped_storage())


def _release(key: int) -> None:
    with _lock:
        n = _live.pop(key, None)
        if n is not None:
            _stats["current"] -= n


def _mib(n: int) -> str:
    """Bytes as CUDA's messages write them, in the largest unit that keeps a whole number in front."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def admit(raw: torch.Tensor, count: bool = True) -> None:
    """Count `raw`'s storage as held by the device (once per storage); `torch.OutOfMemoryError` over the capacity.
    `count=False`: a storage that stands for a view (simdev's copy of a non-contiguous view) is tracked at 0 bytes."""
    storage = raw.untyped_storage()
    key = id(storage)
    with _lock:
        if key in _live:
            return
        n = int(storage.nbytes()) if count else 0
        cap = _stats["capacity"]
        if cap is not None and _stats["current"] + n > cap:
            _stats["ooms"] += 1
            raise torch.OutOfMemoryError(
                f"simdev out of memory. Tried to allocate {_mib(n)} (device capacity {_mib(cap)}; "
                f"{_mib(_stats['current'])} already allocated)")
        _live[key] = n
        _stats["current"] += n
        _stats["allocations"] += 1
        _stats["peak"] = max(_stats["peak"], _stats["current"])
    weakref.finalize(storage, _release, key)


def set_capacity(nbytes: int | None) -> None:
    """The device's capacity in bytes (None: unlimited)."""
    with _lock:
        _stats["capacity"] = None if nbytes is None else int(nbytes)


def capacity() -> int | None:
    return _stats["capacity"]


def memory_allocated() -> int:
    return int(_stats["current"])


def max_memory_allocated() -> int:
    return int(_stats["peak"])


def reset_peak_memory_stats() -> None:
    with _lock:
        _stats["peak"] = _stats["current"]


def memory_stats() -> dict[str, Any]:
    """`torch.cuda.memory_stats`-style keys for what simdev tracks."""
    with _lock:
        return {"allocated_bytes.all.current": _stats["current"], "allocated_bytes.all.peak": _stats["peak"],
                "num_alloc_retries": 0, "num_ooms": _stats["ooms"], "allocation.all.allocated": _stats["allocations"],
                "capacity_bytes": _stats["capacity"]}


def live_storages() -> dict[int, int]:
    """Storage key -> bytes of everything the device holds now."""
    with _lock:
        return dict(_live)
