"""The layers mode's engine without processes: tree, call encoding, the top-down search, capture, options."""

from __future__ import annotations

from collections.abc import Callable
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from ci_runner.errors import ConfigError
from ci_runner.engine.codec import TensorStore, call_tensor_keys, decode_call
from ci_runner.engine.codec import Unstorable as Opaque
from ci_runner.procs.isolate import open_entry
from ci_runner.procs.limits import HangLimits
from ci_runner.failures.outcome import UNFINISHED, ProbeOutcome, append_outcome, read_outcomes
from ci_runner.modes.layers.search import (
    ROOT,
    ModuleTree,
    StopSearch,
    capture_inputs,
    encode_call,
    minimal_failing,
    record_calls,
    scan_model,
    search,
    measured_s,
    unlabel,
)
from ci_runner.failures.failure import is_compile_stage, unwrap
from ci_runner.modes.layers.mode import _key_text
from ci_runner.registry import parse_options
from tests.fixtures.oldtorch import differs_on_oldest

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)


def _open_entry_since(journal: Path, offset: int) -> str | None:
    entry = open_entry(journal, "module", since=offset)
    return None if entry is None else unlabel(entry)


# --------------------------------------------------------------------------- tree

def _tree(*names: str, opaque: tuple[str, ...] = ()) -> ModuleTree:
    return ModuleTree.build((n, f"C_{n or 'root'}", 1, n not in opaque, "opaque" if n in opaque else None)
                            for n in (ROOT, *names))


def test_tree_descends_through_containers_that_never_ran() -> None:
    # `model.layers` (a ModuleList) never runs, so layer 0 hangs under `model` directly
    tree = _tree("model", "model.layers.0", "model.layers.0.attn", "model.layers.1", "lm_head")
    assert tree.children(ROOT) == ["model", "lm_head"]
    assert tree.children("model") == ["model.layers.0", "model.layers.1"]
    assert tree.path("model.layers.0.attn") == [ROOT, "model", "model.layers.0", "model.layers.0.attn"]
    again = ModuleTree.from_json(json.loads(json.dumps(tree.to_json())))
    assert again.children("model") == tree.children("model")


def test_tree_requires_the_root() -> None:
    with pytest.raises(ValueError):
        ModuleTree.build([("a", "A", 1, True, None)])


# --------------------------------------------------------------------------- search

def _prober(failing: dict[str, str], log: list[str]):
    def probe(name: str) -> ProbeOutcome:
        log.append(name)
        status = failing.get(name, "pass")
        return ProbeOutcome(name=name, status=status, stage="run" if status != "pass" else None)

    return probe


def test_search_passes_on_a_passing_model_after_one_probe() -> None:
    tree = _tree("a", "a.b", "c")
    log: list[str] = []
    res = search(tree, _prober({}, log))
    assert log == [ROOT]
    assert res.minimal == [] and res.complete
    assert res.whole_model is not None and res.whole_model.status == "pass"


def test_search_finds_every_smallest_failing_module_and_skips_passing_subtrees() -> None:
    tree = _tree("m", "m.l0", "m.l0.attn", "m.l0.attn.q", "m.l0.mlp", "m.l0.mlp.up",
                 "m.l1", "m.l1.attn", "m.l1.attn.q", "m.l1.mlp", "m.l1.mlp.up", "head")
    failing = {ROOT: "fail", "m": "fail", "m.l0": "fail", "m.l0.attn": "fail", "m.l1": "crashed",
               "m.l1.attn": "timeout"}
    log: list[str] = []
    res = search(tree, _prober(failing, log))
    assert res.minimal == ["m.l0.attn", "m.l1.attn"]
    # passing modules' children are never tried
    assert "m.l0.mlp.up" not in log and "m.l1.mlp.up" not in log and "head" in log
    # breadth first: every module of a level before the next level
    assert log.index("m.l1") < log.index("m.l0.attn")
    assert len(log) == len(set(log))


