"""The culprit search inside a layer finding (issue 16): real tiny models, real backends, isolated children.

Each test runs the layers mode the way a cell worker does (`cellrun.run_cell_inprocess`); the culprit search,
its children, journal and repro verification are all real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from ci_runner.run.cellrun import run_cell_inprocess
from ci_runner.config import load_matrix_text
from ci_runner.procs.isolate import open_entry
from ci_runner.matrix import expand
from ci_runner.results.model import JOURNAL_NAME
from ci_runner.results.model import CellResult, ModeResult, validate
from tests.fixtures.layers_checks import check_attention_found_in_each_layer
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu.default"

pytestmark = pytest.mark.slow  # probing children and compiles: tens of seconds each on 2 cores

_DECODER = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 64}


def _matrix(layers: int, options: str) -> str:
    """The test matrix (`options`: the `options.layers` mapping's YAML body)."""
    mixtral = {**_DECODER, "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2}
    return matrix_text(
        modes=["layers"], timeout=900, inputs={"batch": 1, "seq_len": 8, "samples": 1, "seed": 0},
        options={"layers": yaml.safe_load("{" + options + "}")},
        models=[{"id": "tiny-llama", "config": "llama", "overrides": {**_DECODER, "num_hidden_layers": layers}},
                {"id": "tiny-mixtral", "config": "mixtral", "overrides": mixtral},
                {"id": "rotary", "factory": "tests.fixtures.plugin_layers_models:rotary_net"}],
        backends=[{"id": "pair", "compile": "tests.fixtures.plugin_layers_pair:pair_backend"},
                  {"id": "refuse", "compile": "tests.fixtures.plugin_layers_refuse:refuse_backend"},
                  *({"id": f"sim-{s}", "compile": f"sim-{s}"} for s in ("crash", "abort", "hang")),
                  {"id": "simdev", "device": "simdev"},
                  {"id": "turbine", "compile": "turbine_cpu"}],  # registered by iree-turbine (entry point)
    )


_Run = tuple[ModeResult, CellResult, Path]


@pytest.fixture(scope="module")
def run_cell(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., _Run]:
    """`run_cell(model, backend, layers=1, options=...)`: the cell's layers mode, run once per module and shared
    by every test that looks at the same cell."""
    done: dict[tuple[str, str, int, str], _Run] = {}

    def run(model: str, backend: str, *, layers: int = 1, options: str = "probe_timeout: 60") -> _Run:
        key = (model, backend, layers, options)
        if key not in done:
            tmp_path = tmp_path_factory.mktemp(f"{model}-{backend}")
            matrix = load_matrix_text(_matrix(layers, options), path=str(tmp_path / "matrix.yaml"))
            cell = next(c for c in expand(matrix) if c.model.id == model and c.backend.id == backend)
            cdir = tmp_path / "cells" / cell.id
            result = run_cell_inprocess(cell, cdir, modes=("layers",), deadline=time.monotonic() + cell.timeout)
            validate(result.to_dict(), "cell.schema.json", source="culprit test")
            done[key] = (result.modes["layers"], result, cdir)
        return done[key]

    return run


def _culprits(mode: ModeResult) -> dict[str, dict[str, Any]]:
    return {str(f.module): f.details["culprit"] for f in mode.findings}


def _first_probe(cdir: Path, culprit: dict[str, Any]) -> list[int]:
    """The node range the culprit search probed first (its `probes.jsonl`, in probe order)."""
    from ci_runner.failures.outcome import read_outcomes

    first = next(iter(read_outcomes(cdir / Path(culprit["repro"]["path"]).parent / "probes.jsonl")))
    return [int(x) for x in first.split(":")]


def _by_hand(cdir: Path, culprit: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """The culprit repro from its folder, in a clean interpreter (deepview-ci only as the sim plugin)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = str(ROOT)
    rdir = cdir / Path(culprit["repro"]["path"]).parent
    return subprocess.run([sys.executable, "repro.py"], cwd=rdir, env=env, capture_output=True, text=True, timeout=300)


def test_sim_crash_names_the_attention_op_with_real_shapes(run_cell: Callable[..., _Run]) -> None:
    mode, _, cdir = run_cell("tiny-llama", "sim-crash", layers=2)
    assert mode.status == "fail", mode.reason
    culprits = _culprits(mode)
    assert list(culprits) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for c in culprits.values():
        assert c["found"] and c["kind"] == "single" and c["ops"] == [SDPA], c
        assert c["level"] == "aot" and c["status"] == "fail" and c["stage"] == "run"
        # real shapes and strides of the layer's own intermediates (batch 1, 2 heads, 8 tokens, head dim 8)
        assert c["inputs"][0][:3] == ["float32[1, 2, 8, 8] stride=[128, 8, 16, 1]",
                                      "float32[1, 1, 8, 8]", "float32[1, 1, 8, 8]"], c["inputs"]
        assert "sdpa_attention.py" in (c["sources"][0] or "")
        assert c["repro"]["verified"], c["repro"]
        assert _first_probe(cdir, c) == c["node_range"]  # the op the layer's error names is probed first
    # one cause group (same class, error signature and inputs): one search, its answer carried by the twin
    assert culprits["model.layers.1.self_attn"]["shared_with"] == "model.layers.0.self_attn"
    assert culprits["model.layers.1.self_attn"]["repro"] == culprits["model.layers.0.self_attn"]["repro"]
    assert not (cdir / "layers" / "repro" / "model.layers.1.self_attn" / "culprit").exists()
    rdir = cdir / Path(culprits["model.layers.0.self_attn"]["repro"]["path"]).parent
    assert {p.name for p in rdir.iterdir()} >= {"graph.py", "inputs.safetensors", "repro.py"}
    proc = _by_hand(cdir, culprits["model.layers.0.self_attn"])
    assert proc.returncode == 1 and "[sim-crash]" in proc.stderr, proc.stdout + proc.stderr
    assert open_entry(cdir / JOURNAL_NAME, "culprit") is None


def test_the_layer_search_beneath_names_each_attention_module_and_nothing_else(run_cell: Callable[..., _Run]) -> None:
    """The same cell as above: with the culprit search on, the layer search finds what it finds without it
    (test_layers.py checks tiny Granite with it off)."""
    mode, _, _ = run_cell("tiny-llama", "sim-crash", layers=2)
    check_attention_found_in_each_layer(mode, "LlamaAttention")


def test_fusion_only_gives_the_smallest_range_holding_both_ops(run_cell: Callable[..., _Run]) -> None:
    """A tiny module where `aten.mm` (its projection) and `aten.neg` (its rotate-half) meet: every op passes
    alone, the module fails; the range search must find the mm..neg range."""
    mode, _, _ = run_cell("rotary", "pair")
    assert [str(f.module) for f in mode.findings] == ["rot"], mode.findings
    c = _culprits(mode)["rot"]
    assert c["found"] and c["kind"] == "range", c
    assert "no single op fails alone" in c["note"]
    ops = c["node_ops"]
    assert "aten.mm.default" in ops and "aten.neg.default" in ops
    # smallest: it starts at an mm and ends at a neg (or the other way round), with neither end removable
    assert {ops[0], ops[-1]} == {"aten.mm.default", "aten.neg.default"}, ops
    assert c["error_type"] == "IndexError" and c["repro"]["verified"], c["repro"]


def test_every_op_that_fails_alone_is_named(run_cell: Callable[..., _Run]) -> None:
    """Issue 38: a module failing on two ops (the backend names only the first it meets) names both; the repro is
    the first's, and the report says both."""
    from ci_runner.report.view import culprit_text

    mode, _, _ = run_cell("rotary", "refuse")
    assert [str(f.module) for f in mode.findings] == ["rot"], mode.findings
    c = _culprits(mode)["rot"]
    assert c["found"] and c["kind"] == "single", c
    failing = [r["op"] for r in c["failing_ops"]]
    assert sorted(failing) == ["aten.cat.default", "aten.neg.default"], c["failing_ops"]
    assert c["ops"] == failing[:1] and c["repro"]["verified"], c
    assert all(r["status"] == "fail" and "unsupported operator" in r["message"] for r in c["failing_ops"])
    assert culprit_text(mode.findings[0]) == f"{failing[0]}, {failing[1]} each fail alone"


def test_eager_device_names_the_executing_submodule(run_cell: Callable[..., _Run]) -> None:
    """The layer search on simdev (moved from test_layers.py, which ran the same cell with the culprit search
    off): the same findings with it on, on the run the culprit test below reads."""
    mode, _, _ = run_cell("tiny-llama", "simdev")
    assert mode.status == "fail", mode.reason
    # simdev lacks rsqrt (every RMSNorm) and _softmax (attention)
    assert [str(f.module) for f in mode.findings] == ["model.layers.0.input_layernorm", "model.layers.0.self_attn",
                                                      "model.layers.0.post_attention_layernorm", "model.norm"]
    whole = mode.data["whole_model"]
    assert whole["executing"] == "model.layers.0.input_layernorm"  # where the whole model's run died
    by = {f.module: f for f in mode.findings}
    assert "aten::rsqrt" in by["model.norm"].message and by["model.norm"].details["executing"] == "model.norm"
    assert "aten::_softmax" in by["model.layers.0.self_attn"].message
    assert all(f.repro is not None and f.repro.verified for f in mode.findings), [f.repro for f in mode.findings]


def test_eager_device_names_rsqrt_in_norms_and_softmax_in_attention(run_cell: Callable[..., _Run]) -> None:
    mode, _, cdir = run_cell("tiny-llama", "simdev")
    culprits = _culprits(mode)
    assert culprits["model.layers.0.input_layernorm"]["ops"] == ["aten.rsqrt.default"]
    assert culprits["model.norm"]["ops"] == ["aten.rsqrt.default"]
    # the attention's math path (what an eager device runs): _safe_softmax, which runs _softmax on the device
    attn = culprits["model.layers.0.self_attn"]
    assert attn["ops"] == ["aten._safe_softmax.default"] and "aten::_softmax" in attn["message"], attn
    assert _first_probe(cdir, attn) == attn["node_range"]  # the layer's error names _softmax: it goes first
    assert all(c["repro"]["verified"] for c in culprits.values()), culprits


@pytest.mark.parametrize("backend, status, probe_timeout", [("sim-abort", "crashed", 60), ("sim-hang", "timeout", 8)])
def test_hard_fault_culprit_is_found_and_the_search_goes_on(tmp_path: Path, backend: str, status: str,
                                                            probe_timeout: int) -> None:
    """The engine alone, without hints: the probes walk the graph in order, every op before the attention
    passes in the first child, the attention kills (or hangs) it; a fresh child keeps those outcomes."""
    from ci_runner.config import spec_to_json
    from ci_runner.modes.layers.culprit import find_culprit
    from ci_runner.procs.limits import HangLimits
    from ci_runner.failures.outcome import read_outcomes
    from ci_runner.modes.layers.search import scan_model, write_root_call
    from ci_runner.models.load import build_inputs, load_model

    matrix = load_matrix_text(_matrix(1, "probe_timeout: 60"), path=str(tmp_path / "matrix.yaml"))
    cell = next(c for c in expand(matrix) if c.model.id == "tiny-llama" and c.backend.id == backend)
    loaded = load_model(cell.model, seed=0)
    kwargs = build_inputs(loaded, cell.inputs, sample=0)
    layers_dir = tmp_path / "layers"
    layers_dir.mkdir()
    write_root_call(layers_dir, scan_model(loaded.module, kwargs), kwargs)
    journal = tmp_path / "journal.log"
    r = find_culprit(model=spec_to_json(cell.model), backend=spec_to_json(cell.backend), seed=0,
                     layers_dir=layers_dir, module="model.layers.0.self_attn", out_dir=tmp_path / "culprit",
                     journal=journal, limits=HangLimits(first=probe_timeout, window=30.0, factor=4.0),
                     startup_timeout=60, budget_s=300)
    assert r.found and r.kind == "single" and r.ops == [SDPA] and r.status == status, r
    assert r.restarts == 1 and r.probes > 10  # the passing probes before the fault were kept, not redone
    known = read_outcomes(tmp_path / "culprit" / "probes.jsonl")
    assert [k for k, o in known.items() if o.status != "pass"] == [f"{r.node_range[0]}:{r.node_range[1]}"]  # type: ignore[index]
    assert open_entry(journal, "culprit") is None
    assert (tmp_path / "culprit" / "graph.py").exists() and (tmp_path / "culprit" / "inputs.safetensors").exists()


def test_iree_turbine_names_histc_in_mixtral_experts(run_cell: Callable[..., _Run]) -> None:
    pytest.importorskip("iree.turbine")
    mode, _, _ = run_cell("tiny-mixtral", "turbine")
    culprits = _culprits(mode)
    experts = [m for m in culprits if m.endswith("mlp.experts")]
    assert experts, list(culprits)
    for m in experts:
        assert culprits[m]["ops"] == ["aten.histc.default"], culprits[m]
        # IREE stops at the first op it cannot lower; the experts also fail on the grouped matmul (issue 38)
        # (both grouped matmuls, up and down projection, fail: one node each)
        failing = [r["op"] for r in culprits[m]["failing_ops"]]
        assert list(dict.fromkeys(failing)) == ["aten.histc.default", "transformers.grouped_mm_fallback.default"]
        assert culprits[m]["repro"]["verified"], culprits[m]["repro"]
