"""The zoo scan's inventory side: every selected architecture built small on `meta` and traced, many per child.

`scan_inventories` runs `jobs` supervised children (`procs.isolate.supervise`) over ONE shared queue, ordered
longest-first (`cost_hint`, by family): a child claims the next architecture no one has claimed (an exclusive
claim file per scan), so the children end together. A child builds and traces one architecture after another
(`inventory_child`), writing one record per architecture (`<dir>/<model_type>.json`, atomic) between journal
`enter-model` / `leave-model` lines. A per-model watchdog ends the child when one architecture uses more than
`per_model_timeout` CPU seconds (CPU, not wall: a loaded shared machine does not time models out; a wall limit
of `WALL_FACTOR` times that catches a child that hangs without computing); the journal names it, the parent
records it as left out (timeout or crash) and a fresh child goes on with the rest: one hang costs one model.

A smaller config that fails to build is retried bigger (`shrink.LEVELS`); one that fails to trace is retried only
for a size error (`worth_retrying`): a data-dependent or unsupported construct fails the same way at any size, and
a bigger trace only costs time. The unshrunk default config is traced only when no shrunk one built.

A record is either scanned (`inventory`: the `Inventory` dict, with the head, family, shrink level and layer
counts) or left out (`left_out`: {stage, reason}, stage one of config | build | inputs | trace | timeout | crashed).
Records are reused: a second backend with the same IR level and host device, or a rerun, traces nothing again.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..config import InputSpec
from ..procs.isolate import Attempt, IsolatedResult, child_journal, supervise
from ..engine.repro import safe_filename
from ..fsutil import atomic_write_json
from ..results.model import read_json
from .catalog import catalog, head_config
from .shrink import LEVELS, layer_count, shrink

STAGES: tuple[str, ...] = ("head", "config", "build", "inputs", "trace", "timeout", "crashed", "not scanned")
START_SLACK_S = 120.0  # a child's start (torch, transformers) on top of its models' time
WALL_FACTOR = 5.0  # wall-clock limit per model = this × its CPU limit (a child that hangs without computing)
# trace errors a less shrunk config may not have (sizes that no longer divide, tensors that no longer match)
SHAPE_ERROR = re.compile(r"size|shape|dimension|divisib|mismatch|must match|expected .* got|out of (range|bounds)"
                         r"|index|split", re.I)
# errors of the primary tracer that no size changes: data-dependent control flow, unsupported constructs, code
# errors (measured: jetmoe's `DataDependentOutputException` spent 81 CPU s re-traced at all four sizes)
SIZE_INDEPENDENT = re.compile(r"DataDependent|DynamicOutputShape|GuardOnDataDependent|\bUnsupported\b"
                              r"|AttributeError|TypeError|KeyError|NameError|ImportError|NotImplementedError"
                              r"|values to unpack")  # an input of the wrong rank (Idefics2's 5-d pixel_values)
# relative cost by family (median trace time per family in a 299-architecture scan): longest first
COST_HINT: dict[str, float] = {"SSM/hybrid": 22.0, "multimodal": 15.0, "MoE": 14.0, "vision": 12.0,
                               "encoder-decoder": 12.0, "decoder": 10.0, "audio": 9.0, "encoder": 8.0}


@dataclass(frozen=True, kw_only=True)
class ScanOptions:
    """How the inventory side runs."""

    out_dir: Path  # records go here (one folder per IR level and host device)
    level: str = "aten"
    device: str = "cpu"
    jobs: int = 1
    per_model_timeout: float = 180.0
    inputs: InputSpec = InputSpec(batch=1, seq_len=16, samples=1)


def record_path(out_dir: Path, model_type: str) -> Path:
    return out_dir / f"{safe_filename(model_type)}.json"


def claim(claims: Path, model_type: str) -> bool:
    """Claim `model_type` for this child (exclusive create in this scan's claim folder); False if taken."""
    try:
        os.close(os.open(claims / safe_filename(model_type), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


def cost_hint(info: Mapping[str, Any]) -> float:
    """A relative trace cost for ordering the queue longest-first (by family; image-text models are the slowest)."""
    return COST_HINT.get(str(info.get("family")), 10.0) * (1.5 if info.get("task") == "image-text" else 1.0)


def worth_retrying(stage: str, error: str) -> bool:
    """Whether a bigger config may get past `error` (`stage`: build, inputs or trace). A build error always may;
    a trace error only when it is about sizes and the primary tracer's error is not size-independent."""
    if stage == "build":
        return True
    primary = error.split("; torch.export failed", 1)[0]
    return not SIZE_INDEPENDENT.search(primary) and bool(SHAPE_ERROR.search(error))


def one_line(text: str, limit: int = 300) -> str:
    """An error message on one line (validation errors put the cause on their second line)."""
    return " ".join(text.split())[:limit]


def left_out(model_type: str, stage: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, **extra, "left_out": {"stage": stage, "reason": one_line(reason, 400)}}


# --------------------------------------------------------------------------------------------- in the child

def _build(cls: Any, config: Any) -> Any:
    import torch

    from ..models.load import disable_caches  # deferred: torch, in the scan child only

    with torch.device("meta"):
        module = cls._from_config(config)
    module.eval()
    disable_caches(module)
    return module


class StageClock:
    """CPU seconds per stage of one architecture: `lap(stage)` books the time since the last lap; `split` books
    a finished lap's parts as the tracer measured them (`take_inventory(timings=...)`)."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.last = time.process_time()

    def lap(self, stage: str) -> None:
        now = time.process_time()
        self.cpu[stage] = self.cpu.get(stage, 0.0) + now - self.last
        self.last = now

    def split(self, stage: str, parts: Mapping[str, float]) -> None:
        """Replace the `stage` lap by `parts` (what they do not cover stays under `stage`)."""
        rest = self.cpu.pop(stage, 0.0)
        for k, v in parts.items():
            self.cpu[k] = self.cpu.get(k, 0.0) + v
            rest -= v
        if rest > 0.0005:
            self.cpu[stage] = rest

    def totals(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.cpu.items()}


def scan_one(model_type: str, *, level: str, device: str, inputs: InputSpec) -> dict[str, Any]:
    """Build `model_type` small on meta, make its inputs and take its inventory; a scanned or left-out record."""
    import transformers

    from ..modes.ops.inventory import take_inventory  # deferred: torch, in the scan child only
    from .inputs import ZooInputError, zoo_inputs  # deferred: torch, in the scan child only

    entry = catalog([model_type])[0]
    info = {"family": entry.family, "task": entry.task, "class": entry.class_name}
    if entry.class_name is None:
        return left_out(model_type, "head", entry.reason or "no model class", **info)
    cls = getattr(transformers, entry.class_name, None)
    if cls is None:
        return left_out(model_type, "head", f"transformers does not export {entry.class_name}", **info)
    try:
        default = transformers.AutoConfig.for_model(model_type)
    except Exception as exc:  # any config error is the architecture's reason
        return left_out(model_type, "config", f"{type(exc).__name__}: {one_line(str(exc))}", **info)
    tried: dict[str, str] = {}
    stage, clock = "build", StageClock()
    for shrink_level in LEVELS:
        if shrink_level == "default" and any(not t.startswith("build:") for t in tried.values()):
            break  # a shrunk config built and failed to trace: the full-size one traces for minutes (zamba)
        stage, t0 = "shrink", time.monotonic()
        try:
            config = head_config(cls, shrink(default, shrink_level))  # the text config for a text-model head
            stage = "build"
            clock.lap("shrink")
            module = _build(cls, config)
            stage = "inputs"
            clock.lap("build")
            kwargs = zoo_inputs(module, config, model_type=model_type, task=entry.task, inputs=inputs)
            stage, timings = "trace", {}
            clock.lap("inputs")
            t0 = time.monotonic()
            inv = take_inventory(module, (), kwargs, level=level, device=device, timings=timings)
        except ZooInputError as exc:
            clock.lap(stage)
            return left_out(model_type, "inputs", exc.message, **info, tried=tried, cpu_s=clock.totals())
        except Exception as exc:  # the next shrink level may build; the last error is the reason
            clock.lap(stage)
            stage = "build" if stage == "shrink" else stage
            tried[shrink_level] = f"{stage}: {type(exc).__name__}: {one_line(str(exc))}"
            if not worth_retrying(stage, str(exc)):
                break  # a bigger config fails the same way (and slowly)
            continue
        clock.lap("trace")
        clock.split("trace", timings)
        return {"model_type": model_type, **info, "shrink": shrink_level, "tried": tried,
                "layers": [layer_count(default), layer_count(config)],
                "params": sum(p.numel() for p in module.parameters()), "trace_s": round(time.monotonic() - t0, 3),
                "cpu_s": clock.totals(), "inventory": inv.to_dict()}
    last = list(tried.values())[-1] if tried else "unknown"
    return left_out(model_type, stage, last.split(": ", 1)[1] if ": " in last else last, **info, tried=tried,
                    cpu_s=clock.totals())


class _Watchdog:
    """Ends the child (exit 124) when the model in flight has used `cpu_s` CPU seconds (all threads), or
    `WALL_FACTOR` × that in wall time. One thread per child, re-armed per model."""

    def __init__(self, cpu_s: float, poll_s: float = 0.5) -> None:
        self.cpu_s, self.poll_s = cpu_s, poll_s
        self.model: str | None = None
        self.cpu0 = self.wall0 = 0.0
        self.lock = threading.Lock()
        threading.Thread(target=self._watch, daemon=True, name="zoo-scan-watchdog").start()

    def arm(self, model: str | None) -> None:
        with self.lock:
            self.model, self.cpu0, self.wall0 = model, time.process_time(), time.monotonic()

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            with self.lock:
                model = self.model
                over = model is not None and (time.process_time() - self.cpu0 > self.cpu_s or
                                              time.monotonic() - self.wall0 > self.cpu_s * WALL_FACTOR)
            if over and model is not None:
                child_journal("timeout-model", model)
                os._exit(124)


def inventory_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Child target: scan `payload["types"]` one after another, skipping those that already have a record."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # this child's stderr is the scan's log: no config warnings per model
    hf_logging.disable_progress_bar()
    out, claims = Path(payload["out_dir"]), Path(payload["claims"])
    raw = dict(payload.get("inputs") or {})
    inputs = InputSpec(**{**raw, "text": tuple(raw.get("text") or ())})
    done = 0
    watchdog = _Watchdog(float(payload["per_model_timeout"]))
    for model_type in payload["types"]:
        path = record_path(out, model_type)
        if path.exists() or not claim(claims, model_type):
            continue
        child_journal("enter-model", model_type)
        watchdog.arm(model_type)
        try:
            record = scan_one(model_type, level=payload["level"], device=payload["device"], inputs=inputs)
        finally:
            watchdog.arm(None)
        atomic_write_json(path, record, indent=None)
        child_journal("leave-model", model_type)
        torch._dynamo.reset()
        done += 1
    return {"scanned": done}


# --------------------------------------------------------------------------------------------- in the parent

def _shard_attempt(types: Sequence[str], opts: ScanOptions, claims: Path) -> Callable[[int], "Attempt | None"]:
    def next_attempt(_n: int) -> Attempt | None:
        todo = [t for t in types if not record_path(opts.out_dir, t).exists()
                and not (claims / safe_filename(t)).exists()]
        if not todo:
            return None
        payload = {"types": todo, "out_dir": str(opts.out_dir), "claims": str(claims), "level": opts.level,
                   "device": opts.device, "per_model_timeout": opts.per_model_timeout, "inputs": opts.inputs.key()}
        return Attempt(payload=payload, timeout=START_SLACK_S + opts.per_model_timeout * WALL_FACTOR * len(todo))
    return next_attempt


def _on_crash(opts: ScanOptions, info: Mapping[str, Mapping[str, Any]]) -> Callable[[str | None, IsolatedResult], str | None]:
    def on_crash(item: str | None, res: IsolatedResult) -> str | None:
        if item is None:  # died outside any model: starting the child failed, nothing to pin on an architecture
            return f"the scan child {res.describe()}"
        if res.exit_code == 124 or res.status == "timeout":
            stage, reason = "timeout", f"no result within the per-model limit of {opts.per_model_timeout:g} CPU s"
        else:
            stage, reason = "crashed", f"the scan child {res.describe()} while building or tracing it"
        atomic_write_json(record_path(opts.out_dir, item), left_out(item, stage, reason, **info.get(item, {})),
                          indent=None)
        return None
    return on_crash


def _run_shard(types: Sequence[str], opts: ScanOptions, info: Mapping[str, Mapping[str, Any]], shard: int,
               claims: Path) -> str | None:
    run = supervise("ci_runner.zoo.scan:inventory_child", journal=opts.out_dir / f"journal-{shard}.log", kind="model",
                    next_attempt=_shard_attempt(types, opts, claims), on_crash=_on_crash(opts, info))
    return run.stop_reason


def scan_inventories(types: Sequence[str], opts: ScanOptions,
                     info: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """model_type -> record for every one of `types` (scanned or left out, never missing), `opts.jobs` children
    at a time over one queue, longest first. `info` (model_type -> family/task/class) orders the queue and labels
    architectures a crash leaves without a record."""
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    info = info or {}
    jobs = max(1, min(opts.jobs, len(types)))
    queue = sorted(types, key=lambda t: -cost_hint(info.get(t, {})))  # stable: ties keep the caller's order
    claims = opts.out_dir / f"claims-{os.getpid()}-{secrets.token_hex(4)}"  # this scan's claims only
    claims.mkdir()
    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            stops = list(pool.map(lambda shard: _run_shard(queue, opts, info, shard, claims), range(jobs)))
    finally:
        shutil.rmtree(claims, ignore_errors=True)
    stop = next((s for s in stops if s), None)
    records: dict[str, dict[str, Any]] = {}
    for t in types:
        path = record_path(opts.out_dir, t)
        if path.exists():
            records[t] = read_json(path, what="zoo scan record")
        else:
            records[t] = left_out(t, "not scanned", stop or "the scan ended before it", **info.get(t, {}))
    return records
