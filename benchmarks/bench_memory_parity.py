"""Predicted against measured memory, per module and phase, for the bundled example's decoder models (issue 37).

The prediction runs on `meta` (`modes/memory/runs.py`, a `DispatchMeter`); the measurement runs the same calls
eagerly on `--device` with its allocator statistics: `simdev` (the self-test device's allocator, default) or `cuda`
(`torch.cuda.memory_allocated`/`max_memory_allocated`: the prepared GPU check; run it where a GPU is lent). Printed
per model and phase: the worst module's peak ratio (measured / predicted), the worst working-bytes ratio (the peak
above the call's entry), and the KV cache's growth per decode step on both sides.

    PYTHONPATH=. python benchmarks/bench_memory_parity.py [--device cuda] [--models tiny-llama,tiny-mixtral]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Any

DECODERS = "tiny-llama,tiny-granite,tiny-mixtral,tiny-bamba,tiny-llava"
PHASES: list[Any] = [{"decode": {"steps": 2, "cache": "dynamic"}}, {"batch": {"lengths": [16, 5]}},
                     {"long": {"seq_len": [40]}}]


def _worst(rows: list[dict[str, Any]], key: str) -> tuple[str, float] | None:
    have = [r for r in rows if r.get(key) is not None]
    if not have:
        return None
    r = max(have, key=lambda r: abs(r[key] - 1))
    return r["module"] or "(model)", round(r[key], 4)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="simdev")
    ap.add_argument("--models", default=DECODERS)
    args = ap.parse_args()

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ci_runner.config import InputSpec, load_matrix
    from ci_runner.models.load import load_model
    from ci_runner.workloads.calls import skip_reason
    from ci_runner.modes.memory.meters import DispatchMeter, device_meter
    from ci_runner.modes.memory.runs import metered_run
    from ci_runner.modes.memory.tables import compare_rows, kv_growth
    from ci_runner.workloads.phases import parse_phases

    if args.device == "simdev":
        from ci_runner.sim import simdev

        simdev.register(extra_allow=["rsqrt", "_softmax"])
    meter = device_meter(args.device)
    if meter is None:
        raise SystemExit(f"{args.device}: no allocator statistics here")
    inputs = InputSpec(seq_len=16)
    phases = [None, *parse_phases(PHASES, seq_len=16)]
    specs = {m.id: m for m in load_matrix(None).models}
    worst_all = 0.0
    for name in args.models.split(","):
        t0 = time.perf_counter()
        meta, real = load_model(specs[name], meta=True), load_model(specs[name])
        for phase in phases:
            label = phase.name if phase is not None else "forward"
            if phase is not None and skip_reason(meta, phase, inputs):
                print(f"{name:14s} {label:8s} skipped: {skip_reason(meta, phase, inputs)}")
                continue
            math = sdpa_kernel(SDPBackend.MATH) if args.device == "simdev" else contextlib.nullcontext()
            with math:
                pred = metered_run(meta.module, meta, inputs, phase, "meta", DispatchMeter(shadow_numel=1 << 22))
            module = copy.deepcopy(real.module).to(args.device)
            meas = metered_run(module, real, inputs, phase, args.device, meter)
            del module
            if pred.error or meas.error or meas.oom:
                print(f"{name:14s} {label:8s} error: {pred.error or meas.error or meas.oom}")
                continue
            rows = compare_rows(pred, meas)
            peak, work = _worst(rows, "peak_ratio"), _worst(rows, "working_ratio")
            worst_all = max(worst_all, abs(peak[1] - 1) if peak else 0.0)
            print(f"{name:14s} {label:8s} worst peak {peak}  worst working {work}  "
                  f"kv growth predicted {kv_growth(pred)} measured {kv_growth(meas)}")
        print(f"{name:14s} {time.perf_counter() - t0:.1f} s")
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(f"worst peak deviation over every module and phase: {worst_all:.2%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
