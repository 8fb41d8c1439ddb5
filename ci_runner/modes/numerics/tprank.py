"""What one rank of a tensor-parallel numerics run does (`rank_task`, a task of `procs/ranks.rank_tasks`).

Every rank builds the same model (same seed), shards a copy by the plan (`workloads/tpplan.py`), checks its weight
shards against the slices of the single-rank weights, runs the sharded model eagerly (the plan's own reference)
and then compiled by each backend, as a user compiles it, with output hooks on every submodule. The outputs are
gathered to rank 0 (`procs/ranks.gather_outputs`), which alone holds the single-rank references (float32, the
primary, and float64) and measures, per module call and sample, the metrics of `modes/numerics/metrics.py` and the
signature facts of `modes/numerics/tpsignature.py`. Only rank 0 returns records; the parent (`modes/numerics/tpcompare.py`)
derives thresholds and verdicts from them. Last, rank 0 finds each backend's divergence as the parent will, and every
rank stores that layer's shards and inputs for its repro (`modes/numerics/tprepro.store_divergences`; rank 0's value
lists them under `stored`).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ...backends.spec import resolve_backend
from ...config import BackendSpec, InputSpec, ModelSpec, spec_from_json
from ...failures.failure import classify, first_line
from ...models.load import build_inputs, load_model
from ...procs.ranks import arrive, assemble, gather_outputs
from ...results.model import clean
from ...workloads.parallel import layout_of
from ...workloads.collectives import probe_collectives
from ...workloads.tpplan import check_plan, local_output_modules, on_mesh_device, resolve_plan, shard, shard_dim
from .capture import compared_flat, run_eager_with_outputs
from .watched import watched_outputs_each
from .metrics import compare_tensors, public, worst
from .tprepro import divergent_calls, store_divergences
from .tpsignature import signature_facts
from .views import runnable_reference

Outputs = dict[str, dict[str, torch.Tensor]]


def rank_task(payload: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    """One rank, a task of `procs/ranks.rank_tasks` (see the module docstring); rank 0 returns
    {"plan", "weights", "eager", "backends", "process_group", "stored"}."""
    return clean(_rank(payload, mesh))


def _rank(payload: Mapping[str, Any], mesh: Any) -> dict[str, Any]:
    rank = int(payload["rank"])
    model_spec = spec_from_json(ModelSpec, payload["model"])
    inputs = spec_from_json(InputSpec, payload["inputs"])
    loaded = load_model(model_spec, seed=inputs.seed, dtype="float32")
    module = loaded.module
    resolved = resolve_plan(module, dict(layout_of(payload).plan))
    check_plan(module, resolved, int(payload["world"]), model_spec.id)
    samples = [build_inputs(loaded, inputs, sample=s) for s in payload["samples"]]
    refs = _references(module, samples) if rank == 0 else None
    sharded = shard(copy.deepcopy(module), mesh, resolved)  # on the mesh's device; the references stay on CPU
    placed = [on_mesh_device(kw, mesh) for kw in samples]
    arrive(payload, "shard")
    weights = _weights_check(sharded, module, resolved)
    local = local_output_modules(resolved)
    eager = _compare_runs(sharded, None, placed, refs, local)
    arrive(payload, "eager")
    backends: dict[str, Any] = {}
    for raw in payload["backends"]:
        spec = spec_from_json(BackendSpec, raw)
        torch._dynamo.reset()
        backends[spec.id] = _backend_run(payload, spec, sharded, placed, refs, local, mesh.device_type)
    arrive(payload, "store")  # each divergence's layer: every rank's shards and inputs, for its repro (tprepro.py)
    found = divergent_calls(payload, eager, backends) if rank == 0 else None
    stored = store_divergences(payload, module, sharded, resolved, samples, placed, found)
    group = {"name": dist.get_backend(), "device": mesh.device_type}  # what the ranks ran over, as c10d says
    counts = getattr(dist.group.WORLD, "counts", None)  # a group that counts its collectives (the self-test simccl)
    if counts is not None:
        group["collectives"] = dict(counts)
    return {"rank": rank, "plan": resolved, "weights": weights, "eager": eager, "backends": backends,
            "process_group": group, "stored": stored} if rank == 0 else {"rank": rank}


def _references(module: torch.nn.Module, samples: list[dict[str, Any]]) -> list[tuple[Outputs, Outputs]]:
    """Rank 0's single-rank references per sample: (float32 outputs, float64 outputs) by call key."""
    wide = copy.deepcopy(module).to(torch.float64)
    runnable_reference(wide, "float64")  # MoE experts: no float64 grouped-mm kernel (modes/numerics/views.py)
    out = []
    for kw in samples:
        kw64 = {k: v.to(torch.float64) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in kw.items()}
        out.append((dict(run_eager_with_outputs(module, kw)), dict(run_eager_with_outputs(wide, kw64))))
    return out


