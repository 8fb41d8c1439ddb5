"""Compiler-pass bisect of a divergent layer: which stage of the compiler broke it.

Once the numerics mode has named a layer, the next question is which compiler pass (or which graph node) makes
it diverge. The layer is taken alone, fed the inputs it received in the reference's forward (captured with
hooks), and its output compared against its own eager output (same dtype, same weights) with the layer's
threshold; "good" means within the threshold. Two methods:

* **compiler** (inductor-family backends): `torch._inductor.compiler_bisector.CompilerBisector.do_bisect`, which
  recompiles the layer under `eager`, `aot_eager`, `aot_eager_decomp_partition`, its crossref variant and
  `inductor`, finds the first backend stage that reproduces the divergence, then disables that stage's
  subsystems in turn (inductor: `pre_grad_passes`, `joint_graph_passes`, `post_grad_passes`, config changes such
  as `fallback_random`, `cudagraphs`, `lowerings`) and bisects the number of applications of the one whose
  removal fixes it. Measured with torch 2.13: a pass registered as `torch._inductor.config.post_grad_custom_post_pass`
  runs inside `post_grad_passes` and IS disabled by the bisector; the result names it
  (`debug_info="post_grad_custom_post_pass"`). What it cannot disable (code generation, a pass outside those
  subsystems) ends as "backend inductor, no subsystem identified": that is what is reported.
* **nodes** (any other backend): the layer is exported (`torch.export.export(strict=False)`, ATen ops with their
  `nn_module_stack` and source lines); a prefix of its k compute nodes runs on the target (compiled by the backend
  or eagerly on its device), the rest eagerly on the reference (CPU), and a binary search over k finds the first
  node whose inclusion makes the output deviate beyond the threshold. It assumes the deviation, once introduced,
  persists to the output (it does for a wrong kernel; a node whose error later cancels out can mislead it).

Both run in a child process in the numerics mode (a bisect recompiles many times; a crash must not cost the
mode), and each step is logged in the result. Every step is a fresh compile watched like the mode's other compiled
runs (`backends.ran.CompileWatch`, its `not_ran`): a step the backend did not
run (Dynamo ran it in eager, OpenVINO fell back to PyTorch) would read as "good" and steer the search, so it ends the
bisect as `status: inconclusive` naming the step and why (never a verdict; the finding itself stands).
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import operator
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ...backends import CompileRecord, CompileWatch, resolve_backend
from ...watch.capture import ModuleCapture, iter_tensors
from ...config import BackendSpec, InputSpec, ModelSpec, spec_from_json, spec_to_json
from ...procs.isolate import run_isolated
from ...models.load import build_inputs, load_model, model_module_stack
from ...results.model import clean, number
from ...sim.compilers import op_name
from ...models.torchcompat import available, require, skip_reason
from .metrics import compare_tensors, public, worst
from .settings import CellContext, dynamo_settings
from .thresholds import ThresholdTable, exceeded

if TYPE_CHECKING:
    from ...backends import Backend

INDUCTOR_FAMILY = ("inductor",)


class BisectError(Exception):
    """The bisect could not run (the layer could not be captured, exported or compiled)."""


class StepNotRan(Exception):
    """A bisect step the backend did not run: the step says nothing, so the bisect has no verdict."""

    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"{step}: {why}")
        self.step = step
        self.why = why


def inconclusive(out: dict[str, Any], exc: StepNotRan, log: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`out` (a bisect result so far) as inconclusive: the step the backend did not run, and why."""
    out.update(status="inconclusive", reproduced=None, not_ran={"step": exc.step, "why": exc.why[:400]},
               steps=len(log), log=list(log)[-40:],
               summary=f"inconclusive: {exc.step} did not run on the backend ({exc.why[:200]}); no verdict")
    return out


# --------------------------------------------------------------------------------------------- shared helpers

