"""The hook context manager: every call recorded, hooks always removed, callbacks never break the run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ci_runner.watch.capture import ModuleCapture, iter_tensors, primary_tensor

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        x = self.act(self.lin(x))
        return self.act(self.lin(x)) * scale  # lin and act called twice per forward


def hook_count(m: nn.Module) -> int:
    return sum(len(s._forward_hooks) + len(s._forward_pre_hooks) for s in m.modules())


def test_records_every_call_with_kwargs_and_removes_hooks() -> None:
    torch.manual_seed(0)
    m = Shared()
    x = torch.randn(2, 4)
    with ModuleCapture(m, record_inputs=True, record_outputs=True) as cap:
        out = m(x, scale=2.0)
    assert hook_count(m) == 0
    by = cap.by_name()
    assert [r.info.call_index for r in by["lin"]] == [0, 1]
    assert [r.info.call_index for r in by["act"]] == [0, 1]
    assert by[""][0].kwargs == {"scale": 2.0}
    assert torch.equal(by[""][0].output, out)
    assert by["lin"][0].info.order < by["act"][0].info.order < by["lin"][1].info.order
    assert cap.entered[:2] == ["", "lin"]


def test_hooks_removed_when_the_forward_raises_and_callbacks_cannot_break_it() -> None:
    m = Shared()

    def bad(info, args, kwargs, output):
        raise ValueError("observer bug")

    with ModuleCapture(m, post=bad) as cap:
        m(torch.randn(1, 4))
    assert cap.errors and isinstance(cap.errors[0][1], ValueError)
    with pytest.raises(RuntimeError):
        with ModuleCapture(m, record_inputs=True):
            m(torch.randn(1, 5))  # shape error inside lin
    assert hook_count(m) == 0


def test_iter_tensors_skips_caches() -> None:
    out = {"last_hidden_state": torch.ones(1), "past_key_values": (torch.zeros(1),), "attn": (torch.ones(2), None)}
    names = [n for n, _ in iter_tensors(out)]
    assert names == ["last_hidden_state", "attn.0"]
    assert primary_tensor((torch.tensor([1]), torch.ones(2))).dtype == torch.float32


def test_module_hooks_name_each_call_and_are_removed_even_when_the_forward_raises() -> None:
    """`watch.hooks.ModuleHooks`: the factories get each module's name; pre-hooks see kwargs, post-hooks the
    output (and kwargs with `post_kwargs`); removed on exit, also when the forward raised."""
    from ci_runner.watch.hooks import ModuleHooks

    model = Shared()
    seen: list[tuple[str, str]] = []
    pre = lambda name: lambda mod, args, kwargs: seen.append(("pre", name))  # noqa: E731
    post = lambda name: lambda mod, args, kwargs, out: seen.append(("post", name))  # noqa: E731
    with ModuleHooks(model.named_modules(), pre=pre, post=post, post_kwargs=True) as hooks:
        assert hook_count(model) == 6 and len(hooks.handles) == 6
        model(torch.randn(1, 4), scale=2.0)
    assert hook_count(model) == 0
    assert seen[:3] == [("pre", ""), ("pre", "lin"), ("post", "lin")] and seen[-1] == ("post", "")
    assert seen.count(("pre", "lin")) == 2 and len(seen) == 2 * (1 + 2 + 2)
    with pytest.raises(RuntimeError):
        with ModuleHooks([("lin", model.lin)], pre=pre):
            model(torch.randn(1, 5))  # the wrong width: Linear raises
    assert hook_count(model) == 0


def test_record_aten_graphs_gives_what_an_aot_backend_is_given_one_graph_per_break(fresh_dynamo) -> None:  # type: ignore[no-untyped-def]
    """`watch.hooks.record_aten_graphs`: ATen overloads after aot_autograd; a graph break splits the graphs."""
    from ci_runner.watch.hooks import record_aten_graphs

    def broken(x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x)
        torch._dynamo.graph_break()
        return torch.rsqrt(y + 1)

    graphs = record_aten_graphs(broken, (torch.randn(3),))
    ops = [[str(n.target) for n in gm.graph.nodes if n.op == "call_function"] for gm in graphs]
    assert ops == [["aten.relu.default"], ["aten.add.Tensor", "aten.rsqrt.default"]], ops
    assert len(record_aten_graphs(Shared(), (torch.randn(1, 4),), {"scale": 2.0})) == 1
