"""The probe store (`modes/ops/store.py`): inventories merged across models, outcomes kept per backend identity (one
probe per signature even when several processes probe at once, a claim whose holder died taken over:
`tests/integration/test_ops_store_processes.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci_runner.modes.ops.signature import CallSite, Inventory, OpSignature, signature_key
from ci_runner.modes.ops.outcome import OpOutcome, OpStatus
from ci_runner.modes.ops.store import ProbeStore, merge_inventories, probe_through

IDENTITY = {"backend": "test"}


def _sig(op: str, n: int, module: str = "m") -> OpSignature:
    args = [{"__tensor__": {"shape": [n], "stride": [1], "dtype": "float32"}}]
    return OpSignature(op=op, args=args, kwargs={}, key=signature_key(op, args, {}), count=1, site_count=1,
                       sites=[CallSite(module=module, module_class="Linear", source=f"{module}.py:1")])


def test_merge_counts_pairs_and_maps_every_use_back_to_its_model_and_site() -> None:
    a = Inventory(level="aten", method="export", device="meta", signatures=[_sig("aten.exp.default", 4, "a.0"),
                                                                          _sig("aten.neg.default", 4, "a.1")])
    b = Inventory(level="aten", method="export", device="meta", signatures=[_sig("aten.exp.default", 4, "b.0"),
                                                                          _sig("aten.exp.default", 8, "b.1")])
    m = merge_inventories({"A": a, "B": b})
    assert m.pairs == 4 and len(m.signatures) == 3 and m.factor == 4 / 3
    shared = m.signatures[0]
    assert shared.op == "aten.exp.default" and shared.count == 2
    assert [(mid, s.module) for mid, s in m.uses[shared.key]] == [("A", "a.0"), ("B", "b.0")]
    assert m.models[shared.key] == ["A", "B"] and m.models[m.signatures[2].key] == ["B"]


def test_not_run_outcomes_are_not_stored(tmp_path: Path) -> None:
    sig = _sig("aten.exp.default", 3)
    store = ProbeStore(tmp_path, IDENTITY)
    got = probe_through(store, [sig], lambda b: {s.key: OpOutcome(status=OpStatus.NOT_RUN) for s in b},
                        remaining=lambda: 10.0)
    assert got[sig.key].status is OpStatus.NOT_RUN and store.get(sig.key) is None


def test_group_testing_auto_groups_except_where_the_vendor_says_verdicts_differ() -> None:
    from ci_runner.config import BackendSpec
    from ci_runner.errors import DeepviewError
    from ci_runner.modes.ops.probe import group_size, grouped
    from ci_runner.registry import parse_options

    auto = parse_options("ops", {})
    assert auto.group_testing == "auto"
    ov, ind = BackendSpec(id="ov", compile="openvino"), BackendSpec(id="ind", compile="inductor")
    assert not grouped(auto, ov) and group_size(auto, ov) == 1  # OpenVINO: one-op and grouped verdicts differ
    assert grouped(auto, ind) and group_size(auto, ind) == auto.group_size
    assert grouped(parse_options("ops", {"group_testing": True}), ov)
    assert not grouped(parse_options("ops", {"group_testing": False}), ind)
    # the store keeps grouped and one-op outcomes apart
    from ci_runner.modes.ops.store import store_identity
    assert store_identity(ind, auto)["grouped"] and not store_identity(ind, parse_options("ops", {"group_testing": False}))["grouped"]
    with pytest.raises(DeepviewError, match="true, false or auto"):
        parse_options("ops", {"group_testing": "sometimes"})


def test_outcomes_are_typed_inside_and_the_same_wire_rows_on_disk(tmp_path: Path) -> None:
    """`OpOutcome.from_row`/`to_row` keep a row's keys (the null ones the child always writes, the optional ones
    only when set, unknown ones as they came); the store file holds that row without the batch's probe id."""
    import json

    row = {"id": "s00003", "op": "aten.exp.default", "status": "mismatch", "stage": "compare", "error_type": "OpMismatch",
           "message": "differs", "named_op": None, "named_text": None, "metrics": {"max_abs": 1.0}, "seconds": None,
           "compare": "mismatch", "ran": {"graphs": 1}, "group_mismatch": "in a group of 4"}
    o = OpOutcome.from_row(row)
    assert o.status is OpStatus.MISMATCH and o.is_finding and o.kind is not None
    assert o.extra == {"group_mismatch": "in a group of 4"}
    assert o.to_row() == row
    sig = _sig("aten.exp.default", 5)
    store = ProbeStore(tmp_path, IDENTITY)
    store.put(sig.key, o)
    on_disk = json.loads((store.dir / f"{store.name(sig.key)}.json").read_text())
    assert on_disk == {"key": sig.key, "outcome": {k: v for k, v in row.items() if k != "id"}}
    assert store.get(sig.key) == OpOutcome.from_row({**row, "id": ""})
    cpu_too = OpOutcome(status=OpStatus.PROBE_ERROR, message="CPU eager fails too (RuntimeError: x): y")
    assert not cpu_too.is_finding and OpOutcome(status=OpStatus.PROBE_ERROR, message="cannot resolve").is_finding
    assert not OpOutcome(status=OpStatus.INCONCLUSIVE).is_finding and OpStatus.CRASHED.is_crash


def test_a_claim_chunk_is_a_batch_per_worker_within_the_open_file_limit() -> None:
    import resource

    from ci_runner.modes.ops.store import claim_chunk
    from ci_runner.registry import parse_options

    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert claim_chunk(parse_options("ops", {"workers": 2, "batch_size": 300})) == min(600, 4096, max(64, files // 4))
    assert claim_chunk(parse_options("ops", {"workers": 1, "batch_size": 10})) == min(256, max(64, files // 4))
