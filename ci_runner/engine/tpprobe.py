"""Each collective a tensor-parallel plan uses, alone on the backend: the ops-mode view of a sharded run.

A sharded model compiled after `aot_autograd` shows its collectives as functional ops
(`_c10d_functional.all_reduce`, `all_gather_into_tensor`, each followed by `wait_tensor`). When a backend fails on
the sharded model, `probe_collectives` runs each of them alone, on every rank at once (the probes are collectives
themselves), as a one-op function through `torch.compile(backend=…)`, and compares it with the same collective
run eagerly: `ok`, `unsupported` (compile or run raised: the backend's error, first line) or `mismatch`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .failure import classify, first_line

# the plan's styles → the functional collectives their redistributions become (engine/tpplan.py's styles)
COLLECTIVES: dict[str, str] = {
    "all_reduce": "_c10d_functional.all_reduce.default",
    "all_gather_into_tensor": "_c10d_functional.all_gather_into_tensor.default",
}


def _collective(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    import torch.distributed as dist  # deferred: rank children only
    import torch.distributed._functional_collectives as funcol  # deferred: as above

    group = dist.group.WORLD
    if name == "all_reduce":
        return lambda x: funcol.all_reduce(x, "sum", group)
    return lambda x: funcol.all_gather_tensor(x, 0, group)


def probe_collectives(compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> list[dict[str, Any]]:
    """One row per collective of `COLLECTIVES`: {"op", "status", "error_type", "message"} on this rank."""
    import torch.distributed as dist  # deferred: rank children only

    rows = []
    x = torch.arange(8, dtype=torch.float32) + dist.get_rank()
    for name, op in COLLECTIVES.items():
        fn = _collective(name)
        want = fn(x.clone())
        row: dict[str, Any] = {"op": op, "status": "ok", "error_type": None, "message": ""}
        try:
            torch._dynamo.reset()
            got = compile_fn(fn)(x.clone())
            if not torch.equal(got, want):
                row.update(status="mismatch", message=f"max abs difference {float((got - want).abs().max()):.3g}")
        except Exception as exc:  # the backend's refusal is the probe's result
            failure = classify(exc)  # the backend's own error, unwrapped from Dynamo's
            row.update(status="unsupported", error_type=failure.error_type, stage=failure.stage,
                       message=first_line(failure.message, 600))
        rows.append(row)
        dist.barrier()
    return rows
