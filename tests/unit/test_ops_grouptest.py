"""Group testing (`modes/ops/grouptest.py`): one compile for a passing group, bisection to single probes where a
group fails, "fails only together", and the guards that keep a group from hiding a failure."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from ci_runner.config import BackendSpec, spec_to_json
from ci_runner.modes.ops.grouptest import plan_tasks, probe_groups
from ci_runner.modes.ops.inputs import with_ranges
from ci_runner.engine.codec import encode_arg

X = torch.empty(2, 3)


def _probe(i: int, op: str, *args: Any) -> dict[str, Any]:
    a, k = with_ranges(op, [encode_arg(x) for x in args], {})
    return {"id": f"p{i:04d}", "op": op, "key": f"{op}#{i}", "args": a, "kwargs": k, "seed": i,
            "tolerance": [1e-4, 1e-5]}


def _run(tmp_path: Path, compile: str, probes: list[dict[str, Any]], group_size: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    results = tmp_path / f"out-{group_size}.jsonl"
    payload = {"backend": spec_to_json(BackendSpec(id="t", compile=compile)), "probes": probes,
               "results": str(results), "compare": True, "group_size": group_size,
               "limits": {"first": 60.0, "window": 30.0, "factor": 4.0}, "limits_file": str(tmp_path / "limits.jsonl"),
               "deadline_wall": time.time() + 600.0}
    probe_groups(payload)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    return {r["id"]: r for r in rows if not r["id"].startswith("together:")}, [r for r in rows if r["id"].startswith("together:")]


def test_plan_groups_consecutive_probes_and_respects_each_probes_cap() -> None:
    probes = [{"id": i} for i in range(5)] + [{"id": 5, "group_cap": 1}, {"id": 6, "group_cap": 1}, {"id": 7}]
    assert [[p["id"] for p in t] for t in plan_tasks(probes, 2)] == [[0, 1], [2, 3], [4], [5], [6], [7]]


def test_a_passing_group_is_one_compile_and_a_failing_one_is_bisected_to_the_culprit(tmp_path: Path) -> None:
    ops = ["aten.mul.Tensor", "aten.softplus.default", "aten.sin.default", "aten.cos.default"]
    probes = [_probe(i, op, X, X) if op == "aten.mul.Tensor" else _probe(i, op, X) for i, op in enumerate(ops)]
    vendor = "tests.fixtures.plugin_ops_vendor:compile_fn"  # refuses softplus, naming it
    grouped, together = _run(tmp_path, vendor, probes, 8)
    assert [grouped[p["id"]]["status"] for p in probes] == ["pass", "unsupported", "pass", "pass"]  # as alone
    assert grouped["p0001"]["status"] == "unsupported" and "softplus" in grouped["p0001"]["message"]
    assert "group" not in grouped["p0001"]  # decided alone
    assert all(grouped[p["id"]].get("group") == 3 for p in probes if p["id"] != "p0001")  # the rest: one compile
    assert not together


def test_a_group_failing_only_together_names_the_smallest_failing_set(tmp_path: Path) -> None:
    ops = ["aten.exp.default", "aten.abs.default", "aten.sin.default", "aten.neg.default", "aten.cos.default"]
    probes = [_probe(i, op, X) for i, op in enumerate(ops)]
    out, together = _run(tmp_path, "tests.fixtures.plugin_group:compile_fn", probes, 8)
    assert {o["status"] for o in out.values()} == {"pass"}  # no op fails alone: no finding
    assert len(together) == 1
    assert sorted(together[0]["ops"]) == ["aten.exp.default", "aten.neg.default"]
    assert together[0]["message"].startswith("fails only together (2 probes") and "FusionError" in together[0]["message"]


def test_a_group_the_backend_did_not_wholly_run_is_split_not_passed(tmp_path: Path) -> None:
    probes = [_probe(0, "aten.abs.default", X), _probe(1, "tests.fixtures.plugin_group.breaks", X),
              _probe(2, "aten.sin.default", X)]
    alone, _ = _run(tmp_path, "aot_eager", probes, 1)
    grouped, _ = _run(tmp_path, "aot_eager", probes, 8)
    assert alone["p0001"]["status"] == "inconclusive" and "graph break" in alone["p0001"]["message"]
    assert {k: v["status"] for k, v in grouped.items()} == {k: v["status"] for k, v in alone.items()}
    assert not any(o.get("group") == 3 for o in grouped.values())  # the graph break sent the group to halves


def test_the_group_function_is_each_call_as_decoded_and_traces_one_node_per_op() -> None:
    """`group_function`'s flat source calls each op as `assemble` decodes its call (lists of tensors, dtypes,
    keywords, selected outputs); a call source cannot write goes through the decoding helper."""
    from ci_runner.modes.ops.grouptest import group_function
    from ci_runner.modes.ops.inputs import build_tensors
    from ci_runner.modes.ops.probe import assemble, resolve_op, select_outputs

    probes = [_probe(0, "aten.add.Tensor", X, X), _probe(1, "aten.cat.default", [X, X], 1),
              _probe(2, "aten.max.dim", X, 1), _probe(3, "aten._to_copy.default", X)]
    probes[2]["outputs"] = [0]
    probes[3]["kwargs"] = {"dtype": {"__dtype__": "float16"}}
    calls = [(resolve_op(p), p) for p in probes]
    tensors = [t for p in probes for t in build_tensors(p["args"], p["kwargs"], p["seed"])]
    got = group_function(calls, "cpu")(*tensors)
    it = iter(tensors)
    for (op, p), value in zip(calls, got):
        n = len(build_tensors(p["args"], p["kwargs"], p["seed"]))
        a, k = assemble(p["args"], p["kwargs"], [next(it) for _ in range(n)], "cpu")
        assert torch.equal(value, select_outputs(op(*a, **k), p.get("outputs")))
    graphs: list[Any] = []

    def count(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(group_function(calls, "cpu"), backend=count, fullgraph=True)(*tensors)
    assert len(graphs) == 1 and sum(n.op == "call_function" for n in graphs[0].graph.nodes) >= len(probes)


def test_a_call_source_cannot_write_is_decoded_by_the_helper() -> None:
    from ci_runner.modes.ops import grouptest

    probe = _probe(0, "aten.abs.default", X)
    probe["kwargs"] = {"not-an-identifier": 1}  # keyword source cannot write: the helper decodes the call
    seen: list[Any] = []
    fn = grouptest.group_function([(lambda x, **kw: seen.append(kw) or x.abs(), probe)], "cpu")
    (out,) = fn(torch.full((2, 3), -2.0))
    assert torch.equal(out, torch.full((2, 3), 2.0)) and seen == [{"not-an-identifier": 1}]


def test_an_in_place_op_is_compared_on_fresh_inputs_after_a_failing_group(tmp_path: Path) -> None:
    """The reference runs on a copy of the inputs and the group's first attempt on the inputs as built; a half
    after a failing group builds them again (an in-place op changed them): the verdicts are those of each alone."""
    probes = [_probe(0, "aten.add_.Tensor", X, X), _probe(1, "aten.softplus.default", X),
              _probe(2, "aten.mul_.Tensor", X, X)]
    vendor = "tests.fixtures.plugin_ops_vendor:compile_fn"  # refuses softplus: the group fails and is split
    alone, _ = _run(tmp_path, vendor, probes, 1)
    grouped, _ = _run(tmp_path, vendor, probes, 8)
    assert [grouped[p["id"]]["status"] for p in probes] == ["pass", "unsupported", "pass"]
    assert {k: (v["status"], v.get("compare")) for k, v in grouped.items()} == \
        {k: (v["status"], v.get("compare")) for k, v in alone.items()}
    passing = [probes[0], probes[2]]
    together, _ = _run(tmp_path, "aot_eager", passing, 8)  # one compile on the inputs the reference did not touch
    assert [(together[p["id"]]["status"], together[p["id"]].get("group")) for p in passing] == [("pass", 2)] * 2
