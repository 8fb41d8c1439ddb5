"""The one wire format (`ci_runner.engine.codec`): call round trips, the strict policy the layers mode needs, dedupe,
op-signature specs (their JSON is a signature's identity: a golden key), source, specs of the earlier dialect."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import pytest
import torch

from ci_runner.engine.codec import (
    TensorDedupe,
    TensorStore,
    Unstorable,
    call_tensor_keys,
    check_value,
    decode_call,
    decode_value,
    describe_value,
    encode_arg,
    encode_call,
    encode_value,
    source_of,
    tensor_specs,
    upgrade_call_v2,
)
from ci_runner.modes.ops.inputs import probe_seed
from ci_runner.modes.ops.signature import signature_key

Pair = collections.namedtuple("Pair", "a b")


def test_strict_round_trip_keeps_structure_strides_and_sharing() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    shared = torch.ones(3)
    args = (t, shared, None, 3, 2.5, float("inf"), "x", True)
    kwargs = {"pair": (shared, torch.tensor([1, 2])), "dtype": torch.float16, "dev": torch.device("cpu"),
              "size": torch.Size([2, 3]), "d": {"k": 1}}
    store = TensorStore()
    spec = encode_call(args, kwargs, store, strict=True, keep_strides=True)
    json.dumps(spec)
    assert len(store.tensors) == 3
    a, k = decode_call(spec, store.tensors)
    assert torch.equal(a[0], t) and a[0].stride() == t.stride()
    assert a[1] is k["pair"][0] and a[2:5] == (None, 3, 2.5) and math.isinf(a[5])
    assert k["dtype"] is torch.float16 and k["size"] == torch.Size([2, 3]) and k["d"] == {"k": 1}
    assert sorted(call_tensor_keys(spec)) == sorted(store.tensors)


@pytest.mark.parametrize("value, why", [
    (Pair(1, 2), "namedtuple Pair"),
    ({1: 2}, "non-string keys"),
    (collections.OrderedDict(a=1), "OrderedDict"),
    (slice(1, 2), "slice"),
    (torch.ones(2).to_sparse(), "sparse"),
    (object(), "object"),
])
def test_strict_refuses_what_cannot_be_replayed_exactly(value: object, why: str) -> None:
    with pytest.raises(Unstorable, match=why):
        encode_value(value, TensorStore(), strict=True)
    with pytest.raises(Unstorable):
        check_value({"x": [value]}, strict=True)


def test_lenient_policy_keeps_model_outputs_caches_namedtuples_and_marks_opaque() -> None:
    from transformers.modeling_outputs import BaseModelOutput

    class DynamicCache:
        pass

    store: dict[str, torch.Tensor] = {}

    def put(t: torch.Tensor) -> str:
        store[f"k{len(store)}"] = t
        return f"k{len(store) - 1}"

    value = {"mo": BaseModelOutput(last_hidden_state=torch.zeros(1)), "f": math.nan, "s": slice(1, None),
             "p": Pair(1, [2, None]), "c": DynamicCache(), 3: "int key"}
    spec = encode_value(value, put)
    back = decode_value(json.loads(json.dumps(spec)), store.__getitem__)
    assert isinstance(back["mo"], BaseModelOutput) and torch.equal(back["mo"].last_hidden_state, torch.zeros(1))
    assert math.isnan(back["f"]) and back["s"] == slice(1, None) and back["p"] == (1, [2, None])
    assert type(back["p"]).__name__ == "Pair" and back["p"]._fields == ("a", "b") and back["p"].b == [2, None]
    assert back["c"] is None and back[3] == "int key"
    with pytest.raises(Unstorable, match="object"):
        encode_value(object(), put)
    assert encode_value(object(), put, opaque=True) == {"__opaque__": "object"}
    assert decode_value({"__opaque__": "object"}, store) is None


def test_dedupe_finds_live_unchanged_views_only() -> None:
    d = TensorDedupe()
    t = torch.ones(4)
    d.remember(t, "k1")
    assert d.get(t) == "k1"
    assert d.get(t.view(4)) == "k1"  # another view of the same memory, same layout
    assert d.get(t[1:]) is None
    t.add_(1)  # changed in place: stored again
    assert d.get(t) is None


def test_dedupe_forgets_a_dead_tensor() -> None:
    d = TensorDedupe()
    t = torch.ones(4)
    d.remember(t, "k1")
    del t
    u = torch.ones(4)  # may reuse the same memory
    assert d.get(u) is None


def test_saved_store_loads_back(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    store = TensorStore()
    x = torch.randn(2, 3)
    spec = encode_call((x, x[:, 1:]), {}, store, strict=True, keep_strides=True)
    store.save(tmp_path / "in.safetensors")
    a, _ = decode_call(spec, load_file(str(tmp_path / "in.safetensors")))
    assert torch.equal(a[0], x) and torch.equal(a[1], x[:, 1:])


# An op signature's key feeds its probe's seed, finding fingerprints and repro names: this one was written by the
# op-signature encoder before the codec and the op signatures shared one format, and must never change.
GOLDEN_KEY = ('["aten.x.default",[{"__tensor__":{"dtype":"float32","shape":[3,2],"stride":[1,3]}},[1,2],'
              '{"__tuple__":[3,null]},1.5,{"__float__":"-inf"},{"__dtype__":"float16"},{"__device__":"cpu"},'
              '{"__layout__":"strided"},{"__memory_format__":"contiguous_format"},{"__slice__":[0,null,2]},'
              '{"__ellipsis__":true},{"__tuple__":[4]},true,"mean",{"__opaque__":"<class \'object\'>"}],'
              '{"dim":-1,"out":{"__tensor__":{"dtype":"int64","shape":[0],"stride":[1]}}},{"outputs":[0]}]')


def test_op_signature_specs_and_key_are_unchanged() -> None:
    values = (torch.empty(2, 3).t(), [1, 2], (3, None), 1.5, float("-inf"), torch.float16, torch.device("cpu"),
              torch.strided, torch.contiguous_format, slice(0, None, 2), Ellipsis, torch.Size([4]), True, "mean", object)
    args = [encode_arg(v) for v in values]
    kwargs = {"dim": encode_arg(-1), "out": encode_arg(torch.empty(0, dtype=torch.int64))}
    key = signature_key("aten.x.default", args, kwargs, [0])
    assert key == GOLDEN_KEY and probe_seed(key) == 314335644
    assert describe_value(args[0]) == "f32[3, 2]{stride=(1, 3)}" and describe_value(args[9]) == "0::2"


def test_described_tensors_decode_in_order_on_the_given_device() -> None:
    """A probe's call: the specs' tensors come from an iterator, in `tensor_specs` order; devices become its own."""
    args = [encode_arg(v) for v in (torch.ones(2), (torch.zeros(3), torch.device("meta")), [torch.float16, 2])]
    assert [s["shape"] for s in tensor_specs(args)] == [[2], [3]]
    made = [torch.full(tuple(s["shape"]), float(i)) for i, s in enumerate(tensor_specs(args))]
    a, (b, dev), c = decode_value(args, made, device="cpu")
    assert a is made[0] and b is made[1] and dev == torch.device("cpu") and c == [torch.float16, 2]
    with pytest.raises(ValueError, match="in order"):
        decode_value(args[0], {"k": torch.ones(2)})


def test_source_of_writes_what_decode_rebuilds() -> None:
    store = TensorStore()
    value = (torch.ones(2), [1, None, float("nan")], {"d": torch.float16}, slice(1, None), Ellipsis, torch.Size([2]))
    spec = encode_value(value, store)
    text = source_of(spec, lambda body: f"T[{body['key']!r}]", device="DEV")
    back = eval(text, {"torch": torch, "T": store.tensors, "DEV": torch.device("cpu")})  # noqa: S307 - our own text
    want = decode_value(spec, store.tensors)
    assert torch.equal(back[0], want[0]) and back[2:] == want[2:] and back[1][:2] == [1, None]
    assert math.isnan(back[1][2])


def test_specs_of_the_earlier_dialect_upgrade_to_the_same_values() -> None:
    """Dump schema 2 wrote `{"tensor": k}`, `{"value": x}`, `{"tuple": …}`, …: `upgrade_v2` reads them."""
    old = {"args": {"tuple": [{"tensor": "t0", "stride": [1, 2], "requires_grad": False}, {"value": 2},
                              {"float": "inf"}, {"size": [2]}, {"slice": [1, None, None]}]},
           "kwargs": {"dict": [["p", {"namedtuple": "Pair", "fields": ["a", "b"], "tuple": [{"value": None},
                                                                                          {"list": [{"dtype": "int8"}]}]}],
                               ["c", {"value": None, "cache": "DynamicCache"}], ["o", {"opaque": "Foo"}],
                               ["dev", {"device": "cpu"}]]}}
    x = torch.arange(4.0).reshape(2, 2)
    a, k = decode_call(upgrade_call_v2(old), {"t0": x})
    assert torch.equal(a[0], x) and a[0].stride() == (1, 2) and a[1:4] == (2, math.inf, torch.Size([2]))
    assert a[4] == slice(1, None) and k["p"]._fields == ("a", "b") and k["p"].b == [torch.int8]
    assert k["c"] is None and k["o"] is None and k["dev"] == torch.device("cpu")


def _static_cache() -> object:
    from transformers import LlamaConfig, StaticCache

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=64)
    cache = StaticCache(config=cfg, max_cache_len=6)
    for i in range(2):
        cache.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8), i, {"cache_position": torch.arange(3)})
    return cache


@pytest.mark.parametrize("make", ["dynamic", "static"])
def test_kv_caches_round_trip_by_their_state(make: str) -> None:
    """`kv=True` keeps a transformers cache's tensors and state (the memory repros' decode steps, issue 46): the
    rebuilt cache is of the same class, holds the same tensors and updates as the original does."""
    from transformers import DynamicCache

    if make == "dynamic":
        cache: object = DynamicCache()
        for i in range(2):
            cache.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8), i)  # type: ignore[attr-defined]
    else:
        cache = _static_cache()
    store = TensorStore()
    spec = encode_call((), {"cache": cache}, store.add, kv=True)
    json.dumps(spec)  # plain JSON
    assert encode_call((), {"cache": cache}, TensorStore().add)["kwargs"] == \
        {"__dict__": [["cache", {"__cache__": type(cache).__name__}]]}  # without kv: by name only, as before
    _, kwargs = decode_call(json.loads(json.dumps(spec)), store.tensors)
    back = kwargs["cache"]
    assert type(back) is type(cache) and describe_value(spec["kwargs"]) == f"{{cache: {type(cache).__name__}}}"
    for old, new in zip(cache.layers, back.layers):  # type: ignore[attr-defined]
        assert type(new) is type(old) and torch.equal(old.keys, new.keys) and torch.equal(old.values, new.values)
    k, v = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    extra = {"cache_position": torch.tensor([3])}
    assert all(torch.equal(a, b) for a, b in zip(cache.update(k, v, 0, extra), back.update(k, v, 0, extra)))


def test_a_cache_spec_imports_nothing_outside_transformers() -> None:
    """A results or repro file is data: a `__kv_cache__` or `__class__` naming another module rebuilds nothing."""
    assert decode_value({"__kv_cache__": {"class": "os:_wrap_close", "state": []}}, {}) is None
    assert decode_value({"__class__": "subprocess:Popen"}, {}) is None
    assert decode_value({"__kv_cache__": {"class": "transformers.nope:Nope", "state": []}}, {}) is None
    opaque = type("Odd", (), {})()
    cache = type("DynamicCache", (), {})()
    cache.layers = [opaque]  # type: ignore[attr-defined]  # a part no spec may name: the cache is kept by name
    assert encode_value(cache, TensorStore().add, kv=True) == {"__cache__": "DynamicCache"}