def test_a_parent_failing_while_each_child_passes_is_the_answer() -> None:
    tree = _tree("m", "m.attn", "m.attn.q", "m.attn.k", "m.attn.o")
    res = search(tree, _prober({ROOT: "fail", "m": "fail", "m.attn": "fail"}, []))
    assert res.minimal == ["m.attn"]


def test_search_looks_through_modules_whose_inputs_cannot_be_replayed() -> None:
    tree = _tree("m", "m.blk", "m.blk.inner", "m.other", opaque=("m.blk",))
    log: list[str] = []
    res = search(tree, _prober({ROOT: "fail", "m": "fail", "m.blk.inner": "fail"}, log))
    assert "m.blk" not in log and res.outcomes["m.blk"].status == "skipped"
    assert res.minimal == ["m.blk.inner"]
    # when nothing under a skipped module fails, the failing parent stays the answer
    res2 = search(tree, _prober({ROOT: "fail", "m": "fail"}, []))
    assert res2.minimal == ["m"]


def test_search_stopped_early_keeps_what_it_learnt() -> None:
    tree = _tree("m", "m.a", "m.b")
    calls = {"n": 0}

    def probe(name: str) -> ProbeOutcome:
        calls["n"] += 1
        if calls["n"] > 2:
            raise StopSearch()
        return ProbeOutcome(name=name, status="fail")

    res = search(tree, probe)
    assert not res.complete
    assert list(res.outcomes) == [ROOT, "m", "m.a"]  # `m` is the whole model's wrapper: looked through
    assert res.outcomes["m"].status == "skipped"
    assert res.minimal == ["m.a"]


def test_replay_from_the_outcomes_file_continues_where_a_crash_stopped(tmp_path: Path) -> None:
    tree = _tree("m", "m.a", "m.b", "m.a.x")
    f = tmp_path / "probes.jsonl"
    for o in (ProbeOutcome(name=ROOT, status="fail"), ProbeOutcome(name="m", status="fail"),
              ProbeOutcome(name="m.a", status="crashed", error_type="SIGSEGV")):
        append_outcome(f, o)
    with open(f, "a", encoding="utf-8") as fh:
        fh.write('{"name": "m.b", "sta')  # torn line of a process killed mid-write
    known = read_outcomes(f)
    assert set(known) == {ROOT, "m", "m.a"}
    log: list[str] = []
    res = search(tree, lambda n: known[n] if n in known else _prober({}, log)(n))
    assert log == ["m.b", "m.a.x"]
    assert res.minimal == ["m.a"]
    assert minimal_failing(tree, res.outcomes) == ["m.a"]


def _layers_tree(n: int, *, cousins: bool = False) -> ModuleTree:
    """A decoder of `n` twin layers: classes by role, as in a real model. `cousins`: each layer under a wrapper of
    its own class (`m.w3.l3`), so the layers are cousins, not siblings."""
    def layer(i: int) -> str:
        return f"m.w{i}.l{i}" if cousins else f"m.l{i}"

    names = ["m"] + [f"m.w{i}" for i in range(n) if cousins]
    names += [f"{layer(i)}{part}" for i in range(n) for part in ("", ".attn", ".attn.q", ".attn.k", ".mlp", ".mlp.up")]
    role = {"m": "Model", "attn": "Attn", "q": "Linear", "k": "Linear", "mlp": "Mlp", "up": "Linear"}

    def cls(name: str) -> str:
        last = name.rsplit(".", 1)[-1]
        return "Top" if not name else role.get(last, f"Wrap{last}" if last.startswith("w") else "Layer")

    return ModuleTree.build((name, cls(name), 1, True, None) for name in (ROOT, *names))


def _failing_prober(failing: dict[str, str], log: list[str], message: str = "attention failed"):
    def probe(name: str) -> ProbeOutcome:
        log.append(name)
        if name in failing:
            return ProbeOutcome(name=name, status="fail", stage="run", error_type="RuntimeError",
                                message=failing[name])
        return ProbeOutcome(name=name, status="pass")

    return probe


