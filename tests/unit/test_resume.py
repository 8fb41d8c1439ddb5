"""The key of a cell's resolved configuration (what a rerun into the same `--out` may reuse) and the run lock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ci_runner.config import load_matrix_text
from ci_runner.errors import EXIT_BUSY, RunBusyError
from ci_runner.matrix import expand
from ci_runner.results.model import CellResult
from ci_runner.run.resume import LOCK_NAME, cell_config, rerun_reason, run_lock
from tests.fixtures.matrices import TINY_DECODER, matrix_text


def _cells(**edit: object) -> dict:
    models = [{"id": "a", "config": "llama", "overrides": dict(TINY_DECODER)},
              {"id": "b", "config": "llama", "overrides": dict(TINY_DECODER), **edit.get("b", {})}]
    text = matrix_text(models=models, backends=[{"id": "ae", "compile": "aot_eager"}],
                       modes=edit.get("modes", ["ops", "layers"]), timeout=edit.get("timeout", 300),
                       inputs=edit.get("inputs", {"seq_len": 8}), options=edit.get("options"))
    return {c.id: c for c in expand(load_matrix_text(text, path="/nowhere/m.yaml"))}


def _done(cell_id: str, config: dict, status: str = "pass") -> CellResult:
    model, backend = cell_id.split("@")
    return CellResult(id=cell_id, model=model, backend=backend, status=status, config=config)


def test_the_key_is_stable_and_plain() -> None:
    first, again = _cells(), _cells()
    for cid in first:
        assert cell_config(first[cid]) == cell_config(again[cid])
    cfg = cell_config(first["a@ae"])
    assert len(cfg["key"]) == 64 and cfg["timeout"] == 300
    assert json.loads(json.dumps(cfg)) == cfg  # plain JSON, as it is stored in result.json
    assert {"model", "backend", "inputs.seq_len", "inputs.phases", "parallel", "modes", "options.ops",
            "options.layers", "references", "version"} <= set(cfg["parts"])


def test_editing_one_model_changes_only_its_cells_keys_and_says_what() -> None:
    before, after = _cells(), _cells(b={"overrides": {**TINY_DECODER, "hidden_size": 32}})
    assert rerun_reason(_done("a@ae", cell_config(before["a@ae"])), cell_config(after["a@ae"])) is None
    assert rerun_reason(_done("b@ae", cell_config(before["b@ae"])), cell_config(after["b@ae"])) == "matrix changed: model"


def test_modes_phases_and_options_are_named() -> None:
    before = _cells()
    after = _cells(modes=["ops", "layers", "numerics"], inputs={"seq_len": 8, "phases": ["prefill", "decode"]})
    why = rerun_reason(_done("a@ae", cell_config(before["a@ae"])), cell_config(after["a@ae"]))
    assert why == "matrix changed: inputs.phases, modes, options.numerics", why
    opts = _cells(options={"layers": {"probe_timeout": 5}})
    why = rerun_reason(_done("a@ae", cell_config(before["a@ae"])), cell_config(opts["a@ae"]))
    assert why == "matrix changed: options.layers", why
    # an option of a mode the cell does not run changes nothing
    only_ops = {"modes": ["ops"]}
    plain, other = _cells(**only_ops), _cells(**only_ops, options={"numerics": {"compare_samples": 2}})
    assert cell_config(plain["a@ae"]) == cell_config(other["a@ae"])


def test_the_timeout_reruns_only_a_cell_that_timed_out() -> None:
    short, longer = _cells(timeout=60), _cells(timeout=900)
    old, new = cell_config(short["a@ae"]), cell_config(longer["a@ae"])
    assert old["key"] == new["key"]
    assert rerun_reason(_done("a@ae", old, "pass"), new) is None
    assert "timeout changed" in (rerun_reason(_done("a@ae", old, "timeout"), new) or "")
    assert rerun_reason(_done("a@ae", old, "crashed"), cell_config(_cells(timeout=60)["a@ae"])) is None


def test_a_result_without_a_key_reruns() -> None:
    cfg = cell_config(_cells()["a@ae"])
    assert "no configuration key" in (rerun_reason(_done("a@ae", None), cfg) or "")  # type: ignore[arg-type]
    roundtrip = CellResult.from_dict(_done("a@ae", cfg).to_dict())
    assert roundtrip.config == cfg and "config" not in _done("a@ae", None).to_dict()  # type: ignore[arg-type]


def test_the_lock_refuses_a_second_holder_and_is_released(tmp_path: Path) -> None:
    with run_lock(tmp_path):
        assert (tmp_path / LOCK_NAME).read_text().strip().isdigit()
        with pytest.raises(RunBusyError) as err:
            with run_lock(tmp_path):
                pass
        assert err.value.exit_code == EXIT_BUSY == 7
        assert "in use by another run (pid" in err.value.message and "\n" not in err.value.message
    with run_lock(tmp_path):  # released with the block; the file stays, and never blocks by itself
        pass


def test_a_path_model_keys_the_same_in_another_checkout(tmp_path: Path) -> None:
    """The same matrix and model folder under two roots (two machines' checkouts) give the same key."""
    keys = []
    for root in (tmp_path / "one", tmp_path / "two"):
        (root / "models" / "tiny").mkdir(parents=True)
        text = matrix_text(models=[{"id": "m", "path": "./models/tiny"}], backends=[{"id": "ae", "compile": "aot_eager"}])
        (root / "m.yaml").write_text(text, encoding="utf-8")
        [cell] = expand(load_matrix_text(text, path=str(root / "m.yaml")))
        assert cell.model.path and cell.model.path.startswith(str(root))
        keys.append(cell_config(cell, base=root)["key"])
    assert keys[0] == keys[1]
