"""modes/numerics.py building blocks on a small hand-written model: capture, dumps, both views, verdicts."""

from __future__ import annotations

from collections.abc import Callable
import collections
import dataclasses
import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ci_runner.errors import ConfigError, InputError
from ci_runner.engine import codec
from ci_runner.modes.numerics import store, target, verdict, views
from ci_runner.registry import parse_options as parse
from ci_runner.modes.numerics import capture as ncap
from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec
from ci_runner.modes.numerics.thresholds import ThresholdOptions, ThresholdTable
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.lin = nn.Linear(8, 8)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.lin(self.norm(x))) * 0.5  # own ops: the residual add and the scale


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None) -> dict[str, Any]:
        for b in self.blocks:
            x = b(x)
        x = self.shared(x)
        x = self.shared(torch.tanh(x))  # called twice: `shared` and `shared#1`
        return {"logits": self.head(x) * scale, "hidden": (x,), "past_key_values": None}


def _inputs() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(2, 3, 8, generator=g), "scale": 2.0, "mask": None}


@pytest.fixture()
def dump(tmp_path: Path) -> store.DumpReader:
    model = Toy().eval()
    ncap.record_reference(model, _inputs(), tmp_path / "ref", chunk_mb=0.0005)
    return store.DumpReader(tmp_path / "ref")


# ------------------------------------------------------------------------------------------ dumps

def test_reference_dump_records_every_call_with_its_caller(dump: store.DumpReader) -> None:
    keys = [c["key"] for c in dump.calls]
    assert keys == ["", "blocks.0", "blocks.0.norm", "blocks.0.lin", "blocks.0.act", "blocks.1", "blocks.1.norm",
                    "blocks.1.lin", "blocks.1.act", "shared", "shared#1", "head"]
    by = dump.by_key
    assert by["blocks.1.lin"]["parent"] == by["blocks.1"]["idx"]
    assert by["shared#1"]["parent"] == 0 and by["shared#1"]["call_index"] == 1
    assert [c["key"] for c in dump.children(by[""])] == ["blocks.0", "blocks.1", "shared", "shared#1", "head"]
    # completion order: children finish before their parent
    assert by["blocks.0.act"]["done"] < by["blocks.0"]["done"] < by[""]["done"]
    assert by[""]["compare"].keys() == {"logits", "hidden.0"}  # the cache entry is skipped
    assert len(dump.index["files"]) > 1  # tiny chunk size: several safetensors files


def test_dump_round_trip_rebuilds_calls_and_outputs(dump: store.DumpReader) -> None:
    model = Toy().eval()
    args, kwargs = dump.inputs(dump.root())
    assert args == () and kwargs["scale"] == 2.0 and kwargs["mask"] is None
    assert torch.equal(kwargs["x"], _inputs()["x"])
    with torch.no_grad():
        out = model(**kwargs)
    ref = dump.output(dump.root())
    assert torch.equal(ref["logits"], out["logits"]) and isinstance(ref["hidden"], tuple)
    x1 = dump.inputs(dump.by_key["shared#1"])[0][0]
    assert torch.equal(x1, torch.tanh(dump.output(dump.by_key["shared"])))


def test_unchanged_tensors_are_stored_once_and_in_place_changes_are_not_missed(tmp_path: Path) -> None:
    w = store.DumpWriter(tmp_path / "d")
    t = torch.ones(4)
    k1 = w.put(t)
    assert w.put(t) == k1  # same object, same version: one copy
    t.add_(1)  # changed in place: stored again
    k2 = w.put(t)
    assert k2 != k1
    w.close()
    r = store.DumpReader(tmp_path / "d")
    assert torch.equal(r.get(k1), torch.ones(4)) and torch.equal(r.get(k2), torch.full((4,), 2.0))


def test_writer_buffers_at_most_one_chunk(tmp_path: Path) -> None:
    w = store.DumpWriter(tmp_path / "d", chunk_bytes=1000)
    peak = 0
    for _ in range(20):
        w.put(torch.randn(50))  # 200 bytes each
        peak = max(peak, w._buf_bytes)
    w.close()
    assert peak < 1000 and len(list((tmp_path / "d").glob("chunk-*.safetensors"))) >= 4


