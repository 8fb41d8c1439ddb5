"""The zoo's phases: inventory shards → merge → probe shards → a cell per architecture; `run` does all four.

One code path for GitHub (a job per shard, `deepview-ci zoo …`) and a laptop (`deepview-ci run`, every phase in
this process and its children). Which architectures and signatures a shard takes is `zoo/shards.py`.

1. `inventory_shard`: the shard's slice of every (IR level, host device) group of the zoo cells' architectures is
   scanned (`scan.scan_inventories`: many models per child, `jobs` children) into
   `<out>/zoo/inventory/<level>-<device>/<model_type>.json`, and the shard's manifest is written
   (`<out>/zoo/inventory/shards/I-of-N.json`);
2. `merge_shards`: the N shards' records (checked: every shard present, every record readable and its own
   architecture's) are copied into one run folder, and per backend the distinct signatures its ops mode would probe
   (`modes.ops.store.merge_inventories`, `modes.ops.mode.build_probes`) are written in a stable order with the
   architectures scanned and left out (`<out>/zoo/merged/<backend>.json`);
3. `probe_shard`: in one child per backend (its plugins never load into this process), the shard's slice of that
   list is probed into the backend's probe store (`<out>/probes/<backend>/<identity>/`, shared with ordinary
   cells) and a note of what it did is left in `<out>/zoo/probes/<backend>-I-of-N.json`;
4. `backend_cells`: in one child per backend, the whole list's outcomes are read from the store (whatever a probe
   shard left undone is probed there), every architecture gets its ops `ModeResult` from its own inventory and
   those outcomes (`modes.ops.mode.model_result`: findings, repros, verification), left-out ones a `skipped`
   cell saying why, each in `cells/<cell-id>/result.json`; and `<out>/zoo/<backend>.json`, the backend's zoo
   record, which `report.zoo_section` turns into results.json's `zoo` section.

Zoo cells run the ops mode only; their other modes are reported skipped.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..backends.spec import resolve_backend
from ..config import Cell, load_matrix
from ..engine.envinfo import cell_stamp, plugin_modules
from ..procs.isolate import run_isolated
from ..engine.repro import safe_filename
from ..errors import ConfigError, ExecutionError, InputError
from ..fsutil import atomic_write_json
from ..log import Progress
from ..matrix import expand
from ..modes.ops.outcome import OpStatus
from ..modes.ops.storepath import store_root
from ..registry import parse_options
from ..results.model import CellResult, ModeResult, load_cell_result, read_json, save_cell_result
from .catalog import catalog
from .report import backend_table
from .scan import ScanOptions, record_path, scan_inventories
from .shards import ALL, Shard, check_manifests, manifest, manifest_path, split

ZOO_DIR = "zoo"
MODE = "ops"
MERGED_VERSION = 1


def _level(cell: Cell) -> str:
    """The IR level the cell's ops mode inventories (as `modes.ops.mode.choose_level`, whose module imports torch:
    the run process decides the scan's folders without it; the backend's child checks with the real one)."""
    ir = (cell.options.get(MODE) or {}).get("ir")
    if ir:
        return str(ir)
    return "dispatch" if cell.backend.compile is None else (cell.backend.ir or "aten")


def _host(device: str) -> str:
    """The device the inventory fakes (as `modes.ops.inventory`: cpu or cuda, else meta)."""
    kind = (device or "cpu").split(":", 1)[0]
    return kind if kind in ("cpu", "cuda") else "meta"


def group_name(cell: Cell) -> str:
    """The inventory group of a zoo cell: `<level>-<host device>` (cells of one group share their records)."""
    return f"{_level(cell)}-{_host(cell.backend.device)}"


def _group_dir(out_dir: Path, group: str) -> Path:
    """`<out>/zoo/inventory/<group>` (`group_name`): the group's scan records."""
    return Path(out_dir) / ZOO_DIR / "inventory" / group


def merged_path(out_dir: Path, backend_id: str) -> Path:
    return Path(out_dir) / ZOO_DIR / "merged" / f"{safe_filename(backend_id)}.json"


