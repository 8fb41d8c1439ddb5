"""The layers mode's crash safety on a small factory model (no transformers model): each crash is a fresh child.

A backend that segfaults or hangs when attention runs: the diagnosis survives, each crash costs one fresh
probing child, the search goes on to the end and names both attention modules.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from ci_runner.run.cellrun import run_cell_inprocess
from ci_runner.config import load_matrix_text
from ci_runner.errors import ConfigError
from ci_runner.procs.isolate import open_entry
from ci_runner.failures.outcome import read_outcomes
from ci_runner.matrix import expand
from ci_runner.results.model import JOURNAL_NAME
from ci_runner.results.model import ModeResult
from tests.fixtures.matrices import matrix_text

def _matrix(options: str) -> str:
    """The test matrix (`options`: the `options.layers` mapping's YAML body)."""
    return matrix_text(
        modes=["layers"], timeout=600, inputs={"batch": 1, "seq_len": 8, "samples": 1, "seed": 0},
        options={"layers": yaml.safe_load("{" + options + "}")},
        models=[{"id": "net", "factory": "tests.fixtures.plugin_layers_models:attn_net"}],
        backends=[{"id": "segv", "compile": "tests.fixtures.plugin_layers_fault:segv_backend"},
                  {"id": "hang", "compile": "tests.fixtures.plugin_layers_fault:hang_backend"},
                  {"id": "raises", "compile": "tests.fixtures.plugin_layers_fault:raise_backend"}],
    )


def _run(tmp_path: Path, backend: str, options: str) -> tuple[ModeResult, Path]:
    # the culprit search is covered by tests/integration/test_culprit.py: off here, to keep these tests fast
    matrix = load_matrix_text(_matrix(f"{options}, culprit: false"), path=str(tmp_path / "m.yaml"))
    cell = next(c for c in expand(matrix) if c.backend.id == backend)
    cdir = tmp_path / cell.id
    result = run_cell_inprocess(cell, cdir, modes=("layers",), deadline=time.monotonic() + 600)
    return result.modes["layers"], cdir


@pytest.mark.slow
def test_segfaults_cost_one_child_each_and_the_search_finishes(tmp_path: Path) -> None:
    mode, cdir = _run(tmp_path, "segv", "probe_timeout: 60, repro: false")
    assert mode.status == "fail", mode.reason
    assert [f.module for f in mode.findings] == ["blocks.0.attn", "blocks.1.attn"]
    for f in mode.findings:
        assert f.details["status"] == "crashed" and f.error_type == "SIGSEGV" and f.module_class == "Attn"
        assert f.details["children"] == {f"{f.module}.{c}": "pass" for c in ("q", "k", "v")}
    search = mode.data["search"]
    # crashed: <root>, blocks.0, blocks.0.attn, blocks.1.attn -> 4 children, each restarted after a crash; the
    # last crash completes the search (blocks.1 is blocks.0's sibling twin: only its attn, where blocks.0 fails,
    # is probed; blocks.1 and the rest of its subtree take blocks.0's outcomes)
    assert search["complete"] and search["restarts"] == 4 and search["children"] == 4
    assert mode.data["search"]["inferred"] >= 1
    known = read_outcomes(cdir / "layers" / "probes.jsonl")
    assert known["head"].status == "pass" and known["head"].calls_tried == 1
    assert mode.data["capture"]["shared"] == {"head": 2}
    assert "blocks.0.mlp.0" not in known  # below a passing module: never tried
    assert open_entry(cdir / JOURNAL_NAME, "module") is None


@pytest.mark.slow
def test_a_hang_is_cut_at_probe_timeout(tmp_path: Path) -> None:
    mode, _ = _run(tmp_path, "hang", "probe_timeout: 3, repro: false")
    assert [f.module for f in mode.findings] == ["blocks.0.attn", "blocks.1.attn"]
    assert {f.details["status"] for f in mode.findings} == {"timeout"}
    assert {f.error_type for f in mode.findings} == {"Timeout"}
    tail = mode.findings[0].details["traceback_tail"]  # faulthandler's dump of the hung stack: in the plugin's code
    assert ("Current thread" in tail or "Timeout" in tail) and "plugin_layers_fault" in tail, tail


@pytest.mark.slow
def test_errors_are_found_in_one_child_with_verified_repros(tmp_path: Path) -> None:
    mode, cdir = _run(tmp_path, "raises", "probe_timeout: 60")
    assert [f.module for f in mode.findings] == ["blocks.0.attn", "blocks.1.attn"]
    assert mode.data["search"]["children"] == 1
    f = mode.findings[0]
    assert f.stage == "run" and f.error_type == "RuntimeError" and "fault-plugin" in f.message
    assert f.repro is not None and f.repro.verified, f.repro
    assert (cdir / "layers" / "repro" / "blocks.0.attn" / "module.pt2").exists()


@pytest.mark.slow
def test_all_calls_probes_every_call_of_a_shared_module(tmp_path: Path) -> None:
    mode, cdir = _run(tmp_path, "raises", "probe_timeout: 60, all_calls: true, repro: false")
    known = read_outcomes(cdir / "layers" / "probes.jsonl")
    assert known["head"].calls_tried == 2
    assert [f.module for f in mode.findings] == ["blocks.0.attn", "blocks.1.attn"]


@pytest.mark.parametrize("options", ["probe_timout: 3"])
def test_unknown_option_is_an_error_at_load_naming_the_fix(tmp_path: Path, options: str) -> None:
    """Options are checked when the matrix loads (`options.parse`), before any cell runs."""
    with pytest.raises(ConfigError) as info:
        _run(tmp_path, "raises", options)
    assert "did you mean 'probe_timeout'" in str(info.value) and "m.yaml:" in str(info.value)
