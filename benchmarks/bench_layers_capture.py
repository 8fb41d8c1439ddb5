"""Overhead of the `layers` capture pass against a plain forward, on a realistically sized model.

Measured, interleaved with plain forwards (no hooks), as wall time and as this process's CPU time (the
latter is what the capture costs when other processes share the machine; use --threads 1 there):

* `capture pass` (what the mode runs on every cell): `layer_search.scan_model`, hooks on every submodule,
  every call recorded (names, classes, call counts, whether the inputs can be replayed). Goal ≤ 1.02x.
* `level capture`: `layer_search.capture_inputs` for one search level of the widest kind (every decoder
  layer's `self_attn`): what the probing child runs per level when the whole model failed.
* `full retention` (for comparison, not used by the mode): every call's args and kwargs kept by reference.
  Keeping every activation alive costs fresh memory for all of them; that is why the mode does not do it.

    PYTHONPATH=. python benchmarks/bench_layers_capture.py [--hidden 768 --layers 12 --seq 128 --repeat 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from ci_runner.config import InputSpec, ModelSpec
    from ci_runner.modes.layers.search import capture_inputs, record_calls, scan_model
    from ci_runner.models.load import build_inputs, load_model

    spec = ModelSpec(id="bench-llama", config="llama", overrides={
        "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 64,
        "vocab_size": args.vocab, "max_position_embeddings": max(512, args.seq)})
    loaded = load_model(spec, seed=0)
    model = loaded.module
    kwargs = build_inputs(loaded, InputSpec(batch=1, seq_len=args.seq, samples=1, seed=0), sample=0)
    n_params = sum(p.numel() for p in model.parameters())

    attn = [n for n, m in model.named_modules() if n.endswith("self_attn")]

    def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        return time.perf_counter() - t0, time.process_time() - c0

    def plain() -> None:
        with torch.no_grad():
            model(**kwargs)

    variants = {
        "plain_forward": plain,
        "capture_pass": lambda: scan_model(model, kwargs),
        "level_capture_self_attn": lambda: capture_inputs(model, (), kwargs, attn),
        "full_retention": lambda: record_calls(model, (), kwargs),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    cpu: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up
    order = list(variants)
    for i in range(args.repeat):  # interleaved and rotated, against drift on a shared machine
        for k in order[i % len(order):] + order[: i % len(order)]:
            wall, used = timed(variants[k])
            times[k].append(wall)
            cpu[k].append(used)
    tree = scan_model(model, kwargs)
    per_call_us = _hook_cost_per_call_us(scan_model)
    base_med = statistics.median(times["plain_forward"])
    base_min = min(times["plain_forward"])
    cpu_med = statistics.median(cpu["plain_forward"])
    report: dict[str, object] = {
        "model": {"hidden": args.hidden, "layers": args.layers, "seq": args.seq, "vocab": args.vocab,
                  "params_m": round(n_params / 1e6, 1), "threads": torch.get_num_threads()},
        "modules": len(tree.nodes), "calls": sum(n.calls for n in tree.nodes.values()), "repeat": args.repeat,
    }
    for k, v in times.items():
        report[k] = {"median_s": round(statistics.median(v), 4), "min_s": round(min(v), 4),
                     "ratio_median": round(statistics.median(v) / base_med, 4),
                     "ratio_min": round(min(v) / base_min, 4),
                     "cpu_median_s": round(statistics.median(cpu[k]), 4),
                     "cpu_ratio_median": round(statistics.median(cpu[k]) / cpu_med, 4)}
    # CPU time of this process: what the capture itself costs, not what other processes on the machine take
    n_calls = sum(n.calls for n in tree.nodes.values())
    # the capture's own cost, free of the forward's noise: per-call hook cost (measured on a tiny model, many
    # repeats) times the calls of this model, over the plain forward's CPU time
    report["hook_cost_per_call_us"] = round(per_call_us, 2)
    report["capture_pass_estimated_ratio"] = round(1 + n_calls * per_call_us / 1e6 / cpu_med, 4)
    report["goal"] = "capture_pass <= 1.02x a plain forward (cpu_ratio_median with --threads 1; estimated ratio)"
    report["goal_met"] = bool(report["capture_pass_estimated_ratio"] <= 1.02)  # type: ignore[operator]
    print(json.dumps(report, indent=2))
    return 0


def _hook_cost_per_call_us(scan_model) -> float:  # type: ignore[no-untyped-def]
    """CPU µs the capture pass adds per module call: a 64-Linear stack, scanned vs run plainly, many times."""
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(64)]).eval()
    x = {"input": torch.randn(1, 4)}
    calls = 65  # the Sequential itself and its 64 children

    def cpu(fn, n: int = 200) -> float:  # type: ignore[no-untyped-def]
        samples = []
        for _ in range(7):
            c0 = time.process_time()
            for _ in range(n):
                fn()
            samples.append((time.process_time() - c0) / n)
        return statistics.median(samples)

    def plain() -> None:
        with torch.no_grad():
            net(**x)

    plain()
    scan_model(net, x)
    return max(0.0, (cpu(lambda: scan_model(net, x)) - cpu(plain)) / calls * 1e6)


if __name__ == "__main__":
    raise SystemExit(main())
