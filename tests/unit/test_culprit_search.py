"""The culprit search's pure parts: probe order, singles, the smallest failing range; and the small graphs it
probes, built from a real traced module and run on CPU against the recorded intermediates."""

from __future__ import annotations

import torch

from ci_runner.modes.layers.culprit import capture_graph, entry_name, graph_source, graph_steps, load_graph, parse_entry, subgraph
from ci_runner.failures.outcome import ProbeOutcome
from ci_runner.modes.layers.culprit_search import Step, StopSearch, parse_key, search, single_order


def _probe(fails):
    seen = []

    def probe(key: str) -> ProbeOutcome:
        seen.append(key)
        s, e = parse_key(key)
        return ProbeOutcome(name=key, status="fail" if fails(set(range(s, e))) else "pass")
    return probe, seen


def test_first_failing_single_wins_in_probe_order() -> None:
    probe, seen = _probe(lambda idx: 5 in idx)
    st = search(10, [5, 0, 1, 2, 3, 4, 6, 7, 8, 9], probe, all_singles=False)
    assert (st.kind, st.key, seen) == ("single", "5:6", ["5:6"])


def test_every_single_that_fails_alone_is_named() -> None:
    """Issue 38: a module failing on two ops names both (the backend's error names only the first it meets)."""
    probe, seen = _probe(lambda idx: bool({5, 2, 8} & idx))
    st = search(10, [5, 0, 1, 2, 3, 4, 6, 7, 8, 9], probe)
    assert (st.kind, st.key, st.failing) == ("single", "5:6", ["5:6", "2:3", "8:9"])
    # the first single, then group testing on each side of it: ranges halved down to the failing singles
    assert seen[0] == "5:6" and "0:5" in seen and "6:10" in seen, seen
    probe, seen = _probe(lambda idx: 5 in idx)
    assert search(10, [5, 0, 1, 2, 3, 4, 6, 7, 8, 9], probe).failing == ["5:6"]
    assert seen == ["5:6", "0:5", "6:10"]  # nothing else fails alone: two probes, not nine
    # out of time after a failing one: that answer, said to be partial
    calls = []

    def timed(key: str) -> ProbeOutcome:
        calls.append(key)
        if len(calls) > 1:
            raise StopSearch()
        return probe(key)

    st = search(10, [5, 0, 1, 2, 3], timed)
    assert (st.kind, st.failing) == ("single", ["5:6"]) and "out of time" in st.note
    # a node with the op and inputs of an earlier one is the same probe: left out of the order
    steps = [Step(index=i, node=f"n{i}", op=op, source=None, inputs=["float32[2]"], probe=True)
             for i, op in enumerate(["aten.neg.default", "aten.cat.default", "aten.neg.default"])]
    assert single_order(steps, []) == [0, 1]


def test_no_single_fails_gives_the_smallest_range_holding_both() -> None:
    # fails only when nodes 3 and 7 are in one graph (mm and neg, say)
    probe, seen = _probe(lambda idx: {3, 7} <= idx)
    st = search(12, list(range(12)), probe)
    assert st.kind == "range" and st.key == "3:8" and "no single op fails alone" in st.note
    assert seen[12] == "0:12"  # the whole graph after the 12 singles
    assert len(seen) <= 12 + 1 + 2 * 4  # two bisections over 12 nodes


def test_whole_graph_passing_says_so_and_replay_stops_cleanly() -> None:
    probe, _ = _probe(lambda idx: False)
    st = search(4, [0, 1, 2, 3], probe)
    assert st.kind == "none" and "whole graph passes" in st.note

    def stop(key: str) -> ProbeOutcome:
        raise StopSearch()
    assert search(4, [0, 1], stop).kind == "incomplete"


def test_probe_order_puts_the_named_op_and_its_relatives_first() -> None:
    ops = ["aten.view.default", "aten._safe_softmax.default", "aten.rsqrt.default", "aten._assert_scalar.default"]
    steps = [Step(index=i, node=f"n{i}", op=o, source=None, inputs=[], probe=i != 3) for i, o in enumerate(ops)]
    assert single_order(steps, ["aten.rsqrt.out", "aten.rsqrt"]) == [2, 0, 1]
    assert single_order(steps, ["aten._softmax.out"]) == [1, 0, 2]
    assert single_order(steps, []) == [0, 1, 2]


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        y = self.lin(x.transpose(0, 1))  # a non-contiguous input to the linear
        return torch.softmax(y * scale, dim=-1).sum(0)


def test_small_graphs_rebuild_each_node_and_range_on_its_real_inputs() -> None:
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(8, 4)
    cg = capture_graph(block, (x,), {"scale": 0.5})
    assert cg.level == "aot"
    steps, nodes = graph_steps(cg)
    ops = [s.op for s in steps]
    assert "aten._softmax.default" in ops and "aten.addmm.default" in ops
    i = ops.index("aten._softmax.default")
    assert steps[i].inputs[0] == "float32[4, 8]" and steps[i].inputs[1:] == ["-1", "False"]
    assert "test_culprit_search.py" in (steps[i].source or "")
    for s, e in [(i, i + 1), (0, len(nodes))]:
        g, inputs = subgraph(cg, nodes[s:e])
        src = graph_source(g, title=f"{s}:{e}")
        out = load_graph(src)(*[t for _, t in inputs])
        want = cg.values[nodes[e - 1]]
        torch.testing.assert_close(out[-1], want)
    # the whole module's result, rebuilt from the recorded inputs of the full range
    torch.testing.assert_close(cg.values[nodes[-1]], block(x, scale=0.5).detach())


def test_journal_entries_name_the_module_and_the_range() -> None:
    """One child serves every finding of a cell: a dead child's open entry must say whose probe it was."""
    assert parse_entry(entry_name("model.layers.1.self_attn", "3:4")) == ("model.layers.1.self_attn", "3:4")
    assert parse_entry(entry_name("", "0:12")) == ("", "0:12")  # the whole model
    assert parse_entry(entry_name("model.layers.0.self_attn", "0:12")) != parse_entry(
        entry_name("model.layers.1.self_attn", "0:12"))
