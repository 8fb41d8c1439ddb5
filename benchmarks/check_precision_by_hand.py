"""Issue 43's hand check, with plain `torch.compile` and no deepview-ci code: what OpenVINO at bf16 and f32, IREE's
turbine_cpu and inductor on a bf16 model compute, per op class, against float64 on the same weights.

    python benchmarks/check_precision_by_hand.py

Expected (2026-12-07, torch 2.13, OpenVINO 2026.4, CPU without avx512_bf16): OpenVINO bf16 Linear rel 2.21e-3 =
the policy emulation's 2.21e-3 and its RMSNorm ~5e-8 (float32: the convention); IREE ~1e-7 (float32); inductor
on the bf16 tiny Llama 4.1e-3 on the logits, eager bf16 4.6e-3.
"""
import torch, warnings, copy
warnings.filterwarnings("ignore")
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
model = LlamaForCausalLM(cfg).eval()
ids = torch.randint(0, 128, (1, 16))
def rel(a, b): return float((a.double()-b.double()).norm()/b.double().norm())
lin = model.model.layers[0].mlp.up_proj
norm = model.model.layers[0].input_layernorm
x = torch.randn(1, 16, 64)
for name, opts in (("openvino bf16", {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "bf16"}}),
                   ("openvino f32", {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}})):
    import openvino.torch  # noqa
    for what, mod in (("Linear", lin), ("RMSNorm", norm)):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(copy.deepcopy(mod), backend="openvino", options=opts)(x)
            exact = copy.deepcopy(mod).double()(x.double())
        print(f"{name:14s} {what:8s} rel vs float64 {rel(out, exact):.2e}")
with torch.no_grad():
    emu = torch.nn.functional.linear(x.bfloat16().float(), lin.weight.bfloat16().float())
    print(f"emulated bf16 Linear (inputs rounded, f32 accumulate) rel {rel(emu, lin.double()(x.double())):.2e}")
    nb = copy.deepcopy(norm).bfloat16()
    print(f"RMSNorm computed in bf16 (eager, x rounded) rel {rel(nb(x.bfloat16()), norm.double()(x.double())):.2e}")
# IREE
try:
    import iree.turbine  # noqa: F401  (registers turbine_cpu with Dynamo)
    for what, mod in (("Linear", lin), ("RMSNorm", norm)):
        torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(copy.deepcopy(mod), backend="turbine_cpu")(x)
        print(f"iree turbine_cpu {what:8s} rel vs float64 {rel(out, copy.deepcopy(mod).double()(x.double())):.2e}")
except Exception as e:
    print("iree:", type(e).__name__, str(e)[:200])
# inductor on the model in bf16: logits vs float64 on the same (bf16) weights, and eager bf16's
mb = copy.deepcopy(model).bfloat16()
m64 = copy.deepcopy(mb).double()
torch._dynamo.reset()
with torch.no_grad():
    ind = torch.compile(mb, backend="inductor")(input_ids=ids).logits
    eag = mb(input_ids=ids).logits
    ref = m64(input_ids=ids).logits
print(f"inductor bf16 model logits rel vs float64 {rel(ind, ref):.2e}; eager bf16 {rel(eag, ref):.2e}")
