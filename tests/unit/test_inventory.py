"""The op inventory: what each IR level records, from meta models, with owners and source lines."""

from __future__ import annotations

from collections.abc import Callable
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ci_runner.modes.ops.inventory import (
    InventoryError,
    normalize_module_path,
    source_from_stack_trace,
    take_inventory,
)
from ci_runner.engine.codec import describe_value, encode_arg
from ci_runner.modes.ops.signature import Inventory
from tests.fixtures.oldtorch import differs_on_oldest

pytestmark = pytest.mark.oldtorch  # the old-torch subset (tests/fixtures/oldtorch.py)


class Mixer(nn.Module):
    """A state-space-like block: pad, softplus, cumsum, exp (ops a transformer-only backend lacks)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.softplus(self.proj(x))
        h = F.pad(h, (0, 0, 1, 0))[:, 1:]
        return torch.exp(torch.cumsum(h, dim=1) * -0.1) * x


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, d)


class Tiny(nn.Module):
    def __init__(self, vocab: int = 32, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mixer = Mixer(d)
        self.attn = Attn(d)
        self.norm = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.mixer(x)
        x = x + self.attn(x)
        return self.norm(x)


def _meta_tiny() -> Tiny:
    with torch.device("meta"):
        return Tiny().eval()


IDS = torch.zeros(1, 6, dtype=torch.long)


def _aot_ops(model: nn.Module, *args: torch.Tensor, reset: Callable[[], None]) -> set[str]:
    """Ground truth: the ops an aot_autograd backend receives when compiling the real model on CPU."""
    from torch._dynamo.backends.common import aot_autograd

    seen: set[str] = set()

    def record(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        seen.update(str(n.target) for n in gm.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
        return gm

    reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=record), dynamic=False)(*args)
    reset()
    return seen


def test_encode_tags_every_kind_of_argument() -> None:
    t = torch.empty(2, 3).t()
    enc = encode_arg([t, 2, 1.5, float("inf"), None, torch.float16, torch.device("cpu"), torch.strided,
                        torch.contiguous_format, slice(1, None), Ellipsis, (1, 2), "mean", True])
    assert enc[0] == {"__tensor__": {"shape": [3, 2], "stride": [1, 3], "dtype": "float32"}}
    assert enc[1:5] == [2, 1.5, {"__float__": "inf"}, None]
    assert enc[5] == {"__dtype__": "float16"} and enc[6] == {"__device__": "cpu"}
    assert enc[7] == {"__layout__": "strided"} and enc[8] == {"__memory_format__": "contiguous_format"}
    assert enc[9] == {"__slice__": [1, None, None]} and enc[10] == {"__ellipsis__": True}
    assert enc[11] == {"__tuple__": [1, 2]} and enc[12:] == ["mean", True]
    json.dumps(enc)  # JSON-able
    assert describe_value(enc[0]) == "f32[3, 2]{stride=(1, 3)}"
    assert describe_value({"__tensor__": {"shape": [4], "stride": [1], "dtype": "bfloat16"}}) == "bf16[4]"


def test_module_paths_and_source_lines_are_normalised() -> None:
    assert normalize_module_path("L['self'].model.layers[0]._modules['mlp']") == "model.layers.0.mlp"
    assert normalize_module_path("model.layers.0@1") == "model.layers.0"
    assert normalize_module_path("L['self']") == ""
    trace = ('  File "/x/site-packages/transformers/models/llama/modeling_llama.py", line 12, in forward\n'
             '    h = self.up(x)\n'
             f'  File "{torch.__file__.rsplit("/", 1)[0]}/nn/modules/linear.py", line 134, in forward\n'
             '    return F.linear(x, self.weight)\n')
    assert source_from_stack_trace(trace) == "transformers/models/llama/modeling_llama.py:12 in forward"
    assert source_from_stack_trace(None) is None


@differs_on_oldest("2.7's aot_autograd capture of a meta model fails; the inventory falls back to torch.export")
def test_aten_inventory_from_a_meta_model_matches_what_aot_autograd_hands_a_backend(fresh_dynamo: Callable[[], None]) -> None:
    meta = _meta_tiny()
    assert all(p.is_meta for p in meta.parameters())
    inv = take_inventory(meta, (IDS,), level="aten", device="cpu")
    assert inv.method == "aot" and inv.level == "aten" and inv.device == "cpu"
    torch.manual_seed(0)
    truth = _aot_ops(Tiny().eval(), IDS, reset=fresh_dynamo)
    assert set(inv.op_names()) == truth
    # the meta model is untouched (the trace used a fake copy)
    assert all(p.is_meta for p in meta.parameters())


def test_signatures_carry_shapes_dtypes_strides_owner_and_source() -> None:
    inv = take_inventory(_meta_tiny(), (IDS,), level="aten", device="cpu")
    by_op = inv.by_op()
    (softplus,) = by_op["aten.softplus.default"]
    assert softplus.args[0] == {"__tensor__": {"shape": [1, 6, 8], "stride": [48, 8, 1], "dtype": "float32"}}
    assert softplus.count == 1
    site = softplus.sites[0]
    assert (site.module, site.module_class) == ("mixer", "Mixer")
    assert site.source is not None and site.source.startswith("tests/unit/test_inventory.py:")
    assert "in forward" in site.source
    (emb,) = by_op["aten.embedding.default"]
    assert emb.sites[0].module == "embed" and emb.args[1]["__tensor__"]["dtype"] == "int64"
    # every call is counted, and each distinct signature listed once
    assert inv.total_calls == sum(s.count for s in inv.signatures)
    assert len({s.key for s in inv.signatures}) == len(inv.signatures)


@differs_on_oldest("2.7's export with the CIA-only decompositions keeps select/unbind that aot_autograd decomposes")
def test_export_fallback_gives_the_same_ops_here() -> None:
    from ci_runner.modes.ops.inventory import trace_export

    aot = take_inventory(_meta_tiny(), (IDS,), level="aten", device="cpu")
    exp = trace_export(_meta_tiny(), (IDS,), {}, level="aten", device="cpu")
    assert exp.method == "export"
    # non-strict export runs Python: `q, k, v = t` unbinds where Dynamo selects
    assert set(exp.op_names()) ^ set(aot.op_names()) == {"aten.unbind.int", "aten.select.int"}


def test_same_signature_from_two_modules_is_one_entry_with_two_sites() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = Mixer(4)
            self.b = Mixer(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    with torch.device("meta"):
        model = Two()
    inv = take_inventory(model, (torch.ones(1, 3, 4),), level="aten")
    (sp,) = inv.by_op()["aten.softplus.default"]
    assert sp.count == 2 and [s.module for s in sp.sites] == ["a", "b"] and sp.site_count == 2


def test_device_decides_the_attention_kernel() -> None:
    cpu = take_inventory(_meta_tiny(), (IDS,), level="aten", device="cpu")
    other = take_inventory(_meta_tiny(), (IDS,), level="aten", device="simdev")
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in cpu.op_names()
    assert other.device == "meta"
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in other.op_names()
    assert "aten._safe_softmax.default" in other.op_names()  # the math path an out-of-tree device takes


def test_core_aten_is_lowered_further() -> None:
    aten = set(take_inventory(_meta_tiny(), (IDS,), level="aten").op_names())
    core = set(take_inventory(_meta_tiny(), (IDS,), level="core_aten").op_names())
    assert "aten.softplus.default" in aten and "aten.softplus.default" not in core
    assert "aten.native_layer_norm.default" in core


def test_dynamo_level_records_torch_functions() -> None:
    inv = take_inventory(_meta_tiny(), (IDS,), level="dynamo")
    names = set(inv.op_names())
    assert "torch.nn.functional.softplus" in names or "torch._C._nn.softplus" in names
    assert "torch.cumsum" in names and "torch.exp" in names
    assert not any(n.startswith("aten.") for n in names)
    (sig,) = [s for s in inv.signatures if s.op == "torch.cumsum"]
    assert sig.sites[0].module == "mixer"


def test_dispatch_level_sees_eager_ops_with_module_stack() -> None:
    inv = take_inventory(_meta_tiny(), (IDS,), level="dispatch", device="simdev")
    names = set(inv.op_names())
    assert {"aten.softplus.default", "aten.cumsum.default", "aten.exp.default", "aten.embedding.default"} <= names
    (sp,) = inv.by_op()["aten.softplus.default"]
    assert sp.sites[0].module == "mixer" and sp.sites[0].module_class == "Mixer"
    assert sp.sites[0].source is not None and "test_inventory.py" in sp.sites[0].source
    assert inv.method == "dispatch"


def test_inventory_round_trips_and_summary_is_bounded() -> None:
    inv = take_inventory(_meta_tiny(), (IDS,), level="aten")
    back = Inventory.from_dict(json.loads(json.dumps(inv.to_dict())))
    assert [s.key for s in back.signatures] == [s.key for s in inv.signatures]
    assert back.signatures[0].sites == inv.signatures[0].sites
    summary = inv.summary(max_ops=3, max_modules=1)
    assert summary["distinct_ops"] == len(inv.op_names()) and len(summary["ops"]) == 3 and summary["ops_truncated"]
    assert all(len(o["modules"]) <= 1 for o in summary["ops"])
    assert summary["total_calls"] == inv.total_calls == sum(s.count for s in inv.signatures)
    assert len(json.dumps(inv.summary())) < 20000


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w
        if x.sum().item() > 0:  # needs real data: no tracer can decide it on a meta model
            return x * 2
        return x


def test_untraceable_model_gives_the_error_and_where_it_happened() -> None:
    with torch.device("meta"):
        model = DataDependent()
    with pytest.raises(InventoryError) as info:
        take_inventory(model, (torch.ones(3),), level="aten")
    text = str(info.value)
    assert "dynamo+aot_autograd capture failed" in text and "torch.export failed" in text
    assert "test_inventory.py" in text  # the model line, not a torch internal
    assert "Traceback" not in text


def test_unknown_level_is_rejected() -> None:
    with pytest.raises(InventoryError, match="unknown IR level"):
        take_inventory(_meta_tiny(), (IDS,), level="tosa")


class _Checked(nn.Module):
    """A runtime check as transformers writes it (`torch_compilable_check` → `torch._check_tensor_all`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._check_tensor_all((x > -1e9).all())
        return x.relu()


def test_runtime_checks_are_not_probed_at_graph_level_but_are_on_an_eager_device() -> None:
    """Dynamo runs `_check_tensor_all`'s ops in eager at a graph break, so a compiler never sees them (a one-op probe
    of `aten._is_all_true` was a false alarm on IREE); an eager device does run them."""
    x = torch.randn(4)
    aten = {s.op for s in take_inventory(_Checked(), (x,), level="aten", device="cpu").signatures}
    assert "aten.relu.default" in aten
    assert not aten & {"aten._is_all_true.default", "aten._local_scalar_dense.default"}, aten
    eager = {s.op for s in take_inventory(_Checked(), (x,), level="dispatch", device="cpu").signatures}
    assert "aten._is_all_true.default" in eager or "aten._local_scalar_dense.default" in eager, eager


def test_an_error_in_the_model_code_is_not_retried_with_another_tracer() -> None:
    """A plain Python error from the model's own forward fails every tracer the same way: only the first runs."""
    from ci_runner.modes.ops.inventory import InventoryError, take_inventory

    class Broken(torch.nn.Module):
        def forward(self, x: torch.Tensor, grid: torch.Tensor | None = None) -> torch.Tensor:
            return x * grid.shape[0]  # type: ignore[union-attr]  # grid is None: AttributeError in the model's code

    with pytest.raises(InventoryError) as err:
        take_inventory(Broken(), (torch.ones(2),), level="aten")
    assert "AttributeError" in err.value.message and "no other tracer tried" in err.value.message
    assert "torch.export failed" not in err.value.message


class _ImageTokens(nn.Module):
    """transformers' multimodal pattern: a `torch_compilable_check` on the input data before merging features."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        from transformers.utils.import_utils import torch_compilable_check

        mask = ids == 7
        torch_compilable_check(mask.sum() == feats.shape[0], "image tokens and features do not match")
        return self.proj(feats).sum() + mask.float().sum()


def test_transformers_input_checks_do_not_send_the_capture_to_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """On fake tensors the check is a data-dependent `.item()`: with it on, the aot capture failed at its end and
    torch.export traced the model a second time. It is off while tracing, and the caller's setting comes back."""
    from ci_runner.modes.ops.tracefail import TRANSFORMERS_CHECK_ENV

    monkeypatch.delenv(TRANSFORMERS_CHECK_ENV, raising=False)
    ids = torch.tensor([[1, 7, 7, 2]])
    with torch.device("meta"):
        model = _ImageTokens()
    inv = take_inventory(model, (ids.to("meta"), torch.empty(2, 8, device="meta")), level="aten", device="cpu")
    assert inv.method == "aot" and not [n for n in inv.notes if "fallback" in n], inv.notes
    assert "aten.addmm.default" in {s.op for s in inv.signatures}
    assert TRANSFORMERS_CHECK_ENV not in __import__("os").environ


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        out, keep = torch.zeros_like(x), x > 0
        out[keep] = x[keep]  # vits' pattern: after the graph break, `nonzero` runs on fake tensors
        return out


def test_a_fake_tensor_error_is_not_retried_with_torch_export() -> None:
    """`nonzero` on fake tensors fails Dynamo's capture; torch.export runs the same code on the same fake tensors
    (49 of 49 such zoo architectures failed there too, after a second full trace): only the first tracer runs."""
    from ci_runner.modes.ops.inventory import InventoryError

    with torch.device("meta"):
        model = _Routed()
    with pytest.raises(InventoryError) as err:
        take_inventory(model, (torch.empty(6, device="meta"),), level="aten", device="cpu")
    assert "DynamicOutputShapeException" in err.value.message, err.value.message
    assert "same fake tensors" in err.value.message and "torch.export failed" not in err.value.message


class _Mismatched(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.proj(x), x[..., :2]], dim=0)  # widths 4 and 2: fails on any tensors


def test_a_fake_tensor_call_error_names_the_ops_own_error() -> None:
    """Dynamo's first line is only "RuntimeError when making fake tensor call"; the op's own words come after it
    and are what the zoo scan's size check reads (zamba2 and unlimited_ocr scan one size up because of them)."""
    from ci_runner.modes.ops.inventory import InventoryError
    from ci_runner.zoo.scan import worth_retrying

    with torch.device("meta"):
        model = _Mismatched()
    with pytest.raises(InventoryError) as err:
        take_inventory(model, (torch.empty(3, 4, device="meta"),), level="aten", device="cpu")
    assert "fake tensor call: RuntimeError: Sizes of tensors must match" in err.value.message, err.value.message
    assert worth_retrying("trace", err.value.message)
