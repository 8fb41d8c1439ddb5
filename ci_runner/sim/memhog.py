"""`sim-memhog`: a compiler change that makes a layer need more memory, with the same results.

A Dynamo-level backend: the graph it is given runs op by op (`torch.fx.Interpreter`), and for the chosen instances it
keeps `copies` extra copies of every intermediate tensor until the graph returns, so that layer's peak memory grows by
about `copies` × its activations while its outputs stay bit-identical to eager. An instance is one distinct set of
parameters the graph runs with: layers that share one compiled graph (a decoder layer's `forward`, compiled once
and reused by every layer of the model, or one graph per layer) are numbered by their first call over every graph
this backend object compiles, so `instances: [0]` is the first layer
that runs, `[1]` the second. A graph without parameters is instance 0.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.fx

__all__ = ["make_memhog"]


class _Hoard(torch.fx.Interpreter):
    """Runs a graph and keeps `copies` clones of each intermediate tensor until the run ends."""

    def __init__(self, gm: torch.fx.GraphModule, copies: int) -> None:
        super().__init__(gm)
        self.copies = copies
        self.kept: list[torch.Tensor] = []

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module") and isinstance(out, torch.Tensor):
            self.kept += [out.clone() for _ in range(self.copies)]
        return out


def _param_positions(gm: torch.fx.GraphModule) -> list[int]:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return [i for i, name in enumerate(names) if "_parameters_" in name]


def make_memhog(instances: Iterable[int] | str = (0,), copies: int = 1) -> Callable[..., Any]:
    """The backend; `instances`: which instances hoard (`all`, or indices by first call), `copies` ≥ 1."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"sim-memhog: copies {copies!r} is not a whole number >= 1")
    chosen = None if instances == "all" else {int(i) for i in instances}  # type: ignore[union-attr]
    numbers: dict[tuple[int, ...], int] = {}  # parameters' memory -> instance, over every graph of this backend

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        positions = _param_positions(gm)

        def run(*args: Any) -> Any:
            key = tuple(args[i].data_ptr() for i in positions if i < len(args))  # the parameters' memory
            number = numbers.setdefault(key, len(numbers))
            if chosen is None or number in chosen:
                return _Hoard(gm, copies).run(*args)
            return gm(*args)

        return run

    return backend
