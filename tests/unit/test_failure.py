"""The one failure classifier (`ci_runner/failures/failure.py`): stage, unwrap, words, raising frame; and
the repro scripts embed the same functions."""

from __future__ import annotations

import pytest
import torch

from ci_runner.failures import failure
from ci_runner.engine.repro import FAILURE_SOURCE
from ci_runner.results.rootcause import raised_in


def _guard_like(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> None:
    raise IndexError("list index out of range")  # a compiler error Dynamo wraps in BackendCompilerFailed


def test_backend_compiler_error_is_compile_and_unwrapped(fresh_dynamo: None) -> None:
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: x.neg(), backend=_guard_like)(torch.randn(3))
    f = failure.classify(info.value)
    assert f.stage == "compile" and f.error_type == "IndexError"
    assert failure.first_line(f.message) == "list index out of range"
    assert failure.is_compile_stage(info.value)
    # the traceback is the backend's own error's: its innermost frame is the raiser, here this test file
    where = raised_in(f.traceback)
    assert where.frame.endswith("in _guard_like"), where


def test_dynamo_trace_error_is_trace_and_a_run_error_is_run(fresh_dynamo: None) -> None:
    from torch._dynamo.exc import Unsupported

    exc = Unsupported("graph break")
    assert failure.stage_of(exc) == "trace" and failure.is_compile_stage(exc)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x[torch.tensor([5])]  # indexes past the end when it runs

    with pytest.raises(Exception) as info:
        torch.compile(fn, backend="eager")(torch.randn(3))
    assert failure.stage_of(info.value) == "run" and not failure.is_compile_stage(info.value)


def test_unwrap_follows_dynamo_causes_only() -> None:
    from torch._dynamo.exc import InternalTorchDynamoError

    inner = KeyError("k")
    wrapped = InternalTorchDynamoError("wrapper")
    wrapped.__cause__ = inner
    assert failure.unwrap(wrapped) is inner
    plain = RuntimeError("outer")
    plain.__cause__ = inner
    assert failure.unwrap(plain) is plain  # not Dynamo's wrapper: the error itself


def test_words() -> None:
    assert failure.first_line("\n  \n  first  \nsecond", 3) == "fir"
    assert failure.headline("backend='x' raised:\nIndexError: boom") == "backend='x' raised: IndexError: boom"
    assert failure.headline("a" * 20, 10) == "a" * 9 + "…"
    assert failure.error_text(ValueError()) == "ValueError"


def test_repro_scripts_embed_the_classifier_itself() -> None:
    namespace: dict[str, object] = {}
    exec(compile(FAILURE_SOURCE, "<repro>", "exec"), namespace)  # standalone: no ci_runner import
    assert {"unwrap", "stage_of", "compile_frames_in"} <= set(namespace)
    from torch._dynamo.exc import Unsupported

    assert namespace["stage_of"](Unsupported("x")) == "trace"  # type: ignore[operator]
    assert "ci_runner" not in FAILURE_SOURCE


def test_tail_keeps_the_end_marked_or_with_its_head_line() -> None:
    """The one text tail (a step's log, a probe's traceback): a short text whole, a long one cut at the front."""
    text = "Timeout (0:00:03)!\n" + "".join(f"frame {i}\n" for i in range(100))
    assert failure.tail("short", 10) == "short" and failure.tail(text, len(text)) == text
    assert failure.tail(text, 20) == text[-20:]
    assert failure.tail(text, 20, marked=True) == "…" + text[-20:]
    kept = failure.tail(text, 60, keep_head=True)
    assert kept.startswith("Timeout (0:00:03)!\n…\n") and kept.endswith("frame 99\n") and len(kept) == 60
