"""Tensor parallel over gloo on CPU, and over a device's own process group: the ranks, the sharded model against
one rank, the self-test backends.

One launch (module-scoped) runs the tiny decoder of `tests/fixtures/plugin_tp_models.py` sharded over 2 ranks by
the default decoder plan, eagerly and then compiled by aot_eager, sim-tp-drop, sim-tp-dup and sim-tp-shard in turn
(the numerics task), then the layers mode's search on sim-crash in the same ranks (the layers task, which stores
the failing module's shards and inputs for its repro), then the
ops mode's inventory of the collectives, probed alone on sim-subset allowing ATen ops only, and of rank 0's
sharded graphs' other ops (the ops task).
Another (module-scoped) runs the numerics task on the self-test device `simdev` over its own process group
(`simccl`, declared by the backend), compiled by aot_eager and by sim-tp-drop.
The numerics task also stores each divergent layer's shards and inputs: sim-tp-shard's q_proj gets a repro with its
own ranks, run (verified), by its printed command, and with aot_eager (it passes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ci_runner.config import BackendSpec, InputSpec, ModelSpec, spec_to_json
from ci_runner.procs.ranks import RANK_TASKS, BackgroundLaunch, RankRun, launch_ranks, read_progress
from ci_runner.modes.layers.parallel import TASK as LAYERS, tp_findings
from ci_runner.modes.layers.tprepro import attach_repros
from ci_runner.modes.ops.parallel import TASK as OPS, collective_finding
from ci_runner.modes.numerics.tpcompare import TASK as NUMERICS, analyse, rank_payload
from ci_runner.modes.numerics.tprepro import tp_repro
from ci_runner.options import OpsOptions
from ci_runner.registry import parse_options
from ci_runner.results.model import Repro
from ci_runner.options import ThresholdOptions
from ci_runner.workloads.parallel import ParallelSpec, with_process_group

pytestmark = pytest.mark.subprocess

TP2 = ParallelSpec(tp=2)
BACKENDS = ("aot_eager", "sim-tp-drop", "sim-tp-dup", "sim-tp-shard")
SIM_CRASH = BackendSpec(id="sim-crash", compile="sim-crash")
ATEN_ONLY = BackendSpec(id="sim-subset", compile="sim-subset", backend_options={"allow": ["aten.*"]})


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> tuple[RankRun, Path]:
    model = ModelSpec(id="tiny-decoder", factory="tests.fixtures.plugin_tp_models:decoder")
    payload = rank_payload(model, InputSpec(samples=2), TP2, [BackendSpec(id=b, compile=b) for b in BACKENDS],
                           samples=[0, 1])
    payload.update(tasks=[NUMERICS, LAYERS, OPS], ops_backend=spec_to_json(ATEN_ONLY),
                   search_backends=[spec_to_json(SIM_CRASH)])
    folder = tmp_path_factory.mktemp("tp")
    run = launch_ranks(RANK_TASKS, payload, world=2, timeout=400, folder=folder)
    assert run.ok, run.describe() + "\n" + "\n".join(r.traceback or r.stderr_tail for r in run.results)
    return run, folder


@pytest.fixture(scope="module")
def ranks(launch: tuple[RankRun, Path]) -> dict[str, Any]:
    return launch[0].results[0].value[NUMERICS]


def _only(value: dict[str, Any], backend: str) -> Any:
    result = analyse(value, backend, model_id="tiny-decoder", parallel=TP2, opts=ThresholdOptions())
    assert len(result.findings) == 1, [f.message for f in result.findings]
    return result.findings[0]


def test_the_sharded_model_run_eagerly_is_the_single_rank_model(ranks: dict[str, Any]) -> None:
    assert ranks["eager"] and all(r["metrics"]["rel"] < 1e-5 for r in ranks["eager"])  # the ground truth
    assert ranks["weights"] and all(w["equal"] for w in ranks["weights"])  # every shard is its slice
    assert {w["rank"] for w in ranks["weights"]} == {0, 1}
    assert ranks["plan"]["layers.0.self_attn.o_proj"] == "rowwise"


def test_aot_eager_under_tp2_has_no_findings(ranks: dict[str, Any]) -> None:
    result = analyse(ranks, "aot_eager", model_id="tiny-decoder", parallel=TP2, opts=ThresholdOptions())
    assert result.status == "pass" and not result.findings
    assert len(result.layers) >= 15 and not any(r["over"] for r in result.layers)


def test_a_dropped_all_reduce_is_found_at_its_projection(ranks: dict[str, Any]) -> None:
    f = _only(ranks, "sim-tp-drop")
    assert (f.kind, f.module, f.parallel, f.details["signature"]) == \
        ("divergence", "layers.0.self_attn.o_proj", "tp2", "reduce_missing")
    assert f.details["facts"]["ranks_equal"] is False and f.details["facts"]["sum_rel"] < 1e-5
    assert f.details["plan"]["layers.0.self_attn.q_proj"] == "colwise"
    assert "layers.0.mlp.down_proj" in f.details["later"]  # the drift it carries in is listed, not a finding


def test_a_duplicated_all_reduce_is_found_by_its_norm(ranks: dict[str, Any]) -> None:
    f = _only(ranks, "sim-tp-dup")
    assert (f.module, f.details["signature"]) == ("layers.0.self_attn.o_proj", "reduce_duplicated")
    assert f.metrics["cos"] > 0.9999 and abs(f.details["facts"]["norm_ratio"] - 2.0) < 1e-4  # cosine blind, norm 2×


def test_a_wrongly_laid_out_shard_is_found_as_a_permutation(ranks: dict[str, Any]) -> None:
    f = _only(ranks, "sim-tp-shard")
    assert (f.module, f.details["signature"]) == ("layers.0.self_attn.q_proj", "shard_layout")
    assert f.details["facts"]["permuted_rel"] < 1e-5 and f.metrics["cos"] < 0.5


def test_each_divergence_has_its_layer_stored_by_every_rank(ranks: dict[str, Any], launch: tuple[RankRun, Path]
                                                            ) -> None:
    """Rank 0 found each backend's divergence as the parent does; every rank stored that layer's own shards and its
    part of the reference's inputs: the rowwise o_proj takes a slice of them, the colwise q_proj all of them."""
    folder = launch[1] / "numerics_repro"
    stored = ranks["stored"]
    assert set(stored) == {"sim-tp-drop", "sim-tp-dup", "sim-tp-shard"}  # aot_eager: no divergence, nothing stored
    assert {b: (s["key"], s["plan"], s["errors"]) for b, s in stored.items()} == {
        "sim-tp-drop": ("layers.0.self_attn.o_proj", {"": "rowwise"}, {}),
        "sim-tp-dup": ("layers.0.self_attn.o_proj", {"": "rowwise"}, {}),
        "sim-tp-shard": ("layers.0.self_attn.q_proj", {"": "colwise"}, {})}
    o_proj = folder / stored["sim-tp-drop"]["dir"]
    rank0, rank1 = (torch.load(o_proj / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    whole = rank0["reference"]["tensors"][rank0["reference"]["call"]["args"]["__tuple__"][0]["__tensor__"]["key"]]
    part = rank1["tensors"][rank1["call"]["args"]["__tuple__"][0]["__tensor__"]["key"]]
    assert whole.shape[-1] == 16 and torch.equal(part, whole.chunk(2, dim=-1)[1])  # rank 1's half of the input
    assert tuple(rank1["state"]["weight"].shape) == (16, 8) and "reference" not in rank1
    assert tuple(rank0["reference"]["state"]["weight"].shape) == (16, 16)  # the layer unsharded, for the reference


def test_a_tp_divergence_has_a_verified_repro_and_its_command_shows_it(ranks: dict[str, Any],
                                                                       launch: tuple[RankRun, Path]) -> None:
    """The repro of sim-tp-shard's q_proj starts 2 ranks of its own, runs the colwise q_proj compiled with the
    backend and the unsharded q_proj eagerly: over the finding's threshold, exit 1 (verified; its printed command,
    run from the cell folder, the same). The same files with aot_eager in it: within, exit 0 (~45 s in all)."""
    cell = launch[1]
    f = _only(ranks, "sim-tp-shard")
    info = ranks["stored"]["sim-tp-shard"]
    common = dict(layout=TP2, model_id="tiny-decoder", folder=cell / "numerics_repro", cell_dir=cell, timeout=150.0)
    repro = tp_repro(f, info, spec=BackendSpec(id="sim-tp-shard", compile="sim-tp-shard"), verify=True, **common)
    assert isinstance(repro, Repro) and repro.verified, repro
    assert repro.path == "numerics_repro/layers.0.self_attn.q_proj/repro.py"
    assert repro.command is not None and repro.command.startswith("cd numerics_repro/layers.0.self_attn.q_proj && ")
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    shown = subprocess.run(repro.command, shell=True, cwd=cell, capture_output=True, text=True, timeout=150, env=env)
    assert shown.returncode == 1, shown.stdout[-3000:] + shown.stderr[-2000:]
    assert "rank 0: REPRO FAILED: layers.0.self_attn.q_proj diverges: rel" in shown.stdout
    exact = tp_repro(f, info, spec=BackendSpec(id="aot_eager", compile="aot_eager"), verify=False, **common)
    assert isinstance(exact, Repro) and not exact.verified
    passed = subprocess.run(exact.command, shell=True, cwd=cell, capture_output=True, text=True, timeout=150, env=env)
    assert passed.returncode == 0, passed.stdout[-3000:] + passed.stderr[-2000:]
    assert "rank 0: REPRO PASSED: layers.0.self_attn.q_proj is within the finding's threshold" in passed.stdout


def test_the_layers_search_under_tp2_finds_the_failing_attention_on_every_rank(launch: tuple[RankRun, Path]) -> None:
    run, folder = launch
    value = run.results[0].value[LAYERS]
    found = tp_findings(value, run, "sim-crash", "tiny-decoder", TP2, folder)
    assert [(f.kind, f.module, f.parallel, f.stage, f.details["ranks"]) for f in found] == \
        [("layer_failure", "layers.0.self_attn", "tp2", "run", [0, 1])]
    assert "[sim-crash]" in found[0].message and "on every rank" in found[0].message
    outcomes = value["backends"]["sim-crash"]["outcomes"]
    assert outcomes[""]["status"] == "fail"  # the whole sharded model first, as the single-rank search
    # its sharded children pass alone, the row-parallel o_proj's all-reduce too: the attention itself is smallest
    assert {outcomes[f"layers.0.self_attn.{p}_proj"]["status"] for p in "qkvo"} == {"pass"}
    assert outcomes["layers.0.mlp"]["status"] == "pass"


def test_the_tp_layers_finding_has_a_repro_with_its_own_ranks_that_fails_on_both(launch: tuple[RankRun, Path]) -> None:
    """Each rank stored the failing attention's local shards and inputs; the script starts 2 ranks of its own,
    rebuilds the attention from the model's factory, shards it with parallelize_module, compiles it with sim-crash:
    both ranks fail with the finding's error (run: verified; ~15 s)."""
    run, folder = launch
    value = run.results[0].value[LAYERS]
    found = tp_findings(value, run, "sim-crash", "tiny-decoder", TP2, folder)
    stored = value["stored"]["layers.0.self_attn"]
    assert (stored["plan"], stored["errors"]) == ({"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise",
                                                   "o_proj": "rowwise"}, {})
    attach_repros(found, value["stored"], spec=SIM_CRASH, layout=TP2, model_id="tiny-decoder", folder=folder,
                  cell_dir=folder, opts=parse_options("layers", {}), time_left=300.0)
    f = found[0]
    assert f.repro is not None and f.repro.path == "repro_layers.0.self_attn/repro.py"
    assert f.repro.verified, (f.repro.note, f.details.get("repro_output_tail"))
    tail = f.details["repro_output_tail"]
    for r in (0, 1):  # the summary the script ends with: every rank, the finding's error
        assert f"rank {r}: REPRO FAILED: layers.0.self_attn: RuntimeError: [sim-crash] Assertion" in tail
    assert tail.rstrip().endswith("layers.0.self_attn under tp2 on sim-crash: fails on rank(s) 0, 1")
    script = (folder / f.repro.path).read_text()
    assert "weights_only=True)" in script and "parallelize_module(module, mesh" in script
    blob = torch.load(folder / "repro_layers.0.self_attn" / "rank1.pt", weights_only=True)
    assert tuple(blob["state"]["q_proj.weight"].shape) == (8, 16)  # rank 1's own shard of the 16 output rows
    assert tuple(blob["state"]["o_proj.weight"].shape) == (16, 8)  # and of the rowwise projection's inputs


def test_the_collectives_the_backend_sees_are_ops_each_refused_one_with_a_repro(
        launch: tuple[RankRun, Path], tmp_path: Path) -> None:
    run, _ = launch
    value = run.results[0].value[OPS]
    rows = {r["op"]: r for r in value["rows"]}
    assert set(rows) == {"_c10d_functional.all_reduce.default", "_c10d_functional.all_gather_into_tensor.default"}
    reduce = rows["_c10d_functional.all_reduce.default"]
    # the rowwise embedding's, o_proj's and down_proj's all-reduces: one call signature (sum over [1, 8, 16])
    assert (reduce["call"]["shape"], reduce["call"]["args"], reduce["call"]["count"]) == ([1, 8, 16], ["sum"], 3)
    assert rows["_c10d_functional.all_gather_into_tensor.default"]["call"]["module"] == "lm_head"
    assert all(r["status"] == "unsupported" and r["ranks"] == [0, 1] for r in rows.values())
    # the repro is run (verified) by the slow IREE test below: here it is written and compiles (16 s less)
    opts: OpsOptions = parse_options("ops", {"verify": False})
    f = collective_finding(reduce, ATEN_ONLY, "tiny-decoder", TP2, opts, tmp_path, tmp_path)
    assert (f.kind, f.op, f.parallel, f.error_type) == \
        ("unsupported_op", "_c10d_functional.all_reduce.default", "tp2", "SimCompilerError")
    assert f.repro is not None and not f.repro.verified
    script = (tmp_path / f.repro.path).read_text()
    compile(script, f.repro.path, "exec")
    assert "OP = ('_c10d_functional', 'all_reduce', 'default')" in script and "SHAPE = [1, 8, 16]" in script
    assert "make_backend('sim-subset'" in script


# simdev with its kernels for the decoder (RMSNorm's rsqrt, attention's softmax), over simccl (`ci_runner/sim/simccl.py`)
SIMDEV = {"imports": ("ci_runner.sim.simccl",), "device": "simdev", "process_group": "simccl",
          "backend_options": {"simdev": {"extra_allow": ["rsqrt", "_softmax"]}}}


def _on_simdev(compiler: str, folder: Path, **tasks: Any) -> tuple[dict[str, Any], ParallelSpec]:
    """The numerics task (and `tasks`: other tasks' payload keys) over the device's own process group, as a cell
    whose backend declares it gets it; rank 0's value per task."""
    spec = BackendSpec(id=f"simdev-{compiler}", compile=compiler, **SIMDEV)
    layout = with_process_group(TP2, spec.process_group, spec.device, spec_to_json(spec))
    assert layout is not None
    model = ModelSpec(id="tiny-decoder", factory="tests.fixtures.plugin_tp_models:decoder")
    payload = rank_payload(model, InputSpec(samples=2), layout, [spec], samples=[0, 1])
    payload.update(tasks)
    run = launch_ranks(RANK_TASKS, payload, world=2, timeout=400, folder=folder)
    assert run.ok, run.describe() + "\n" + "\n".join(r.traceback or r.stderr_tail for r in run.results)
    return run.results[0].value, layout


def test_tp2_over_the_devices_own_process_group(tmp_path: Path) -> None:
    """The ranks join simccl (not gloo), the mesh and the sharded model are on simdev, the DTensor collectives run
    over simccl on simdev tensors, the outputs are compared on CPU: aot_eager there has no findings."""
    values, layout = _on_simdev("aot_eager", tmp_path)
    value = values[NUMERICS]
    group = value["process_group"]
    assert (group["name"], group["device"]) == ("simccl", "simdev")
    ran = group["collectives"]  # simccl's own count, by collective and the device type of the tensors it was given
    # the weights' scatter; o_proj's, down_proj's and the embedding's all-reduces, the LM head's gather (2 samples
    # eagerly, then compiled): on simdev tensors
    assert ran["scatter:simdev"] >= 1 and ran["allreduce:simdev"] >= 6 and ran["all_gather_into_tensor:simdev"] >= 2
    assert value["weights"] and all(w["equal"] for w in value["weights"])  # shards on simdev, compared on CPU
    assert value["eager"] and all(r["metrics"]["rel"] < 1e-5 for r in value["eager"])
    result = analyse(value, "simdev-aot_eager", model_id="tiny-decoder", parallel=layout, opts=ThresholdOptions())
    assert result.status == "pass" and not result.findings and len(result.layers) >= 15
    assert not any(r["over"] or r.get("not_ran") for r in result.layers)


@pytest.mark.slow
def test_the_three_modes_tasks_find_the_same_over_the_devices_own_process_group(tmp_path: Path) -> None:
    """On simdev over simccl, as over gloo on CPU: sim-tp-drop's missing all-reduce, the collectives sim-subset
    (ATen only) refuses alone (probed on simdev tensors), and the attention sim-crash fails in."""
    on_simdev = {"simdev": {"extra_allow": ["rsqrt", "_softmax"]}}
    aten_only = BackendSpec(id="simdev-subset", compile="sim-subset",
                            **{**SIMDEV, "backend_options": {"allow": ["aten.*"], **on_simdev}})
    crash = BackendSpec(id="simdev-crash", compile="sim-crash", **SIMDEV)
    values, _ = _on_simdev("sim-tp-drop", tmp_path, tasks=[NUMERICS, OPS, LAYERS], ops_backend=spec_to_json(aten_only),
                           search_backends=[spec_to_json(crash)])
    f = _only(values[NUMERICS], "simdev-sim-tp-drop")
    assert (f.module, f.details["signature"]) == ("layers.0.self_attn.o_proj", "reduce_missing")
    assert f.details["facts"]["sum_rel"] < 1e-5  # the ranks' partial sums, gathered from simdev, sum to the reference
    rows = {r["op"]: r for r in values[OPS]["rows"]}
    assert set(rows) == {"_c10d_functional.all_reduce.default", "_c10d_functional.all_gather_into_tensor.default"}
    assert all(r["status"] == "unsupported" and r["ranks"] == [0, 1] and r["error_type"] == "SimCompilerError"
               for r in rows.values())
    outcomes = values[LAYERS]["backends"]["simdev-crash"]["outcomes"]
    assert outcomes["layers.0.self_attn"]["status"] == "fail"
    assert {outcomes[f"layers.0.self_attn.{p}_proj"]["status"] for p in "qkvo"} == {"pass"}


def test_a_rank_that_never_arrives_is_named(tmp_path: Path) -> None:
    run = launch_ranks("tests.fixtures.tp_targets:stall", {"stall_s": 9}, world=2, timeout=120, folder=tmp_path,
                       collective_timeout=3)
    assert not run.ok and run.results[1].ok
    assert run.results[0].status == "error" and "timed out" in run.results[0].message.lower()  # gloo's own error
    assert run.hang == "rank 1 did not arrive at `barrier` (last: `init`)"
    assert "rank 1 did not arrive" in run.describe()


def test_one_launch_keeps_each_tasks_value_past_a_task_that_raises_and_a_rank_that_dies(tmp_path: Path) -> None:
    """The tasks of one launch run in turn in one process group, each with its own part of the payload; each is
    recorded as it ends: a task that raises on every rank is that task's error (the next one still runs), and a rank
    that dies (SIGSEGV) in the last task leaves every earlier task's value."""
    first, boom, second, die = (f"tests.fixtures.tp_targets:{n}" for n in ("first", "boom", "second", "die"))
    payload = {"parallel": TP2.key(), "tasks": [first, boom, second, die],
               "parts": {first: {"tag": "a"}, second: {"tag": "b"}}}
    launch = BackgroundLaunch(payload, world=2, timeout=120, folder=tmp_path, collective_timeout=20)
    one = launch.take(first)
    assert (one.value, one.run.describe()) == ({"sum": 3.0, "tag": "a"}, "all ranks finished")
    raised = launch.take(boom)
    assert raised.value is None and [r.error_type for r in raised.run.results] == ["ValueError", "ValueError"]
    assert "rank 0 failed: ValueError: boom on rank 0" in raised.run.describe()
    assert launch.take(second).value == {"sum": 3.0, "tag": "b"}
    died = launch.take(die)
    assert died.value is None and died.run.results[1].status == "crashed" and "SIGSEGV" in died.run.describe()
    launch.wait()
    assert launch.run is not None and not launch.run.ok
    assert [read_progress(tmp_path, r).count("init") for r in (0, 1)] == [1, 1]  # one launch


@pytest.mark.slow
def test_iree_reports_its_unsupported_collective(tmp_path: Path) -> None:
    """IREE's turbine_cpu cannot lower `_c10d_functional.all_reduce` (checked by hand with a lone funcol all-reduce
    under gloo: "failed to legalize operation 'torch.operator' … torch._c10d_functional.all_reduce"): the ops
    mode's TP task finds it among the sharded model's collectives, and its repro (own ranks) fails the same way."""
    pytest.importorskip("iree.turbine")
    model = ModelSpec(id="tiny-decoder", factory="tests.fixtures.plugin_tp_models:decoder")
    spec = BackendSpec(id="turbine_cpu", compile="turbine_cpu")
    payload = rank_payload(model, InputSpec(samples=1), TP2, [], samples=[0])
    payload.update(tasks=[OPS], ops_backend=spec_to_json(spec))
    run = launch_ranks(RANK_TASKS, payload, world=2, timeout=400, folder=tmp_path / "ranks")
    assert run.ok, run.describe()
    rows = {r["op"]: r for r in run.results[0].value[OPS]["rows"]}
    reduce = rows["_c10d_functional.all_reduce.default"]
    assert reduce["status"] == "unsupported" and reduce["ranks"] == [0, 1]
    f = collective_finding(reduce, spec, "tiny-decoder", TP2, parse_options("ops", {}), tmp_path, tmp_path)
    assert (f.kind, f.stage, f.parallel) == ("unsupported_op", "compile", "tp2")
    assert f.repro is not None and f.repro.verified, (f.repro and f.repro.note, f.details.get("repro_output_tail"))


def _numerics_tp_cell(tmp_path: Path, backend: dict[str, Any]) -> Any:
    """The numerics mode on the test decoder with `parallel: {tp: 2}` on `backend` (single rank in this process)."""
    import dataclasses
    import time

    from ci_runner.backends import resolve_backend
    from ci_runner.config import load_matrix_text
    from ci_runner.matrix import expand
    from ci_runner.modes import ModeContext
    from ci_runner.modes.numerics.mode import run
    from tests.fixtures.matrices import REFERENCES, matrix_text

    text = matrix_text(models=[{"id": "tiny-decoder", "factory": "tests.fixtures.plugin_tp_models:decoder",
                                "parallel": {"tp": 2}}], backends=[backend],
                       modes=["numerics"], inputs={"samples": 2}, references=REFERENCES)
    cell = dataclasses.replace(expand(load_matrix_text(text))[0], options={"numerics": {"isolate": False}})
    ctx = ModeContext(cell=cell, cell_dir=tmp_path, backend=resolve_backend(cell.backend),
                      deadline=time.monotonic() + 600)
    return run(ctx)


@pytest.mark.slow
def test_the_numerics_mode_runs_the_ranks_beside_its_single_rank_part(tmp_path: Path) -> None:
    """A TP cell through the numerics mode (test decoder, aot_eager, the single rank in this process): the ranks
    start with the mode, so the cell waits only for the part of them left after its single-rank comparison (before,
    it waited for all of them after it), and the TP result is still the comparison's: pass, every call compared."""
    res = _numerics_tp_cell(tmp_path, {"id": "aot_eager", "compile": "aot_eager"})
    tp = res.data["parallel"]
    assert (res.status, tp["status"], tp["ranks"]) == ("pass", "pass", "all ranks finished"), res.reason
    assert not res.findings and len(tp["layers"]) >= 15 and all("metrics" in r for r in tp["layers"])
    assert tp["waited_s"] < tp["seconds"] - 1.0, tp  # the ranks ran while the single-rank part did


@pytest.mark.slow
def test_the_numerics_mode_gives_a_tp_divergence_its_verified_repro(tmp_path: Path) -> None:
    """A TP cell through the numerics mode on sim-tp-shard: the ranks store the diverging q_proj's shards and inputs in
    the cell's `numerics/parallel/` (the mode's payload says where), and the finding carries the repro, verified,
    no `repro_note`."""
    res = _numerics_tp_cell(tmp_path, {"id": "sim-tp-shard", "compile": "sim-tp-shard"})
    tp = [f for f in res.findings if f.parallel == "tp2"]
    assert [(f.kind, f.module) for f in tp] == [("divergence", "layers.0.self_attn.q_proj")], res.reason
    f = tp[0]
    assert f.repro is not None and f.repro.verified, (f.repro, f.details.get("repro_note"))
    assert f.repro.path == "numerics/parallel/layers.0.self_attn.q_proj/repro.py" and "repro_note" not in f.details
    assert (tmp_path / "numerics/parallel/layers.0.self_attn.q_proj/rank1.pt").is_file()


def test_the_sharded_graphs_own_ops_are_probed_like_the_single_ranks(launch: tuple[RankRun, Path], tmp_path: Path
                                                                     ) -> None:
    """The vocabulary-sharded embedding (rowwise, DTensor's MaskPartial) puts a mask and `aten.index_put` into the
    sharded graph, which the single-rank model has not: the ops task's inventory of rank 0's graphs, the signatures
    the single-rank inventory lacks probed by the mode's own prober on sim-subset's default allowlist (no
    index_put): one `unsupported_op` on aten.index_put.default carrying tp2, with a verified one-op repro."""
    import time

    from ci_runner.backends import resolve_backend
    from ci_runner.config import load_matrix_text
    from ci_runner.matrix import expand
    from ci_runner.modes import ModeContext
    from ci_runner.modes.ops.mode import _prober, take_model_inventory
    from ci_runner.modes.ops.parallel import sharded_ops
    from ci_runner.modes.ops.signature import Inventory
    from tests.fixtures.matrices import REFERENCES, matrix_text

    text = matrix_text(models=[{"id": "tiny-decoder", "factory": "tests.fixtures.plugin_tp_models:decoder",
                                "parallel": {"tp": 2}}], backends=[{"id": "sim-subset", "compile": "sim-subset"}],
                       modes=["ops"], inputs={"samples": 1}, references=REFERENCES)
    cell = expand(load_matrix_text(text))[0]
    ctx = ModeContext(cell=cell, cell_dir=tmp_path, backend=resolve_backend(cell.backend),
                      deadline=time.monotonic() + 300)
    single = take_model_inventory(ctx, "aten")
    assert "aten.index_put.default" not in single.op_names()
    sharded = Inventory.from_dict(launch[0].results[0].value[OPS]["ops"])
    assert not any(op.startswith("_c10d_functional.") for op in sharded.op_names())
    found, row = sharded_ops(sharded, single, _prober(ctx, parse_options("ops", {})), TP2,
                             ctx.artifact_dir("ops") / "parallel" / "ops", set())
    assert 0 < row["new_count"] < row["signatures"], row
    assert [(f.kind, f.op, f.parallel) for f in found] == [("unsupported_op", "aten.index_put.default", "tp2")], row
    f = found[0]
    assert f.error_type == "SimCompilerError" and "unsupported operator aten.index_put.default" in f.message
    assert f.repro is not None and f.repro.verified, f.repro
    assert f.repro.path.startswith("ops/parallel/ops/") and (tmp_path / f.repro.path).is_file()
    # an op the single rank already failed on is not reported again
    assert sharded_ops(sharded, single, _prober(ctx, parse_options("ops", {})), TP2, tmp_path / "again",
                       {f.fingerprint})[0] == []