def test_encode_decode_values() -> None:
    from transformers.modeling_outputs import BaseModelOutput

    store: dict[str, torch.Tensor] = {}

    def put(t: torch.Tensor) -> str:
        store[f"k{len(store)}"] = t
        return f"k{len(store) - 1}"

    Pair = collections.namedtuple("Pair", "a b")
    value = {"t": torch.ones(2), "mo": BaseModelOutput(last_hidden_state=torch.zeros(1)), "f": math.nan,
             "dt": torch.float16, "dev": torch.device("cpu"), "s": slice(1, None), "p": Pair(1, [2, None])}
    spec = codec.encode_value(value, put)  # numerics' inputs policy: rebuilt exactly or refused
    back = codec.decode_value(spec, store.__getitem__)
    assert isinstance(back["mo"], BaseModelOutput) and torch.equal(back["mo"].last_hidden_state, torch.zeros(1))
    assert math.isnan(back["f"]) and back["dt"] is torch.float16 and back["s"] == slice(1, None)
    assert back["p"] == (1, [2, None])
    with pytest.raises(codec.Unstorable):
        codec.encode_value(object(), put)
    assert codec.encode_value(object(), put, opaque=True) == {"__opaque__": "object"}  # outputs


def test_corrupt_or_missing_dump_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a complete numerics dump"):
        store.DumpReader(tmp_path)
    (tmp_path / "index.json").write_text('{"schema_version": 7}')
    with pytest.raises(InputError, match="schema"):
        store.DumpReader(tmp_path)


# ------------------------------------------------------------------------------------------ views

def _collect() -> tuple[list[dict[str, Any]], Any]:
    recs: list[dict[str, Any]] = []
    return recs, recs.append


def test_isolated_view_measures_only_each_modules_own_ops(dump: store.DumpReader) -> None:
    model = Toy().eval()
    recs, emit = _collect()
    views.run_isolated_view(dict(model.named_modules()), dump, lambda _n, m: m, emit)
    assert {r["key"] for r in recs} == {c["key"] for c in dump.calls}
    assert all(r["metrics"]["rel"] == 0.0 for r in recs)  # the reference against itself: exact

    # a "backend" that gets blocks.1.lin wrong: only that module is off in the isolated view (its parent's
    # sub-call is stubbed with the reference's output), while the cumulative view carries the error on
    def runner(name: str, m: nn.Module) -> Any:
        if name == "blocks.1.lin":
            return lambda *a, **k: m(*a, **k) * 1.01
        return m

    recs, emit = _collect()
    views.run_isolated_view(dict(model.named_modules()), dump, runner, emit)
    off = {r["key"] for r in recs if r["metrics"]["rel"] > 0}
    assert off == {"blocks.1.lin"}
    assert not any(m.__dict__.get("forward") for m in model.modules())  # stubs removed

    bad = copy.deepcopy(model)
    with torch.no_grad():
        bad.blocks[1].lin.weight.mul_(1.01)
    recs, emit = _collect()
    args, kwargs = dump.inputs(dump.root())
    ncap.capture_layer_outputs(bad, args, kwargs, ncap.CompareSink(dump, emit))
    cum_off = {r["key"] for r in recs if r["metrics"]["rel"] > 0}
    assert cum_off == {"blocks.1.lin", "blocks.1.act", "blocks.1", "shared", "shared#1", "head", ""}


def test_isolated_view_records_failures_and_unstorable_inputs(tmp_path: Path) -> None:
    model = Toy().eval()
    kwargs = _inputs()
    ncap.record_reference(model, kwargs, tmp_path / "r")
    reader = store.DumpReader(tmp_path / "r")

    def runner(name: str, m: nn.Module) -> Any:
        if name == "head":
            raise RuntimeError("[vendor] unsupported operator aten.addmm.default")
        return m

    recs, emit = _collect()
    views.run_isolated_view(dict(model.named_modules()), reader, runner, emit, skip={"blocks.0"})
    by = {r["key"]: r for r in recs}
    assert "blocks.0" not in by
    assert by["head"]["stage"] == "compile" and "unsupported operator" in by["head"]["error"]
    assert by["shared#1"]["metrics"]["rel"] == 0.0


