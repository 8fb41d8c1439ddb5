"""The numerics repro (modes/numerics/repro.py, templates/repro_numerics.py.j2) without a run of the mode: the script
renders, starts with the verification marker, and computes rel and cos as the mode's metrics do."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ci_runner.engine.repro import render_template, template_backend
from ci_runner.config import BackendSpec
from ci_runner.modes.numerics.metrics import compare_tensors
from ci_runner.modes.numerics.phaserepro import _watched, attach_phase_repros
from ci_runner.modes.numerics.repro import _via
from ci_runner.options import NumericsOptions
from ci_runner.results.model import Finding
from tests.fixtures.matrices import REFERENCES, matrix_text

SOURCE = {"kind": "factory", "factory": "pkg.mod:build", "seed": 0, "overrides": {}, "dtype": "float32"}


def _render(**over: object) -> str:
    ctx = dict(module="blk.attn", qualified_name="blk.attn", module_class="Attn", model_id="m",
               model_source="factory:pkg.mod:build", backend_id="aot_eager",
               backend=template_backend(BackendSpec(id="aot_eager", compile="aot_eager")),
               message="blk.attn diverges on its own", source=SOURCE, call={"args": [], "kwargs": {}},
               ref_dtype="float32", target_dtype="bfloat16", via=None, via_call=0, threshold_rel=1e-3,
               threshold_cos=0.999, command="python repro.py")
    ctx.update(over)
    return render_template("repro_numerics.py.j2", **ctx)


def test_via_is_a_path_below_the_layer_and_a_call_index() -> None:
    assert _via("model.layers.0.self_attn", "model.layers.0.self_attn.o_proj") == ("o_proj", 0)
    assert _via("model.layers.0.self_attn", "model.layers.0.self_attn.o_proj#2") == ("o_proj", 2)
    assert _via("", "model.norm") == ("model.norm", 0)
    assert _via("a", None) == (None, 0)
    assert _via("a", "ab.c") == (None, 0)  # not below `a`


def test_the_script_starts_with_the_marker_and_holds_the_threshold(tmp_path: Path) -> None:
    src = _render(via="o_proj", via_call=1)
    compile(src, "repro.py", "exec")
    code = [ln for ln in src.splitlines() if ln.strip() and not ln.startswith("#")]
    assert code[0].startswith('print("REPRO STARTED"')
    assert "THRESHOLD_REL = 0.001" in src and "VIA = 'o_proj'" in src and "VIA_CALL = 1" in src
    assert "import ci_runner" not in src and "from ci_runner" not in src


@pytest.mark.parametrize("ref,tgt", [
    (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.001, 3.0])),
    (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),
     torch.randn(4, 8, generator=torch.Generator().manual_seed(1))),
    (torch.zeros(3), torch.zeros(3)),
    (torch.tensor([1.0, float("-inf")]), torch.tensor([1.5, float("-inf")])),
    (torch.tensor([1.0, 2.0]), torch.tensor([1.0, float("nan")])),
])
def test_the_scripts_metrics_are_the_modes(tmp_path: Path, ref: torch.Tensor, tgt: torch.Tensor) -> None:
    script = tmp_path / "repro.py"
    script.write_text(_render(), encoding="utf-8")
    space: dict[str, object] = {"__name__": "not_main", "__file__": str(script)}
    exec(compile(script.read_text(encoding="utf-8"), str(script), "exec"), space)
    rel, cos = space["rel_cos"](ref, tgt)  # type: ignore[operator]
    want = compare_tensors(ref, tgt)
    assert math.isclose(rel, float(want["rel"]), rel_tol=1e-9, abs_tol=1e-15) or rel == float(want["rel"])
    assert math.isclose(cos, float(want["cos"]), rel_tol=1e-9, abs_tol=1e-12)


def _phase_space(tmp_path: Path, **over: object) -> dict[str, object]:
    """The phase repro (repro_numerics_phase.py.j2) rendered and executed as a module (its main not run)."""
    ctx = dict(module="blk.attn", qualified_name="blk.attn", module_class="Attn", model_id="m",
               model_source="config:llama", backend_id="aot_eager",
               backend=template_backend(BackendSpec(id="aot_eager", compile="aot_eager")), message="diverges",
               source=SOURCE, call=None, phase="batch (lengths [2, 1])", call_label="batch", module_call=0, kv=None,
               calls=[{"label": "batch", "tensors": {"input_ids": "0.input_ids"}}], cache=None, use_cache=False,
               real=[[True, True], [False, True]], ref_dtype="float32", target_dtype="float32", threshold_rel=1e-3,
               threshold_cos=None, command="python repro.py", overwritten=None)
    ctx.update(over)
    script = tmp_path / "repro.py"
    script.write_text(render_template("repro_numerics_phase.py.j2", **ctx), encoding="utf-8")
    space: dict[str, object] = {"__name__": "not_main", "__file__": str(script)}
    exec(compile(script.read_text(encoding="utf-8"), str(script), "exec"), space)
    return space


def test_the_phase_script_compares_real_tokens_and_finds_where_nan_starts(tmp_path: Path) -> None:
    """A module's NaN counts in its whole row (padding included: where deepview-ci sees a NaN start); the logits'
    only on the real tokens, as the rel is."""
    ref = torch.zeros(2, 2, 3)
    tgt = ref.clone()
    tgt[1, 0, 0] = float("nan")  # row 1's padded position
    module = _phase_space(tmp_path)
    assert [tuple(r.shape) for r in module["rows"](ref)] == [(2, 3), (1, 3)]  # type: ignore[operator]
    assert module["nonfinite_row"](ref, tgt) == 1  # type: ignore[operator]
    logits = _phase_space(tmp_path, qualified_name="", module="(model)")
    assert logits["nonfinite_row"](ref, tgt) is None  # type: ignore[operator]
    assert logits["WATCHED"] == "" and logits["QUALIFIED_NAME"] == ""
    src = (tmp_path / "repro.py").read_text(encoding="utf-8")
    assert [ln for ln in src.splitlines() if ln.strip() and not ln.startswith("#")][0].startswith('print("REPRO STARTED"')


def test_a_phase_findings_module_names_what_its_repro_compares() -> None:
    assert _watched("model.layers.0.mlp") == ("model.layers.0.mlp", None)
    assert _watched("(model)") == ("", None)
    assert _watched("kv:layers.3.values") == ("", (3, "values"))
    with pytest.raises(ValueError):
        _watched("kv:something")


def test_the_findings_of_one_phase_share_one_reference_run(mode_context: Any) -> None:
    """modes/numerics/phaserepro.py: the reference's run of a phase is made once per attach pass, whatever the
    number of its findings (several `output_overwritten` findings of one decode phase ran it once each); each
    finding's script still gets the phase's calls up to its own, as the reference made them."""
    llama = {"id": "llama", "config": "llama", "overrides": {
        "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 64, "max_position_embeddings": 64}}
    text = matrix_text(models=[llama], backends=[{"id": "aot_eager", "compile": "aot_eager"}], references=REFERENCES,
                       inputs={"seq_len": 6, "samples": 1, "phases": ["prefill", {"decode": {"steps": 2}}]})
    ctx = mode_context(text, "llama", "aot_eager")
    reference = ctx.model(dtype=ctx.cell.references[0].dtype).module
    forwards: list[int] = []
    hook = reference.register_forward_pre_hook(lambda *_: forwards.append(1))

    def over(call: str, after: str) -> Finding:
        return Finding(kind="output_overwritten", stage="compare", message="m", fingerprint=f"{call}>{after}",
                       module="(model)", phase="decode", details={"call": call, "changed_after": after})

    findings = [over("prefill", "decode step 1"), over("decode step 1", "decode step 2"),
                Finding(kind="divergence", stage="compare", message="m", fingerprint="p", module="model.norm",
                        phase="prefill", details={"call": "prefill"}, threshold={"rel": 1e-3})]
    try:
        attach_phase_repros(ctx, findings, NumericsOptions(verify=False))
    finally:
        hook.remove()
    assert all(f.repro is not None for f in findings), [f.details.get("repro_note") for f in findings]
    assert len(forwards) == 3 + 1  # decode: prefill and 2 steps, once; prefill: 1 (it was 3 + 3 + 1)
    folder = ctx.cell_dir / Path(findings[1].repro.path).parent  # type: ignore[union-attr]
    kept = load_file(str(folder / "inputs.safetensors"))  # the last overwrite's (both share the folder)
    assert {k.split(".")[0] for k in kept} == {"0", "1", "2"}, sorted(kept)  # up to decode step 2
    prefill = load_file(str(ctx.cell_dir / Path(findings[2].repro.path).parent / "inputs.safetensors"))
    assert {k.split(".")[0] for k in prefill} == {"0"}
    assert torch.equal(prefill["0.input_ids"], kept["0.input_ids"])
