"""From a failing submodule to the failing operator(s): the culprit search inside a layer finding.

After the layers mode has found a smallest failing submodule, this takes its graph at the level the backend
sees and finds the operator (or the smallest contiguous range of operators) that still fails alone:

1. Graph. The submodule is traced on the reference (CPU) on its captured call: the forward graph
   `aot_autograd` hands a compiler (ATen overloads, parameters as inputs, true source lines); when Dynamo
   breaks that graph, `torch.export(strict=False)` (as the layer repro). `capture_graph`.
2. Reference intermediates: the graph runs once in `torch.fx.Interpreter` on the captured inputs; every
   node's value is kept (real shapes, dtypes, strides and values).
3. Single ops first: each op node is compiled and run alone on the target (`Backend.compile`, or eagerly on an
   eager device) on its real inputs. Ops the layer's error names go first; the first node that fails alone
   is the culprit.
4. Then ranges: when no single node fails alone, the whole graph is probed, and the smallest failing
   contiguous range is found by delta debugging over the node list (shrink the end, then the start).
5. Every probe (a node or a range) is one small graph (`subgraph` + `graph_source`) run in an isolated child
   (`isolate.supervise`): each probe is journalled (`enter-culprit`/`leave-culprit`), each outcome appended
   to `probes.jsonl`; an abort, a segfault or a hang (measured: `procs/limits.py`) kills only that child, the
   journal names the probe in flight (`<module>@<start>:<end>`), and a fresh child replays the known outcomes
   and goes on. One child serves all of a cell's findings in turn (`find_culprits`): the model, its inputs
   (one reference forward) and the backend are loaded once; a finished target leaves `answer.json`.
6. The culprit's repro: `graph.py` (the node or range as a small `torch.nn.Module`), `inputs.safetensors` with
   the real inputs (call codec, strides kept) and `repro.py` (`templates/repro_culprit.py.j2`), verified in
   a subprocess like the other repros.

The search is a pure function of the probe outcomes (`search`), as the layer search is.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ...backends import boilerplate_lines, named_op_from_error, resolve_backend
from ...failures.diagnostics import capture_fd2, compiler_words
from ...watch.hooks import aten_recording
from ...engine.codec import TensorStore, decode_call, encode_call
from ...config import BackendSpec, ModelSpec, spec_from_json
from ...models.tree import map_tensors
from ...fsutil import atomic_write_json, atomic_write_text
from ...quoting import comment, pyrepr
from ...failures.failure import first_line, is_compile_stage, raised_traceback, unwrap
from ...procs.isolate import Attempt, IsolatedResult, Journal, child_journal, file_tail, supervise
from ...procs.limits import ChildLimits, HangLimits, dead_item, item_limits, stacks_on_signal
from ...engine.handoff import load_handoff
from .search import capture_inputs
from ...models.load import load_model
from ...failures.outcome import UNFINISHED, ProbeOutcome, append_outcome, read_outcomes
from .culprit_search import Step, StopSearch, parse_key, search, single_order
from ...engine.repro import Verification, render_template, run_command, write_script
from ...results.rootcause import cause_line

__all__ = [
    "KIND", "ANSWER", "CapturedGraph", "CulpritResult", "CulpritTarget", "CulpritPlan",
    "capture_graph", "graph_steps", "subgraph", "graph_source", "run_graph",
    "entry_name", "parse_entry", "culprit_child", "find_culprit", "find_culprits", "describe_value",
    "ops_cross_check",
]

Call = tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]  # a submodule and its first call's inputs
KIND = "culprit"  # the journal's entry kind: enter-culprit / leave-culprit
# Nodes that compute nothing a backend lowers: never probed alone (still part of ranges).
_NO_KERNEL = ("aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
              "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg",
              "aten.sym_size.int", "aten.sym_stride.int", "aten.sym_numel.default")


# --------------------------------------------------------------------------- the graph

@dataclass
class CapturedGraph:
    gm: torch.fx.GraphModule
    values: dict[torch.fx.Node, Any]  # every node's reference value
    level: str  # aot | export
    note: str = ""


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{mod}.{name}" if mod and mod not in ("builtins", "_operator", "operator") else str(name)


class _Recorder(torch.fx.Interpreter):
    """Runs a graph on the reference kernels and keeps every node's value (cloned when the graph mutates)."""

    def __init__(self, gm: torch.fx.GraphModule, clone: bool) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.clone = clone
        self.values: dict[torch.fx.Node, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if self.clone:
            self.values[n] = map_tensors(lambda t: t.detach().clone(), out)
        else:
            self.values[n] = out
        return out


def _mutates(gm: torch.fx.GraphModule) -> bool:
    return any(n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
               for n in gm.graph.nodes)


def _record(gm: torch.fx.GraphModule, flat: Sequence[Any]) -> dict[torch.fx.Node, Any]:
    rec = _Recorder(gm, clone=_mutates(gm))
    with torch.no_grad():
        rec.run(*flat)
    return rec.values


def capture_graph(module: torch.nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], *,
                  eager_device: bool = False) -> CapturedGraph:
    """`module`'s graph on its call, at the level the backend sees, with every node's reference value.

    `eager_device`: the target runs ops eagerly (no compiler); fused attention is traced through its math
    path, as PyTorch dispatches it on a device without a fused kernel."""
    if eager_device:
        from torch.nn.attention import SDPBackend, sdpa_kernel  # deferred: torch

        with sdpa_kernel([SDPBackend.MATH]):
            return capture_graph(module, args, kwargs)
    from functorch.compile import make_boxed_func  # deferred: functorch is heavy

    got: list[tuple[torch.fx.GraphModule, dict[torch.fx.Node, Any]]] = []

    def recorder(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        # not `keep_graph`: each graph is kept as it RUNS, with every node's value on the real inputs
        def run(*flat: Any) -> Any:
            got.append((gm, _record(gm, flat)))
            return gm(*flat)
        return make_boxed_func(run)

    kw = dict(kwargs)
    note = ""
    try:
        with aten_recording(lambda *xs: module(*xs, **kw), fw_compiler=recorder, dynamic=False) as (compiled, _), \
                torch.no_grad():
            compiled(*args)
        if len(got) == 1:
            gm, values = got[0]
            return CapturedGraph(gm=gm, values=values, level="aot")
        note = f"Dynamo split the module into {len(got)} graphs"
    except Exception as exc:
        note = f"the aot_autograd trace failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''})"
    from torch.utils import _pytree as pytree  # deferred: torch

    with torch.no_grad():
        ep = torch.export.export(module, tuple(args), kw, strict=False)
    gm = ep.module()
    values = _record(gm, pytree.tree_leaves((tuple(args), kw)))
    return CapturedGraph(gm=gm, values=values, level="export", note=note + "; traced with torch.export instead")


def describe_value(v: Any) -> str:
    """`float32[1, 16, 64]` (with `stride=[…]` when not contiguous) for a tensor; repr for the rest."""
    if isinstance(v, torch.Tensor):
        s = f"{str(v.dtype).replace('torch.', '')}{list(v.shape)}"
        if v.device.type != "cpu":
            s += f" on {v.device}"
        return s if v.is_contiguous() or v.dim() < 2 else f"{s} stride={list(v.stride())}"
    if isinstance(v, (list, tuple)):
        inner = ", ".join(describe_value(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner})"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _source_line(node: torch.fx.Node) -> str | None:
    """The innermost source line of the node that is not this tool's own code, with no folder of this machine:
    a path inside site-packages from there, one under the working folder relative to it, else the file's name."""
    st = node.meta.get("stack_trace") or ""
    frames = [line.strip() for line in st.splitlines() if line.strip().startswith("File ")]
    own = str(Path(__file__).resolve().parents[2])
    frames = [f for f in frames if own + os.sep + "ci_runner" not in f] or frames
    if not frames:
        return None
    frame = frames[-1]
    m = re.match(r'File "([^"]+)"(.*)$', frame)
    if not m or not os.path.isabs(m.group(1)):
        return frame
    path = m.group(1)
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return f'File "{path.partition(marker)[2]}"{m.group(2)}'
    cwd = os.getcwd()
    short = os.path.relpath(path, cwd) if path.startswith(cwd + os.sep) else os.path.basename(path)
    return f'File "{short}"{m.group(2)}'


def _arg_nodes(node: torch.fx.Node) -> list[Any]:
    out: list[Any] = []
    torch.fx.node.map_aggregate((node.args, node.kwargs), lambda a: out.append(a) or a)  # type: ignore[func-returns-value]
    return out


def graph_steps(cg: CapturedGraph) -> tuple[list[Step], list[torch.fx.Node]]:
    """The op nodes in graph order (getitem nodes travel with their producer), described."""
    import operator

    steps: list[Step] = []
    nodes: list[torch.fx.Node] = []
    for n in cg.gm.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        op = _op_name(n.target)
        ins: list[str] = []
        for a in n.args:
            ins.append(describe_value(cg.values.get(a)) if isinstance(a, torch.fx.Node) else
                       describe_value(torch.fx.node.map_arg(a, lambda x: cg.values.get(x))))
        for k, a in n.kwargs.items():
            val = cg.values.get(a) if isinstance(a, torch.fx.Node) else torch.fx.node.map_arg(a, lambda x: cg.values.get(x))
            ins.append(f"{k}={describe_value(val)}")
        probe = isinstance(n.target, torch._ops.OpOverload) and op not in _NO_KERNEL
        steps.append(Step(index=len(steps), node=n.name, op=op, source=_source_line(n), inputs=ins, probe=probe))
        nodes.append(n)
    return steps, nodes


# --------------------------------------------------------------------------- one probe: a small graph

class Unprobeable(Exception):
    """A node range whose inputs cannot be given to a small graph (a non-tensor value computed in the graph)."""


def subgraph(cg: CapturedGraph, nodes: Sequence[torch.fx.Node]) -> tuple[torch.fx.Graph, list[tuple[str, torch.Tensor]]]:
    """The nodes (a contiguous range of steps, plus their getitem users) as a graph of their own: every value
    from outside becomes an input (tensors) or a constant (plain values); its outputs are the values used
    after the range (or, when none is, its last values)."""
    import operator

    inc: list[torch.fx.Node] = []
    chosen = set(nodes)
    for n in cg.gm.graph.nodes:
        if n in chosen or (n.op == "call_function" and n.target is operator.getitem and n.args[0] in chosen):
            inc.append(n)
    members = set(inc)
    g = torch.fx.Graph()
    inputs: list[tuple[str, torch.Tensor]] = []
    env: dict[torch.fx.Node, Any] = {}
    # the inputs first: placeholders lead the graph
    for n in inc:
        for a in _arg_nodes(n):
            if not isinstance(a, torch.fx.Node) or a in members or a in env:
                continue
            val = cg.values.get(a)
            if isinstance(val, torch.Tensor):
                env[a] = g.placeholder(a.name)
                env[a].meta["val"] = val
                inputs.append((env[a].name, val))
            elif val is None or isinstance(val, (bool, int, float, str, torch.dtype, torch.device)):
                env[a] = val  # a constant in the small graph
            else:
                raise Unprobeable(f"{a.name} is a {type(val).__name__} computed in the graph")
    for n in inc:
        env[n] = g.node_copy(n, lambda a: env[a])
    tensor_valued = [n for n in inc if isinstance(cg.values.get(n), torch.Tensor)]
    outs = [n for n in tensor_valued if any(u not in members for u in n.users)]
    if not outs:
        outs = [n for n in tensor_valued if not n.users] or tensor_valued[-1:]
    g.output(tuple(env[n] for n in outs))
    g.lint()
    return g, inputs


def graph_source(graph: torch.fx.Graph, *, title: str, lines: Iterable[str] = ()) -> str:
    """A Python module defining `class Graph(torch.nn.Module)` whose forward is `graph`."""
    from torch.fx.graph import _custom_builtins  # deferred: torch

    code = graph.python_code(root_module="self")
    head = [pyrepr(title), "# generated by deepview-ci (culprit search); the inputs are in inputs.safetensors"]
    head += [f"# {comment(line)}" for line in lines]
    imports = []
    for name in code.globals:
        builtin = _custom_builtins.get(name)
        if builtin is not None:
            imports.append(builtin.import_str)
        elif name != "torch":
            raise Unprobeable(f"the graph needs {name!r}, which a standalone file cannot import")
    body = "\n".join("    " + line if line.strip() else "" for line in code.src.strip("\n").splitlines())
    return "\n".join(head + sorted(set(imports) | {"import torch"}) +
                     ["", "", "class Graph(torch.nn.Module):", body, ""])


def load_graph(source: str, filename: str = "graph.py") -> torch.nn.Module:
    ns: dict[str, Any] = {"__name__": "deepview_culprit_graph"}
    exec(compile(source, filename, "exec"), ns)
    return ns["Graph"]()


def run_graph(source: str, inputs: Sequence[torch.Tensor], backend: Any) -> None:
    """Compile (or, on an eager device, just run) the small graph on the target and fetch its outputs."""
    import torch._dynamo

    torch._dynamo.reset()
    module = backend.to_device(load_graph(source))
    fn = backend.compile(module)
    with torch.no_grad():
        out = fn(*backend.to_device(list(inputs)))
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            t.to("cpu")


# --------------------------------------------------------------------------- the probing child

@dataclass(frozen=True, kw_only=True)
class CulpritTarget:
    """One layer finding to search: its submodule, its folder (probes.jsonl, graph.json, answer.json and the
    culprit's files) and the op names its error mentions (probed first)."""

    module: str  # qualified name of the failing submodule ("" = the whole model)
    out_dir: str
    hints: list[str] = field(default_factory=list)
    handoff: str | None = None  # the submodule's tensors and its call from the cell (`engine.handoff`), if written


@dataclass(frozen=True, kw_only=True)
class CulpritPlan:
    """What a culprit child needs; JSON through `run_isolated`. One child serves every finding of a cell: the
    model, its inputs and the backend are loaded once."""

    model: dict[str, Any]
    backend: dict[str, Any]
    seed: int
    layers_dir: str  # holds root_call.json and root_inputs.safetensors (the layers mode's)
    targets: list[dict[str, Any]]  # CulpritTarget, in order
    timeout_file: str  # where faulthandler writes the stacks of a probe that overran its limit
    limits: dict[str, float]  # `procs/limits.HangLimits.to_json()`: probe_timeout, progress_window, stuck_factor
    limits_file: str  # a JSON line per probe: the limit its child put on it and why (`ChildLimits`)
    deadline_wall: float
    target_budget_s: float  # the most one target's search may take in this child
    all_singles: bool = True  # probe every single op, to name each one that fails alone


ANSWER = "answer.json"  # a target's finished search (written by the child, read by the parent)


def _handed_calls(plan: CulpritPlan, targets: Sequence[CulpritTarget]) -> dict[str, Call]:
    """Each target the cell handed over (`engine.handoff`): its submodule, filled from the file, and its call. The
    model is built once, on the meta device; a target that does not come back whole is left out (built instead)."""
    todo = [t for t in targets if t.module and t.handoff and Path(t.handoff).is_file()]
    if not todo:
        return {}
    try:
        shell = load_model(spec_from_json(ModelSpec, plan.model), seed=plan.seed, meta=True).module
    except Exception:  # `_module_calls` builds the model the usual way, which reports the error
        return {}
    got = {t.module: load_handoff(shell, Path(str(t.handoff)), t.module) for t in todo}
    return {name: (h.module, h.args, h.kwargs) for name, h in got.items() if h is not None}


def _module_calls(plan: CulpritPlan, modules: Sequence[str]) -> dict[str, Call]:
    """Each module with its first call's inputs, from one load of the model and one reference forward."""
    from safetensors.torch import load_file  # deferred: heavy

    layers_dir = Path(plan.layers_dir)
    root = json.loads((layers_dir / "root_call.json").read_text(encoding="utf-8"))
    root_args, root_kwargs = decode_call(root, load_file(str(layers_dir / "root_inputs.safetensors")))
    model = load_model(spec_from_json(ModelSpec, plan.model), seed=plan.seed).module
    out: dict[str, Call] = {}
    subs = [m for m in modules if m != ""]
    calls = capture_inputs(model, root_args, root_kwargs, subs) if subs else {}
    for m in modules:
        if m == "":
            out[m] = (model, tuple(root_args), dict(root_kwargs))
            continue
        got = calls.get(m)
        if not got:
            raise RuntimeError(f"{m} did not run in the reference forward")
        args, kwargs = got[0]
        out[m] = (model.get_submodule(m), tuple(args), dict(kwargs))
    return out


def entry_name(module: str, key: str) -> str:
    """The journal entry of one probe: `<module>@<start>:<end>`."""
    return f"{module}@{key}"


def parse_entry(entry: str) -> tuple[str, str]:
    module, _, key = entry.rpartition("@")
    return module, key


def culprit_child(payload: dict[str, Any]) -> dict[str, Any]:
    """Entry point of a culprit child (`ci_runner.modes.layers.culprit:culprit_child`): load the model, its inputs and the
    backend once, then for each target not yet answered: trace its module, replay the known probe outcomes,
    probe the rest (journalled, appended as they come) and, when its search is done, write the culprit's graph
    and inputs and the target's `answer.json`."""
    faulthandler.enable(file=sys.stderr)
    plan = CulpritPlan(**payload)
    targets = [CulpritTarget(**t) for t in plan.targets]
    todo = [t for t in targets if not (Path(t.out_dir) / ANSWER).exists()]
    if not todo:
        return {"answered": 0}
    calls = _handed_calls(plan, todo)  # handed over: no build
    if rest := [t.module for t in todo if t.module not in calls]:
        calls.update(_module_calls(plan, rest))
    backend = resolve_backend(spec_from_json(BackendSpec, plan.backend))
    backend.prepare()
    measured = [o.duration_s for t in targets for o in read_outcomes(Path(t.out_dir) / "probes.jsonl").values()
                if o.status in ("pass", "fail")]  # this cell's finished probes: what the second limit derives from
    with open(plan.timeout_file, "a", encoding="utf-8") as timeout_fh, \
            stacks_on_signal(timeout_fh):  # the parent's watch: where stuck
        for t in todo:
            sub, args, kwargs = calls[t.module]
            try:
                _search_target(plan, t, sub, args, kwargs, backend, timeout_fh, measured)
            except Exception as exc:  # outside any probe (the trace, the culprit's files): this target only
                atomic_write_json(Path(t.out_dir) / ANSWER, {
                    "kind": "error", "key": None,
                    "note": f"the culprit child failed outside any probe: {type(exc).__name__}: "
                            f"{first_line(str(exc))}"})
    return {"answered": len(todo)}


def _search_target(plan: CulpritPlan, target: CulpritTarget, sub: torch.nn.Module, args: tuple[Any, ...],
                   kwargs: dict[str, Any], backend: Any, timeout_fh: Any, measured: list[float]) -> None:
    out_dir = Path(target.out_dir)
    outcomes_file = out_dir / "probes.jsonl"
    known = read_outcomes(outcomes_file)
    t0 = time.monotonic()
    deadline = min(plan.deadline_wall, time.time() + plan.target_budget_s)
    limits = ChildLimits(HangLimits.from_json(plan.limits), deadline, Path(plan.limits_file), measured)
    cg = capture_graph(sub, args, kwargs, eager_device=backend.is_eager)
    steps, nodes = graph_steps(cg)
    atomic_write_json(out_dir / "graph.json", {"level": cg.level, "note": cg.note, "steps": [asdict(s) for s in steps],
                                               "seconds": round(time.monotonic() - t0, 3)})
    probed = 0

    def probe(key: str) -> ProbeOutcome:
        nonlocal probed
        if key in known:
            return known[key]
        if time.time() >= deadline:
            raise StopSearch()
        s, e = parse_key(key)
        entry = entry_name(target.module, key)
        r = _probe(entry, key, cg, nodes[s:e], backend, timeout=limits.limit(entry), timeout_fh=timeout_fh)
        if r.status in ("pass", "fail"):
            limits.finished(r.duration_s)
        append_outcome(outcomes_file, r)
        known[key] = r
        probed += 1
        return r

    state = search(len(steps), single_order(steps, target.hints), probe, all_singles=plan.all_singles)
    if state.key is not None:
        s, e = parse_key(state.key)
        _write_culprit(out_dir, cg, steps[s:e], nodes[s:e])
    atomic_write_json(out_dir / ANSWER, {"kind": state.kind, "key": state.key, "note": state.note, "probed": probed,
                                         "probes": state.probed, "failing": state.failing, "level": cg.level,
                                         "own_seconds": round(time.monotonic() - t0, 3)})


def _probe(entry: str, key: str, cg: CapturedGraph, nodes: Sequence[torch.fx.Node], backend: Any, *,
           timeout: float, timeout_fh: Any) -> ProbeOutcome:
    t0 = time.monotonic()
    try:
        g, inputs = subgraph(cg, nodes)
        source = graph_source(g, title=key)
    except Unprobeable as exc:
        return ProbeOutcome(name=key, status="skipped", message=str(exc))
    child_journal(f"enter-{KIND}", entry)
    faulthandler.dump_traceback_later(timeout, exit=True, file=timeout_fh)
    err = [""]
    try:
        with capture_fd2() as err:  # a native compiler's own words (IREE's "failed to legalize …") go to fd 2
            run_graph(source, [t for _, t in inputs], backend)
        r = ProbeOutcome(name=key, status="pass", duration_s=time.monotonic() - t0)
    except Exception as exc:  # the backend's error is the finding
        inner = unwrap(exc)
        stage = "compile" if (not backend.is_eager and is_compile_stage(exc)) else "run"
        message = str(inner)[:4000] or type(inner).__name__
        words, _ = compiler_words(err[0], inner, message)
        if words:  # after the error's first line, as the layer search keeps them: the cause past a boilerplate line
            message = (message + "\n" + "\n".join(words))[:6000]
        r = ProbeOutcome(name=key, status="fail", stage=stage, error_type=type(inner).__name__, message=message,
                        traceback=raised_traceback(exc, inner)[-4000:], duration_s=time.monotonic() - t0,
                        diagnostics=words)
    finally:
        faulthandler.cancel_dump_traceback_later()
        child_journal(f"leave-{KIND}", entry)
    return r


def _write_culprit(out_dir: Path, cg: CapturedGraph, steps: Sequence[Step], nodes: Sequence[torch.fx.Node]) -> None:
    """The culprit's small graph (`graph.py`), its real inputs (`inputs.safetensors`) and `call.json`."""
    g, inputs = subgraph(cg, nodes)
    ops = list(dict.fromkeys(s.op for s in steps))
    lines = [f"{s.node}: {s.op}({', '.join(s.inputs)})" + (f"  <- {s.source}" if s.source else "") for s in steps]
    atomic_write_text(out_dir / "graph.py", graph_source(g, title=f"the culprit: {', '.join(ops)}", lines=lines))
    store = TensorStore()
    call = encode_call(tuple(t for _, t in inputs), {}, store)
    store.save(out_dir / "inputs.safetensors")
    atomic_write_json(out_dir / "call.json", {"call": call, "inputs": [n for n, _ in inputs]})


# --------------------------------------------------------------------------- the parent side

@dataclass(frozen=True, kw_only=True)
class CulpritResult:
    """The search's answer for one layer finding; `to_details()` is the finding's `details.culprit`."""

    found: bool
    kind: str  # single | range | none | incomplete | error
    ops: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    node_ops: list[str] = field(default_factory=list)  # per node: its op
    node_range: list[int] | None = None  # [start, end) over the op nodes
    graph_nodes: int = 0
    level: str | None = None
    inputs: list[list[str]] = field(default_factory=list)  # per node: its real inputs, described
    sources: list[str | None] = field(default_factory=list)
    status: str | None = None  # the culprit probe's outcome: fail | crashed | timeout
    stage: str | None = None
    error_type: str | None = None
    message: str = ""
    note: str = ""
    probes: int = 0
    restarts: int = 0
    seconds: float = 0.0
    out_dir: str | None = None  # where graph.py / inputs.safetensors are (absolute, for the caller)
    # every single op that fails alone, the culprit first: {op, node, inputs, source, status, stage, error_type,
    # message}; the repro is the first's
    failing_ops: list[dict[str, Any]] = field(default_factory=list)

    def to_details(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("out_dir")
        return d


def find_culprit(*, model: Mapping[str, Any], backend: Mapping[str, Any], seed: int, layers_dir: Path, module: str,
                 out_dir: Path, journal: Path, limits: HangLimits, startup_timeout: float, budget_s: float,
                 hints: Sequence[str] = (), env: Mapping[str, str] | None = None, max_restarts: int = 16,
                 all_singles: bool = True) -> CulpritResult:
    """The culprit search for one module (`find_culprits` with one target)."""
    target = CulpritTarget(module=module, out_dir=str(out_dir), hints=list(hints))
    return find_culprits(model=model, backend=backend, seed=seed, layers_dir=layers_dir, targets=[target],
                         journal=journal, limits=limits, startup_timeout=startup_timeout,
                         budget_s=budget_s, env=env, max_restarts=max_restarts, all_singles=all_singles)[0]


def find_culprits(*, model: Mapping[str, Any], backend: Mapping[str, Any], seed: int, layers_dir: Path,
                  targets: Sequence[CulpritTarget], journal: Path, limits: HangLimits, startup_timeout: float,
                  budget_s: float, env: Mapping[str, str] | None = None, max_restarts: int = 16,
                  all_singles: bool = True) -> list[CulpritResult]:
    """Run the culprit searches of `targets` (a cell's findings) in isolated children until each is done, out of
    time or out of restarts: one child serves them all, in order, so the model, its inputs and the backend are
    loaded once. A child that dies in a probe has that probe recorded crashed (or timeout) in its target's
    `probes.jsonl` and a fresh child goes on where it stopped. `budget_s` is per target; each result's
    `seconds` is its own search plus an equal share of the children's fixed costs (start, model, backend)."""
    t0 = time.monotonic()
    if not targets:
        return []
    by_module = {t.module: t for t in targets}
    for t in targets:
        d = Path(t.out_dir)
        d.mkdir(parents=True, exist_ok=True)
        for name in ("probes.jsonl", ANSWER, "graph.json"):
            (d / name).unlink(missing_ok=True)
    timeout_file = Path(targets[0].out_dir) / "timeout.txt"
    limits_file = Path(targets[0].out_dir) / "limits.jsonl"
    limits_file.unlink(missing_ok=True)
    total = budget_s * len(targets)
    deadline = time.monotonic() + total

    def unanswered() -> int:
        return sum(1 for t in targets if not (Path(t.out_dir) / ANSWER).exists())

    def next_attempt(children: int) -> Attempt | str | None:
        if not unanswered():
            return None
        left = deadline - time.monotonic()
        if left < min(20.0, budget_s / 2):
            return "the time for the culprit search ran out"
        timeout_file.unlink(missing_ok=True)
        plan = CulpritPlan(model=dict(model), backend=dict(backend), seed=seed, layers_dir=str(layers_dir),
                           targets=[asdict(t) for t in targets], timeout_file=str(timeout_file),
                           limits=limits.to_json(), limits_file=str(limits_file), deadline_wall=time.time() + left - 5.0,
                           target_budget_s=budget_s, all_singles=all_singles)
        # past probe_timeout a probe is a hang only when it makes no progress (the watch); a busy one runs on to its
        # second limit (the child's own watchdog, `procs/limits.ChildLimits`), or to its target's time
        return Attempt(payload=asdict(plan), timeout=left,
                       watch=limits.watch(journal, KIND, since=Journal(journal).size()))

    def on_crash(entry: str | None, res: IsolatedResult) -> str | None:
        if res.status == "error":
            return f"the culprit child failed outside any probe: {res.error_type}: {first_line(res.message)}"
        if entry is None:
            return f"the culprit child {res.message or res.status} before it probed anything"
        module, key = parse_entry(entry)
        target = by_module.get(module, targets[0])
        timed_out = res.status == "timeout" or _nonempty(timeout_file)
        dead = dead_item(res, timed_out=timed_out, limits=limits, record=item_limits(limits_file).get(entry))
        if dead is not None and dead.verdict == "hung":
            r = ProbeOutcome(name=key, status="timeout", stage="run", error_type="Timeout", duration_s=dead.seconds,
                            message=f"the probe {dead.words}; the child was killed",
                            traceback=file_tail(timeout_file) or res.stderr_tail[-3000:])
        elif dead is not None:  # cut short by the search's time while busy: no verdict (not a failing range)
            r = ProbeOutcome(name=key, status=UNFINISHED, stage="run", duration_s=dead.seconds,
                            message=f"the probe {dead.words}")
        else:
            why = res.signal or (f"exit code {res.exit_code}" if res.exit_code is not None else res.status)
            r = ProbeOutcome(name=key, status="crashed", stage="run", error_type=res.signal or "Crash",
                            message=f"the process died ({why}) while the probe ran", signal=res.signal,
                            traceback=res.stderr_tail[-3000:])
        append_outcome(Path(target.out_dir) / "probes.jsonl", r)
        return None

    run = supervise("ci_runner.modes.layers.culprit:culprit_child", journal=journal, kind=KIND, next_attempt=next_attempt,
                    on_crash=on_crash, max_restarts=max_restarts, env=env)
    wall = time.monotonic() - t0
    answers = [_read_json(Path(t.out_dir) / ANSWER) for t in targets]
    own = [float(a.get("own_seconds") or 0.0) for a in answers]
    shared = max(0.0, wall - sum(own)) / len(targets)
    return [_result(t, a, run, round(o + shared, 3)) for t, a, o in zip(targets, answers, own)]


def _result(target: CulpritTarget, answer: Mapping[str, Any], run: Any, seconds: float) -> CulpritResult:
    """One target's `CulpritResult` from its folder (answer.json, graph.json, probes.jsonl)."""
    out_dir = Path(target.out_dir)
    known = read_outcomes(out_dir / "probes.jsonl")
    graph = _read_json(out_dir / "graph.json")
    steps = [Step(**s) for s in graph.get("steps", [])]
    common = {"graph_nodes": len(steps), "level": graph.get("level"), "probes": len(known),
              "restarts": run.restarts, "seconds": seconds, "out_dir": str(out_dir)}
    if not answer:
        return CulpritResult(found=False, kind="error" if run.stop_reason else "incomplete",
                             note=run.stop_reason or "the search did not finish", **common)
    key = answer.get("key")
    if not key or answer.get("kind") not in ("single", "range"):
        return CulpritResult(found=False, kind=str(answer.get("kind")), note=str(answer.get("note") or ""), **common)
    s, e = parse_key(key)
    r = known.get(key)
    chosen = steps[s:e]
    note = str(answer.get("note") or "")
    if graph.get("note"):
        note = "; ".join(x for x in (note, str(graph["note"])) if x)
    return CulpritResult(found=True, kind=str(answer["kind"]), ops=list(dict.fromkeys(st.op for st in chosen)),
                         failing_ops=_failing_ops(answer, steps, known),
                         nodes=[st.node for st in chosen], node_ops=[st.op for st in chosen], node_range=[s, e],
                         inputs=[st.inputs for st in chosen], sources=[st.source for st in chosen],
                         status=r.status if r else None, stage=r.stage if r else None,
                         error_type=r.error_type if r else None,
                         message=cause_line(r.message, boilerplate_lines(), 400) if r else "", note=note, **common)


def _failing_ops(answer: Mapping[str, Any], steps: Sequence[Step], known: Mapping[str, ProbeOutcome]) -> list[dict[str, Any]]:
    """Each single op that failed alone (`answer["failing"]`, in probe order), with its probe's outcome."""
    out = []
    for key in answer.get("failing") or ():
        s, _ = parse_key(str(key))
        r = known.get(str(key))
        if s >= len(steps) or r is None:
            continue
        out.append({"op": steps[s].op, "node": steps[s].node, "inputs": steps[s].inputs, "source": steps[s].source,
                    "status": r.status, "stage": r.stage, "error_type": r.error_type,
                    "message": cause_line(r.message, boilerplate_lines(), 400)})
    return out


def write_repro(result: CulpritResult, *, context: Mapping[str, Any],
                verify: Callable[[Path, CulpritResult], Verification | None]) -> dict[str, Any]:
    """Write `repro.py` next to the culprit's `graph.py` and `inputs.safetensors` (`templates/repro_culprit.py.j2`,
    `context`: the layer repro's template context) and verify it (`verify(script, result)`: the same failure
    as the culprit's probe, None when verification is off). Returns the `details.culprit.repro` entry (absolute
    path)."""
    assert result.out_dir is not None
    rdir = Path(result.out_dir)
    call = _read_json(rdir / "call.json").get("call")
    if call is None or not (rdir / "graph.py").exists():
        return {"path": str(rdir), "verified": False, "note": "the culprit's graph was not written"}
    what = (f"{result.ops[0]} fails alone" if result.kind == "single" else
            f"nodes {result.nodes[0]}..{result.nodes[-1]} ({len(result.nodes)} ops: {', '.join(result.ops)}) fail together; "
            f"no single op fails alone")
    node_lines = [f"{n}: {op_in}" for n, op_in in zip(result.nodes, _node_calls(result))]
    ctx = {**context, "run_it": run_command("repro.py", rdir, context.get("pythonpath") or ()), "call": call,
           "culprit_what": what, "layer": context.get("module"), "level": result.level,
           "node_lines": node_lines, "status": result.status or "fail", "stage": result.stage or "run",
           "error_type": result.error_type or "", "message": first_line(result.message, 200)}
    script = write_script(rdir / "repro.py", render_template("repro_culprit.py.j2", **ctx))
    ver = verify(script, result)
    note = "not verified" if ver is None else ver.note
    return {"path": str(script), "verified": bool(ver and ver.verified), "note": note, "command": ctx["run_it"]}


def _node_calls(result: CulpritResult) -> list[str]:
    out = []
    for i, inputs in enumerate(result.inputs):
        src = result.sources[i] if i < len(result.sources) else None
        op = result.node_ops[i] if i < len(result.node_ops) else ""
        out.append(f"{op}({', '.join(inputs)})" + (f" <- {src}" if src else ""))
    return out


def hints_from_error(message: str, traceback_text: str = "") -> list[str]:
    """Op names the layer's error text mentions (probed first)."""
    out: list[str] = []
    for text in (message, traceback_text):
        op, _ = named_op_from_error(text or "")
        if op:
            out.append(op)
            out.append(".".join(op.split(".")[:2]))
    return list(dict.fromkeys(out))


# the ops mode's statuses, the one its finding reports first (its severity order), then inconclusive, then pass
_OPS_STATUS_ORDER = ("unsupported", "crashed", "timeout", "error", "mismatch", "probe_error", "inconclusive", "pass")


def ops_cross_check(ops_probes: Iterable[Mapping[str, Any]], culprit_ops: Sequence[str]) -> dict[str, str]:
    """For each culprit op the same cell's ops mode probed: its status there, the one the ops mode's finding for
    that op reports when it has one (the most severe over the op's signatures). `pass` alone is the signal that
    the failure depends on the real shapes or values."""
    out: dict[str, str] = {}
    for row in ops_probes:
        op = str(row.get("op") or "")
        status = str(row.get("status") or "")
        if op not in culprit_ops or status not in _OPS_STATUS_ORDER:
            continue
        if op not in out or _OPS_STATUS_ORDER.index(status) < _OPS_STATUS_ORDER.index(out[op]):
            out[op] = status
    return out


def _nonempty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