def test_derive_reference_stats_float64_against_float32(tmp_path: Path) -> None:
    model = Toy().eval()
    f64 = copy.deepcopy(model).double()
    ref = type("Ref", (), {"id": "cpu-fp64", "device": "cpu", "dtype": "float64"})()
    primary = type("Ref", (), {"id": "cpu-fp32", "device": "cpu", "dtype": "float32"})()

    def sample(s: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(s)
        return {"x": torch.randn(1, 2 + s, 8, generator=g)}

    stats = views.derive_reference_stats(model, primary, [(ref, f64)], sample, 3, tmp_path / "ref", keep=[0])
    assert (tmp_path / "ref" / "sample-0" / "index.json").exists() and not (tmp_path / "ref" / "sample-1").exists()
    lin = stats["blocks.1.lin"].views
    assert len(lin["cumulative"]["rel"]) == 3 and len(lin["isolated"]["rel"]) == 3
    assert all(0 < r < 1e-5 for r in lin["cumulative"]["rel"])
    assert stats["blocks.0"].module_class == "Block"


def _eager_backend() -> Any:
    """CPU eager as the matrix spells it (no `compile`)."""
    return resolve_backend(BackendSpec(id="cpu", device="cpu"))


def _compiled_backend(perturb: dict[str, Any] | None = None) -> Any:
    """aot_eager, or with `perturb` the plugin backend that perturbs an op (tests/fixtures/plugin_numerics_perturb)."""
    if perturb is None:
        return resolve_backend(BackendSpec(id="aot_eager", compile="aot_eager"))
    return resolve_backend(BackendSpec(id="perturb", compile="tests.fixtures.plugin_numerics_perturb:make",
                                       backend_options=perturb))


@pytest.mark.parametrize("backend", [_eager_backend(), _compiled_backend()], ids=["eager", "aot_eager"])
def test_compare_target_both_views(fresh_dynamo: Callable[[], None], tmp_path: Path, backend: Any) -> None:
    model = Toy().eval()
    ncap.record_reference(model, _inputs(), tmp_path / "r0")
    plan = target.TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(tmp_path / "r0"),),
                         results="", journal="")
    recs, emit = _collect()
    fresh_dynamo()
    target.compare_target(model, backend, plan, emit)
    cum = {r["key"]: r for r in recs if r["view"] == "cumulative" and "key" in r}
    iso = {r["key"]: r for r in recs if r["view"] == "isolated" and "key" in r}
    status = [r for r in recs if r["view"] == "cumulative" and "status" in r]
    assert status and status[0]["status"] == "ok" and status[0]["unobserved_count"] == 0
    assert set(cum) == set(iso) == {c["key"] for c in store.DumpReader(tmp_path / "r0").calls}
    assert max(r["metrics"]["rel"] for r in [*cum.values(), *iso.values()]) < 1e-6
    assert not any(m._forward_hooks for m in model.modules())  # the capture hooks are gone


def test_compiled_cumulative_view_sees_the_backends_own_values(fresh_dynamo: Callable[[], None], tmp_path: Path) -> None:
    model = Toy().eval()
    ncap.record_reference(model, _inputs(), tmp_path / "r0")
    plan = target.TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(tmp_path / "r0"),),
                         results="", journal="", views=("cumulative", "isolated"))
    recs, emit = _collect()
    fresh_dynamo()
    target.compare_target(model, _compiled_backend({"op": "aten.tanh.default", "scale": 1e-2}), plan, emit)
    cum_off = {r["key"] for r in recs if r["view"] == "cumulative" and r.get("metrics", {}).get("rel", 0) > 1e-4}
    iso = {r["key"]: r for r in recs if r["view"] == "isolated" and "key" in r}
    iso_off = {k for k, r in iso.items() if r.get("metrics", {}).get("rel", 0) > 1e-4}
    assert iso_off == {""}  # tanh is the root's own op ...
    assert iso[""]["via"] == "shared#1"  # ... whose result only feeds the second call of `shared`
    assert cum_off == {"shared#1", "head", ""}  # what runs after it in the compiled graph


