"""A tensor-parallel cell's ranks, launched once for every mode that declares a rank task (`ModeContext.ranks()`).

A mode declares what it does in each rank in its registration (`registry.ModeSpec.rank_task`, called with
(payload, mesh); `rank_payload`, (ctx) -> its own part of the payload). The first time a cell with
`parallel: {tp: N}` starts such a mode (`run/cellrun.py` calls `start` before the mode runs; a mode may call it
itself), `CellRanks` launches the ranks ONCE (`procs/ranks.BackgroundLaunch`, in a thread of its own: the
single-rank parts of the modes run beside them) with the tasks of every selected mode that declares one, in mode
order, in the launch folder ``<cell>/parallel/`` (the ranks' progress files and each task's records). Each mode
then takes its own task's outcome (`take`: rank 0's value, and the ranks' view of that task for hang and crash
reports) as soon as every rank finished that task. The launch's timeout is the cell's time left when it starts,
less 10 s (at least 60 s), as each mode's own launch had. Nothing here names a mode.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import spec_to_json
from ..procs.ranks import BackgroundLaunch, TaskRun
from ..registry import ModeSpec, load_ref, mode_spec, modes

if TYPE_CHECKING:
    from . import ModeContext

LAUNCH_FOLDER = "parallel"  # in the cell folder: the ranks' progress files and task records


class CellRanks:
    """The cell's launches of ranks: normally one, with every declaring mode's task (`start`); a mode that asks
    for its task when the launch holds none of it (a context built for that mode alone, with no mode list) gets
    a launch of its own, in ``parallel-<mode>/``."""

    def __init__(self, ctx: "ModeContext") -> None:
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
