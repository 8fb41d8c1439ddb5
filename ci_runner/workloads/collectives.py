"""The collectives of a tensor-parallel run, found in the graphs a backend sees and each run alone on the backend.

A sharded model compiled after `aot_autograd` shows its DTensor redistributions as functional collectives
(`_c10d_functional.all_reduce`, `all_gather_into_tensor`, `reduce_scatter_tensor`, …, each followed by
`wait_tensor`). `collective_calls` lists the distinct calls of a set of ATen graphs: the op, the input's shape and
dtype, its other arguments (the reduce op, the group size; the group's name, always last, left out) and how often
it is called. `probe_collectives` runs each call alone, on every rank at once (a probe is a collective itself), as
a one-op function through the backend's `compile`, and compares it with the same call run eagerly: `ok`,
`unsupported` (compile or run raised: the backend's error, first line) or `mismatch`. Without calls it probes
the plan's two (`PLAN_CALLS`). `repro_values` gives a repro script (`templates/repro_collective.py.j2`) the same
call; the script starts ranks of its own.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..backends.ran import CompileWatch
from ..engine.repro import render_template, template_backend, write_script
from ..failures.diagnostics import capture_fd2, compiler_words
from ..failures.failure import classify, first_line
from ..watch.hooks import record_aten_graphs
from ..models.load import model_module_stack, normalize_module_path

NAMESPACE = "_c10d_functional"
WAIT = "_c10d_functional.wait_tensor.default"
# the plan's styles → the functional collectives their redistributions become (workloads/tpplan.py's styles)
PLAN_CALLS: tuple[dict[str, Any], ...] = (
    {"op": "_c10d_functional.all_reduce.default", "shape": [8], "dtype": "float32", "args": ["sum"], "count": 0},
    {"op": "_c10d_functional.all_gather_into_tensor.default", "shape": [8], "dtype": "float32", "args": ["@world"],
     "count": 0},
)
COLLECTIVES = {c["op"].split(".")[1]: c["op"] for c in PLAN_CALLS}


def collective_calls(graphs: Iterable[torch.fx.GraphModule]) -> list[dict[str, Any]]:
    """The distinct functional collective calls of `graphs` (op, shape, dtype, args), in first-call order, each
    with its call count and the first module that made it (`nn_module_stack`)."""
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op != "call_function" or not name.startswith(NAMESPACE + ".") or name == WAIT:
                continue
            val = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
            if val is None:
                continue
            args = [a if isinstance(a, (int, float, str)) else str(a) for a in node.args[1:-1]]
            key = (name, tuple(val.shape), str(val.dtype), tuple(map(str, args)))
            stack = model_module_stack(node.meta)
            module = normalize_module_path(stack[-1][0]) if stack else ""
            row = out.setdefault(key, {"op": name, "shape": [int(d) for d in val.shape],
                                       "dtype": str(val.dtype).removeprefix("torch."), "args": args, "count": 0,
                                       "module": module})
            row["count"] += 1
    return list(out.values())


def lone_call(call: Mapping[str, Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The call alone: the collective on the world group, then its wait (as the graph has them)."""
    import torch.distributed as dist  # deferred: rank children only

    namespace, name, overload = str(call["op"]).split(".")
    op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    group = dist.group.WORLD.group_name  # type: ignore[union-attr]
    args = [dist.get_world_size() if a == "@world" else a for a in call["args"]]
    return lambda x: torch.ops._c10d_functional.wait_tensor(op(x, *args, group))


def probe_input(call: Mapping[str, Any], rank: int) -> torch.Tensor:
    """The probe's input on `rank`: 0, 1, 2, … in the call's shape and dtype, plus the rank (ranks differ)."""
    shape = [int(d) for d in call["shape"]]
    return (torch.arange(math.prod(shape), dtype=torch.float64) % 97 + rank).reshape(shape).to(getattr(torch, call["dtype"]))