def test_isolated_auto_runs_only_when_the_cumulative_view_flags(fresh_dynamo: Callable[[], None], tmp_path: Path) -> None:
    model = Toy().eval()
    ncap.record_reference(model, _inputs(), tmp_path / "r0")
    table = ThresholdTable(layers={}, options=ThresholdOptions(), primary_dtype="float32", key={})
    plan = target.TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(tmp_path / "r0"),),
                         results="", journal="", isolated="auto")
    fresh_dynamo()
    recs, emit = _collect()
    target.compare_target(model, _eager_backend(), plan, emit, table=table)
    status = [r for r in recs if r["view"] == "isolated"]
    assert len(status) == 1 and status[0]["status"] == "skipped"
    recs, emit = _collect()
    target.compare_target(model, _compiled_backend({"op": "aten.tanh.default", "scale": 1e-2}), plan, emit, table=table)
    assert any(r["view"] == "isolated" and "metrics" in r for r in recs)
    assert [r["status"] for r in recs if r["view"] == "isolated" and "status" in r] == ["done"]



def test_isolated_auto_reads_the_thresholds_file_of_the_plan(fresh_dynamo: Callable[[], None], tmp_path: Path) -> None:
    """In the child the table comes from the plan: its file and its threshold options (JSON, as the mode sends them)."""
    model = Toy().eval()
    ncap.record_reference(model, _inputs(), tmp_path / "r0")
    opts = parse("numerics", {"margin": 4})
    table = ThresholdTable(layers={}, options=opts.thresholds, primary_dtype="float32", key={})
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps(table.to_json()))
    plan = target.TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(tmp_path / "r0"),),
                             results="", journal="", isolated="auto", thresholds=str(path),
                             threshold_options=json.loads(json.dumps(opts.thresholds.as_dict())))
    fresh_dynamo()
    recs, emit = _collect()
    target.compare_target(model, _eager_backend(), plan, emit)
    status = [r for r in recs if r["view"] == "isolated"]
    assert len(status) == 1 and status[0]["status"] == "skipped"


# ------------------------------------------------------------------------------------------ verdicts

def _layer(name: str, done: int, cls: str = "Linear", cum: float = 0.0, iso: float = 0.0) -> Any:
    layer = verdict.Layer(key=name, name=name, module_class=cls, call_index=0, idx=done, done=done, depth=name.count(".") + 1)
    layer.metrics = {"cumulative": {"rel": cum, "cos": 1.0, "mad": 0.0}, "isolated": {"rel": iso, "cos": 1.0, "mad": 0.0}}
    layer.exceeded = {"cumulative": ["rel"] if cum > 1e-3 else [], "isolated": ["rel"] if iso > 1e-3 else []}
    return layer


def test_verdict_kinds() -> None:
    none = verdict.verdict_of([_layer("a", 0), _layer("b", 1)], isolated_ran=True)
    assert none["kind"] is None and none["first_divergent"] is None

    drift = verdict.verdict_of([_layer("l.0", 0, cum=1e-4), _layer("l.1", 1, cum=2e-3), _layer("l.2", 2, cum=5e-3)], isolated_ran=True)
    assert drift["kind"] == "drift" and drift["first_divergent"] == "l.1" and "accumulated drift" in drift["text"]

    algo = verdict.verdict_of([_layer("m.0.attn", 0, cls="Attn", cum=1e-2, iso=1e-2), _layer("m.0", 1, cls="Layer", cum=1e-2),
                        _layer("m.1.attn", 2, cls="Attn", cum=1e-2)], isolated_ran=True)
    assert algo["kind"] == "algorithmic" and algo["first_divergent"] == "m.0.attn" and "m.0.attn (Attn)" in algo["text"]

    cls = verdict.verdict_of([_layer("m.0.norm", 0, cls="RMSNorm", cum=1e-2, iso=1e-2),
                       _layer("m.1.ln2", 1, cls="RMSNorm", cum=1e-2, iso=1e-2)], isolated_ran=True)
    assert cls["kind"] == "layer_class" and cls["pattern"] == "RMSNorm"

    path = verdict.verdict_of([_layer("m.0.ff_ln", 0, cls="A", iso=1e-2), _layer("m.1.ff_ln", 1, cls="B", iso=1e-2)],
                       isolated_ran=True)
    assert path["kind"] == "layer_class" and path["pattern"] == "m.*.ff_ln"


