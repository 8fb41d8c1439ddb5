"""Layers per phase (`inputs.phases`): the call that dies, the smallest submodule it dies in, and why.

For each phase the whole model is compiled once with the backend (its `compile_options` honoured) and called as
users call it (`workloads/calls.py`: prefill, then decode steps through one KV cache; a padded batch; long prompts),
teacher-forced with eager's tokens. The first call that raises is named (phase, step). Then:
- **dynamic shapes**: the same phase again with `dynamic=False` (one graph per shape). Passing there means the
  failure is "only under dynamic shapes" (Dynamo recompiled the second call with a symbolic length);
- **the culprit**: the symbolic-shape functions (`sym_max`, `sym_size`, …) in the graph the backend was given for
  the failing call, and any graph op the error names;
- **the smallest failing submodule**: each submodule's calls are captured eagerly (args, kwargs, KV cache state
  included) and replayed, in order, through one compiled object per submodule, walking down from the model while a
  child fails at the same call. When no child fails, the failure lies in the parent's own code (e.g. mask code in
  the model's forward) and the finding says so;
- **a repro** (`repro_phase.py.j2`): the model rebuilt from its config and weights, compiled with the backend, the
  phase's calls replayed up to the failing one; verified by running it.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from ...backends.ran import CompileRecord, CompileWatch
from ...failures.failure import first_line, raised_traceback
from ...failures.diagnostics import capture_fd2, compiler_words
from ...backends import boilerplate_lines, plugin_pythonpath
from ...engine.repro import (plugin_modules, render_template, run_command, safe_filename, template_backend,
                               verify_script, write_script)
from ...watch.watchedrun import PhaseWatch, wanted
from ...workloads.calls import (Call, Captured, PhaseRun, cache_recipe, capture_calls, plain_tensors, replay_calls,
                                 run_phase, smallest_module, symbolic_functions)
from ...fsutil import atomic_write_text
from ...options import LayersOptions
from ...workloads.phases import Phase
from ...results.model import Finding, Repro, fingerprint
from ...results.rootcause import cause_line, without_type

if TYPE_CHECKING:
    from .. import ModeContext

ROOT = ""


def _compile(ctx: "ModeContext", module: torch.nn.Module, *, dynamic: bool | None = None) -> tuple[Any, CompileWatch]:
    """The module compiled with the cell's backend as a user compiles it (after a Dynamo reset), watched and keeping
    the graphs it is given; `dynamic` overrides the backend's `compile_options.dynamic`."""
    import torch._dynamo  # deferred: Dynamo takes seconds to import

    torch._dynamo.reset()
    return ctx.backend.compile_watched(module, dynamic=dynamic, keep_modules=True)


def _fresh(ctx: "ModeContext", loaded: Any) -> torch.nn.Module:
    return ctx.backend.to_device(copy.deepcopy(loaded.module))


def _target_run(ctx: "ModeContext", loaded: Any, phase: Phase, forced: list[torch.Tensor] | None, *,
                dynamic: bool | None = None) -> tuple[PhaseRun, CompileRecord | None, dict[int, int], str | None]:
    """The phase through one compiled object, and why the backend did not run (some of) it (None: it ran it all).
    The first (as users compile it) is watched, and kept for the compile mode when the cell runs it
    (`watch.watchedrun`): its signals then cost no compile of their own."""
    fn, compiled = _compile(ctx, _fresh(ctx, loaded), dynamic=dynamic)
    record = compiled.record
    graphs_before: dict[int, int] = {}
    index = {"i": 0}
    keep = dynamic is None and wanted(ctx.cell.modes) and phase.name not in ctx.compiled_runs
    watch = PhaseWatch("layers", compiled, trace=keep)

    def before(call: Call) -> None:
        graphs_before[index["i"]] = len(record.modules) if record is not None else 0
        index["i"] += 1
        watch.before(call)

    with watch, capture_fd2() as fd2:  # a native compiler's own words (IREE's "failed to legalize …") go to fd 2
        run = run_phase(fn, loaded, ctx.cell.inputs, phase, forced=forced, device=ctx.backend.device,
                        before_call=before, after_call=watch.after)
    failed = run.failed
    if failed is not None and failed.exc is not None:  # kept after the error's first line, as the forward's probes
        words, _ = compiler_words(fd2[0], failed.exc, failed.error or "")  # keep them: the cause past boilerplate
        if words:
            failed.error = (failed.error or "") + "\n" + "\n".join(words)
    if keep:
        ctx.compiled_runs[phase.name] = watch.result()
    return run, record, graphs_before, watch.result().not_ran


def _node_name(node: Any) -> str:
    target = node.target
    return str(target) if hasattr(target, "_schema") else getattr(target, "__name__", str(target))


