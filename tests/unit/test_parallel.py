"""The tensor-parallel workload without ranks: the matrix key, the signatures, the hang report, the layout in
findings and reports (ci_runner/workloads/parallel.py, modes/numerics/tpsignature.py, procs/ranks.py, workloads/tpplan.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ci_runner.backends.check import check_backends, static_problems
from ci_runner.config import BackendSpec, load_matrix, load_matrix_text
from ci_runner.procs.ranks import hang_report
from ci_runner.workloads.tpplan import check_plan, resolve_plan
from ci_runner.errors import ConfigError, InputError
from ci_runner.matrix import expand
from ci_runner.modes.numerics.tpsignature import classify, signature_facts
from ci_runner.workloads.parallel import layout_of, spec_from_key
from ci_runner.report.view import finding_title
from ci_runner.results.model import Finding
from tests.fixtures.plugin_tp_models import decoder

MATRIX = """version: 1
defaults:
  parallel: {tp: 2}
models:
  - {id: a, config: llama}
  - {id: b, config: llama, parallel: null}
  - {id: c, config: llama, parallel: {tp: 4, plan: {"*.q_proj": colwise}}}
backends:
  - {id: x, compile: aot_eager}
  - {id: y, compile: aot_eager, parallel: {tp: 2, plan: {"*.o_proj": rowwise}}}
"""


def test_the_most_specific_parallel_wins_whole() -> None:
    cells = {c.id: c.parallel for c in expand(load_matrix_text(MATRIX))}
    assert cells["a@x"] is not None and cells["a@x"].tp == 2 and not cells["a@x"].plan
    assert cells["b@x"] is None  # `parallel: null` on the model turns it off
    assert cells["c@x"] is not None and cells["c@x"].label() == "tp4" and dict(cells["c@x"].plan) == {"*.q_proj": "colwise"}
    assert all(dict(cells[f"{m}@y"].plan) == {"*.o_proj": "rowwise"} for m in "abc")  # the backend's over the model's


@pytest.mark.parametrize("value, where, words, hint", [
    ("{tp: 0}", "models[0].parallel.tp", "is not a number of ranks", "tp: 2"),
    ("{tp: 2, plan: {'*.q_proj': colwse}}", "models[0].parallel.plan.*.q_proj", "unknown style 'colwse'",
     "did you mean 'colwise'"),
    ("{tp: 2, sizes: 1}", "models[0].parallel.sizes", "unknown key 'sizes'", "known: tp, plan"),
])
def test_a_bad_parallel_is_one_error_with_its_place_and_fix(value: str, where: str, words: str, hint: str) -> None:
    text = f"version: 1\nmodels:\n  - {{id: a, config: llama, parallel: {value}}}\nbackends:\n  - {{id: x, compile: aot_eager}}\n"
    with pytest.raises(ConfigError) as info:
        load_matrix_text(text, path="m.yaml")
    assert f"m.yaml:3:" in info.value.message and where in info.value.message and words in info.value.message
    assert hint in (info.value.hint or "")


GROUPS = """version: 1
defaults:
  parallel: {tp: 2}
models:
  - {id: a, config: llama}
  - {id: b, config: llama, parallel: null}
backends:
  - {id: cpu, compile: aot_eager}
  - {id: dev, compile: aot_eager, device: simdev, import: [ci_runner.sim.simccl], process_group: simccl}
