"""The deduplicated, group-tested ops path gives the same findings as per-model, one-probe-at-a-time probing.

On two of the bundled example's models that share most of their signatures (tiny-llama, and tiny-llava whose text
model is the same Llama; its vision tower stops sim-subset at convolution): once with the run's shared probe store
and group testing (the default), once per model with its own store and `group_testing: false`. Fingerprints,
and every probe's status, must be the same; the second model of the shared run probes only what the first lacked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ci_runner.modes.ops.mode import run

pytestmark = pytest.mark.slow

MODELS = ("tiny-llama", "tiny-llava")
BASE = {"workers": 1, "verify": False}


def _statuses(result: Any) -> dict[str, str]:
    return {r["signature"]: r["status"] for r in result.data["probes"]}


def test_shared_store_and_group_testing_give_per_model_findings(example_matrix: Any, mode_context: Any,
                                                               tmp_path: Path) -> None:
    shared, solo = {}, {}
    for model in MODELS:
        shared[model] = run(mode_context(example_matrix, model, "sim-subset", options={"ops": BASE}))
        solo[model] = run(mode_context(example_matrix, model, "sim-subset",
                                       options={"ops": {**BASE, "group_testing": False}},
                                       cell_dir=tmp_path / "solo" / model))
    for model in MODELS:
        assert sorted(f.fingerprint for f in shared[model].findings) == \
            sorted(f.fingerprint for f in solo[model].findings), model
        assert _statuses(shared[model]) == _statuses(solo[model]), model
    assert any(f.op == "aten.convolution.default" for f in shared["tiny-llava"].findings)
    store = shared["tiny-llava"].data["probe_store"]
    assert store["reused"] >= 40 and store["probed"] < len(shared["tiny-llava"].data["probes"])
    assert (tmp_path / "run" / "probes" / "sim-subset").is_dir()
