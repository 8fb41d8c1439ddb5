"""The memory mode's repros: one layer, its captured inputs, and a script that re-runs it alone.

Nothing is unpickled: the script rebuilds the layer from the model's source (its factory, or its transformers class
from `config.json`: `engine.repro.model_source`) by its qualified name and loads its own weights from
`weights.safetensors`; its arguments at the failing call are `inputs.safetensors` plus the call in the codec's wire
format (`engine/codec.py`, with a decode step's DynamicCache stored as its keys and values). The script
(`templates/repro_memory.py.j2`) needs torch, safetensors, transformers (for a transformers model or a KV cache) and
the backend's plugin; an out-of-memory repro sets the same capacity and holds, as one block, the rest of what the run
held when the layer began; a regression repro prints the eager and compiled peaks. A model whose source no script can
rebuild (a `path:` model of a class transformers does not export) gets no repro, and the finding says so.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch

from ...backends import backend_recipe, plugin_pythonpath
from ...engine.codec import TensorStore, Unstorable, encode_call, save_tensors
from ...engine.repro import (model_source, render_template, run_command, safe_filename, template_backend,
                             verify_script, write_script)
from ...models.tree import module_tensors
from ...results.model import Repro

__all__ = ["to_device", "write_repro", "verify", "repro_folder"]


def to_device(obj: Any, device: str, depth: int = 0) -> Any:
    """A copy of `obj` with every tensor on `device`, also inside cache objects (three attribute levels deep)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, depth) for v in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device, depth) for k, v in obj.items()}
    if depth < 3 and hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        out = copy.copy(obj)
        for k, v in list(vars(obj).items()):
            setattr(out, k, to_device(v, device, depth + 1))
        return out
    return obj


def write_repro(folder: Path, *, kind: str, title: str, cell: Any, loaded: Any, call_args: Any, phase: str,
                step: int | None, module: str, **extra: Any) -> tuple[Path, list[str]] | str:
    """Write `repro.py`, `weights.safetensors` (the layer `module` of the CPU model `loaded`), `inputs.safetensors`
    and, for a transformers model, `config.json` into `folder`: the script's path and the folders its imports need on
    PYTHONPATH; or why no repro can be written (the finding's note)."""
    folder.mkdir(parents=True, exist_ok=True)
    source = model_source(cell.model, cell.inputs.seed, loaded, folder)
    if source is None:
        return f"no repro: the layer cannot be rebuilt from this model's source ({cell.model.source})"
    store = TensorStore()
    try:
        args, kwargs = call_args
        call = encode_call(args, kwargs, store.add, kv=True)
    except Unstorable as exc:
        return f"no repro: the layer's call holds {exc}"
    store.save(folder / "inputs.safetensors")
    save_tensors(module_tensors(loaded.module.get_submodule(module)), folder / "weights.safetensors", copy=True)
    recipe = backend_recipe(cell.backend)
    imports = list(recipe.imports)
    if recipe.device.split(":")[0] == "simdev" and "ci_runner.sim.simdev" not in imports:
        imports.append("ci_runner.sim.simdev")
    pythonpath = plugin_pythonpath([*imports, "ci_runner"])
    script = folder / "repro.py"
    text = render_template("repro_memory.py.j2", kind=kind, title=title, model=cell.model.id, backend_id=cell.backend.id,
                           phase=phase, step=step, module=module, backend=template_backend(cell.backend),
                           source=source, call=call, command=run_command(script.name, folder, pythonpath), **extra)
    return write_script(script, text), pythonpath


def verify(script: Path, pythonpath: list[str], *, expect: list[str], timeout: float, enabled: bool,
           cell_dir: Path) -> Repro:
    """The `Repro` of `script` (path relative to the cell folder), run in a fresh process when `enabled`."""
    rel = str(script.relative_to(cell_dir))
    command = run_command(script.name, script.parent, pythonpath)
    if not enabled:
        return Repro(path=rel, verified=False, command=command, note="not run (verify: false)")
    # the repro runs with the deepview-ci that wrote it (a checkout, when that is what runs), as the command says
    own = str(Path(__file__).resolve().parents[3])  # the folder holding `ci_runner/`
    env = {"PYTHONPATH": os.pathsep.join([*pythonpath, own])}
    v = verify_script(script, expect_text=expect, timeout=timeout, env=env)
    return Repro(path=rel, verified=v.verified, command=command, note=v.note)


def repro_folder(cell_dir: Path, kind: str, phase: str, module: str) -> Path:
    return cell_dir / "memory" / safe_filename(f"{kind}-{phase}-{module or 'model'}")
