"""Issue 13: volatile-token normalisation, repro verification across changing symbols, root causes, honest
own-code wording, names that resolve and caches off (the fast parts; with real compilers:
tests/integration/test_real_compilers_layers.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from ci_runner.run.aggregate import write_report_dir
from ci_runner.backends import resolve_backend
from ci_runner.config import BackendSpec
from ci_runner.failures.outcome import ProbeOutcome
from ci_runner.modes.layers.search import ROOT, ModuleTree, probe_one, own_code_candidates, own_name
from ci_runner.models.load import disable_caches, module_names, resolve_module_name
from ci_runner.modes.layers.mode import own_code_words
from ci_runner.engine.repro import verify_script, write_script
from ci_runner.results.model import CellResult, Finding, ModeResult, Results, load_results
from ci_runner.results.rootcause import normalize_text, package_of, raised_in, root_causes, signature

# the text of OpenVINO's guard failure on the default (non-aot_autograd) path, as torch 2.13 raises it
OV_TB = textwrap.dedent('''\
    Traceback (most recent call last):
      File "/v/lib/python3.12/site-packages/ci_runner/modes/layers/search.py", line 520, in _probe_one
        out = fn(*args, **kwargs)
      File "/v/lib/python3.12/site-packages/torch/_dynamo/guards.py", line 3286, in SHAPE_ENV
        code_parts, verbose_code_parts = output_graph.shape_env.produce_guards_verbose(
      File "/v/lib/python3.12/site-packages/torch/fx/experimental/symbolic_shapes.py", line 6557, in produce_guards_verbose
        assert sources, f"sources must not be empty for symbol {symbol}"
    AssertionError: sources must not be empty for symbol %s
    ''')


def _layer_finding(module: str, sym: str, *, cell_tb: str = OV_TB) -> Finding:
    return Finding(kind="layer_failure", stage="compile", module=module, error_type="AssertionError",
                   message=f"{module} fails alone at compile: AssertionError: sources must not be empty for symbol {sym}",
                   fingerprint="ab" * 10,
                   details={"message_full": f"sources must not be empty for symbol {sym}",
                            "traceback_tail": cell_tb % sym})


# --------------------------------------------------------------------------- the volatile-token rule

@pytest.mark.parametrize("a, b", [
    ("sources must not be empty for symbol s96", "sources must not be empty for symbol s47"),
    ("object at 0x7f3a2c10 failed", "object at 0x55e0ffee failed"),
    ("cannot read /tmp/tmpab12cd/graph.py", "cannot read /tmp/tmpzz99qq/graph.py"),
    ("worker pid 4242 died", "worker pid 17 died"),
    ("getitem_12 of __compiled_fn_7 [0/3]", "getitem_3 of __compiled_fn_19 [1/0]"),
    ("Failing guard allocated at u0 + s3", "Failing guard allocated at u12 + s0"),
])
def test_volatile_tokens_normalise_equal(a: str, b: str) -> None:
    assert a != b and normalize_text(a) == normalize_text(b)


@pytest.mark.parametrize("a, b", [
    ("unsupported operator aten.histc.default", "unsupported operator aten.sort.default"),
    ("expected float32 but got bfloat16", "expected float32 but got float16"),
    ("size mismatch 32 vs 16", "size mismatch 32 vs 8"),  # shapes are kept: they tell causes apart
    ("conv2d failed", "conv3d failed"),
])
def test_what_tells_causes_apart_is_kept(a: str, b: str) -> None:
    assert normalize_text(a) != normalize_text(b)


def test_verification_tolerates_a_symbol_that_changes_every_run(tmp_path: Path) -> None:
    """A repro whose message names a fresh symbol each run (OpenVINO's guard error) is verified; one that fails
    with another message is not."""
    script = write_script(tmp_path / "repro.py", textwrap.dedent("""\
        import os
        sym = "s%d" % (os.getpid() % 1000)
        raise AssertionError("sources must not be empty for symbol " + sym)
        """))
    v = verify_script(script, expect_text=["sources must not be empty for symbol s96"],
                      expect_error_type="AssertionError", timeout=60)
    assert v.verified, v
    other = write_script(tmp_path / "other.py", 'raise AssertionError("sources must not be empty for tensor x")\n')
    v2 = verify_script(other, expect_text=["sources must not be empty for symbol s96"],
                       expect_error_type="AssertionError", timeout=60)
    assert not v2.verified and "lacks" in v2.note


# --------------------------------------------------------------------------- where it was raised, root causes

def test_raised_in_names_the_innermost_package_of_the_root_exception() -> None:
    r = raised_in(OV_TB % "s7")
    assert r.package == "torch.fx" and r.role == "torch"
    assert r.frame == "torch/fx/experimental/symbolic_shapes.py:6557 in produce_guards_verbose"
    chained = ('Traceback (most recent call last):\n  File "/x/site-packages/iree/turbine/runtime/launch.py", '
               'line 292, in _compile\n    raise RuntimeError("JIT compilation failed")\nRuntimeError: JIT\n\n'
               'The above exception was the direct cause of the following exception:\n\nTraceback (most recent call '
               'last):\n  File "/x/site-packages/torch/_dynamo/output_graph.py", line 1, in call_user_compiler\n'
               'torch._dynamo.exc.BackendCompilerFailed: x\n')
    r2 = raised_in(chained)
    assert (r2.package, r2.role) == ("iree", "backend")
    assert package_of("/home/me/proj/my_model.py") == "model"
    assert package_of("/x/site-packages/transformers/models/llama/modeling_llama.py") == "transformers"
    assert raised_in("").package == ""


def test_findings_of_one_cause_collapse_into_one_root_cause(tmp_path: Path) -> None:
    mods = ["model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.0.mlp", "lm_head"]
    ov = CellResult(id="tiny-llama@openvino", model="tiny-llama", backend="openvino", status="fail", modes={
        "layers": ModeResult(status="fail", findings=[_layer_finding(m, f"s{9 + 37 * i}") for i, m in enumerate(mods)])})
    other = Finding(kind="unsupported_op", stage="compile", op="aten.histc.default", error_type="RuntimeError",
                    message="JIT compilation failed", fingerprint="cd" * 10)
    ir = CellResult(id="tiny-mixtral@iree", model="tiny-mixtral", backend="iree", status="fail",
                    modes={"ops": ModeResult(status="fail", findings=[other])})
    results = Results(cells=[ov, ir])
    causes = root_causes(results)
    assert [c["count"] for c in causes] == [4, 1]
    top = causes[0]
    assert top["cells"] == ["tiny-llama@openvino"] and top["error_type"] == "AssertionError"
    assert top["message"] == "sources must not be empty for symbol s<N>"
    assert top["raised_in"].startswith("torch.fx (torch) at torch/fx/experimental/symbolic_shapes.py:6557")
    assert {f.details["signature"] for f in ov.findings} == {top["signature"]}
    assert other.details["signature"] == causes[1]["signature"] != top["signature"]
    # the same text raised by another package is another cause
    moved = _layer_finding("x", "s1", cell_tb=OV_TB.replace("torch/fx/experimental", "openvino/frontend"))
    assert signature(moved).id != top["signature"]
    # results.json carries them; summary.md and report.html lead with them
    results.root_causes = causes
    paths = write_report_dir(results, tmp_path / "report")
    back = load_results(paths["results"])
    assert back.root_causes[0]["signature"] == top["signature"]
    summary = paths["summary"].read_text()
    assert summary.index("### Root causes: 2 distinct") < summary.index("### Cells × modes")
    assert "symbolic\\_shapes.py:6557" in summary or "symbolic_shapes.py:6557" in summary
    page = paths["html"].read_text()
    assert page.index('id="root-causes"') < page.index('id="matrix"')


# --------------------------------------------------------------------------- honest wording

def test_wording_says_what_was_shown() -> None:
    fail = ProbeOutcome(name="m.experts", status="fail", stage="compile", error_type="RuntimeError", message="x")
    kids = ["m.experts.act_fn"]
    passed = {"m.experts.act_fn": "pass"}
    own_fails = ProbeOutcome(name=own_name("m.experts"), status="fail", error_type="RuntimeError", message="x")
    own_passes = ProbeOutcome(name=own_name("m.experts"), status="pass")
    words, verdict = own_code_words("m.experts", fail, kids, passed, own_fails)
    assert verdict == "own_code" and "fails in its own code" in words and "1 child module run eagerly" in words
    words, verdict = own_code_words("m.experts", fail, kids, passed, own_passes)
    assert verdict == "needs_children" and "needs them together" in words and "1 child module passes" in words
    words, verdict = own_code_words("m.experts", fail, kids, passed, None)
    assert verdict == "open" and "needs them together" in words and "not shown" in words
    assert "children" not in words
    eager = ProbeOutcome(name="m.experts", status="fail", error_type="E", message="x", executing="m.experts")
    assert own_code_words("m.experts", eager, kids, passed, None)[1] == "own_code"
    assert own_code_words("m.leaf", fail, [], {}, None) == ("", None)


class _Child(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _OwnNeg(nn.Module):  # aten.mm in the child, aten.neg in its own code: fails only together
    def __init__(self) -> None:
        super().__init__()
        self.child = _Child()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -self.child(x)


class _OwnBoth(_OwnNeg):  # its own code holds aten.mm and aten.neg: fails with the child eager
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -(self.child(x) @ x.t())


@pytest.mark.parametrize("cls, own_status", [(_OwnNeg, "pass"), (_OwnBoth, "fail")])
def test_own_code_probe_compiles_the_module_with_its_children_eager(tmp_path: Path, cls: type, own_status: str) -> None:
    """The pair backend fails when aten.mm and aten.neg meet in one graph (tests/fixtures/plugin_layers_pair.py)."""
    backend = resolve_backend(BackendSpec(id="pair", compile="tests.fixtures.plugin_layers_pair:pair_backend"))
    model = nn.Sequential()
    model.add_module("block", cls())
    x = torch.randn(2, 4)
    with open(tmp_path / "t.txt", "a") as fh:
        whole = probe_one("block", model=model, backend=backend, calls=[((x,), {})], all_calls=False,
                           timeout=120, timeout_fh=fh)
        child = probe_one("block.child", model=model, backend=backend, calls=[((x,), {})], all_calls=False,
                           timeout=120, timeout_fh=fh)
        own = probe_one("block", model=model, backend=backend, calls=[((x,), {})], all_calls=False,
                         timeout=120, timeout_fh=fh, eager_children=["block.child"])
    assert (whole.status, child.status) == ("fail", "pass")
    assert own.name == "block#own" and own.status == own_status, own.message
    tree = ModuleTree.build([(ROOT, "Sequential", 1, True, None), ("block", cls.__name__, 1, True, None),
                             ("block.child", "_Child", 1, True, None), ("block.child.lin", "Linear", 1, True, None)])
    outcomes = {ROOT: whole, "block": whole, "block.child": child}
    assert own_code_candidates(tree, outcomes) == ["block"]


# --------------------------------------------------------------------------- names and caches

def test_tracer_paths_resolve_to_qualified_names() -> None:
    names = {"": "Llava", "model": "LlavaModel", "model.vision_tower": "CLIPVisionModel",
             "model.vision_tower.vision_model.encoder.layers.0.self_attn": "CLIPAttention",
             "model.language_model.layers.0.self_attn": "LlamaAttention",
             "model.language_model.layers.0": "LlamaDecoderLayer"}
    assert resolve_module_name("L.args.0.model.language_model.layers.0.self_attn", names) == \
        "model.language_model.layers.0.self_attn"
    assert resolve_module_name("encoder.layers.0.self_attn", names, "CLIPAttention") == \
        "model.vision_tower.vision_model.encoder.layers.0.self_attn"
    assert resolve_module_name("layers.0.self_attn", names, "LlamaAttention") == "model.language_model.layers.0.self_attn"
    assert resolve_module_name("model.language_model.layers.0", names) == "model.language_model.layers.0"
    assert resolve_module_name("nothing.like.it", names) is None


def test_caches_off_in_every_nested_config() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlavaConfig(
        text_config={"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                       "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 16, "patch_size": 8},
        image_token_id=3)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    assert model.config.text_config.use_cache is True
    disable_caches(model)
    assert model.config.text_config.use_cache is False
    assert model.model.language_model.config.use_cache is False
    seen = {}
    layer = model.model.language_model.layers[0]
    handle = layer.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    ids = torch.tensor([[3] * 4 + [5, 6, 7]])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=torch.randn(1, 3, 16, 16))
    handle.remove()
    assert seen.get("past_key_values") is None  # no cache object: the decoder layer can be stored and replayed
    assert "model.language_model.layers.0.self_attn" in module_names(model)


@pytest.mark.slow  # traces tiny LLaVA with Dynamo + AOT autograd: ~20 s
def test_every_ops_call_site_of_tiny_llava_resolves_on_the_users_model() -> None:
    """LLaVA graph-breaks into 7 graphs; frames that start inside the vision tower name their modules from there
    (`encoder.layers.0`): the inventory names them by their full path on the model the user built."""
    from ci_runner.config import load_matrix
    from ci_runner.modes.ops.inventory import take_inventory
    from ci_runner.models.load import build_inputs, load_model

    matrix = load_matrix(None)  # the bundled example's tiny-llava
    loaded = load_model(matrix.model("tiny-llava"), seed=0)
    inv = take_inventory(loaded.module, (), build_inputs(loaded, matrix.inputs), level="aten")
    sites = {site.module for s in inv.signatures for site in s.sites}
    assert inv.graphs > 1 and any(m.startswith("model.vision_tower.") for m in sites), sorted(sites)[:5]
    for name in sites:
        loaded.module.get_submodule(name)  # raises AttributeError for a name that does not resolve


# --------------------------------------------------------------------------- issue 25: one cause across modes

def _op_finding(op: str, sym: str, *, tb: str = OV_TB) -> Finding:
    """An ops finding as the ops mode now writes it: `Type: message`, the raising traceback in details."""
    return Finding(kind="op_error", stage="compile", op=op, error_type="AssertionError", fingerprint="ef" * 10,
                   message=f"AssertionError: sources must not be empty for symbol {sym}\nError while creating guard:",
                   details={"traceback_tail": tb % sym})


def test_ops_and_layers_findings_of_one_error_share_one_root_cause() -> None:
    ops = [_op_finding(op, f"s{i}") for i, op in enumerate(["aten.neg.default", "aten.cat.default"])]
    layers = [_layer_finding("model.layers.0.mlp.experts.act_fn", "s96")]
    cell = CellResult(id="tiny-mixtral@openvino", model="tiny-mixtral", backend="openvino", status="fail", modes={
        "ops": ModeResult(status="fail", findings=ops), "layers": ModeResult(status="fail", findings=layers)})
    causes = root_causes(Results(cells=[cell]))
    assert len(causes) == 1 and causes[0]["count"] == 3 and set(causes[0]["kinds"]) == {"op_error", "layer_failure"}
    assert causes[0]["message"] == "sources must not be empty for symbol s<N>"  # the type is not repeated
    for f in ops + layers:
        assert "symbolic_shapes.py:6557 in produce_guards_verbose" in f.details["raised_in"]


def test_the_ops_ranking_lists_a_shared_torch_error_as_one_cause() -> None:
    from ci_runner.run.aggregate import op_ranking

    backend_tb = OV_TB.replace("torch/fx/experimental/symbolic_shapes.py", "openvino/frontend/convert.py")
    own = Finding(kind="unsupported_op", stage="compile", op="aten.histc.default", error_type="RuntimeError",
                  message="RuntimeError: histc not supported", fingerprint="12" * 10,
                  details={"traceback_tail": backend_tb % "x"})
    cells = [CellResult(id=f"{m}@openvino", model=m, backend="openvino", status="fail", modes={"ops": ModeResult(
        status="fail", findings=[_op_finding("aten.neg.default", "s1"), _op_finding("aten.cat.default", "s2"), own])})
        for m in ("tiny-mixtral", "tiny-llama")]
    # the same backend error on two ops is still about the ops (raised by the backend, not torch)
    cells[1].modes["ops"].findings.append(Finding(
        kind="unsupported_op", stage="compile", op="aten.sort.default", error_type="RuntimeError",
        message="RuntimeError: histc not supported", fingerprint="34" * 10, details={"traceback_tail": backend_tb % "x"}))
    rows = op_ranking(Results(cells=cells))
    cause = rows[0]
    assert cause["op"] is None and cause["ops"] == ["aten.cat.default", "aten.neg.default"] and cause["count"] == 2
    assert cause["error_type"] == "AssertionError" and "symbolic_shapes.py" in cause["raised_in"]
    assert [r["op"] for r in rows[1:]] == ["aten.histc.default", "aten.sort.default"]
    from ci_runner.report.summary import render_summary

    text = render_summary(Results(cells=cells, ranking=rows))
    assert "cause, not an operator: `AssertionError`: sources must not be empty" in text
    assert "| `aten.neg.default` |" not in text


def test_culprit_cross_check_agrees_with_the_ops_finding() -> None:
    from ci_runner.modes.layers.culprit import ops_cross_check

    rows = [{"op": "aten.view.default", "status": "inconclusive"}, {"op": "aten.view.default", "status": "error"},
            {"op": "aten.view.default", "status": "pass"}, {"op": "aten.silu.default", "status": "pass"},
            {"op": "aten.mm.default", "status": "unsupported"}]
    assert ops_cross_check(rows, ["aten.view.default", "aten.silu.default"]) == {
        "aten.view.default": "error", "aten.silu.default": "pass"}


def test_culprit_label_says_when_its_repro_did_not_reproduce() -> None:
    from ci_runner.report.view import culprit_label

    def f(repro: dict[str, object]) -> Finding:
        return Finding(kind="layer_failure", stage="compile", message="m", fingerprint="56" * 10,
                       details={"culprit": {"found": True, "kind": "single", "ops": ["aten.silu.default"],
                                            "repro": repro}})

    assert culprit_label(f({"path": "r.py", "verified": True})) == "culprit"
    assert culprit_label(f({"path": "r.py", "verified": False, "note": "the repro passed: the failure did not "
                            "reproduce"})) == "culprit (repro did not reproduce)"
    assert culprit_label(f({"path": "r.py", "verified": False, "note": "not verified"})) == "culprit (not verified)"


def test_a_layers_pass_says_what_ran_in_eager() -> None:
    from ci_runner.modes.layers.mode import _with_eager_ops

    assert _with_eager_ops(None, {}) is None
    text = _with_eager_ops(None, {"eager_ops": ["aten.histc.default", "aten.floor_divide.default"]})
    assert text is not None and "2 op(s) ran in PyTorch eager" in text and "aten.histc.default" in text


def test_the_summary_shows_what_a_pass_did_not_cover() -> None:
    from ci_runner.report.summary import render_summary

    reason = "the backend ran only part of the model: 1 op(s) ran in PyTorch eager (its partitioner left them out)"
    cell = CellResult(id="router@openvino", model="router", backend="openvino", status="pass",
                      modes={"layers": ModeResult(status="pass", reason=reason)})
    text = render_summary(Results(cells=[cell]))
    assert f"- `router@openvino` layers pass: {reason}" in text


# --------------------------------------------------------------------------- a backend's boilerplate first line

def _iree_message(op: str, loc: str, ssa: str, types: str) -> str:
    """A layers probe's message on IREE (issue 38): the error's one line, then the MLIR diagnostic it wrote to fd 2
    (the shape `search._probe_one` appends, as IREE 3.9 prints it)."""
    return ("JIT compilation failed. See diagnostics.\n"
            f"{loc}: error: failed to legalize operation 'torch.operator' that was explicitly marked illegal: "
            f'{ssa} = "torch.operator"(%arg0, %0, %1, %2) <{{name = "{op}"}}> : {types}')


def _iree_finding(module: str, message: str) -> Finding:
    return Finding(kind="layer_failure", stage="compile", module=module, error_type="RuntimeError",
                   message=f"{module} fails alone at compile: RuntimeError: {message}", fingerprint=module[:20],
                   details={"message_full": message, "traceback_tail": (
                       'Traceback (most recent call last):\n  File "/v/site-packages/iree/turbine/runtime/launch.py", '
                       'line 292, in callback\n    raise RuntimeError(f"JIT compilation failed. See diagnostics.")\n'
                       'RuntimeError: JIT compilation failed. See diagnostics.\n')})


def test_iree_boilerplate_line_is_skipped_so_two_ops_are_two_causes() -> None:
    from ci_runner.backends import boilerplate_lines
    from ci_runner.results.rootcause import cause_line

    lines = boilerplate_lines()
    assert "JIT compilation failed. See diagnostics." in lines  # declared by backends/iree.py
    histc_a = _iree_message("torch.aten.histc", "source.mlir:52:11", "%37",
                            "(!torch.vtensor<[16],f32>, !torch.int, !torch.int, !torch.int) -> !torch.vtensor<[4],f32>")
    histc_b = _iree_message("torch.aten.histc", "source.mlir:6:10", "%3",
                            "(!torch.vtensor<[8],f32>, !torch.int, !torch.int, !torch.int) -> !torch.vtensor<[4],f32>")
    gmm = _iree_message("torch.transformers.grouped_mm_fallback", "source.mlir:3:10", "%1",
                        "(!torch.vtensor<[6,4],f32>, !torch.vtensor<[3,4,5],f32>) -> !torch.vtensor<[6,5],f32>")
    assert cause_line(histc_a, lines).startswith("source.mlir:52:11: error: failed to legalize")
    assert cause_line(histc_a) == "JIT compilation failed. See diagnostics."  # without the declaration
    assert cause_line("compiler: x\nrest", ()) == "x" and cause_line("", lines) == ""
    findings = [_iree_finding("model.layers.0.mlp.experts", histc_a), _iree_finding("router", histc_b),
                _iree_finding("model.layers.1.mlp.experts", gmm)]
    cell = CellResult(id="tiny-mixtral@iree", model="tiny-mixtral", backend="iree", status="fail",
                      modes={"layers": ModeResult(status="fail", findings=findings)})
    causes = root_causes(Results(cells=[cell]), boilerplate=lines)
    assert [c["count"] for c in causes] == [2, 1], causes  # histc at two places and shapes is one cause
    assert 'name = "torch.aten.histc"' in causes[0]["message"] and "<LOC>:" in causes[0]["message"]
    assert causes[0]["message"].endswith(": <TYPES>") and "%<N>" in causes[0]["message"]
    assert "grouped_mm_fallback" in causes[1]["message"]
    assert len({c["raised_in"] for c in causes}) == 1 and causes[0]["role"] == "backend"
    # the old key (the first line) merged them: the declaration is what tells them apart
    assert len(root_causes(Results(cells=[cell]))) == 1
    # the layers search's grouping agrees (ProbeOutcome.cause_of, with the lines `search.BOILERPLATE` holds)
    from ci_runner.modes.layers.search import BOILERPLATE
    o = [ProbeOutcome(name=str(i), status="fail", stage="compile", error_type="RuntimeError", message=m)
         for i, m in enumerate((histc_a, histc_b, gmm))]
    assert o[0].cause_of(BOILERPLATE) == o[1].cause_of(BOILERPLATE) != o[2].cause_of(BOILERPLATE)
    assert o[0].cause == o[2].cause  # the plain key, as before


@pytest.mark.slow
def test_real_iree_messages_of_histc_and_grouped_mm_are_two_causes() -> None:
    """The messages as IREE (turbine_cpu) really gives them, read as the layers probe reads them."""
    pytest.importorskip("iree.turbine")
    import transformers.integrations.moe  # noqa: F401  (registers torch.ops.transformers.grouped_mm_fallback)
    from ci_runner.backends import boilerplate_lines
    from ci_runner.failures.diagnostics import capture_fd2, compiler_words
    from ci_runner.failures.failure import unwrap
    from ci_runner.results.rootcause import error_signature

    def histc(x: torch.Tensor) -> torch.Tensor:
        return torch.histc(x, bins=4, min=0, max=1) + 1

    def gmm(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.transformers.grouped_mm_fallback(x, x.new_ones(3, 4, 5), torch.tensor([2, 4, 6])) + 1

    sigs = []
    for fn, x in ((histc, torch.rand(8)), (gmm, torch.rand(6, 4))):
        torch._dynamo.reset()
        with capture_fd2() as err, pytest.raises(Exception) as info:
            torch.compile(fn, backend="turbine_cpu")(x)
        inner = unwrap(info.value)
        words, _ = compiler_words(err[0], inner, str(inner))
        message = str(inner) + "\n" + "\n".join(words)
        assert message.startswith("JIT compilation failed. See diagnostics.\n"), message
        sigs.append(error_signature(type(inner).__name__, message, boilerplate=boilerplate_lines()))
    assert "torch.aten.histc" in sigs[0].message and "grouped_mm_fallback" in sigs[1].message, sigs
    assert sigs[0].id != sigs[1].id


# --------------------------------------------------------------------------- one cause in findings of two kinds

def _sdpa_nan() -> Finding:
    from ci_runner.modes.ops.compare import compare_leaf

    e = torch.zeros(2, 4)
    words = compare_leaf(0, e, torch.where(torch.arange(4) < 2, torch.nan, 0.0).expand(2, 4), 1e-4, 1e-5)  # the ops mode's words
    assert words is not None
    op = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    return Finding(kind="op_mismatch", stage="compare", op=op, error_type="OpMismatch", fingerprint="aa" * 10,
                   message=f"OpMismatch: {op} differs from CPU eager: {words}", module="model.layers.0.self_attn",
                   details={"modules": ["model.layers.0.self_attn", "model.layers.1.self_attn"]})


def _nan_divergence(module: str, nonfinite: int = 1408) -> Finding:
    return Finding(kind="divergence", stage="compare", module=module, module_class="Attention", phase="batch",
                   message=f"batch: NaN/Inf on the real tokens of row 1; it starts in {module}", fingerprint="bb" * 10,
                   metrics={"rows": [1], "nonfinite_tgt": nonfinite})


def _cells(*modes: dict[str, list[Finding]]) -> Results:
    return Results(cells=[CellResult(id=f"m{i}@ov", model=f"m{i}", backend="ov", status="fail",
                                     modes={k: ModeResult(status="fail", findings=v) for k, v in ms.items()})
                          for i, ms in enumerate(modes)])


def test_a_nan_divergence_that_an_operator_gives_is_that_operators_cause() -> None:
    """Issue 45: OpenVINO's SDPA gives NaN on a fully masked row (the ops finding), and the padded batch's NaN starts
    in the attention that calls it: one cause, not two. In another cell, without that op finding, the same layer
    class's divergence is its own cause; a finite divergence in that layer is never the NaN's."""
    op, div = _sdpa_nan(), _nan_divergence("model.layers.0.self_attn")
    other = _nan_divergence("model.layers.0.self_attn")
    finite = _nan_divergence("model.layers.1.self_attn", nonfinite=0)
    results = _cells({"ops": [op], "numerics": [div]}, {"numerics": [other]}, {"ops": [_sdpa_nan()], "numerics": [finite]})
    causes = root_causes(results)
    assert div.details["signature"] == op.details["signature"]
    assert div.details["same_cause_as"]["op"] == op.op and "NaN/Inf" in div.details["same_cause_as"]["why"]
    assert other.details["signature"] != op.details["signature"] and "same_cause_as" not in other.details
    assert "same_cause_as" not in finite.details
    (sdpa,) = [c for c in causes if c["signature"] == op.details["signature"]]
    assert sdpa["count"] == 3 and sdpa["kinds"] == ["op_mismatch", "divergence"]


def test_a_leftover_op_that_fails_in_the_ops_mode_is_one_cause_and_two_ops_are_no_guess() -> None:
    """OpenVINO's `sym_max`: left outside its partitions (compile) and unsupported (ops) in one cell: one cause.
    A NaN divergence in a layer where two different ops give NaN joins neither."""
    unsupported = Finding(kind="unsupported_op", stage="compile", op="torch.sym_max", error_type="AssertionError",
                          message="decode: torch.sym_max on a dynamic size fails: AssertionError: expected int",
                          fingerprint="cc" * 10)
    leftover = Finding(kind="eager_fallback", stage="run", op="sym_max", fingerprint="dd" * 10,
                       message="sym_max ran in PyTorch eager: openvino's partitioner left it outside its partitions")
    histc = Finding(kind="eager_fallback", stage="run", op="aten.histc.default", fingerprint="ee" * 10,
                    message="aten.histc.default ran in PyTorch eager")
    nan2 = _sdpa_nan()
    nan2.op = "aten.softmax.default"
    div = _nan_divergence("model.layers.0")
    root_causes(_cells({"ops": [unsupported, _sdpa_nan(), nan2], "compile": [leftover, histc], "numerics": [div]}))
    assert leftover.details["signature"] == unsupported.details["signature"]
    assert histc.details["signature"] != unsupported.details["signature"] and "same_cause_as" not in histc.details
    assert "same_cause_as" not in div.details


def test_the_report_says_which_operator_finding_a_finding_shares_its_cause_with(tmp_path: Path) -> None:
    from ci_runner.report.html import render_html

    op, div = _sdpa_nan(), _nan_divergence("model.layers.0.self_attn")
    results = _cells({"ops": [op], "numerics": [div]})
    results.root_causes = root_causes(results)
    html = render_html(results)
    assert "cause: one cause with the ops mode&#x27;s op_mismatch of aten._scaled_dot_product_flash_attention" in html \
        or "cause: one cause with the ops mode's op_mismatch of aten._scaled_dot_product_flash_attention" in html


def _culprit_layer(module: str, error: str, *, op: str = "aten.topk.default", verified: bool = True,
                   culprit_error: str = "", culprit_type: str = "RuntimeError") -> Finding:
    culprit = {"found": True, "kind": "single", "ops": [op], "error_type": culprit_type,
               "message": culprit_error, "repro": {"verified": verified}}
    return Finding(kind="layer_failure", stage="compile", module=module, error_type="RuntimeError",
                   message=f"{module} fails alone at compile: RuntimeError: JIT compilation failed. See diagnostics.",
                   fingerprint="ff" * 10,
                   details={"message_full": f"JIT compilation failed. See diagnostics.\n{error}", "culprit": culprit})


def test_a_layer_whose_verified_culprit_fails_as_the_ops_finding_does_is_that_operators_cause() -> None:
    """DeepSeek-V3's MoE gate on IREE: the gate's first error names `torch.constant.int`, its culprit
    `topk(sorted=False)` alone fails on `torch.constant.bool` as the ops probe of `topk` does: one cause. A culprit
    whose error is another (Llama 4's complex `mul` replayed: a Dynamo error) or whose repro did not reproduce
    joins nothing."""
    bool_line = "source.mlir:6:14: error: failed to legalize operation 'torch.constant.bool': %0 = \"torch.constant.bool\"() <{value = false}> : () -> !torch.bool"
    topk = Finding(kind="unsupported_op", stage="compile", op="aten.topk.default", error_type="RuntimeError",
                   message=f"RuntimeError: JIT compilation failed. See diagnostics.\n{bool_line}", fingerprint="ab" * 10)
    gate = _culprit_layer("model.layers.1.mlp.gate", "<unknown>:0: error: failed to legalize operation "
                          "'torch.constant.int': %8 = \"torch.constant.int\"() <{value = -1 : i64}> : () -> !torch.int",
                          culprit_error=bool_line.replace("6:14", "9:3").replace("%0", "%4"))
    unverified = _culprit_layer("model.layers.2.mlp.gate", "<unknown>:0: error: other", culprit_error=bool_line,
                                verified=False)
    other_error = _culprit_layer("model.layers.3.mlp.gate", "<unknown>:0: error: LLVM Translation failed",
                                 culprit_error="Tensor must have a last dimension of size 2",
                                 culprit_type="InternalTorchDynamoError")
    boiler = ("JIT compilation failed. See diagnostics.",)
    root_causes(_cells({"ops": [topk], "layers": [gate, unverified, other_error]}), boilerplate=boiler)
    assert gate.details["signature"] == topk.details["signature"]
    assert "culprit is aten.topk.default alone" in gate.details["same_cause_as"]["why"]
    for f in (unverified, other_error):
        assert f.details["signature"] != topk.details["signature"] and "same_cause_as" not in f.details


def test_an_op_failing_on_a_shared_torch_error_explains_no_leftover_of_that_op() -> None:
    """A guard error raised in torch fails every op of a phase (a shared cause, not the ops'): OpenVINO leaving
    `histc` to PyTorch is not that error's."""
    tb = OV_TB % "s1"
    failing = [Finding(kind="op_error", stage="compile", op=op, error_type="AssertionError", fingerprint=op,
                       message="AssertionError: sources must not be empty for symbol s1",
                       details={"traceback_tail": tb}) for op in ("aten.histc.default", "aten.exp.default")]
    leftover = Finding(kind="eager_fallback", stage="compile", op="aten.histc.default", fingerprint="ee" * 10,
                       message="aten.histc.default ran in PyTorch eager")
    root_causes(_cells({"ops": failing, "compile": [leftover]}))
    assert "same_cause_as" not in leftover.details and leftover.details["signature"] != failing[0].details["signature"]