def test_twin_layers_cost_one_descent_and_every_layer_is_still_listed() -> None:
    n = 6
    tree = _layers_tree(n, cousins=True)
    lay = [f"m.w{i}.l{i}" for i in range(n)]
    failing = {ROOT: "boom", "m": "boom", **{f"m.w{i}": "boom" for i in range(n)}, **{x: "boom" for x in lay},
               **{f"{x}.attn": "boom" for x in lay}}
    log: list[str] = []
    res = search(tree, _failing_prober(failing, log))
    assert res.minimal == [f"{x}.attn" for x in lay]
    # the first layer is searched fully; each cousin twin probes only the child that failed in the first
    assert {f"{lay[0]}.mlp", f"{lay[0]}.attn.q", f"{lay[0]}.attn.k"} <= set(log)
    for x in lay[1:]:
        assert f"{x}.attn" in log and f"{x}.mlp" not in log and f"{x}.attn.q" not in log
        assert res.outcomes[f"{x}.mlp"].inferred_from == f"{lay[0]}.mlp"
        assert res.outcomes[f"{x}.attn.q"].status == "pass"
    # root, the wrappers, the layers, l0's children, twins' attn, l0.attn's children (`m` is looked through)
    assert len(log) == 1 + n + n + 2 + (n - 1) + 2
    # without twins every child of every failing module is probed
    full: list[str] = []
    assert search(tree, _failing_prober(failing, full), twins=False).minimal == res.minimal
    assert len(full) == 1 + n + n + 2 * n + 2 * n


def test_a_twin_that_fails_differently_is_searched_fully() -> None:
    tree = _layers_tree(3)
    failing = {ROOT: "boom", "m": "boom", "m.l0": "boom", "m.l1": "boom", "m.l2": "boom", "m.l0.attn": "boom",
               "m.l1.attn": "other error", "m.l2.mlp": "boom"}
    log: list[str] = []
    res = search(tree, _failing_prober(failing, log))
    # l1's attn fails with another cause: its other children are probed; l2's attn passes: l2 is searched too
    assert "m.l1.mlp" in log and "m.l2.mlp" in log
    assert res.minimal == ["m.l0.attn", "m.l1.attn", "m.l2.mlp"]
    assert all(o.inferred_from is None for o in res.outcomes.values())


def test_twins_replay_from_known_outcomes_alone() -> None:
    tree = _layers_tree(4)
    failing = {ROOT: "boom", "m": "boom", **{f"m.l{i}": "boom" for i in range(4)},
               **{f"m.l{i}.attn": "boom" for i in range(4)}}
    log: list[str] = []
    first = search(tree, _failing_prober(failing, log))
    probed = {n: first.outcomes[n] for n in log}

    def replay(name: str) -> ProbeOutcome:
        if name in probed:
            return probed[name]
        raise StopSearch()

    again = search(tree, replay)
    assert again.complete and again.minimal == first.minimal


def test_open_journal_entry_since_an_offset(tmp_path: Path) -> None:
    j = tmp_path / "journal.log"
    j.write_text("enter-module\told\n", encoding="utf-8")
    offset = j.stat().st_size
    with open(j, "a", encoding="utf-8") as fh:
        fh.write("enter-module\t<root>\nleave-module\t<root>\nenter-module\tm.a\nleave-module\tm.a\nenter-module\tm.b\n")
    assert _open_entry_since(j, offset) == "m.b"
    with open(j, "a", encoding="utf-8") as fh:
        fh.write("leave-module\tm.b\nenter-module\t<root>\n")
    assert _open_entry_since(j, offset) == ROOT
    assert _open_entry_since(j, j.stat().st_size) is None


# --------------------------------------------------------------------------- call encoding

