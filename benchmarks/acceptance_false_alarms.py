"""The false-alarm acceptance sweep: the numerics mode over every model of the bundled example on real compilers,
every layer compared in both views (`isolated: all`), thresholds derived once and shared as in one run. Prints one
row per model and backend: status, layers flagged, layers compared, and the worst metric/threshold ratio (under 1.0:
no layer came near its threshold). Exit 1 when any layer is flagged.

The suite runs a subset (tests/integration/test_numerics_false_alarms.py: aot_eager on three models, inductor on two):
inductor's C++ compiles with a cold cache take ~800 s for the whole example on 2 cores. Run this before a release
and whenever the thresholds or the capture change:

    PYTHONPATH=. python benchmarks/acceptance_false_alarms.py [--backends aot_eager,inductor,openvino,turbine_cpu] [--models …]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.fixtures.false_alarms import EXAMPLE_MODELS, sweep

OPENVINO_RECIPE = {"options": {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="aot_eager,inductor", help="comma-separated torch.compile backends")
    ap.add_argument("--models", default=",".join(EXAMPLE_MODELS), help="comma-separated example model ids")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="false-alarms-"))
    bad = 0
    print(f"{'backend':<12} {'model':<14} {'status':<12} {'flagged':>7} {'compared':>9} {'worst':>6} {'s':>6}")
    for backend in args.backends.split(","):
        options = OPENVINO_RECIPE if backend == "openvino" else None
        rows = sweep(backend, args.models.split(","), work / backend, work / "thresholds", options)
        for model, r in rows.items():
            bad += len(r["flagged"]) + r["findings"]
            print(f"{backend:<12} {model:<14} {r['status']:<12} {len(r['flagged']):>7} "
                  f"{r['compared']}/{r['layers']:<6} {r['worst']:>6.2f} {r['seconds']:>6.1f}"
                  + (f"  {', '.join(r['flagged'][:4])}" if r["flagged"] else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
