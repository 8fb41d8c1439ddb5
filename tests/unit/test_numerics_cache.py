"""The thresholds cache: one key per model for the file name, the reuse check and the CI cache
(`modes/numerics/cache.py`, `deepview-ci thresholds-key`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from ci_runner import cli
from ci_runner.config import load_matrix_text
from ci_runner.matrix import expand
from ci_runner.modes.numerics.cache import CACHE_PREFIX, cache_for, cell_thresholds
from ci_runner.modes.numerics.thresholds import LayerStats, load_or_derive
from ci_runner.options import ThresholdOptions
from tests.fixtures.matrices import REFERENCES, TINY_DECODER, matrix_text


def _cells(*, overrides: dict[str, Any] | None = None, inputs: dict[str, Any] | None = None,
           references: Any = REFERENCES, options: dict[str, Any] | None = None,
           modes: tuple[str, ...] = ("numerics",)) -> list[Any]:
    text = matrix_text(modes=list(modes), inputs=inputs or {"seq_len": 8, "samples": 2, "seed": 0},
                       references=references, options=options,
                       models=[{"id": "tiny", "config": "llama", "overrides": {**TINY_DECODER, **(overrides or {})}}],
                       backends=[{"id": "aot_eager", "compile": "aot_eager"}, {"id": "inductor", "compile": "inductor"}])
    return expand(load_matrix_text(text))


def test_two_backends_of_a_model_share_one_file_and_one_cache_key(tmp_path: Path) -> None:
    a, b = _cells()
    assert cell_thresholds(a, tmp_path) == cell_thresholds(b, tmp_path)
    cache = cache_for([a, b], tmp_path)
    assert cache.files == (cell_thresholds(a, tmp_path).path,) and cache.folders == (tmp_path / "thresholds",)
    assert cache.key == f"{CACHE_PREFIX}-{cache.files[0].stem}"
    assert cache_for(_cells(), tmp_path) == cache  # the same matrix again: the same key
    assert cache_for(_cells(modes=("ops",)), tmp_path).key == ""  # no numerics, no cache


@pytest.mark.parametrize("change", [
    {"overrides": {"num_hidden_layers": 3}},
    {"inputs": {"seq_len": 9, "samples": 2, "seed": 0}},
    {"inputs": {"seq_len": 8, "samples": 2, "seed": 1}},
    {"references": [REFERENCES[0], {"id": "cpu-bf16", "device": "cpu", "dtype": "bfloat16"}]},
    {"options": {"numerics": {"samples": 5}}},
])
def test_a_changed_model_input_or_reference_is_another_key(tmp_path: Path, change: dict[str, Any]) -> None:
    before = cache_for(_cells(), tmp_path)
    after = cache_for(_cells(**change), tmp_path)
    assert after.key and after.key != before.key and after.files != before.files


def test_another_torch_or_method_is_another_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from ci_runner.modes.numerics import thresholds

    cell = _cells()[0]
    before = cell_thresholds(cell, tmp_path)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cell_thresholds(cell, tmp_path).path != before.path
    monkeypatch.undo()
    monkeypatch.setattr(thresholds, "METHOD_VERSION", thresholds.METHOD_VERSION + 1)
    assert cell_thresholds(cell, tmp_path).path != before.path


def test_thresholds_dir_option_moves_the_folder_not_the_key(tmp_path: Path) -> None:
    cell = _cells()[0]
    moved = dataclasses.replace(cell, options={"numerics": {"thresholds_dir": str(tmp_path / "shared")}})
    assert cell_thresholds(moved, tmp_path / "run").path == tmp_path / "shared" / cell_thresholds(cell, tmp_path).path.name


def test_unchanged_model_reuses_and_changed_model_derives_again(tmp_path: Path) -> None:
    derived: list[str] = []

    def derive_for(cell: Any) -> tuple[Any, str]:
        where = cell_thresholds(cell, tmp_path)

        def derive() -> dict[str, LayerStats]:
            derived.append(cell.model.id)
            return {"m": LayerStats(module_class="Linear", name="m", views={"cumulative": {"rel": [1e-7]}})}

        return load_or_derive(where.path, where.key, ThresholdOptions(), "float32", derive)

    a, b = _cells()
    assert derive_for(a)[0].reused is False and derive_for(b)[0].reused is True  # two backends, one derivation
    assert derive_for(_cells()[0])[0].reused is True  # a later run: reused
    changed = _cells(overrides={"intermediate_size": 96})[0]
    table, note = derive_for(changed)
    assert table.reused is False and note.startswith("derived") and len(derived) == 2


def test_cli_prints_the_key_and_writes_the_step_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text(matrix_text(modes=["numerics"], inputs={"seq_len": 8, "samples": 2, "seed": 0},
                                  models=[{"id": "tiny", "config": "llama", "overrides": dict(TINY_DECODER)}],
                                  backends=[{"id": "aot_eager", "compile": "aot_eager"}]))
    gh_out = tmp_path / "gh-output"
    gh_out.touch()
    monkeypatch.setenv("GITHUB_OUTPUT", str(gh_out))
    assert cli.main(["thresholds-key", str(matrix), "--cell", "tiny@aot_eager", "--out", "deepview-run"]) == 0
    cell = expand(load_matrix_text(matrix.read_text()))[0]
    expected = cache_for([cell], Path("deepview-run"))
    assert expected.key in capsys.readouterr().out
    text = gh_out.read_text()
    assert f"thresholds-key<<" in text and expected.key in text and "deepview-run/thresholds" in text
