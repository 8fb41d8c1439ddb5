"""The numerics mode's Model Explorer overlay on a real run (tiny Llama, sim-drift rounding the norms to bfloat16):
the node-data files against our JSON Schema of Model Explorer's documented format, their node ids against the saved
program's graph, the isolated view colouring exactly the norms' nodes over their threshold, the links in
report.html, and, where `ai-edge-model-explorer` is installed, Model Explorer's own PyTorch adapter loading the
program and its node-data classes reading the files.

Model Explorer is found in this interpreter, else in `DEEPVIEW_MODEL_EXPLORER_PATH` (a folder holding its
`model_explorer` package: `pip install --target DIR ai-edge-model-explorer`, so that its server's dependencies stay
out of the test environment; .ci/run does so); its code runs in a child process with that folder after this
interpreter's own packages on `sys.path` (this torch, its adapter)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from ci_runner.backends import resolve_backend
from ci_runner.config import load_matrix_text
from ci_runner.matrix import expand
from ci_runner.results.model import CellResult, ModeResult, Results
from tests.fixtures.matrices import matrix_text
from tests.fixtures.paths import ROOT

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # one numerics run: ~15 CPU s, ~30 s on a loaded machine

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128}
NORMS = {"model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm", "model.norm"}
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "model_explorer_node_data.schema.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def drift(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModeResult, Path]:
    """The numerics mode on tiny-llama@sim-drift, both views, in this process: (result, cell folder)."""
    from ci_runner.modes import ModeContext  # deferred: imports torch
    from ci_runner.modes.numerics.mode import run

    text = matrix_text(inputs={"seq_len": 8, "samples": 2, "seed": 0},
                       models=[{"id": "tiny-llama", "config": "llama", "overrides": TINY}],
                       backends=[{"id": "sim-drift", "compile": "sim-drift",
                                  "backend_options": {"op": "norm", "dtype": "bfloat16"}}],
                       modes=["numerics"], options={"numerics": {"isolate": False, "isolated": "all"}})
    cell = next(iter(expand(load_matrix_text(text))))
    cell_dir = tmp_path_factory.mktemp("overlay") / "run" / "cells" / cell.id
    cell_dir.mkdir(parents=True)
    ctx = ModeContext(cell=cell, cell_dir=cell_dir, backend=resolve_backend(cell.backend),
                      deadline=time.monotonic() + 600)
    return run(ctx), cell_dir


def _load(cell_dir: Path, rel: str) -> dict[str, Any]:
    return json.loads((cell_dir / rel).read_text(encoding="utf-8"))


def test_each_view_is_model_explorer_node_data_over_the_saved_programs_nodes(drift: Any) -> None:
    import torch

    from ci_runner.modes.numerics.overlay import node_stacks

    res, cell_dir = drift
    me = res.data["model_explorer"]
    assert res.status == "fail" and set(me["node_data"]) == {"cumulative", "isolated"}, me
    assert me["program"] == "numerics/model_explorer/model.pt2"
    assert me["command"] == ("model-explorer numerics/model_explorer/model.pt2 --node_data_paths="
                             "numerics/model_explorer/cumulative.json,numerics/model_explorer/isolated.json")
    program = torch.export.load(str(cell_dir / me["program"]))  # loads without transformers' pytree nodes too
    stacks = node_stacks(program.graph.nodes)
    ops = {n.name for n in program.graph.nodes if n.op == "call_function"}
    assert me["nodes"] == len(ops) == len(stacks)
    for view, rel in me["node_data"].items():
        data = _load(cell_dir, rel)
        jsonschema.validate(data, SCHEMA)
        assert set(data["results"]) <= ops and len(data["results"]) == me["coloured"][view]
        stops = [s["stop"] for s in data["gradient"]]
        assert stops == sorted(stops)
    iso, cum = (_load(cell_dir, me["node_data"][v])["results"] for v in ("isolated", "cumulative"))
    over = {n for n, r in iso.items() if r["value"] > 1.0}
    # the isolated view colours the layers wrong on their own: exactly the norms' nodes are over their threshold
    assert over and {stacks[n][0] for n in over} == NORMS
    assert all(iso[n]["value"] <= 1.0 for n in iso if stacks[n][0].startswith("model.layers.0.self_attn"))
    first = res.data["verdict"]["first_divergent"]
    assert first in NORMS and any(stacks[n][0] == first for n in over)
    # the cumulative view carries the drift downstream: more nodes over, the first norm's among them
    assert len([n for n, r in cum.items() if r["value"] > 1.0]) > len(over) == me["over"]["isolated"]


def test_report_html_links_the_overlay(drift: Any, tmp_path: Path) -> None:
    from ci_runner.report import write_reports

    res, cell_dir = drift
    run_dir = cell_dir.parent.parent
    results = Results(cells=[CellResult(id=cell_dir.name, model="tiny-llama", backend="sim-drift", status=res.status,
                                        modes={"numerics": res}, artifacts_dir=f"cells/{cell_dir.name}")])
    paths = write_reports(results, run_dir / "report", run_dir=run_dir)
    page = Path(paths["html"]).read_text(encoding="utf-8")
    for rel in ("numerics/model_explorer/model.pt2", "numerics/model_explorer/isolated.json"):
        assert f'href="../cells/tiny-llama%40sim-drift/{rel}"' in page
    assert "Model Explorer: exported program" in page


def model_explorer_path() -> str | None:
    """Where Model Explorer's package is: "" in this interpreter, else `DEEPVIEW_MODEL_EXPLORER_PATH`, else None."""
    if importlib.util.find_spec("model_explorer") is not None:
        return ""
    given = os.environ.get("DEEPVIEW_MODEL_EXPLORER_PATH", "")
    return given if given and (Path(given) / "model_explorer").is_dir() else None


