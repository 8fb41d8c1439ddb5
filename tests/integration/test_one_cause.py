"""Issue 25: one cause, one group, across modes, on a real compiler.

Ground truth (checked by hand with plain `torch.compile(model, backend="openvino")`, `import openvino.torch`,
default options): tiny Mixtral fails with `IndexError: list index out of range`, raised in
torch/fx/experimental/symbolic_shapes.py in `issue_guard` (Dynamo's guard building, which OpenVINO's default path
breaks), re-raised by Dynamo unwrapped; other graphs of it fail in the same guard building with `AssertionError:
sources must not be empty for symbol sN`. The ops probes of view/slice/neg/cat hit these same two errors: they are
two causes, not four missing operators.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ci_runner.config import load_matrix_text
from ci_runner.matrix import expand
from ci_runner.results.model import Results, iter_findings
from ci_runner.results.rootcause import root_causes
from tests.fixtures.matrices import TINY_DECODER, matrix_text
from ci_runner.run.aggregate import op_ranking
from ci_runner.run.cellrun import run_cell_inprocess

pytestmark = pytest.mark.slow  # a real compiler on 2 shared cores: a few minutes
pytest.importorskip("openvino")

PROBED = ("aten.view.default", "aten.slice.Tensor", "aten.neg.default", "aten.cat.default")
MATRIX = matrix_text(
    modes=["ops", "layers"], timeout=900, inputs={"batch": 1, "seq_len": 16, "samples": 1, "seed": 0},
    options={"ops": {"only_ops": list(PROBED), "max_signatures_per_op": 4, "workers": 1, "verify": False},
             "layers": {"repro": False, "culprit": False, "verify": False}},
    models=[{"id": "tiny-mixtral", "config": "mixtral",
             "overrides": {**TINY_DECODER, "num_hidden_layers": 1, "num_local_experts": 4, "num_experts_per_tok": 2}}],
    backends=[{"id": "openvino", "compile": "openvino"}],  # default options: no recipe from docs/backends.md
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    tmp = tmp_path_factory.mktemp("one-cause")
    matrix = load_matrix_text(MATRIX, path=str(tmp / "matrix.yaml"))
    cell = expand(matrix)[0]
    result = run_cell_inprocess(cell, tmp / "cells" / cell.id, modes=("ops", "layers"),
                                deadline=time.monotonic() + cell.timeout)
    out = Results(cells=[result])
    out.ranking = op_ranking(out)
    out.root_causes = root_causes(out)
    return out


def test_ops_and_layers_findings_of_one_error_share_one_root_cause(results: Results) -> None:
    findings = [(mode, f) for _, mode, f in iter_findings(results)]
    assert {m for m, _ in findings} == {"ops", "layers"}, [(m, f.kind, f.message[:80]) for m, f in findings]
    for mode, f in findings:  # each names the frame it was raised in
        assert "symbolic_shapes.py" in str(f.details.get("raised_in")), (mode, f.op or f.module, f.details)
    for cause in results.root_causes:
        assert "IndexError: " not in cause["message"] and "AssertionError: " not in cause["message"]
        assert cause["raised_in"].startswith("torch.fx (torch) at torch/fx/experimental/symbolic_shapes.py")
    ops_causes = {f.details["signature"] for m, f in findings if m == "ops"}
    layer_causes = {f.details["signature"] for m, f in findings if m == "layers"}
    assert ops_causes & layer_causes, results.root_causes
    assert len(results.root_causes) <= 2  # IndexError and AssertionError in guard building; was 4


def test_the_ops_ranking_ranks_the_cause_not_its_operators(results: Results) -> None:
    rows = results.ranking
    causes = [r for r in rows if r["op"] is None]
    assert causes, rows
    listed_ops = {r["op"] for r in rows if r["op"]}
    for r in causes:
        assert len(r["ops"]) >= 2 and not set(r["ops"]) & listed_ops
        assert "symbolic_shapes.py" in r["raised_in"]
