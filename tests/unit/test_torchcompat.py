"""Feature detection of private or newer torch APIs (`ci_runner.models.torchcompat`).

On a new torch every feature is present, so each test stands in an old torch by replacing the feature's probe, and
checks that the feature then reports `skipped` (or refuses) with "needs torch ≥ X", never an Import/AttributeError.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from ci_runner.models import torchcompat
from ci_runner.config import load_matrix
from ci_runner.errors import EnvironmentSetupError, TorchTooOldError
from ci_runner.models.torchcompat import FEATURES
from tests.fixtures.paths import ROOT

pytestmark = pytest.mark.oldtorch

EXAMPLE = load_matrix(None)


def _absent(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    monkeypatch.setitem(FEATURES, key, replace(FEATURES[key], probe=lambda: False))


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize("key", sorted(FEATURES))
def test_each_probe_agrees_with_the_release_it_names(key: str) -> None:
    """A probe is true exactly on the torch releases ≥ the one its feature says it needs (this torch, at least)."""
    f = FEATURES[key]
    assert torchcompat.available(key) == (_release(torch.__version__) >= _release(f.needs)), (key, torch.__version__)


def test_the_declared_oldest_torch_is_what_pyproject_requires() -> None:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert f'"torch>={torchcompat.OLDEST_TORCH}"' in text
    assert _release(torch.__version__) >= _release(torchcompat.OLDEST_TORCH)


def test_require_raises_a_setup_error_naming_the_release(monkeypatch: pytest.MonkeyPatch) -> None:
    torchcompat.require("cia_ops")  # present: no error
    _absent(monkeypatch, "cia_ops")
    with pytest.raises(TorchTooOldError) as info:
        torchcompat.require("cia_ops")
    assert isinstance(info.value, EnvironmentSetupError) and info.value.needs == "2.6"
    assert "needs torch \u2265 2.6" in info.value.message and torch.__version__ in info.value.message
    assert "torch._export.utils._collect_all_valid_cia_ops" in info.value.message
    assert "install torch>=2.6" in str(info.value)


def test_dynamo_keys_fall_back_to_their_names_before_2_7(monkeypatch: pytest.MonkeyPatch) -> None:
    from ci_runner.modes.numerics.settings import DYNAMO_SETTINGS, dynamo_settings

    assert dynamo_settings() == dict(DYNAMO_SETTINGS)
    _absent(monkeypatch, "recompile_limit")
    old = dynamo_settings()
    assert old == {"cache_size_limit": 1024, "accumulated_cache_size_limit": 1 << 16, "fail_on_cache_limit_hit": True,
                   "automatic_dynamic_shapes": False}  # not renamed: passed through
    with torch._dynamo.config.patch(**old):  # the old names are real keys (aliases on this torch)
        assert torch._dynamo.config.cache_size_limit == 1024


def test_simdev_cell_on_a_torch_without_python_devices_is_skipped_with_the_release_it_needs(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ci_runner.run.cellrun import run_cell_inprocess
    from ci_runner.matrix import expand, select

    _absent(monkeypatch, "simdev")
    (cell,) = select(expand(EXAMPLE), ["tiny-llama@simdev"])
    result = run_cell_inprocess(cell, tmp_path, modes=("ops", "layers"), deadline=time.monotonic() + 300)
    assert result.status == "skipped" and set(result.modes) == {"ops", "layers"} and result.error is None
    for mode in result.modes.values():
        assert mode.status == "skipped"
        assert mode.reason.startswith("backend setup: simdev (a PrivateUse1 device registered from Python) needs "
                                      "torch \u2265 2.10 (installed: torch ")


def test_simdev_is_not_offered_as_a_device_without_the_api(monkeypatch: pytest.MonkeyPatch) -> None:
    from ci_runner.backends import available_backends, available_devices
    from ci_runner.sim import simdev

    _absent(monkeypatch, "simdev")
    assert not simdev.supported()
    if not simdev.is_registered():  # once registered (an earlier test in this process), the device does exist
        assert "simdev" not in available_devices()
    (entry,) = [b for b in available_backends() if b["name"] == "simdev"]
    assert "unavailable here: simdev (a PrivateUse1 device registered from Python) needs torch \u2265 2.10" \
        in entry["description"]
    with pytest.raises(TorchTooOldError):
        simdev.register()


def test_a_mode_that_needs_a_newer_torch_is_skipped_and_the_next_mode_runs(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A TorchTooOldError out of a mode makes that mode `skipped` (not `error`); the cell goes on."""
    import ci_runner.run.cellrun as cellrun
    from ci_runner.matrix import expand, select
    from ci_runner.results.model import ModeResult

    def needs_new(ctx):  # type: ignore[no-untyped-def]
        torchcompat.require("cia_ops")
        return ModeResult(status="pass")

    _absent(monkeypatch, "cia_ops")
    monkeypatch.setattr(cellrun, "get_mode", lambda name: needs_new)
    (cell,) = select(expand(EXAMPLE), ["tiny-llama@sim-subset"])
    result = cellrun.run_cell_inprocess(cell, tmp_path, modes=("ops", "layers"), deadline=time.monotonic() + 300)
    assert {n: m.status for n, m in result.modes.items()} == {"ops": "skipped", "layers": "skipped"}
    assert "needs torch \u2265 2.6" in result.modes["ops"].reason
    monkeypatch.setitem(FEATURES, "cia_ops", replace(FEATURES["cia_ops"], probe=lambda: True))
    result = cellrun.run_cell_inprocess(cell, tmp_path / "again", modes=("ops",), deadline=time.monotonic() + 300)
    assert result.modes["ops"].status == "pass"


def test_the_export_inventory_at_aten_level_needs_the_cia_list(monkeypatch: pytest.MonkeyPatch) -> None:
    from ci_runner.modes.ops.inventory import cia_decompositions, trace_export

    model, x = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()), torch.randn(2, 4)
    assert cia_decompositions()
    _absent(monkeypatch, "cia_ops")
    with pytest.raises(TorchTooOldError, match="needs torch ≥ 2.6"):
        trace_export(model, (x,), {}, level="aten")
    assert trace_export(model, (x,), {}, level="core_aten").op_names()  # does not need it


def test_compiler_bisect_is_skipped_with_the_release_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from ci_runner.backends import resolve_backend
    from ci_runner.config import BackendSpec
    from ci_runner.modes.numerics.bisect import bisect_cell, compiler_bisect

    _absent(monkeypatch, "compiler_bisector")
    layer = SimpleNamespace(name="norm", done=0, key="norm", module_class="RMSNorm", call_index=0, threshold={},
                            flagged=lambda view: view == "isolated")
    ctx = SimpleNamespace(backend=resolve_backend(BackendSpec(id="inductor", compile="inductor")))
    res = bisect_cell(ctx, layers=[layer], verdict={}, method="auto")  # type: ignore[arg-type]
    assert res is not None and res["status"] == "skipped" and res["summary"] is None and res["layer"] == "norm"
    assert res["reason"].startswith("the compiler bisect (numerics bisect_method: compiler) needs torch \u2265 2.6")
    with pytest.raises(TorchTooOldError):
        compiler_bisect(torch.nn.Linear(2, 2), (torch.ones(1, 2),), {}, threshold={"rel": 1e-6})
