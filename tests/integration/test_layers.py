"""Mode `layers` end to end: real tiny models, real (sim and plugin) backends, isolated children, verified repros.

Each test runs the mode the way a cell worker does (`cellrun.run_cell_inprocess`), so the probing children,
the crash journal, the restarts and the repro verification are all real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ci_runner.run.cellrun import run_cell_inprocess
from ci_runner.config import load_matrix_text
from ci_runner.procs.isolate import open_entry
from ci_runner.matrix import expand
from ci_runner.results.model import JOURNAL_NAME
from ci_runner.results.model import CellResult, ModeResult, fingerprint, validate
from tests.fixtures.layers_checks import check_attention_found_in_each_layer
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT


pytestmark = pytest.mark.slow  # each test starts probing children and compiles: tens of seconds on 2 cores

_DECODER = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 64}


def _matrix(layers: int, options: str) -> str:
    """The test matrix (`options`: the `options.layers` mapping's YAML body); the culprit search inside each finding
    is off unless asked for (tests/integration/test_culprit.py covers it): these tests are about the layer search
    itself, and stay fast."""
    if "culprit" not in options:
        options = f"{options}, culprit: false"
    dec = {**_DECODER, "num_hidden_layers": layers}
    return matrix_text(
        modes=["layers"], timeout=900, inputs={"batch": 1, "seq_len": 8, "samples": 1, "seed": 0},
        options={"layers": yaml.safe_load("{" + options + "}")},
        models=[{"id": "tiny-llama", "config": "llama", "overrides": dec},
                {"id": "tiny-granite", "config": "granite", "overrides": dec},
                {"id": "gated", "factory": "tests.fixtures.plugin_layers_models:gated"},
                {"id": "disabled", "factory": "tests.fixtures.plugin_layers_models:disabled"}],
        backends=[{"id": "pair", "compile": "tests.fixtures.plugin_layers_pair:pair_backend"},
                {"id": "fault-raise", "compile": "tests.fixtures.plugin_layers_fault:raise_backend"},
                *({"id": f"sim-{s}", "compile": f"sim-{s}"} for s in ("crash", "abort", "segv", "hang")),
                {"id": "sim-slow", "compile": "sim-slow", "backend_options": {"seconds": 5}},
                {"id": "simdev", "device": "simdev"}, {"id": "aot", "compile": "aot_eager"}],
    )


def _run(tmp_path: Path, model: str, backend: str, *, layers: int = 1,
         options: str = "probe_timeout: 60") -> tuple[ModeResult, CellResult, Path]:
    matrix = load_matrix_text(_matrix(layers, options), path=str(tmp_path / "matrix.yaml"))
    cell = next(c for c in expand(matrix) if c.model.id == model and c.backend.id == backend)
    cdir = tmp_path / "cells" / cell.id
    result = run_cell_inprocess(cell, cdir, modes=("layers",), deadline=time.monotonic() + cell.timeout)
    validate(result.to_dict(), "cell.schema.json", source="layers test")
    return result.modes["layers"], result, cdir


def _modules(mode: ModeResult) -> list[str]:
    return [f.module for f in mode.findings if f.module is not None]


def _rows(mode: ModeResult) -> dict[str, dict[str, Any]]:
    return {r["module"]: r for r in mode.data["candidates"]}


def _run_by_hand(repro_dir: Path, plugin_root: Path | None) -> subprocess.CompletedProcess[str]:
    """`python repro.py` from its folder, with torch and the backend's plugin only (no deepview-ci unless it is the plugin)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONSAFEPATH"] = "1"  # nothing from the current folder beyond the script's own
    if plugin_root is not None:
        env["PYTHONPATH"] = str(plugin_root)
    return subprocess.run([sys.executable, "repro.py"], cwd=repro_dir, env=env, capture_output=True, text=True,
                          timeout=300)


# --------------------------------------------------------------------------- ground truth of the issue

def test_two_operator_backend_names_self_attn_while_each_child_compiles(tmp_path: Path) -> None:
    """A backend that fails only when aten.mm and aten.neg share a graph: no single op is to blame."""
    mode, _, cdir = _run(tmp_path, "tiny-llama", "pair", layers=2)
    assert mode.status == "fail", mode.reason
    assert _modules(mode) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    rows = _rows(mode)
    assert rows["<root>"]["status"] == "fail" and rows["<root>"]["stage"] == "compile"
    for layer in (0, 1):
        for child in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert rows[f"model.layers.{layer}.self_attn.{child}"]["status"] == "pass"
        assert rows[f"model.layers.{layer}.mlp"]["status"] == "pass"
        assert f"model.layers.{layer}.mlp.up_proj" not in rows  # a passing module's subtree is never tried
    f = mode.findings[0]
    assert f.kind == "layer_failure" and f.stage == "compile" and f.error_type == "IndexError"
    assert f.module_class == "LlamaAttention"
    assert f.details["path"] == ["<root>", "model", "model.layers.0", "model.layers.0.self_attn"]
    # shown, not assumed: the own-code probe (children run eagerly) passes, so the failure needs them together
    assert "each of its 4 child modules passes alone and its own code passes with them run eagerly" in f.message
    assert f.details["own_code"] == "needs_children"
    assert f.fingerprint == fingerprint("layer_failure", "pair", "tiny-llama", "model.layers.0.self_attn")
    # a verified repro: the exported submodule, its inputs and a script
    assert f.repro is not None and f.repro.verified, f.repro
    rdir = cdir / Path(f.repro.path).parent
    assert {p.name for p in rdir.iterdir()} >= {"module.pt2", "inputs.safetensors", "repro.py"}
    assert "model source" not in (f.repro.note or "") or "needs no model source" in (f.repro.note or "")
    # by hand, from its folder: torch and the plugin only (a copy of the plugin alone; deepview-ci not importable)
    plugin_root = tmp_path / "plugin_only"
    (plugin_root / "tests" / "fixtures").mkdir(parents=True)
    (plugin_root / "tests" / "__init__.py").write_text("")
    (plugin_root / "tests" / "fixtures" / "__init__.py").write_text("")
    (plugin_root / "tests" / "fixtures" / "plugin_layers_pair.py").write_text(
        (ROOT / "tests" / "fixtures" / "plugin_layers_pair.py").read_text())
    proc = _run_by_hand(rdir, plugin_root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REPRO FAILED" in proc.stderr and "IndexError" in proc.stderr
    # the journal is balanced: nothing left open
    assert open_entry(cdir / JOURNAL_NAME, "module") is None


# ----------------------------------------------------------------- sim-crash on Granite (Llama: test_culprit.py)

def test_sim_crash_names_each_attention_module_and_nothing_else(tmp_path: Path) -> None:
    """Granite here, with the culprit search off; the same search on tiny Llama is checked on test_culprit.py's
    run of that cell (the culprit search on: the layer search beneath it must find the same)."""
    mode, _, cdir = _run(tmp_path, "tiny-granite", "sim-crash", layers=2)
    check_attention_found_in_each_layer(mode, "GraniteAttention")
    rdir = cdir / Path(mode.findings[1].repro.path).parent  # type: ignore[union-attr]
    proc = _run_by_hand(rdir, ROOT)  # the sim backends live in ci_runner: that is the plugin here
    assert proc.returncode == 1 and "[sim-crash]" in proc.stderr, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- hard faults

# A crash by one signal and a hang. (A segfault is the same path as the abort, a child killed by a signal, but for
# the signal's name: test_layers_isolation.py checks SIGSEGV in the layers mode, test_ops_isolation.py both.)
@pytest.mark.parametrize("backend, status, error_type, probe_timeout", [
    ("sim-abort", "crashed", "SIGABRT", 60),
    ("sim-hang", "timeout", "Timeout", 6),
])
def test_hard_faults_keep_the_diagnosis_and_the_run_goes_on(tmp_path: Path, backend: str, status: str,
                                                            error_type: str, probe_timeout: int) -> None:
    options = f"probe_timeout: {probe_timeout}"
    if status == "timeout":  # the hanging repro shows its hang by outlasting 8 s (the suite's repro checks fork a
        options += ", verify_timeout: 8"  # warm child: no start to wait for); the default, probe_timeout + 30 s,
        # would sleep 36 s for the same verdict
    mode, cell, cdir = _run(tmp_path, "tiny-llama", backend, options=options)
    assert cell.status == "fail" and mode.status == "fail", mode.reason
    assert _modules(mode) == ["model.layers.0.self_attn"]
    f = mode.findings[0]
    assert f.details["status"] == status and f.error_type == error_type and f.stage == "run"
    if status == "timeout":  # measured: sim-hang sleeps, its session's CPU time and output stopped (issue 44)
        assert "hung: no progress for 3 s after 6 s" in f.details["message_full"], f.details["message_full"]
    search = mode.data["search"]
    assert search["complete"] and search["restarts"] == 2  # root, self_attn: one child each
    rows = _rows(mode)
    assert [m for m, r in rows.items() if r["status"] == status] == ["<root>", "model.layers.0.self_attn"]
    # `model` and its one layer each wrap nearly all of the model: looked through, never run alone
    assert rows["model"]["status"] == rows["model.layers.0"]["status"] == "skipped"
    assert rows["model.layers.0.self_attn.q_proj"]["status"] == "pass"  # probed after the crashes
    assert open_entry(cdir / JOURNAL_NAME, "module") is None
    assert f.repro is not None and f.repro.verified, f.repro  # the repro dies (or hangs) the same way


def test_a_slow_compile_past_probe_timeout_is_a_figure_not_a_hang(tmp_path: Path) -> None:
    """sim-slow spends 5 CPU seconds compiling each graph, past probe_timeout (2 s): the probe keeps using CPU, so it
    is no hang; it runs to its end (the whole model's probe has no second limit: nothing was measured before it)."""
    mode, cell, _ = _run(tmp_path, "tiny-llama", "sim-slow", options="probe_timeout: 2")
    assert mode.status == "pass" and mode.findings == [] and cell.status == "pass", mode.reason
    assert mode.data["search"]["probed"] == 1 and mode.data["search"]["restarts"] == 0
    assert mode.data["search"]["slow"]["<root>"] >= 5.0, mode.data["search"]
    # the cost in compiles: the whole model's probe in its child, counted for the mode (data.compiles)
    compiled = mode.data["compiles"]
    assert compiled["forward"]["graphs"] >= 1 and compiled["forward"]["compile_s"] >= 5.0, compiled
    assert compiled["total"] == compiled["forward"]


# --------------------------------------------------------------------------- eager device
# simdev on tiny Llama: tests/integration/test_culprit.py::test_eager_device_names_the_executing_submodule, on the
# run its culprit tests read (the culprit search on: the layer search beneath it must find the same).


# --------------------------------------------------------------------------- export fallback, passing backend

def test_export_failure_falls_back_to_a_model_source_repro(tmp_path: Path) -> None:
    mode, _, cdir = _run(tmp_path, "gated", "fault-raise")
    assert _modules(mode) == ["gate"]
    f = mode.findings[0]
    assert f.repro is not None and f.repro.verified, f.repro
    assert "torch.export failed" in (f.repro.note or "") and "fallback" in (f.repro.note or "")
    rdir = cdir / Path(f.repro.path).parent
    assert not (rdir / "module.pt2").exists() and (rdir / "weights.safetensors").exists()
    proc = _run_by_hand(rdir, ROOT)
    assert proc.returncode == 1 and "fault-plugin" in proc.stderr, proc.stdout + proc.stderr


def test_a_backend_that_runs_the_model_passes_after_one_probe(tmp_path: Path) -> None:
    mode, _, cdir = _run(tmp_path, "tiny-llama", "aot")
    assert mode.status == "pass" and mode.findings == []
    assert mode.data["search"]["probed"] == 1 and mode.data["whole_model"]["status"] == "pass"
    assert not (cdir / "layers" / "repro").exists()


def test_a_model_the_backend_never_ran_is_inconclusive_not_pass(tmp_path: Path) -> None:
    """Issue 13: the model raised nothing on the backend, but Dynamo never handed it a graph: not a pass."""
    mode, cell, _ = _run(tmp_path, "disabled", "aot")
    assert mode.status == "inconclusive" and mode.findings == [], (mode.status, mode.reason)
    assert cell.status == "inconclusive", cell.status
    assert "1 module probe(s) the backend never ran" in (mode.reason or "") and "<root>" in mode.reason, mode.reason
    assert mode.data["backend_ran"]["inconclusive"] == 1 and mode.data["backend_ran"]["probes_executed"] == 0
    row = _rows(mode)["<root>"]
    assert row["status"] == "inconclusive" and "no graph" in row["message"], row
