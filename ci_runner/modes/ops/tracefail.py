"""What a tracer's failure tells the inventory: where in the model's source it failed, a one-line summary, and
whether another tracer could do better (`inventory.take_inventory` tries them in turn)."""

from __future__ import annotations

import contextlib
import os
import re
import traceback
from pathlib import Path
from typing import Iterator

import torch

from ...failures.failure import first_line

# frames inside deepview-ci itself are not the model's source (this file lies in ci_runner/modes/ops/)
PACKAGE_DIR = str(Path(__file__).parents[2])


def short_path(path: str) -> str:
    """A path without the machine-specific prefix: after site-packages/, else relative to cwd, else as is."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def where_failed(exc: BaseException) -> str:
    """The innermost frame of a traceback outside torch: `file.py:123 in fn`, or the innermost at all."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = str(Path(torch.__file__).parent)
    mine = PACKAGE_DIR
    for fr in reversed(frames):
        if not fr.filename.startswith(torch_dir) and not fr.filename.startswith(mine):
            return f"{short_path(fr.filename)}:{fr.lineno} in {fr.name}"
    if frames:
        fr = frames[-1]
        return f"{short_path(fr.filename)}:{fr.lineno} in {fr.name}"
    return "unknown location"


MODEL_CODE_ERRORS = (AttributeError, TypeError, KeyError, ValueError, IndexError, NameError)
# transformers' switch for its `torch_compilable_check` input checks (see `transformers_checks_off`)
TRANSFORMERS_CHECK_ENV = "TRANSFORMERS_DISABLE_TORCH_CHECK"


@contextlib.contextmanager
def transformers_checks_off() -> Iterator[None]:
    """Turn off transformers' `torch_compilable_check` while tracing (its documented switch, restored after).

    Those checks test the input *data* (e.g. image tokens vs image features) with `torch._check_tensor_all`,
    which on fake tensors is a data-dependent `.item()`: the aot capture failed at the end of the whole model
    and torch.export traced it again (16 architectures of the zoo; d_fine 63 -> 23 CPU s, florence2 31 -> 10).
    A check adds no op a backend is given; the inputs are ours and consistent."""
    old = os.environ.get(TRANSFORMERS_CHECK_ENV)
    os.environ[TRANSFORMERS_CHECK_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(TRANSFORMERS_CHECK_ENV, None)
        else:
            os.environ[TRANSFORMERS_CHECK_ENV] = old


def model_code_error(exc: BaseException) -> bool:
    """A plain Python error raised by the model's own code (not by a tracer: Dynamo's and torch's own errors are
    RuntimeErrors): every tracer runs that code with the same inputs and fails the same way, so trying the next one
    only costs time (measured: about half the CPU time of each multimodal architecture the zoo leaves out)."""
    if not isinstance(exc, MODEL_CODE_ERRORS):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and not frames[-1].filename.startswith((str(Path(torch.__file__).parent), PACKAGE_DIR))


_FAKE_CALL_ERROR = re.compile(r"got (\w+(?:Error|Exception))\((.+?)\)\s*$", re.M)


def error_summary(exc: BaseException) -> str:
    """The error's first line; for Dynamo's "RuntimeError when making fake tensor call", also the op's own error
    from its explanation (e.g. "Sizes of tensors must match ...": the scan retries a bigger config on size errors)."""
    text = str(exc)
    head = first_line(text, 600)
    inner = _FAKE_CALL_ERROR.search(text) if "fake tensor call" in head else None
    return f"{head}: {inner.group(1)}: {inner.group(2).strip(chr(39) + chr(34))}"[:900] if inner else head


def fake_tensor_error(exc: BaseException) -> bool:
    """An error of the fake tensors themselves (an op's fake kernel raised, or an output shape that depends on
    data): torch.export's non-strict trace runs the same code on the same fake tensors and fails the same way
    (measured on the zoo: 49 of 49 such architectures failed in torch.export too, after a second trace)."""
    from torch._dynamo.exc import TorchRuntimeError
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    return isinstance(exc, (TorchRuntimeError, DynamicOutputShapeException))
