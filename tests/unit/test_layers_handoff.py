"""The culprit child's handoff: a failing submodule and its call from a file, the model built on meta only."""

from __future__ import annotations

from pathlib import Path

import torch

from ci_runner.config import spec_to_json
from ci_runner.engine.models import build_inputs, load_model
from ci_runner.matrix import expand
from ci_runner.modes.layers.handoff import load_targets, save_target
from ci_runner.modes.layers.search import capture_inputs


def test_a_submodule_comes_back_whole_without_building_the_model(tmp_path: Path, example_matrix) -> None:
    cell = next(c for c in expand(example_matrix) if c.model.id == "tiny-llama")
    loaded = load_model(cell.model, seed=0)
    kwargs = build_inputs(loaded, cell.inputs, sample=0)
    names = ["model.layers.1.self_attn", "model.layers.0.mlp"]
    calls = capture_inputs(loaded.module, (), kwargs, names)
    for name in names:
        save_target(tmp_path / name, loaded.module.get_submodule(name), *calls[name][0])
    got = load_targets(spec_to_json(cell.model), 0, [(n, tmp_path / n) for n in names] + [("lm_head", tmp_path / "none")])
    assert sorted(got) == sorted(names)  # a target without a handoff is left to the child's own build
    for name in names:
        sub, args, kw = got[name]
        ref = loaded.module.get_submodule(name)
        assert {k: v for k, v in sub.state_dict().items()}.keys() == ref.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(sub.state_dict().values(), ref.state_dict().values()))
        assert not any(t.is_meta for t in sub.parameters())
        with torch.no_grad():
            want, have = ref(*calls[name][0][0], **calls[name][0][1]), sub(*args, **kw)
        want, have = (want[0], have[0]) if isinstance(want, tuple) else (want, have)
        assert torch.equal(want, have)
