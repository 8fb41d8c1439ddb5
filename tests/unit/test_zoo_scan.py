"""The zoo scan's scheduling rules: which trace errors are worth a bigger config, the shared queue's claims and
its longest-first order (the children themselves run in tests/integration/test_zoo_run.py)."""

from __future__ import annotations

from pathlib import Path

from ci_runner.zoo.scan import claim, cost_hint, worth_retrying

# shapes of real messages from a 299-architecture scan (InventoryError: primary tracer; torch.export fallback)
JETMOE = ("InventoryError: the model could not be traced for its op inventory (level aten): dynamo+aot_autograd "
          "capture failed at transformers/models/jetmoe/modeling_jetmoe.py:195 in forward: "
          "DataDependentOutputException: aten._local_scalar_dense.default; torch.export failed at "
          "transformers/models/jetmoe/modeling_jetmoe.py:195 in forward: GuardOnDataDependentSymNode: "
          "Could not guard on data-dependent expression Eq(u0, 1) (unhinted: Eq(u0, 1)); size")
CLVP = ("InventoryError: the model could not be traced for its op inventory (level aten): dynamo+aot_autograd "
        "capture failed at torch/_dynamo/exc.py:723 in unimplemented: TorchRuntimeError: RuntimeError when making "
        "fake tensor call; torch.export failed at transformers/models/clvp/modeling_clvp.py:102 in "
        "apply_rotary_pos_emb: RuntimeError: The size of tensor a (8) must match the size of tensor b (16)")
ALTCLIP = ("InventoryError: the model could not be traced for its op inventory (level aten): dynamo+aot_autograd "
           "capture failed at transformers/models/altclip/modeling_altclip.py:604 in forward: AttributeError: "
           "'NoneType' object has no attribute 'shape'; torch.export failed at modeling_altclip.py:604: same")


def test_only_size_errors_are_retried_bigger() -> None:
    assert worth_retrying("build", "ValueError: in_channels must be divisible by groups")
    assert worth_retrying("trace", CLVP)  # a shrunk size that no longer matches: a bigger config traces (zamba2)
    assert not worth_retrying("trace", JETMOE)  # data-dependent: the same at any size, 81 CPU s for nothing
    assert not worth_retrying("trace", ALTCLIP)  # "shape" in a code error is not a size error
    assert not worth_retrying("inputs", "ValueError: You have to specify pixel_values")


def test_a_claim_is_taken_once(tmp_path: Path) -> None:
    assert claim(tmp_path, "llama") and not claim(tmp_path, "llama") and claim(tmp_path, "bert")


def test_the_queue_puts_slow_families_first() -> None:
    hints = {t: cost_hint(i) for t, i in {"bert": {"family": "encoder"}, "jamba": {"family": "SSM/hybrid"},
                                          "llava": {"family": "multimodal", "task": "image-text"},
                                          "unknown": {}}.items()}
    assert sorted(hints, key=lambda t: -hints[t]) == ["llava", "jamba", "unknown", "bert"]


def test_an_input_of_the_wrong_rank_is_not_retried() -> None:
    idefics2 = ("InventoryError: ... capture failed at transformers/models/idefics2/modeling_idefics2.py:804 in "
                "get_image_features: ValueError: not enough values to unpack (expected 5, got 4)")
    assert not worth_retrying("trace", idefics2)


def test_the_catalog_does_not_print_the_default_configs_warnings(capsys) -> None:  # type: ignore[no-untyped-def]
    """arcee's default config warns that its token ids lie outside its vocabulary: the catalog builds every
    default config, and the CLI printed 23 such lines before its first own line. The caller's level comes back."""
    from transformers.utils import logging as hf_logging

    from ci_runner.zoo.catalog import catalog

    before = hf_logging.get_verbosity()
    assert catalog(["arcee"])[0].class_name
    err = capsys.readouterr().err
    assert "token_id" not in err, err
    assert hf_logging.get_verbosity() == before
