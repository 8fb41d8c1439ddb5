"""The numerics target child's model from its parent (`numerics/handoff.py`): every tensor from one memory-mapped
file, the model built on meta only, the same outputs bit for bit; a file that does not fit is not used."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ci_runner.config import ModelSpec
from ci_runner.engine.models import build_inputs, load_model
from ci_runner.matrix import expand
from ci_runner.numerics import handoff
from ci_runner.engine.tree import module_tensors
from ci_runner.numerics.handoff import PREFIX, handoff_path, load_weights, save_weights

QWEN = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "tie_word_embeddings": True}


def test_the_child_gets_the_parents_tensors_without_building_the_model(tmp_path: Path, example_matrix) -> None:
    cell = next(c for c in expand(example_matrix) if c.model.id == "tiny-llama")
    spec = ModelSpec(id="tied", config="qwen2", overrides=QWEN)
    for spec in (cell.model, spec):
        loaded = load_model(spec, seed=3)
        with torch.no_grad():  # the parent's weights, not the seed's: the child must run exactly these
            loaded.module.get_submodule("model.norm").weight.add_(0.5)
        saved = save_weights(loaded.module, tmp_path / f"{spec.id}.pt")
        assert saved["bytes"] > 0 and not list(tmp_path.glob(".*.tmp"))
        got = load_weights(spec, seed=3, dtype="float32", file=Path(saved["file"]))
        assert got is not None and not got.meta and not any(t.is_meta for t in got.module.parameters())
        want, have = module_tensors(loaded.module), module_tensors(got.module)
        assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
        if spec.id == "tied":  # a tied parameter stays one object
            assert got.module.lm_head.weight is got.module.model.embed_tokens.weight
        rotary = got.module.model.rotary_emb
        assert not any(t.is_meta for t in vars(rotary).values() if isinstance(t, torch.Tensor))
        kwargs = build_inputs(loaded, cell.inputs, sample=0)
        with torch.no_grad():
            assert torch.equal(loaded.module(**kwargs).logits, got.module(**kwargs).logits)
    # another model's file does not fit: not used (the child builds the model instead)
    assert load_weights(cell.model, seed=3, dtype="float32", file=tmp_path / "tied.pt") is None
    assert load_weights(cell.model, seed=3, dtype="float32", file=tmp_path / "missing.pt") is None


def _dead_pid() -> int:
    """A pid no process has now (counting down from the kernel's pid_max), found without starting one."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path("/proc/sys/kernel/pid_max").exists() else 32768
    for pid in range(top - 1, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    raise AssertionError("no free pid")


def test_the_file_goes_to_shared_memory_and_stale_files_of_dead_parents_are_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(handoff, "SHM", shm)
    dead = _dead_pid()
    stale = [shm / f"{PREFIX}{dead}-x.pt", shm / f".{PREFIX}{dead}-y.pt.z.tmp"]
    alive = shm / f"{PREFIX}{1}-w.pt"  # pid 1 exists
    for p in stale + [alive]:
        p.write_bytes(b"x")
    module = torch.nn.Linear(4, 4)
    path = handoff_path(module, tmp_path / "cell")
    assert path.parent == shm and path.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert not any(p.exists() for p in stale) and alive.exists()
    monkeypatch.setattr(handoff, "SHM", tmp_path / "no-shm")  # none: the cell's folder
    (tmp_path / "cell").mkdir()
    assert handoff_path(module, tmp_path / "cell").parent == tmp_path / "cell"
