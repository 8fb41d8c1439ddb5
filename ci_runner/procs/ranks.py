"""Tensor-parallel runs: N ranks as processes over gloo on CPU (or the device's own process group, when the cell's
backend declares one: `group_of`), and what a rank shares with the others.

The parent (`launch_ranks`) picks a free local port and starts one isolated child per rank through
`procs/isolate.run_isolated` (own session, dies with the parent, killed at the timeout), each running the same
target with its `rank`, `world` and `port` added to the payload. Inside a rank, `init_ranks` joins the gloo process
group with a collective timeout shorter than the child's, so a rank waiting for a peer that hangs fails with
gloo's own timeout instead of hanging too; `arrive` writes each rank's progress (`rank<r>.progress`, one line per
step), and `hang_report` turns the steps into "rank 1 did not arrive at `compile:aot_eager` (last: `shard`)".

A cell launches its ranks once (`BackgroundLaunch`, owned by the cell's `CellRanks`, below): `rank_tasks`
runs every selected mode's declared rank task (`registry.ModeSpec.rank_task`) in turn in one process group, each
given the launch's common payload plus its own part (`payload["parts"][task]`). Each rank records each task as it
finishes (`task<i>.rank<r>.json` in the launch folder, written atomically: rank 0's holds the task's value), so a
rank that dies or hangs in a later task leaves the earlier tasks' values; a task that raises is that task's error
only, and the next task runs. `BackgroundLaunch.take` hands one task's outcome over as soon as every rank recorded
it (`TaskRun`: the ranks' view of that task, as a `RankRun`). Inside a rank the layout is read once, typed
(`workloads.parallel.layout_of`: the `ParallelSpec` of the payload's `parallel` key).

`gather_outputs` brings every rank's captured module outputs together (on CPU); `assemble` makes one output of them: a
module whose output each rank holds a slice of (a colwise projection) is concatenated on its last dim, every other
one is rank 0's, with every rank's copy kept (a missing all-reduce leaves them different, summing to the
reference).

`CellRanks` (a cell's `ModeContext.ranks()`) is the cell's one launch. A mode declares what it does in each rank
in its registration (`registry.ModeSpec.rank_task`, called with (payload, mesh); `rank_payload`, (ctx) -> its own
part of the payload). The first time a cell with
`parallel: {tp: N}` starts such a mode (`run/cellrun.py` calls `start` before the mode runs; a mode may call it
itself), `CellRanks` launches the ranks ONCE (`BackgroundLaunch`, in a thread of its own: the
single-rank parts of the modes run beside them) with the tasks of every selected mode that declares one, in mode
order, in the launch folder ``<cell>/parallel/`` (the ranks' progress files and each task's records). Each mode
then takes its own task's outcome (`take`: rank 0's value, and the ranks' view of that task for hang and crash
reports) as soon as every rank finished that task. The launch's timeout is the cell's time left when it starts,
less 10 s (at least 60 s). Nothing here names a mode.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from ..backends.check import c10d_backends
from ..backends.spec import resolve_backend
from ..config import BackendSpec, spec_from_json, spec_to_json
from ..errors import BackendError
from ..fsutil import atomic_write_json
from ..registry import ModeSpec, load_ref, mode_spec, modes
from ..workloads.parallel import ParallelSpec, spec_from_key
from .isolate import IsolatedResult, run_isolated

PROGRESS = "rank{rank}.progress"
TASK_RECORD = "task{index}.rank{rank}.json"  # what a rank recorded of one task of `rank_tasks` (in the launch folder)
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

    name, device = group_of(spec_from_key(payload.get("parallel")))  # a bare launch (no layout): gloo
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(payload["port"])
    dist.init_process_group(name, rank=int(payload["rank"]), world_size=int(payload["world"]),
                            timeout=datetime.timedelta(seconds=float(payload["collective_timeout"])))
    return init_device_mesh(device, (int(payload["world"]),))


def group_of(layout: ParallelSpec | None) -> tuple[str, str]:
    """(c10d backend, device type) of a launch: ("gloo", "cpu"), or the declared process group once its backend
    is prepared in this rank; a name c10d does not know then is a `BackendError` listing the ones it knows."""
    group = layout.process_group if layout is not None else None
    if group is None:
        return "gloo", "cpu"
    spec = spec_from_json(BackendSpec, dict(group.backend))
    resolve_backend(spec)  # env, imports, device: what a user's script does before init_process_group
    name = group.name
    if name.lower() not in c10d_backends():
        raise BackendError(f"backend {spec.id!r}: process_group {name!r} is not a c10d backend torch knows after "
                           f"its imports", hint=f"known: {', '.join(c10d_backends())}; a device's plugin registers its "
                           "own with torch.distributed.Backend.register_backend (list its module under `import:`)")
    return name, group.device.split(":")[0]


RANK_TASKS = "ci_runner.procs.ranks:rank_tasks"


def rank_tasks(payload: Mapping[str, Any]) -> dict[str, Any]:
    """A rank running several tasks in one process group (`launch_ranks(RANK_TASKS, {..., "tasks": [...]})`):
    each "module:function" of `payload["tasks"]` is called in turn with (its payload, mesh), its payload the
    launch's plus the task's own part (`payload["parts"][task]`, if any); {task: its value}. Each task is recorded
    as it ends (`record_task`); one that raises is that task's error only, the next task still runs, and the rank
    ends with an error naming the tasks that raised."""
    mesh = init_ranks(payload)
    arrive(payload, "init")
    folder = Path(str(payload["progress"])).parent
    parts: Mapping[str, Mapping[str, Any]] = payload.get("parts") or {}
    common = {k: v for k, v in payload.items() if k != "parts"}
    try:
        out: dict[str, Any] = {}
        raised: list[str] = []
        for index, task in enumerate(payload["tasks"]):
            t = time.monotonic()
            try:
                out[task] = call_task(str(task), {**common, **parts.get(task, {})}, mesh)
            except Exception as exc:  # this task's error; the next task runs
                raised.append(f"{task}: {type(exc).__name__}: {exc}")
                record_task(folder, index, int(payload["rank"]), task, error=exc, seconds=time.monotonic() - t)
                continue
            record_task(folder, index, int(payload["rank"]), task, value=out[task], seconds=time.monotonic() - t)
        if raised:
            raise RuntimeError(f"{len(raised)} rank task(s) raised: " + "; ".join(raised))
        return out
    finally:
        close_ranks()


def call_task(task: str, payload: Mapping[str, Any], mesh: Any) -> Any:
    """Call one "module:function" rank task with (payload, mesh)."""
    module, _, name = task.partition(":")
    return getattr(importlib.import_module(module), name)(payload, mesh)


def record_task(folder: Path, index: int, rank: int, task: str, *, value: Any = None,
                error: BaseException | None = None, seconds: float = 0.0) -> None:
    """What this rank made of task `index` (`TASK_RECORD`, atomic): its value (rank 0's is the task's), or the
    exception it raised."""
    record: dict[str, Any] = {"task": task, "rank": rank, "seconds": round(seconds, 3)}
    if error is None:
        record.update(status="ok", value=value)
    else:
        record.update(status="error", error_type=type(error).__name__, message=str(error),
                      traceback=traceback.format_exc(limit=12)[-4000:])
    atomic_write_json(folder / TASK_RECORD.format(index=index, rank=rank), record, indent=None)


def read_task(folder: Path, index: int, rank: int) -> dict[str, Any] | None:
    """The record `record_task` left (None: the rank did not finish that task)."""
    try:
        return dict(json.loads((folder / TASK_RECORD.format(index=index, rank=rank)).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class TaskRun:
    """One task of a launch: `run` is the ranks' view of that task (each rank's result: its record of the task, or,
    where it has none, what ended the rank; the hang report when the ranks did not all get through it), `seconds`
    from the launch's start until the task ended on every rank (or the launch ended), `waited` the seconds the
    taker waited for it."""

    run: RankRun
    seconds: float
    waited: float

    @property
    def value(self) -> Any:
        """Rank 0's value of the task, when every rank finished it; else None."""
        return self.run.results[0].value if self.run.ok and self.run.results else None