def test_call_round_trip_keeps_structure_strides_and_sharing() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = base.t()  # non-contiguous
    shared = torch.ones(3)
    args = (t, shared, None, 3, 2.5, float("inf"), "x", True)
    kwargs = {"pair": (shared, torch.tensor([1, 2])), "lst": [torch.zeros(2, dtype=torch.bool)],
              "dtype": torch.float16, "dev": torch.device("cpu"), "size": torch.Size([2, 3]), "d": {"k": 1}}
    store = TensorStore()
    spec = encode_call(args, kwargs, store)
    json.dumps(spec)  # plain JSON
    assert len(store.tensors) == 4  # `shared` stored once
    a, k = decode_call(spec, store.tensors)
    assert torch.equal(a[0], t) and a[0].stride() == t.stride()
    assert a[1] is k["pair"][0]
    assert a[2:5] == (None, 3, 2.5) and math.isinf(a[5]) and a[6:] == ("x", True)
    assert k["dtype"] is torch.float16 and k["dev"] == torch.device("cpu") and k["size"] == torch.Size([2, 3])
    assert k["lst"][0].dtype == torch.bool and k["d"] == {"k": 1}
    assert sorted(call_tensor_keys(spec)) == sorted(store.tensors)


def test_saved_inputs_load_back(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    store = TensorStore()
    x = torch.randn(2, 3)
    spec = encode_call((x, x[:, 1:]), {}, store)
    store.save(tmp_path / "in.safetensors")
    a, _ = decode_call(spec, load_file(str(tmp_path / "in.safetensors")))
    assert torch.equal(a[0], x) and torch.equal(a[1], x[:, 1:])


def test_objects_that_cannot_be_rebuilt_are_reported() -> None:
    class Cache:
        pass

    with pytest.raises(Opaque, match="Cache"):
        encode_call((), {"cache": Cache()}, TensorStore())


# --------------------------------------------------------------------------- capture

class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return self.act(self.lin(x)) * scale


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.shared = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = self.shared(b(x, scale=0.5))
        return x


def test_scan_records_every_call_and_builds_the_tree() -> None:
    net = _Net().eval()
    tree = scan_model(net, {"x": torch.randn(2, 4)})
    assert tree.children(ROOT) == ["blocks.0", "shared", "blocks.1"]
    assert tree.nodes["shared"].calls == 2 and tree.nodes["blocks.0"].calls == 1
    assert "blocks" not in tree.nodes  # the ModuleList never ran
    assert sum(n.calls for n in tree.nodes.values()) == 1 + 2 * 3 + 2
    assert all(n.replayable for n in tree.nodes.values())


def test_scan_keeps_no_tensor_and_marks_opaque_inputs() -> None:
    class Cache:
        pass

    class Takes(nn.Module):
        def forward(self, x: torch.Tensor, cache: object = None) -> torch.Tensor:
            return x

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Takes()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x, cache=Cache())

    recorded, _ = record_calls(Outer(), (), {"x": torch.ones(2)}, keep=False)
    assert all(r.args == () and r.kwargs == {} for r in recorded)
    tree = scan_model(Outer(), {"x": torch.ones(2)})
    assert tree.nodes[ROOT].replayable and not tree.nodes["inner"].replayable
    assert "Cache" in (tree.nodes["inner"].why_not or "")


def test_capture_inputs_keeps_only_the_named_modules() -> None:
    net = _Net().eval()
    x = torch.randn(2, 4)
    got = capture_inputs(net, (), {"x": x}, ["blocks.1", "shared"])
    assert set(got) == {"blocks.1", "shared"}
    assert len(got["shared"]) == 1 and got["blocks.1"][0][1] == {"scale": 0.5}
    every = capture_inputs(net, (), {"x": x}, ["shared"], all_calls=True)
    assert len(every["shared"]) == 2
    # replaying the captured call gives the same output as inside the forward
    a, k = got["blocks.1"][0]
    with torch.no_grad():
        h = net.shared(net.blocks[0](x, scale=0.5))
        assert torch.allclose(a[0], h)


