"""The zoo end to end: `deepview-ci run` on a zoo entry (scan, one probe per signature, a cell per architecture,
results.json's zoo section), and the scan's per-model watchdog (one hang costs one model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("transformers")

FOUR = ["llama", "vit", "whisper", "mamba"]  # decoder, vision, audio encoder-decoder, SSM (the unit tests cover the rest)


@pytest.mark.slow
def test_zoo_run_on_aot_eager(tmp_path: Path, write_matrix: Callable[..., Path], cli: Callable[..., Any]) -> None:
    matrix = write_matrix(modes=["ops"], options={"ops": {"max_signatures_per_op": 1, "verify": False}},
                          models=[{"id": "zoo", "zoo": "transformers", "select": FOUR}],
                          backends=[{"id": "aot_eager", "compile": "aot_eager"}])
    out = tmp_path / "run"
    proc = cli("run", str(matrix), "--out", str(out), "--jobs", "2", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "report" / "results.json").read_text())
    zoo = results["zoo"]
    # aot_eager runs eager kernels: every scanned architecture must be fully supported (a finding is our bug)
    assert zoo["architectures"] == 4 and len(zoo["scanned"]) + len(zoo["left_out"]) == 4
    assert sorted(zoo["scanned"]) == sorted(FOUR), zoo["left_out"]
    assert zoo["backends"]["aot_eager"]["supported"] == zoo["scanned"]
    assert 0 < zoo["signatures"]["aot_eager"] < zoo["pairs"]["aot_eager"]  # deduplicated across models
    cells = {c["model"]: c for c in results["cells"]}
    assert set(cells) == set(FOUR)
    for model in zoo["scanned"]:
        ops = cells[model]["modes"]["ops"]
        assert cells[model]["status"] == "pass" and ops["data"]["zoo"]["model_type"] == model
        assert ops["data"]["probe_counts"]["total"] > 0
    summary = (out / "report" / "summary.md").read_text()
    assert f"### Zoo: {len(zoo['scanned'])} of 4 architectures scanned" in summary


@pytest.mark.slow
def test_a_model_past_the_per_model_limit_costs_that_model_only(tmp_path: Path) -> None:
    from ci_runner.zoo.scan import ScanOptions, scan_inventories

    records = scan_inventories(["vit", "bert"], ScanOptions(out_dir=tmp_path, per_model_timeout=0.5))
    assert [r["left_out"]["stage"] for r in records.values()] == ["timeout", "timeout"]  # each got its own child
    assert "per-model limit of 0.5 CPU s" in records["bert"]["left_out"]["reason"]
    journal = "".join(p.read_text() for p in tmp_path.glob("journal-*.log"))
    assert journal.count("enter-model") == 2 and journal.count("timeout-model") == 2
