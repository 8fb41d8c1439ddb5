"""The repro of a sharded layer's `divergence` (the numerics mode under tensor parallelism): a script that starts its
own ranks, runs the layer sharded and compiled on the backend and measures it against the layer unsharded, run
eagerly, on the same inputs; verified by running it.

Inside the ranks (`store_divergences`, called by `tprank.rank_task` after every backend ran): rank 0 finds each
backend's divergence as the parent will (`tpcompare.rows_and_bad`: the first module call over its threshold, and the
sample it was worst on) and tells the other ranks. For each such call every rank stores, with the rank files the TP
repros share (`engine/tprepro.py`), `<numerics_repro_folder>/<module>/rank<r>.pt`: its local state of the layer
(the local shards of its DTensor parameters) and the layer's inputs of that call, the single-rank reference's
inputs as this rank's part of them (`local_inputs`: a tensor the sharded layer takes whole is the reference's; one
it takes a slice of, e.g. a rowwise projection's input, is that rank's chunk of the reference's along the dim it
differs on); rank 0 also stores the layer unsharded (`reference`: its whole state and the reference's inputs).

In the parent (`tp_repro`, called by `parallel._result`): `repro.py` is rendered beside them
(`templates/repro_numerics_tp.py.j2`). It starts `tp` ranks (gloo on CPU, a free port); each rebuilds the layer from
the model's source, shards it with `parallelize_module` by the plan relative to it, puts its own shards in
(`_repro_tp_module.py.j2`, as the layers mode's TP repro does) and runs it compiled with the backend on its inputs;
the outputs are gathered to rank 0, which assembles them as the numerics ranks do (`procs/ranks.assemble`: a slice per
rank is concatenated on the last dim, else rank 0's), runs the unsharded layer eagerly in float32 (the mode's
primary reference) on the reference's inputs and prints rel, 1 − cos and mad against the finding's threshold; exit 1
with "REPRO FAILED: <module> diverges: …" over it, 0 within it (2 when a rank failed otherwise). With
`numerics.verify` the script is run once (`repro.verify_at`): verified when it exits 1 printing "<module> diverges".

The layer alone may not show a divergence the whole model shows: a backend whose fault depends on the rest of the
graph (the self-test `sim-tp-drop` drops the forward graph's second all-reduce; `o_proj` alone has one) passes,
and the repro then stays unverified with the note saying so.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ...engine.codec import TensorStore, encode_call
from ...engine.repro import render_template, run_command, safe_filename, template_backend, write_script
from ...engine.tprepro import agree_errors, brief_source, errors_of, local_state, rank_model_source, relative_plan, \
    save_rank_file, script_pythonpath
from ...failures.failure import first_line
from ...options import ThresholdOptions
from ...quoting import shell_quote
from ...results.model import Finding, Repro
from ...watch.hooks import ModuleHooks
from .repro import verify_at
from .tpcompare import rows_and_bad

if TYPE_CHECKING:
    from ...config import BackendSpec
    from ...workloads.parallel import ParallelSpec

Call = tuple[dict[str, Any], dict[str, torch.Tensor]]  # (the codec's call spec, its tensors by key)
FOLDER = "numerics_repro"  # in the launch folder, when the payload names no `numerics_repro_folder`


# --------------------------------------------------------------------------- inside the ranks

def divergent_calls(payload: Mapping[str, Any], eager: Sequence[Mapping[str, Any]],
                    backends: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rank 0: per backend, its divergence's module call and sample ({"key", "sample"}): the first row over its
    threshold, as `tpcompare.analyse` finds it. A first bad row that is an error (a structure mismatch) has none."""
    out: dict[str, dict[str, Any]] = {}
    for backend_id, run in backends.items():
        if run.get("status") != "ok":
            continue
        try:
            opts = ThresholdOptions(**dict(payload.get("thresholds") or {}))
            _, bad = rows_and_bad(run["records"], eager, opts, int(payload["world"]))
        except Exception as exc:  # the repro is extra: the comparison's own result must not be lost to it
            out[backend_id] = {"error": f"{type(exc).__name__}: {first_line(str(exc), 300)}"}
            continue
        if bad and not bad[0]["error"] and "sample" in bad[0]:
            out[backend_id] = {"key": bad[0]["module"], "sample": int(bad[0]["sample"])}
    return out