def culprit_ops(record: CompileRecord | None, first_graph: int, error: str) -> list[str]:
    """Ops of the graphs given to the backend for the failing call: the symbolic-shape functions among them
    (`workloads.calls.symbolic_functions`), and any op whose name the error text contains."""
    if record is None:
        return []
    found: list[str] = []
    for gm in record.modules[first_graph:] or record.modules[-1:]:
        for name in symbolic_functions(gm):
            if name not in found:
                found.append(name)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            name = _node_name(node)
            short = name.split(".")[-2] if name.startswith("aten.") and name.count(".") >= 2 else name
            if len(short) > 3 and re.search(rf"\b{re.escape(short)}\b", error) is not None and name not in found:
                found.append(name)
    return found


def _replay_fails(ctx: "ModeContext", loaded: Any, name: str, calls: list[tuple[int, tuple[Any, ...], dict[str, Any]]],
                  failing: int) -> str | None:
    """Replay a submodule's captured calls through one compiled object; the error at the failing call, if any."""
    fn, _ = _compile(ctx, ctx.backend.to_device(copy.deepcopy(loaded.module.get_submodule(name))))  # that module only
    index, _, exc = replay_calls(fn, calls, failing, ctx.backend.to_device)
    return f"{type(exc).__name__}: {exc}" if exc is not None and index == failing else None


def smallest_failing(ctx: "ModeContext", loaded: Any, captured: Captured, failing: int) -> tuple[str, list[str]]:
    """Walk down from the model while a child, replayed alone, fails at the failing call."""
    def fails(child: str) -> bool:
        calls = [c for c in captured.get(child, []) if c[0] <= failing]
        return bool(calls) and _replay_fails(ctx, loaded, child, calls, failing) is not None

    return smallest_module(loaded.module, captured, failing, fails)


def run_phases(ctx: "ModeContext", opts: LayersOptions, layers_dir: Path) -> tuple[list[Finding], dict[str, Any]]:
    return ctx.each_phase("layers", lambda phase: _one_phase(ctx, opts, phase, layers_dir),  # type: ignore[arg-type]
                          loaded=ctx.model())


def _one_phase(ctx: "ModeContext", opts: LayersOptions, phase: Phase, layers_dir: Path) -> tuple[list[Finding], dict[str, Any]]:
    loaded = ctx.model()
    ref = run_phase(loaded.module, loaded, ctx.cell.inputs, phase)
    if ref.failed is not None:
        return [], {"status": "error", "reason": f"eager fails at {ref.failed.label}: {ref.failed.error}"}
    forced = list(ref.tokens[:-1]) if ref.tokens else None
    run, record, graphs_before, not_ran = _target_run(ctx, loaded, phase, forced)
    calls = [{"call": r.label, "step": r.step, "ok": r.error is None} for r in run.records]
    data: dict[str, Any] = {"status": "pass", "phase": phase.label(), "calls": calls}
    if record is not None:
        data["graphs"] = len(record.graphs)
    failed = run.failed
    if failed is None:
        if not_ran:  # its calls passed, but (some of) them in PyTorch: never a pass
            data.update(status="inconclusive", reason=f"the backend did not run (all of) this phase: {not_ran[:400]}")
        return [], data
    failing = len(run.records) - 1
    passed_calls = [r.label for r in run.records if r.error is None]
    dynamic_note = None
    if ctx.cell.backend.compile_options.get("dynamic") is not False and ctx.backend.compiler_backend() is not None:
        static, _, _, _ = _target_run(ctx, loaded, phase, forced, dynamic=False)
        if static.failed is None:
            dynamic_note = "fails only under dynamic shapes: the same calls pass with torch.compile(..., dynamic=False)"
        else:
            dynamic_note = f"fails with dynamic=False too (at {static.failed.label})"
    culprits = culprit_ops(record, graphs_before.get(failing, 0), failed.error or "")
    captured = capture_calls(loaded, ctx.cell.inputs, phase, forced=forced, upto=failing)
    module, children_passed = smallest_failing(ctx, loaded, captured, failing)
    classes = {n: type(m).__name__ for n, m in loaded.module.named_modules()}
    where = f"{phase.name} step {failed.step}" if failed.step is not None else failed.label
    before = (f" ({', '.join(passed_calls[:3])}{'…' if len(passed_calls) > 3 else ''} "
              f"{'passes' if len(passed_calls) == 1 else 'pass'})") if passed_calls else ""
    parts = [f"{where} fails on the backend{before}: {first_line(failed.error or '', 300)}"]
    if children_passed or module == ROOT:
        parts.append(f"in {module or 'the model'}'s own code ({len(children_passed)} child module(s) replayed on the "
                     f"same calls pass)")
    if culprits:
        parts.append(f"culprit: {', '.join(culprits[:4])} in the graph the backend was given")
    if dynamic_note:
        parts.append(dynamic_note)
    finding = Finding(
        kind="layer_failure", stage=failed.stage if failed.stage in ("compile", "run") else "run",
        message="; ".join(parts), module=module or "(model)", module_class=classes.get(module, "?"),
        error_type=failed.error_type, phase=phase.name, step=failed.step,
        details={"call": failed.label, "culprit_ops": culprits, "dynamic_only": bool(dynamic_note and
                                                                                     dynamic_note.startswith("fails only")),
                 "children_passed": children_passed, "passed_calls": passed_calls,
                 # the error itself and where it was raised: root causes key on these, not on the phase's words
                 # (one cause failing in prefill, decode and long is one cause, as the forward's finding is)
                 "message_full": (failed.error or "")[:4000],
                 **({"traceback_tail": raised_traceback(failed.exc)[-3000:]} if failed.exc is not None else {})},
        fingerprint=fingerprint("layer_failure", ctx.cell.backend.id, ctx.cell.model.id, phase.name, module))
    finding.repro = _repro(ctx, opts, loaded, phase, ref, failing, failed, layers_dir)
    data.update(status="fail", failed_call=failed.label, module=module or "(model)", culprit_ops=culprits,
                dynamic=dynamic_note)
    return [finding], data