def probe_note_path(out_dir: Path, backend_id: str, shard: Shard) -> Path:
    return Path(out_dir) / ZOO_DIR / "probes" / f"{safe_filename(backend_id)}-{shard.name}.json"


def _arch(cell: Cell) -> str:
    return cell.model.config or cell.model.id


def zoo_groups(cells: Sequence[Cell]) -> dict[str, list[str]]:
    """Inventory group -> its architectures (sorted model types)."""
    groups: dict[str, set[str]] = {}
    for c in cells:
        groups.setdefault(group_name(c), set()).add(_arch(c))
    return {g: sorted(t) for g, t in sorted(groups.items())}


def by_backend(cells: Sequence[Cell]) -> dict[str, list[Cell]]:
    out: dict[str, list[Cell]] = {}
    for c in cells:
        out.setdefault(c.backend.id, []).append(c)
    return out


def backend_group(cells: Sequence[Cell], backend_id: str) -> list[Cell]:
    group = by_backend(cells).get(backend_id)
    if not group:
        known = ", ".join(sorted(by_backend(cells))) or "none"
        raise ConfigError(f"no zoo cell runs on backend {backend_id!r} (zoo backends: {known})",
                          hint="pass one of the matrix's backend ids with --backend")
    return group


# --------------------------------------------------------------------------------------------- 1. inventory

def inventory_shard(cells: Sequence[Cell], *, out_dir: Path, shard: Shard = ALL, jobs: int = 1,
                    per_model_timeout: float = 180.0, force: bool = False,
                    progress: Progress | None = None) -> dict[str, int]:
    """Scan the shard's slice of every inventory group and write its manifest; {group: architectures scanned}."""
    progress = progress or Progress(0, quiet=True)
    doc = manifest(zoo_groups(cells), shard)
    types = sorted({t for todo in doc["groups"].values() for t in todo})
    info = {z.model_type: {"family": z.family, "task": z.task, "class": z.class_name} for z in catalog(types)} \
        if types else {}
    scanned: dict[str, int] = {}
    for group, todo in doc["groups"].items():
        level, _, host = group.rpartition("-")
        folder = _group_dir(out_dir, group)
        if force:
            for t in todo:
                record_path(folder, t).unlink(missing_ok=True)
        progress.info(f"deepview-ci: zoo inventory{'' if shard == ALL else f' shard {shard}'}: {len(todo)} "
                      f"architecture(s) at {level} on {host} ({jobs} job(s)) → {folder}")
        t0 = time.monotonic()
        records = scan_inventories(todo, ScanOptions(out_dir=folder, level=level, device=host, jobs=jobs,
                                                     per_model_timeout=per_model_timeout), info)
        scanned[group] = sum(1 for r in records.values() if "inventory" in r)
        progress.info(f"deepview-ci: zoo inventory: {scanned[group]} of {len(todo)} scanned in "
                      f"{time.monotonic() - t0:.0f} s")
    atomic_write_json(manifest_path(out_dir, shard), doc)
    return scanned


# --------------------------------------------------------------------------------------------- 2. merge

def _manifests(folder: Path) -> list[Path]:
    """The shard manifests in a run folder, or in the folders one level below it (one per downloaded artifact)."""
    if not Path(folder).is_dir():
        raise InputError(f"{folder}: no such folder", hint="pass the folders the inventory shards wrote (--out)")
    return sorted(Path(folder).glob("zoo/inventory/shards/*.json")) + \
        sorted(Path(folder).glob("*/zoo/inventory/shards/*.json"))


def _shard_record(root: Path, group: str, model_type: str, shard: Shard) -> tuple[Path, dict[str, Any]]:
    path = record_path(_group_dir(root, group), model_type)
    if not path.exists():
        raise InputError(f"{path}: inventory shard {shard} lists {model_type!r} but wrote no record for it",
                         hint=f"the shard ended early; rerun `deepview-ci zoo inventory MATRIX --shard {shard}`")
    rec = read_json(path, what="zoo scan record")
    if not isinstance(rec, dict) or rec.get("model_type") != model_type or not ({"inventory", "left_out"} & set(rec)):
        raise InputError(f"{path}: not a zoo scan record of {model_type!r}",
                         hint=f"the file is corrupt; rerun `deepview-ci zoo inventory MATRIX --shard {shard}`")
    return path, rec


