"""A module's tensors from a parent to its child (`engine/handoff.py`): the whole model (the numerics target child)
or one submodule with its call (the layers culprit child), from one memory-mapped safetensors file into a model
built on meta, the same outputs bit for bit; a file that does not fill the (sub)module exactly is not used."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from ci_runner.config import ModelSpec
from ci_runner.engine import handoff
from ci_runner.engine.handoff import PREFIX, handoff_path, load_handoff, save_handoff
from ci_runner.models.load import build_inputs, load_model
from ci_runner.models.tree import module_tensors
from ci_runner.matrix import expand
from ci_runner.modes.layers.search import capture_inputs

QWEN = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "tie_word_embeddings": True}


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    want, have = module_tensors(a), module_tensors(b)
    return want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)


def test_the_child_gets_the_whole_model_without_building_it(tmp_path: Path, example_matrix) -> None:
    cell = next(c for c in expand(example_matrix) if c.model.id == "tiny-llama")
    for spec in (cell.model, ModelSpec(id="tied", config="qwen2", overrides=QWEN)):
        loaded = load_model(spec, seed=3)
        with torch.no_grad():  # the parent's weights, not the seed's: the child must run exactly these
            loaded.module.get_submodule("model.norm").weight.add_(0.5)
        saved = save_handoff(loaded.module, tmp_path / f"{spec.id}.safetensors")
        assert saved["bytes"] > 0 and not list(tmp_path.glob(".*.tmp"))
        shell = load_model(spec, seed=3, dtype="float32", meta=True).module
        got = load_handoff(shell, Path(saved["file"]))
        assert got is not None and got.module is shell and (got.args, got.kwargs) == ((), {})
        assert not any(t.is_meta for t in got.module.parameters()) and _same(loaded.module, got.module)
        if spec.id == "tied":  # a tied parameter stays one object, stored once
            assert got.module.lm_head.weight is got.module.model.embed_tokens.weight
            assert saved["bytes"] < sum(t.numel() * 4 for t in module_tensors(loaded.module).values())
        rotary = got.module.model.rotary_emb
        assert not any(t.is_meta for t in vars(rotary).values() if isinstance(t, torch.Tensor))
        kwargs = build_inputs(loaded, cell.inputs, sample=0)
        with torch.no_grad():
            assert torch.equal(loaded.module(**kwargs).logits, got.module(**kwargs).logits)
    # another model's file, or none: not used (the child builds the model instead)
    shell = load_model(cell.model, seed=3, dtype="float32", meta=True).module
    assert load_handoff(shell, tmp_path / "tied.safetensors") is None
    assert load_handoff(shell, tmp_path / "missing.safetensors") is None


def test_a_submodule_comes_back_whole_with_its_call(tmp_path: Path, example_matrix) -> None:
    cell = next(c for c in expand(example_matrix) if c.model.id == "tiny-llama")
    loaded = load_model(cell.model, seed=0)
    kwargs = build_inputs(loaded, cell.inputs, sample=0)
    names = ["model.layers.1.self_attn", "model.layers.0.mlp"]
    calls = capture_inputs(loaded.module, (), kwargs, names)
    files = {n: save_handoff(loaded.module.get_submodule(n), tmp_path / f"{n}.safetensors", calls[n][0])["file"]
             for n in names}
    shell = load_model(cell.model, seed=0, meta=True).module  # built once for both
    for name in names:
        got = load_handoff(shell, Path(files[name]), name)
        assert got is not None and got.module is shell.get_submodule(name)
        ref = loaded.module.get_submodule(name)
        assert _same(ref, got.module) and not any(t.is_meta for t in got.module.parameters())
        with torch.no_grad():
            want, have = ref(*calls[name][0][0], **calls[name][0][1]), got.module(*got.args, **got.kwargs)
        want, have = (want[0], have[0]) if isinstance(want, tuple) else (want, have)
        assert torch.equal(want, have)
    assert any(t.is_meta for t in shell.get_submodule("model.layers.0.self_attn").parameters())  # not handed over
    # the file of another submodule (other names) does not fill this one
    assert load_handoff(shell, Path(files["model.layers.0.mlp"]), "model.layers.1.self_attn") is None


def test_the_culprit_child_takes_what_the_layers_cell_hands_over(tmp_path: Path, example_matrix,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers mode's wiring: the cell's `_handoff` writes the file a `CulpritTarget` names, and the child's
    `_handed_calls` builds the model on meta once and takes each target from it (one without a file is built)."""
    from ci_runner.config import spec_to_json
    from ci_runner.modes.layers.culprit import CulpritPlan, CulpritTarget, _handed_calls
    from ci_runner.modes.layers.mode import _handoff

    monkeypatch.setattr(handoff, "SHM", tmp_path / "no-shm")  # the target's folder, where the test can see it
    cell = next(c for c in expand(example_matrix) if c.model.id == "tiny-llama")
    loaded = load_model(cell.model, seed=0)
    name = "model.layers.1.mlp"
    captured = capture_inputs(loaded.module, (), build_inputs(loaded, cell.inputs, sample=0), [name])
    out_dir = tmp_path / "culprit"
    file = _handoff(loaded, name, captured, out_dir)
    assert file is not None and Path(file).parent == out_dir and Path(file).name.startswith(PREFIX)
    assert _handoff(loaded, "", captured, out_dir) is None  # the whole model: the child has it anyway
    plan = CulpritPlan(model=spec_to_json(cell.model), backend={}, seed=0, layers_dir=str(tmp_path), targets=[],
                       timeout_file="", limits={"first": 1.0, "window": 30.0, "factor": 4.0}, limits_file="",
                       deadline_wall=0.0, target_budget_s=1.0)
    got = _handed_calls(plan, [CulpritTarget(module=name, out_dir=str(out_dir), handoff=file),
                               CulpritTarget(module="model.layers.0.mlp", out_dir=str(out_dir))])
    assert list(got) == [name]
    sub, args, kwargs = got[name]
    with torch.no_grad():
        assert torch.equal(sub(*args, **kwargs), loaded.module.get_submodule(name)(*captured[name][0][0],
                                                                                   **captured[name][0][1]))


