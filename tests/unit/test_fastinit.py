"""Config models built fast (`models/fastinit.py`): big tensors skip the draw transformers overwrites; the weights
stay those of transformers' init, the same for the same seed; tiny configs are bit-identical to a plain build."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.config import ModelSpec, load_matrix
from ci_runner.models import fastinit
from ci_runner.models.load import load_model

EXAMPLE = load_matrix(None)
# embed_tokens and lm_head are 8192 x 128 = 1M elements: the deferred path; the rest is small
WIDE_VOCAB = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 8192, "tie_word_embeddings": False}


def _spec(model_type: str, overrides: dict[str, Any]) -> ModelSpec:
    return ModelSpec(id="m", config=model_type, overrides=MappingProxyType(overrides))


def _plain(spec: ModelSpec, seed: int) -> torch.nn.Module:
    """What `load_model` built before fast_init: from_config under the seed, nothing patched."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(spec.config, **dict(spec.overrides))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-mixtral"])
def test_tiny_example_models_are_bit_identical_to_a_plain_build(model_id: str) -> None:
    spec = next(m for m in EXAMPLE.models if m.id == model_id)
    fast = load_model(spec, seed=0).module.state_dict()
    plain = _plain(spec, 0).state_dict()
    assert fast.keys() == plain.keys()
    for key in plain:
        assert torch.equal(fast[key], plain[key]), key


def test_big_tensors_get_transformers_init_deterministically_and_no_nan() -> None:
    spec = _spec("llama", WIDE_VOCAB)
    a = load_model(spec, seed=3).module
    b = load_model(spec, seed=3).module
    c = load_model(spec, seed=4).module
    head = a.lm_head.weight
    assert head.numel() >= fastinit.BIG
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
        assert not torch.isnan(p).any(), name
    assert not torch.equal(head, c.lm_head.weight)
    # transformers' normal(0, initializer_range), not torch's kaiming uniform (std 1/sqrt(3*128) = 0.051)
    for w in (head, a.model.embed_tokens.weight):
        assert abs(float(w.detach().std()) - 0.02) < 0.001 and float(w.detach().abs().max()) > 0.05


def test_a_deferred_init_nothing_supersedes_still_runs_with_the_same_values() -> None:
    def build(fast: bool) -> torch.nn.Linear:
        torch.manual_seed(7)
        if not fast:
            return torch.nn.Linear(1024, 1024, bias=False)  # (a small bias would be drawn first: another order)
        with fastinit.fast_init() as finish:
            lin = torch.nn.Linear(1024, 1024, bias=False)
            assert torch.isnan(lin.weight.detach().view(-1)[0])  # deferred: not drawn yet
            finish(lin)
        return lin

    fast, plain = build(True), build(False)
    assert torch.equal(fast.weight, plain.weight)


def test_a_write_after_the_deferral_wins_and_orphans_are_skipped() -> None:
    calls: list[int] = []
    original = torch.nn.init.kaiming_uniform_
    with fastinit.fast_init() as finish:
        lin = torch.nn.Linear(1024, 1024)
        orphan = torch.nn.Linear(1024, 1024)
        lin.weight.data.fill_(0.5)  # a direct write supersedes the deferred kaiming_uniform_
        holder = torch.nn.Module()
        holder.lin = lin
        torch.nn.init.kaiming_uniform_ = lambda *a, **k: calls.append(1)  # type: ignore[assignment]
        try:
            finish(holder)
        finally:
            torch.nn.init.kaiming_uniform_ = original
    assert torch.all(lin.weight == 0.5)
    assert torch.isnan(orphan.weight.detach().view(-1)[0])  # never held by the model: never drawn


def test_a_copy_kept_past_the_build_no_longer_defers() -> None:
    with fastinit.fast_init():
        kept = torch.nn.init.normal_
    t = torch.zeros(1 << 20)
    kept(t)
    assert not torch.isnan(t).any() and float(t.std()) > 0.5


def test_torch_init_functions_are_restored_even_on_error() -> None:
    before = {name: getattr(torch.nn.init, name) for name in ("normal_", "uniform_", "kaiming_uniform_")}
    with pytest.raises(RuntimeError):
        with fastinit.fast_init():
            assert torch.nn.init.normal_ is not before["normal_"]
            raise RuntimeError("boom")
    assert {name: getattr(torch.nn.init, name) for name in before} == before
    import torch.nn.modules.linear as linear_mod

    assert linear_mod.init.kaiming_uniform_ is before["kaiming_uniform_"]


def test_parallel_normal_depends_on_the_seed_not_on_the_threads() -> None:
    def draw(threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.manual_seed(11)
            return fastinit.parallel_normal_(torch.empty(fastinit.CHUNK * 2 + 5), 0.0, 0.02)
        finally:
            torch.set_num_threads(before)

    one, two = draw(1), draw(2)
    assert torch.equal(one, two)
    assert abs(float(one.std()) - 0.02) < 0.0005 and abs(float(one.mean())) < 0.0005
    head, tail = one[: fastinit.CHUNK], one[fastinit.CHUNK: 2 * fastinit.CHUNK]
    assert not torch.equal(head, tail)  # every chunk its own stream


def test_once_a_big_tensor_was_deferred_small_ones_are_deferred_too() -> None:
    """A big model's sub-BIG projections skip the construction-time draw as well; before the first big tensor (and
    in a model without one) small ones are drawn at once, as in a plain build."""
    def build(seed: int) -> tuple[torch.nn.Module, list[bool]]:
        torch.manual_seed(seed)
        deferred = []
        with fastinit.fast_init() as finish:
            m = torch.nn.Module()
            m.first = torch.nn.Linear(32, 32)  # before any big tensor: drawn at once
            deferred.append(bool(torch.isnan(m.first.weight.detach().view(-1)[0])))
            m.big = torch.nn.Linear(1024, 1024, bias=False)
            m.after = torch.nn.Linear(32, 32)  # small, after a big one: deferred
            deferred.append(bool(torch.isnan(m.after.weight.detach().view(-1)[0])))
            finish(m)
        return m, deferred

    a, deferred = build(5)
    assert deferred == [False, True]
    b, _ = build(5)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert not torch.isnan(p).any(), name
        assert torch.equal(p, q), name
    torch.manual_seed(5)
    assert torch.equal(a.first.weight, torch.nn.Linear(32, 32).weight)  # the plain build's first draw
    bound = 1 / 32 ** 0.5  # the deferred kaiming_uniform_ still ran, with torch's own bounds
    assert float(a.after.weight.detach().abs().max()) <= bound and float(a.after.weight.detach().std()) > bound / 3
