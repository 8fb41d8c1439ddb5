"""The zoo scan's inventory side: every selected architecture built small on `meta` and traced, many per child.

`scan_inventories` shards the architectures over `jobs` supervised children (`engine.isolate.supervise`). A child
builds and traces one architecture after another (`inventory_child`), writing one record per architecture
(`<dir>/<model_type>.json`, atomic) between journal `enter-model` / `leave-model` lines. A per-model watchdog ends
the child when one architecture runs past `per_model_timeout`; the journal names it, the parent records it as
left out (timeout or crash) and a fresh child goes on with the rest: one hang costs one model.

A record is either scanned (`inventory`: the `Inventory` dict, with the head, family, shrink level and layer
counts) or left out (`left_out`: {stage, reason}, stage one of config | build | inputs | trace | timeout | crashed).
Records are reused: a second backend with the same IR level and host device, or a rerun, traces nothing again.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..config import InputSpec
from ..engine.isolate import Attempt, IsolatedResult, child_journal, supervise
from ..engine.repro import safe_filename
from ..fsutil import atomic_write_json
from ..results.model import read_json
from .catalog import catalog
from .shrink import LEVELS, layer_count, shrink

STAGES: tuple[str, ...] = ("head", "config", "build", "inputs", "trace", "timeout", "crashed", "not scanned")
START_SLACK_S = 120.0
# trace errors a less shrunk config may not have (sizes that no longer divide, tensors that no longer match)
SHAPE_ERROR = re.compile(r"size|shape|dimension|divisib|mismatch|must match|expected .* got|out of (range|bounds)"
                         r"|index|split", re.I)  # a child's start (torch, transformers) on top of its models' time


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


def one_line(text: str, limit: int = 300) -> str:
    """An error message on one line (validation errors put the cause on their second line)."""
    return " ".join(text.split())[:limit]


def left_out(model_type: str, stage: str, reason: str, **extra: Any) -> dict[str, Any]:
    return {"model_type": model_type, **extra, "left_out": {"stage": stage, "reason": one_line(reason, 400)}}


# --------------------------------------------------------------------------------------------- in the child

def _build(cls: Any, config: Any) -> Any:
    import torch

    from ..engine.models import disable_caches  # deferred: torch, in the scan child only

    with torch.device("meta"):
        module = cls._from_config(config)
    module.eval()
    disable_caches(module)
    return module


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
    stage = "build"
    for shrink_level in LEVELS:
        stage = "build"
        try:
            config = shrink(default, shrink_level)
            module = _build(cls, config)
            stage = "inputs"
            kwargs = zoo_inputs(module, config, model_type=model_type, task=entry.task, inputs=inputs)
            stage = "trace"
            t0 = time.monotonic()
            inv = take_inventory(module, (), kwargs, level=level, device=device)
        except ZooInputError as exc:
            return left_out(model_type, "inputs", exc.message, **info, tried=tried)
        except Exception as exc:  # the next shrink level may build; the last error is the reason
            tried[shrink_level] = f"{stage}: {type(exc).__name__}: {one_line(str(exc))}"
            if stage in ("inputs", "trace") and not SHAPE_ERROR.search(str(exc)):
                break  # a trace error that is not about sizes: a bigger config fails the same way (and slowly)
            continue
        return {"model_type": model_type, **info, "shrink": shrink_level, "tried": tried,
                "layers": [layer_count(default), layer_count(config)],
                "params": sum(p.numel() for p in module.parameters()),
                "trace_s": round(time.monotonic() - t0, 3), "inventory": inv.to_dict()}
    last = list(tried.values())[-1] if tried else "unknown"
    return left_out(model_type, stage, last.split(": ", 1)[1] if ": " in last else last, **info, tried=tried)


def _watchdog(seconds: float, model_type: str) -> threading.Timer:
    def expire() -> None:
        child_journal("timeout-model", model_type)
        os._exit(124)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    return timer


def inventory_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Child target: scan `payload["types"]` one after another, skipping those that already have a record."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # this child's stderr is the scan's log: no config warnings per model
    hf_logging.disable_progress_bar()
    out = Path(payload["out_dir"])
    raw = dict(payload.get("inputs") or {})
    inputs = InputSpec(**{**raw, "text": tuple(raw.get("text") or ())})
    done = 0
    for model_type in payload["types"]:
        path = record_path(out, model_type)
        if path.exists():
            continue
        child_journal("enter-model", model_type)
        timer = _watchdog(float(payload["per_model_timeout"]), model_type)
        try:
            record = scan_one(model_type, level=payload["level"], device=payload["device"], inputs=inputs)
        finally:
            timer.cancel()
        atomic_write_json(path, record, indent=None)
        child_journal("leave-model", model_type)
        torch._dynamo.reset()
        done += 1
    return {"scanned": done}


# --------------------------------------------------------------------------------------------- in the parent

def _shard_attempt(types: Sequence[str], opts: ScanOptions) -> Callable[[int], "Attempt | None"]:
    def next_attempt(_n: int) -> Attempt | None:
        todo = [t for t in types if not record_path(opts.out_dir, t).exists()]
        if not todo:
            return None
        payload = {"types": todo, "out_dir": str(opts.out_dir), "level": opts.level, "device": opts.device,
                   "per_model_timeout": opts.per_model_timeout, "inputs": opts.inputs.key()}
        return Attempt(payload=payload, timeout=START_SLACK_S + opts.per_model_timeout * len(todo))
    return next_attempt


def _on_crash(opts: ScanOptions, info: Mapping[str, Mapping[str, Any]]) -> Callable[[str | None, IsolatedResult], str | None]:
    def on_crash(item: str | None, res: IsolatedResult) -> str | None:
        if item is None:  # died outside any model: starting the child failed, nothing to pin on an architecture
            return f"the scan child {res.describe()}"
        if res.exit_code == 124 or res.status == "timeout":
            stage, reason = "timeout", f"no result within the per-model limit of {opts.per_model_timeout:g} s"
        else:
            stage, reason = "crashed", f"the scan child {res.describe()} while building or tracing it"
        atomic_write_json(record_path(opts.out_dir, item), left_out(item, stage, reason, **info.get(item, {})),
                          indent=None)
        return None
    return on_crash


def _run_shard(types: Sequence[str], opts: ScanOptions, info: Mapping[str, Mapping[str, Any]], shard: int) -> str | None:
    run = supervise("ci_runner.zoo.scan:inventory_child", journal=opts.out_dir / f"journal-{shard}.log", kind="model",
                    next_attempt=_shard_attempt(types, opts), on_crash=_on_crash(opts, info))
    return run.stop_reason


def scan_inventories(types: Sequence[str], opts: ScanOptions,
                     info: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """model_type -> record for every one of `types` (scanned or left out, never missing), `opts.jobs` children
    at a time. `info` (model_type -> family/task/class) labels architectures a crash leaves without a record."""
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    info = info or {}
    jobs = max(1, min(opts.jobs, len(types)))
    shards = [list(types[i::jobs]) for i in range(jobs)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        stops = list(pool.map(lambda a: _run_shard(a[1], opts, info, a[0]), enumerate(shards)))
    records: dict[str, dict[str, Any]] = {}
    for shard, stop in zip(shards, stops):
        for t in shard:
            path = record_path(opts.out_dir, t)
            if path.exists():
                records[t] = read_json(path, what="zoo scan record")
            else:
                records[t] = left_out(t, "not scanned", stop or "the scan ended before it", **info.get(t, {}))
    return {t: records[t] for t in types}
