"""The zoo's shards: a stable partition, manifests a merge accepts only whole, and a whole-zoo plan within GitHub's
limits (the catalog only: nothing is scanned)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from ci_runner.errors import ConfigError, InputError
from ci_runner.zoo.shards import (MATRIX_LIMIT, Shard, check_manifests, manifest, manifest_path, parse_shard, split,
                                  zoo_plan_sizes)

TYPES = sorted(f"arch{i:03d}" for i in range(47))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 47, 60])
def test_the_shards_are_a_partition_and_stable(n: int) -> None:
    slices = [split(TYPES, Shard(index=i, count=n)) for i in range(1, n + 1)]
    flat = [t for s in slices for t in s]
    assert sorted(flat) == TYPES and len(flat) == len(set(flat))  # every architecture in exactly one shard
    assert slices == [split(list(TYPES), Shard(index=i, count=n)) for i in range(1, n + 1)]  # same split again
    assert max(map(len, slices)) - min(map(len, slices)) <= 1  # balanced


@pytest.mark.parametrize("text", ["0/2", "3/2", "2", "a/b", "1/0", ""])
def test_a_bad_shard_is_one_usage_error(text: str) -> None:
    with pytest.raises(ConfigError, match="is not I/N"):
        parse_shard(text)
    assert parse_shard(" 2 / 4 ") == Shard(index=2, count=4)


def _manifests(tmp_path: Path, groups: dict[str, list[str]], n: int, skip: int = 0) -> list[tuple[Path, Any]]:
    out = []
    for i in range(1, n + 1):
        if i == skip:
            continue
        path = manifest_path(tmp_path / f"s{i}", Shard(index=i, count=n))
        out.append((path, manifest(groups, Shard(index=i, count=n))))
    return out


def test_a_merge_takes_the_n_shards_of_one_split(tmp_path: Path) -> None:
    groups = {"aten-meta": TYPES[:10], "dispatch-cpu": TYPES[5:9]}
    holders = check_manifests(_manifests(tmp_path, groups, 3), groups)
    assert holders == {i: tmp_path / f"s{i}" for i in (1, 2, 3)}


def test_a_missing_shard_is_named_with_what_to_run(tmp_path: Path) -> None:
    groups = {"aten-meta": TYPES[:10]}
    with pytest.raises(InputError, match=r"inventory shard 2/3 is missing") as exc:
        check_manifests(_manifests(tmp_path, groups, 3, skip=2), groups)
    assert "zoo inventory MATRIX --shard 2/3" in str(exc.value)


def test_shards_of_another_selection_or_split_are_refused(tmp_path: Path) -> None:
    groups = {"aten-meta": TYPES[:10]}
    other = _manifests(tmp_path, {"aten-meta": TYPES[:9]}, 2)
    with pytest.raises(InputError, match="another selection"):
        check_manifests(other, groups)
    mixed = _manifests(tmp_path, groups, 2)[:1] + _manifests(tmp_path, groups, 3)[1:]
    with pytest.raises(InputError, match="different splits"):
        check_manifests(mixed, groups)
    twice = _manifests(tmp_path, groups, 2) + _manifests(tmp_path / "again", groups, 2)[:1]
    with pytest.raises(InputError, match="is also in"):
        check_manifests(twice, groups)
    with pytest.raises(InputError, match="not an inventory shard manifest"):
        check_manifests([(tmp_path / "x.json", {"shard": 1})], groups)


def test_plan_sizes_stay_within_githubs_matrix_limit() -> None:
    inv, probe = zoo_plan_sizes(822, 3)
    assert 1 < inv <= MATRIX_LIMIT and 3 * probe <= MATRIX_LIMIT
    assert zoo_plan_sizes(2, 1) == (1, 1)
    assert zoo_plan_sizes(822, 200)[1] == 1
    with pytest.raises(ConfigError, match="more than GitHub's 256"):
        zoo_plan_sizes(822, 3, probe=100)


@pytest.mark.slow  # about 10 s: the matrix expands every architecture the installed transformers registers
def test_the_plan_of_the_whole_zoo_stays_under_githubs_limits(tmp_path: Path,
                                                               write_matrix: Callable[..., Path]) -> None:
    """Every architecture of the installed transformers on three backends (one self-hosted), with ordinary cells:
    the catalog lists the architectures, nothing is built or scanned."""
    pytest.importorskip("transformers")
    from ci_runner.config import load_matrix
    from ci_runner.matrix import expand, expand_json
    from ci_runner.plan import check_output_size, load_plan, plan_outputs

    matrix = write_matrix(models=[{"id": "tiny", "config": "llama"}, {"id": "zoo", "zoo": "transformers"}],
                          backends=[{"id": "aot_eager", "compile": "aot_eager"}, {"id": "inductor", "compile": "inductor"},
                                    {"id": "vendor", "compile": "aot_eager", "runs-on": ["self-hosted", "acme"]}])
    cells = expand(load_matrix(matrix))
    zoo_cells = [c for c in cells if c.model.zoo]
    assert len(zoo_cells) > 3 * 600  # all ~822 types
    doc = expand_json(cells, max_jobs=1024)  # the zoo's architectures are not cell jobs: no max_jobs refusal
    assert doc["count"] == len(cells) and sum(len(m["include"]) for m in doc["matrix"]) == 3
    zoo = doc["zoo"]
    for step in ("inventory", "probe", "cells"):
        assert 0 < len(zoo[step]["include"]) <= MATRIX_LIMIT
    assert len(zoo["cells"]["include"]) == 3 and {e["backend"] for e in zoo["probe"]["include"]} == {
        "aot_eager", "inductor", "vendor"}
    names = [e["artifact"] for step in ("inventory", "probe", "cells") for e in zoo[step]["include"]]
    assert len(names) == len(set(names)) and not any(ch in n for n in names for ch in '":<>|*?\\/ ')
    outputs = plan_outputs(doc)
    assert check_output_size(outputs) < 100_000  # far under GitHub's 1 MB of job outputs
    assert json.loads(outputs["zoo-probe"]) == zoo["probe"] and outputs["zoo-shards"] == str(len(zoo["inventory"]["include"]))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    planned = {p.cell: p for p in load_plan(plan)}
    assert planned["llama@vendor"].job == "zoo-cells-b2" and planned["llama@vendor"].chunk is None
    assert planned["tiny@aot_eager"].job is None and planned["tiny@aot_eager"].chunk == 0
    fork = expand_json(cells, max_jobs=1024, fork_pr=True)  # the self-hosted backend's zoo cells are skipped
    assert {e["backend"] for e in fork["zoo"]["probe"]["include"]} == {"aot_eager", "inductor"}
    assert all(s["job"] for s in fork["skipped"] if s["model"] != "tiny")


def test_the_report_collects_the_zoo_cells_jobs_and_their_failed_setup(tmp_path: Path) -> None:
    """`collect` copies each backend's zoo cells artifact (cells and zoo record); a zoo cell whose backend job's
    setup failed reads that job's record (`error`, with the command), one with no job result is 'no result'."""
    from ci_runner.plan import NO_RESULT, PlannedCell, collect_attempts
    from ci_runner.results.model import CellResult, ModeResult, save_cell_result
    from ci_runner.run.aggregate import aggregate

    arts = tmp_path / "artifacts"
    ok = CellResult(id="llama@a", model="llama", backend="a", status="pass", modes={"ops": ModeResult(status="pass")})
    save_cell_result(ok, arts / "deepview-zoo-cells-b0" / "cells" / "llama@a" / "result.json")
    (arts / "deepview-zoo-cells-b0" / "zoo").mkdir(parents=True)
    (arts / "deepview-zoo-cells-b0" / "zoo" / "a.json").write_text("{}")
    setup = arts / "deepview-zoo-cells-b1" / "cells" / "zoo-cells-b1" / "setup-failed"
    setup.mkdir(parents=True)
    (setup / "command.txt").write_text("pip install acme-compiler\n")
    (setup / "exit-code").write_text("1\n")
    (setup / "output.log").write_text("ERROR: no matching distribution\n")
    run = tmp_path / "run"
    got = collect_attempts(arts, run)
    assert got["llama@a"] == 1 and (run / "zoo" / "a.json").exists()
    plan = [PlannedCell(cell=f"{m}@{b}", model=m, backend=b, modes=("ops",), chunk=None, job=f"zoo-cells-b{row}")
            for m in ("llama", "vit") for row, b in enumerate(("a", "b", "c"))]
    cells = {c.id: c for c in aggregate([run], plan=plan, run_dirs=()).cells}
    assert cells["llama@a"].status == "pass" and cells["vit@a"].error.type == "no_result"
    assert cells["vit@a"].error.message.startswith(NO_RESULT)
    for cid in ("llama@b", "vit@b"):
        assert cells[cid].status == "error" and cells[cid].error.type == "setup_failed"
        assert "pip install acme-compiler" in cells[cid].error.message
    assert cells["llama@c"].error.type == "no_result"
