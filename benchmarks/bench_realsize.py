"""Real-size cost (issue 24): a Qwen2-0.5B-shaped model (24 layers, hidden 896, vocab 151,936, random weights)
against its 2-layer twin, side by side in one run.

Each case runs in a fresh process (`--case`), the way a cell worker does (`cellrun.run_cell_inprocess`); the
case reports its wall time, its CPU time (itself and every child it waited for: probing children, repro
verifications) and the peak RSS of its largest process (`getrusage`). Cases:

* `build`    — `load_model` of the config (the transformers imports warmed first). Goal ≤ 5 s on 2 cores.
* `layers`   — the layers mode on `sim-crash` (every `self_attn` fails with one error): findings, cause groups,
  culprit searches, verified repro groups. Goal: 24-layer ≤ 2× the 2-layer twin; all layers listed; one
  culprit search, one verified repro group.
* `floor`    — the passes numerics cannot avoid: one float32 and one float64 reference forward, one aot_eager
  forward (compile included, as the mode pays it), and the weights' bytes of both references.
* `numerics` — the numerics mode on `aot_eager`, thresholds derived in the run. Goals: ≤ 4× floor; peak RSS ≤ 1.2×
  (both references' weights + the largest layer's activations). Its `breakdown` says where the time went (weights
  check, the thresholds' passes, the target child's start and build, its compile and cumulative view).

Printed: one JSON line per case as it finishes, then a table with the ratios. `uptime` load is printed with it:
on a shared machine every figure is an upper bound.

    PYTHONPATH=. python benchmarks/bench_realsize.py [--cases build,layers,floor,numerics] [--layers 24 --twin 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

QWEN = {"hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 512, "tie_word_embeddings": True}
QWEN_1_5B = {**QWEN, "hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12}
SHAPES = {"0.5b": (QWEN, 24), "1.5b": (QWEN_1_5B, 28)}  # config overrides, layers


def _params(shape: dict[str, Any], layers: int) -> int:
    """Parameters of a tied Qwen2 config: embeddings + per layer (attention with biases on q/k/v, MLP, 2 norms)."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * h + h + 2 * (h * kv + kv) + h * h + 3 * h * i + 2 * h
    return v * h + layers * per_layer + h


def _mem_available_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


# peak memory of a case, in float32 copies of the model: layers holds the model in the cell and in its probing or
# culprit child at once; numerics holds float32 + float64 references (3 copies' worth); build and floor one or three
NEEDS = {"build": 1.2, "layers": 2.3, "floor": 3.3, "numerics": 3.6}


def _matrix(layers: int, seq: int, samples: int, shape: str = "0.5b") -> str:
    over = json.dumps({**SHAPES[shape][0], "num_hidden_layers": layers})
    return textwrap.dedent(f"""\
        version: 1
        defaults:
          timeout: 3600
          inputs: {{batch: 1, seq_len: {seq}, samples: {samples}, seed: 0}}
          options: {{layers: {{probe_timeout: 900}}}}  # a whole 24-layer model compiles slowly on a busy machine
        references:
          - {{id: cpu-fp32, device: cpu, dtype: float32}}
          - {{id: cpu-fp64, device: cpu, dtype: float64}}
        models:
          - {{id: qwen-{layers}l, config: qwen2, overrides: {over}}}
        backends:
          - {{id: sim-crash, compile: sim-crash, device: cpu, backend_options: {{op: attention}}, modes: [layers]}}
          - {{id: aot_eager, compile: aot_eager, device: cpu, modes: [numerics]}}
        """)


def _usage() -> dict[str, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu_s": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 2),
            "peak_rss_gb": round(max(me.ru_maxrss, kids.ru_maxrss) / 1024 / 1024, 3)}


def _cell(layers: int, backend: str, args: argparse.Namespace) -> Any:
    from ci_runner.config import load_matrix_text
    from ci_runner.matrix import expand

    matrix = load_matrix_text(_matrix(layers, args.seq, args.samples, args.shape),
                              path=str(Path(args.out) / "matrix.yaml"))
    return next(c for c in expand(matrix) if c.backend.id == backend)


