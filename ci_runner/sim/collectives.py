"""The tensor-parallel self-test backends: each rewrites one collective or one projection of the ATen graph.

A sharded model compiled after `aot_autograd` shows its collectives as functional ops:
`_c10d_functional.all_reduce(x, "sum", group)` followed by `_c10d_functional.wait_tensor`. These backends change
the forward graph in one documented place (the rank's graph, the same rewrite on every rank, so no rank waits for
another) and run the rest with the eager kernels:

* `sim-tp-drop`: the `nth` all-reduce (default 1: with the default decoder plan, layer 0's attention `o_proj`;
  0 is the embedding's) is removed: each rank keeps its partial sum.
* `sim-tp-dup`: the `nth` all-reduce is done twice: the output is tp × the reference.
* `sim-tp-shard`: the `nth` weight transposed for a matmul (default 0: layer 0's `q_proj` under the default plan)
  has its rows (the rank's output features) reversed first, as a backend that lays out a colwise shard the wrong
  way: the projection's output features come out permuted.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .compilers import SimCompilerError, aot_backend


def _all_reduces(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target is torch.ops._c10d_functional.all_reduce.default]


def _wait_of(node: torch.fx.Node) -> torch.fx.Node:
    waits = [u for u in node.users if u.target is torch.ops._c10d_functional.wait_tensor.default]
    if len(waits) != 1:
        raise SimCompilerError(str(node.target), node.name)
    return waits[0]


def _nth(nodes: list[torch.fx.Node], nth: int) -> torch.fx.Node | None:
    return nodes[nth] if 0 <= nth < len(nodes) else None


def drop_reduce(gm: torch.fx.GraphModule, nth: int) -> bool:
    """Remove the `nth` all-reduce (its wait's users read the rank's own partial input). True when one was."""
    node = _nth(_all_reduces(gm), nth)
    if node is None:
        return False
    wait = _wait_of(node)
    wait.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(wait)
    gm.graph.erase_node(node)
    gm.recompile()
    return True


def duplicate_reduce(gm: torch.fx.GraphModule, nth: int) -> bool:
    """All-reduce the `nth` all-reduce's result once more. True when there was one."""
    node = _nth(_all_reduces(gm), nth)
    if node is None:
        return False
    wait = _wait_of(node)
    users = list(wait.users)
    with gm.graph.inserting_after(wait):
        again = gm.graph.call_function(node.target, (wait, *node.args[1:]), dict(node.kwargs))
    with gm.graph.inserting_after(again):
        again_wait = gm.graph.call_function(wait.target, (again,), {})
    for user in users:
        user.replace_input_with(wait, again_wait)
    gm.recompile()
    return True


def reverse_weight_rows(gm: torch.fx.GraphModule, nth: int) -> bool:
    """Reverse the rows of the `nth` graph input that is transposed for a matmul (`aten.t` of a 2-D input)."""
    ts = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.t.default
          and isinstance(n.args[0], torch.fx.Node) and n.args[0].op == "placeholder"]
    node = _nth(ts, nth)
    if node is None:
        return False
    weight = node.args[0]
    with gm.graph.inserting_before(node):
        flipped = gm.graph.call_function(torch.ops.aten.flip.default, (weight, [0]), {})
    node.replace_input_with(weight, flipped)
    gm.recompile()
    return True


_REWRITES: dict[str, Callable[[torch.fx.GraphModule, int], bool]] = {
    "drop": drop_reduce, "dup": duplicate_reduce, "shard": reverse_weight_rows,
}


def make_collective(kind: str, *, nth: int | None = None) -> Any:
    """sim-tp-drop / sim-tp-dup / sim-tp-shard (see the module docstring): the rewrite applied to the first graph
    that has its `nth` collective (or weight); later graphs of the same backend object are left alone."""
    which = (0 if kind == "shard" else 1) if nth is None else int(nth)
    done: list[bool] = []

    def fw(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if not done and _REWRITES[kind](gm, which):
            done.append(True)
        return gm.forward

    return aot_backend(fw, f"sim_tp_{kind}")
