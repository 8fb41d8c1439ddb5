"""The compile mode's repros (`repro_compile.py.j2`): the model rebuilt standalone (a transformers model from its
config and weights, a factory model from its factory), compiled once with the backend and called with the phase's
calls in order, with the check that turns the finding into an error: `fullgraph=True` at a graph break,
`error_on_recompile` after the warm-up, `fail_on_recompile_limit_hit` at the recompile limit, a graph count for a
length sweep, OpenVINO's leftover ops for an eager fallback. Each is verified by running it in a fresh process."""

from __future__ import annotations

import copy
import inspect
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...backends import plugin_pythonpath
from ...engine.repro import (plugin_modules, render_template, run_command, safe_filename, template_backend,
                               verify_script, write_script)
from ...engine.codec import TensorStore, Unstorable, encode_call
from ...watch.dynamotrace import short_path
from ...watch.hooks import ModuleHooks
from ...workloads.calls import cache_recipe, capture_calls, plain_tensors
from ...fsutil import atomic_write_text
from ...options import CompileOptions
from ...results.model import Finding, Repro
from .checks import PhaseSignals

if TYPE_CHECKING:
    from .. import ModeContext

__all__ = ["attach_repros", "frame_module"]


def _model_recipe(ctx: "ModeContext", loaded: Any, folder: Path) -> dict[str, Any] | None:
    """How the repro rebuilds the model (writing config.json and weights.safetensors for a transformers model);
    None when it cannot (a path or hub model of no transformers class)."""
    spec = ctx.cell.model
    if spec.factory:
        module, _, function = spec.factory.partition(":")
        return {"kind": "factory", "module": module, "function": function, "seed": ctx.cell.inputs.seed,
                "overrides": dict(spec.overrides)}
    import transformers  # deferred: only a transformers model's repro needs it
    from safetensors.torch import save_file

    cls = type(loaded.module)
    if getattr(transformers, cls.__name__, None) is not cls or loaded.config is None:
        return None
    if not (folder / "weights.safetensors").exists():
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "config.json", loaded.config.to_json_string(use_diff=False))
        state, seen = {}, set()
        for k, v in loaded.module.state_dict().items():  # tied weights: saved once
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                state[k] = v.detach().cpu().contiguous().clone()
        save_file(state, str(folder / "weights.safetensors"))
    return {"kind": "transformers", "config_class": type(loaded.config).__name__, "model_class": cls.__name__}


def _plain_calls(sig: PhaseSignals, upto: str | None) -> list[dict[str, Any]]:
    """The phase's calls as literals, up to the call labelled `upto` (all when None); the KV cache left out."""
    out = []
    for call in sig.calls:
        tensors = {k: v.tolist() for k, v in plain_tensors(call.kwargs).items()}
        plain = {k: v for k, v in call.kwargs.items() if isinstance(v, (bool, int, float, str)) or v is None}
        out.append({"label": call.label, "tensors": tensors, "plain": plain})
        if call.label == upto:
            break
    return out


def _cache(loaded: Any, sig: PhaseSignals) -> dict[str, Any] | None:
    if sig.phase is None or sig.phase.name not in ("prefill", "decode") or not sig.calls:
        return None
    return cache_recipe(loaded, sig.phase, sig.calls[0])


def frame_module(root: torch.nn.Module, source: str) -> tuple[str | None, str]:
    """The module whose `forward` holds Dynamo's compiled frame at `source` (the code object's short `file:line`, a
    resume function's line inside it too): (name, "") when one module of that class is in the model (the root is
    "(model)"), else (None, why)."""
    file, _, line = source.rpartition(":")
    if not file or not line.isdigit():
        return None, f"no frame source ({source or 'none'})"
    names: dict[type, list[str]] = {}
    for name, mod in root.named_modules():
        names.setdefault(type(mod), []).append(name)
    for cls, found in names.items():
        try:
            lines, start = inspect.getsourcelines(cls.forward)
            src = short_path(inspect.getsourcefile(cls.forward) or "")
        except (OSError, TypeError):
            continue
        if src == file and start <= int(line) < start + len(lines):
            if len(found) > 1:
                return None, f"{source} is {cls.__name__}.forward, of {len(found)} modules ({', '.join(found[:3])})"
            return found[0] or "(model)", ""
    return None, f"{source} is no module's forward (a wrapper or a function)"