def case_build(layers: int, args: argparse.Namespace) -> dict[str, Any]:
    from ci_runner.models.load import load_model

    cell = _cell(layers, "sim-crash", args)
    load_model(cell.model.__class__(id="warm", config="qwen2", overrides={**SHAPES[args.shape][0],
                                                                           "num_hidden_layers": 1, "vocab_size": 128}))
    t0, c0 = time.perf_counter(), time.process_time()
    model = load_model(cell.model, seed=0).module
    return {"build_s": round(time.perf_counter() - t0, 2), "build_cpu_s": round(time.process_time() - c0, 2),
            "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1)}


def case_mode(layers: int, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    from ci_runner.run.cellrun import run_cell_inprocess

    cell = _cell(layers, "sim-crash" if mode == "layers" else "aot_eager", args)
    with tempfile.TemporaryDirectory(prefix="bench-realsize-", dir=args.out) as tmp:
        t0 = time.perf_counter()
        result = run_cell_inprocess(cell, Path(tmp) / "cell", modes=(mode,), deadline=time.monotonic() + 3600)
        wall = time.perf_counter() - t0
    res = result.modes[mode]
    out: dict[str, Any] = {"status": res.status, "mode_s": round(res.duration_s or wall, 2), "wall_s": round(wall, 2),
                           "findings": len(res.findings)}
    if mode == "layers":
        culprits = [f.details.get("culprit") or {} for f in res.findings]
        out.update(modules=[f.module for f in res.findings], groups=len(res.data.get("groups") or {}),
                   probed=(res.data.get("search") or {}).get("probed"),
                   inferred=(res.data.get("search") or {}).get("inferred"),
                   culprit_searches=sum(1 for c in culprits if c and "shared_with" not in c),
                   culprit_ops=sorted({op for c in culprits for op in c.get("ops") or []}),
                   verified_repro_groups=len({f.repro.path for f in res.findings if f.repro and f.repro.verified}),
                   seconds=res.data.get("seconds"))
    else:
        out.update(reason=res.reason, breakdown=_numerics_breakdown(res.data, out["mode_s"]))
    return out


def _numerics_breakdown(data: dict[str, Any], mode_s: float) -> dict[str, float]:
    """Where the numerics mode's time went: the weights check (in the target child since it builds the model
    anyway), the thresholds (the primary's passes with their dumps, the secondary's cumulative and isolated views,
    the rest: building the primary and casting the secondary, writing the file), the reference pass, the model
    handed to the target child (written to a file), the target child (its cumulative view, compile included; its
    start and taking the model are the rest), the isolated view's thresholds when derived after it, what is left."""
    t = dict(data.get("timings") or {})
    parts = {"weights_check_s": float((data.get("weights") or {}).get("seconds") or 0.0),
             **{k: float(t[k]) for k in ("derive_record_s", "derive_cumulative_s", "derive_isolated_s") if k in t}}
    parts["thresholds_other_s"] = float(t.get("thresholds_s", 0.0)) - sum(
        parts.get(k, 0.0) for k in ("derive_record_s", "derive_cumulative_s", "derive_isolated_s"))
    parts.update(reference_s=float(t.get("reference_s", 0.0)), handoff_s=float(t.get("handoff_s", 0.0)),
                 target_cumulative_s=float(t.get("target_cumulative_s", 0.0)),
                 target_isolated_s=float(t.get("target_isolated_s", 0.0)),
                 thresholds_later_s=float(t.get("thresholds_later_s", 0.0)))
    in_target = parts["weights_check_s"] if (data.get("weights") or {}).get("in_target_child") else 0.0
    parts["target_start_and_model_s"] = (float(t.get("target_s", 0.0)) - parts["target_cumulative_s"]
                                         - parts["target_isolated_s"] - in_target - parts["handoff_s"])
    parts["other_s"] = mode_s - sum(parts.values())
    return {k: round(v, 2) for k, v in parts.items()}


def case_floor(layers: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from ci_runner.models.load import build_inputs, load_model

    cell = _cell(layers, "aot_eager", args)
    times: dict[str, float] = {}
    weights = 0
    cpu = 0.0  # CPU seconds of the three forwards (every thread): less sensitive to other jobs than their wall time
    for name, dtype in (("fp32", "float32"), ("fp64", "float64")):
        loaded = load_model(cell.model, seed=0, dtype=dtype)
        weights += sum(p.numel() * p.element_size() for p in loaded.module.parameters())
        kwargs = build_inputs(loaded, cell.inputs, sample=0)
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            loaded.module(**kwargs)
        times[f"{name}_forward_s"] = round(time.perf_counter() - t0, 2)
        cpu += time.process_time() - c0
        if name == "fp32":
            compiled = torch.compile(loaded.module, backend="aot_eager")
            t0, c0 = time.perf_counter(), time.process_time()
            with torch.no_grad():
                compiled(**kwargs)
            times["aot_eager_forward_s"] = round(time.perf_counter() - t0, 2)
            cpu += time.process_time() - c0
            del compiled
            torch._dynamo.reset()
        del loaded
    floor = sum(times.values())
    return {**times, "floor_s": round(floor, 2), "floor_cpu_s": round(cpu, 2), "ref_weights_gb": round(weights / 2**30, 3)}


CASES = {"build": case_build, "floor": case_floor,
         "layers": lambda n, a: case_mode(n, "layers", a), "numerics": lambda n, a: case_mode(n, "numerics", a)}


def _run_case(case: str, layers: int, args: argparse.Namespace) -> dict[str, Any]:
    need = NEEDS.get(case, 1.0) * _params(SHAPES[args.shape][0], layers) * 4 / 2**30 + 1.0
    if need > _mem_available_gb():
        row = {"case": case, "layers": layers, "shape": args.shape,
               "skipped": f"needs about {need:.1f} GB, {_mem_available_gb():.1f} GB available"}
        print(json.dumps(row), flush=True)
        return row
    cmd = [sys.executable, __file__, "--case", case, "--n", str(layers), "--seq", str(args.seq),
           "--samples", str(args.samples), "--out", args.out, "--shape", args.shape]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    wall = time.perf_counter() - t0
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
    row: dict[str, Any] = json.loads(line) if line else {"error": (proc.stderr or proc.stdout)[-1500:]}
    row.update(case=case, layers=layers, shape=args.shape, process_wall_s=round(wall, 2),
               load=round(os.getloadavg()[0], 2))
    print(json.dumps(row), flush=True)
    return row


def _ratio(a: Any, b: Any) -> float | None:
    return round(float(a) / float(b), 2) if a is not None and b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="build,layers,floor,numerics")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b",
                    help="0.5b: Qwen2-0.5B (24 layers, hidden 896); 1.5b: Qwen2-1.5B (28 layers, hidden 1536)")
    ap.add_argument("--layers", type=int, default=None, help="default: the shape's own (24 or 28)")
    ap.add_argument("--twin", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--out", default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--case", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.layers = args.layers or SHAPES[args.shape][1]
    if args.case:  # one case, in this fresh process
        row = CASES[args.case](args.n, args)
        print(json.dumps({**row, **_usage()}))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench-realsize-") as tmp:
        args.out = args.out or tmp
        print(f"# {os.uname().nodename}: {os.cpu_count()} cpus, load {os.getloadavg()}, shape {args.shape} "
              f"({_params(SHAPES[args.shape][0], args.layers) / 1e9:.2f}B parameters), "
              f"{_mem_available_gb():.1f} GB available", flush=True)
        rows = {(c, n): _run_case(c, n, args) for c in args.cases.split(",") for n in (args.twin, args.layers)
                if not (c == "build" and n == args.twin)}
    summary: dict[str, Any] = {}
    big, twin = args.layers, args.twin
    if ("layers", big) in rows:
        summary["layers_cpu_ratio"] = _ratio(rows[("layers", big)].get("cpu_s"), rows[("layers", twin)].get("cpu_s"))
        summary["layers_wall_ratio"] = _ratio(rows[("layers", big)].get("process_wall_s"),
                                              rows[("layers", twin)].get("process_wall_s"))
    for n in (twin, big):
        if ("numerics", n) in rows and ("floor", n) in rows:
            summary[f"numerics_over_floor_{n}l"] = _ratio(rows[("numerics", n)].get("mode_s"),
                                                          rows[("floor", n)].get("floor_s"))
            summary[f"numerics_cpu_over_floor_cpu_{n}l"] = _ratio(rows[("numerics", n)].get("cpu_s"),
                                                                  rows[("floor", n)].get("floor_cpu_s"))
            summary[f"numerics_rss_over_weights_{n}l"] = _ratio(rows[("numerics", n)].get("peak_rss_gb"),
                                                                rows[("floor", n)].get("ref_weights_gb"))
    print(json.dumps({"summary": summary, "goals": {"layers_ratio": "<= 2", "numerics_over_floor": "<= 4",
                                                    "numerics_rss_over_weights": "<= 1.2 (+ one layer's activations)",
                                                    "build_s": "<= 5"}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
