"""The context a mode runs in, and a mode's run function from the registry.

A mode is a function `run(ctx: ModeContext) -> ModeResult`, registered once in `ci_runner/registry.py`
(`ModeSpec.run`: ``"module:function"``; the built-in ones are `ci_runner/modes/<name>/mode.py:run`).
The cell runs the selected modes in the matrix's order; a later mode still runs when an earlier
one failed (it works on what can run). A mode whose module is absent is reported as skipped with
that reason: nothing fakes a result.

A cell with `parallel: {tp: N}` launches its ranks once for every mode that declares a rank task
(`ModeContext.ranks()`, `procs/ranks.py`); each such mode takes its own task's outcome from that launch.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..watch import compiles
from ..procs.isolate import Journal
from ..procs.ranks import CellRanks
from ..errors import ModelLoadError
from ..registry import mode_spec
from ..results.model import CHECKPOINT_KEY, JOURNAL_NAME, ModeResult
from ..workloads.precision import PrecisionPolicy, with_storage

if TYPE_CHECKING:
    from ..backends import Backend
    from ..config import Cell
    from ..models.load import LoadedModel
    from ..watch.watchedrun import WatchedRun
    from ..workloads.phases import Phase

ModeFn = Callable[["ModeContext"], ModeResult]
FORWARD = "forward"  # the `data.phases` key of the single forward, for the modes that measure it as a phase

def get_mode(name: str) -> ModeFn | None:
    """The mode's function, or None when this installation does not have that mode."""
    spec = mode_spec(name)
    if spec is None:
        return None
    module_name, fn_name = spec.run.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return None
        raise
    return getattr(module, fn_name, None)