def _weights_check(sharded: torch.nn.Module, module: torch.nn.Module, resolved: Mapping[str, str]) -> list[dict[str, Any]]:
    """Per shard: each sharded weight's local slice on every rank against the same slice of the single-rank
    weight (byte-equal); the ranks' answers gathered to rank 0."""
    full = dict(module.named_parameters())
    rows = []
    for name, param in sharded.named_parameters():
        owner = name.rsplit(".", 1)[0]
        if owner not in resolved or not hasattr(param, "to_local"):
            continue
        dim = shard_dim(resolved[owner])
        want = full[name].detach().chunk(dist.get_world_size(), dim=dim)[dist.get_rank()]
        got = param.to_local().detach().cpu()
        same = tuple(got.shape) == tuple(want.shape) and bool(torch.equal(got, want))
        rows.append({"param": name, "rank": dist.get_rank(), "equal": same, "dim": dim})
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, rows)
    return [row for part in every for row in part]


def _compare_runs(sharded: torch.nn.Module, backend: Any, samples: list[dict[str, Any]],
                  refs: list[tuple[Outputs, Outputs]] | None, local: set[str],
                  which: list[int] | None = None) -> list[dict[str, Any]]:
    """The sharded model run on each sample (eager, or compiled by `backend` once for all samples), gathered and,
    on rank 0, compared with the single-rank references: one record per (sample, call key). A compiled run the
    backend left to PyTorch on any rank is never compared: every call key is `not_ran` (inconclusive); one it ran
    only without output hooks compares the model's output, the other keys `not_ran`."""
    which = list(range(len(samples))) if which is None else which
    keyed_runs = [run_eager_with_outputs(sharded, samples[i]) for i in which] if backend is None else []
    why = None
    if backend is not None:
        runs = watched_outputs_each(sharded, backend, [samples[i] for i in which])  # watched: never compared if left to eager
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (runs[0].way, runs[0].not_ran))  # the ranks decide together: no lone gather
        why = "; ".join(f"rank {r}: {n}" for r, (_, n) in enumerate(every) if n) or None
        ways = {w for w, _ in every}
        if why is not None:
            return [rec for i in which for rec in _not_ran(i, refs[i], set(), why)] if refs else []
        if len(ways) > 1:
            raise RuntimeError(f"the ranks captured the sharded model differently: {sorted(ways)}")
        keyed_runs = [[(k, compared_flat(flat)) for k, flat in run.records] for run in runs]
        if ways == {"no-hooks"}:
            why = f"the backend ran the sharded model only without output hooks ({runs[0].tried[0]['not_ran'][:200]})"
    records: list[dict[str, Any]] = []
    for i, keyed in zip(which, keyed_runs):
        got = gather_outputs([(k, tuple(v.items())) for k, v in keyed])
        if refs is not None:
            records += _records(i, refs[i], got, local)
            records += _not_ran(i, refs[i], set(got), why) if why else []
    return records


