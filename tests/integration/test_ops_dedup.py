"""The deduplicated, group-tested ops path gives the same findings as per-model, one-probe-at-a-time probing.

On two of the bundled example's models that share some signatures (tiny-llama, and tiny-llava whose text model is
the same Llama on longer inputs; its vision tower stops sim-subset at convolution), inventoried once: the merged
signatures probed once through one shared store with group testing (the default), and each model's signatures
probed in its own store with `group_testing: false`. Each model's ops result (`mode.model_result`) must have the
same fingerprints and the same status for every probe.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ci_runner.modes.ops.mode import build_probes, model_result, take_model_inventory
from ci_runner.modes.ops.store import merge_inventories, probe_signatures
from ci_runner.registry import parse_options

pytestmark = pytest.mark.slow

MODELS = ("tiny-llama", "tiny-llava")
BASE = {"workers": 1, "verify": False, "max_signatures_per_op": 1}  # one signature per op: a short test


def _result(ctx: Any, inv: Any, outcomes: dict[str, Any], opts: Any, out: Path) -> Any:
    out.mkdir(parents=True, exist_ok=True)
    return model_result(inv, outcomes, spec=ctx.cell.backend, model_id=ctx.model_id, level="aten", opts=opts,
                        ops_dir=out, env_stamp={}, remaining=lambda: 600.0, eager=False)


def test_shared_store_and_group_testing_give_per_model_findings(example_matrix: Any, mode_context: Any,
                                                               tmp_path: Path) -> None:
    ctxs = {m: mode_context(example_matrix, m, "sim-subset", options={"ops": BASE}) for m in MODELS}
    invs = {m: take_model_inventory(ctx, "aten") for m, ctx in ctxs.items()}
    spec = ctxs[MODELS[0]].cell.backend
    grouped, single = parse_options("ops", BASE), parse_options("ops", {**BASE, "group_testing": False})
    merged = merge_inventories(invs)
    assert merged.pairs > len(merged.signatures)  # some signatures are shared (llava's text runs 32 tokens, not 16)
    wanted = {p["key"] for inv in invs.values() for p in build_probes(inv, grouped)[0]}
    stats: dict[str, Any] = {}
    shared = probe_signatures(spec, [s for s in merged.signatures if s.key in wanted], store_dir=tmp_path / "shared",
                              opts=grouped, stats=stats)
    assert stats["probed"] == len(wanted)
    for model, inv in invs.items():
        probes, _ = build_probes(inv, single)
        by_key = {s.key: s for s in inv.signatures}
        own = probe_signatures(spec, [by_key[p["key"]] for p in probes], store_dir=tmp_path / model, opts=single)
        a = _result(ctxs[model], inv, shared, grouped, tmp_path / "a" / model)
        b = _result(ctxs[model], inv, own, single, tmp_path / "b" / model)
        assert sorted(f.fingerprint for f in a.findings) == sorted(f.fingerprint for f in b.findings), model
        assert [(r["signature"], r["status"]) for r in a.data["probes"]] == \
            [(r["signature"], r["status"]) for r in b.data["probes"]], model
    assert any(f.op == "aten.convolution.default" for f in a.findings)