"""


def test_a_backend_declares_its_devices_process_group() -> None:
    cells = {c.id: c.parallel for c in expand(load_matrix_text(GROUPS))}
    assert cells["a@cpu"] is not None and cells["a@cpu"].process_group is None and cells["a@cpu"].group_name == "gloo"
    dev = cells["a@dev"]
    assert dev is not None and dev.group_name == "simccl" and dev.process_group is not None
    assert (dev.process_group.device, dev.process_group.backend["id"], dev.label()) == ("simdev", "dev", "tp2")
    assert dev.process_group.backend["imports"] == ["ci_runner.sim.simccl"]  # the ranks import it before joining
    assert spec_from_key(dev.key()) == dev  # the layout crosses into the ranks whole
    assert layout_of({"parallel": dev.key()}) == dev  # and is read there, typed, by the one reader
    assert cells["b@dev"] is None  # one rank: nothing to join


@pytest.mark.parametrize("value", ['"hc cl"', "'-nccl'"])
def test_a_malformed_process_group_is_placed_with_its_fix(value: str, tmp_path: Path) -> None:
    [p] = static_problems(0, BackendSpec(id="x", process_group=value.strip("\"'")))
    assert p.where == ("process_group",) and "is not a c10d backend name" in p.message
    assert "process_group: hccl" in (p.hint or "")
    path = tmp_path / "m.yaml"
    path.write_text(f"version: 1\nmodels: [{{id: a, config: llama}}]\nbackends:\n  - {{id: x, process_group: {value}}}\n")
    with pytest.raises(ConfigError) as info:
        check_backends(load_matrix(path))
    name = value.strip("\"'")
    assert f"{path}:4:28: backends[0].process_group (backend 'x'): {name!r} is not a c10d backend" in info.value.message


def test_signature_facts_name_each_measured_bug() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 16, 8, generator=g)  # two ranks' row-parallel partial sums of one output
    ref = w.sum(0)
    missing = signature_facts(ref, w[0], [w[0], w[1]])
    assert classify(missing, 2) == "reduce_missing" and missing["sum_rel"] < 1e-6 and missing["ranks_equal"] is False
    assert 0.5 < missing["norm_ratio"] < 0.9  # about 1/sqrt(2) for independent partials, not 1/tp
    doubled = signature_facts(ref, 2 * ref, [2 * ref, 2 * ref])
    assert classify(doubled, 2) == "reduce_duplicated" and abs(doubled["norm_ratio"] - 2) < 1e-9
    permuted = signature_facts(ref, ref.flip(-1), None)
    assert classify(permuted, 2) == "shard_layout"
    assert classify(signature_facts(ref, ref + 0.1 * torch.randn(16, 8, generator=g), [ref, ref]), 2) is None


def test_hang_report_names_the_ranks_that_did_not_arrive(tmp_path: Path) -> None:
    (tmp_path / "rank0.progress").write_text("init\nshard\ncompile:x\n", encoding="utf-8")
    (tmp_path / "rank1.progress").write_text("init\nshard\n", encoding="utf-8")
    assert hang_report(tmp_path, 2) == "rank 1 did not arrive at `compile:x` (last: `shard`)"
    (tmp_path / "rank1.progress").write_text("init\nshard\ncompile:x\n", encoding="utf-8")
    assert "all reached `compile:x`" in (hang_report(tmp_path, 2) or "")


def test_default_plan_matches_the_decoder_names_and_checks_divisibility() -> None:
    model = decoder()["model"]
    plan = resolve_plan(model, None)
    assert plan["layers.0.self_attn.q_proj"] == "colwise" and plan["layers.0.self_attn.o_proj"] == "rowwise"
    assert plan["layers.0.mlp.down_proj"] == "rowwise" and plan["embed_tokens"] == "rowwise_embedding"
    assert plan["lm_head"] == "colwise_gather"
    check_plan(model, plan, 2, "tiny")
    with pytest.raises(InputError, match="not divisible by tp = 3"):
        check_plan(model, plan, 3, "tiny")
    with pytest.raises(InputError, match="no nn.Linear"):
        check_plan(model, resolve_plan(model, {"*.nothing": "colwise"}), 2, "tiny")


def test_default_plan_leaves_a_partly_matched_block_replicated() -> None:
    """A Llava-like model: CLIP's attention (q/k/v_proj, then out_proj) matches the decoder names only in part; its
    q/k/v sharded colwise would hand the unsharded out_proj each rank's half of the heads (the default plan did so on
    the example's tiny-llava, 2026-12-04). The language model is sharded, the vision tower is not."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    vision = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, image_size=32, patch_size=8))
    model = torch.nn.ModuleDict({"vision_tower": vision, "language_model": decoder()["model"]})
    plan = resolve_plan(model, None)
    assert not [n for n in plan if n.startswith("vision_tower.")]
    assert plan["language_model.layers.0.self_attn.q_proj"] == "colwise"
    assert plan["language_model.layers.0.mlp.gate_proj"] == "colwise"
    alone = {f"language_model.{n}" for n in resolve_plan(decoder()["model"], None)} - {"language_model.lm_head"}
    assert set(plan) == alone  # all of the decoder's (its head is not the model's top-level `lm_head` here)
    # a plan of the user's own is taken as written
    assert resolve_plan(model, {"*.q_proj": "colwise"}).get("vision_tower.encoder.layers.0.self_attn.q_proj") == "colwise"