def same_shapes(samples: list[dict[str, Any]]) -> list[int]:
    """The samples whose inputs have the first one's shapes: the compiled run takes these, so the backend compiles
    the sharded model once (a sample of another length would cost a second, dynamic, Dynamo trace of the DTensor
    model, the larger part of a TP cell; the single-rank cell already runs every sample). The thresholds still come
    from every sample's references (`modes/numerics/tpcompare.layer_thresholds` reads the eager plan's records)."""
    def shapes(kw: Mapping[str, Any]) -> dict[str, Any]:
        return {k: tuple(v.shape) for k, v in kw.items() if isinstance(v, torch.Tensor)}

    return [i for i, kw in enumerate(samples) if shapes(kw) == shapes(samples[0])]


def _not_ran(sample: int, ref: tuple[Outputs, Outputs], compared: set[str], why: str) -> list[dict[str, Any]]:
    """A `not_ran` record per call key of the reference not in `compared` (inconclusive: never a pass)."""
    return [{"sample": sample, "key": key, "order": order, "not_ran": why[:600]}
            for order, key in enumerate(ref[0]) if key not in compared]


def _records(sample: int, ref: tuple[Outputs, Outputs], got: dict[str, dict[str, list[Any]]], local: set[str]
             ) -> list[dict[str, Any]]:
    ref32, ref64 = ref
    out = []
    for order, (key, subs) in enumerate(got.items()):
        if key not in ref32:
            continue
        try:
            full, per_rank = {}, {}
            for s, parts in subs.items():
                if s in ref32[key]:
                    full[s], per_rank[s] = assemble(parts, ref32[key][s].shape, sliced=key.split("#")[0] in local)
            metrics = worst(compare_tensors(ref32[key][s], t) for s, t in full.items())
            spread = worst(compare_tensors(ref32[key][s], ref64[key][s].to(torch.float32))
                           for s in full if s in ref64.get(key, {}))
        except Exception as exc:  # a shape or structure difference: the layer's own finding
            out.append({"sample": sample, "key": key, "order": order, "error": first_line(str(exc), 400)})
            continue
        sub = next(iter(full), None)
        facts = signature_facts(ref32[key][sub], full[sub], per_rank[sub]) if sub is not None else {}
        out.append({"sample": sample, "key": key, "order": order, "metrics": public(metrics),
                    "ref_absmean": metrics.get("ref_absmean", 0.0), "spread": public(spread), "facts": facts})
    return out


def _backend_run(payload: Mapping[str, Any], spec: BackendSpec, sharded: torch.nn.Module, samples: list[dict[str, Any]],
                 refs: list[tuple[Outputs, Outputs]] | None, local: set[str], device: str = "cpu") -> dict[str, Any]:
    """One backend on the sharded model: its records, or how it failed (stage and error) on this rank."""
    arrive(payload, f"compile:{spec.id}")
    try:
        backend = resolve_backend(spec)
        backend.prepare()
        records = _compare_runs(sharded, backend, samples, refs, local, which=same_shapes(samples))
    except Exception as exc:  # the backend's failure on this rank is the result, named by rank
        arrive(payload, f"probe:{spec.id}")
        failure = classify(exc)  # the backend's own error, unwrapped from Dynamo's
        return {"status": "error", "rank": int(payload["rank"]), "stage": failure.stage,
                "error_type": failure.error_type, "message": first_line(failure.message, 2000),
                "collectives": _probe(spec, device)}
    arrive(payload, f"done:{spec.id}")
    return {"status": "ok", "records": records}


def _probe(spec: BackendSpec, device: str) -> list[dict[str, Any]]:
    """The plan's collectives alone on the backend (`workloads/collectives.py`), on the mesh's device, after it failed on
    the sharded model."""
    try:
        backend = resolve_backend(spec)
        return probe_collectives(backend.compile, device=device, compile_name=spec.compile)
    except Exception as exc:  # a probe that cannot run is said, not raised: the failure itself is the finding
        return [{"op": "(probe)", "status": "error", "error_type": type(exc).__name__, "message": first_line(str(exc), 300)}]