def test_rel_path() -> None:
    assert verdict.rel_path("model.layers.12.post_attention_layernorm") == "model.layers.*.post_attention_layernorm"
    assert verdict.rel_path("0.attn") == "*.attn" and verdict.rel_path("lm_head") == "lm_head"


def test_build_layers_aggregates_samples_and_flags(dump: store.DumpReader) -> None:
    table = ThresholdTable(layers={}, options=ThresholdOptions(rel_floor=1e-3), primary_dtype="float32", key={})
    recs = [
        {"view": "isolated", "sample": 0, "key": "head", "metrics": {"rel": 1e-4, "cos": 1.0, "mad": 0.0}},
        {"view": "isolated", "sample": 1, "key": "head", "metrics": {"rel": 5e-3, "cos": 1.0, "mad": 0.0}},
        {"view": "cumulative", "sample": 0, "key": "head", "error": "boom", "stage": "run"},
    ]
    layers = {l.key: l for l in verdict.build_layers(dump, recs, table)}
    assert layers["head"].metrics["isolated"]["rel"] == 5e-3 and layers["head"].flagged("isolated")
    assert layers["head"].errors["cumulative"] == "run: boom"
    rows = verdict.layer_table(list(layers.values()), cap=3)
    assert len(rows) == 3 and rows[0]["index"] == 0


def test_options() -> None:
    o = parse("numerics", {"margin": 4, "compare_samples": 2, "views": "isolated", "isolate": False})
    assert o.thresholds.margin == 4 and o.compare_samples == 2 and o.views == ("isolated",) and not o.isolate
    with pytest.raises(ConfigError, match="did you mean 'margin'"):
        parse("numerics", {"margn": 4})
    for bad in ({"views": ["sideways"]}, {"compare_samples": 0}, {"isolate": "yes"}, {"chunk_mb": -1}):
        with pytest.raises(ConfigError):
            parse("numerics", bad)


def test_compiled_capture_is_not_fooled_by_earlier_compiles(fresh_dynamo: Callable[[], None], tmp_path: Path) -> None:
    """Dynamo caches per code object and does not guard on hooks by default: a model compiled earlier without the
    capture hooks (a plain target run), or another instance of the same architecture, must still be observed."""
    fresh_dynamo()
    be = _compiled_backend()
    model = Toy().eval()
    with torch.no_grad():
        be.compile(model)(**_inputs())  # compiled once without any hooks
    ncap.record_reference(model, _inputs(), tmp_path / "a")
    plan = target.TargetPlan(model={}, backend={}, seed=0, dtype="float32", dumps=(str(tmp_path / "a"),), results="",
                         journal="", views=("cumulative",))
    for _ in range(2):
        recs, emit = _collect()
        target.compare_target(model, be, plan, emit)
        assert [r["unobserved_count"] for r in recs if "status" in r] == [0]
        assert len([r for r in recs if "metrics" in r]) == 12
    other = Toy().eval()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    ncap.record_reference(other, _inputs(), tmp_path / "b")
    plan_b = dataclasses.replace(plan, dumps=(str(tmp_path / "b"),))
    recs, emit = _collect()
    target.compare_target(other, be, plan_b, emit)
    assert max(r["metrics"]["rel"] for r in recs if "metrics" in r) < 1e-6  # its own weights, not the first model's


# --------------------------------------------------------------------------------------------- issue 14 fixes