def probe_collectives(compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
                      calls: Sequence[Mapping[str, Any]] = PLAN_CALLS, *, device: str = "cpu",
                      compile_name: str | None = None) -> list[dict[str, Any]]:
    """One row per call: {"op", "call", "status", "error_type", "stage", "message"} on this rank; the inputs on
    `device` (the mesh's: a device's own process group takes its device's tensors), compared on CPU. Where the
    backend has a vendor watch (`backends.ran.CompileWatch(compile_name).active`), a right result the backend left
    to PyTorch (OpenVINO's partitioner leaves a lone collective outside its partitions) is `not_ran`, not `ok`."""
    import torch.distributed as dist  # deferred: rank children only

    rows = []
    for call in calls:
        fn = lone_call(call)
        x = probe_input(call, dist.get_rank()).to(device)
        want = fn(x.clone()).cpu()
        row: dict[str, Any] = {"op": call["op"], "call": dict(call), "status": "ok", "error_type": None, "message": ""}
        err = [""]
        try:
            torch._dynamo.reset()
            # `compile_fn` is the rank's plain compile: only the backend's own fallback watch is read here
            with CompileWatch(compile_name) as watch, capture_fd2() as err:  # a native compiler's words: fd 2
                got = compile_fn(fn)(x.clone()).cpu()
            if not torch.equal(got, want):
                row.update(status="mismatch", message=f"max abs difference {float((got - want).abs().max()):.3g}")
            elif watch.active and (left := _left_to_eager(watch.vendor, str(call["op"]))):
                row.update(status="not_ran", message=left)
        except Exception as exc:  # the backend's refusal is the probe's result
            failure = classify(exc)  # the backend's own error, unwrapped from Dynamo's
            message = first_line(failure.message, 600)
            words, _ = compiler_words(err[0], exc, message)  # IREE's cause, past its boilerplate first line
            row.update(status="unsupported", error_type=failure.error_type, stage=failure.stage,
                       message="\n".join([message, *words])[:2000])
        rows.append(row)
        dist.barrier()
    return rows


def _left_to_eager(watch: Any, op: str) -> str | None:
    """Why a lone collective's right result does not show the backend ran it: its vendor watch's fallback reason,
    or the collective among the ops its partitioner left to PyTorch eager (`eager_ops`); None when it ran."""
    reason = watch.reason()
    if reason:
        return str(reason)[:600]
    name = op.split(".")[1] if op.count(".") >= 2 else op
    eager = [str(o) for o in watch.facts().get("eager_ops", [])]
    if any(name in o for o in eager):
        return f"the backend left the collective to PyTorch eager (ops outside its partitions: {', '.join(eager)})"
    return None


def repro_values(call: Mapping[str, Any]) -> dict[str, Any]:
    """The template values (`repro_collective.py.j2`) that rebuild `call` in a repro's own ranks."""
    namespace, name, overload = str(call["op"]).split(".")
    return {"namespace": namespace, "op_name": name, "overload": overload, "shape": [int(d) for d in call["shape"]],
            "dtype": str(call["dtype"]), "call_args": list(call["args"])}


def merge_rows(every: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Every rank's probe rows (same calls, same order) as one row per call: the worst status over the ranks
    (unsupported, then mismatch, then not_ran, then ok), the first such rank's error, and the ranks it had."""
    order = {"unsupported": 0, "mismatch": 1, "not_ran": 2, "ok": 3}
    out = []
    for per_rank in zip(*every):
        worst = min(range(len(per_rank)), key=lambda r: (order.get(per_rank[r]["status"], 4), r))
        row = dict(per_rank[worst])
        row["ranks"] = [r for r, x in enumerate(per_rank) if x["status"] == row["status"]]
        out.append(row)
    return out


def aten_graphs(module: torch.nn.Module, kwargs: Mapping[str, Any]) -> list[torch.fx.GraphModule]:
    """The ATen graphs an aot backend gets for `module(**kwargs)` (`torch.compile` + `aot_autograd` with a
    recording compiler, one graph per graph break), on the real (sharded) tensors: a DTensor model's collectives
    are in them."""
    return record_aten_graphs(module, (), kwargs)


def write_repro(path: Any, call: Mapping[str, Any], spec: Any, *, status: str, world: int, error_type: str,
                message: str, model_id: str, layout: str) -> Any:
    """The collective repro of `call` on backend `spec` at `path` (`templates/repro_collective.py.j2`: it starts
    `world` ranks of its own; exit 1 while the collective still fails)."""

    text = render_template("repro_collective.py.j2", op=call["op"], backend_id=spec.id, status=status, world=world,
                           error_type=error_type, message=message, model_id=model_id, layout=layout,
                           script=path.name, backend=template_backend(spec), **repro_values(call))
    return write_script(path, text)