def test_capture_notices_in_place_updates_and_copies() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1
            self.a(y)
            y.add_(100.0)  # modifies the tensor `a` was called with
            return y

    m = InPlace()
    x = torch.zeros(3)
    _, mutated = record_calls(m, (), {"x": x}, include=["a"])
    assert mutated
    got = capture_inputs(m, (), {"x": x}, ["a"])
    assert torch.equal(got["a"][0][0][0], torch.zeros(3))  # the value at call time, not after the add_


def test_capture_leaves_no_hooks() -> None:
    net = _Net()
    scan_model(net, {"x": torch.randn(1, 4)})
    capture_inputs(net, (), {"x": torch.randn(1, 4)}, ["shared"])
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())


def test_search_prefetches_each_level_once() -> None:
    tree = _tree("m", "m.a", "m.a.x", "m.b", "h")
    levels: list[list[str]] = []
    search(tree, _prober({ROOT: "fail", "m": "fail", "m.a": "fail"}, []), levels.append)
    assert levels == [["h"], ["m.b"], ["m.a.x"]]  # `m` and then `m.a` wrap nearly all of the model: looked through


def test_the_whole_models_wrapper_is_looked_through_and_probed_only_when_nothing_below_fails() -> None:
    tree = _tree("m", "m.a", "m.a.x", "m.a.y", "m.b", "h")
    # something below fails: `m` and `m.a` (each its parent's only child with children) are never compiled alone
    log: list[str] = []
    res = search(tree, _prober({ROOT: "fail", "m": "fail", "m.a": "fail", "m.a.x": "fail"}, log))
    assert log == [ROOT, "h", "m.b", "m.a.x", "m.a.y"] and res.minimal == ["m.a.x"]
    assert res.outcomes["m"].status == res.outcomes["m.a"].status == "skipped"
    # nothing below fails: the looked-through modules are probed after all, deepest first, as the plain search
    log2: list[str] = []
    res2 = search(tree, _prober({ROOT: "fail", "m": "fail", "m.a": "fail"}, log2))
    assert log2 == [ROOT, "h", "m.b", "m.a.x", "m.a.y", "m.a"] and res2.minimal == ["m.a"]
    log3: list[str] = []
    res3 = search(tree, _prober({ROOT: "fail"}, log3))
    assert log3 == [ROOT, "h", "m.b", "m.a.x", "m.a.y", "m.a", "m"] and res3.minimal == [ROOT]
    assert res3.outcomes["m"].status == "pass"
    # a second child with children of its own: nothing is looked through
    log4: list[str] = []
    search(_tree("m", "m.a", "h", "h.x"), _prober({ROOT: "fail"}, log4))
    assert log4 == [ROOT, "m", "h"]


# --------------------------------------------------------------------------- errors and options

@differs_on_oldest("2.7's Dynamo wraps the fixture backend's IndexError in BackendCompilerFailed")
def test_stage_of_backend_errors(fresh_dynamo: Callable[[], None]) -> None:
    import torch._dynamo

    from tests.fixtures.plugin_layers_fault import raise_backend
    from tests.fixtures.plugin_layers_pair import pair_backend

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return -self.lin(x)

    x = torch.randn(2, 4)
    fresh_dynamo()
    with pytest.raises(IndexError) as info:
        torch.compile(M(), backend=pair_backend)(x)
    assert is_compile_stage(info.value)
    assert isinstance(unwrap(info.value), IndexError)

    class A(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, q, q)

    fresh_dynamo()
    with pytest.raises(RuntimeError, match="fault-plugin") as info2:
        torch.compile(A(), backend=raise_backend)(torch.randn(1, 2, 4, 8))
    assert not is_compile_stage(info2.value)
    fresh_dynamo()