def test_namedtuple_inputs_keep_their_fields() -> None:
    """A namedtuple argument is rebuilt as a namedtuple (field access works), not as a plain tuple."""
    import collections

    Pair = collections.namedtuple("Pair", ["hidden", "scale"])
    stored: dict[str, torch.Tensor] = {}

    def put(t: torch.Tensor) -> str:
        stored[f"t{len(stored)}"] = t
        return f"t{len(stored) - 1}"

    spec = codec.encode_value(Pair(torch.ones(2), 0.5), put)
    back = codec.decode_value(spec, stored.__getitem__)
    assert back._fields == ("hidden", "scale") and back.scale == 0.5 and torch.equal(back.hidden, torch.ones(2))
    assert codec.decode_value(codec.encode_value((1, 2), put), stored.__getitem__) == (1, 2)


def test_dump_writer_refuses_a_foreign_folder(tmp_path: Path) -> None:
    """The writer removes only a previous dump's files; a folder with anything else is refused, left intact."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("precious", encoding="utf-8")
    with pytest.raises(store.DumpFolderError, match="not empty and not a dump"):
        store.DumpWriter(home)
    assert (home / "thesis.tex").read_text(encoding="utf-8") == "precious"
    dump = tmp_path / "dump"
    w = store.DumpWriter(dump)
    w.put(torch.ones(3))
    w.close()
    again = store.DumpWriter(dump)  # a previous dump is replaced
    assert again.folder == dump and not any(dump.iterdir())


def test_reference_dump_is_reused_only_for_its_thresholds_key(tmp_path: Path) -> None:
    """A `sample-N` dump left by an earlier run (other thresholds key) is stale: it must be recorded again."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    folder = tmp_path / "sample-0"
    ncap.record_reference(model, {"input": torch.ones(1, 4)}, folder, meta=ncap.dump_meta(None, 0, key="old"))
    assert store.dump_matches(folder, "old")
    assert not store.dump_matches(folder, "new")
    assert not store.dump_matches(tmp_path / "absent", "old")


def _v1_index(tmp_path: Path) -> Path:
    """A reference dump as the schema-1 writer left it (call specs with keys t/v/f, inputs as a list and pairs)."""
    w = store.DumpWriter(tmp_path / "v1")
    t0, t1 = w.put(torch.arange(4.0)), w.put(torch.full((2,), 2.0))
    w.calls.append({
        "idx": 0, "key": "", "name": "", "module_class": "M", "call_index": 0, "parent": None, "depth": 0,
        "inputs": {"args": [{"t": t0}, {"f": "0.5"}, {"f": "inf"}],
                   "kwargs": [["mask", {"v": None}],
                              ["p", {"namedtuple": "Pair", "fields": ["a", "b"], "tuple": [{"t": t1}, {"v": 3}]}],
                              ["d", {"dict": [["x", {"list": [{"t": t0}, {"dtype": "float16"}]}]]}]]},
        "output": {"tuple": [{"t": t1}, {"opaque": "Foo"}]}, "compare": {"0": t1}, "done": 0})
    w.close()
    path = tmp_path / "v1" / "index.json"
    index = json.loads(path.read_text())
    path.write_text(json.dumps({**index, "schema_version": 1, "key": "k1"}))
    return tmp_path / "v1"


def test_reader_reads_the_golden_schema_2_dump(tmp_path: Path) -> None:
    """A dump written in the codec's earlier dialect (schema 2, `tests/fixtures/golden/numerics_dump_v2`, written by
    deepview-ci before the wire format was shared with op signatures) loads, every value as it was recorded."""
    import shutil

    folder = shutil.copytree(ROOT / "tests/fixtures/golden/numerics_dump_v2", tmp_path / "v2")
    assert json.loads((folder / "index.json").read_text())["schema_version"] == 2
    assert store.dump_matches(folder, "golden-v2")
    r = store.DumpReader(folder)
    x = torch.arange(6.0).reshape(2, 3)
    (x0, half, ninf, size), kw = r.inputs(r.root())
    assert torch.equal(x0, x) and (half, ninf, size) == (0.5, -math.inf, torch.Size([2, 3]))
    assert kw["mask"] is None and kw["p"]._fields == ("a", "b") and kw["p"].b == 3
    assert torch.equal(kw["p"].a, torch.full((2,), 2.0)) and torch.equal(kw["d"]["x"][0], x.t())
    assert kw["d"]["x"][1] is torch.float16 and kw["d"][1] == "one"
    assert kw["dev"] == torch.device("cpu") and kw["s"] == slice(1, None, 2)
    out = r.output(r.root())
    assert torch.equal(out[0], x * 2) and out[1] is None
    assert torch.equal(r.ref_tensors(r.root())["0"], x * 2)
    r.close()


