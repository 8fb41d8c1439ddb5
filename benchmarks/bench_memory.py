"""The memory mode's prediction at full size (issue 37): a 70B-shaped Llama (hidden 8192, 80 layers, 64 heads,
8 KV heads, intermediate 28672, vocab 128256, bfloat16) at an 8k context and batch 8, predicted on `meta` tensors
(no weights, no device) by the same code the mode runs (`modes/memory/runs.py`). Goal: <= 60 s and <= 2 GB RSS on
2 cores. Prints the time, the peak RSS, and the predicted figures next to a hand count of the weights and of the KV
cache (2 tensors × layers × batch × KV heads × cache length × head dim × 2 bytes, plus the 8-byte
`cumulative_length` counter transformers' StaticCache keeps per layer).

    PYTHONPATH=. python benchmarks/bench_memory.py [--seq-len 8192 --batch 8 --steps 2 --budget-gb 141]
"""

from __future__ import annotations

import argparse
import resource
import time

LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 131072,
             "tie_word_embeddings": False}


def hand_count(cfg: dict, *, batch: int, cache_len: int, nbytes: int = 2) -> tuple[int, int]:
    """(weight bytes, KV cache bytes) of a Llama config, counted by hand."""
    h, n, i, v = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h  # q, k+v, o, gate/up/down, two norms
    weights = n * per_layer + v * h * (1 if cfg.get("tie_word_embeddings") else 2) + h  # + embed, lm_head, norm
    cache = 2 * n * batch * cfg["num_key_value_heads"] * cache_len * hd
    return weights * nbytes, cache * nbytes + n * 8  # + StaticCache's `cumulative_length`: one int64 per layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--budget-gb", type=float, default=141.0, help="an H200's memory, for first_over_budget")
    args = ap.parse_args()
    t0 = time.perf_counter()

    from ci_runner.config import InputSpec, ModelSpec
    from ci_runner.models.load import load_model
    from ci_runner.modes.memory.meters import DispatchMeter
    from ci_runner.modes.memory.runs import metered_run, module_bytes
    from ci_runner.modes.memory.tables import first_over_budget, phase_summary
    from ci_runner.workloads.phases import parse_phases

    t_import = time.perf_counter() - t0
    spec = ModelSpec(id="llama-70b-shape", config="llama", overrides=LLAMA_70B, dtype="bfloat16")
    loaded = load_model(spec, meta=True, dtype="bfloat16")
    loaded.module.to(loaded.dtype)
    t_build = time.perf_counter() - t0 - t_import
    inputs = InputSpec(batch=args.batch, seq_len=args.seq_len, samples=1)
    phase = parse_phases([{"decode": {"steps": args.steps}}], seq_len=args.seq_len)[0]
    run = metered_run(loaded.module, loaded, inputs, phase, "meta", DispatchMeter(shadow_numel=1 << 22), max_depth=4)
    t_run = time.perf_counter() - t0 - t_import - t_build
    params, buffers = module_bytes(loaded.module)
    w_hand, kv_hand = hand_count(LLAMA_70B, batch=args.batch, cache_len=args.seq_len + args.steps)
    summary = phase_summary(run)
    rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    gb = 1e9
    print(f"70B-shaped llama, bfloat16, batch {args.batch}, prompt {args.seq_len}, {args.steps} decode steps")
    print(f"time: import {t_import:.1f} s, meta build {t_build:.1f} s, prediction {t_run:.1f} s, "
          f"total {time.perf_counter() - t0:.1f} s; peak RSS {rss_gb:.2f} GiB")
    print(f"error: {run.error}" if run.error else "prediction ran every call")
    print(f"weights   predicted {params / gb:10.3f} GB   hand count {w_hand / gb:10.3f} GB   equal: {params == w_hand}")
    kv = summary["kv_bytes"][-1] if summary["kv_bytes"] else 0
    print(f"KV cache  predicted {kv / gb:10.3f} GB   hand count {kv_hand / gb:10.3f} GB   equal: {kv == kv_hand} "
          f"({kv} vs {kv_hand} bytes)")
    print(f"buffers {buffers} bytes; peak {summary['peak_bytes'] / gb:.3f} GB at {summary['peak_at']}")
    print(f"first over {args.budget_gb:g} GiB: {first_over_budget([run], int(args.budget_gb * 2**30))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
