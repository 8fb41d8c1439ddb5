"""Mode `ops` end to end through the CLI, checked against ground truth computed independently of the mode.

One run (tiny Bamba × sim-subset, a `module:callable` vendor plugin and simdev; tiny Llama × the vendor plugin)
must report every operator each backend lacks that the model uses, and nothing else; each with a verified repro
that fails the same way when run by hand; and the cross-model ranking must count models per op. (That a Llama
passes on sim-subset, no finding, is checked on the bundled example's cell: tests/integration/test_oldtorch_cells.py.)
"""

from __future__ import annotations

from collections.abc import Callable
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ci_runner.config import load_matrix_text
from ci_runner.procs.isolate import run_isolated
from ci_runner.results.model import load_results
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.slow

TWO_SIGNATURES = {"ops": {"max_signatures_per_op": 2}}
MATRIX = matrix_text(
    modes=["ops"], timeout=900, inputs={"batch": 1, "seq_len": 16, "samples": 1, "seed": 0},
    models=[{"id": "tiny-bamba", "config": "bamba",
             "overrides": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 128,
                           "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
                           "mamba_n_groups": 1, "mamba_chunk_size": 16}},
            {"id": "tiny-llama", "config": "llama",
             "overrides": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "vocab_size": 128},
             "options": TWO_SIGNATURES}],
    backends=[{"id": "sim-subset", "compile": "sim-subset", "device": "cpu"},
              {"id": "vendor", "compile": "tests.fixtures.plugin_ops_vendor:compile_fn", "device": "cpu",
               "options": TWO_SIGNATURES},
              {"id": "simdev", "device": "simdev", "options": TWO_SIGNATURES}],
    exclude=[{"model": "tiny-llama", "backend": "simdev"}, {"model": "tiny-llama", "backend": "sim-subset"}],
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("ops-run")
    matrix = out / "matrix.yaml"
    matrix.write_text(MATRIX, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "ci_runner", "run", str(matrix), "--out", str(out / "out"),
                           "--modes", "ops", "--jobs", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return out / "out"


def _cell(run_dir: Path, cell_id: str) -> dict[str, Any]:
    data = json.loads((run_dir / "cells" / cell_id / "result.json").read_text(encoding="utf-8"))
    return data["modes"]["ops"]


def _finding_ops(mode: dict[str, Any]) -> set[str]:
    return {f["op"] for f in mode["findings"]}


def _real_model(model_id: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    from ci_runner.models.load import build_inputs, load_model

    matrix = load_matrix_text(MATRIX)
    loaded = load_model(matrix.model(model_id), seed=0)
    return loaded.module, build_inputs(loaded, matrix.inputs, sample=0)


_AOT_OPS: dict[str, set[str]] = {}  # model id -> its ground truth, computed once per module (tiny Bamba: two tests)


def _aot_graph_ops(model_id: str, *, reset: Callable[[], None]) -> set[str]:
    """Every op overload an aot_autograd backend receives when torch.compile compiles the real CPU model."""
    if model_id not in _AOT_OPS:
        _AOT_OPS[model_id] = _compile_and_record(model_id, reset)
    return set(_AOT_OPS[model_id])


def _compile_and_record(model_id: str, reset: Callable[[], None]) -> set[str]:
    from torch._dynamo.backends.common import aot_autograd

    model, kwargs = _real_model(model_id)
    seen: set[str] = set()

    def record(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.update(str(n.target) for n in gm.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
        return gm

    reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=record), dynamic=False)(**kwargs)
    reset()
    return seen


def test_sim_subset_reports_exactly_the_ops_outside_its_allowlist(run_dir: Path, fresh_dynamo: Callable[[], None]) -> None:
    from ci_runner.sim import TRANSFORMER_OPS, expand_patterns, op_matches

    allow = expand_patterns(TRANSFORMER_OPS)
    truth = {op for op in _aot_graph_ops("tiny-bamba", reset=fresh_dynamo) if not op_matches(op, allow)}
    assert truth  # tiny Bamba's state-space mixer needs ops a transformer-only compiler lacks
    mode = _cell(run_dir, "tiny-bamba@sim-subset")
    assert mode["status"] == "fail"
    assert _finding_ops(mode) == truth
    assert {f["kind"] for f in mode["findings"]} == {"unsupported_op"}
    assert {f["stage"] for f in mode["findings"]} == {"compile"}
    assert all(f["error_type"] == "SimCompilerError" and "unsupported operator " + f["op"] in f["message"]
               for f in mode["findings"])
    # the inventory summary is there, bounded, and names owners
    inv = mode["data"]["inventory"]
    assert inv["level"] == "aten" and inv["distinct_ops"] >= len(truth) and inv["distinct_signatures"] > 50
    assert any("model.layers.0.mamba" in o["modules"] for o in inv["ops"])
    assert mode["data"]["probe_counts"]["total"] > 100


def test_vendor_plugin_failing_on_first_op_reports_all_of_them(run_dir: Path, fresh_dynamo: Callable[[], None]) -> None:
    from tests.fixtures.plugin_ops_vendor import DENY

    for model_id in ("tiny-bamba", "tiny-llama"):
        truth = {op for op in _aot_graph_ops(model_id, reset=fresh_dynamo) if op.split(".")[1] in DENY}
        mode = _cell(run_dir, f"{model_id}@vendor")
        assert _finding_ops(mode) == truth, model_id
        for f in mode["findings"]:
            assert f["error_type"] == "VendorLoweringError"
            assert f"no kernel for 'aten::{f['op'].split('.')[1]}'" in f["message"]


def _simdev_truth(payload: dict[str, Any]) -> list[str]:
    """In a child process: run the real model on simdev with every kernel, recording each op call with its real
    arguments; then replay each op on simdev with its default kernel set. Those that fail are the truth."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    from ci_runner.sim import simdev

    model, kwargs = _real_model(payload["model"])
    simdev.register(allow=["*"], deny=[])
    model = model.to("simdev")
    kwargs = {k: v.to("simdev") if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    calls: dict[str, tuple[Any, Any, Any]] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            kw = kw or {}
            if str(func) not in calls:
                to_cpu = lambda x: x.detach().to("cpu").clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
                calls[str(func)] = (func, tree_map(to_cpu, list(args)), tree_map(to_cpu, dict(kw)))
            return func(*args, **kw)

    with torch.no_grad(), Record():
        model(**kwargs)
    simdev.register()  # the default kernel set, as the simdev backend has it
    failing = []
    for name, (func, args, kw) in calls.items():
        to_dev = lambda x: x.to("simdev") if isinstance(x, torch.Tensor) else x  # noqa: E731
        if "device" in kw:
            kw["device"] = torch.device("simdev")
        try:
            func(*tree_map(to_dev, args), **tree_map(to_dev, kw))
        except NotImplementedError as exc:
            if "Could not run" in str(exc):
                failing.append(name)
    return sorted(failing)


def test_simdev_eager_device_reports_the_ops_without_kernels(run_dir: Path) -> None:
    res = run_isolated("tests.integration.test_ops_mode:_simdev_truth", {"model": "tiny-bamba"}, timeout=600,
                       env={"PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert res.ok, res.message + res.traceback + res.stderr_tail
    truth = set(res.value)
    assert "aten.rsqrt.default" in truth  # simdev's documented default gap (RMSNorm)
    mode = _cell(run_dir, "tiny-bamba@simdev")
    assert mode["data"]["ir"] == "dispatch"
    assert _finding_ops(mode) == truth
    for f in mode["findings"]:
        assert f["kind"] == "unsupported_op" and f["stage"] == "run" and f["error_type"] == "NotImplementedError"
        assert "with arguments from the 'simdev' backend" in f["message"]


def test_every_failing_op_has_a_verified_repro_that_fails_the_same_way_by_hand(run_dir: Path) -> None:
    findings = [(cid, f) for cid in ("tiny-bamba@sim-subset", "tiny-bamba@vendor", "tiny-bamba@simdev", "tiny-llama@vendor")
                for f in _cell(run_dir, cid)["findings"]]
    assert findings
    for cid, f in findings:
        assert f["repro"]["verified"], (cid, f["op"], f["repro"])
        assert f["details"]["signatures"] and f["fingerprint"]
    # run two of them by hand, from their folder, with only the plugin's folder on the path
    for cid, f in (findings[0], findings[-1]):
        script = run_dir / "cells" / cid / f["repro"]["path"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(ROOT)  # the plugin (tests.fixtures / ci_runner.sim) is not an installed package
        proc = subprocess.run([sys.executable, script.name], cwd=script.parent, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 1
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith("REPRO FAILED") and f["error_type"] in last and f["op"].split(".")[1] in last


def test_ranking_counts_models_blocked_per_op(run_dir: Path) -> None:
    results = load_results(run_dir / "report" / "results.json")
    ranking = {r["op"]: r for r in results.ranking}
    assert ranking["aten.silu.default"]["count"] == 2  # the vendor plugin lacks silu: both models use it
    assert ranking["aten.silu.default"]["models"] == ["tiny-bamba", "tiny-llama"]
    assert ranking["aten.softplus.default"]["count"] == 1
    counts = [r["count"] for r in results.ranking]
    assert counts == sorted(counts, reverse=True)


# --------------------------------------------------------------------------------------------- reach (issue 45)

REACH_MATRIX = matrix_text(
    modes=["ops"], inputs={"batch": 1, "seq_len": 8, "samples": 1, "seed": 0},
    models=[{"id": "cumsum-reaches", "factory": "tests.fixtures.plugin_ops_models:cumsum_reaches"},
            {"id": "cumsum-masked", "factory": "tests.fixtures.plugin_ops_models:cumsum_masked"}],
    backends=[{"id": "wrong-cumsum", "compile": "tests.fixtures.plugin_ops_wrong:make",
               "backend_options": {"op": "aten.cumsum.default", "offset": 1}}],
)


def _whole_model_max_abs(factory: Callable[[], Any]) -> float:
    """Ground truth without the mode: the whole model through plain torch.compile on the wrong backend vs eager."""
    from tests.fixtures.plugin_ops_wrong import make

    model, kwargs = factory()
    with torch.no_grad():
        eager = model(**kwargs)
        compiled = torch.compile(model, backend=make(op="aten.cumsum.default", offset=1))(**kwargs)
    return float((compiled - eager).abs().max())


@pytest.mark.parametrize("model_id,reaches", [("cumsum-reaches", True), ("cumsum-masked", False)])
def test_an_op_mismatch_says_whether_it_reaches_the_models_output(mode_context: Any, fresh_dynamo: Callable[[], None],
                                                                    model_id: str, reaches: bool) -> None:
    from ci_runner.modes.ops.mode import run as run_ops
    from ci_runner.results.model import fingerprint
    from tests.fixtures import plugin_ops_models

    factory = plugin_ops_models.cumsum_reaches if reaches else plugin_ops_models.cumsum_masked
    truth = _whole_model_max_abs(factory)
    assert (truth > 0.5) is reaches, truth  # the wrong cumsum changes this model's output, or leaves it unchanged
    fresh_dynamo()
    res = run_ops(mode_context(REACH_MATRIX, model_id, "wrong-cumsum"))
    assert res.status == "fail", (res.status, res.reason)  # a wrong op is a bug even where the output hides it
    [f] = res.findings
    assert (f.kind, f.op) == ("op_mismatch", "aten.cumsum.default")
    assert f.fingerprint == fingerprint("op_mismatch", "wrong-cumsum", "aten.cumsum.default")  # unchanged by reach
    assert f.details["reaches_output"] is reaches and "reaches_output_note" not in f.details
    assert f.details["output_effect"]["max_abs"] == pytest.approx(truth, abs=1e-5)
    assert f.details["reach"]["calls"] == 1 and f.details["reach"]["differing_calls"] == 1
    words = ("its mismatch reaches the model's output (max abs 1)" if reaches
             else "its mismatch does not reach the model's output for these inputs (max abs 0)")
    assert f.message.endswith("; " + words), f.message
    assert "reach" not in f.details["message_full"] and f.message.startswith(f.details["message_full"])
    assert res.data["reach"]["status"] == "ran" and res.data["reach"]["ops"] == {"aten.cumsum.default": reaches}


def test_reach_output_false_measures_nothing(mode_context: Any, fresh_dynamo: Callable[[], None]) -> None:
    from ci_runner.modes.ops.mode import run as run_ops

    res = run_ops(mode_context(REACH_MATRIX, "cumsum-masked", "wrong-cumsum",
                               options={"ops": {"reach_output": False}}))
    [f] = res.findings
    assert f.kind == "op_mismatch" and "reaches_output" not in f.details and "reach" not in res.data
    assert "reach" not in f.message


def test_a_reach_child_that_crashes_leaves_reaches_output_null_with_why(mode_context: Any, tmp_path: Path) -> None:
    """The backend segfaults on the op inside the model's forward: the child dies, the parent lives and says so."""
    from ci_runner.modes.ops.reach import measure
    from ci_runner.options import OpsOptions
    from ci_runner.results.model import Finding, fingerprint

    matrix = matrix_text(modes=["ops"], inputs={"batch": 1, "seq_len": 8, "samples": 1, "seed": 0},
                         models=[{"id": "cumsum-masked", "factory": "tests.fixtures.plugin_ops_models:cumsum_masked"}],
                         backends=[{"id": "segv", "compile": "sim-segv", "backend_options": {"op": "aten.cumsum.default"}}])
    ctx = mode_context(matrix, "cumsum-masked", "segv")
    f = Finding(kind="op_mismatch", stage="compare", message="OpMismatch: aten.cumsum.default differs from CPU eager",
                fingerprint=fingerprint("op_mismatch", "segv", "aten.cumsum.default"), op="aten.cumsum.default")
    data = measure(ctx, OpsOptions(), [f], tmp_path / "reach")
    assert data is not None and data["status"] == "error" and data["ops"] == {"aten.cumsum.default": None}
    assert f.details["reaches_output"] is None
    assert f.details["reaches_output_note"] == "not measured: the child crashed (SIGSEGV) while measuring this op"
    assert f.message == "OpMismatch: aten.cumsum.default differs from CPU eager"  # nothing measured: no clause