def merge_shards(cells: Sequence[Cell], dirs: Sequence[Path], out_dir: Path) -> dict[str, dict[str, Any]]:
    """Check and copy the N inventory shards under `dirs` into `out_dir` and write each backend's merged list
    (`merged_path`); backend id -> {architectures, scanned, pairs, distinct, probed}."""
    groups = zoo_groups(cells)
    found = [(p, read_json(p, what="zoo inventory shard manifest")) for d in dirs for p in _manifests(Path(d))]
    holders = check_manifests(found, groups)
    records: dict[str, dict[str, dict[str, Any]]] = {g: {} for g in groups}
    for i, root in holders.items():
        shard = Shard(index=i, count=len(holders))
        for group, todo in manifest(groups, shard)["groups"].items():
            for t in todo:
                src, rec = _shard_record(root, group, t, shard)
                dest = record_path(_group_dir(out_dir, group), t)
                if not dest.exists() or dest.resolve() != src.resolve():
                    atomic_write_json(dest, rec, indent=None)
                records[group][t] = rec
    return {b: write_merged(group, records[group_name(group[0])], out_dir) for b, group in by_backend(cells).items()}


def write_merged(group: Sequence[Cell], records: Mapping[str, Mapping[str, Any]], out_dir: Path) -> dict[str, Any]:
    """One backend's merged list: the distinct signatures its ops mode probes (first-seen over its architectures
    in cell order), who uses each, the architectures scanned and left out."""
    from ..modes.ops.mode import build_probes  # deferred: the ops engine imports torch
    from ..modes.ops.signature import Inventory  # deferred: torch
    from ..modes.ops.store import merge_inventories  # deferred: torch

    spec = group[0].backend
    opts = parse_options(MODE, group[0].options.get(MODE) or {}, where=f"zoo {spec.id}: options.ops")
    recs = {c.model.id: records[_arch(c)] for c in group}
    invs = {m: Inventory.from_dict(r["inventory"]) for m, r in recs.items() if "inventory" in r}
    wanted: dict[str, Any] = {}
    for inv in invs.values():
        keys = {s.key: s for s in inv.signatures}
        for p in build_probes(inv, opts)[0]:
            wanted.setdefault(p["key"], keys[p["key"]])
    merged = merge_inventories(invs)
    doc = {"version": MERGED_VERSION, "backend": spec.id, "level": _level(group[0]), "group": group_name(group[0]),
           "architectures": [c.model.id for c in group], "scanned": sorted(invs),
           "left_out": {m: r["left_out"] for m, r in recs.items() if m not in invs},
           "families": {m: r.get("family") for m, r in recs.items()}, "pairs": merged.pairs,
           "distinct": len(merged.signatures), "signatures": [s.to_dict() for s in wanted.values()],
           "uses": {k: merged.models.get(k, []) for k in wanted}}
    atomic_write_json(merged_path(out_dir, spec.id), doc, indent=None)
    return {k: len(doc[k]) if isinstance(doc[k], list) else doc[k]
            for k in ("architectures", "scanned", "pairs", "distinct")} | {"probed": len(wanted)}


def load_merged(out_dir: Path, backend_id: str) -> dict[str, Any]:
    path = merged_path(out_dir, backend_id)
    if not path.exists():
        raise InputError(f"{path}: no merged zoo inventory for backend {backend_id!r}",
                         hint="run `deepview-ci zoo merge DIR… --matrix MATRIX --out OUT` first (or download its "
                              "artifact into OUT)")
    doc = read_json(path, what="merged zoo inventory")
    if not isinstance(doc, dict) or doc.get("version") != MERGED_VERSION or doc.get("backend") != backend_id:
        raise InputError(f"{path}: not a merged zoo inventory of {backend_id!r} from this version of deepview-ci",
                         hint="run `deepview-ci zoo merge` again")
    return doc


