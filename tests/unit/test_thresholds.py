"""thresholds.py: derivation from reference statistics, floors, the versioned keyed file (its lock across processes:
`tests/integration/test_thresholds_lock.py`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ci_runner.errors import ConfigError, InputError
from ci_runner.registry import parse_options as parse
from ci_runner.modes.numerics.thresholds import (
    SCHEMA_VERSION,
    LayerStats,
    ThresholdOptions,
    ThresholdTable,
    add_views,
    exceeded,
    key_hash,
    load_or_derive,
    load_table,
    percentile,
    read_table,
    threshold_from_stats,
    threshold_key,
    threshold_path,
)

FP = {"id": "tiny", "source": "config", "model_type": "llama", "overrides": {"hidden_size": 32}}
INPUTS = {"batch": 1, "seq_len": 8, "samples": 2, "seed": 0, "image_size": None, "text": []}
REFS = [{"id": "cpu-fp32", "device": "cpu", "dtype": "float32"}, {"id": "cpu-fp64", "device": "cpu", "dtype": "float64"}]


def _stats(rels: list[float], *, absmean: float = 1.0, cls: str = "Linear", name: str = "a") -> LayerStats:
    s = LayerStats(module_class=cls, name=name)
    for r in rels:
        for view in ("cumulative", "isolated"):
            s.add(view, {"rel": r, "cos": 1 - r * r / 2, "mad": r * absmean, "ref_absmean": absmean})
    return s


def test_percentile_matches_numpy_linear() -> None:
    xs = [3.0, 1.0, 2.0, 10.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 100) == 10.0
    assert percentile(xs, 99) == pytest.approx(3.0 + 0.97 * 7.0)
    assert percentile([4.0], 99) == 4.0 and percentile([], 99) == 0.0
    assert percentile([1.0, math.nan], 50) == math.inf


def test_threshold_is_margin_times_percentile_with_floors() -> None:
    opts = ThresholdOptions(percentile=100, margin=8)
    s = _stats([1e-5, 2e-5])
    thr = threshold_from_stats(s.views["cumulative"], opts, "float32")
    assert thr["rel"] == pytest.approx(8 * 2e-5)
    assert thr["mad"] == pytest.approx(8 * 2e-5)
    assert 1 - thr["cos"] == pytest.approx(64 * (2e-5) ** 2 / 2, rel=1e-6)
    # references that agree exactly: the floors (64 ulp of float32) hold
    z = threshold_from_stats(_stats([0.0, 0.0], absmean=3.0).views["isolated"], opts, "float32")
    assert z["rel"] == pytest.approx(64 * 2 ** -23)
    assert z["mad"] == pytest.approx(64 * 2 ** -23 * 3.0)
    assert 1 - z["cos"] == pytest.approx((64 * 2 ** -23) ** 2)
    # explicit floors and a float64 primary
    f = threshold_from_stats(_stats([0.0]).views["isolated"], ThresholdOptions(rel_floor=1e-3, mad_floor=0, cos_floor=0), "float32")
    assert f == {"rel": 1e-3, "cos": 1.0, "mad": 0.0}
    assert threshold_from_stats(_stats([0.0]).views["isolated"], ThresholdOptions(), "float64")["rel"] == pytest.approx(64 * 2 ** -52)


def test_exceeded_reads_each_metric_in_its_direction_and_nan_fails() -> None:
    thr = {"rel": 1e-4, "cos": 0.9999, "mad": 1e-3}
    assert exceeded({"rel": 1e-5, "cos": 0.99999, "mad": 1e-4}, thr) == []
    assert exceeded({"rel": 1e-3, "cos": 0.99999, "mad": 1e-4}, thr) == ["rel"]
    assert exceeded({"rel": 1e-5, "cos": 0.99, "mad": 1e-2}, thr) == ["cos", "mad"]
    assert exceeded({"rel": math.nan, "cos": 1.0, "mad": 0.0}, thr) == ["rel"]
    assert exceeded({"rel": math.inf, "cos": 1.0, "mad": math.inf}, thr) == ["rel", "mad"]


def test_options_validation() -> None:
    o = parse("numerics", {"percentile": 95, "margin": "4", "samples": 3}).thresholds
    assert (o.percentile, o.margin, o.samples) == (95.0, 4.0, 3)
    for bad in ({"percentile": 0}, {"percentile": 101}, {"margin": 0.5}, {"rel_floor": -1}, {"samples": 0},
                {"samples": 1.5}, {"margin": "x"}):
        with pytest.raises(ConfigError):
            parse("numerics", bad)


def test_key_and_path() -> None:
    k1 = threshold_key(model_fingerprint=FP, inputs=INPUTS, references=REFS, samples=2)
    k2 = threshold_key(model_fingerprint=FP, inputs={**INPUTS, "seed": 1}, references=REFS, samples=2)
    k3 = threshold_key(model_fingerprint=FP, inputs=INPUTS, references=REFS[:1], samples=2)
    assert len({key_hash(k1), key_hash(k2), key_hash(k3)}) == 3
    assert key_hash(k1) == key_hash(json.loads(json.dumps(k1)))
    p = threshold_path(Path("/x"), "my model/v2", k1)
    assert p.parent == Path("/x") and p.name == f"my_model_v2-{key_hash(k1)}.json"


def test_load_or_derive_reuses_matching_key_and_rederives_otherwise(tmp_path: Path) -> None:
    calls: list[int] = []

    def derive() -> dict[str, LayerStats]:
        calls.append(1)
        return {"a": _stats([1e-5, 3e-5]), "b#1": _stats([0.0], cls="Norm", name="b")}

    key = threshold_key(model_fingerprint=FP, inputs=INPUTS, references=REFS, samples=2)
    path = threshold_path(tmp_path, "tiny", key)
    t1, note1 = load_or_derive(path, key, ThresholdOptions(), "float32", derive)
    assert not t1.reused and note1.startswith("derived") and len(calls) == 1
    data = json.loads(path.read_text())
    assert data["schema_version"] == SCHEMA_VERSION and data["key"] == key
    assert set(data["layers"]) == {"a", "b#1"} and "thresholds" in data["layers"]["a"]
    # same key: reused, and margin changes apply without re-deriving (raw statistics are stored)
    t2, note2 = load_or_derive(path, key, ThresholdOptions(margin=2), "float32", derive)
    assert t2.reused and note2.startswith("reused") and len(calls) == 1
    assert t2.get("a", "cumulative")[0]["rel"] == pytest.approx(max(64 * 2 ** -23, 2 * percentile([1e-5, 3e-5], 99)))
    # a different key in the same file name (tampered) or a corrupt file: derived again
    other = {**key, "samples": 5}
    _t3, note3 = load_or_derive(path, other, ThresholdOptions(), "float32", derive)
    assert note3.startswith("derived") and "key differs" in note3 and len(calls) == 2
    path.write_text("{not json")
    _t4, note4 = load_or_derive(path, other, ThresholdOptions(), "float32", derive)
    assert "unreadable" in note4 and len(calls) == 3
    assert read_table(path, other, ThresholdOptions())[0] is not None


def _one_view(stats: LayerStats, view: str) -> LayerStats:
    return LayerStats(module_class=stats.module_class, name=stats.name, views={view: stats.views[view]})


def test_a_view_derived_later_is_added_to_the_file_and_schema_1_files_stay_readable(tmp_path: Path) -> None:
    key = threshold_key(model_fingerprint=FP, inputs=INPUTS, references=REFS, samples=2)
    path = threshold_path(tmp_path, "tiny", key)
    full = {"a": _stats([1e-5, 3e-5]), "b": _stats([2e-6], cls="Norm", name="b")}
    calls: list[str] = []

    def derive(view: str):  # type: ignore[no-untyped-def]
        def run() -> dict[str, LayerStats]:
            calls.append(view)
            return {k: _one_view(s, view) for k, s in full.items()}
        return run

    table, _ = load_or_derive(path, key, ThresholdOptions(), "float32", derive("cumulative"), views=["cumulative"])
    assert table.views == ("cumulative",) and json.loads(path.read_text())["views"] == ["cumulative"]
    assert read_table(path, key, ThresholdOptions())[0].views == ("cumulative",)  # type: ignore[union-attr]
    assert table.get("a", "isolated")[1] == "fallback"
    other, _ = load_or_derive(path, key, ThresholdOptions(), "float32", derive("cumulative"))  # another cell
    assert other.reused and other.views == ("cumulative",)
    assert add_views(table, ["isolated"], derive("isolated")) == "isolated view derived"
    assert table.views == ("cumulative", "isolated") and calls == ["cumulative", "isolated"]
    assert table.get("a", "isolated") == (threshold_from_stats(full["a"].views["isolated"], ThresholdOptions(),
                                                               "float32"), "derived")
    stored = json.loads(path.read_text())
    assert stored["views"] == ["cumulative", "isolated"] and stored["layers"]["a"]["stats"] == full["a"].views
    # the other cell finds the added view in the file: not derived again
    assert add_views(other, ["isolated"], derive("isolated")).startswith("isolated view reused")
    assert calls == ["cumulative", "isolated"] and other.layers["b"].views == full["b"].views
    assert add_views(other, ["isolated", "cumulative"], derive("isolated")) == ""
    # schema 1 (no `views`): the views its statistics hold
    del stored["views"]
    path.write_text(json.dumps({**stored, "schema_version": 1}))
    assert read_table(path, key, ThresholdOptions())[0].views == ("cumulative", "isolated")  # type: ignore[union-attr]
    only = {**stored, "schema_version": 1,
            "layers": {k: {**v, "stats": {"cumulative": v["stats"]["cumulative"]}} for k, v in stored["layers"].items()}}
    path.write_text(json.dumps(only))
    assert load_table(path).views == ("cumulative",)


def test_fallback_threshold_for_unmeasured_calls() -> None:
    table = ThresholdTable(layers={"l.0.norm": _stats([1e-4], cls="Norm", name="l.0.norm"),
                                   "l.0.proj": _stats([1e-6], cls="Linear", name="l.0.proj")},
                           options=ThresholdOptions(margin=1, percentile=100), primary_dtype="float32", key={})
    thr, src = table.get("l.0.norm", "isolated")
    assert src == "derived" and thr["rel"] == pytest.approx(1e-4)
    thr, src = table.get("l.0.norm#1", "isolated")  # a second call never measured: same module's threshold
    assert src == "fallback" and thr["rel"] == pytest.approx(1e-4)
    thr, src = table.get("unknown", "cumulative")  # loosest of the view
    assert src == "fallback" and thr["rel"] == pytest.approx(1e-4)
    empty = ThresholdTable(layers={}, options=ThresholdOptions(), primary_dtype="float32", key={})
    assert empty.get("x", "isolated")[0]["rel"] == pytest.approx(64 * 2 ** -23)


def test_load_table_errors(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not found"):
        load_table(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(InputError, match="schema_version"):
        load_table(bad)


def test_non_finite_reference_spread_is_stored_read_back_and_bounds_nothing(tmp_path: Path) -> None:
    """Issue 45 (GPT-OSS): the isolated view's statistics held inf and adding them crashed the mode with
    "Out of range float values are not JSON compliant: inf"; now they are stored as "inf"/"nan", read back as
    floats, and the layer gets a threshold from its finite samples (none: the floors), saying how many were not."""
    key = threshold_key(model_fingerprint=FP, inputs=INPUTS, references=REFS, samples=3)
    path = threshold_path(tmp_path, "tiny", key)
    sinks = LayerStats(module_class="GptOssAttention", name="l.0.attn")
    for rel in (2e-6, math.inf, 4e-6):
        sinks.add("cumulative", {"rel": rel, "cos": 1.0, "mad": rel, "ref_absmean": 1.0})
    only_inf = LayerStats(module_class="GptOssAttention", name="l.1.attn")
    only_inf.add("cumulative", {"rel": math.inf, "cos": math.nan, "mad": math.nan, "ref_absmean": math.inf})
    table, _ = load_or_derive(path, key, ThresholdOptions(percentile=100, margin=8), "float32",
                              lambda: {"a": _stats([1e-6]), "sinks": sinks, "inf": only_inf}, views=["cumulative"])
    iso = {"sinks": LayerStats(module_class="GptOssAttention", name="l.0.attn")}
    iso["sinks"].add("isolated", {"rel": math.inf, "cos": 0.5, "mad": math.inf, "ref_absmean": 2.0})
    add_views(table, ["isolated"], lambda: iso)  # the crash of issue 45 was here
    stored = json.loads(path.read_text())  # strict JSON: no bare Infinity/NaN
    assert stored["layers"]["sinks"]["stats"]["cumulative"]["rel"][1] == "inf"
    assert stored["layers"]["inf"]["stats"]["cumulative"]["mad"] == ["nan"]
    back = load_table(path, ThresholdOptions(percentile=100, margin=8))
    assert back.layers["sinks"].views["cumulative"]["rel"][1] == math.inf
    assert math.isnan(back.layers["inf"].views["cumulative"]["mad"][0])
    thr, source = back.get("sinks", "cumulative")
    assert source == "derived" and thr["rel"] == pytest.approx(8 * 4e-6) and thr["ref_nonfinite"] == 1
    assert all(math.isfinite(thr[k]) for k in ("rel", "cos", "mad"))
    none_finite = back.get("inf", "cumulative")[0]
    assert none_finite["rel"] == pytest.approx(64 * 2 ** -23) and none_finite["ref_nonfinite"] == 1
    assert back.get("sinks", "isolated")[0]["ref_nonfinite"] == 1
    # a verdict, not a crash: a target matching the primary reference passes, one off by inf is flagged
    assert exceeded({"rel": 1e-6, "cos": 1.0, "mad": 1e-6}, thr) == []
    assert exceeded({"rel": math.inf, "cos": 1.0, "mad": math.inf}, thr) == ["rel", "mad"]
