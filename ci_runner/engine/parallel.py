"""Tensor-parallel runs: N ranks as processes over gloo on CPU (or the device's own process group, when the cell's
backend declares one: `group_of`), and what a rank shares with the others.

The parent (`launch_ranks`) picks a free local port and starts one isolated child per rank through
`engine/isolate.run_isolated` (own session, dies with the parent, killed at the timeout), each running the same
target with its `rank`, `world` and `port` added to the payload. Inside a rank, `init_ranks` joins the gloo process
group with a collective timeout shorter than the child's, so a rank waiting for a peer that hangs fails with
gloo's own timeout instead of hanging too; `arrive` writes each rank's progress (`rank<r>.progress`, one line per
step), and `hang_report` turns the steps into "rank 1 did not arrive at `compile:aot_eager` (last: `shard`)".

`gather_outputs` brings every rank's captured module outputs together (on CPU); `assemble` makes one output of them: a
module whose output each rank holds a slice of (a colwise projection) is concatenated on its last dim, every other
one is rank 0's, with every rank's copy kept (a missing all-reduce leaves them different, summing to the
reference).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from .isolate import IsolatedResult, run_isolated

PROGRESS = "rank{rank}.progress"
COLLECTIVE_SLACK_S = 15.0  # a rank's collective timeout is the child's minus this: gloo's error comes first


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (bound and released: the ranks bind it at once after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankRun:
    """What the ranks of one launch did: each rank's child result, and the hang report when one timed out."""

    results: tuple[IsolatedResult, ...]
    hang: str | None = None

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def failed(self) -> list[tuple[int, IsolatedResult]]:
        return [(i, r) for i, r in enumerate(self.results) if not r.ok]

    def describe(self) -> str:
        """One line per failed rank: "rank 1 crashed (SIGSEGV)"; the hang report first."""
        lines = [self.hang] if self.hang else []
        lines += [f"rank {i} {r.describe()}" for i, r in self.failed()]
        return "; ".join(lines) or "all ranks finished"


def launch_ranks(target: str, payload: Mapping[str, Any], *, world: int, timeout: float, folder: Path,
                 env: Mapping[str, str] | None = None, collective_timeout: float | None = None) -> RankRun:
    """Run `target` ("module:function") in `world` ranks at once, each an isolated child given the payload plus
    `rank`, `world`, `port`, `progress` (its progress file) and `collective_timeout` (default: `timeout` less
    `COLLECTIVE_SLACK_S`)."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    results: list[IsolatedResult | None] = [None] * world

    def one(rank: int) -> None:
        progress = folder / PROGRESS.format(rank=rank)
        progress.write_text("", encoding="utf-8")
        body = {**payload, "rank": rank, "world": world, "port": port, "progress": str(progress),
                "collective_timeout": collective_timeout or max(5.0, timeout - COLLECTIVE_SLACK_S)}
        results[rank] = run_isolated(target, body, timeout=timeout, env=env)

    threads = [threading.Thread(target=one, args=(r,), name=f"deepview-rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = tuple(r for r in results if r is not None)
    hang = hang_report(folder, world) if any(r.status == "timeout" or "timed out" in r.message.lower()
                                             or "timeout" in r.message.lower() for r in done) else None
    return RankRun(results=done, hang=hang)


def read_progress(folder: Path, rank: int) -> list[str]:
    path = folder / PROGRESS.format(rank=rank)
    try:
        return [line for line in path.read_text(encoding="utf-8").splitlines() if line]
    except OSError:
        return []


def hang_report(folder: Path, world: int) -> str | None:
    """The ranks that did not arrive where the furthest rank got to (by their progress files), or None when
    every rank reached the same step."""
    steps = {r: read_progress(folder, r) for r in range(world)}
    furthest = max(steps.values(), key=len)
    if not furthest:
        return None
    behind = [r for r, s in steps.items() if len(s) < len(furthest)]
    if not behind:
        return f"ranks {', '.join(map(str, range(world)))} all reached `{furthest[-1]}`, then timed out in a collective"
    words = [f"rank {r} did not arrive at `{furthest[len(steps[r])]}` (last: `{steps[r][-1] if steps[r] else 'start'}`)"
             for r in behind]
    return "; ".join(words)


def arrive(payload: Mapping[str, Any], step: str) -> None:
    """Record that this rank reached `step` (appended to its progress file, flushed)."""
    with open(payload["progress"], "a", encoding="utf-8") as fh:
        fh.write(step + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def init_ranks(payload: Mapping[str, Any]) -> Any:
    """Join the process group of this launch; the 1-D device mesh over its ranks. gloo on CPU, unless the layout
    (`payload["parallel"]`) carries the device's own process group: the backend is prepared first (its env, its
    `import:` plugins, which may register the c10d backend, its device), then the ranks join that c10d backend
    and the mesh is on the backend's device type."""
    import torch.distributed as dist  # deferred: torch.distributed only in rank children
    from torch.distributed.device_mesh import init_device_mesh  # deferred: as above

    name, device = group_of(payload)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(payload["port"])
    dist.init_process_group(name, rank=int(payload["rank"]), world_size=int(payload["world"]),
                            timeout=datetime.timedelta(seconds=float(payload["collective_timeout"])))
    return init_device_mesh(device, (int(payload["world"]),))