def store_divergences(payload: Mapping[str, Any], module: torch.nn.Module, sharded: torch.nn.Module,
                      resolved: Mapping[str, str], samples: Sequence[Mapping[str, Any]],
                      placed: Sequence[Mapping[str, Any]], found: Mapping[str, Mapping[str, Any]] | None
                      ) -> dict[str, dict[str, Any]]:
    """Every rank: the files of each divergent call (`found`: rank 0's `divergent_calls`, None on the others, which
    get it from rank 0); per backend {"key", "sample", "dir", "qualified_name", "call_index", "plan", "source",
    "errors"} (see the module docstring)."""
    import torch.distributed as dist  # deferred: rank children only

    rank = int(payload["rank"])
    box = [dict(found or {})]
    dist.broadcast_object_list(box, src=0)
    wanted: dict[str, dict[str, Any]] = box[0]
    folder = Path(str(payload.get("numerics_repro_folder") or Path(str(payload["progress"])).parent / FOLDER))
    source = rank_model_source(payload, module)
    items = sorted({(w["key"], w["sample"]) for w in wanted.values() if "error" not in w})
    mine: dict[str, str] = {}
    for key, sample in items:
        name, _, k = key.partition("#")
        rdir = folder / _dir_name(key, sample, items)
        why = _store_one(rank, name, int(k or 0), module, sharded, samples[sample], placed[sample], rdir, source)
        if why:
            mine[key] = why
    every = agree_errors(mine)
    out: dict[str, dict[str, Any]] = {}
    for backend_id, w in wanted.items():
        if "error" in w:  # rank 0 could not tell which layer
            out[backend_id] = {"key": None, "errors": {"0": w["error"]}}
            continue
        name, _, k = w["key"].partition("#")
        out[backend_id] = {**w, "dir": _dir_name(w["key"], w["sample"], items), "qualified_name": name,
                           "call_index": int(k or 0), "plan": relative_plan(resolved, name),
                           "source": brief_source(source), "errors": errors_of(every, w["key"])}
    return out


def _dir_name(key: str, sample: int, items: Sequence[tuple[str, int]]) -> str:
    """The call's folder: its module (`-call<k>` for a later call), `-sample<s>` when backends diverge there on
    different samples."""
    base = safe_filename(key.replace("#", "-call") or "model")
    return base if sum(1 for k, _ in items if k == key) == 1 else f"{base}-sample{sample}"


def _store_one(rank: int, name: str, k: int, module: torch.nn.Module, sharded: torch.nn.Module,
               sample: Mapping[str, Any], placed: Mapping[str, Any], rdir: Path,
               source: Mapping[str, Any] | None) -> str | None:
    """This rank's `rank<r>.pt` of call `k` of module `name`, or why it could not be stored. The ranks run the
    sharded model together (its collectives), whatever fails on one of them."""
    import torch.distributed as dist  # deferred: rank children only

    world = dist.get_world_size()
    reference = [_recorded(module, sample, name, k) if rank == 0 else None]
    dist.broadcast_object_list(reference, src=0)
    mine = _recorded(sharded, placed, name, k)  # every rank: the sharded forward's collectives
    try:
        if reference[0] is None or mine is None:
            raise RuntimeError(f"call {k} of {name or 'the model'} did not run in an eager forward")
        if isinstance(reference[0], str) or isinstance(mine, str):
            raise RuntimeError(reference[0] if isinstance(reference[0], str) else mine)
        spec, tensors = local_inputs(mine, reference[0], rank, world)
        blob: dict[str, Any] = {"format": 1, "rank": rank, "module": name, "call_index": k, "call": spec,
                                "tensors": tensors,
                                "state": local_state(sharded.get_submodule(name) if name else sharded)}
        if rank == 0:
            blob["reference"] = {"call": reference[0][0], "tensors": reference[0][1],
                                 "state": local_state(module.get_submodule(name) if name else module)}
        save_rank_file(rdir, rank, blob, source)
    except Exception as exc:  # unstorable inputs, a full disk: this layer has no repro, the others do
        return f"{type(exc).__name__}: {first_line(str(exc), 300)}"
    return None