# --------------------------------------------------------------------------------------------- 3. probe, 4. cells

def _payload(group: Sequence[Cell], matrix_path: Path, out_dir: Path, shard: Shard | None,
             budget_s: float | None = None) -> dict[str, Any]:
    """The child's payload; its time is the cells' timeouts (this shard's share of them), at most `budget_s`."""
    deadline = sum(c.timeout for c in group) / (shard.count if shard else 1)
    deadline = min(deadline, budget_s) if budget_s else deadline
    return {"matrix": str(matrix_path), "out": str(out_dir), "backend": group[0].backend.id,
            "cells": [c.id for c in group], "deadline_s": deadline,
            "shard": [shard.index, shard.count] if shard else None}


def probe_shard(cells: Sequence[Cell], *, backend_id: str, shard: Shard, matrix_path: Path, out_dir: Path,
                progress: Progress | None = None, budget_s: float | None = None) -> dict[str, Any]:
    """Probe the shard's slice of the backend's merged list into its probe store (one child)."""
    progress = progress or Progress(0, quiet=True)
    group = backend_group(cells, backend_id)
    merged = load_merged(out_dir, backend_id)
    progress.info(f"deepview-ci: zoo probes on {backend_id}, shard {shard}: "
                  f"{len(split(merged['signatures'], shard))} of {len(merged['signatures'])} signature(s)")
    payload = _payload(group, matrix_path, out_dir, shard, budget_s)
    res = run_isolated("ci_runner.zoo.run:probe_child", payload, timeout=payload["deadline_s"] + 60)
    if not res.ok:
        raise ExecutionError(f"zoo probes on {backend_id}, shard {shard}: the probe child {res.describe()}",
                             hint="the zoo cells step probes whatever this shard left undone")
    return dict(res.value or {})


def backend_cells(group: Sequence[Cell], *, matrix_path: Path, out_dir: Path, progress: Progress | None = None,
                  budget_s: float | None = None) -> list[CellResult]:
    """Every architecture's cell on one backend (one child: the store's outcomes, the rest probed there)."""
    progress = progress or Progress(0, quiet=True)
    backend_id = group[0].backend.id
    load_merged(out_dir, backend_id)  # a clear error here rather than in the child
    for c in group:  # an earlier run's results never stand in for this run's
        (out_dir / "cells" / c.id / "result.json").unlink(missing_ok=True)
    progress.info(f"deepview-ci: zoo cells on {backend_id}: {len(group)} architecture(s)")
    payload = _payload(group, matrix_path, out_dir, None, budget_s)
    res = run_isolated("ci_runner.zoo.run:backend_child", payload, timeout=payload["deadline_s"] + 60)
    if not res.ok:
        progress.info(f"deepview-ci: zoo cells on {backend_id} {res.describe()}")
    return [_cell_result(out_dir, c, res.describe() if not res.ok else None) for c in group]


def run_zoo(cells: Sequence[Cell], *, matrix_path: Path, out_dir: Path, jobs: int, force: bool = False,
            progress: Progress | None = None, per_model_timeout: float = 180.0) -> list[CellResult]:
    """`deepview-ci run`'s zoo: the four phases in one go (one inventory shard, its merge, and per backend the
    cells step, which probes the whole list as one probe shard would)."""
    progress = progress or Progress(len(cells), quiet=True)
    out_dir = Path(out_dir)
    shutil.rmtree(manifest_path(out_dir, ALL).parent, ignore_errors=True)  # another split's shards are not this run's
    shutil.rmtree(out_dir / ZOO_DIR / "probes", ignore_errors=True)
    inventory_shard(cells, out_dir=out_dir, jobs=jobs, per_model_timeout=per_model_timeout, force=force,
                    progress=progress)
    merge_shards(cells, [out_dir], out_dir)
    results: list[CellResult] = []
    for group in by_backend(cells).values():
        results += backend_cells(group, matrix_path=matrix_path, out_dir=out_dir, progress=progress)
    return results


