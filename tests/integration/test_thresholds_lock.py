"""The thresholds file's lock across processes: two cells of one model deriving at once derive once (the table,
its key and its options: `tests/unit/test_thresholds.py`)."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from ci_runner.modes.numerics.thresholds import LayerStats, ThresholdOptions, load_or_derive, threshold_key, threshold_path

pytestmark = pytest.mark.subprocess  # two forked processes race for the lock

FP = {"id": "tiny", "source": "config", "model_type": "llama", "overrides": {"hidden_size": 32}}
INPUTS = {"batch": 1, "seq_len": 8, "samples": 2, "seed": 0, "image_size": None, "text": []}
REFS = [{"id": "cpu-fp32", "device": "cpu", "dtype": "float32"}, {"id": "cpu-fp64", "device": "cpu", "dtype": "float64"}]


def _stats(rel: float) -> LayerStats:
    s = LayerStats(module_class="Linear", name="a")
    for view in ("cumulative", "isolated"):
        s.add(view, {"rel": rel, "cos": 1 - rel * rel / 2, "mad": rel, "ref_absmean": 1.0})
    return s


def _derive_in_process(path: str, marker: str, barrier_file: str) -> None:
    key = threshold_key(model_fingerprint=FP, inputs=INPUTS, references=REFS, samples=2)

    def derive() -> dict[str, LayerStats]:
        with open(marker, "a") as fh:
            fh.write("derive\n")
        time.sleep(1.0)  # long enough for the other process to reach the lock
        return {"a": _stats(1e-5)}

    while not Path(barrier_file).exists():
        time.sleep(0.01)
    load_or_derive(Path(path), key, ThresholdOptions(), "float32", derive)


def test_parallel_cells_derive_once(tmp_path: Path) -> None:
    key = threshold_key(model_fingerprint=FP, inputs=INPUTS, references=REFS, samples=2)
    path = threshold_path(tmp_path, "tiny", key)
    marker = tmp_path / "derivations.log"
    barrier = tmp_path / "go"
    ctx = multiprocessing.get_context("fork")  # no re-import of torch in the children
    procs = [ctx.Process(target=_derive_in_process, args=(str(path), str(marker), str(barrier))) for _ in range(2)]
    for p in procs:
        p.start()
    barrier.touch()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert marker.read_text().count("derive") == 1
    assert json.loads(path.read_text())["key"] == key
