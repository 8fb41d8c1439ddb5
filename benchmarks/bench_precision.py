"""Detection power of the numerics mode under a precision policy, and what each self-test class does.

For every Linear, attention and norm layer of the README's tiny Llama (random weights, seed 0), in the isolated
view (the layer fed the float32 reference's inputs): the policy's own expected error `e` (its CPU emulation against
float32, over `--samples` inputs), the threshold the mode derives (`policy_margin` × the 99th percentile of `e`,
floored as the mode floors), then the smallest extra relative error, injected into that layer's output on top of the
emulated result (independent noise of norm `k·e·‖ref‖`), that is flagged, as a multiple `k` of `e`. The goal of
issue 43 is ≤ 3×. Printed as a markdown table.

    python benchmarks/bench_precision.py [--policy bfloat16] [--samples 4]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ci_runner.workloads.emulate import emulate
from ci_runner.modes.numerics.thresholds import threshold_from_stats
from ci_runner.options import ThresholdOptions
from ci_runner.workloads.precision import parse_precision


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    return LlamaForCausalLM(cfg).eval()


def layer_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, tuple[tuple, dict]]:
    got: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) or type(mod).__name__ in ("LlamaRMSNorm", "LlamaAttention"):
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, k, n=name: got.setdefault(n, (tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in a),
                                                           dict(k))), with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    return got


def first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out  # type: ignore[return-value,index]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="bfloat16")
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args()
    policy = parse_precision(args.policy)
    opts = ThresholdOptions()
    model = tiny_llama()
    mods = dict(model.named_modules())
    samples = [layer_inputs(model, torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(s)))
               for s in range(args.samples)]
    multiples = [1.0, 1.5, 2.0, 2.5, 2.83, 3.0, 3.5, 4.0, 6.0, 8.0]
    print(f"| layer | class | expected rel (policy {policy.label()}) | threshold rel | smallest flagged k |")
    print("|---|---|---|---|---|")
    found_at: list[float] = []
    for name in samples[0]:
        m = mods[name]
        stats = {"rel": [], "one_minus_cos": [], "mad": [], "ref_absmean": []}
        pairs = []
        for s in samples:
            a, k = s[name]
            with torch.no_grad():
                ref = first(m(*a, **k))
                with emulate(policy):
                    emu = first(m(*a, **k))
            e = rel(emu, ref)
            stats["rel"].append(e)
            stats["one_minus_cos"].append(max(0.0, 1 - float(torch.nn.functional.cosine_similarity(
                emu.double().flatten(), ref.double().flatten(), dim=0))))
            stats["mad"].append(float((emu - ref).abs().mean()))
            stats["ref_absmean"].append(float(ref.abs().mean()))
            pairs.append((ref, emu, e))
        zero = {"rel": [0.0], "one_minus_cos": [0.0], "mad": [0.0], "ref_absmean": stats["ref_absmean"]}
        thr = threshold_from_stats(zero, opts, "float32", stats)
        e_mid = statistics.median(stats["rel"])
        smallest = None
        for kx in multiples:
            flagged = 0
            for i, (ref, emu, _e) in enumerate(pairs):
                noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(100 + i), dtype=torch.float64)
                noise = noise / noise.norm() * kx * max(e_mid, 1e-12) * ref.double().norm()
                tgt = emu.double() + noise
                flagged += rel(tgt, ref) > thr["rel"]
            if flagged == len(pairs):
                smallest = kx
                break
        cls = "norm" if "norm" in type(m).__name__.lower() else ("attention" if "Attention" in type(m).__name__ else "matmul")
        if e_mid > 0 and smallest is not None:
            found_at.append(smallest)
        shown = "—(no spread: float32 threshold)" if e_mid == 0 else (f"{smallest:g}×" if smallest else f"> {multiples[-1]:g}×")
        print(f"| {name} | {cls} | {e_mid:.3g} | {thr['rel']:.3g} | {shown} |")
    if found_at:
        print(f"\nlayers with a policy spread: {len(found_at)}; smallest flagged multiple: median "
              f"{statistics.median(found_at):g}×, worst {max(found_at):g}× (goal ≤ 3×; policy_margin {opts.policy_margin:g}, "
              f"percentile {opts.percentile:g} over {args.samples} samples)")


if __name__ == "__main__":
    main()
