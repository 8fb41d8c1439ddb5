"""The toolbox inside the numerics mode, through the real cell runner: weights check before numerics, batch
invariance, the bisect of the divergent layer, and a reference dump consumed instead of the reference pass."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ci_runner.run.cellrun import run_cell_inprocess, write_final
from ci_runner.config import load_matrix_text
from ci_runner.matrix import find_cell
from ci_runner.results.model import CellResult, fingerprint, load_cell_result
from tests.fixtures.matrices import REFERENCES, matrix_text

def _matrix(thresholds: Path, dump: Path) -> str:
    """Tiny Llama on one backend per toolbox check (`thresholds`: the thresholds folder; `dump`: a reference dump)."""
    return matrix_text(
        modes=["numerics"], inputs={"seq_len": 8, "samples": 2},
        options={"numerics": {"thresholds_dir": str(thresholds), "isolate": False}}, references=REFERENCES,
        models=[{"id": "tiny-llama", "config": "llama",
                 "overrides": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}}],
        backends=[{"id": "bad-transfer", "compile": "tests.fixtures.plugin_toolbox_weights:corrupt",
                   "options": {"numerics": {"isolate": True}}},
                  {"id": "slotty", "compile": "tests.fixtures.plugin_toolbox_batch:slot_dependent",
                   "options": {"numerics": {"batch_invariance": True, "batch_slots": 3, "weights_check": False}}},
                  {"id": "silu-off", "compile": "tests.fixtures.plugin_toolbox_perturb:perturb",
                   "options": {"numerics": {"bisect": True}}},
                  {"id": "silu-off-from-dump", "compile": "tests.fixtures.plugin_toolbox_perturb:perturb",
                   "options": {"numerics": {"reference_dump": str(dump), "weights_check": False}}},
                  {"id": "inductor-wrong-eps", "compile": "inductor", "import": ["tests.fixtures.plugin_toolbox_inductor"],
                   "options": {"numerics": {"bisect": True, "weights_check": False, "views": ["cumulative"]}}}],
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("toolbox")
    text = _matrix(root / "thresholds", root / "ref-dump")
    (root / "m.yaml").write_text(text)
    return root, load_matrix_text(text, path=str(root / "m.yaml"))


def _bisect_left_to_eager(setup, backend: str, layer: str) -> dict:  # type: ignore[no-untyped-def]
    """The cell's bisect of `layer` with every compiled step left to PyTorch by a real silent fallback
    (`torch.compiler.set_stance("force_eager")`): each step would read as "good"."""
    import torch

    from ci_runner.backends import resolve_backend
    from ci_runner.models.load import build_inputs, load_model
    from ci_runner.modes.numerics.bisect import bisect_layer

    _root, matrix = setup
    cell = find_cell(matrix, f"tiny-llama@{backend}")
    loaded = load_model(cell.model, seed=cell.inputs.seed)
    kwargs = build_inputs(loaded, cell.inputs)
    with torch.compiler.set_stance("force_eager"):
        return bisect_layer(loaded.module, kwargs, resolve_backend(cell.backend), layer=layer, call_index=0,
                            threshold={"rel": 1e-6})


def _run(setup, backend: str) -> CellResult:  # type: ignore[no-untyped-def]
    root, matrix = setup
    cell = find_cell(matrix, f"tiny-llama@{backend}")
    cdir = root / "cells" / cell.id
    result = run_cell_inprocess(cell, cdir, modes=("numerics",), deadline=time.monotonic() + 600)
    path = write_final(result, cdir)
    return load_cell_result(path)  # schema-valid, findings and all


@pytest.mark.slow
def test_weights_check_names_the_corrupted_tensor_before_numerics(setup) -> None:  # type: ignore[no-untyped-def]
    res = _run(setup, "bad-transfer")
    mode = res.modes["numerics"]
    assert mode.status == "fail", mode.reason
    weights = [f for f in mode.findings if f.kind == "weights_mismatch"]
    assert [f.details["tensor"] for f in weights] == ["model.layers.1.mlp.down_proj.weight"]
    assert weights[0].fingerprint == fingerprint("weights_mismatch", "bad-transfer", "tiny-llama",
                                                 "model.layers.1.mlp.down_proj.weight")
    assert mode.findings[0].kind == "weights_mismatch", "reported first: it explains what follows"
    assert mode.data["weights"]["status"] == "mismatch" and mode.data["weights"]["byte_equal"] == 22
    assert any("weights check" in n for n in mode.data["notes"])
    div = [f for f in mode.findings if f.kind == "divergence"]
    assert div and all("layers.0" not in (f.module or "") for f in div), "layer 0 is untouched by the bad weight"


@pytest.mark.slow
def test_batch_invariance_catches_a_slot_dependent_backend(setup) -> None:  # type: ignore[no-untyped-def]
    res = _run(setup, "slotty")
    mode = res.modes["numerics"]
    assert [f.kind for f in mode.findings] == ["batch_variance"], "batch 1 is exact: only the batch experiment sees it"
    f = mode.findings[0]
    assert f.module == "model.layers.0.mlp.act_fn" and f.module_class == "SiLUActivation"
    assert mode.data["batch_invariance"]["same_input"]["first_nonbitwise"] == "model.layers.0.mlp.act_fn"
    assert "weights" not in mode.data


@pytest.mark.slow
def test_bisect_traces_a_plugin_divergence_to_its_graph_node(setup) -> None:  # type: ignore[no-untyped-def]
    res = _run(setup, "silu-off")
    mode = res.modes["numerics"]
    assert mode.data["weights"]["status"] == "ok"
    b = mode.data["bisect"]
    assert b["status"] == "ok" and b["method"] == "nodes" and b["layer"] == "model.layers.0.mlp.act_fn"
    assert b["first_node"]["op"] == "aten.silu.default"
    f = next(f for f in mode.findings if f.module == "model.layers.0.mlp.act_fn")
    assert f.kind == "divergence" and "bisect: first node: silu = aten.silu.default" in f.message
    assert f.details["bisect"]["first_node"]["module"] == "model.layers.0.mlp.act_fn"
    # a step the backend did not run is inconclusive, never "does not reproduce"
    left = _bisect_left_to_eager(setup, "silu-off", "model.layers.0.mlp.act_fn")
    assert left["status"] == "inconclusive" and left["reproduced"] is None and "first_node" not in left, left
    assert left["summary"].startswith("inconclusive: the step with the first 1 of 1 nodes on the target did not run")
    assert "given no graph" in left["not_ran"]["why"] and left["log"][0]["not_ran"]


@pytest.mark.slow
def test_numerics_consumes_a_reference_dump_instead_of_running_the_reference(setup) -> None:  # type: ignore[no-untyped-def]
    from ci_runner.modes.numerics.dumps import dump_entry

    root, matrix = setup
    dump_entry(matrix, "tiny-llama", root / "ref-dump", reference_id="cpu-fp32", sample=0)
    res = _run(setup, "silu-off-from-dump")
    mode = res.modes["numerics"]
    assert any("reference pass replaced by dump(s)" in n for n in mode.data["notes"])
    assert mode.data["compare_samples"] == [0]
    assert mode.data["verdict"]["first_divergent"] == "model.layers.0.mlp.act_fn"
    assert {f.module for f in mode.findings if f.kind == "divergence"} >= {"model.layers.0.mlp.act_fn"}
    # a dump of another input is refused, not silently compared
    dump_entry(matrix, "tiny-llama", root / "ref-dump", reference_id="cpu-fp32", sample=1)
    (root / "ref-dump" / "manifest.json").write_text(
        (root / "ref-dump" / "manifest.json").read_text().replace('"sample": 1', '"sample": 0'))
    res = _run(setup, "silu-off-from-dump")
    assert res.modes["numerics"].status == "error"
    assert "another input" in (res.modes["numerics"].reason or "")


@pytest.mark.slow
def test_bisect_traces_an_inductor_pass_to_its_subsystem(setup) -> None:  # type: ignore[no-untyped-def]
    from tests.fixtures import plugin_toolbox_inductor

    plugin_toolbox_inductor.install()  # (again: an earlier test in this process may have removed it)
    try:
        res = _run(setup, "inductor-wrong-eps")
    finally:
        plugin_toolbox_inductor.uninstall()
    mode = res.modes["numerics"]
    b = mode.data["bisect"]
    assert b["status"] == "ok", b
    assert b["method"] == "compiler" and b["layer"].endswith("input_layernorm")
    assert (b["backend"], b["subsystem"], b["debug_info"]) == ("inductor", "post_grad_passes",
                                                               "post_grad_custom_post_pass")
    f = next(f for f in mode.findings if f.module == b["layer"])
    assert "compiler bisect: inductor › post_grad_passes" in f.message
    left = _bisect_left_to_eager(setup, "inductor-wrong-eps", b["layer"])
    assert left["status"] == "inconclusive" and left["reproduced"] is None and "subsystem" not in left, left
    assert left["summary"].startswith("inconclusive: the step on inductor did not run on the backend")
