"""The two ways this tool looks inside a model's run, each written once.

* `ModuleHooks`: forward pre- and post-hooks over named modules, removed on exit (always) or by `remove()`. Each
  hook is made by a factory that gets the module's qualified name, so one hook knows whose call it sees. Pre-hooks
  get `(module, args, kwargs)`; post-hooks `(module, args, output)`, or `(module, args, kwargs, output)` with
  `post_kwargs`; `always_call` runs the post-hooks of a call that raised too. Every module in the package that hooks
  a model's modules does it through this class (`watch/capture.py`'s `ModuleCapture` and `OutputHooks`, the
  workload's per-module capture, the memory tracker, …; `tests/unit/test_architecture_watch.py`).
* `aten_recording` / `record_aten_graphs`: the ATen graphs a torch.compile backend would be given, recorded: the
  callable compiled with `aot_autograd(fw_compiler=<keep>)` (one graph per graph break) between two Dynamo resets.
  The context manager gives the compiled callable and the list the graphs land in, for a caller that runs a whole
  workload through it; `record_aten_graphs(fn, args, kwargs)` calls it once (under `no_grad`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

__all__ = ["ModuleHooks", "aten_recording", "record_aten_graphs", "keep_graph"]

HookFactory = Callable[[str], Callable[..., Any]]


class ModuleHooks:
    """Forward hooks on `modules` ((qualified name, module) pairs), registered at construction: `pre(name)` and
    `post(name)` make each module's hooks (None: none of that kind). A context manager: the hooks are removed on
    exit; `remove()` removes them earlier (idempotent). `prepend`: the pre-hooks run before the module's own (the
    inputs as the caller passed them, before a tensor-parallel style's hook turns them into DTensors)."""

    def __init__(self, modules: Iterable[tuple[str, nn.Module]], *, pre: HookFactory | None = None,
                 post: HookFactory | None = None, post_kwargs: bool = False, always_call: bool = False,
                 prepend: bool = False) -> None:
        self.handles: list[Any] = []
        try:
            for name, module in modules:
                if pre is not None:  # `prepend`: before the module's other pre-hooks (a parallel style's)
                    self.handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True, prepend=prepend))
                if post is not None:
                    self.handles.append(module.register_forward_hook(post(name), with_kwargs=post_kwargs,
                                                                     always_call=always_call))
        except BaseException:
            self.remove()
            raise

    def __enter__(self) -> "ModuleHooks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def keep_graph(graphs: list[torch.fx.GraphModule]) -> Callable[..., Any]:
    """The recording forward compiler: keeps each graph in `graphs` and runs it as it is."""
    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm
    return keep


@contextmanager
def aten_recording(fn: Callable[..., Any], *, fw_compiler: Callable[..., Any] | None = None,
                   cpu_seconds: list[float] | None = None,
                   **compile_options: Any) -> Iterator[tuple[Callable[..., Any], list[torch.fx.GraphModule]]]:
    """`with aten_recording(fn, dynamic=False) as (compiled, graphs):` — `fn` compiled with `aot_autograd` and a
    recording forward compiler (`keep_graph`, or `fw_compiler`, which then records what it wants), after a Dynamo
    reset and with another on exit; `graphs` gets each ATen graph as the callable is called. `cpu_seconds`, when
    given, gets (in its first item) the CPU seconds spent in aot_autograd and the compiler."""
    from torch._dynamo.backends.common import aot_autograd  # deferred: Dynamo takes seconds to import

    graphs: list[torch.fx.GraphModule] = []
    aot = aot_autograd(fw_compiler=fw_compiler if fw_compiler is not None else keep_graph(graphs))

    def timed(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        c = time.process_time()
        try:
            return aot(gm, example_inputs)
        finally:
            cpu_seconds[0] += time.process_time() - c  # type: ignore[index]

    torch._dynamo.reset()
    try:
        yield torch.compile(fn, backend=aot if cpu_seconds is None else timed, **compile_options), graphs
    finally:
        torch._dynamo.reset()


def record_aten_graphs(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                       dynamic: bool | None = False) -> list[torch.fx.GraphModule]:
    """The ATen graphs an aot backend gets for `fn(*args, **kwargs)` (one call, under `no_grad`; one graph per
    graph break)."""
    with aten_recording(fn, dynamic=dynamic) as (compiled, graphs), torch.no_grad():
        compiled(*args, **dict(kwargs or {}))
    return graphs