@dataclass
class ModeContext:
    """What a mode gets: the resolved cell, its folder, the prepared backend and lazy model loading."""

    cell: "Cell"
    cell_dir: Path
    backend: "Backend"
    deadline: float  # time.monotonic() at which the cell's timeout strikes
    env: dict[str, Any] = field(default_factory=dict)
    previous: dict[str, ModeResult] = field(default_factory=dict)
    modes: tuple[str, ...] = ()  # the modes the cell runs (its one launch of ranks runs the tasks of all of them)
    _models: dict[tuple[Any, ...], "LoadedModel"] = field(default_factory=dict, repr=False)
    model_error: "ModelLoadError | None" = None  # the cell's model did not load: every later load raises it again
    on_checkpoint: Callable[[str, ModeResult], None] | None = field(default=None, repr=False)  # run/cellrun.py's
    on_event: Callable[[str, str], None] | None = field(default=None, repr=False)  # each journal event (heartbeat)
    # per phase: a mode's whole-model compiled run, watched for the compile mode's signals (watch/watchedrun.py)
    compiled_runs: dict[str, "WatchedRun"] = field(default_factory=dict, repr=False)
    _precision: tuple[Any, dict[str, Any]] | None = field(default=None, repr=False)
    _checkpoints: dict[str, ModeResult] = field(default_factory=dict, repr=False)  # the last `checkpoint` per mode
    _compiles: dict[str, dict[str, compiles.Compiles]] = field(default_factory=dict, repr=False)  # mode -> phase -> cost
    _ranks: CellRanks | None = field(default=None, repr=False)

    @property
    def model_id(self) -> str:
        return self.cell.model.id

    def options(self, mode: str) -> Mapping[str, Any]:
        return self.cell.options.get(mode, {})

    def precision(self) -> tuple[PrecisionPolicy, dict[str, Any]]:
        """The cell's precision policy and its `data.precision` record: the backend's declared policy, or for
        `auto` the one measured once per backend configuration (`workloads/emulate.resolve_policy`), with the
        model's own dtype as its storage (`workloads/precision.with_storage`)."""
        if self._precision is None:
            from ..workloads.emulate import resolve_policy  # deferred: it imports torch

            policy, record = resolve_policy(self.cell.backend)
            stored = with_storage(policy, self.cell.model.dtype)
            if stored != policy:
                record = {**record, "policy": stored.label(), "storage": stored.storage}
            self._precision = (stored, record)
        return self._precision

    def ranks(self) -> CellRanks:
        """The cell's tensor-parallel ranks: launched once for every mode that declares a rank task
        (`CellRanks.start`), each mode's outcome by `CellRanks.take(mode)`."""
        if self._ranks is None:
            self._ranks = CellRanks(self)
        return self._ranks

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def artifact_dir(self, mode: str) -> Path:
        d = self.cell_dir / mode
        d.mkdir(parents=True, exist_ok=True)
        return d

    def model(self, *, dtype: str | None = None, device: str = "cpu", meta: bool = False) -> "LoadedModel":
        """Load (once per dtype/device/meta) the cell's model; the same seed gives the same weights. A load that
        failed is tried once per cell: later calls (the next modes) raise the same `ModelLoadError` at once."""
        from ..models.load import load_model  # deferred: models imports torch

        if self.model_error is not None:
            raise self.model_error
        key = (dtype, device, meta)
        if key not in self._models:
            try:
                self._models[key] = load_model(self.cell.model, seed=self.cell.inputs.seed, dtype=dtype, device=device,
                                               meta=meta)
            except ModelLoadError as exc:
                self.model_error = exc
                raise
        return self._models[key]

    def inputs(self, loaded: "LoadedModel", *, sample: int = 0, device: str = "cpu") -> dict[str, Any]:
        from ..models.load import build_inputs  # deferred: models imports torch

        return build_inputs(loaded, self.cell.inputs, sample=sample, device=device)

    def checkpoint(self, mode: str, findings: list[Any], data: Mapping[str, Any]) -> None:
        """Save what `mode` has found so far (its single forward's findings and data, before its phases): when the
        process dies later in the mode, the parent keeps it and names the phase that was running (`run/execute.py`)."""
        saved = ModeResult(status="error", reason="stopped during its phases: what its single forward found is kept",
                           findings=list(findings), data={**data, CHECKPOINT_KEY: "phases"})
        self._checkpoints[mode] = saved
        if self.on_checkpoint is not None:
            self.on_checkpoint(mode, saved)

    def checkpoint_phase(self, mode: str, phase: str, findings: list[Any], row: Mapping[str, Any]) -> None:
        """After each finished phase: the mode's checkpoint with this phase's findings and its `data.phases` row
        added, saved again, so that a timeout or a crash in a later phase keeps every finished one."""
        saved = self._checkpoints.get(mode)
        if saved is None:
            return
        saved.findings += list(findings)
        phases = saved.data.setdefault("phases", {})
        phases[phase] = dict(row)
        saved.data["compiles"] = {p: c.to_json() for p, c in self._compiles.get(mode, {}).items()}
        saved.reason = (f"stopped during its phases: what its single forward and its finished phases "
                        f"({', '.join(phases)}) found is kept")
        if self.on_checkpoint is not None:
            self.on_checkpoint(mode, saved)

    def each_phase(self, mode: str, body: Callable[["Phase | None"], tuple[list[Any], dict[str, Any]]], *,
                   loaded: "LoadedModel | None" = None, forward: bool = False,
                   min_seconds: float = 0.0) -> tuple[list[Any], dict[str, dict[str, Any]]]:
        """The one phase loop every mode runs its per-phase `body` in: (findings, `data.phases`).

        For each phase of the cell's workload (`inputs.phases`, resolved once: `InputSpec.workload()`; with
        `forward` and no phases, the single forward as phase `None`, keyed `forward`): a phase the model cannot
        run (`workloads.calls.skip_reason` on `loaded`) or that starts with less than `min_seconds` left is a
        `skipped` row with its reason; the others run `body(phase) -> (findings, row)` between the journal's
        `enter-workload`/`leave-workload` lines (a hard crash names the phase), and every phase is checkpointed
        as it finishes (`checkpoint_phase`: a later timeout or crash keeps it). What the backend compiled in each phase
        (`watch/compiles.py`) is kept for the mode's `data.compiles` (`compiles_data`)."""
        from ..workloads.calls import skip_reason  # deferred: workloads.calls imports torch

        findings: list[Any] = []
        data: dict[str, dict[str, Any]] = {}
        phases: list[Phase | None] = list(self.cell.inputs.workload()) or ([None] if forward else [])
        for phase in phases:
            name = phase.name if phase is not None else FORWARD
            reason = skip_reason(loaded, phase, self.cell.inputs) if phase is not None and loaded is not None else None
            if reason is None and min_seconds and self.remaining() < min_seconds:
                reason = "the cell ran out of time before this phase"
            found: list[Any] = []
            if reason:
                row: dict[str, Any] = {"status": "skipped", "reason": reason}
            else:
                self.journal("enter-workload", f"{mode}.{name}")
                before = compiles.tally()
                found, row = body(phase)
                self._compiles.setdefault(mode, {})[name] = compiles.since(before)
                self.journal("leave-workload", f"{mode}.{name}")
            findings += found
            data[name] = row
            self.checkpoint_phase(mode, name, found, row)
        return findings, data

    def compiles_data(self, mode: str, total: compiles.Compiles) -> dict[str, dict[str, int | float]]:
        """The mode's `data.compiles`: per phase of its phase loop (`each_phase`), what it compiled outside them (the
        single forward's search and probes: `forward`, or `other` where the loop had a `forward` phase), and the
        mode's `total` (`total`: the tally's growth over the whole mode, its isolated children's included)."""
        phases = self._compiles.get(mode, {})
        out = {p: c.to_json() for p, c in phases.items()}
        rest = total - sum(phases.values(), compiles.Compiles())
        if rest:
            out[FORWARD if FORWARD not in phases else "other"] = rest.to_json()
        out["total"] = total.to_json()
        return out

    def journal(self, event: str, name: str) -> None:
        """Append `event name` to the cell's crash journal (fsync'd): the parent reads it after a hard crash."""
        Journal(self.cell_dir / JOURNAL_NAME).write(event, name)
        if self.on_event is not None:
            self.on_event(event, name)