def test_reader_reads_a_schema_1_dump(tmp_path: Path) -> None:
    """Dumps written before the call codec was shared (schema 1, keys t/v/f) stay readable and reusable."""
    folder = _v1_index(tmp_path)
    assert store.dump_matches(folder, "k1") and not store.dump_matches(folder, "k2")
    r = store.DumpReader(folder)
    (x, half, inf), kw = r.inputs(r.root())
    assert torch.equal(x, torch.arange(4.0)) and half == 0.5 and inf == math.inf
    assert kw["mask"] is None and kw["p"]._fields == ("a", "b") and kw["p"].b == 3
    assert torch.equal(kw["p"].a, torch.full((2,), 2.0)) and kw["d"]["x"][1] is torch.float16
    out = r.output(r.root())
    assert torch.equal(out[0], torch.full((2,), 2.0)) and out[1] is None
    assert torch.equal(r.ref_tensors(r.root())["0"], torch.full((2,), 2.0))


def test_reference_dump_is_schema_3_with_codec_specs(tmp_path: Path) -> None:
    """A recorded call stores its inputs in the one wire format (`codec.encode_call`); the reader rebuilds them."""
    Pair = collections.namedtuple("Pair", "a b")

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor, p: Any = None, scale: float = 1.0) -> torch.Tensor:
            return x * p.b * scale

    folder = tmp_path / "v3"
    writer = store.DumpWriter(folder)
    ncap.capture_layer_outputs(M(), (torch.ones(3),), {"p": Pair(torch.zeros(1), 2.0), "scale": 0.25},
                                  ncap.RecordingSink(writer))
    writer.close()
    index = json.loads((folder / "index.json").read_text())
    assert index["schema_version"] == store.DUMP_SCHEMA_VERSION == 3
    spec = index["calls"][0]["inputs"]
    assert set(spec) == {"args", "kwargs"} and "key" in spec["args"]["__tuple__"][0]["__tensor__"]
    assert dict(spec["kwargs"]["__dict__"])["scale"] == 0.25
    r = store.DumpReader(folder)
    (x,), kw = r.inputs(r.root())
    assert torch.equal(x, torch.ones(3)) and kw["p"]._fields == ("a", "b") and kw["p"].b == 2.0 and kw["scale"] == 0.25
    assert torch.equal(r.output(r.root()), torch.full((3,), 0.5))


def test_cast_copy_is_the_model_load_model_builds_in_float64() -> None:
    """The float64 reference of a config model is the float32 primary cast (no second build): the same parameters,
    buffers (rotary inv_freq included), tied weights and outputs as `load_model(dtype="float64")`."""
    from ci_runner.config import load_matrix_text
    from ci_runner.models.load import load_model
    from tests.fixtures.matrices import TINY_DECODER, matrix_text

    text = matrix_text(models=[{"id": "m", "config": "qwen2", "overrides": {**TINY_DECODER, "tie_word_embeddings": True}}],
                       backends=[{"id": "e", "compile": "aot_eager"}])
    spec = load_matrix_text(text).model("m")
    primary = load_model(spec, seed=0, dtype="float32").module
    built = load_model(spec, seed=0, dtype="float64").module
    cast = views.cast_copy(primary, torch.float64)
    for mine, theirs in ((dict(cast.named_parameters()), dict(built.named_parameters())),
                         (dict(cast.named_buffers()), dict(built.named_buffers()))):
        assert mine.keys() == theirs.keys()
        for k, t in theirs.items():
            assert mine[k].dtype == t.dtype and torch.equal(mine[k], t), k
    assert cast.lm_head.weight is cast.model.embed_tokens.weight
    assert primary.lm_head.weight.dtype == torch.float32  # the primary is left as it was
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(cast(input_ids=ids).logits, built(input_ids=ids).logits)
