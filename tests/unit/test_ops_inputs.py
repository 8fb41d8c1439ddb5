"""A probe's synthetic inputs (`modes/ops/inputs.py`): chunked draws with the values of one draw, inputs that keep
the op contracts real models rely on (the whole-zoo aot_eager probe errors), the same values in a repro script, and
the parent's memory guard (`ops.max_probe_input_mb`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ci_runner.config import BackendSpec
from ci_runner.engine.repro import plain_source
from ci_runner.modes.ops.inputs import (SCRIPT_FUNCTIONS, build_tensors, call_source, input_bytes, make_tensor,
                                        storage_span, with_ranges)
from ci_runner.modes.ops.outcome import OpStatus
from ci_runner.modes.ops.probe import ProbeRunner, resolve_op, select_outputs, too_big
from ci_runner.registry import parse_options

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)


def _one_buffer(shape: list[int], stride: list[int], dtype: str, low: float, high: float, seed: int) -> torch.Tensor:
    """`make_tensor` as it was: one float64 / int64 draw of the whole storage, cast by one copy."""
    gen = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    t = torch.empty_strided(tuple(shape), tuple(stride), dtype=dt)
    n = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(s > 0 for s in shape) else 0
    if n > 0:
        if dt == torch.bool:
            flat = torch.randint(0, 2, (n,), generator=gen).bool()
        elif dt.is_floating_point or dt.is_complex:
            flat = torch.rand(n, generator=gen, dtype=torch.float64).mul_(high - low).add_(low)
        else:
            flat = torch.randint(int(low), max(int(high), int(low) + 1), (n,), generator=gen)
        t.as_strided((n,), (1,)).copy_(flat)
    return t


@pytest.mark.parametrize("shape,stride,dtype,low,high", [
    ([37, 11], [11, 1], "float32", -1.0, 1.0), ([5, 40], [1, 5], "bfloat16", 0.1, 1.1),
    ([6, 50], [0, 1], "float16", -1.0, 1.0),  # stride 0: an expanded (overlapping) layout
    ([9, 9], [3, 1], "float32", -1.0, 1.0),  # rows overlap
    ([300], [2], "complex64", -1.0, 1.0),  # gaps between the elements
    ([17, 13], [13, 1], "int64", 0, 16), ([251], [1], "int32", 3, 9), ([20, 20], [1, 0], "bool", 0, 2),
])
def test_chunked_draws_are_bitwise_the_one_buffer_draw(shape: list[int], stride: list[int], dtype: str,
                                                       low: float, high: float) -> None:
    n = storage_span(shape, stride)
    for chunk in (7, 64, n - 1, n, 1 << 22):  # many chunks, a last chunk of 1, exactly one, the default
        got = make_tensor(shape, stride, dtype, low, high, 5, chunk=chunk)
        want = _one_buffer(shape, stride, dtype, low, high, 5)
        assert torch.equal(got.as_strided((n,), (1,)), want.as_strided((n,), (1,))), (dtype, chunk)


def test_the_default_chunk_splits_a_big_draw_without_changing_it() -> None:
    n = (1 << 22) + 1000  # two chunks at the default size
    assert torch.equal(make_tensor([n], [1], "float32", -1.0, 1.0, 3), _one_buffer([n], [1], "float32", -1.0, 1.0, 3))


# the whole-zoo aot_eager probe errors (CPU eager rejected the random inputs too), as their store keys recorded them
def _t(dtype: str, shape: list[int]) -> dict[str, Any]:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return {"__tensor__": {"dtype": dtype, "shape": shape, "stride": stride}}


ZOO_PROBE_ERRORS = [
    ("aten.masked_scatter.default", [_t("float32", [1, 1040, 512]), _t("bool", [1, 1040, 1]), _t("float32", [1, 256, 512])]),
    ("aten.masked_scatter.default", [_t("float32", [1, 2384, 256]), _t("bool", [1, 2384, 1]), _t("float32", [1, 50, 1024])]),
    ("aten.masked_scatter.default", [_t("float32", [1, 20, 256]), _t("bool", [1, 20, 1]), _t("float32", [4, 256])]),
    ("aten.masked_scatter.default", [_t("float32", [1, 20, 512]), _t("bool", [1, 20, 1]), _t("float32", [4, 512])]),
    ("aten.masked_scatter.default", [_t("float32", [1, 4112, 256]), _t("bool", [1, 4112, 1]), _t("float32", [1, 256, 256])]),
    ("aten.masked_scatter.default", [_t("float32", [1, 272, 1280]), _t("bool", [1, 272, 1]), _t("float32", [21, 1280])]),
    ("aten.index_put.default", [_t("float32", [1, 20, 512]), [_t("bool", [1, 20])], _t("float32", [4, 512])]),
    ("aten._embedding_bag.default", [_t("float32", [4096, 288]), _t("int64", [256]), _t("int64", [16]), False, 0, False,
                                     _t("float32", [256])]),
]


def _cpu(op: str, args: list[Any], seed: int = 99) -> tuple[Any, list[torch.Tensor]]:
    from ci_runner.modes.ops.probe import assemble

    a, k = with_ranges(op, args, {})
    tensors = build_tensors(a, k, seed)
    fn = resolve_op({"op": op})
    ca, ck = assemble(a, k, tensors, "cpu")
    return fn(*ca, **ck), tensors


@pytest.mark.parametrize("op,args", ZOO_PROBE_ERRORS, ids=[f"{op.split('.')[1]}-{i}" for i, (op, _) in
                                                            enumerate(ZOO_PROBE_ERRORS)])
def test_inputs_keep_the_op_contracts_cpu_eager_checks(op: str, args: list[Any]) -> None:
    out, tensors = _cpu(op, args)  # raised before: source < ones in mask, value shape mismatch, offsets[0] != 0
    assert select_outputs(out, None) is not None
    if "masked_scatter" in op:  # as many Trues as the source fills, not fewer: the op still scatters
        mask, source, this = tensors[1], tensors[2], tensors[0]
        assert int(mask.expand_as(this).sum()) == source.numel() - source.numel() % this.shape[-1]


def test_masks_offsets_and_their_limits() -> None:
    # a stride-0 mask: each stored element shows 5 times, so at most 12 Trues means at most 2 stored ones
    m = make_tensor([4, 5], [1, 0], "bool", 0, 2, 3, trues=12)
    assert m.stride() == (1, 0) and int(m.sum()) <= 12 and int(m.sum()) % 5 == 0 and int(m.sum()) >= 10
    assert int(make_tensor([3, 7], [7, 1], "bool", 0, 2, 3, trues=9).sum()) == 9
    assert not torch.equal(make_tensor([40], [1], "bool", 0, 2, 3, trues=9), make_tensor([40], [1], "bool", 0, 2, 4, trues=9))
    off = make_tensor([16], [1], "int64", 0, 257, 8, offsets=True)
    assert int(off[0]) == 0 and bool((off[1:] >= off[:-1]).all()) and int(off.max()) <= 256
    strided = make_tensor([6], [3], "int64", 0, 11, 8, offsets=True)
    assert int(strided[0]) == 0 and bool((strided[1:] >= strided[:-1]).all())
    # an embedding_bag with its last offset included: the offsets stay within the indices too
    _cpu("aten._embedding_bag.default", [_t("float32", [50, 4]), _t("int64", [30]), _t("int64", [9]), False, 0,
                                         False, None, True])
    # no value of `values` says how many: the mask stays random; a mask too small for `values`: left to CPU eager
    a, _ = with_ranges("aten.index_put.default", [_t("float32", [4, 8]), [_t("bool", [4])], _t("float32", [1, 8])], {})
    assert "trues" not in a[1][0]["__tensor__"]
    a, _ = with_ranges("aten.index_put.default", [_t("float32", [4, 8]), [_t("bool", [4])], _t("float32", [9, 8])], {})
    assert "trues" not in a[1][0]["__tensor__"]


def test_a_repro_script_rebuilds_exactly_the_probe_inputs() -> None:
    op, args = ZOO_PROBE_ERRORS[6][0], [*ZOO_PROBE_ERRORS[6][1]]
    for op, args in (ZOO_PROBE_ERRORS[2], ZOO_PROBE_ERRORS[6], ZOO_PROBE_ERRORS[7]):
        a, k = with_ranges(op, args, {})
        lines, names, _ = call_source(a, k)
        assert any("trues=" in ln or "offsets=True" in ln for ln in lines), lines
        scope: dict[str, Any] = {"torch": torch, "SEED": 1234}
        exec("\n\n".join(plain_source(f) for f in SCRIPT_FUNCTIONS) + "\n" + "\n".join(lines), scope)  # noqa: S102
        for name, built in zip(names, build_tensors(a, k, 1234)):
            assert torch.equal(scope[name], built), (op, name)


def test_input_bytes_count_the_storage_each_layout_spans() -> None:
    args = [_t("float32", [1024, 256]), {"__tensor__": {"dtype": "bfloat16", "shape": [8, 4096], "stride": [0, 1]}},
            {"__tensor__": {"dtype": "int64", "shape": [10], "stride": [3]}}, 2.0]
    assert input_bytes(args, {"out": _t("bool", [5])}) == 1024 * 256 * 4 + 4096 * 2 + 28 * 8 + 5
    assert input_bytes([_t("no_such_dtype", [8]), _t("int8", [0, 4])], {}) == 0  # left to the child to report
    probe = {"id": "s1", "op": "aten.embedding.default", "args": [_t("float32", [262144, 8960]), _t("int64", [1, 16])],
             "kwargs": {}}
    why = too_big(probe, 1024)
    assert why and "8,960 MB" in why and "ops.max_probe_input_mb = 1024" in why and "raise ops.max_probe_input_mb" in why
    assert too_big(probe, 0) is None and too_big(probe, 9000) is None


def test_the_parent_leaves_out_a_probe_over_the_limit_without_a_child(tmp_path: Path) -> None:
    from ci_runner.modes.ops.signature import OpSignature, signature_key
    from ci_runner.modes.ops.store import ProbeStore, probe_signatures, store_identity

    opts = parse_options("ops", {"max_probe_input_mb": 0.5})
    spec = BackendSpec(id="aot", compile="aot_eager")
    args = [_t("float32", [1024, 256]), _t("int64", [1, 16])]  # 1 MB of weight
    sig = OpSignature(op="aten.embedding.default", args=args, kwargs={}, key=signature_key("aten.embedding.default",
                                                                                           args, {}))
    got = probe_signatures(spec, [sig], store_dir=tmp_path / "store", opts=opts, work_dir=tmp_path / "work")
    o = got[sig.key]
    assert o.status is OpStatus.NOT_RUN and "1 MB, over ops.max_probe_input_mb = 0.5" in o.message
    assert not o.is_finding and not (tmp_path / "work").exists()  # no child started
    # not stored: a later run with a higher limit probes it
    assert ProbeStore(tmp_path / "store", store_identity(spec, opts)).get(sig.key) is None
    runner = ProbeRunner(backend_spec=spec, work_dir=tmp_path / "w2", opts=opts, remaining=lambda: 60.0)
    assert runner.run([{"id": "a", "op": sig.op, "args": args, "kwargs": {}}])["a"].status is OpStatus.NOT_RUN


def test_a_group_holds_no_more_inputs_than_the_limit() -> None:
    from ci_runner.modes.ops.grouptest import plan_tasks

    probes = [{"id": i, "op": "aten.neg.default", "args": [_t("float32", [n, 256])], "kwargs": {}}
              for i, n in enumerate([512, 512, 512, 2048, 64, 64])]  # 0.5, 0.5, 0.5, 2, 0.0625, 0.0625 MB
    assert [[p["id"] for p in t] for t in plan_tasks(probes, 8, 1.0 * 2**20)] == [[0, 1], [2], [3], [4, 5]]
    assert [[p["id"] for p in t] for t in plan_tasks(probes, 8, 0)] == [[0, 1, 2, 3, 4, 5]]


def test_the_limit_is_an_ops_option_checked_at_load() -> None:
    from ci_runner.errors import ConfigError

    assert parse_options("ops", {}).max_probe_input_mb == 1024
    assert parse_options("ops", {"max_probe_input_mb": 0}).max_probe_input_mb == 0
    with pytest.raises(ConfigError, match="max_probe_input_mb"):
        parse_options("ops", {"max_probe_input_mb": -1})
    with pytest.raises(ConfigError, match="did you mean"):
        parse_options("ops", {"max_probe_input_md": 10})


def test_probes_not_run_make_the_mode_inconclusive_not_a_pass() -> None:
    from ci_runner.modes.ops.mode import _status

    rows = [{"op": "aten.embedding.default", "status": "not_run"}, {"op": "aten.add.Tensor", "status": "pass"}]
    status, reason = _status(rows, {"pass": 1, "not_run": 1}, has_findings=False, setup_error=None)
    assert status == "inconclusive" and "ops.max_probe_input_mb" in (reason or "")
    assert _status(rows, {"pass": 1, "not_run": 1}, has_findings=True, setup_error=None)[0] == "fail"
    assert json.dumps(_status(rows, {"pass": 2}, has_findings=False, setup_error=None)) == '["pass", null]'


def test_a_bool_mask_index_put_is_compared_a_repeated_index_is_not() -> None:
    from ci_runner.modes.ops.compare import no_compare_reason

    x, mask = torch.zeros(1, 20, 8), torch.zeros(1, 20, dtype=torch.bool)
    mask[0, 3:7] = True  # each place once, though every value of the mask is 0 or 1
    assert no_compare_reason("aten.index_put.default", [x, [mask], torch.zeros(4, 8)], {}) is None
    twice = [torch.tensor([0, 0]), torch.tensor([1, 1])]
    assert "repeated" in (no_compare_reason("aten.index_put.default", [x, twice, torch.zeros(2, 8)], {}) or "")


def test_the_reference_copies_only_the_inputs_of_an_op_that_writes_them() -> None:
    from ci_runner.modes.ops.probe import reference_inputs

    built = [torch.ones(3), torch.ones(3)]
    assert reference_inputs(torch.ops.aten.add.Tensor, built) is built  # holds its inputs once
    for op in (torch.ops.aten.add_.Tensor, torch.ops.aten.add.out, torch.nn.functional.relu):  # writes, or unknown
        copied = reference_inputs(op, built)
        assert all(torch.equal(c, b) and c.data_ptr() != b.data_ptr() for c, b in zip(copied, built))


def test_the_store_neither_keeps_nor_reuses_a_probe_whose_inputs_cpu_eager_rejects(tmp_path: Path) -> None:
    from ci_runner.modes.ops.outcome import CPU_FAILS_TOO, OpOutcome
    from ci_runner.modes.ops.signature import OpSignature, signature_key
    from ci_runner.modes.ops.store import ProbeStore, probe_through

    store = ProbeStore(tmp_path, {"backend": "test"})
    invalid = OpOutcome(status=OpStatus.PROBE_ERROR, message=f"{CPU_FAILS_TOO} (RuntimeError: offsets[0] …): …")
    store.put("k-old", invalid)  # as an earlier version stored it: probed again now
    assert store.get("k-old") is None
    store.put("k-unresolved", OpOutcome(status=OpStatus.PROBE_ERROR, message="cannot resolve aten.nope"))
    assert store.get("k-unresolved") is not None  # a probe error that is a finding stays
    args = [_t("float32", [4])]
    sig = OpSignature(op="aten.neg.default", args=args, kwargs={}, key=signature_key("aten.neg.default", args, {}))
    got = probe_through(store, [sig], lambda b: {s.key: invalid for s in b}, remaining=lambda: 10.0)
    assert got[sig.key] is invalid and not (tmp_path / store.dir.name / f"{store.name(sig.key)}.json").exists()
