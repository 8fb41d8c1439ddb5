"""The memory mode's parts without a model run: simdev's allocator (`sim/simalloc.py`), the meta meter's values
for data-dependent questions (`modes/memory/meters.py`), the tables (`tables.py`), the options."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ci_runner.errors import OptionError
from ci_runner.modes.memory.meters import DispatchMeter
from ci_runner.modes.memory.runs import MeteredRun
from ci_runner.modes.memory.tables import first_over_budget, kv_growth, module_rows
from ci_runner.registry import parse_options
from ci_runner.sim import simalloc, simdev


@pytest.fixture
def device() -> object:
    simdev.register(extra_allow=["rsqrt", "_softmax"])
    yield "simdev"
    simalloc.set_capacity(None)


def test_simdev_allocator_counts_storages_once_and_refuses_past_its_capacity(device: str) -> None:
    base = simalloc.memory_allocated()
    x = torch.ones(256, dtype=torch.float32).to(device)  # 1 KiB
    assert simalloc.memory_allocated() - base == 1024
    v = x.view(16, 16)  # a view: no new bytes
    t = v.t()  # simdev copies a non-contiguous view; a real device would not: not counted
    assert simalloc.memory_allocated() - base == 1024
    simalloc.reset_peak_memory_stats()
    y = x * 2
    assert simalloc.memory_allocated() - base == 2048 and simalloc.max_memory_allocated() - base == 2048
    del y, t, v
    assert simalloc.memory_allocated() - base == 1024
    simalloc.set_capacity(simalloc.memory_allocated() + 512)
    with pytest.raises(torch.OutOfMemoryError, match=r"simdev out of memory\. Tried to allocate 1\.00 KiB \(device capacity"):
        x + 1
    assert simalloc.memory_allocated() - base == 1024  # nothing was kept
    assert simalloc.memory_stats()["num_ooms"] >= 1
    del x
    assert simalloc.memory_allocated() == base


def test_capacity_option_is_checked(device: str) -> None:
    with pytest.raises(ValueError, match="capacity_mb"):
        simdev.register_from_options({"extra_allow": ["rsqrt"], "capacity_mb": -1})
    simdev.register_from_options({"extra_allow": ["rsqrt", "_softmax"], "capacity_mb": 2})
    assert simalloc.capacity() == 2 * 2**20


def test_meta_meter_answers_questions_about_the_inputs_and_refuses_the_rest() -> None:
    meter = DispatchMeter(shadow_numel=1 << 10)
    w = torch.empty(4, 4, device="meta")
    with meter:
        mask = torch.tensor([[1, 1, 0]]).to("meta")  # from the inputs: its values are known
        assert bool((mask == 1).all()) is False and int(mask.sum()) == 2
        y = w @ w  # from the weights: no value
        with pytest.raises(RuntimeError, match="prediction on meta"):
            y.sum().item()
    assert meter.peak() >= 16 * 4  # the product's storage was counted


def _run(rows: list[tuple[str, str, int | None, int, int]], kv: list[int]) -> MeteredRun:
    run = MeteredRun(phase="decode", meter="test")
    run.calls = [{"call": c, "step": s, "kv_bytes": k, "peak_bytes": None, "entry_bytes": None}
                 for (c, s), k in zip(dict.fromkeys((r[0], r[2]) for r in rows), kv)]
    run.rows = [{"call": c, "module": m, "module_class": "M", "step": s, "entry_bytes": e, "peak_bytes": p,
                 "exit_bytes": e} for c, m, s, e, p in rows]
    return run


def test_first_over_budget_is_the_deepest_module_of_the_first_call_over_it() -> None:
    run = _run([("prefill", "model.layers.0", None, 100, 150), ("prefill", "", None, 90, 150),
                ("decode step 1", "model.layers.0.mlp", 1, 100, 260), ("decode step 1", "model.layers.0", 1, 100, 260),
                ("decode step 1", "", 1, 90, 260)], kv=[10, 30])
    assert first_over_budget([run], 200) == {"phase": "decode", "step": 1, "call": "decode step 1",
                                             "module": "model.layers.0.mlp", "module_class": "M", "bytes": 260}
    assert first_over_budget([run], 1000) is None
    assert kv_growth(run) == [20]
    assert module_rows(run)["model.layers.0"] == {"module": "model.layers.0", "module_class": "M", "peak_bytes": 260,
                                                  "working_bytes": 160, "activation_bytes": 0, "temporary_bytes": 160,
                                                  "call": "decode step 1", "step": 1}


def test_options() -> None:
    opts = parse_options("memory", {"budget_gb": 64})
    assert opts.budget_gb == 64 and opts.compiled_ratio == 1.5
    with pytest.raises(OptionError, match="budget_gb"):
        parse_options("memory", {"budget_gb": -1})
    with pytest.raises(OptionError, match="compiled_ratio"):
        parse_options("memory", {"compiled_ratio": 0.5})


def _memory_result(ratio: float | None) -> Any:
    from ci_runner.results.model import CellResult, Finding, ModeResult, Results, fingerprint

    rows = [{"phase": "prefill", "module": f"model.layers.{i}", "module_class": "LlamaDecoderLayer",
             "peak_bytes": 30000 + 1000 * i, "measured_peak_bytes": 30100 + 1000 * i} for i in range(2)]
    findings = [] if ratio is None else [Finding(
        kind="memory_regression", stage="run", module="model.layers.0", phase="prefill", message="needs more",
        metrics={"ratio": ratio}, fingerprint=fingerprint("memory_regression", "memhog", "llama", "prefill",
                                                          "model.layers.0"))]
    mode = ModeResult(status="fail" if findings else "pass", findings=findings,
                      data={"params_bytes": 26976, "peak_bytes": {"prefill": 33840}, "modules": rows,
                            "first_over_budget": None})
    cell = CellResult(id="llama@memhog", model="llama", backend="memhog", status=mode.status, modes={"memory": mode})
    return Results(cells=[cell])


def test_the_per_layer_chart_and_a_regression_over_nights(tmp_path: Any) -> None:
    from ci_runner.report.html import render_html
    from ci_runner.modes.memory.report import memory_chart
    from ci_runner.results.baseline import diff, load_baseline, make_baseline
    from ci_runner.fsutil import atomic_write_json

    night1, night2 = _memory_result(None), _memory_result(5.8)
    chart = memory_chart(night2.cells[0].modes["memory"].data, cell_id="llama@memhog")
    assert chart is not None and 'data-kind="memory-layers"' in chart and "prefill measured" in chart
    assert 'class="chartbox memory"' in render_html(night2)
    atomic_write_json(tmp_path / "baseline.json", make_baseline(night1))
    d = diff(night2, load_baseline(tmp_path / "baseline.json"))
    assert [(e.category, e.kind, e.key) for e in d.entries if e.fingerprint] == \
        [("regressed", "memory_regression", "model.layers.0")]
