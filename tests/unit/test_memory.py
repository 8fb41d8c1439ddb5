"""The memory mode's parts without a model run: simdev's allocator (`sim/simalloc.py`), the meta meter's values
for data-dependent questions (`modes/memory/meters.py`), the tables (`tables.py`), the options."""

from __future__ import annotations

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
                                                  "working_bytes": 160, "call": "decode step 1", "step": 1}


def test_options() -> None:
    opts = parse_options("memory", {"budget_gb": 64})
    assert opts.budget_gb == 64 and opts.compiled_ratio == 1.5
    with pytest.raises(OptionError, match="budget_gb"):
        parse_options("memory", {"budget_gb": -1})
    with pytest.raises(OptionError, match="compiled_ratio"):
        parse_options("memory", {"compiled_ratio": 0.5})
