"""The target child takes the primary reference's model from its parent instead of building it again.

Building a config model (its random weights drawn) or loading a checkpoint costs seconds to minutes at real size,
and the numerics mode's target child used to pay it once more after the parent had. Now the parent writes the model's
parameters and buffers (every name, persistent or not; tied tensors once) to one file (`save_weights`: `torch.save`,
no checksum pass: the file lives for one target run) and the child builds the model on the meta device (no weights,
no init) and points every parameter and buffer at the file's tensors, memory-mapped (`load_weights`:
`torch.load(mmap=True, weights_only=True)`): the pages are shared with the page cache, nothing is copied or drawn.
The child runs exactly the tensors the reference dumps were recorded with.

The file goes to `/dev/shm` when it has room (memory-backed: writing 2 GB there took 3.4 s against 20 s into a
disk folder on the shared 2-core VM, where the kernel's write-back competes), else to the cell's folder; its name
holds the parent's pid, and files left by a parent that is gone (killed before it could remove its own) are removed
by the next one (`handoff_path`).

A model whose tensors do not come back whole (a name missing or extra, another shape or dtype, a tensor left on
meta) is not used: `load_weights` returns None and the child builds the model as before.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from ..config import ModelSpec
from ..engine.models import LoadedModel, load_model
from ..engine.tree import module_tensors, tensors_in
from ..fsutil import atomic_write_with

PREFIX = "deepview-target-weights-"
SHM = Path("/dev/shm")


def handoff_path(module: nn.Module, fallback: Path) -> Path:
    """Where `save_weights` writes `module`'s tensors: `/dev/shm` when it has room for them (and a margin), else the
    folder `fallback`; named `<PREFIX><pid>-<n>.pt`. Stale files of dead parents in `/dev/shm` are removed first."""
    _sweep(SHM)
    need = sum(t.numel() * t.element_size() for t in {id(t): t for t in module_tensors(module).values()}.values())
    try:
        room = SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free > 1.5 * need + (256 << 20)
    except OSError:
        room = False
    folder = SHM if room else Path(fallback)
    fd, name = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=".pt", dir=folder)
    os.close(fd)
    return Path(name)


def _sweep(folder: Path) -> None:
    """Remove handoff files (and their temp files) whose parent process no longer exists."""
    try:
        found = list(folder.glob(f"*{PREFIX}*"))
    except OSError:
        return
    for p in found:
        try:
            pid = int(p.name.split(PREFIX, 1)[1].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except (ValueError, IndexError, PermissionError, OSError):
            continue


def save_weights(module: nn.Module, path: Path) -> dict[str, Any]:
    """Write `module`'s tensors (CPU) to `path` atomically (a temp file, then `os.replace`); returns the child's
    `weights` payload entry: the file, its size, the seconds spent."""
    t0 = time.monotonic()
    path = Path(path)
    from torch.utils.serialization import config  # the zip writer's CRC pass over every byte is skipped

    crc = config.save.compute_crc32
    config.save.compute_crc32 = False
    try:
        atomic_write_with(path, lambda tmp: torch.save({k: t.detach() for k, t in module_tensors(module).items()}, tmp))
    finally:
        config.save.compute_crc32 = crc
    return {"file": str(path), "bytes": path.stat().st_size, "seconds": round(time.monotonic() - t0, 3)}


def load_weights(spec: ModelSpec, *, seed: int, dtype: str, file: Path) -> LoadedModel | None:
    """The model of `spec` built on the meta device with every tensor taken from `file` (`save_weights`),
    memory-mapped; None when the file's tensors do not fill the model exactly (the caller builds it instead)."""
    try:
        shell = load_model(spec, seed=seed, dtype=dtype, meta=True)
        tensors = torch.load(str(file), mmap=True, weights_only=True, map_location="cpu")
    except Exception:
        return None
    module = shell.module
    own = module_tensors(module)
    if not isinstance(tensors, Mapping) or set(own) != set(tensors) or any(
            tuple(own[k].shape) != tuple(tensors[k].shape) or own[k].dtype != tensors[k].dtype for k in own):
        return None
    _fill(module, tensors)
    if any(t.is_meta for m in module.modules() for key, value in vars(m).items() if key != "_modules"
           for t in tensors_in(value)):
        return None
    return dataclasses.replace(shell, module=module.eval(), device="cpu", meta=False)


def _fill(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Point every parameter and buffer of `module` at `tensors` (a tied parameter stays one object), and every
    plain tensor attribute that aliased one of them (e.g. a rotary embedding's `original_inv_freq`)."""
    made: dict[int, Any] = {}  # id(meta tensor) -> its replacement
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, p in list(m._parameters.items()):
            if p is not None:
                full = f"{prefix}.{name}" if prefix else name
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(tensors[full], requires_grad=p.requires_grad)
                m._parameters[name] = made[id(p)]
        for name, b in list(m._buffers.items()):
            if b is not None:
                full = f"{prefix}.{name}" if prefix else name
                made.setdefault(id(b), tensors[full])
                m._buffers[name] = made[id(b)]
    for m in module.modules():
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.is_meta and id(value) in made:
                setattr(m, key, made[id(value)])


__all__ = ["PREFIX", "handoff_path", "load_weights", "save_weights"]