def _recorded(model: torch.nn.Module, kwargs: Mapping[str, Any], name: str, k: int) -> Call | str | None:
    """Call `k` of submodule `name` in one eager forward of `model`, as it got it (before any hook of a parallel
    style: the inputs the ranks hold), encoded at the call (a cache as it was then); None when it did not run, the
    reason when it cannot be stored."""
    sub = model.get_submodule(name) if name else model
    seen: list[Call | str] = []
    count = [0]

    def pre(_m: torch.nn.Module, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        if count[0] == k:
            store = TensorStore()
            try:
                seen.append((encode_call(args, kw, store.add, strict=True, kv=True), store.tensors))
            except Exception as exc:  # noqa: BLE001 - said in the finding's note
                seen.append(f"its inputs cannot be stored: {type(exc).__name__}: {first_line(str(exc), 200)}")
        count[0] += 1

    try:
        with ModuleHooks([(name, sub)], pre=lambda _name: pre, prepend=True), torch.no_grad():
            model(**kwargs)
    except Exception as exc:  # noqa: BLE001 - the layer then has no repro; the task goes on
        return f"the eager forward failed: {type(exc).__name__}: {first_line(str(exc), 200)}"
    return seen[0] if seen else None


def local_inputs(mine: Call, reference: Call, rank: int, world: int) -> Call:
    """This rank's inputs of the sharded layer made of the reference's (`mine`: the call as the sharded run gave it,
    for its structure and shapes): a tensor of the same shape is the reference's, one smaller along one dim is this
    rank's chunk of the reference's along it (as DTensor shards); the other values are this rank's."""
    spec, tensors = mine
    ref_spec, ref_tensors = reference
    out: dict[str, torch.Tensor] = {}

    def walk(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and "__tensor__" in a:
            if not (isinstance(b, dict) and "__tensor__" in b):
                raise ValueError("the sharded layer's inputs differ in structure from the reference's")
            key = a["__tensor__"]["key"]
            out[key] = _part(tensors[key], ref_tensors[b["__tensor__"]["key"]], rank, world)
            return a
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: walk(v, b.get(k)) for k, v in a.items()}
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [walk(x, y) for x, y in zip(a, b)]
        return a

    walked = walk(spec, ref_spec)
    return walked, {**tensors, **out}


def _part(local: torch.Tensor, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if tuple(local.shape) == tuple(full.shape):
        return full
    dims = [d for d in range(full.dim()) if local.dim() == full.dim() and local.shape[d] != full.shape[d]]
    if len(dims) == 1:
        part = full.chunk(world, dim=dims[0])
        if rank < len(part) and tuple(part[rank].shape) == tuple(local.shape):
            return part[rank].contiguous().clone()
    raise ValueError(f"an input of shape {tuple(local.shape)} on rank {rank} is not a shard of the reference's "
                     f"{tuple(full.shape)}")


# --------------------------------------------------------------------------- in the parent

def tp_repro(f: Finding, info: Mapping[str, Any] | None, *, spec: "BackendSpec", layout: "ParallelSpec",
             model_id: str, folder: Path, cell_dir: Path, verify: bool, timeout: float) -> Repro | str:
    """The repro of divergence `f` from the ranks' files (`info`: `store_divergences`'s entry for the backend, in
    `folder`), run within `timeout` when `verify`; or why it has none."""
    if info is None:
        return ("no repro: the ranks stored no layer for it (its first bad module call is a structure mismatch, "
                "or the ranks kept nothing)")
    if info.get("errors"):
        why = "; ".join(f"rank {r}: {e}" for r, e in dict(info["errors"]).items())
        return f"no repro: the ranks could not store the layer's shards and inputs: {why}"
    if info["key"] != f.module:
        return f"no repro: the ranks stored {info['key']}, not {f.module}"
    if info.get("source") is None:
        return "no repro: no rebuild for this model source (a factory or a transformers class is needed)"
    source = dict(info["source"])
    rdir = folder / str(info["dir"])
    rel = rdir.relative_to(cell_dir)
    factory_module, pythonpath = script_pythonpath(spec, source)
    run_it = run_command("repro.py", rdir, pythonpath)
    thr = dict(f.threshold or {})
    text = render_template(
        "repro_numerics_tp.py.j2", module=f.module, qualified_name=str(info["qualified_name"]),
        module_class=f.module_class or "", layout=layout.label(), world=layout.tp, plan=dict(info["plan"]),
        source=source, model_id=model_id, model_source=source.get("factory") or source.get("model_class"),
        factory_module=factory_module, backend_id=spec.id, backend=template_backend(spec), message=f.message,
        sample=info.get("sample"), threshold={k: float(thr[k]) for k in ("rel", "cos", "mad") if k in thr},
        timeout=max(30.0, timeout - 15.0), run_it=run_it, torch_version=torch.__version__)
    script = write_script(rdir / "repro.py", text)
    command = f"cd {shell_quote(str(rel))} && {run_it}"
    if not verify:
        return Repro(path=str(rel / "repro.py"), verified=False, command=command,
                     note="not verified (numerics.verify: false)")
    repro = verify_at(script, pythonpath, command, cell_dir=cell_dir, expect=f"{f.module} diverges", timeout=timeout)
    alone = ("; the layer alone on the backend stays within the threshold: what diverges in the whole model may "
             "need more of its graph" if repro.note and repro.note.startswith("the repro passed") else "")
    repro.note = f"own {layout.tp} ranks; {repro.note}{alone}"
    return repro
