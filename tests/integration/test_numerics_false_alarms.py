"""No false alarm: the numerics mode on real compilers (inductor, aot_eager on CPU) flags no layer of any model of
the bundled example, in either view. (Moved out of test_numerics_mode.py so that xdist's `--dist loadfile` runs
this sweep, the suite's longest, on one worker while the other runs the rest of the numerics tests.)"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec, load_matrix
from ci_runner.matrix import expand
from ci_runner.modes import ModeContext
from ci_runner.modes.numerics.mode import run
from tests.fixtures.paths import EXAMPLE

EXAMPLE_MODELS = ("tiny-llama", "tiny-granite", "tiny-bamba", "tiny-mixtral", "tiny-vit", "tiny-llava", "minilm")


@pytest.fixture(scope="module")
def shared_thresholds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("thresholds")


def _flagged(data: dict[str, Any], view: str) -> set[str]:
    return {row["name"] for row in data["layers"] if row[f"flagged_{view}"]}


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_real_compilers_flag_no_layer_on_the_example_matrix(tmp_path: Path, shared_thresholds: Path,
                                                            backend: str) -> None:
    """inductor and aot_eager on CPU: no layer flagged on any example model, in either view (every layer compared).
    One seed each, the example's: a second seed is the same check on other random weights and inputs, and its
    thresholds are derived again (it ran for inductor until the suite had to fit its 15 minutes). The two backends
    share one thresholds folder, as the cells of one run do: the thresholds are derived once."""
    m = load_matrix(EXAMPLE)
    spec = BackendSpec(id=backend, compile=backend)
    be = resolve_backend(spec)
    worst_ratio = 0.0
    options = {"isolate": False, "isolated": "all", "thresholds_dir": str(shared_thresholds)}
    for model in EXAMPLE_MODELS:
        base = next(c for c in expand(m) if c.model.id == model)
        cell = dataclasses.replace(base, id=f"{model}@{backend}", backend=spec, options={"numerics": options})
        cell_dir = tmp_path / "run" / "cells" / cell.id
        cell_dir.mkdir(parents=True)
        res = run(ModeContext(cell=cell, cell_dir=cell_dir, backend=be, deadline=time.monotonic() + 900))
        flagged = _flagged(res.data, "cumulative") | _flagged(res.data, "isolated")
        assert res.status == "pass" and not flagged and not res.findings, (model, flagged, res.reason)
        assert res.data["views"] == {"cumulative": "ran", "isolated": "ran"}, (model, res.data["views"])
        assert res.data["coverage"]["compared"] == res.data["layers_total"], (model, res.data["coverage"])
        for row in res.data["layers"]:
            for view, thr in (("cumulative", row["threshold"]), ("isolated", row["threshold_isolated"])):
                if row[view] and thr:
                    worst_ratio = max(worst_ratio, row[view]["rel"] / thr["rel"])
    assert worst_ratio < 1.0
