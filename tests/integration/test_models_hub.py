"""`hub:` sources resolve offline from a local Hugging Face cache that the test builds (no network here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ci_runner.config import InputSpec, ModelSpec
from ci_runner.errors import ModelLoadError
from ci_runner.models.load import build_inputs, load_model, model_fingerprint
from tests.fixtures.paths import ROOT

SHA = "0123456789abcdef0123456789abcdef01234567"
OLD_SHA = "fedcba9876543210fedcba9876543210fedcba98"
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 64}


def _snapshot(repo_dir: Path, sha: str, hidden_act: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", hidden_act=hidden_act, **TINY))
    model.save_pretrained(repo_dir / "snapshots" / sha)
    return model


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """HF_HOME with hub/models--acme--tiny-llama: `main` → SHA, plus an older commit (different activation)."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / "models--acme--tiny-llama"
    model = _snapshot(repo, SHA, "silu")
    _snapshot(repo, OLD_SHA, "gelu")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SHA)
    (repo / "refs" / "v1").write_text(OLD_SHA)
    return home, model


@pytest.fixture
def offline(hf_home, monkeypatch: pytest.MonkeyPatch) -> Path:
    home, _ = hf_home
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_hub_id_resolves_offline_from_the_local_cache(offline: Path, hf_home) -> None:
    _, original = hf_home
    loaded = load_model(ModelSpec(id="hub-llama", hub="acme/tiny-llama"))
    assert loaded.revision == SHA
    assert loaded.task == "causal-lm" and loaded.source_dir and loaded.source_dir.endswith(SHA)
    for a, b in zip(original.parameters(), loaded.module.parameters()):
        assert torch.equal(a, b)
    kw = build_inputs(loaded, InputSpec(seq_len=8))
    with torch.no_grad():
        assert loaded.module(**kw).logits.shape == (1, 8, 64)
    fp = model_fingerprint(ModelSpec(id="hub-llama", hub="acme/tiny-llama"))
    assert fp["source"] == "hub" and fp["commit"] == SHA and fp["revision"] == "main"


@pytest.mark.parametrize("revision", ["v1", OLD_SHA])
def test_revision_selects_the_snapshot(offline: Path, revision: str) -> None:
    loaded = load_model(ModelSpec(id="hub-llama", hub="acme/tiny-llama", revision=revision))
    assert loaded.revision == OLD_SHA
    assert loaded.config.hidden_act == "gelu"


def test_hub_id_not_in_cache_offline_is_one_clear_error(offline: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(id="missing", hub="acme/not-cached"))
    err = info.value
    assert "'missing'" in err.message and "not in the local Hugging Face cache" in err.message
    assert str(offline / "hub") in err.message
    assert "HF_HUB_OFFLINE" in (err.hint or "")


def test_unknown_revision_offline(offline: Path) -> None:
    with pytest.raises(ModelLoadError, match="acme/tiny-llama"):
        load_model(ModelSpec(id="r", hub="acme/tiny-llama", revision="does-not-exist"))


def test_fresh_process_honours_hf_env(hf_home, tmp_path: Path) -> None:
    """In a new process (as a cell runs), HF_HOME + HF_HUB_OFFLINE set before import are honoured end to end."""
    home, _ = hf_home
    script = (
        "import json; from ci_runner.config import ModelSpec; from ci_runner.models.load import load_model\n"
        "m = load_model(ModelSpec(id='h', hub='acme/tiny-llama'))\n"
        "print(json.dumps({'revision': m.revision, 'cls': type(m.module).__name__}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"revision": SHA, "cls": "LlamaForCausalLM"}
