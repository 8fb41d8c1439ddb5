"""OpenVINO's partitioner leftovers (`backends/openvino.py`): a tensor op left to PyTorch eager and the size
arithmetic of dynamic shapes it does not take (issue 45's Qwen3-Next: `mod`, `neg` on symbolic ints; its support list
has `_operator.add`, `sub`, `mul`, `floordiv`) are both leftovers, and the finding says which it is."""

from __future__ import annotations

import operator

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ci_runner.backends.openvino import shape_math
from ci_runner.modes.compile.checks import PhaseSignals, _fallbacks


def test_size_arithmetic_is_told_from_a_tensor_op_and_a_value_read() -> None:
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
    assert [shape_math(n) for n in (size, mod, neg)] == [True, True, True]
    assert [shape_math(n) for n in (item, exp, bare)] == [False, False, False]


def test_a_size_arithmetic_leftover_is_a_fallback_that_says_what_it_computes() -> None:
    sig = PhaseSignals(name="long", label="long", phase=None,
                       facts={"eager_ops": ["aten.histc.default", "mod"], "eager_size_ops": ["mod"],
                              "eager_sites": {"mod": ["model.layers.0.linear_attn"]}, "openvino_partitions": 3})
    histc, mod = _fallbacks("openvino", sig)
    assert mod.op == "mod" and mod.module == "model.layers.0.linear_attn" and mod.details["size_arithmetic"] is True
    assert "mod ran in PyTorch eager: openvino's partitioner left it outside its partitions (size arithmetic" in mod.message
    assert "never ran on the backend" in histc.message and "size_arithmetic" not in histc.details
