"""The workload sims (issue 32) fail in their own regime of generation and match eager everywhere else.

Plain generation code on a tiny random Llama (2 layers, hidden 32, GQA): a prefill into a `StaticCache`, then
teacher-forced one-token decode steps with `cache_position`; a left-padded batch of lengths [8, 3] with the mask and
positions as `generate` builds them, `use_cache=False`.
"""

from __future__ import annotations

from collections.abc import Callable
import re

import pytest
import torch

from ci_runner.backends import unsupported_op_from_error
from ci_runner.sim import SimCompilerError, make_backend
from ci_runner.sim.workloads import math_attention

pytestmark = pytest.mark.usefixtures("fresh_dynamo")  # tests/conftest.py

ATTENTION = "aten._scaled_dot_product_flash_attention_for_cpu.default"
PROMPT = [5, 9, 2, 7, 11, 3, 8, 1]
DECODE = [4, 6]  # teacher-forced decode tokens


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


class Run:
    """One generation: the logits of each call (cloned when returned) and the cache it leaves."""

    def __init__(self, logits: list[torch.Tensor], cache: object) -> None:
        self.logits = logits
        self.cache = cache

    def keys(self, layer: int) -> torch.Tensor:
        return self.cache.layers[layer].keys  # type: ignore[attr-defined]


