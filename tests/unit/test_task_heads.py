"""Issue 45: every head a model has can be asked for with `task:`, from one table (`zoo.catalog.TASK_HEADS`):
the matrix schema, `models.load.TASKS`, the auto class built and the task read from a checkpoint's
`architectures` all come from it. A tiny wav2vec2 with `task: ctc` is built with its CTC head and fed audio."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from ci_runner.config import InputSpec, ModelSpec, load_matrix
from ci_runner.models.load import TASKS, build_inputs, detect_task, load_model
from ci_runner.errors import ModelLoadError
from ci_runner.zoo.catalog import HEADS, LABELS, TASK_HEADS

W2V = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
       "conv_dim": [16, 16], "conv_kernel": [10, 3], "conv_stride": [5, 2], "num_conv_pos_embeddings": 16,
       "num_conv_pos_embedding_groups": 2, "vocab_size": 32}
BERT = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 128,
        "vocab_size": 64}
SPEC = InputSpec(batch=1, seq_len=8, samples=1, seed=0)


def test_one_table_names_every_task_its_auto_class_and_mapping() -> None:
    assert TASKS == tuple(TASK_HEADS)
    assert {t for t, _ in HEADS + LABELS} <= set(TASK_HEADS)
    for task, (auto, mapping) in TASK_HEADS.items():
        assert isinstance(getattr(transformers, auto, None), type), (task, auto)
        assert getattr(modeling_auto, mapping), (task, mapping)
    schema = json.loads(resources.files("ci_runner").joinpath("schemas/matrix.schema.json").read_text())
    text = json.dumps(schema)
    assert '"enum": ' + json.dumps(["auto", *TASKS]) in text  # the matrix accepts exactly these


def test_a_matrix_asks_for_the_ctc_head(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text("version: 1\nmodels:\n  - {id: w, config: wav2vec2, task: ctc}\n"
                    "backends:\n  - {id: b, compile: aot_eager}\n")
    assert load_matrix(path).models[0].task == "ctc"


def test_wav2vec2_with_task_ctc_is_its_ctc_head_fed_audio() -> None:
    loaded = load_model(ModelSpec(id="w", config="wav2vec2", task="ctc", overrides=MappingProxyType(W2V)), seed=0)
    assert loaded.task == "ctc" and type(loaded.module).__name__ == "Wav2Vec2ForCTC"
    kwargs = build_inputs(loaded, SPEC)
    assert set(k for k, v in kwargs.items() if isinstance(v, torch.Tensor)) == {"input_values"}
    with torch.no_grad():
        logits = loaded.module(**kwargs).logits
    assert logits.shape[0] == 1 and logits.shape[-1] == W2V["vocab_size"] and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("config, overrides, task, cls", [
    ("wav2vec2", W2V, "audio-classification", "Wav2Vec2ForSequenceClassification"),
    ("bert", BERT, "sequence-classification", "BertForSequenceClassification"),
    ("bert", BERT, "question-answering", "BertForQuestionAnswering"),
])
def test_other_heads_of_the_table_build_and_run(config: str, overrides: dict, task: str, cls: str) -> None:
    loaded = load_model(ModelSpec(id="m", config=config, task=task, overrides=MappingProxyType(overrides)), seed=0)
    assert type(loaded.module).__name__ == cls
    with torch.no_grad():
        loaded.module(**build_inputs(loaded, SPEC))


def test_a_checkpoints_architecture_names_its_head() -> None:
    ctc = transformers.Wav2Vec2Config(architectures=["Wav2Vec2ForCTC"])
    assert detect_task(ctc) == "ctc"
    assert detect_task(transformers.BertConfig(architectures=["BertForTokenClassification"])) == "token-classification"
    assert detect_task(transformers.BertConfig(architectures=["BertForMaskedLM"])) == "masked-lm"  # as before
    assert detect_task(transformers.BertConfig(architectures=["BertModel"])) == "base"


def test_a_head_the_architecture_lacks_is_refused_with_the_fix() -> None:
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelSpec(id="l", config="llama", task="ctc"), seed=0, meta=True)
    assert "has no ctc model class" in str(err.value) and "task:" in (err.value.hint or "")
