"""Cost of the culprit search (issue 16) against the layers mode's own time, on the bundled example's
tiny-llama × sim-crash cell (the two `self_attn` findings).

Runs the cell's layers mode once, the way a cell worker does (`cellrun.run_cell_inprocess`), with the culprit
search on; the culprit search times itself per finding (`details.culprit.seconds`). Printed:

* `layers` : the mode's time without the culprit searches (the module search, the layer repros, their
  verification), in total and per finding (total / findings);
* `culprit`: each finding's culprit search (children, graph capture, probes) plus its repro verification;
* the ratio culprit / layers-per-finding. Goal ≤ 1.0.

    PYTHONPATH=. python benchmarks/bench_culprit.py [--model tiny-llama --backend sim-crash]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--backend", default="sim-crash")
    args = ap.parse_args()

    from ci_runner.run.cellrun import run_cell_inprocess
    from ci_runner.config import load_matrix
    from ci_runner.matrix import expand

    matrix = load_matrix(None)
    cell = next(c for c in expand(matrix) if c.model.id == args.model and c.backend.id == args.backend)
    with tempfile.TemporaryDirectory(prefix="bench-culprit-") as tmp:
        t0 = time.perf_counter()
        result = run_cell_inprocess(cell, Path(tmp) / cell.id, modes=("layers",),
                                    deadline=time.monotonic() + cell.timeout)
        wall = time.perf_counter() - t0
    mode = result.modes["layers"]
    rows = []
    culprit_total = 0.0
    for f in mode.findings:
        c = f.details.get("culprit") or {}
        verify_s = float(c.get("repro_seconds") or 0.0)  # writing and verifying the culprit's repro
        secs = float(c.get("seconds") or 0.0) + verify_s
        if "shared_with" in c:  # one search per cause group: a twin carries its first's answer, at no cost
            secs = 0.0
        culprit_total += secs
        rows.append({"finding": f.module, "culprit": c.get("ops"), "kind": c.get("kind"), "probes": c.get("probes"),
                     "verified": (c.get("repro") or {}).get("verified"), "culprit_s": round(secs, 2)})
    layers_total = (mode.duration_s or wall) - culprit_total
    per_finding = layers_total / max(1, len(mode.findings))
    for r in rows:
        r["ratio"] = round(r["culprit_s"] / per_finding, 3) if per_finding > 0 else None
    print(json.dumps({"cell": cell.id, "status": mode.status, "mode_s": round(mode.duration_s or wall, 2),
                      "layers_without_culprit_s": round(layers_total, 2),
                      "layers_per_finding_s": round(per_finding, 2), "findings": rows,
                      "goal": "ratio <= 1.0"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