def _plain_call(call_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v.tolist() for k, v in plain_tensors(call_kwargs).items()}


def _repro(ctx: "ModeContext", opts: LayersOptions, loaded: Any, phase: Phase, ref: PhaseRun, failing: int,
           failed: Any, layers_dir: Path) -> Repro | None:
    """The phase replayed up to the failing call on the model rebuilt from its config and weights."""
    import transformers  # deferred: only phase repros need it
    from safetensors.torch import save_file

    cls = type(loaded.module)
    if getattr(transformers, cls.__name__, None) is not cls or loaded.config is None:
        return None
    rdir = layers_dir / "repro" / safe_filename(f"{phase.name}-{failed.label}")
    rdir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(rdir / "config.json", loaded.config.to_json_string(use_diff=False))
    state = {k: v.detach().cpu().contiguous().clone() for k, v in loaded.module.state_dict().items()}
    seen: dict[int, str] = {}
    for k, v in list(state.items()):  # tied weights: saved once
        if v.data_ptr() in seen:
            del state[k]
        else:
            seen[v.data_ptr()] = k
    save_file(state, str(rdir / "weights.safetensors"))
    calls: list[dict[str, Any]] = []
    forced = list(ref.tokens[:-1]) if ref.tokens else None
    index = {"i": 0}
    seen: list[Call] = []  # the phase's first call: its cache's recipe

    def keep(call: Call) -> None:
        if index["i"] <= failing:
            calls.append({"label": call.label, "tensors": _plain_call(call.kwargs)})
        if not seen:
            seen.append(call)
        index["i"] += 1

    run_phase(loaded.module, loaded, ctx.cell.inputs, phase, forced=forced, before_call=keep)
    spec = ctx.cell.backend
    cache = cache_recipe(loaded, phase, seen[0]) if phase.name in ("prefill", "decode") else None
    pythonpath = plugin_pythonpath(plugin_modules(spec))  # a plugin not installed: its folder, relative
    command = run_command("repro.py", rdir, pythonpath)
    text = render_template(
        "repro_phase.py.j2", run_it=command, model_id=ctx.cell.model.id, model_source=ctx.cell.model.source, backend_id=spec.id,
        phase=phase.label(), failing=failed.label, error_type=failed.error_type or "",
        message=cause_line(without_type(failed.error or "", failed.error_type), boilerplate_lines(), 200), torch_version=torch.__version__,
        backend=template_backend(spec), model_class=cls.__name__,
        config_class=type(loaded.config).__name__, calls=calls, cache=cache, use_cache=phase.name in ("prefill", "decode"))
    script = write_script(rdir / "repro.py", text)
    rel = script.relative_to(ctx.cell_dir).as_posix()
    if not opts.verify:
        return Repro(path=rel, verified=False, command=command, note="not verified (layers.verify: false)")
    env = {str(k): str(v) for k, v in spec.env.items()}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    # the same call failing with the same error type and cause line (past a backend's boilerplate line)
    ver = verify_script(script, expect_text=[failed.label], expect_error_type=failed.error_type or None,
                        expect_message=failed.error or None,
                        timeout=max(30.0, min(opts.verify_timeout, ctx.remaining() / 2)), env=env)
    return Repro(path=rel, verified=ver.verified, command=command, note=ver.note)
