"""A module's tensors handed from a parent to its child, which builds the model on meta and fills it from them.

Building a config model (its random weights drawn) or loading a checkpoint costs seconds to minutes at real size,
and a child that builds it again after its parent has pays that once more. Two children take it from their parent
instead: the numerics target child (the whole model) and the layers culprit child (one failing submodule, with its
first call beside its tensors). Both go through this module:

- `handoff_path`: where the file goes: `/dev/shm` when it has room (memory-backed: writing 2 GB there took 3.4 s
  against 20 s into a disk folder on the shared 2-core VM, where the kernel's write-back competes), else the
  caller's folder; named `<PREFIX><pid>-<random>.safetensors`. Files left by a parent that is gone (killed before
  it could remove its own) are removed first (`sweep`).
- `save_handoff`: the writer: the module's parameters and buffers (every name, persistent or not; a tied tensor
  stored once, its other names pointing at it) and, optionally, a call (`codec.encode_call`, strict, strides kept),
  in one safetensors file written atomically (`codec.save_tensors`); the names and the call's spec go in its header.
- `load_handoff`: the loader: the file's tensors memory-mapped (the pages are shared with the page cache, nothing
  is copied or drawn) and put in place of the meta tensors of the model's submodule `name` ("" = the whole model); a
  tied parameter stays one object, and a plain tensor attribute that aliased a parameter or buffer (a rotary
  embedding's `original_inv_freq`) follows it. The child runs exactly the tensors its parent had.
- The validity check: a file whose tensors do not fill the submodule exactly (a name missing or extra, another
  shape or dtype, a tensor left on meta) or cannot be read is not used: `load_handoff` returns None and the child
  builds the model as before.

The storage is safetensors, not `torch.save`: it is memory-mapped on load just the same (loading 512 MiB from
`/dev/shm` took 5 ms either way, no resident growth) and written just as fast (1.2 s each, torch.save without its
CRC pass), but its reader never unpickles anything, not even `weights_only` tensors, and the call's tensors share
the file with the weights (the codec's spec in the header) instead of a file pair that could be half written.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from .codec import TensorStore, decode_call, encode_call, save_tensors
from ..models.tree import module_tensors, tensors_in

PREFIX = "deepview-handoff-"
SHM = Path("/dev/shm")
SUFFIX = ".safetensors"
_HEADER = "deepview-handoff"  # the safetensors metadata key holding the names and the call (JSON)
_WEIGHT = "w:"  # a weight's stored key; the call's tensors are the store's own keys (t0, t1, …)

__all__ = ["PREFIX", "SHM", "Handed", "handoff_path", "load_handoff", "save_handoff", "sweep"]


@dataclass
class Handed:
    """What a child got from its parent: the filled (sub)module and the call stored beside it (empty when none)."""

    module: nn.Module
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def _distinct(module: nn.Module) -> dict[int, torch.Tensor]:
    return {id(t): t for t in module_tensors(module).values()}


def handoff_path(module: nn.Module, fallback: Path) -> Path:
    """Where `save_handoff` writes `module`'s tensors: `/dev/shm` when it has room for them (and a margin), else the
    folder `fallback` (created); an empty file named `<PREFIX><pid>-<random>.safetensors`, reserved. Stale files of
    dead parents in `/dev/shm` and `fallback` are removed first."""
    need = sum(t.numel() * t.element_size() for t in _distinct(module).values())
    try:
        room = SHM.is_dir() and os.access(SHM, os.W_OK) and shutil.disk_usage(SHM).free > 1.5 * need + (256 << 20)
    except OSError:
        room = False
    folder = SHM if room else Path(fallback)
    folder.mkdir(parents=True, exist_ok=True)
    sweep(folder)
    fd, name = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=SUFFIX, dir=folder)
    os.close(fd)
    return Path(name)


def sweep(folder: Path) -> None:
    """Remove handoff files (and their temp files) in `folder` whose parent process no longer exists."""
    try:
        found = list(Path(folder).glob(f"*{PREFIX}*"))
    except OSError:
        return
    for p in found:
        try:
            pid = int(p.name.split(PREFIX, 1)[1].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            p.unlink(missing_ok=True)
        except (ValueError, IndexError, OSError):
            continue


def _stored_weights(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's distinct tensors as safetensors takes them (CPU, contiguous, no two sharing memory: a tensor
    whose storage another one already uses is copied; the rest are written from their own memory) and every name's
    stored key."""
    stored: dict[str, torch.Tensor] = {}
    keys: dict[int, str] = {}
    storages: set[tuple[torch.device, int]] = set()
    names: dict[str, str] = {}
    for name, t in module_tensors(module).items():
        if id(t) not in keys:
            v = t.detach().to("cpu").contiguous()
            where = (v.device, v.untyped_storage().data_ptr())
            if v.untyped_storage().nbytes() and where in storages:
                v = v.clone()
            storages.add((v.device, v.untyped_storage().data_ptr()))
            keys[id(t)] = f"{_WEIGHT}{name}"
            stored[keys[id(t)]] = v
        names[name] = keys[id(t)]
    return stored, names


