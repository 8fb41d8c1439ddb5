"""The probe store (`modes/ops/store.py`): inventories merged across models, outcomes kept per backend identity (one
probe per signature even when several processes probe at once, a claim whose holder died taken over:
`tests/integration/test_ops_store_processes.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ci_runner.modes.ops.signature import CallSite, Inventory, OpSignature, signature_key
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
    got = probe_through(store, [sig], lambda b: {s.key: {"status": "not_run"} for s in b}, remaining=lambda: 10.0)
    assert got[sig.key]["status"] == "not_run" and store.get(sig.key) is None


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
