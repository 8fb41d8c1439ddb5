"""Issue 45's ModernBERT case by hand, with plain `torch.compile`: transformers' ModernBERT calls its rotary embedding
once per layer type, looping over `set(config.layer_types)`, so the two calls' order follows the process's hash seed
and may differ between eager and a compiled run. This prints both orders, the two calls compared by index and by
layer type, and the model's output against eager (what deepview-ci's numerics verdict must agree with).

    PYTHONHASHSEED=1 python benchmarks/check_call_order_by_hand.py [turbine_cpu|openvino|aot_eager]

Measured 2026-12-07 on IREE `turbine_cpu`, PYTHONHASHSEED=1: eager [sliding, full], compiled [full, sliding]; by index
1.0085 apart, by layer type 3.7e-7; output max abs 4.8e-7 (rel 9.7e-8). deepview-ci's numerics mode on the same
model (the matrix below as YAML, `deepview-ci run M --out O`) passes: "no layer exceeds its threshold".

    version: 1
    models:
      - id: mbert
        config: modernbert
        overrides: {hidden_size: 64, intermediate_size: 128, num_hidden_layers: 3, num_attention_heads: 4,
                    vocab_size: 128, pad_token_id: 0, bos_token_id: 1, eos_token_id: 2, cls_token_id: 1,
                    sep_token_id: 2, global_attn_every_n_layers: 2, local_attention: 8, max_position_embeddings: 64}
    backends: [{id: iree, compile: turbine_cpu}]
    defaults: {modes: [numerics], inputs: {seq_len: 16, samples: 1}}
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import transformers


def main(backend: str) -> None:
    if backend == "turbine_cpu":
        import iree.turbine  # noqa: F401  (registers turbine_cpu)
    options: dict[str, Any] = {"options": {"aot_autograd": True}} if backend == "openvino" else {}
    if backend == "openvino":
        import openvino.torch  # noqa: F401  (registers openvino)
    cfg = transformers.ModernBertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                        vocab_size=128, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                                        sep_token_id=2, global_attn_every_n_layers=2, local_attention=8,
                                        max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.ModernBertModel(cfg).eval()
    ids = torch.randint(3, 128, (1, 16))
    calls: dict[str, list[tuple[str, torch.Tensor]]] = {"eager": [], "compiled": []}
    which = ["eager"]

    def hook(mod: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        layer_type = kwargs.get("layer_type", args[2] if len(args) > 2 else None)
        calls[which[0]].append((str(layer_type), out[0].detach().clone()))

    model.rotary_emb.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
        which[0] = "compiled"
        got = torch.compile(model, backend=backend, **options)(input_ids=ids).last_hidden_state
    print("order: eager", [c[0] for c in calls["eager"]], "compiled", [c[0] for c in calls["compiled"]])
    for (le, te), (lc, tc) in zip(calls["eager"], calls["compiled"]):
        print(f"by index: {le} vs {lc}: max abs {float((te - tc).abs().max()):.3g}")
    compiled = dict(calls["compiled"])
    for lt, t in calls["eager"]:
        if lt in compiled:
            print(f"by layer type: {lt}: max abs {float((t - compiled[lt]).abs().max()):.3g}")
    print(f"output: max abs {float((ref - got).abs().max()):.3g}, rel {float((ref - got).norm() / ref.norm()):.3g}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "turbine_cpu")