def _cell_result(out_dir: Path, cell: Cell, failure: str | None) -> CellResult:
    path = out_dir / "cells" / cell.id / "result.json"
    if path.exists():
        return load_cell_result(path)
    reason = f"the zoo probe child {failure}" if failure else "no result written"
    result = CellResult(id=cell.id, model=cell.model.id, backend=cell.backend.id, status="error",
                        modes={MODE: ModeResult(status="error", reason=reason)}, artifacts_dir=f"cells/{cell.id}")
    save_cell_result(result, path)
    return result


# --------------------------------------------------------------------------------------------- the backend's child

@dataclass(frozen=True, kw_only=True)
class _Child:
    """What both child targets set up: the backend, its env stamp and ops options, the merged list."""

    out: Path
    group: list[Cell]
    spec: Any
    backend: Any
    env: dict[str, Any]
    opts: Any
    level: str
    merged: dict[str, Any]
    remaining: Callable[[], float]


def _child(payload: Mapping[str, Any]) -> _Child:
    from ..modes.ops.mode import choose_level  # deferred: torch, child only

    deadline = time.monotonic() + float(payload["deadline_s"])
    out = Path(payload["out"])
    by_id = {c.id: c for c in expand(load_matrix(payload["matrix"]))}
    group = [by_id[i] for i in payload["cells"]]
    spec = group[0].backend
    backend = resolve_backend(spec)
    backend.prepare()
    env = cell_stamp(backend.device, backend.versions(), plugins=plugin_modules(spec.compile, spec.imports))
    opts = parse_options(MODE, group[0].options.get(MODE) or {}, where=f"zoo {spec.id}: options.ops")
    level = choose_level(spec, backend.is_eager, opts.ir)
    merged = load_merged(out, spec.id)
    if level != merged["level"]:
        raise RuntimeError(f"zoo: the scan inventoried {spec.id} at {merged['level']}, its ops mode wants {level}")
    return _Child(out=out, group=group, spec=spec, backend=backend, env=env, opts=opts, level=level, merged=merged,
                  remaining=lambda: max(0.0, deadline - time.monotonic()))


def _probe(ctx: _Child, signatures: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any], float]:
    """(outcomes by key, store stats, seconds) of `signatures` through the backend's probe store."""
    from ..modes.ops.store import probe_signatures  # deferred: torch, child only

    stats: dict[str, Any] = {}
    t0 = time.monotonic()
    outcomes = probe_signatures(ctx.spec, list(signatures), store_dir=store_root(ctx.out, ctx.spec.id), opts=ctx.opts,
                                remaining=ctx.remaining, work_dir=ctx.out / ZOO_DIR / f"work-{ctx.spec.id}",
                                versions=ctx.env.get("backend"), stats=stats) \
        if signatures and ctx.opts.probe else {}
    return outcomes, stats, time.monotonic() - t0


def _signatures(ctx: _Child) -> list[Any]:
    from ..modes.ops.signature import OpSignature  # deferred: torch, child only

    return [OpSignature.from_dict(s) for s in ctx.merged["signatures"]]


def probe_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Child target: probe one shard of a backend's merged list into its store; leave a note of what it did."""
    ctx = _child(payload)
    shard = Shard(index=payload["shard"][0], count=payload["shard"][1])
    mine = split(_signatures(ctx), shard)
    _outcomes, stats, seconds = _probe(ctx, mine)
    note = {"backend": ctx.spec.id, "shard": shard.index, "of": shard.count, "signatures": len(mine),
            "probe_s": round(seconds, 1), **{k: stats.get(k, 0) for k in ("reused", "probed", "waited")}}
    atomic_write_json(probe_note_path(ctx.out, ctx.spec.id, shard), note)
    return note