class BackgroundLaunch:
    """One launch of `rank_tasks` running in a thread of its own (`launch_ranks`); `take` hands over one task's
    outcome once every rank recorded it, or the launch ended, or the taker's `limit` passed."""

    POLL_S = 0.2

    def __init__(self, payload: Mapping[str, Any], *, world: int, timeout: float, folder: Path,
                 collective_timeout: float | None = None) -> None:
        self.payload = dict(payload)
        self.collective_timeout = collective_timeout
        self.tasks: tuple[str, ...] = tuple(str(t) for t in payload["tasks"])
        self.world, self.folder, self.timeout = world, folder, timeout
        self.t0, self.t0_wall = time.monotonic(), time.time()
        self.run: RankRun | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.glob("task*.rank*.json"):  # a resumed cell's earlier launch
            stale.unlink()
        self._thread = threading.Thread(target=self._launch, args=(self.payload,), name="deepview-ranks", daemon=True)
        self._thread.start()

    def _launch(self, payload: dict[str, Any]) -> None:
        try:
            self.run = launch_ranks(RANK_TASKS, payload, world=self.world, timeout=self.timeout, folder=self.folder,
                                    collective_timeout=self.collective_timeout)
        except BaseException as exc:  # raised again by `take`, in the taker's thread
            self.error = exc
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def task_payload(self, task: str) -> dict[str, Any]:
        """What `task` was given in each rank, less what each rank adds (`launch_ranks`): the launch's payload and
        the task's own part (for a later launch of another task on the same footing)."""
        common = {k: v for k, v in self.payload.items() if k not in ("tasks", "parts")}
        return {**common, **(self.payload.get("parts") or {}).get(task, {})}

    def wait(self) -> None:
        """Wait for the whole launch (its ranks never outlive the cell)."""
        self._thread.join()

    def take(self, task: str, *, limit: float | None = None) -> TaskRun:
        """The outcome of `task` (one of this launch's), waiting for it; `limit`: seconds from the launch's start
        after which a rank that has not finished the task counts as timed out in it (the launch goes on)."""
        index = self.tasks.index(task)
        t = time.monotonic()
        while True:
            records = [read_task(self.folder, index, r) for r in range(self.world)]
            over = limit is not None and time.monotonic() - self.t0 >= limit
            if all(records) or self.done() or over:
                break
            self._done.wait(self.POLL_S)
        if self.error is not None and not all(records):
            raise self.error
        ended = time.monotonic()
        run = self._view(records, limit if over and not self.done() else None)
        finished = self._recorded_at(index) if all(records) else None  # the task ended before it was taken
        seconds = finished - self.t0_wall if finished is not None else ended - self.t0
        return TaskRun(run=run, seconds=round(max(0.0, seconds), 3), waited=round(ended - t, 3))

    def _recorded_at(self, index: int) -> float | None:
        """When the last rank recorded task `index` (wall clock), or None."""
        try:
            return max((self.folder / TASK_RECORD.format(index=index, rank=r)).stat().st_mtime
                       for r in range(self.world))
        except OSError:
            return None

    def _view(self, records: Sequence[dict[str, Any] | None], limit: float | None) -> RankRun:
        results = []
        for rank, rec in enumerate(records):
            if rec is not None:
                results.append(IsolatedResult(status=str(rec["status"]), value=rec.get("value"),
                                              error_type=rec.get("error_type"), message=str(rec.get("message", "")),
                                              traceback=str(rec.get("traceback", ""))))
            elif self.run is not None and rank < len(self.run.results):
                results.append(self.run.results[rank])
            else:  # the taker's limit passed first
                results.append(IsolatedResult(status="timeout", timeout=limit,
                                              message=f"did not finish the task within {limit or 0:g}s"))
        if all(records):
            return RankRun(results=tuple(results))
        hang = self.run.hang if self.run is not None else hang_report(self.folder, self.world)
        return RankRun(results=tuple(results), hang=hang)


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


