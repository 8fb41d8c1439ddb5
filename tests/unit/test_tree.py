"""The one tensor-tree mapper (`ci_runner.models.tree`): every structure the modes hand it keeps its shape and type."""

from __future__ import annotations

import collections
from collections import OrderedDict

import pytest
import torch
from torch import nn

from ci_runner.models.tree import map_tensors, tensors_in

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)

Pair = collections.namedtuple("Pair", "a b")


def _double(t: torch.Tensor) -> torch.Tensor:
    return t * 2


def test_nested_containers_keep_their_structure_and_types() -> None:
    obj = {"x": torch.ones(2), "tup": (torch.ones(1), 3, "s"), "lst": [torch.zeros(1), None],
           "pair": Pair(torch.ones(1), [torch.ones(1)]), "size": torch.Size([2, 3]), "dt": torch.float16,
           "od": OrderedDict(k=torch.ones(1))}
    out = map_tensors(_double, obj)
    assert type(out) is dict and list(out) == list(obj)
    assert torch.equal(out["x"], torch.full((2,), 2.0))
    assert type(out["tup"]) is tuple and out["tup"][1:] == (3, "s") and torch.equal(out["tup"][0], torch.full((1,), 2.0))
    assert type(out["lst"]) is list and out["lst"][1] is None
    assert type(out["pair"]) is Pair and torch.equal(out["pair"].b[0], torch.full((1,), 2.0))
    assert type(out["size"]) is torch.Size and out["size"] == torch.Size([2, 3])
    assert out["dt"] is torch.float16
    assert torch.equal(out["od"]["k"], torch.full((1,), 2.0))
    assert torch.equal(obj["x"], torch.ones(2))  # the input is untouched


def test_structseq_return_types_keep_their_type() -> None:
    r = torch.max(torch.tensor([[1.0, 3.0], [4.0, 2.0]]), 1)
    out = map_tensors(_double, r)
    assert type(out) is type(r)
    assert torch.equal(out.values, torch.tensor([6.0, 8.0])) and torch.equal(out.indices, torch.tensor([2, 0]))


def test_model_output_keeps_its_class_and_is_not_modified_in_place() -> None:
    from transformers.modeling_outputs import BaseModelOutput

    mo = BaseModelOutput(last_hidden_state=torch.ones(1), hidden_states=(torch.ones(1), torch.zeros(1)))
    out = map_tensors(_double, mo)
    assert type(out) is BaseModelOutput and out is not mo
    assert torch.equal(out.last_hidden_state, torch.full((1,), 2.0)) and out.attentions is None
    assert isinstance(out.hidden_states, tuple) and torch.equal(out.hidden_states[0], torch.full((1,), 2.0))
    assert torch.equal(mo.last_hidden_state, torch.ones(1))


def test_modules_only_when_asked() -> None:
    lin = nn.Linear(2, 2)
    seen: list[object] = []

    def fn(x: object) -> object:
        seen.append(x)
        return x

    map_tensors(fn, {"m": lin, "x": torch.ones(1)})
    assert seen[0] is not lin and len(seen) == 1
    seen.clear()
    map_tensors(fn, {"m": lin, "x": torch.ones(1)}, modules=True)
    assert seen[0] is lin and len(seen) == 2


def test_dtype_and_device_casts_as_the_modes_use_them() -> None:
    obj = (torch.ones(2, dtype=torch.float32), torch.arange(2))
    out = map_tensors(lambda t: t.to(torch.float16) if t.is_floating_point() else t, obj)
    assert out[0].dtype == torch.float16 and out[1].dtype == torch.int64
    assert [t.shape for t in tensors_in({"a": obj, "b": [torch.zeros(3)]})] == [torch.Size([2]), torch.Size([2]),
                                                                               torch.Size([3])]
