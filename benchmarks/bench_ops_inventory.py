"""Op inventory of a Bamba-9B-sized model on CPU with no weights: time and peak memory.

The model is built on the meta device (`models.load_model(..., meta=True)`: no weights, no accelerator) with the
shape of the published Bamba-9B config (hidden 4096, 32 layers of which 9/18/27 attention, 128 Mamba-2 heads of
64, state 128, vocab 128256), and inventoried at the chosen IR level (default `aten`: what aot_autograd hands a
torch.compile backend). Goal: ≤ 30 s and ≤ 2 GB peak RSS (of this whole process, torch import included).
Wall time depends on what else runs on the machine: the CPU time of the trace and the 1-minute load average are
printed next to it.

    PYTHONPATH=. python benchmarks/bench_ops_inventory.py [--level aten|core_aten|dynamo|dispatch] [--seq 32] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

BAMBA_9B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 4096,
    "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_d_state": 128,
    "mamba_n_groups": 1, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_d_conv": 4,
}


def _cpu_s() -> float:
    """CPU seconds of this process: on a shared, loaded machine a fairer measure than wall time."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", default="aten", choices=["dynamo", "aten", "core_aten", "dispatch"])
    ap.add_argument("--device", default="cpu", help="the backend's device (decides the attention kernel)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    args = ap.parse_args()

    t_start = time.perf_counter()
    import torch

    from ci_runner.config import InputSpec, ModelSpec
    from ci_runner.modes.ops.inventory import take_inventory
    from ci_runner.models.load import build_inputs, load_model

    t_import = time.perf_counter() - t_start
    rss_import = peak_rss_mb()
    spec = ModelSpec(id="bamba-9b-shape", config="bamba", overrides=BAMBA_9B)
    t0 = time.perf_counter()
    loaded = load_model(spec, seed=0, meta=True)
    kwargs = build_inputs(loaded, InputSpec(batch=1, seq_len=args.seq, samples=1, seed=0), sample=0)
    t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in loaded.module.parameters())
    assert all(p.is_meta for p in loaded.module.parameters()), "expected a weightless (meta) model"
    t0, c0 = time.perf_counter(), _cpu_s()
    inv = take_inventory(loaded.module, (), kwargs, level=args.level, device=args.device)
    t_inv, c_inv = time.perf_counter() - t0, _cpu_s() - c0
    summary = inv.summary()
    total = time.perf_counter() - t_start
    peak = peak_rss_mb()
    report = {
        "model": "Bamba-9B shape (meta device, no weights)", "params_b": round(n_params / 1e9, 2),
        "level": args.level, "method": inv.method, "traced_device": inv.device, "seq_len": args.seq,
        "ops": summary["distinct_ops"], "signatures": summary["distinct_signatures"], "calls": summary["total_calls"],
        "graphs": inv.graphs, "import_s": round(t_import, 2), "build_s": round(t_build, 2),
        "inventory_s": round(t_inv, 2), "inventory_cpu_s": round(c_inv, 2), "total_s": round(total, 2),
        "load_avg_1m": round(os.getloadavg()[0], 2), "rss_after_import_mb": round(rss_import),
        "peak_rss_mb": round(peak), "goal": "inventory+build <= 30 s, peak RSS <= 2048 MB",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
    }
    report["meets_goal"] = (t_build + t_inv) <= 30.0 and peak <= 2048
    if args.json:
        print(json.dumps(report))
    else:
        width = max(len(k) for k in report)
        for k, v in report.items():
            print(f"{k:<{width}}  {v}")
        top = sorted(summary["ops"], key=lambda o: -o["calls"])[:8]
        print("most called:", ", ".join(f"{o['op']}×{o['calls']}" for o in top))
    return 0 if report["meets_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
