"""`simccl`: the self-test device's own process group, a c10d backend registered from Python on import.

A real accelerator's plugin registers its collective library with c10d (`torch.distributed.Backend.
register_backend`, as `hccl` or `xccl` are), and a matrix declares it on the backend (`process_group: simccl`, with
this module under `import:`): `ci_runner/workloads/parallel.py`, docs/parallel.md. Importing this module registers `simccl`
for the `simdev` device. Its process group (`SimcclGroup`, a Python `ProcessGroup`) does each collective on the
ranks' tensors by copying them to the CPU, running gloo's collective on the copies (its own gloo group on the same
store) and copying the results back into the given tensors; the returned work is already complete. So a collective
over simdev tensors is gloo's to the bit, and `counts` says which collectives ran on which device type (a test sees
that the sharded model's all-reduces went through it, on simdev tensors).

What torch 2.13 needs of a Python process group (measured): the `ProcessGroup` subclass is the whole group (a
Python `Backend` cannot be subclassed: "No constructor defined"), so `init_process_group("simccl")` makes it the
default group; it keeps its own group name and description (`DeviceMesh` reads `group_name`: "ProcessGroup name
not set" otherwise); every collective DTensor calls must be overridden (the C++ default looks up a per-device
backend: "No backend type associated with device type simdev"): `scatter` (sharding a weight), `allreduce`,
`allgather_into_tensor_coalesced` and `reduce_scatter_tensor_coalesced` (where the trampoline sends the functional
`all_gather_into_tensor` and `reduce_scatter_tensor`, found by probing), `allgather` and `broadcast` (objects).
"""

from __future__ import annotations

import datetime
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, _create_work_from_future
from torch.futures import Future

NAME = "simccl"
DEVICES = ("simdev",)


def _host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().cpu() for t in tensors]


def _back(tensors: Sequence[torch.Tensor], host: Sequence[torch.Tensor]) -> None:
    for t, h in zip(tensors, host):
        t.copy_(h)


class SimcclGroup(dist.ProcessGroup):
    """simdev's process group: gloo's collectives on CPU copies of the tensors (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, world)
        self._gloo = dist.ProcessGroupGloo(store, rank, world, timeout)
        self._name = ""
        self._desc = ""
        self.counts: Counter[str] = Counter()

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return NAME

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    def getGroupName(self) -> str:  # noqa: N802 - c10d's name
        return self._name

    def getGroupDesc(self) -> str:  # noqa: N802 - c10d's name
        return self._desc

    def _done(self, what: str, tensors: Sequence[torch.Tensor], result: Any) -> Any:
        self.counts[f"{what}:{tensors[0].device.type if tensors else 'none'}"] += 1
        fut: Future[Any] = Future()
        fut.set_result(result)
        return _create_work_from_future(fut)

    def _run(self, what: str, call: Callable[[], Any], seen: Sequence[torch.Tensor], result: Any) -> Any:
        call().wait()
        return self._done(what, seen, result)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        host = _host(tensors)
        work = self._run("allreduce", lambda: self._gloo.allreduce(host, opts or dist.AllreduceOptions()), tensors, tensors)
        _back(tensors, host)
        return work

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        host_out, host_in = [_host(o) for o in outputs], _host(inputs)
        work = self._run("allgather", lambda: self._gloo.allgather(host_out, host_in, opts or AllgatherOptions()),
                         inputs, outputs)
        for out, host in zip(outputs, host_out):
            _back(out, host)
        return work

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        """`_c10d_functional.all_gather_into_tensor` (and its coalesced form) lands here."""
        host = _host(outputs)
        for out, inp in zip(host, inputs):
            self._gloo._allgather_base(out, inp.detach().cpu(), opts or AllgatherOptions()).wait()
        _back(outputs, host)
        return self._done("all_gather_into_tensor", inputs, outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        """`_c10d_functional.reduce_scatter_tensor` (and its coalesced form) lands here."""
        host = _host(outputs)
        for out, inp in zip(host, inputs):
            self._gloo._reduce_scatter_base(out, inp.detach().cpu(), opts or dist.ReduceScatterOptions()).wait()
        _back(outputs, host)
        return self._done("reduce_scatter_tensor", inputs, outputs)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        host = _host(tensors)
        work = self._run("broadcast", lambda: self._gloo.broadcast(host, opts or dist.BroadcastOptions()), tensors, tensors)
        _back(tensors, host)
        return work

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None) -> Any:
        host_out, host_in = _host(outputs), [_host(i) for i in inputs]
        work = self._run("scatter", lambda: self._gloo.scatter(host_out, host_in, opts or dist.ScatterOptions()),
                         outputs, outputs)
        _back(outputs, host_out)
        return work

    def barrier(self, opts: Any = None) -> Any:
        return self._run("barrier", lambda: self._gloo.barrier(opts or dist.BarrierOptions()), [], [])


def create(store: Any, rank: int, world: int, timeout: datetime.timedelta) -> SimcclGroup:
    """c10d's creator of `simccl` (`register_backend`): the group of this rank."""
    return SimcclGroup(store, rank, world, timeout)


def register() -> None:
    """Register `simccl` with c10d for simdev (idempotent; done on import)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, create, devices=list(DEVICES))


register()
