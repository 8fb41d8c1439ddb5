"""The zoo in shards, as the GitHub jobs run it (CLI subprocesses, one folder per job, artifacts copied as
`actions/download-artifact` merges them): the same cells and the same results.json zoo section as one
`deepview-ci run`; a merge refuses a missing or corrupt shard with one clear error naming it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest

pytest.importorskip("transformers")

TWO = ["llama", "vit"]
VOLATILE = ("probe_s",)  # seconds: never equal between two runs


def _zoo(results: dict[str, Any]) -> dict[str, Any]:
    zoo = json.loads(json.dumps(results["zoo"]))
    for b in zoo["backends"].values():
        for k in VOLATILE:
            b.pop(k, None)
    return zoo


def _cells(results: dict[str, Any]) -> dict[str, Any]:
    return {c["id"]: (c["status"], c["modes"]["ops"]["status"], c["modes"]["ops"]["data"].get("probe_counts"),
                      [f["fingerprint"] for f in c["modes"]["ops"]["findings"]]) for c in results["cells"]}


def _outcomes(run: Path) -> dict[str, tuple[Any, ...]]:
    """Signature key -> (status, stage, error type, compare) of every outcome in the run's aot_eager store."""
    rows = [json.loads(p.read_text()) for p in (run / "probes" / "aot_eager").glob("*/*.json")
            if p.name != "identity.json"]
    return {r["key"]: tuple(r["outcome"].get(k) for k in ("status", "stage", "error_type", "compare")) for r in rows}


def _copy(src: Path, dest: Path) -> None:
    """What download-artifact with merge-multiple does: files of several artifacts into one folder."""
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True)


@pytest.mark.slow
def test_sharded_zoo_gives_what_one_run_gives(tmp_path: Path, write_matrix: Callable[..., Path],
                                               cli: Callable[..., Any]) -> None:
    matrix = write_matrix(modes=["ops"], options={"ops": {"max_signatures_per_op": 1, "verify": False}},
                          models=[{"id": "zoo", "zoo": "transformers", "select": TWO}],
                          backends=[{"id": "aot_eager", "compile": "aot_eager"}])
    one = tmp_path / "one"
    proc = cli("run", str(matrix), "--out", str(one), "--jobs", "1", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

    inv = tmp_path / "inventory"  # one folder per downloaded inventory artifact
    for i in (1, 2):
        proc = cli("zoo", "inventory", str(matrix), "--shard", f"{i}/2", "--out", str(inv / f"shard-{i}"), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    merged = tmp_path / "merged"
    proc = cli("zoo", "merge", str(inv), "--matrix", str(matrix), "--out", str(merged), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 of 2 architecture(s) scanned" in proc.stdout
    run = tmp_path / "run"
    _copy(merged, run)
    for i in (1, 2):  # each probe job on its own copy of the merged artifact; their stores merged afterwards
        job = tmp_path / f"probe-{i}"
        _copy(merged, job)
        proc = cli("zoo", "probe", str(matrix), "--backend", "aot_eager", "--shard", f"{i}/2", "--out", str(job),
                   timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        _copy(job / "probes", run / "probes")
        _copy(job / "zoo" / "probes", run / "zoo" / "probes")
    proc = cli("zoo", "cells", str(matrix), "--backend", "aot_eager", "--out", str(run), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli("aggregate", str(run), "--out", str(run / "report"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    a = json.loads((one / "report" / "results.json").read_text())
    b = json.loads((run / "report" / "results.json").read_text())
    assert _zoo(a) == _zoo(b) and sorted(a["zoo"]["scanned"]) == TWO
    assert _cells(a) == _cells(b) and all(c[0] == "pass" for c in _cells(b).values())
    # the merge of two shards is the unsharded inventory's (same distinct signatures, pairs, uses), and the probe
    # shards' stores together hold the one run's outcomes (their groups differ, so sizes and seconds may)
    assert json.loads((merged / "zoo/merged/aot_eager.json").read_text()) == \
        json.loads((one / "zoo/merged/aot_eager.json").read_text())
    assert _outcomes(run) == _outcomes(one) and len(_outcomes(run)) == a["zoo"]["probed"]["aot_eager"]
    record = json.loads((run / "zoo" / "aot_eager.json").read_text())
    assert record["store"]["probed"] == record["probed"] > 0  # the shards probed everything; the cells step nothing
    notes = sorted((run / "zoo" / "probes").glob("*.json"))
    assert [json.loads(p.read_text())["shard"] for p in notes] == [1, 2]

    # a corrupt record, or a missing shard: one clear error naming it (InputError: exit 3; in this process, as the
    # `zoo merge` command calls it, so as not to start two more processes)
    from ci_runner.config import load_matrix
    from ci_runner.errors import EXIT_INPUT, InputError
    from ci_runner.matrix import expand
    from ci_runner.zoo.run import merge_shards

    cells = expand(load_matrix(matrix))
    rec = next(inv.glob("shard-*/zoo/inventory/*/llama.json"))
    rec.write_text(rec.read_text()[:100])
    with pytest.raises(InputError, match="not valid JSON") as exc:
        merge_shards(cells, [inv], tmp_path / "m2")
    assert str(exc.value).startswith(f"{rec}:") and exc.value.exit_code == EXIT_INPUT
    shutil.rmtree(inv / "shard-2")
    with pytest.raises(InputError, match="inventory shard 2/2 is missing"):
        merge_shards(cells, [inv], tmp_path / "m3")
