"""Cause groups: the layers mode's work follows root causes, not layers.

Smallest failing modules that share a module class, a cause (`ProbeOutcome.cause`: the root-cause signature of
their error, `results/rootcause.py`) and an input signature (`call_signature`: the dtypes, shapes and strides of
their first call, and its plain values) form one group. A group gets one repro, verified once, and one culprit
search; its other members carry the first one's answers, named as shared (`shared_with`). Groups that differ
only in their inputs still get a culprit search each, with the first group's culprit op probed first (one probe
when it fails there too).

Repro verifications (fresh processes) of different groups run at once, up to `options.layers.verify_workers`
(`run_parallel`); what runs in this process (torch.export) stays serial (`IN_PROCESS`).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import torch

from .search import BOILERPLATE, ModuleTree, SearchResult

T = TypeVar("T")
R = TypeVar("R")

IN_PROCESS = threading.Lock()  # torch.export and other in-process tracing: one at a time


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{list(value.stride())}"
    if isinstance(value, (list, tuple)):
        inner = ",".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}={_describe(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    return type(value).__name__  # an object: its type, never its address


def call_signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """What a call's inputs look like, not their values: tensors by dtype, shape and strides; plain values as
    they are; other objects by type."""
    return _describe(tuple(args)) + _describe(dict(kwargs))


def cause_groups(tree: ModuleTree, result: SearchResult,
                 calls: Mapping[str, list[tuple[tuple[Any, ...], dict[str, Any]]]]) -> dict[str, str]:
    """Each smallest failing module → the first module of its group (itself when it leads one). A module without
    captured inputs is a group of its own."""
    first: dict[tuple[Any, ...], str] = {}
    out: dict[str, str] = {}
    for name in result.minimal:
        got = calls.get(name) or []
        inputs = call_signature(*got[0]) if got else f"<no inputs: {name}>"
        key = (tree.nodes[name].module_class, result.outcomes[name].cause_of(BOILERPLATE), inputs)
        out[name] = first.setdefault(key, name)
    return out


def cause_families(tree: ModuleTree, result: SearchResult, leaders: Iterable[str]) -> dict[str, str]:
    """Each group leader → the first leader with the same class and cause (groups that differ in inputs only)."""
    first: dict[tuple[str, str], str] = {}
    return {name: first.setdefault((tree.nodes[name].module_class, result.outcomes[name].cause_of(BOILERPLATE)), name)
            for name in leaders}


def run_parallel(fn: Callable[[T], R], items: Sequence[T], workers: int) -> list[R]:
    """`[fn(x) for x in items]`, up to `workers` at once (threads: each mostly waits on a child process)."""
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(fn, items))