def test_options_defaults_and_errors() -> None:
    o = parse_options("layers", {"probe_timeout": 5, "all_calls": True})
    assert o.probe_timeout == 5.0 and o.all_calls and o.verify
    with pytest.raises(ConfigError, match="probe_timout") as info:
        parse_options("layers", {"probe_timout": 5})
    assert "probe_timeout" in str(info.value)
    with pytest.raises(ConfigError):
        parse_options("layers", {"verify": "yes"})
    with pytest.raises(ConfigError):
        parse_options("layers", {"probe_timeout": -1})


def test_key_text_is_a_stable_prefix() -> None:
    assert _key_text("[sim-subset] unsupported operator aten.neg.default in node neg_1: more") == [
        "[sim-subset] unsupported operator aten.neg.default"]
    assert _key_text("list index out of range\n\nSet TORCHDYNAMO_VERBOSE=1") == ["list index out of range"]
    assert _key_text("x") == []


def test_cause_groups_split_by_class_cause_and_input_signature() -> None:
    from ci_runner.modes.layers.groups import call_signature, cause_families, cause_groups
    from ci_runner.modes.layers.search import SearchResult

    tree = _layers_tree(4)
    boom = dict(status="fail", stage="run", error_type="RuntimeError", message="boom at 0x7f00aa")
    outcomes = {f"m.l{i}.attn": ProbeOutcome(name=f"m.l{i}.attn", **boom) for i in range(4)}
    outcomes["m.l3.attn"] = ProbeOutcome(name="m.l3.attn", **{**boom, "message": "another error"})
    result = SearchResult(outcomes=outcomes, minimal=list(outcomes), complete=True)
    x = torch.zeros(1, 4, 8)
    calls = {n: [((x,), {"mask": None, "pos": (x, x)})] for n in outcomes}
    calls["m.l2.attn"] = [((torch.zeros(1, 5, 8),), {"mask": None, "pos": (x, x)})]  # other shapes
    groups = cause_groups(tree, result, calls)
    assert groups == {"m.l0.attn": "m.l0.attn", "m.l1.attn": "m.l0.attn", "m.l2.attn": "m.l2.attn",
                      "m.l3.attn": "m.l3.attn"}
    # l2 differs only in its inputs: same family as l0 (its culprit op is probed first); l3 is another cause
    assert cause_families(tree, result, ["m.l0.attn", "m.l2.attn", "m.l3.attn"]) == {
        "m.l0.attn": "m.l0.attn", "m.l2.attn": "m.l0.attn", "m.l3.attn": "m.l3.attn"}
    sig = call_signature((x.transpose(1, 2),), {"obj": object()})
    assert sig == "(float32[1, 8, 4]@[32, 1, 8]){obj=object}"  # strides kept, no address


def test_sibling_twins_are_confirmed_through_the_first_ones_smallest_failing_module() -> None:
    n = 6
    tree = _layers_tree(n)
    # the layers are siblings under `m`: same class, same subtree
    failing = {ROOT: "boom", "m": "boom", **{f"m.l{i}": "boom" for i in range(n)},
               **{f"m.l{i}.attn": "boom" for i in range(n)}}
    log: list[str] = []
    res = search(tree, _failing_prober(failing, log))
    assert res.minimal == [f"m.l{i}.attn" for i in range(n)]
    for i in range(1, n):  # each later layer: only its attn is probed; the layer itself takes l0's outcome
        assert f"m.l{i}" not in log and f"m.l{i}.attn" in log and f"m.l{i}.mlp" not in log
        assert res.outcomes[f"m.l{i}"].inferred_from == "m.l0" and res.outcomes[f"m.l{i}"].failed
    assert len(log) == len(set(log)) == 1 + 1 + 2 + 2 + (n - 1)  # root, l0, l0's children, l0.attn's, twins' attn
    assert res.outcomes["m"].status == "skipped"  # the whole model's wrapper: looked through, never compiled alone


