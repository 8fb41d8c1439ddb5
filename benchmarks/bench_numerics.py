"""Cost of the `numerics` mode against the passes it cannot avoid, at two model depths, side by side.

For each depth a fresh process builds a Llama-shaped model (random weights), derives its thresholds first (once
per model, like compile time not part of a cell's comparison), then measures:

* `ref` — a plain eager forward (the primary reference pass), `tgt` — the target's compiled forward (warm: compile
  time excluded), best of `--repeat` (on a shared machine noise only adds time, so every figure is a best-of);
* `mode` — what a cell does once thresholds exist: the reference pass streaming every call's inputs and output to
  disk, then the target compared: `auto` (the default `isolated: auto` on a clean target: cumulative view only)
  and `all` (both views on every layer: cumulative, the compiled whole model with hooks; isolated, every module
  alone on the reference's inputs; what any cell with a flagged layer runs). Run twice to compile, then timed
  (compile time excluded), in this process (`isolate: false`; the child process adds its start-up, reported by
  the mode's timings). Time goal: mode / (ref + tgt) ≤ 1.5.
* peak RSS (VmHWM, reset before each measurement through /proc/self/clear_refs) of a plain forward vs the mode's
  comparison; both include the loaded weights and the process itself. Goal: ≤ 1.3× and flat in depth.

    PYTHONPATH=. python benchmarks/bench_numerics.py [--depths 4,12 --hidden 768 --seq 128 --backend aot_eager]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _hwm_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]


def _rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]


def _reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def measure(depth: int, args: argparse.Namespace) -> dict[str, float]:
    import torch

    from ci_runner.backends import resolve_backend
    from ci_runner.config import BackendSpec, InputSpec, ModelSpec, Reference
    from ci_runner.models.load import build_inputs, load_model
    from ci_runner.modes.numerics import settings, views
    from ci_runner.modes.numerics.target import TargetPlan, compare_target
    from ci_runner.modes.numerics import capture as ncap
    from ci_runner.modes.numerics.thresholds import ThresholdOptions, ThresholdTable

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = ModelSpec(id="bench", config="llama", overrides={
        "hidden_size": args.hidden, "intermediate_size": args.hidden * 8 // 3, "num_hidden_layers": depth,
        "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 64,
        "vocab_size": args.vocab, "max_position_embeddings": max(512, args.seq)})
    inputs = InputSpec(batch=1, seq_len=args.seq, samples=2, seed=0)
    work = Path(tempfile.mkdtemp(prefix="bench-numerics-"))
    out: dict[str, float] = {"depth": depth}
    try:
        loaded = load_model(spec, seed=0, dtype="float32")
        model = loaded.module
        kwargs = build_inputs(loaded, inputs, sample=0)
        out["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6

        # thresholds: once per model (a float64 copy), before anything is measured
        t = time.perf_counter()
        f64 = load_model(spec, seed=0, dtype="float64").module
        primary = Reference(id="cpu-fp32", device="cpu", dtype="float32")
        second = Reference(id="cpu-fp64", device="cpu", dtype="float64")
        with torch._dynamo.config.patch(**settings.dynamo_settings()):
            stats = views.derive_reference_stats(model, primary, [(second, f64)],
                                              lambda s: build_inputs(loaded, inputs, sample=s), 2, work / "derive",
                                              chunk_mb=args.chunk_mb)
        table = ThresholdTable(layers=stats, options=ThresholdOptions(), primary_dtype="float32", key={})
        out["thresholds_s"] = time.perf_counter() - t
        del f64
        gc.collect()

        backend = resolve_backend(BackendSpec(id=args.backend, compile=args.backend))
        compiled = backend.compile(model)
        with torch.no_grad():
            compiled(**kwargs)  # compile: not timed

        def plain() -> None:
            with torch.no_grad():
                model(**kwargs)

        def target() -> None:
            with torch.no_grad():
                compiled(**kwargs)

        refs, tgts, refs_cpu, tgts_cpu = [], [], [], []
        for _ in range(args.repeat):  # interleaved, so that machine noise hits both alike
            t, c = time.perf_counter(), time.process_time()
            plain()
            refs.append(time.perf_counter() - t)
            refs_cpu.append(time.process_time() - c)
            t, c = time.perf_counter(), time.process_time()
            target()
            tgts.append(time.perf_counter() - t)
            tgts_cpu.append(time.process_time() - c)
        out["ref_s"] = min(refs)  # best of: the machine's noise only ever adds time
        out["tgt_s"] = min(tgts)
        out["ref_cpu"] = min(refs_cpu)
        out["tgt_cpu"] = min(tgts_cpu)

        gc.collect()
        out["base_rss_mb"] = _rss_mb()
        _reset_hwm()
        plain()
        out["plain_peak_mb"] = _hwm_mb()

        cpu: dict[str, list[float]] = {"all": [], "auto": []}

        def mode(isolated: str) -> float:
            t0, c0 = time.perf_counter(), time.process_time()
            folder = work / "ref" / "sample-0"
            ncap.record_reference(model, kwargs, folder, chunk_mb=args.chunk_mb)
            plan = TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(folder),), results="",
                                 journal="", isolated=isolated)
            recs: list[dict] = []
            compare_target(model, backend, plan, recs.append, table=table)
            assert recs and not any("error" in r for r in recs), [r for r in recs if "error" in r][:3]
            ran = any(r["view"] == "isolated" and "metrics" in r for r in recs)
            assert ran == (isolated == "all"), "a clean target skips the isolated view under auto"
            cpu[isolated].append(time.process_time() - c0)
            return time.perf_counter() - t0

        out["mode_first_s"] = mode("all")  # compiles every module for the isolated view
        gc.collect()
        mode("all")  # a second warm-up: a few graphs recompile once when their inputs turn out to vary
        mode("auto")
        cpu["all"].clear()
        cpu["auto"].clear()
        _reset_hwm()
        times = [mode("all") for _ in range(max(1, args.repeat // 2))]
        out["mode_peak_mb"] = _hwm_mb()
        out["mode_s"] = min(times)
        out["mode_auto_s"] = min(mode("auto") for _ in range(max(1, args.repeat // 2)))
        out["mode_cpu"] = min(cpu["all"])
        out["mode_auto_cpu"] = min(cpu["auto"])
        out["dump_mb"] = sum(f.stat().st_size for f in (work / "ref" / "sample-0").iterdir()) / 2**20
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", default="4,12")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--backend", default="aot_eager")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--chunk-mb", type=float, default=64.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: measure one depth
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args)))
        return 0
    rows = []
    for d in (int(x) for x in args.depths.split(",")):
        cmd = [sys.executable, __file__, "--one", str(d)] + [a for a in sys.argv[1:] if a != "--json"]
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
        if res.returncode != 0:
            print(res.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"numerics mode cost, Llama-shaped, hidden {args.hidden}, seq {args.seq}, backend {args.backend} "
          f"(compile and threshold derivation excluded)")
    print(f"{'depth':>5} {'params':>8} {'ref s':>7} {'tgt s':>7} {'auto s':>7} {'auto x':>7} {'all s':>7} "
          f"{'all x':>7} {'plain MB':>9} {'mode MB':>8} {'mem x':>6} {'dump MB':>8} {'thr s':>6} {'1st s':>6}")
    for r in rows:
        base = r["ref_s"] + r["tgt_s"]
        mx = r["mode_peak_mb"] / r["plain_peak_mb"]
        print(f"{int(r['depth']):>5} {r['params_m']:>7.1f}M {r['ref_s']:>7.3f} {r['tgt_s']:>7.3f} "
              f"{r['mode_auto_s']:>7.3f} {r['mode_auto_s'] / base:>6.2f}x {r['mode_s']:>7.3f} {r['mode_s'] / base:>6.2f}x "
              f"{r['plain_peak_mb']:>9.0f} {r['mode_peak_mb']:>8.0f} {mx:>5.2f}x {r['dump_mb']:>8.1f} "
              f"{r['thresholds_s']:>6.1f} {r['mode_first_s']:>6.1f}")
    print("memory: mode − plain forward, per depth: " + ", ".join(
        f"{int(r['depth'])} layers +{r['mode_peak_mb'] - r['plain_peak_mb']:.0f} MB" for r in rows)
        + " (a compiled target's cumulative view holds one compiled graph's module outputs until it returns)")
    print("CPU time (process_time, best of; robust on a shared machine with --threads 1):")
    for r in rows:
        base = r["ref_cpu"] + r["tgt_cpu"]
        print(f"{int(r['depth']):>5} ref {r['ref_cpu']:.3f} tgt {r['tgt_cpu']:.3f} auto {r['mode_auto_cpu']:.3f} "
              f"({r['mode_auto_cpu'] / base:.2f}x) all {r['mode_cpu']:.3f} ({r['mode_cpu'] / base:.2f}x)")
    print("auto: a clean target, the isolated view skipped (`isolated: auto`, the default); all: both views on every "
          "layer (`isolated: all`, or any cell whose cumulative view flags a layer). mem x is measured on `all`.")
    print("goals: time x ≤ 1.5, mem x ≤ 1.3 and flat in depth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
