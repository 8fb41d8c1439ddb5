"""One cell per mode of the bundled example, through the command line, on whatever torch runs the tests.

Part of the `oldtorch` subset (docs/torch.md): on the oldest supported torch it shows that each mode
still finds what it finds on the newest, and that simdev, which needs torch ≥ 2.10, is `skipped` with its reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ci_runner.models.torchcompat import FEATURES, available
from tests.fixtures.paths import EXAMPLE

pytestmark = [pytest.mark.oldtorch, pytest.mark.slow]

CELLS = ("tiny-llama@sim-subset", "tiny-llama@sim-crash", "tiny-llama@sim-drift", "tiny-llama@simdev")




def test_one_cell_per_mode_of_the_bundled_example(tmp_path: Path) -> None:
    # the bundled example with the layers mode's culprit search off (tests/integration/test_culprit.py covers it),
    # and simdev's cell in the ops mode only (only its ops result is checked below; the layers mode on simdev is
    # checked on tiny Llama by test_culprit.py): on an older torch that mode is skipped with the release it needs
    doc = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    doc["defaults"].setdefault("options", {}).setdefault("layers", {})["culprit"] = False
    simdev = next(b for b in doc["backends"] if b["id"] == "simdev")
    assert simdev["modes"] == ["ops", "layers"], simdev  # the example's; this test narrows it
    simdev["modes"] = ["ops"]
    matrix = tmp_path / "example.yaml"
    matrix.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "ci_runner", "run", str(matrix), "--out", str(out), "--jobs", "2"]
    for cell in CELLS:
        argv += ["--select", cell]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # findings: exit 1
    cells = {c["id"]: c for c in json.loads((out / "report" / "results.json").read_text(encoding="utf-8"))["cells"]}
    assert set(cells) == set(CELLS)

    # ops: every Llama operator is in sim-subset's transformer allowlist (no false finding on a supported model)
    ops = cells["tiny-llama@sim-subset"]["modes"]
    assert set(ops) == {"ops"} and ops["ops"]["status"] == "pass" and ops["ops"]["findings"] == [], ops
    # layers: sim-crash fails on attention, found in each decoder layer's self-attention
    layers = cells["tiny-llama@sim-crash"]["modes"]["layers"]
    assert layers["status"] == "fail"
    assert {f["module"] for f in layers["findings"]} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    assert all("[sim-crash]" in f["message"] for f in layers["findings"])
    # numerics: sim-drift's reduced-precision rsqrt makes every RMSNorm diverge
    num = cells["tiny-llama@sim-drift"]["modes"]["numerics"]
    assert num["status"] == "fail"
    assert {f["module"] for f in num["findings"] if f["kind"] == "divergence"} >= {
        "model.layers.0.input_layernorm", "model.layers.1.input_layernorm", "model.norm"}
    # a device registered from Python: runs on torch ≥ 2.10, else every mode is skipped with the release it needs
    dev = cells["tiny-llama@simdev"]
    if available("simdev"):
        assert dev["status"] == "fail" and dev["modes"]["ops"]["status"] == "fail"
    else:
        assert dev["status"] == "skipped" and dev["modes"]
        for mode in dev["modes"].values():
            assert mode["status"] == "skipped"
            assert f"needs torch \u2265 {FEATURES['simdev'].needs}" in mode["reason"]