class _Odd(torch.nn.Module):
    """A parameter, a buffer that is a view of it (shares its memory) and, optionally, a plain tensor attribute
    nothing fills (left on meta in a meta build)."""

    def __init__(self, dtype: torch.dtype = torch.float32, loose: bool = False) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(8, dtype=dtype).reshape(2, 4))
        self.register_buffer("row", self.w.data[1], persistent=False)
        if loose:
            self.extra = torch.ones(3)


def test_the_validity_check_and_storage(tmp_path: Path) -> None:
    path = save_handoff(_Odd(), tmp_path / "odd.safetensors")["file"]  # shared memory: written apart
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]  # a safetensors file: a JSON header, then raw bytes; no pickle
    assert set(json.loads(raw[8:8 + n])) == {"__metadata__", "w:w", "w:row"}
    with torch.device("meta"):
        shell, wrong, loose = _Odd(), _Odd(torch.float16), _Odd(loose=True)
    got = load_handoff(shell, Path(path))
    assert got is not None and torch.equal(got.module.row, torch.arange(4.0, 8.0))
    assert load_handoff(wrong, Path(path)) is None  # another dtype
    assert load_handoff(loose, Path(path)) is None  # a tensor left on meta
    Path(path).write_bytes(raw[: len(raw) // 2])
    assert load_handoff(shell, Path(path)) is None  # a broken file


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
    stale = [shm / f"{PREFIX}{dead}-x.safetensors", shm / f".{PREFIX}{dead}-y.safetensors.tmp"]
    alive = shm / f"{PREFIX}{1}-w.safetensors"  # pid 1 exists
    for p in stale + [alive]:
        p.write_bytes(b"x")
    module = torch.nn.Linear(4, 4)
    path = handoff_path(module, tmp_path / "cell")
    assert path.parent == shm and path.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert not any(p.exists() for p in stale) and alive.exists()
    monkeypatch.setattr(handoff, "SHM", tmp_path / "no-shm")  # none: the cell's folder (created)
    cell_stale = tmp_path / "cell" / f"{PREFIX}{dead}-z.safetensors"
    cell_stale.parent.mkdir(exist_ok=True)
    cell_stale.write_bytes(b"x")
    assert handoff_path(module, tmp_path / "cell").parent == tmp_path / "cell" and not cell_stale.exists()