def _module_calls(ctx: "ModeContext", loaded: Any, sig: PhaseSignals, name: str,
                  upto: int) -> list[tuple[str, Any, Any]]:
    """(phase call label, args, kwargs) of every call of module `name` during the phase's calls 0..upto, run
    eagerly (a phase's calls through `capture_calls`: its KV cache state as the module saw it)."""
    if sig.phase is not None:
        calls = capture_calls(loaded, ctx.cell.inputs, sig.phase, forced=None, upto=upto).get(name) or []
        return [(sig.calls[i].label, a, k) for i, a, k in calls if 0 <= i <= upto]
    seen: list[tuple[str, Any, Any]] = []
    current = {"label": ""}

    def pre(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append((current["label"], copy.deepcopy(args), copy.deepcopy(kwargs)))

    with ModuleHooks([(name, loaded.module.get_submodule(name))], pre=lambda _name: pre), torch.no_grad():
        for call in sig.calls[:upto + 1]:
            current["label"] = call.label
            loaded.module(**call.kwargs)
    return seen


def _minimal_module(loaded: Any, f: Finding) -> tuple[str | None, str]:
    """The module a finding's smallest repro compiles alone: a graph break's module, the submodule whose forward is
    the recompiled frame, the one module OpenVINO's leftover op sits in; (None, why) for the whole model."""
    if f.kind == "graph_break":
        name = f.details.get("module")
        if not name:
            return None, "the break is outside any module's forward"
        return (name, "") if name != "(model)" else (None, "the break is in the model's own forward")
    if f.kind in ("compile_after_warmup", "recompile_limit"):
        name, why = frame_module(loaded.module, str(f.details.get("source") or ""))
        return (name, why) if name != "(model)" else (None, "the recompiled frame is the model's own forward")
    if f.kind == "eager_fallback":
        where = list(f.details.get("modules") or [])
        return (where[0], "") if len(where) == 1 and where[0] else (None, f"{f.op} sits in {len(where)} modules")
    return None, "the check is about the whole phase"


def _minimal(ctx: "ModeContext", loaded: Any, sig: PhaseSignals, f: Finding, folder: Path,
             index: int) -> dict[str, Any] | None:
    """A finding's smallest repro: the module `_minimal_module` names, compiled alone and called with its captured
    inputs (`inputs_<i>.safetensors`, each call in the wire format of `engine/codec.py`): a graph break's one call,
    else every call of the module up to the finding's call (the same guards fail on the same inputs). None (the
    whole model's calls, `details.repro_note` says why) when there is no such module or its inputs cannot be
    stored."""
    name, why = _minimal_module(loaded, f)
    if not name:
        f.details["repro_note"] = f"{why}: the whole model's calls"
        return None
    label = str(f.details.get("call") or (sig.calls[-1].label if sig.calls else ""))
    upto = next((i for i, c in enumerate(sig.calls) if c.label == label), None)
    try:
        calls = _module_calls(ctx, loaded, sig, name, upto) if upto is not None else []
        if f.kind == "graph_break":
            calls = [c for c in calls if c[0] == label][:1]
        if not calls or calls[-1][0] != label:
            f.details["repro_note"] = f"{name} was not called in {label}: the whole model's calls"
            return None
        store = TensorStore()
        specs = [{"label": c[0], "call": encode_call(c[1], c[2], store.add, strict=True)} for c in calls]
    except Unstorable as exc:
        f.details["repro_note"] = f"{name}'s inputs cannot be stored ({exc}): the whole model's calls"
        return None
    inputs = f"inputs_{index}.safetensors"
    store.save(folder / inputs)
    f.details["repro_module"] = name
    return {"name": name, "calls": specs, "inputs": inputs, "label": label,
            "check_at": next(i for i, c in enumerate(specs) if c["label"] == label)}


def _expect(f: Finding) -> tuple[list[str], str | None]:
    """What a verifying run must print: texts and error type."""
    d = f.details
    if f.kind == "graph_break":
        return [f"REPRO FAILED: graph break at {d.get('source', '')}", str(d.get("reason", "")).split(":", 1)[0][:80]], None
    if f.kind == "compile_after_warmup":
        return [str(d.get("changed") or "")], "RecompileError"
    if f.kind == "recompile_limit":
        return ["fail_on_recompile_limit_hit"], "FailOnRecompileLimitHit"
    if f.kind == "eager_fallback":
        return [f"REPRO FAILED: {f.op} ran in PyTorch eager"], None
    return ["REPRO FAILED"], None


def attach_repros(ctx: "ModeContext", opts: CompileOptions, loaded: Any, signals: list[PhaseSignals],
                  findings: list[Finding]) -> None:
    """A repro per finding (`Finding.repro`), verified unless `verify: false`, `verify_workers` at once. The
    `compile_after_warmup` findings of one call share a script (`error_on_recompile` raises at its first recompile).
    None when the model cannot be rebuilt standalone (`details.repro_note` says why)."""
    folder = ctx.artifact_dir("compile") / "repro"
    folder.mkdir(parents=True, exist_ok=True)
    recipe = _model_recipe(ctx, loaded, folder)
    by_name = {s.name: s for s in signals}
    scripts: dict[tuple[str, ...], tuple[Path, str, str, Finding]] = {}  # share key -> (script, command, pythonpath)
    owners: list[tuple[Finding, tuple[str, ...]]] = []
    whole_args: dict[tuple[str, ...], tuple[PhaseSignals, int]] = {}
    for i, f in enumerate(findings):
        if f.kind == "eager_fallback" and f.op == "(partition)":
            continue
        if recipe is None:
            f.details["repro_note"] = "no repro: the model is neither a transformers class nor a factory"
            continue
        sig = by_name[f.details["phases"][0]]
        key = (f.kind, sig.name, str(f.details.get("call")), str(_minimal_module(loaded, f)[0])) \
            if f.kind == "compile_after_warmup" else (f.fingerprint,)
        if key not in scripts:
            scripts[key] = (*_write(ctx, opts, loaded, sig, f, recipe, folder, i), f)
            whole_args[key] = (sig, i)
        owners.append((f, key))
    done = _verify_all(ctx, opts, scripts)
    retry = {k: (*_write(ctx, opts, loaded, whole_args[k][0], t[3], recipe, folder, whole_args[k][1], whole=True), t[3])
             for k, t in scripts.items() if t[3].details.get("repro_module") and opts.verify and not done[k].verified}
    for k, repro in _verify_all(ctx, opts, retry).items():  # the module alone did not show it: the whole model's calls
        f = retry[k][3]
        f.details["repro_note"] = f"{f.details.pop('repro_module')} alone did not show it ({done[k].note[:200]})"
        done[k] = repro
    for f, key in owners:
        f.repro = done[key]
        if scripts[key][3] is not f:
            f.details["repro_shared_with"] = scripts[key][3].fingerprint


def _write(ctx: "ModeContext", opts: CompileOptions, loaded: Any, sig: PhaseSignals, f: Finding,
           recipe: dict[str, Any], folder: Path, index: int, *, whole: bool = False) -> tuple[Path, str, str]:
    """The rendered script of `f`: (path, command, PYTHONPATH it needs). A graph break's script is its module alone
    (`_minimal`) unless `whole` or it cannot be."""
    spec = ctx.cell.backend
    upto = f.details.get("call") if f.kind in ("compile_after_warmup", "recompile_limit") else None
    name = f"repro_{f.kind}_{safe_filename(sig.name)}_{index}{'_model' if whole else ''}.py"
    modules = plugin_modules(spec) + ([recipe["module"]] if recipe["kind"] == "factory" else [])
    pythonpath = plugin_pythonpath(modules)
    command = run_command(name, folder, pythonpath)
    import torch._dynamo  # deferred: Dynamo's config, for the limit the mode ran under

    limit = opts.recompile_limit or int(torch._dynamo.config.recompile_limit)
    allowed = opts.max_graphs if f.kind == "graph_count" else int(f.metrics.get("allowed", 0) or 0)
    minimal = _minimal(ctx, loaded, sig, f, folder, index) if whole is False else None
    text = render_template(
        "repro_compile.py.j2", check=f.kind, model_id=ctx.cell.model.id, backend_id=spec.id, phase=sig.label,
        message=f.message[:300], torch_version=torch.__version__, source=f.details.get("source", ""),
        warmup=next((i for i, c in enumerate(sig.calls) if c.label == upto), 1), limit=limit, allowed=allowed, expect=f.op or "", model=recipe,
        run_it=command, calls=_plain_calls(sig, upto) if minimal is None else [], cache=_cache(loaded, sig),
        backend=template_backend(spec), minimal=minimal)
    return write_script(folder / name, text), command, os.pathsep.join(pythonpath)


def _verify_all(ctx: "ModeContext", opts: CompileOptions,
                scripts: dict[tuple[str, ...], tuple[Path, str, str, Finding]]) -> dict[tuple[str, ...], Repro]:
    """Each script run in a fresh process (`verify_workers` at once): its `Repro`."""
    from concurrent.futures import ThreadPoolExecutor  # deferred: only verification runs threads

    spec = ctx.cell.backend

    def one(item: tuple[Path, str, str, Finding]) -> Repro:
        script, command, pythonpath, f = item
        rel = script.relative_to(ctx.cell_dir).as_posix()
        if not opts.verify:
            return Repro(path=rel, verified=False, command=command, note="not verified (compile.verify: false)")
        env = {str(k): str(v) for k, v in spec.env.items()}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        texts, error_type = _expect(f)
        ver = verify_script(script, expect_text=[t for t in texts if t], expect_error_type=error_type,
                            timeout=max(30.0, min(opts.verify_timeout, ctx.remaining() / 2)), env=env)
        tail = [ln for ln in ver.output_tail.splitlines() if ln.startswith("REPRO FAILED")]
        said = re.sub(r"\s+", " ", tail[-1])[:300] if tail else ""
        return Repro(path=rel, verified=ver.verified, command=command,
                     note=ver.note + (f": {said}" if said and ver.verified else ""))

    keys = list(scripts)
    with ThreadPoolExecutor(max_workers=max(1, opts.verify_workers)) as pool:
        return dict(zip(keys, pool.map(one, [scripts[k] for k in keys])))
