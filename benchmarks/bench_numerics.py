"""Cost of the `numerics` mode against the passes it cannot avoid, at two model depths, side by side.

For each depth a fresh process builds a Llama-shaped model (random weights), derives its thresholds first (once
per model, like compile time not part of a cell's comparison), then measures:

* `ref` — a plain eager forward (the primary reference pass), `tgt` — the target's compiled forward (warm: compile
  time excluded), median of `--repeat`;
* `mode` — what a cell does once thresholds exist: the reference pass streaming every call's inputs and output to
  disk, then the target compared in both views (cumulative: the compiled whole model with hooks; isolated: every
  module alone on the reference's inputs). Run once to compile, then timed (compile time excluded), in this
  process (`isolate: false`; the child process adds its start-up, reported separately by the mode).
  Time goal: mode / (ref + tgt) ≤ 1.5.
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
import statistics
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
    from ci_runner.models import build_inputs, load_model
    from ci_runner.modes import numerics as nx

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
        with torch._dynamo.config.patch(**nx.DYNAMO_SETTINGS):
            nx.derive_reference_stats(model, primary, [(second, f64)], lambda s: build_inputs(loaded, inputs, sample=s),
                                      2, work / "derive", chunk_mb=args.chunk_mb)
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

        refs, tgts = [], []
        for _ in range(args.repeat):  # interleaved, so that machine noise hits both alike
            t = time.perf_counter()
            plain()
            refs.append(time.perf_counter() - t)
            t = time.perf_counter()
            target()
            tgts.append(time.perf_counter() - t)
        out["ref_s"] = statistics.median(refs)
        out["tgt_s"] = statistics.median(tgts)

        gc.collect()
        out["base_rss_mb"] = _rss_mb()
        _reset_hwm()
        plain()
        out["plain_peak_mb"] = _hwm_mb()

        def mode() -> float:
            t0 = time.perf_counter()
            folder = work / "ref" / "sample-0"
            nx.record_reference(model, kwargs, folder, chunk_mb=args.chunk_mb)
            plan = nx.TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(folder),), results="",
                                 journal="")
            recs: list[dict] = []
            nx.compare_target(model, backend, plan, recs.append)
            assert recs and not any("error" in r for r in recs), [r for r in recs if "error" in r][:3]
            return time.perf_counter() - t0

        out["mode_first_s"] = mode()  # compiles every module for the isolated view
        gc.collect()
        _reset_hwm()
        times = [mode() for _ in range(max(1, args.repeat // 3))]
        out["mode_peak_mb"] = _hwm_mb()
        out["mode_s"] = statistics.median(times)
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
    print(f"{'depth':>5} {'params':>8} {'ref s':>7} {'tgt s':>7} {'mode s':>7} {'time x':>7} {'plain MB':>9} "
          f"{'mode MB':>8} {'mem x':>6} {'dump MB':>8} {'thr s':>6} {'1st s':>6}")
    for r in rows:
        tx = r["mode_s"] / (r["ref_s"] + r["tgt_s"])
        mx = r["mode_peak_mb"] / r["plain_peak_mb"]
        print(f"{int(r['depth']):>5} {r['params_m']:>7.1f}M {r['ref_s']:>7.3f} {r['tgt_s']:>7.3f} {r['mode_s']:>7.3f} "
              f"{tx:>6.2f}x {r['plain_peak_mb']:>9.0f} {r['mode_peak_mb']:>8.0f} {mx:>5.2f}x {r['dump_mb']:>8.1f} "
              f"{r['thresholds_s']:>6.1f} {r['mode_first_s']:>6.1f}")
    print("goals: time x ≤ 1.5, mem x ≤ 1.3 and flat in depth")
    return 0


if __name__ == "__main__":
    sys.exit(main())