# --------------------------------------------------------------------------- the cell's one launch

class CellContext(Protocol):
    """What `CellRanks` reads of the cell's `ModeContext`: the cell, its mode list, its folder, its time left."""

    cell: Any
    modes: Sequence[str]
    cell_dir: Path

    def remaining(self) -> float: ...


LAUNCH_FOLDER = "parallel"  # in the cell folder: the ranks' progress files and task records


class CellRanks:
    """The cell's launches of ranks: normally one, with every declaring mode's task (`start`); a mode that asks
    for its task when the launch holds none of it (a context built for that mode alone, with no mode list) gets
    a launch of its own, in ``parallel-<mode>/``."""

    def __init__(self, ctx: CellContext) -> None:
        self.ctx = ctx
        self.launches: list[BackgroundLaunch] = []

    def start(self, mode: str) -> BackgroundLaunch | None:
        """Launch the ranks now, unless a launch already runs `mode`'s task: the tasks of every mode of the cell's
        mode list (and `mode`) that declares one. None when the cell has no layout or `mode` declares no task."""
        spec = mode_spec(mode)
        if self.ctx.cell.parallel is None or spec is None or not spec.rank_task:
            return None
        found = self._launch_of(spec.rank_task)
        if found is not None:
            return found
        specs = self.selected(mode)
        folder = self.ctx.cell_dir / (LAUNCH_FOLDER if not self.launches else f"{LAUNCH_FOLDER}-{mode}")
        launch = BackgroundLaunch(self.payload(specs), world=self.ctx.cell.parallel.tp, folder=folder,
                                  timeout=max(60.0, self.ctx.remaining() - 10.0))
        self.launches.append(launch)
        return launch

    def selected(self, mode: str) -> list[ModeSpec]:
        """The modes whose tasks a launch started for `mode` runs: every mode of the cell's mode list (and `mode`)
        that declares a rank task no launch runs yet, in mode order."""
        taken = {t for launch in self.launches for t in launch.tasks}
        return [m for m in modes() if m.rank_task and m.rank_task not in taken
                and (m.name in self.ctx.modes or m.name == mode)]

    def payload(self, specs: list[ModeSpec]) -> dict[str, Any]:
        """The launch's payload: the cell's model, inputs and layout, the tasks, and each task's own part."""
        layout = self.ctx.cell.parallel
        assert layout is not None
        parts = {str(s.rank_task): dict(load_ref(s.rank_payload)(self.ctx)) if s.rank_payload else {} for s in specs}
        return {"model": spec_to_json(self.ctx.cell.model), "inputs": spec_to_json(self.ctx.cell.inputs),
                "parallel": layout.key(), "tasks": [s.rank_task for s in specs], "parts": parts}

    def take(self, mode: str, *, limit: float | None = None) -> TaskRun:
        """`mode`'s task in the ranks (launched now if no launch runs it), once every rank finished it or the launch
        ended; `limit`: seconds from the launch's start after which the mode stops waiting (its ranks time out)."""
        launch = self.start(mode)
        spec = mode_spec(mode)
        if launch is None or spec is None or spec.rank_task is None:
            raise ValueError(f"mode {mode!r}: no rank task to take (the cell has no layout, or the mode declares none)")
        return launch.take(spec.rank_task, limit=limit)

    def folder(self, mode: str) -> Path:
        """The launch folder of `mode`'s task (its ranks' progress files), once launched."""
        return self._launched(mode)[0].folder

    def task_payload(self, mode: str) -> dict[str, Any]:
        """What `mode`'s task was given in the ranks (the launch's payload and the mode's part), once launched."""
        launch, task = self._launched(mode)
        return launch.task_payload(task)

    def _launched(self, mode: str) -> tuple[BackgroundLaunch, str]:
        spec = mode_spec(mode)
        launch = self._launch_of(spec.rank_task) if spec is not None and spec.rank_task else None
        if launch is None or spec is None or spec.rank_task is None:
            raise ValueError(f"mode {mode!r}: its rank task was not launched")
        return launch, spec.rank_task

    def close(self) -> None:
        """Wait for every launch: the ranks never outlive the cell."""
        for launch in self.launches:
            launch.wait()

    def _launch_of(self, task: str) -> BackgroundLaunch | None:
        return next((launch for launch in self.launches if task in launch.tasks), None)