def test_findings_carry_the_layout_like_a_phase() -> None:
    f = Finding(kind="divergence", stage="compare", message="m", fingerprint="f", module="layers.0.self_attn.o_proj",
                parallel="tp2")
    assert f.to_dict()["parallel"] == "tp2" and Finding.from_dict(f.to_dict()) == f
    assert "parallel" not in Finding(kind="divergence", stage="compare", message="m", fingerprint="f").to_dict()
    assert finding_title(f) == "layers.0.self_attn.o_proj [tp2]"


def test_analyse_turns_bad_shards_and_failing_collectives_into_findings() -> None:
    from ci_runner.modes.numerics.tpcompare import analyse
    from ci_runner.options import ThresholdOptions
    from ci_runner.workloads.parallel import ParallelSpec

    value = {"plan": {"l.q_proj": "colwise"}, "eager": [],
             "weights": [{"param": "l.q_proj.weight", "rank": 1, "equal": False, "dim": 0},
                         {"param": "l.q_proj.weight", "rank": 0, "equal": True, "dim": 0}],
             "backends": {"vendor": {"status": "error", "rank": 0, "stage": "compile", "error_type": "RuntimeError",
                                     "message": "JIT compilation failed",
                                     "collectives": [
                                         {"op": "_c10d_functional.all_reduce.default", "status": "unsupported",
                                          "error_type": "RuntimeError", "message": "failed to legalize"},
                                         {"op": "_c10d_functional.all_gather_into_tensor.default", "status": "ok"}]}}}
    result = analyse(value, "vendor", model_id="m", parallel=ParallelSpec(tp=2), opts=ThresholdOptions())
    kinds = [(f.kind, f.module or f.op, f.parallel) for f in result.findings]
    assert kinds == [("weights_mismatch", "l.q_proj", "tp2"),
                     ("unsupported_op", "_c10d_functional.all_reduce.default", "tp2")]
    assert "rank 1" in result.findings[0].message and result.findings[1].details["plan"] == {"l.q_proj": "colwise"}
    tp4 = analyse(value, "vendor", model_id="m", parallel=ParallelSpec(tp=4), opts=ThresholdOptions())
    assert tp4.findings[1].fingerprint != result.findings[1].fingerprint  # the layout is part of the identity
    value["backends"]["vendor"]["collectives"][0]["status"] = "ok"
    alone = analyse(value, "vendor", model_id="m", parallel=ParallelSpec(tp=2), opts=ThresholdOptions())
    assert alone.findings[-1].kind == "layer_failure" and "rank 0" in alone.findings[-1].message


def test_a_sharded_run_the_backend_left_to_pytorch_is_inconclusive_per_layer_never_a_pass() -> None:
    from ci_runner.modes.numerics.tpcompare import analyse
    from ci_runner.options import ThresholdOptions
    from ci_runner.workloads.parallel import ParallelSpec

    why = "rank 1: OpenVINO fell back to PyTorch: 3 partitions"
    records = [{"sample": s, "key": k, "order": i, "not_ran": why} for s in (0, 1) for i, k in enumerate(("a#0", "b#0"))]
    value = {"plan": {}, "eager": [], "weights": [], "backends": {"v": {"status": "ok", "records": records}}}
    result = analyse(value, "v", model_id="m", parallel=ParallelSpec(tp=2), opts=ThresholdOptions())
    assert (result.status, result.findings) == ("inconclusive", [])
    assert [(r["module"], r["not_ran"]) for r in result.layers] == [("a#0", why), ("b#0", why)]
    assert "2 of 2 module call(s) not run on the backend under tp2" in (result.reason or "")


