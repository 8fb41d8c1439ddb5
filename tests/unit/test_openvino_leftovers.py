"""OpenVINO's partitioner leftovers (`backends/openvino.py`): a tensor op left to PyTorch eager is a fallback; the
host-side size arithmetic of dynamic shapes (issue 45's Qwen3-Next: `mod`, `neg` on symbolic ints) is not."""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ci_runner.backends.openvino import _shape_math


def test_size_arithmetic_is_not_a_fallback_but_a_tensor_op_or_a_value_read_is() -> None:
    env = ShapeEnv()
    s = env.create_unbacked_symint()
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3)
    size = g.call_function(torch.ops.aten.sym_size.int, (x, 0))
    size.meta["val"] = s
    mod = g.call_function(operator.mod, (size, 2))
    mod.meta["val"] = s % 2
    neg = g.call_function(operator.neg, (size,))
    neg.meta["val"] = -s
    item = g.call_function(torch.ops.aten._local_scalar_dense.default, (x,))  # reads a value: a device sync
    item.meta["val"] = s
    exp = g.call_function(torch.ops.aten.exp.default, (x,))
    exp.meta["val"] = torch.empty(2, 3)
    bare = g.call_function(torch.ops.aten.neg.default, (x,))  # no recorded value: counted as a tensor op
    assert [_shape_math(n) for n in (size, mod, neg)] == [True, True, True]
    assert [_shape_math(n) for n in (item, exp, bare)] == [False, False, False]
