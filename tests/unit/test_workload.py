"""The workload engine (`workloads/calls.py`) on eager models: it runs phases as generation does."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.config import InputSpec, ModelSpec
from ci_runner.models.load import load_model
from ci_runner.workloads.calls import run_phase, skip_reason
from ci_runner.workloads.phases import parse_phases

pytestmark = pytest.mark.oldtorch

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}
INPUTS = InputSpec(seq_len=8, samples=1, phases=("prefill", {"decode": {"steps": 3}},
                                                  {"batch": {"lengths": [8, 5, 2]}}, {"long": {"seq_len": [16, 200]}}))


@pytest.fixture(scope="module")
def llama() -> Any:
    return load_model(ModelSpec(id="l", config="llama", overrides=MappingProxyType(LLAMA)), seed=0)


def _phase(name: str) -> Any:
    return next(p for p in INPUTS.workload() if p.name == name)


def test_decode_through_the_static_cache_matches_the_full_forward(llama: Any) -> None:
    run = run_phase(llama.module, llama, INPUTS, _phase("decode"))
    assert [r.label for r in run.records] == ["prefill", "decode step 1", "decode step 2", "decode step 3"]
    assert all(r.error is None for r in run.records) and run.overwritten == []
    prompt = run.records[0].logits
    ids = _ids_of(run)
    with torch.no_grad():
        full = llama.module(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(prompt, full[:, :8], atol=1e-5, rtol=1e-5)
    for k, rec in enumerate(run.records[1:]):
        torch.testing.assert_close(rec.logits[:, -1], full[:, 8 + k], atol=1e-5, rtol=1e-5)


def _ids_of(run: Any) -> torch.Tensor:
    """The prompt's ids then each decode step's token (the greedy ones eager chose)."""
    first = run.records[0]
    prompt_ids = first.prompt_ids
    return torch.cat([prompt_ids] + [r.token for r in run.records[1:]], dim=1)


def test_teacher_forcing_feeds_the_given_tokens(llama: Any) -> None:
    forced = [torch.tensor([[5]]), torch.tensor([[6]]), torch.tensor([[7]])]
    run = run_phase(llama.module, llama, INPUTS, _phase("decode"), forced=forced)
    assert [int(r.token) for r in run.records[1:]] == [5, 6, 7]


def test_a_left_padded_batch_matches_each_prompt_alone_on_real_tokens(llama: Any) -> None:
    run = run_phase(llama.module, llama, INPUTS, _phase("batch"))
    rec = run.records[0]
    assert rec.real.tolist()[2] == [False] * 6 + [True] * 2
    ids = rec.prompt_ids
    for row, n in enumerate([8, 5, 2]):
        with torch.no_grad():
            alone = llama.module(input_ids=ids[row:row + 1, 8 - n:], use_cache=False).logits
        torch.testing.assert_close(rec.logits[row, 8 - n:], alone[0], atol=1e-4, rtol=1e-4)


def test_an_output_a_later_call_overwrites_is_named(llama: Any) -> None:
    arena: dict[tuple[int, ...], torch.Tensor] = {}

    def reusing(**kwargs: Any) -> Any:  # a runtime that hands out the same output buffer for the same shape
        out = llama.module(**kwargs)
        buf = arena.setdefault(tuple(out.logits.shape), torch.empty_like(out.logits))
        buf.copy_(out.logits)
        return buf

    run = run_phase(reusing, llama, INPUTS, _phase("decode"))
    assert [o["call"] for o in run.overwritten] == ["decode step 1", "decode step 2"]
    assert run.overwritten[0]["changed_after"] == "decode step 2" and run.overwritten[0]["shares_storage"]


def test_what_does_not_apply_is_skipped_with_its_reason(llama: Any) -> None:
    assert skip_reason(llama, _phase("decode"), INPUTS) is None
    long = _phase("long")
    assert skip_reason(llama, long, INPUTS) is None  # 16 fits; 200 is left out
    labels = [r.label for r in run_phase(llama.module, llama, INPUTS, long).records]
    assert labels == ["long 8", "long 16"]  # the prompt's length first: the long one is a recompile, as users hit it
    over = parse_phases([{"long": {"seq_len": [100]}}], seq_len=8)[0]
    assert "max_position_embeddings 64" in skip_reason(llama, over, INPUTS)
    vit = load_model(ModelSpec(id="v", config="vit", overrides=MappingProxyType(
        {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
         "image_size": 16, "patch_size": 8})), seed=0)
    assert "token inputs" in skip_reason(vit, _phase("decode"), INPUTS)


def test_symbolic_functions_are_what_a_dynamic_length_hands_the_backend() -> None:
    """A sliding-window mask's `max(0, s - window + 1)` under a dynamic length is `torch.sym_max` in the graph (the
    backends that fail on it say so); the size queries are ATen ops and are not listed; a static graph has none."""
    from ci_runner.workloads.calls import symbolic_functions

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    def window(x: torch.Tensor) -> torch.Tensor:
        start = max(0, x.shape[0] - 3)
        return x[start:] * 2

    torch._dynamo.reset()
    fn = torch.compile(window, backend=keep, dynamic=True)
    fn(torch.randn(6))
    static = torch.compile(window, backend=keep, dynamic=False)
    torch._dynamo.reset()
    static(torch.randn(6))
    assert symbolic_functions(graphs[0]) == ["sym_max"], graphs[0].code
    assert symbolic_functions(graphs[-1]) == []


def test_describing_a_dynamic_graphs_tensors_keeps_every_dim_symbolic() -> None:
    """`described_tensor` reads symbolic sizes by their hint: `int()` would specialize the symbol in the graph's shape
    environment, and every tensor described after the first would read as static."""
    from ci_runner.engine.codec import described_tensor

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    fn = torch.compile(lambda x: (x * 2).sum(-1) + x.mean(-1), backend=keep, dynamic=True)
    fn(torch.randn(5, 3))
    bodies = [described_tensor(n.meta["example_value"]) for n in graphs[0].graph.nodes
              if isinstance(n.meta.get("example_value"), torch.Tensor)]
    assert len(bodies) >= 4 and all(b.get("dynamic") for b in bodies), bodies
    assert bodies[0]["shape"] == [5, 3] and bodies[0]["stride"] == [3, 1]
    assert "dynamic" not in described_tensor(torch.randn(5, 3))  # a static tensor reads as it always did