def test_a_sibling_twin_failing_elsewhere_is_searched() -> None:
    tree = _layers_tree(3)
    failing = {ROOT: "boom", "m": "boom", "m.l0": "boom", "m.l0.attn": "boom", "m.l2": "boom", "m.l2.mlp": "boom"}
    log: list[str] = []
    res = search(tree, _failing_prober(failing, log))
    assert res.minimal == ["m.l0.attn", "m.l2.mlp"]
    assert "m.l1" in log and "m.l2" in log  # their attn passed: probed themselves (l1 passes, l2 is searched)
    assert res.outcomes["m.l1"].status == "pass" and res.outcomes["m.l1"].inferred_from is None


def test_a_cpu_targets_copy_shares_the_weights_and_a_write_is_noticed_and_undone() -> None:
    from types import SimpleNamespace

    from ci_runner.modes.layers.search import _target_copy, restore_weights, versions_unchanged, weight_versions

    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    net[1].register_buffer("scale", torch.ones(4), persistent=False)
    cpu = SimpleNamespace(device="cpu", to_device=lambda m: m)
    copy = _target_copy(net, cpu)
    assert copy is not net and copy[0] is not net[0] and copy[0].weight is net[0].weight  # no second copy of weights
    other = _target_copy(net, SimpleNamespace(device="simdev", to_device=lambda m: m))
    assert other[0].weight is not net[0].weight  # a device copy is moved: the reference keeps its own
    fresh = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    fresh[1].register_buffer("scale", torch.ones(4), persistent=False)
    fresh.load_state_dict(net.state_dict())
    before = weight_versions(net)
    assert versions_unchanged(before)
    with torch.no_grad():
        copy[0].weight.add_(1.0)  # a target writing into the shared weights
        copy[1].scale.mul_(3.0)
    assert not versions_unchanged(before)
    restore_weights(net, fresh)
    assert torch.equal(net[0].weight, fresh[0].weight) and torch.equal(net[1].scale, torch.ones(4))


def test_capture_stops_the_forward_once_every_wanted_first_call_is_recorded() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise AssertionError("ran past the last wanted module")

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Boom())
    x = torch.randn(2, 4)
    got = capture_inputs(net, (x,), {}, ["0", "1"])
    assert torch.equal(got["0"][0][0][0], x) and set(got) == {"0", "1"}
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in net.modules())
    with pytest.raises(AssertionError, match="ran past"):  # every call: the whole forward runs
        capture_inputs(net, (x,), {}, ["0"], all_calls=True)


def test_a_probe_cut_short_while_busy_is_not_a_hang_and_its_failing_parent_is_named() -> None:
    """Issue 44: `unfinished` (the cell's time ran out while the probe still made progress) is not failing: the search
    names its failing parent, not it; a measured hang (`timeout`) stays the smallest failing module."""
    tree = _tree("a", "a.b", "a.c", "d")
    log: list[str] = []
    res = search(tree, _prober({ROOT: "fail", "a": "fail", "a.b": UNFINISHED}, log), twins=False)
    assert res.minimal == ["a"] and res.complete
    res = search(tree, _prober({ROOT: "fail", "a": "fail", "a.b": "timeout"}, []), twins=False)
    assert res.minimal == ["a.b"]


def test_the_second_limit_scales_with_what_the_cell_measured() -> None:
    limits = HangLimits(first=120.0, window=30.0, factor=4.0)
    assert limits.second(measured_s({})) is None  # the whole model's probe: nothing measured before it
    known = {"x": ProbeOutcome(name="x", status="pass", duration_s=100.0),
             "y": ProbeOutcome(name="y", status="fail", duration_s=10.0),
             "z": ProbeOutcome(name="z", status="timeout", duration_s=900.0),  # a hang measures no compile
             "w": ProbeOutcome(name="w", status="pass", duration_s=500.0, inferred_from="x")}  # not probed
    assert limits.second(measured_s(known)) == (400.0, 100.0)
    assert replace(limits, factor=1.0).second(measured_s(known)) == (240.0, 100.0)  # never under twice probe_timeout