def test_a_dead_rank_in_the_tp_layers_search_names_the_module_it_was_probing(tmp_path: Path) -> None:
    from ci_runner.procs.isolate import IsolatedResult
    from ci_runner.procs.ranks import RankRun
    from ci_runner.modes.layers.parallel import tp_findings
    from ci_runner.workloads.parallel import ParallelSpec

    (tmp_path / "rank0.progress").write_text("init\nprobe:v:<root>\nprobe:v:layers.0.mlp\n")
    (tmp_path / "rank1.progress").write_text("init\nprobe:v:<root>\nprobe:v:layers.0.mlp\n")
    results = (IsolatedResult(status="error", message="Gloo timed out"), IsolatedResult(status="crashed", signal="SIGSEGV"))
    found = tp_findings(None, RankRun(results=results), "v", "m", ParallelSpec(tp=2), tmp_path)
    assert [(f.kind, f.module, f.parallel) for f in found] == [("layer_failure", "layers.0.mlp", "tp2")]
    assert "rank 1 was probing layers.0.mlp" in found[0].message and found[0].details["ranks"] == [0, 1]
    assert found[0].details["status"] == "crashed"  # its repro (tprepro.py) then expects a rank to die again
    (tmp_path / "rank1.progress.faults").write_text("Timeout (0:00:10)!\nThread 0x1 (most recent call first):\n")
    hung = tp_findings(None, RankRun(results=results), "v", "m", ParallelSpec(tp=2), tmp_path)[0]
    assert "rank 1 hung (probe_timeout) in layers.0.mlp" in hung.message and hung.details["status"] == "timeout"


def test_a_tp_repro_shards_the_module_by_the_plan_relative_to_it() -> None:
    from ci_runner.engine.tprepro import relative_plan

    plan = {"embed_tokens": "rowwise_embedding", "layers.0.self_attn.q_proj": "colwise",
            "layers.0.self_attn.o_proj": "rowwise", "layers.0.mlp.down_proj": "rowwise", "layers.0.self_attn_x.q": "colwise"}
    assert relative_plan(plan, "layers.0.self_attn") == {"q_proj": "colwise", "o_proj": "rowwise"}
    assert relative_plan(plan, "layers.0.self_attn.o_proj") == {"": "rowwise"}  # the module itself is planned
    assert relative_plan(plan, "") == plan and relative_plan(plan, "layers.0.input_layernorm") == {}


def test_the_ranks_refuse_a_process_group_c10d_does_not_know() -> None:
    """What a rank does before joining (`procs/ranks.group_of`): the backend prepared, the name checked."""
    from ci_runner.config import spec_to_json
    from ci_runner.procs.ranks import group_of
    from ci_runner.errors import BackendError
    from ci_runner.workloads.parallel import layout_of

    assert group_of(layout_of({"parallel": {"tp": 2}})) == ("gloo", "cpu")
    payload = {"parallel": {"tp": 2, "process_group": {"name": "glo", "device": "cpu",
                                                       "backend": spec_to_json(BackendSpec(id="x", compile="aot_eager"))}}}
    with pytest.raises(BackendError) as info:
        group_of(layout_of(payload))
    assert "backend 'x': process_group 'glo' is not a c10d backend torch knows" in info.value.message
    assert "gloo" in (info.value.hint or "") and "register_backend" in (info.value.hint or "")