def capture_call_inputs(model: nn.Module, kwargs: Mapping[str, Any], name: str,
                        call_index: int = 0) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The (args, kwargs) the submodule `name` received in its `call_index`-th call of `model(**kwargs)`."""

    with torch.no_grad(), ModuleCapture(model, record_inputs=True, include=lambda n, _m: n == name) as cap:
        model(**kwargs)
    calls = [r for r in cap.records if r.info.name == name]
    if len(calls) <= call_index:
        raise BisectError(f"module {name or '(root)'!r} was called {len(calls)} time(s), not {call_index + 1}")
    rec = calls[call_index]
    return tuple(rec.args), dict(rec.kwargs)


def _floating_leaves(out: Any) -> list[torch.Tensor]:

    ts = [t for _k, t in iter_tensors(out)]
    fl = [t for t in ts if t.is_floating_point() or t.is_complex()]
    return fl or ts


def deviation(ref: Any, out: Any) -> dict[str, Any]:
    """Worst-of metrics of every (floating) output tensor of `out` against `ref`."""
    a, b = _floating_leaves(ref), _floating_leaves(out)
    if len(a) != len(b):
        return {"rel": math.inf, "cos": 0.0, "mad": math.inf, "max_abs": math.inf, "sqnr_db": -math.inf,
                "note": f"{len(b)} output tensors instead of {len(a)}"}
    return worst(compare_tensors(x.detach().cpu(), y.detach().cpu()) for x, y in zip(a, b))


def _bad(metrics: Mapping[str, Any], threshold: Mapping[str, float]) -> bool:

    return bool(exceeded(metrics, threshold))


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:300]


def is_inductor_family(backend: "Backend") -> bool:
    comp = backend.compiler_backend()
    return isinstance(comp, str) and comp in INDUCTOR_FAMILY


# --------------------------------------------------------------------------------------------- compiler bisect

def compiler_bisect(layer: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                    threshold: Mapping[str, float], compile_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`CompilerBisector.do_bisect` on `layer` compiled alone; good = within `threshold` of its eager output."""
    require("compiler_bisector")
    from torch._inductor.compiler_bisector import CompilerBisector  # deferred: private, probed just above

    opts = dict(compile_options or {})
    generic = {k: v for k, v in opts.items() if k in ("dynamic", "fullgraph")}
    with torch.no_grad():
        ref = layer(*args, **kwargs)
    log: list[dict[str, Any]] = []

    def run(backend_name: str) -> tuple[bool, dict[str, Any]]:
        torch._dynamo.reset()  # a fresh compile, watched: a step Dynamo ran in eager would read as "good"
        inner: Any = backend_name
        if backend_name == "inductor":  # torch.compile special-cases the name: build what it would build
            inner = torch._TorchCompileInductorWrapper(opts.get("mode"), opts.get("options"), opts.get("dynamic"))
        record = CompileRecord(inner, backend_name)
        # the bisector's own stage backend, not the matrix's `Backend` (no `compile_watched`): its record, watched
        watch = CompileWatch(backend_name, [record])
        try:
            with watch, torch.no_grad():
                # Dynamo's own entry: torch.compile would swap the record for the bisector's stage name
                compiled = torch._dynamo.optimize(record, nopython=bool(generic.get("fullgraph")),
                                                  dynamic=generic.get("dynamic"))(layer)
                out = compiled(*args, **kwargs)
        except Exception as exc:  # a failure counts as "bad" (the bisector also finds crashes)
            return False, {"error": _short(exc)}
        why = watch.not_ran(breaks=False)
        if why:
            sub = CompilerBisector.get_subsystem()
            raise StepNotRan(f"the step on {backend_name}" + (f" with subsystem {sub}" if sub else ""), why)
        m = deviation(ref, out)
        return not _bad(m, threshold), public(m)

    def fn() -> bool:
        be = CompilerBisector.get_backend() or "inductor"
        good, m = run(be)
        log.append({"backend": be, "subsystem": CompilerBisector.get_subsystem(), "good": good, **m})
        return good

    out: dict[str, Any] = {"method": "compiler", "threshold": dict(threshold)}
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    patches = contextlib.ExitStack()
    with patches:
        patches.enter_context(inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False))
        patches.enter_context(functorch_config.patch(enable_autograd_cache=False))
        try:
            good, m = run("inductor")
        except StepNotRan as exc:
            return inconclusive(out, exc, log)
        out["target"] = m
        if good:
            out.update(reproduced=False, summary="the divergence does not reproduce with the layer compiled alone "
                                                 "by inductor (it needs the surrounding graph); no bisect")
            return out
        buf = io.StringIO()
        t0 = time.monotonic()
        try:
            with contextlib.redirect_stdout(buf):
                res = CompilerBisector.do_bisect(fn)
        except StepNotRan as exc:
            return inconclusive(out, exc, log)
        out["seconds_bisect"] = round(time.monotonic() - t0, 3)
    out["reproduced"] = True
    out["steps"] = len(log)
    out["log"] = log[-40:]
    out["bisector_output"] = buf.getvalue()[-3000:]
    return _compiler_answer(out, res)


