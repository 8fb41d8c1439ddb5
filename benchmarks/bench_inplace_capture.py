"""Memory cost of the in-place rule (issue 25): what the compiled capture holds with no copy, with copies of the
outputs the reference pass saw changed in place later (what the numerics mode does), and with copies of every
output (what a compiled dump or the batch-invariance check does, having no reference pass), side by side in one
run, on a ResNet-18-shaped model (basic layers: `hidden_state += residual` after a BatchNorm) and a Llama-shaped
one (no in-place update of a returned output).

Held bytes = distinct storages among the captured tensors after the forward (what the hooks keep alive); the
reference pass (which watches version counters at every hook) is timed too. Measured on 2 shared cores:
ResNet-18 shape 1.30x (mutated-only) and 1.80x (all), Llama 1.00x and 1.22x.

    PYTHONPATH=. python benchmarks/bench_inplace_capture.py [--image 64 --seq 64 --backend aot_eager]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from ci_runner.watch.capture import OutputHooks
from ci_runner.modes.numerics.capture import capture_compiled_outputs, record_reference
from ci_runner.modes.numerics.store import DumpReader


def held_bytes(records: list[tuple[str, Any]]) -> int:
    seen: dict[int, int] = {}
    for _key, flat in records:
        for _sub, t in flat:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure(name: str, model: torch.nn.Module, kwargs: dict[str, Any], backend: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        record_reference(model, kwargs, Path(tmp) / "ref")
        t_ref = time.perf_counter() - t0
        reader = DumpReader(Path(tmp) / "ref")
        mutated = reader.mutated_names()
        calls = len(reader.calls)
    fn = torch.compile(lambda m, a, k: m(*a, **k), backend=backend)
    row = {}
    for label, clone in (("none", ()), ("mutated", mutated), ("all", True)):
        torch._dynamo.reset()
        with OutputHooks(model, clone=clone) as hooks:
            capture_compiled_outputs(model, fn, (), kwargs, hooks)  # compile
            _out, records = capture_compiled_outputs(model, fn, (), kwargs, hooks)
        row[label] = held_bytes(records)
        del records
    base = row["none"]
    print(f"{name}: {calls} calls, {len(mutated)} module(s) with an output changed in place later; reference pass "
          f"{t_ref:.2f}s; held by the compiled capture: none {base / 2**20:.1f} MiB, mutated-only "
          f"{row['mutated'] / 2**20:.1f} MiB ({row['mutated'] / base:.2f}x), all {row['all'] / 2**20:.1f} MiB "
          f"({row['all'] / base:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--backend", default="aot_eager")
    a = ap.parse_args()
    torch.manual_seed(0)
    resnet = transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2], layer_type="basic")).eval()
    measure("resnet-18 shape", resnet, {"pixel_values": torch.randn(1, 3, a.image, a.image)}, a.backend)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000)).eval()
    measure("llama 4 layers", llama, {"input_ids": torch.randint(0, 1000, (1, a.seq))}, a.backend)


if __name__ == "__main__":
    main()