def test_a_lone_collective_openvino_leaves_to_pytorch_is_not_ran_not_ok(tmp_path: Path) -> None:
    """OpenVINO leaves a lone all-reduce to PyTorch (its partitioner makes no partition of it): a right result, but
    not the backend's (`workloads/collectives.probe_collectives`: `not_ran`, OpenVINO's reason); aot_eager's is `ok`. One
    rank over gloo."""
    pytest.importorskip("openvino")
    import torch.distributed as dist

    from ci_runner.backends import resolve_backend
    from ci_runner.workloads.collectives import PLAN_CALLS, probe_collectives

    recipe = {"options": {"aot_autograd": True, "testing": True, "config": {"INFERENCE_PRECISION_HINT": "f32"}}}
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        calls = [c for c in PLAN_CALLS if "all_reduce" in str(c["op"])][:1]
        ov = resolve_backend(BackendSpec(id="ov", compile="openvino", compile_options=recipe))
        (row,) = probe_collectives(ov.compile, calls, compile_name="openvino")
        assert row["status"] == "not_ran" and "OpenVINO ran no partition" in row["message"], row
        ae = resolve_backend(BackendSpec(id="ae", compile="aot_eager"))
        assert [r["status"] for r in probe_collectives(ae.compile, calls, compile_name="aot_eager")] == ["ok"]
    finally:
        dist.destroy_process_group()


def test_a_layout_the_model_cannot_take_is_refused_before_any_cell_runs(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`parallel: {tp: 3}` on a 4-head model (issue 45: it passed `expand` and became a layer finding blamed on the
    backend after 83 s): `run` refuses it at once (exit 2, the cell and the fix named, no cell folder); the cell
    itself, run alone, is an error of type `layout`, never a finding."""
    from ci_runner.cli import main
    from ci_runner.run.cellrun import _layout_error

    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        "version: 1\ndefaults: {modes: [layers]}\n"
        "models:\n  - {id: four-heads, config: llama, parallel: {tp: 3}, overrides: {hidden_size: 32,\n"
        "     intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2,\n"
        "     vocab_size: 96}}\n"
        "  - {id: fits, config: llama, parallel: {tp: 2}, overrides: {hidden_size: 32, intermediate_size: 64,\n"
        "     num_hidden_layers: 1, num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 96}}\n"
        "backends: [{id: b, compile: aot_eager}]\n", encoding="utf-8")
    assert main(["run", str(matrix), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "cell four-heads@b (tp3): model 'four-heads': num_attention_heads = 4 is not divisible by tp = 3" in err
    assert "fits@b" not in err and "Traceback" not in err and not (tmp_path / "out" / "cells").exists()
    cells = {c.model.id: c for c in expand(load_matrix(matrix))}
    assert _layout_error(cells["fits"]) is None
    assert _layout_error(cells["four-heads"]) == (
        "tp3: model 'four-heads': num_attention_heads = 4 is not divisible by tp = 3 (fix: choose a tp that divides "
        "the head counts, or override them in the model)")


def test_a_ranks_repro_inputs_are_its_part_of_the_references() -> None:
    """A numerics TP repro feeds each rank its part of the single-rank reference's inputs: a tensor the sharded layer
    takes whole is the reference's, one it takes a slice of is this rank's chunk along the dim that differs; the
    other values are the rank's own. A tensor that is no chunk of the reference's is refused."""
    from ci_runner.engine.codec import TensorStore, encode_call
    from ci_runner.modes.numerics.tprepro import local_inputs

    def encoded(args: tuple, kwargs: dict) -> tuple[dict, dict]:
        store = TensorStore()
        return encode_call(args, kwargs, store.add, strict=True, kv=True), store.tensors

    full, mask = torch.arange(24.0).reshape(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)
    reference = encoded((full,), {"mask": mask, "scale": 2.0})
    spec, tensors = local_inputs(encoded((torch.zeros(2, 3, 2),), {"mask": mask, "scale": 3.0}), reference, 1, 2)
    arg = tensors[spec["args"]["__tuple__"][0]["__tensor__"]["key"]]
    assert torch.equal(arg, full[..., 2:])  # rank 1's half of the last dim
    kwargs = dict(spec["kwargs"]["__dict__"])
    assert torch.equal(tensors[kwargs["mask"]["__tensor__"]["key"]], mask) and kwargs["scale"] == 3.0  # the rank's
    with pytest.raises(ValueError, match="not a shard"):
        local_inputs(encoded((torch.zeros(2, 3, 3),), {}), encoded((full,), {}), 0, 2)