def _compiler_answer(out: dict[str, Any], res: Any) -> dict[str, Any]:
    """`out` with the bisector's result `res` (a `BisectionResult`, or None) and its summary."""
    if res is None:
        out.update(backend=None, subsystem=None, bisect_number=None, debug_info=None,
                   summary="the bisector found no stage that reproduces the divergence (flaky?)")
        return out
    out.update(backend=res.backend, subsystem=res.subsystem, bisect_number=res.bisect_number,
               debug_info=res.debug_info)
    if res.backend == "eager":
        out["summary"] = "reproduces under backend=eager: Dynamo's capture itself, not a compiler pass"
    elif res.subsystem is None:
        out["summary"] = (f"first reproduces in backend stage {res.backend}; no subsystem the bisector can disable "
                          f"fixes it (code generation or a pass outside its subsystems)")
    else:
        where = f"{res.backend} › {res.subsystem}"
        if res.bisect_number:
            where += f", application #{res.bisect_number}"
        if res.debug_info and res.debug_info != res.subsystem:
            where += f" ({res.debug_info})"
        out["summary"] = f"compiler bisect: {where}"
    return out


# --------------------------------------------------------------------------------------------- node bisect

def export_layer(layer: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The layer as an ATen-level GraphModule (`torch.export`, strict=False) and its flat inputs."""
    import torch.fx._pytree as fx_pytree

    try:
        with torch.no_grad():
            ep = torch.export.export(layer, tuple(args), dict(kwargs), strict=False)
    except Exception as exc:
        raise BisectError(f"cannot export the layer for a node bisect: {_short(exc)}") from exc
    gm = ep.module()
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and str(n.target).startswith("_guards") and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()
    flat = list(fx_pytree.tree_flatten_spec((tuple(args), dict(kwargs)), gm._in_spec))
    return gm, flat


def _units(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def _cut(gm: torch.fx.GraphModule, units: Sequence[torch.fx.Node], k: int) -> tuple[set[torch.fx.Node], list[torch.fx.Node]]:
    """(the nodes of the first k units, with their getitems; the ones whose values are used after the cut)."""
    cut = set(units[:k])
    for n in list(cut):
        for u in n.users:
            if u.op == "call_function" and u.target is operator.getitem:
                cut.add(u)
    live = [n for n in gm.graph.nodes if n in cut and any(u not in cut for u in n.users)
            and not any(u.op == "call_function" and u.target is operator.getitem for u in n.users)]
    return cut, live


def _prefix_module(gm: torch.fx.GraphModule, cut: set[torch.fx.Node], live: Sequence[torch.fx.Node]) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = g.placeholder(n.name)
            env[n].meta = dict(n.meta)
        elif n.op == "get_attr":
            env[n] = g.get_attr(n.target)
        elif n in cut:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in live))
    return torch.fx.GraphModule(gm, g)


class _Hybrid(torch.fx.Interpreter):
    """Runs the graph eagerly, taking the values of `given` nodes as computed (by the target) and skipping `skip`."""

    def __init__(self, gm: torch.fx.GraphModule, given: Mapping[torch.fx.Node, Any], skip: set[torch.fx.Node]) -> None:
        super().__init__(gm)
        self.given = given
        self.skip = skip

    def run_node(self, n: torch.fx.Node) -> Any:
        if n in self.given:
            return self.given[n]
        if n in self.skip:
            return None
        return super().run_node(n)


def _node_info(n: torch.fx.Node, layer_name: str) -> dict[str, Any]:

    stack = model_module_stack(n.meta)
    sub = stack[-1][0] if stack else ""
    cls = stack[-1][1] if stack else None
    if isinstance(cls, type):
        cls = cls.__name__
    module = ".".join(p for p in (layer_name, sub) if p)
    trace = (n.meta.get("stack_trace") or "").strip().splitlines()
    return {"node": n.name, "op": op_name(n.target), "module": module,
            "module_class": str(cls).rsplit(".", 1)[-1] if cls else None,
            "source": "\n".join(line.strip() for line in trace[-2:]) if trace else None}


def first_bad(n: int, is_bad: Callable[[int], bool], out: dict[str, Any]) -> int:
    """The smallest prefix length k in 1..n with `is_bad(k)`, prefix 0 good and n bad (binary search); a step the
    backend did not run (`StepNotRan`) leaves `out["between"]`, the range the steps that ran narrowed it to."""
    lo, hi = 0, n  # prefix lo is good (all eager), prefix hi is bad
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            step_bad = is_bad(mid)
        except StepNotRan:
            out["between"] = [lo, hi]  # the first bad node is in (lo, hi]
            raise
        if step_bad:
            hi = mid
        else:
            lo = mid
    return hi


def node_bisect(layer: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], backend: "Backend", *,
                threshold: Mapping[str, float], layer_name: str = "") -> dict[str, Any]:
    """Binary search over the layer's graph nodes for the first one whose run on the target causes the deviation."""
    gm, flat = export_layer(layer, args, kwargs)
    units = _units(gm)
    device = getattr(backend, "device", "cpu")
    compiled = not getattr(backend, "is_eager", True)
    with torch.no_grad():
        ref = torch.fx.Interpreter(gm).run(*flat)
    log: list[dict[str, Any]] = []
    cache: dict[int, tuple[bool, dict[str, Any]]] = {}

    def on_target(prefix: torch.fx.GraphModule) -> tuple[Callable[..., Any], Any]:
        """The prefix on the target and its watch (a null context when the backend does not compile)."""
        if device != "cpu":
            prefix = copy.deepcopy(prefix).to(device)
        fn, watch = backend.compile_watched(prefix) if compiled else (prefix, contextlib.nullcontext())

        def call(*xs: Any) -> Any:
            moved = [x.to(device) if isinstance(x, torch.Tensor) and device != "cpu" else x for x in xs]
            return fn(*moved)

        return call, watch

    def bad(k: int) -> tuple[bool, dict[str, Any]]:
        if k in cache:
            return cache[k]
        cut, live = _cut(gm, units, k)
        why = None
        try:
            prefix = _prefix_module(gm, cut, live)
            torch._dynamo.reset()  # a fresh compile, watched: a prefix left to PyTorch would read as "good"
            with torch._dynamo.config.patch(**dynamo_settings()), torch.no_grad():
                call, watch = on_target(prefix)
                with watch:
                    vals = call(*flat)
                why = watch.not_ran(breaks=False) if compiled and live else None
                given = {n: (v.to("cpu") if isinstance(v, torch.Tensor) else v) for n, v in zip(live, vals)}
                out = _Hybrid(gm, given, cut).run(*flat)
            m = deviation(ref, out)
            res = (_bad(m, threshold), public(m))
        except Exception as exc:
            res = (True, {"error": _short(exc)})
        log.append({"k": k, "node": units[k - 1].name if k else None, "bad": res[0], **res[1],
                    **({"not_ran": why[:300]} if why else {})})
        if why:
            raise StepNotRan(f"the step with the first {k} of {len(units)} nodes on the target", why)
        cache[k] = res
        return res

    out: dict[str, Any] = {"method": "nodes", "nodes": len(units), "threshold": dict(threshold)}
    try:
        whole_bad, whole = bad(len(units))
    except StepNotRan as exc:
        return inconclusive(out, exc, log)
    out["target"] = whole
    if not whole_bad:
        out.update(reproduced=False, log=log,
                   summary="the divergence does not reproduce on the layer's exported graph run on the target; no "
                           "node bisect")
        return out
    try:
        hi = first_bad(len(units), lambda k: bad(k)[0], out)
    except StepNotRan as exc:
        return inconclusive(out, exc, log)
    node = units[hi - 1]
    info = _node_info(node, layer_name)
    out.update(reproduced=True, steps=len(log), log=log[-40:], first_node=info, first_node_index=hi,
               metrics_at_node=cache[hi][1])
    where = info["module"] or "(root)"
    out["summary"] = (f"first node: {info['node']} = {info['op']} in {where}"
                      + (f" ({info['module_class']})" if info["module_class"] else "")
                      + (f", at `{info['source'].splitlines()[-1]}`" if info.get("source") else "")
                      + f" (node {hi} of {len(units)})")
    return out


# --------------------------------------------------------------------------------------------- choosing and running

def choose_layer(layers: Sequence[Any], verdict: Mapping[str, Any]) -> tuple[Any, str] | None:
    """The layer to bisect: the first layer wrong on its own (isolated view), else the first divergent one."""
    def done(x: Any) -> int:
        return int(getattr(x, "done", getattr(x, "idx", 0)))

    iso = sorted((x for x in layers if x.flagged("isolated")), key=done)
    if iso:
        return iso[0], "isolated"
    first = verdict.get("first_divergent")
    if first is None:
        return None
    cands = sorted((x for x in layers if x.name == first and x.flagged("cumulative")), key=done)
    return (cands[0], "cumulative") if cands else None


def bisect_layer(model: nn.Module, kwargs: Mapping[str, Any], backend: "Backend", *, layer: str, call_index: int,
                 threshold: Mapping[str, float], method: str = "auto") -> dict[str, Any]:
    """Capture `layer`'s inputs in `model(**kwargs)` (eager, CPU) and bisect it on `backend`."""
    use = method
    if use == "auto":
        use = "compiler" if is_inductor_family(backend) else "nodes"
    if use == "compiler" and not is_inductor_family(backend):
        raise BisectError(f"the compiler bisect applies to inductor-family backends, not {backend.spec.compile!r}; "
                          f"use bisect_method: nodes")
    args, kw = capture_call_inputs(model, kwargs, layer, call_index)
    sub = model.get_submodule(layer) if layer else model
    if use == "compiler":
        res = compiler_bisect(sub, args, kw, threshold=threshold, compile_options=dict(backend.spec.compile_options))
    else:
        target = sub
        res = node_bisect(target, args, kw, backend, threshold=threshold, layer_name=layer)
    res["layer"] = layer
    res["call_index"] = call_index
    return res


def bisect_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Entry point of the isolated child (`run_isolated("ci_runner.modes.numerics.bisect:bisect_child", …)`)."""

    backend = resolve_backend(spec_from_json(BackendSpec, payload["backend"]))
    loaded = load_model(spec_from_json(ModelSpec, payload["model"]), seed=int(payload["seed"]),
                        dtype=payload["dtype"], device="cpu")
    inputs = spec_from_json(InputSpec, payload["inputs"])
    kwargs = build_inputs(loaded, inputs, sample=int(payload.get("sample", 0)), device="cpu")
    return clean(bisect_layer(loaded.module, kwargs, backend, layer=payload["layer"],
                               call_index=int(payload.get("call_index", 0)), threshold=payload["threshold"],
                               method=payload.get("method", "auto")))


def bisect_cell(ctx: CellContext, *, layers: Sequence[Any], verdict: Mapping[str, Any],
                table: ThresholdTable | None = None, method: str = "auto", timeout: float = 600.0,
                isolate: bool = True) -> dict[str, Any] | None:
    """Bisect the cell's divergent layer (None when no layer diverged); the result dict has `summary`."""
    chosen = choose_layer(layers, verdict)
    if chosen is None:
        return None
    layer, view = chosen
    base = {"layer": layer.name, "module_class": layer.module_class, "call_index": int(layer.call_index),
            "view": view}
    use = method if method != "auto" else ("compiler" if is_inductor_family(ctx.backend) else "nodes")
    if use == "compiler" and not available("compiler_bisector"):
        return {**base, "status": "skipped", "summary": None, "reason": skip_reason("compiler_bisector")}
    threshold = dict(layer.threshold.get(view) or {})
    if not threshold and table is not None:
        threshold = dict(table.get(layer.key, view)[0])

    payload = {"model": spec_to_json(ctx.cell.model), "backend": spec_to_json(ctx.cell.backend),
               "inputs": spec_to_json(ctx.cell.inputs), "seed": ctx.cell.inputs.seed,
               "dtype": ctx.cell.references[0].dtype, "sample": 0, "layer": layer.name,
               "call_index": int(layer.call_index), "threshold": {k: float(number(v)) for k, v in threshold.items()},
               "method": method}
    budget = max(5.0, min(timeout, ctx.remaining() * 0.8))
    if isolate:
        res = run_isolated("ci_runner.modes.numerics.bisect:bisect_child", payload, timeout=budget, env=dict(ctx.cell.backend.env))
        if res.status != "ok":
            return {**base, "status": "error", "summary": None, **res.failure("bisect")}
        return {**base, "status": "ok", **res.value}
    try:
        return {**base, "status": "ok", **bisect_child(payload)}
    except Exception as exc:
        return {**base, "status": "error", "summary": None, "reason": f"bisect could not run: {_short(exc)}"}


__all__ = ["BisectError", "StepNotRan", "bisect_cell", "first_bad", "inconclusive", "bisect_child", "bisect_layer", "capture_call_inputs", "choose_layer",
           "compiler_bisect", "deviation", "export_layer", "is_inductor_family", "node_bisect"]