def group_of(payload: Mapping[str, Any]) -> tuple[str, str]:
    """(c10d backend, device type) of a launch: ("gloo", "cpu"), or the declared process group once its backend
    is prepared in this rank; a name c10d does not know then is a `BackendError` listing the ones it knows."""
    group = (payload.get("parallel") or {}).get("process_group")
    if not group:
        return "gloo", "cpu"
    from ..backends.check import c10d_backends  # deferred: the declared group only
    from ..backends.spec import resolve_backend  # deferred: as above
    from ..config import BackendSpec, spec_from_json  # deferred: as above
    from ..errors import BackendError  # deferred: as above

    spec = spec_from_json(BackendSpec, group["backend"])
    resolve_backend(spec)  # env, imports, device: what a user's script does before init_process_group
    name = str(group["name"])
    if name.lower() not in c10d_backends():
        raise BackendError(f"backend {spec.id!r}: process_group {name!r} is not a c10d backend torch knows after "
                           f"its imports", hint=f"known: {', '.join(c10d_backends())}; a device's plugin registers its "
                           "own with torch.distributed.Backend.register_backend (list its module under `import:`)")
    return name, str(group["device"]).split(":")[0]


RANK_TASKS = "ci_runner.engine.parallel:rank_tasks"


def rank_tasks(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A rank running several tasks in one process group (`launch_ranks(RANK_TASKS, {..., "tasks": [...]})`):
    each "module:function" of `payload["tasks"]` is called in turn with (payload, mesh); {task: its value}. The
    modes' TP hooks each launch their own task; one launch can run several (the tests share one)."""
    import importlib  # deferred: a task's module is imported only in the rank that runs it

    mesh = init_ranks(payload)
    arrive(payload, "init")
    try:
        out: dict[str, Any] = {}
        for task in payload["tasks"]:
            module, _, name = str(task).partition(":")
            out[task] = getattr(importlib.import_module(module), name)(payload, mesh)
        return out
    finally:
        close_ranks()


def close_ranks() -> None:
    import torch.distributed as dist  # deferred: torch.distributed only in rank children

    if dist.is_initialized():
        dist.destroy_process_group()


def gather_outputs(records: Sequence[tuple[str, Sequence[tuple[str, Any]]]]) -> dict[str, dict[str, list[Any]]]:
    """Every rank's captured `(call key, flat outputs)` (the same keys in the same order on every rank) on every
    rank: per call key and sub-name, the list of the ranks' tensors (`assemble` makes one output of them)."""
    import torch  # deferred: torch in rank children only
    import torch.distributed as dist  # deferred: as above

    world = dist.get_world_size()
    out: dict[str, dict[str, list[Any]]] = {}
    for key, flat in records:
        for sub, tensor in flat:
            t = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            t = t.detach().contiguous()
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t)  # over the launch's process group, on the device
            out.setdefault(key, {})[sub] = [p.cpu() for p in parts]  # compared on CPU, with the references
    return out


def assemble(parts: Sequence[Any], full_shape: Sequence[int], *, sliced: bool) -> tuple[Any, list[Any] | None]:
    """One output from the ranks' tensors: (the full tensor, each rank's copy or None). A module output each rank
    holds a slice of (`sliced`: a colwise projection; or any output whose shape is the full one's with the last
    dim divided by the ranks, e.g. the activation between a colwise and a rowwise projection) is concatenated on
    the last dim; any other is rank 0's, with every rank's copy."""
    import torch  # deferred: torch in rank children only

    if not sliced and tuple(parts[0].shape) == tuple(full_shape):
        return parts[0], list(parts)
    return torch.cat(list(parts), dim=-1), None
