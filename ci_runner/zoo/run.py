"""`deepview-ci run` for zoo models: the inventory scanned once, each distinct op signature probed once per backend.

`run_zoo(cells, …)` takes the run's zoo cells (one per architecture × backend, `config.ModelSpec.zoo`):

1. inventory: `scan.scan_inventories` once per (IR level, host device) over every architecture of those cells
   (`<out>/zoo/inventory/<level>-<device>/`, many models per child, `--jobs` children);
2. per backend, in one child (`backend_child`: the backend's plugins never load into the run process): the merged
   signatures (`modes.ops.store.merge_inventories`) that any architecture's ops mode would probe are probed once
   (`probe_signatures`, the backend's probe store `<out>/probes/<backend>` that ordinary cells share), and every
   architecture gets its ops `ModeResult` from its own inventory and those outcomes (`modes.ops.mode.model_result`:
   findings, repros and their verification as for any model). Left-out architectures get a `skipped` cell that
   says why. Each cell's result lands in `cells/<cell-id>/result.json` like any cell's;
3. `<out>/zoo/<backend>.json`: the backend's zoo record (scanned, left out, pairs, distinct signatures, the
   signature table), which `zoo_section` turns into results.json's `zoo` section.

Zoo cells run the ops mode only; their other modes are reported skipped.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import Cell, load_matrix
from ..engine.isolate import run_isolated
from ..fsutil import atomic_write_json
from ..log import Progress
from ..matrix import expand
from ..modes.ops.storepath import store_root
from ..results.model import CellResult, ModeResult, load_cell_result, read_json, save_cell_result
from .catalog import catalog
from .report import backend_table
from .scan import ScanOptions, record_path, scan_inventories

ZOO_DIR = "zoo"
MODE = "ops"


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


def inventory_dir(out_dir: Path, level: str, device: str) -> Path:
    return out_dir / ZOO_DIR / "inventory" / f"{level}-{_host(device)}"


def run_zoo(cells: Sequence[Cell], *, matrix_path: Path, out_dir: Path, jobs: int, force: bool = False,
            progress: Progress | None = None, per_model_timeout: float = 180.0) -> list[CellResult]:
    """Scan, probe and write a result for every zoo cell (see the module docstring)."""
    progress = progress or Progress(len(cells), quiet=True)
    types = sorted({c.model.config or c.model.id for c in cells})
    info = {z.model_type: {"family": z.family, "task": z.task, "class": z.class_name} for z in catalog(types)} \
        if types else {}
    groups: dict[tuple[str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((_level(c), _host(c.backend.device)), []).append(c)
    for (level, host), group in groups.items():
        folder = inventory_dir(out_dir, level, host)
        if force and folder.exists():
            shutil.rmtree(folder)
        todo = sorted({c.model.config or c.model.id for c in group})
        progress.info(f"deepview-ci: zoo inventory of {len(todo)} architecture(s) at {level} on {host} "
                      f"({jobs} job(s)) → {folder}")
        t0 = time.monotonic()
        records = scan_inventories(todo, ScanOptions(out_dir=folder, level=level, device=host, jobs=jobs,
                                                     per_model_timeout=per_model_timeout), info)
        n = sum(1 for r in records.values() if "inventory" in r)
        progress.info(f"deepview-ci: zoo inventory: {n} of {len(todo)} scanned in {time.monotonic() - t0:.0f} s")
    results: list[CellResult] = []
    by_backend: dict[str, list[Cell]] = {}
    for c in cells:
        by_backend.setdefault(c.backend.id, []).append(c)
    for backend_id, group in by_backend.items():
        timeout = sum(c.timeout for c in group)
        payload = {"matrix": str(matrix_path), "out": str(out_dir), "backend": backend_id,
                   "cells": [c.id for c in group], "deadline_s": timeout}
        for c in group:  # an earlier run's results never stand in for this run's
            (out_dir / "cells" / c.id / "result.json").unlink(missing_ok=True)
        progress.info(f"deepview-ci: zoo probes on {backend_id}: {len(group)} architecture(s)")
        res = run_isolated("ci_runner.zoo.run:backend_child", payload, timeout=timeout + 60)
        if not res.ok:
            progress.info(f"deepview-ci: zoo probes on {backend_id} {res.describe()}")
        for c in group:
            results.append(_cell_result(out_dir, c, res.describe() if not res.ok else None))
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

def _zoo_meta(cell: Cell, record: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("family", "task", "class", "shrink", "layers", "params", "trace_s", "left_out")
    return {"entry": cell.model.zoo_entry, "model_type": cell.model.config,
            **{k: record[k] for k in keys if k in record}}


def backend_child(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Child target: probe one backend's zoo signatures once and write every architecture's cell result."""
    from dataclasses import replace

    from ..backends.spec import resolve_backend  # deferred: torch and the backend's plugins, in this child only
    from ..engine.envinfo import cell_stamp, plugin_modules  # deferred: torch, in this child only
    from ..modes.ops.mode import build_probes, choose_level, model_result  # deferred: torch, child only
    from ..modes.ops.outcome import OpStatus  # deferred: with the ops mode it belongs to, in this child only
    from ..modes.ops.signature import Inventory  # deferred: torch, in this child only
    from ..modes.ops.store import merge_inventories, probe_signatures  # deferred: torch, child only
    from ..registry import parse_options  # deferred: with the modes it registers, in this child only

    deadline = time.monotonic() + float(payload["deadline_s"])
    remaining = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    out = Path(payload["out"])
    by_id = {c.id: c for c in expand(load_matrix(payload["matrix"]))}
    group = [by_id[i] for i in payload["cells"]]
    spec = group[0].backend
    backend = resolve_backend(spec)
    backend.prepare()
    env = cell_stamp(backend.device, backend.versions(), plugins=plugin_modules(spec.compile, spec.imports))
    opts = parse_options(MODE, group[0].options.get(MODE) or {}, where=f"zoo {spec.id}: options.ops")
    level = choose_level(spec, backend.is_eager, opts.ir)
    if level != _level(group[0]):
        raise RuntimeError(f"zoo: the scan inventoried {spec.id} at {_level(group[0])}, its ops mode wants {level}")
    folder = inventory_dir(out, level, backend.device)
    records = {c.id: read_json(record_path(folder, c.model.config or c.model.id), what="zoo scan record")
               for c in group}
    invs = {c.model.id: Inventory.from_dict(records[c.id]["inventory"]) for c in group if "inventory" in records[c.id]}
    wanted: dict[str, Any] = {}
    for inv in invs.values():
        keys = {s.key: s for s in inv.signatures}
        for p in build_probes(inv, opts)[0]:
            wanted.setdefault(p["key"], keys[p["key"]])
    stats: dict[str, Any] = {}
    t0 = time.monotonic()
    outcomes = probe_signatures(spec, list(wanted.values()), store_dir=store_root(out, spec.id), opts=opts,
                                remaining=remaining, work_dir=out / ZOO_DIR / f"work-{spec.id}",
                                versions=env.get("backend"), stats=stats) if wanted and opts.probe else {}
    probe_s = time.monotonic() - t0
    verified: set[str] = set()  # ops whose repro one architecture already verified: the others skip it
    for c in group:
        rec = records[c.id]
        meta = _zoo_meta(c, rec)
        t1 = time.monotonic()
        if c.model.id in invs:
            inv = invs[c.model.id]
            data = {"ir": level, "inventory": inv.summary(), "timings": {}, "zoo": meta}
            cell_opts = replace(opts, verify=opts.verify and not (verified >= {s.op for s in inv.signatures}))
            mr = model_result(inv, outcomes, spec=spec, model_id=c.model.id, level=level, opts=cell_opts,
                              ops_dir=out / "cells" / c.id / MODE, env_stamp=env, remaining=remaining,
                              eager=backend.is_eager, setup_error=stats.get("setup_error"), data=data, started=t1)
            verified |= {f.op for f in mr.findings if f.op and f.repro is not None}
        else:
            lo = rec["left_out"]
            mr = ModeResult(status="skipped", reason=f"zoo: left out ({lo['stage']}): {lo['reason']}",
                            data={"zoo": meta})
        result = CellResult(id=c.id, model=c.model.id, backend=spec.id, status="skipped", env=env,
                            modes={MODE: mr}, artifacts_dir=f"cells/{c.id}", duration_s=time.monotonic() - t1)
        result.status = result.fold_status()
        save_cell_result(result, out / "cells" / c.id / "result.json")
    merged = merge_inventories(invs)
    sigs = {k: {"op": s.op, "text": s.describe()[:300]} for k, s in wanted.items()}
    verdicts = {k: "pass" if o.status is OpStatus.PASS else "fail" if o.is_finding else "inconclusive"
                for k, o in outcomes.items()}  # as the ops mode decides what is a finding
    uses = {k: merged.models.get(k, []) for k in wanted}
    atomic_write_json(out / ZOO_DIR / f"{spec.id}.json", {
        "backend": spec.id, "level": level, "architectures": [c.model.id for c in group],
        "scanned": sorted(invs), "left_out": {c.model.id: records[c.id]["left_out"] for c in group
                                              if c.model.id not in invs},
        "families": {c.model.id: records[c.id].get("family") for c in group},
        "pairs": merged.pairs, "distinct": len(merged.signatures), "probed": len(wanted),
        "probe_s": round(probe_s, 1), "store": {k: stats[k] for k in ("reused", "probed", "waited") if k in stats},
        "table": backend_table(uses, verdicts, sigs),
    }, indent=None)
    return {"cells": len(group), "probed": len(wanted)}
