"""The one call codec (`ci_runner.engine.codec`): round trips, the strict policy the layers mode needs, dedupe."""

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
    encode_call,
    encode_value,
)

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
    assert encode_value(object(), put, opaque=True) == {"opaque": "object"}
    assert decode_value({"opaque": "object"}, store) is None


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
