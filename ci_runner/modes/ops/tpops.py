"""The ops mode under tensor parallelism, inside the ranks: the collectives the backend sees, each alone on it.

`rank_task` is a task of `procs/ranks.rank_tasks`. Every rank builds and shards the model
(`workloads/tpplan.sharded_model`), traces it as an aot backend receives it (`workloads/collectives.aten_graphs`: the DTensor
redistributions are functional collectives there), lists the distinct collective calls
(`workloads/collectives.collective_calls`: op, shape, dtype, arguments) and probes each alone with the cell's backend on
every rank at once (`workloads/collectives.probe_collectives`). The ranks' rows are merged on rank 0
(`workloads/collectives.merge_rows`: a call fails when it fails on any rank, the ranks named). Rank 0 also returns the
inventory of its graphs' other ops (`sharded_inventory`: local ops on its local shapes, among them what DTensor
itself adds, e.g. a vocabulary-sharded embedding's mask and `index_put`); the parent probes those the single-rank
inventory lacks (`parallel.py`), with no ranks: they need no collective.
"""

from __future__ import annotations

from typing import Any, Mapping

from ...backends import resolve_backend
from ...config import BackendSpec, spec_from_json
from ...procs.ranks import arrive
from ...workloads.tpplan import sharded_model
from ...workloads.collectives import NAMESPACE, aten_graphs, collective_calls, merge_rows, probe_collectives
from ...results.model import clean
from .inventory import inventory_of_graphs
from .signature import Inventory


def sharded_inventory(graphs: Any, root_class: str) -> Inventory:
    """The ATen inventory of a rank's sharded graphs without the functional collectives (probed in the ranks)."""
    inv = inventory_of_graphs(graphs, root_class, level="aten", method="tp", device="cpu")
    inv.signatures = [s for s in inv.signatures if not s.op.startswith(NAMESPACE + ".")]
    inv.total_calls = sum(s.count for s in inv.signatures)
    return inv


def rank_task(payload: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """Rank 0 returns {"plan", "graphs", "calls", "rows", "ops"}; the other ranks {"rank"}."""
    import torch.distributed as dist  # deferred: rank children only

    sharded, resolved, kwargs = sharded_model(payload, mesh)
    arrive(payload, "trace")
    graphs = aten_graphs(sharded, kwargs)
    calls = collective_calls(graphs)
    spec = spec_from_json(BackendSpec, payload["ops_backend"])
    arrive(payload, f"probe:{spec.id}")
    backend = resolve_backend(spec)
    backend.prepare()
    rows = probe_collectives(backend.compile, calls, device=mesh.device_type, compile_name=spec.compile)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    arrive(payload, f"probed:{spec.id}")
    if int(payload["rank"]) != 0:
        return {"rank": int(payload["rank"])}
    ops = sharded_inventory(graphs, type(sharded).__name__).to_dict()
    return clean({"plan": resolved, "graphs": len(graphs), "calls": calls, "rows": merge_rows(every), "ops": ops})