# Model Explorer's own code on the files: its PyTorch adapter converts the program (as its server does for a .pt2),
# its node-data dataclasses rebuild each file to the same JSON, and the web app's rule for a dropped/loaded file
# (`results` at the top holding no `results`: one graph's data) takes it; every node id is one of the graph's.
CHECK = """
import json, sys
if sys.argv[1]:
    sys.path.append(sys.argv[1])
from model_explorer import node_data_builder as ndb
from model_explorer.builtin_pytorch_exportedprogram_adapter import BuiltinPytorchExportedProgramAdapter
graphs = BuiltinPytorchExportedProgramAdapter().convert(sys.argv[2], {"const_element_count_limit": 16})["graphs"]
ids = {n.id for n in graphs[0].nodes}
out = {"graph": graphs[0].id, "nodes": len(ids), "files": {}}
for path in sys.argv[3:]:
    data = json.load(open(path))
    assert data["results"] is not None and data["results"].get("results") is None
    rebuilt = ndb.GraphNodeData(results={k: ndb.NodeDataResult(**v) for k, v in data["results"].items()},
                                name=data.get("name"), gradient=[ndb.GradientItem(**g) for g in data["gradient"]])
    again = json.loads(rebuilt.to_json_string())  # with the defaults of the fields the file leaves out
    out["files"][path] = {"same": {k: again[k] for k in data} == data,
                          "unknown_ids": sorted(set(data["results"]) - ids)[:5], "results": len(data["results"])}
print(json.dumps(out))
"""


def test_model_explorers_own_adapter_and_node_data_classes_read_the_overlay(drift: Any) -> None:
    where = model_explorer_path()
    if where is None:
        pytest.skip("ai-edge-model-explorer is not installed here (pip install --target DIR ai-edge-model-explorer, "
                    "then DEEPVIEW_MODEL_EXPLORER_PATH=DIR); the files were checked against the schema above")
    res, cell_dir = drift
    me = res.data["model_explorer"]
    files = [str(cell_dir / rel) for rel in me["node_data"].values()]
    proc = subprocess.run([sys.executable, "-c", CHECK, where, str(cell_dir / me["program"]), *files],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["graph"] == "graph" and out["nodes"] > me["nodes"]  # the op nodes, and the inputs and output
    for path in files:
        assert out["files"][path] == {"same": True, "unknown_ids": [], "results": me["coloured"][Path(path).stem]}