def save_handoff(module: nn.Module, path: Path, call: tuple[tuple[Any, ...], Mapping[str, Any]] | None = None
                 ) -> dict[str, Any]:
    """Write `module`'s tensors and, when given, its call `(args, kwargs)` to `path` atomically; returns what the
    child's payload names: the file, its size, the seconds spent. Raises `codec.Unstorable` for a call the codec
    cannot store exactly."""
    t0 = time.monotonic()
    store = TensorStore()
    spec = encode_call(tuple(call[0]), call[1], store, strict=True, keep_strides=True) if call is not None else None
    weights, names = _stored_weights(module)
    header = json.dumps({"names": names, "call": spec}, allow_nan=False)
    save_tensors({**store.tensors, **weights}, Path(path), metadata={_HEADER: header})
    return {"file": str(path), "bytes": Path(path).stat().st_size, "seconds": round(time.monotonic() - t0, 3)}


def _read(file: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The header and the tensors of a handoff file, memory-mapped."""
    from safetensors import safe_open  # deferred: only a child that takes a handoff reads one

    with safe_open(str(file), framework="pt", device="cpu") as f:
        header = json.loads((f.metadata() or {})[_HEADER])
        return header, {k: f.get_tensor(k) for k in f.keys()}


def load_handoff(model: nn.Module, file: Path, name: str = "") -> Handed | None:
    """The submodule `name` of `model` (built on meta; "" = the whole model) with every tensor taken from `file`
    (`save_handoff`), and the call stored with them; None when the file cannot be read or its tensors do not fill
    the submodule exactly (the caller builds the model instead). Other submodules stay on meta."""
    try:
        header, stored = _read(file)
        sub = model.get_submodule(name)
        names: dict[str, str] = header["names"]
        tensors = {k: stored[key] for k, key in names.items()}
        args, kwargs = decode_call(header["call"], stored) if header.get("call") is not None else ((), {})
    except Exception:
        return None
    own = module_tensors(sub)
    if set(own) != set(tensors) or any(
            tuple(own[k].shape) != tuple(tensors[k].shape) or own[k].dtype != tensors[k].dtype for k in own):
        return None
    try:
        _fill(sub, tensors)
    except Exception:  # e.g. a parameter whose dtype cannot require grad: the meta shell is left part filled
        return None
    if _on_meta(sub):
        return None
    return Handed(sub.eval(), tuple(args), dict(kwargs))


def _on_meta(module: nn.Module) -> bool:
    """A tensor of `module` (a parameter, a buffer or a plain tensor attribute) still on the meta device."""
    return any(t.is_meta for m in module.modules() for key, value in vars(m).items() if key != "_modules"
               for t in tensors_in(value))


def _fill(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Point every parameter and buffer of `module` at `tensors` (a tied parameter stays one object), and every
    plain tensor attribute that aliased one of them (e.g. a rotary embedding's `original_inv_freq`)."""
    made: dict[int, Any] = {}  # id(meta tensor) -> its replacement
    for prefix, m in module.named_modules(remove_duplicate=False):
        for key, p in list(m._parameters.items()):
            if p is not None:
                full = f"{prefix}.{key}" if prefix else key
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(tensors[full], requires_grad=p.requires_grad)
                m._parameters[key] = made[id(p)]
        for key, b in list(m._buffers.items()):
            if b is not None:
                full = f"{prefix}.{key}" if prefix else key
                made.setdefault(id(b), tensors[full])
                m._buffers[key] = made[id(b)]
    for m in module.modules():
        for key, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.is_meta and id(value) in made:
                setattr(m, key, made[id(value)])