def _zoo_meta(cell: Cell, record: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("family", "task", "class", "shrink", "layers", "params", "trace_s", "left_out")
    return {"entry": cell.model.zoo_entry, "model_type": cell.model.config,
            **{k: record[k] for k in keys if k in record}}


def _store_counts(ctx: _Child, stats: Mapping[str, Any], seconds: float) -> tuple[dict[str, int], float]:
    """The store counts and probe time of the whole list: this step's, with what the probe shards did before it
    (their outcomes are this step's `reused`), so a sharded run reports what one process would."""
    notes = [read_json(p, what="zoo probe note") for p in sorted((ctx.out / ZOO_DIR / "probes").glob("*.json"))]
    notes = [n for n in notes if isinstance(n, dict) and n.get("backend") == ctx.spec.id]
    shard_probed = sum(int(n.get("probed", 0)) for n in notes)
    counts = {"reused": max(0, int(stats.get("reused", 0)) - shard_probed),
              "probed": int(stats.get("probed", 0)) + shard_probed,
              "waited": int(stats.get("waited", 0)) + sum(int(n.get("waited", 0)) for n in notes)}
    return ({k: v for k, v in counts.items() if k in stats or notes},
            seconds + sum(float(n.get("probe_s", 0.0)) for n in notes))


def backend_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Child target: the backend's outcomes for its whole merged list, every architecture's cell, the zoo record."""

    from ..modes.ops.mode import model_result  # deferred: torch, child only
    from ..modes.ops.signature import Inventory  # deferred: torch, in this child only

    ctx = _child(payload)
    sigs = _signatures(ctx)
    outcomes, stats, probe_s = _probe(ctx, sigs)
    group_dir = _group_dir(ctx.out, ctx.merged["group"])
    verified: dict[str, str] = {}  # op -> the architecture whose repro of it verified: the others skip it
    for c in ctx.group:
        rec = read_json(record_path(group_dir, _arch(c)), what="zoo scan record")
        meta = _zoo_meta(c, rec)
        t1 = time.monotonic()
        if "inventory" in rec:
            inv = Inventory.from_dict(rec["inventory"])
            data = {"ir": ctx.level, "inventory": inv.summary(), "timings": {}, "zoo": meta}
            mr = model_result(inv, outcomes, spec=ctx.spec, model_id=c.model.id, level=ctx.level, opts=ctx.opts,
                              ops_dir=ctx.out / "cells" / c.id / MODE, env_stamp=ctx.env, remaining=ctx.remaining,
                              eager=ctx.backend.is_eager, setup_error=stats.get("setup_error"), data=data, started=t1,
                              verified_ops=verified)
            verified.update({f.op: c.model.id for f in mr.findings
                             if f.op and f.repro is not None and f.repro.verified and f.op not in verified})
        else:
            lo = rec["left_out"]
            mr = ModeResult(status="skipped", reason=f"zoo: left out ({lo['stage']}): {lo['reason']}",
                            data={"zoo": meta})
        result = CellResult(id=c.id, model=c.model.id, backend=ctx.spec.id, status="skipped", env=ctx.env,
                            modes={MODE: mr}, artifacts_dir=f"cells/{c.id}", duration_s=time.monotonic() - t1)
        result.status = result.fold_status()
        save_cell_result(result, ctx.out / "cells" / c.id / "result.json")
    verdicts = {k: "pass" if o.status is OpStatus.PASS else "fail" if o.is_finding else "inconclusive"
                for k, o in outcomes.items()}  # as the ops mode decides what is a finding
    _write_record(ctx, sigs, verdicts, *_store_counts(ctx, stats, probe_s))
    return {"cells": len(ctx.group), "probed": len(sigs)}


def _write_record(ctx: _Child, sigs: Sequence[Any], verdicts: Mapping[str, str], store: Mapping[str, int],
                  probe_s: float) -> None:
    m = ctx.merged
    atomic_write_json(ctx.out / ZOO_DIR / f"{ctx.spec.id}.json", {
        "backend": ctx.spec.id, "level": ctx.level, "architectures": m["architectures"], "scanned": m["scanned"],
        "left_out": m["left_out"], "families": m["families"], "pairs": m["pairs"], "distinct": m["distinct"],
        "probed": len(sigs), "probe_s": round(probe_s, 1), "store": dict(store),
        "table": backend_table(m["uses"], verdicts, {s.key: {"op": s.op, "text": s.describe()[:300]} for s in sigs}),
    }, indent=None)
