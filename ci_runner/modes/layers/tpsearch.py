"""The layers mode under tensor parallelism, inside the ranks: the smallest submodule whose sharded run dies on the
backend, on any rank.

`rank_task` is a task of `procs/ranks.rank_tasks`. Every rank builds the model (same seed), shards it by the
plan (`workloads/tpplan.py`), records each module's first-call inputs in one eager sharded forward (kept in memory:
the ranks replay them themselves) and runs the single-rank mode's own top-down search (`search.search`) with a
probe that compiles the sharded submodule alone on the backend and runs it on its inputs (`search.probe_one`).
The ranks probe the same modules in the same order, so the collectives inside a probed module meet: after each
probe the ranks' outcomes are agreed with an all-gather (a module fails when it fails on any rank; the first such
rank's outcome stands and the failing ranks are named). Each probe is announced in the rank's progress file
(`probe:<backend>:<module>`), so a rank that dies in a probe, or hangs in a collective, is named with its module by
`procs/ranks.hang_report` and the parent (`modes/layers/parallel.py`). After the search every rank stores each
smallest failing module's local shards and inputs for its repro (`tprepro.store_ranks`).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...backends import resolve_backend
from ...config import BackendSpec, spec_from_json
from ...failures.outcome import ProbeOutcome
from ...procs.ranks import arrive
from ...workloads.tpplan import sharded_model
from ...results.model import clean
from .search import ModuleTree, label, minimal_failing, probe_one, record_calls, search, tree_of
from .tprepro import store_ranks

Calls = list[tuple[tuple[Any, ...], dict[str, Any]]]
PROBE_STEP = "probe:{backend}:{module}"  # the progress step announcing a probe (parsed back by the parent)
STORE_TASK = "ci_runner.modes.layers.tpsearch:store_task"


def rank_task(payload: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """Search each backend of `payload["search_backends"]` on the sharded model; rank 0 returns
    {"tree", "plan", "backends": {id: {"outcomes", "ranks", "minimal", "complete"}}}."""
    rank = int(payload["rank"])
    sharded, resolved, kwargs = sharded_model(payload, mesh)
    tree, calls = capture_sharded(sharded, kwargs)
    out = {}
    for raw in payload.get("search_backends") or []:
        spec = spec_from_json(BackendSpec, raw)
        out[spec.id] = _search(payload, spec, sharded, tree, calls)
    # each smallest failing module's local state and inputs, per rank, for its repro (tprepro.py)
    failing = list(dict.fromkeys(n for res in out.values() for n in res["minimal"]))
    stored = store_ranks(payload, sharded, resolved, calls, failing) if failing else {}
    if rank != 0:
        return {"rank": rank}
    return clean({"tree": tree.to_json(), "plan": resolved, "backends": out, "stored": stored})


def store_task(payload: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """A rank task that only records, after a search whose ranks died: the sharded model, one eager forward, and
    `tprepro.store_ranks` for `payload["store_modules"]` (qualified names)."""
    sharded, resolved, kwargs = sharded_model(payload, mesh)
    _, calls = capture_sharded(sharded, kwargs)
    stored = store_ranks(payload, sharded, resolved, calls, list(payload["store_modules"]))
    arrive(payload, "stored")
    return {"stored": stored}


def capture_sharded(sharded: torch.nn.Module, kwargs: Mapping[str, Any]) -> tuple[ModuleTree, dict[str, Calls]]:
    """The module tree of one eager sharded forward and every module's first-call inputs (cloned: a later call
    may write into them), kept in memory for the rank's own probes."""
    recorded, _ = record_calls(sharded, (), kwargs, keep=True, clone=True)
    calls: dict[str, Calls] = {rec.name: [(rec.args, rec.kwargs)] for rec in recorded if rec.call_index == 0}
    return tree_of(recorded), calls


def _search(payload: Mapping[str, Any], spec: BackendSpec, sharded: torch.nn.Module, tree: ModuleTree,
            calls: Mapping[str, Calls]) -> dict[str, Any]:
    """One backend's search on this rank, every outcome agreed with the other ranks (`agree`)."""
    backend = OnRankDevice(resolve_backend(spec))
    backend.prepare()
    ranks: dict[str, list[int]] = {}
    timeout = float(payload.get("probe_timeout", 300.0))
    with open(str(payload["progress"]) + ".faults", "a", encoding="utf-8") as timeout_fh:
        def probe(name: str) -> ProbeOutcome:
            arrive(payload, PROBE_STEP.format(backend=spec.id, module=label(name)))
            mine = probe_one(name, model=sharded, backend=backend, calls=list(calls.get(name, [])), all_calls=False,
                             timeout=timeout, timeout_fh=timeout_fh)
            agreed, failing = agree(mine)
            ranks[name] = failing
            return agreed

        result = search(tree, probe)
    arrive(payload, f"searched:{spec.id}")
    return {"outcomes": {n: o.to_json() for n, o in result.outcomes.items()},
            "ranks": {n: r for n, r in ranks.items() if r}, "minimal": minimal_failing(tree, result.outcomes),
            "complete": result.complete}


class OnRankDevice:
    """The backend as the ranks' probes see it: the sharded model already sits on the rank's device, so
    `to_device` moves nothing (moving a module with DTensor parameters swaps them, which fails once Dynamo holds
    weak references to them); everything else is the backend's."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def to_device(self, obj: Any) -> Any:
        return obj


def agree(mine: ProbeOutcome) -> tuple[ProbeOutcome, list[int]]:
    """Every rank's outcome of the same probe: (the one that stands, the ranks it failed on). A failure on any
    rank stands (the first failing rank's); else an inconclusive one (the backend did not run it there); else
    rank 0's pass."""
    import torch.distributed as dist  # deferred: rank children only

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine.to_json())
    outs = [ProbeOutcome.from_json(o) for o in every]
    failing = [r for r, o in enumerate(outs) if o.failed]
    if failing:
        return outs[failing[0]], failing
    return next((o for o in outs if o.status == "inconclusive"), outs[0]), []