def generate(model: Callable[..., object], config: object, prompt_len: int = 8, steps: int = 2,
             calls: list[str] | None = None, logits: list[torch.Tensor] | None = None) -> Run:
    """Prefill `prompt_len` tokens into a StaticCache sized prompt + steps, then `steps` one-token decode steps;
    `calls` records each call that returned ('prefill', 'decode 0', ...), `logits` their last-token logits."""
    from transformers.cache_utils import StaticCache

    prompt = torch.tensor([(PROMPT * (prompt_len // len(PROMPT) + 1))[:prompt_len]])
    cache = StaticCache(config=config, max_cache_len=prompt_len + steps)
    logits = [] if logits is None else logits
    with torch.no_grad():
        out = model(input_ids=prompt, cache=cache, cache_position=torch.arange(prompt_len), use_cache=True)
        logits.append(out.logits[:, -1].clone())  # type: ignore[attr-defined]
        if calls is not None:
            calls.append("prefill")
        for step in range(steps):
            out = model(input_ids=torch.tensor([[DECODE[step % len(DECODE)]]]), cache=cache,
                        cache_position=torch.tensor([prompt_len + step]), use_cache=True)
            logits.append(out.logits[:, -1].clone())  # type: ignore[attr-defined]
            if calls is not None:
                calls.append(f"decode {step}")
    return Run(logits, cache)


def padded_batch(model: Callable[..., object], lengths: tuple[int, ...] = (8, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, attention mask) of a left-padded batch as `generate` pads it; use_cache=False."""
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.tensor(PROMPT[:n]) + row
        mask[row, width - n:] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False)
    return out.logits, mask  # type: ignore[attr-defined]


def _chain(exc: BaseException | None):
    while exc is not None:
        yield exc
        exc = getattr(exc, "inner_exception", None) or exc.__cause__


def _close(got: list[torch.Tensor], ref: list[torch.Tensor], atol: float = 1e-5) -> None:
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, atol=atol, rtol=1e-5)


# --------------------------------------------------------------------------------------------- sim-decode

@pytest.mark.parametrize("dynamic", [None, False])
def test_decode_passes_prefill_and_fails_the_first_decode_step(llama, dynamic: bool | None) -> None:
    ref = generate(llama, llama.config, steps=0)
    calls: list[str] = []
    logits: list[torch.Tensor] = []
    compiled = torch.compile(llama, backend=make_backend("sim-decode"), dynamic=dynamic)
    with pytest.raises(Exception) as info:
        generate(compiled, llama.config, steps=2, calls=calls, logits=logits)
    assert calls == ["prefill"]  # the prefill returned; the first decode step raised
    _close(logits, ref.logits)  # and the prefill is eager's
    err = info.value
    assert any(isinstance(e, SimCompilerError) for e in _chain(err))  # at compile time, inside Dynamo
    assert "[sim-decode] unsupported operator" in str(err) and "query sequence length 1 is not supported" in str(err)
    assert unsupported_op_from_error(str(err)) == ATTENTION


def test_decode_judges_the_query_length_only(fresh_dynamo: Callable[[], None]) -> None:
    def attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, kv, kv)

    kv = torch.randn(1, 2, 8, 4)
    # a 2-token query against 8 keys passes and is right; a dynamic-shape graph serving 3, 4, ... never fires
    for length in (2, 3, 4):
        q = torch.randn(1, 2, length, 4)
        got = torch.compile(attend, backend=make_backend("sim-decode"), dynamic=True)(q, kv)
        torch.testing.assert_close(got, attend(q, kv))
    fresh_dynamo()
    with pytest.raises(Exception, match=r"query sequence length 1 is not supported"):
        torch.compile(attend, backend=make_backend("sim-decode"), dynamic=True)(torch.randn(1, 2, 1, 4), kv)
    fresh_dynamo()
    with pytest.raises(Exception, match=r"query sequence length 3 is not supported.*at least 5 query tokens"):
        torch.compile(attend, backend=make_backend("sim-decode", {"max_query_len": 4}))(torch.randn(1, 2, 3, 4), kv)


# --------------------------------------------------------------------------------------------- sim-kvdrift

def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def test_kvdrift_keeps_the_prefill_exact_and_drifts_the_decode_steps(llama) -> None:
    ref = generate(llama, llama.config)
    got = generate(torch.compile(llama, backend=make_backend("sim-kvdrift")), llama.config)
    assert torch.equal(got.logits[0], ref.logits[0])  # the first token is right
    for step in (1, 2):  # later ones drift, by a bfloat16 rounding of the cache
        assert 1e-6 < float((got.logits[step] - ref.logits[step]).abs().max()) < 1e-2
    # the cache: the prompt's positions exactly eager's; the first decode write of layer 0 (its keys depend on the
    # token alone) is eager's value rounded to bfloat16, exactly; layer 1 reads the rounded cache and drifts
    assert torch.equal(got.keys(0)[:, :, :8], ref.keys(0)[:, :, :8])
    assert torch.equal(got.keys(1)[:, :, :8], ref.keys(1)[:, :, :8])
    assert torch.equal(got.keys(0)[:, :, 8], _bf16(ref.keys(0)[:, :, 8]))
    assert not torch.equal(got.keys(0)[:, :, 8], ref.keys(0)[:, :, 8])
    assert not torch.equal(got.keys(1)[:, :, 9], _bf16(ref.keys(1)[:, :, 9]))


def test_kvdrift_all_writes(llama) -> None:
    ref = generate(llama, llama.config, steps=1)
    got = generate(torch.compile(llama, backend=make_backend("sim-kvdrift", {"writes": "all"})), llama.config, steps=1)
    assert torch.equal(got.keys(0)[:, :, :8], _bf16(ref.keys(0)[:, :, :8]))  # the prefill's writes too
    assert not torch.equal(got.logits[0], ref.logits[0])
    with pytest.raises(ValueError, match="writes 'some' is not one of decode, all"):
        make_backend("sim-kvdrift", {"writes": "some"})


@pytest.mark.parametrize("write", ["index_copy_", "index_put_", "slice"])
def test_kvdrift_rounds_one_position_writes_into_a_graph_input(write: str, fresh_dynamo) -> None:
    def step(cache: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if write == "index_copy_":
            cache.index_copy_(1, pos, new)
        elif write == "index_put_":
            cache[:, pos] = new
        else:
            cache[:, 2:2 + new.shape[1]] = new
        return cache.sum(1) * 1.0

    torch.manual_seed(0)
    for positions, rounded in ((1, True), (3, False)):
        fresh_dynamo()
        cache, new, pos = torch.zeros(2, 6, 4), torch.randn(2, positions, 4), torch.arange(2, 2 + positions)
        ref_cache = cache.clone()
        step(ref_cache, new, pos)
        torch.compile(step, backend=make_backend("sim-kvdrift", {"dtype": "float16"}))(cache, new, pos)
        expect = ref_cache.half().float() if rounded else ref_cache  # only the one-position write is rounded
        assert torch.equal(cache, expect) and torch.equal(cache, ref_cache) is not rounded


# --------------------------------------------------------------------------------------------- sim-masknan

def test_masknan_is_clean_unpadded_and_nan_in_the_padded_rows_real_tokens(llama, fresh_dynamo) -> None:
    ref, _ = padded_batch(llama, (8, 8))
    got, _ = padded_batch(torch.compile(llama, backend=make_backend("sim-masknan")), (8, 8))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    fresh_dynamo()
    ref, mask = padded_batch(llama, (8, 3))
    got, _ = padded_batch(torch.compile(llama, backend=make_backend("sim-masknan")), (8, 3))
    assert not ref.isnan().any()  # eager's safe softmax: 0 for the pads' fully-masked rows
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)  # the unpadded prompt
    real = mask[1].bool()
    assert got[1][real].isnan().all()  # the shorter prompt's real tokens: the pads' NaN spread through layer 2


def test_masknan_is_clean_on_prefill_and_decode(llama) -> None:
    ref = generate(llama, llama.config)
    _close(generate(torch.compile(llama, backend=make_backend("sim-masknan")), llama.config).logits, ref.logits)


@pytest.mark.parametrize("kind", ["bool", "float", "causal"])
def test_math_attention_matches_sdpa_except_fully_masked_rows(kind: str) -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)  # GQA: 4 query heads, 2 kv
    keep = torch.rand(2, 1, 5, 6) > 0.4
    keep[0, 0, 2] = False  # one fully-masked row
    mask = None if kind == "causal" else keep if kind == "bool" else torch.zeros(keep.shape).masked_fill(~keep, -torch.inf)
    causal = kind == "causal"
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=0.3,
                                                           enable_gqa=True)
    got = math_attention(q, k, v, mask, is_causal=causal, scale=0.3)
    if causal:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        return
    dead = ~keep.any(-1, keepdim=True).expand(2, 4, 5, 1)  # rows that see no key
    assert got.isnan().all(-1)[dead[..., 0]].all() and not got.isnan()[~dead.expand_as(got)].any()
    assert (ref[dead.expand_as(ref)] == 0).all()  # eager: 0
    torch.testing.assert_close(got.masked_fill(dead, 0), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------- sim-long

def test_long_passes_16_tokens_and_fails_80(llama, fresh_dynamo: Callable[[], None]) -> None:
    ref = generate(llama, llama.config, prompt_len=16, steps=1)
    _close(generate(torch.compile(llama, backend=make_backend("sim-long")), llama.config, prompt_len=16,
                    steps=1).logits, ref.logits)
    fresh_dynamo()
    with pytest.raises(Exception) as info:
        generate(torch.compile(llama, backend=make_backend("sim-long")), llama.config, prompt_len=80, steps=0)
    assert any(isinstance(e, SimCompilerError) for e in _chain(info.value))
    assert "key/value sequence length 80 exceeds the maximum of 64 tokens" in str(info.value)
    assert unsupported_op_from_error(str(info.value)) == ATTENTION


def test_long_checks_a_dynamic_graph_at_run_time(fresh_dynamo: Callable[[], None]) -> None:
    def attend(q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    compiled = torch.compile(attend, backend=make_backend("sim-long", {"max_tokens": 8}), dynamic=True)
    for length in (4, 8):
        q = torch.randn(1, 2, length, 4)
        torch.testing.assert_close(compiled(q), attend(q))
    with pytest.raises(SimCompilerError, match=r"length 9 exceeds the maximum of 8 tokens.*checked at run time"):
        compiled(torch.randn(1, 2, 9, 4))
    # a graph without attention: its token inputs (ids) are judged
    fresh_dynamo()
    table = torch.randn(32, 4)

    def embed(ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, table).sum(-1)

    ids = torch.randint(0, 32, (1, 8))
    torch.testing.assert_close(torch.compile(embed, backend=make_backend("sim-long", {"max_tokens": 8}))(ids), embed(ids))
    fresh_dynamo()
    with pytest.raises(Exception) as info:
        torch.compile(embed, backend=make_backend("sim-long", {"max_tokens": 8}))(torch.randint(0, 32, (1, 9)))
    assert re.search(r"\[sim-long\] input \w+: sequence length 9 exceeds the maximum of 8 tokens", str(info.value))
    assert unsupported_op_from_error(str(info.value)) is None  # no op to blame
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        make_backend("sim-long", {"max_tokens": 0})


# --------------------------------------------------------------------------------------------- sim-reuse

def test_reuse_overwrites_an_earlier_output_with_the_next_call(llama) -> None:
    compiled = torch.compile(llama, backend=make_backend("sim-reuse"))
    ids = torch.tensor([PROMPT[:6]])
    with torch.no_grad():
        first = compiled(input_ids=ids, use_cache=False).logits
        right = llama(input_ids=ids, use_cache=False).logits
        assert torch.equal(first, right)  # right when returned
        second = compiled(input_ids=ids + 1, use_cache=False).logits  # same shapes: same graph, same buffers
        assert torch.equal(second, llama(input_ids=ids + 1, use_cache=False).logits)
        assert torch.equal(first, second) and not torch.equal(first, right)  # call 1's output now holds call 2's


def test_reuse_in_generation_overwrites_decode_steps_not_the_prefill(llama) -> None:
    from transformers.cache_utils import StaticCache

    compiled = torch.compile(llama, backend=make_backend("sim-reuse"))
    cache = StaticCache(config=llama.config, max_cache_len=10)
    with torch.no_grad():
        kept = [compiled(input_ids=torch.tensor([PROMPT]), cache=cache, cache_position=torch.arange(8)).logits]
        for step, token in enumerate(DECODE):
            kept.append(compiled(input_ids=torch.tensor([[token]]), cache=cache,
                                 cache_position=torch.tensor([8 + step])).logits)
    ref = generate(llama, llama.config)
    # compiled vs eager decode steps agree to float noise, not bit for bit on every CPU (3e-8 measured on one)
    torch.testing.assert_close(kept[0][:, -1], ref.logits[0], rtol=0, atol=1e-6)  # the prefill's graph ran once
    torch.testing.assert_close(kept[2][:, -1], ref.logits[2], rtol=0, atol=1e-6)  # the last decode step is right
    assert torch.equal(kept[1], kept[2])  # step 0's output buffer now holds step 1's
    assert not torch.allclose(kept[1][:, -1], ref.logits[1], rtol=0, atol=1e-3)  # so step 0's was overwritten


def test_reuse_keeps_a_buffer_per_shape_and_takes_outputs(fresh_dynamo: Callable[[], None]) -> None:
    def two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x + 1

    compiled = torch.compile(two, backend=make_backend("sim-reuse"), dynamic=False)
    a = compiled(torch.ones(3))
    b = compiled(torch.ones(4))  # another shape: another graph, other buffers
    assert torch.equal(a[0], torch.full((3,), 2.0)) and b[0].shape == (4,)
    compiled(torch.zeros(3))
    assert torch.equal(a[0], torch.zeros(3)) and torch.equal(a[1], torch.ones(3))  # both outputs reused
    fresh_dynamo()
    compiled = torch.compile(two, backend=make_backend("sim-reuse", {"outputs": [1]}))
    a = compiled(torch.ones(3))
    compiled(torch.zeros(3))
    assert torch.equal(a[0], torch.full((3,), 2.0)) and torch.equal(a[1], torch.ones(3))  # only output 1 reuses
    with pytest.raises(ValueError, match="outputs must be 'all' or a list of output indices"):
        make_backend("sim-reuse", {"outputs": "first"})


# --------------------------------------------------------------------------------------------- each in its regime

@pytest.mark.parametrize(("name", "options"), [("sim-decode", {}), ("sim-kvdrift", {"writes": "all"}), ("sim-long", {}),
                                               ("sim-reuse", {})])
def test_the_others_are_clean_on_a_padded_batch(llama, name: str, options: dict[str, object]) -> None:
    ref, _ = padded_batch(llama)  # use_cache=False: kvdrift has no cache write to round, even with `writes: all`
    got, _ = padded_batch(torch.compile(llama, backend=make_backend(name, options)))
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
